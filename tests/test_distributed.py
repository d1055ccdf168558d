"""train_step under DistributedDataParallel: 2 processes, gloo, on the CPU."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autocastfx
from helpers import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

WORLD = 2


def _batch(rank, i, n=4):
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


ACCUMS = (1, 2)


def _worker(rank, init_file, out_dir):
    """Both accumulation counts in one pair of processes (starting them costs more than the steps)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for accum in ACCUMS:
            _run(rank, out_dir, accum)
        dist.barrier()  # no rank leaves while its peer still talks to it (an abort at exit otherwise)
    finally:
        dist.destroy_process_group()


def _run(rank, out_dir, accum):
    from test_step import MLP
    torch.manual_seed(0)
    model = MLP()
    x0, _ = _batch(rank, 0)
    gm = autocastfx.convert(model, (x0,), pad_multiple=1)
    ddp = torch.nn.parallel.DistributedDataParallel(gm)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    step = autocastfx.train_step(ddp, F.cross_entropy, opt, init_scale=1024.0, accum_steps=accum)
    assert "P.all_reduce_max(S.found_inf)" in step.code
    if accum > 1:
        assert "step.parallel.sync(last)" in step.code and "micro-batches per update" in step.code
        assert type(step.parallel.sync(False)).__name__ == type(ddp.no_sync()).__name__
    # rank 0 alone sees an overflow in update 2: every rank must skip it
    p = dict(gm.named_parameters())["fc1.weight"]
    calls = {"n": 0}

    def hook(g):
        calls["n"] += 1
        return g * float("inf") if rank == 0 and calls["n"] == 2 * accum else g
    p.register_hook(hook)
    for i in range(4 * accum):
        step(*_batch(rank, i))
    # DDP all-reduced float32 gradients into the model's own float32 parameters (gm's: no copies beside them)
    assert all(q.dtype == torch.float32 for q in gm.parameters())
    assert all(a is b for a, b in zip(gm.parameters(), model.parameters()))
    torch.save({"masters": [m.detach() for m in autocastfx.master_parameters(gm)],
                "params": {n: q.detach() for n, q in gm.named_parameters()},
                "scale": float(step.stats.scale), "skipped": int(step.stats.skipped),
                "steps": int(step.stats.steps)}, os.path.join(out_dir, f"rank{rank}-{accum}.pt"))


@pytest.fixture(scope="module")
def ranks():
    """What each rank saved, by accumulation count: {accum: [rank 0's, rank 1's]}."""
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_worker, (os.path.join(d, "init"), d), WORLD)
        return {a: [torch.load(os.path.join(d, f"rank{i}-{a}.pt")) for i in range(WORLD)] for a in ACCUMS}


@pytest.mark.parametrize("accum", ACCUMS)
def test_ddp_ranks_agree_on_skips_scale_and_weights(accum, ranks):
    r = ranks[accum]
    assert r[0]["skipped"] == r[1]["skipped"] == 1
    assert r[0]["scale"] == r[1]["scale"] == 512.0
    assert r[0]["steps"] == r[1]["steps"] == 4
    for a, b in zip(r[0]["masters"], r[1]["masters"]):
        assert torch.equal(a, b)
    for n in r[0]["params"]:
        assert torch.equal(r[0]["params"][n], r[1]["params"][n]), n

    # the same run on one process, both ranks' batches at once (DDP averages gradients; so does the mean loss)
    from test_step import MLP
    torch.manual_seed(0)
    model = MLP()
    gm = autocastfx.convert(model, (_batch(0, 0)[0],), pad_multiple=1)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9),
                                 init_scale=1024.0)
    skip = dict(gm.named_parameters())["fc1.weight"]
    calls = {"n": 0}

    def hook(g):
        calls["n"] += 1
        return g * float("inf") if calls["n"] == 2 else g
    skip.register_hook(hook)
    for i in range(4):
        xs, ys = zip(*[_batch(rk, j) for j in range(i * accum, (i + 1) * accum) for rk in range(WORLD)])
        step(torch.cat(xs), torch.cat(ys))
    assert len(r[0]["masters"]) == len(autocastfx.master_parameters(gm)) == 4  # the weights the graph casts low
    for a, b in zip(r[0]["masters"], autocastfx.master_parameters(gm)):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-4)
    for n, q in gm.named_parameters():
        torch.testing.assert_close(r[0]["params"][n], q.detach(), rtol=5e-3, atol=5e-4, msg=n)
