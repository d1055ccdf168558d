"""Plain torch wrappers around a converted module, with the user's own optimizer and no autocastfx helper:
DistributedDataParallel(gm) and fully_shard on gm's blocks and root train as one process does (2 gloo ranks on the
CPU), and FSDP2's MixedPrecisionPolicy composes where the graph reads every gathered weight low, else is refused
with an error that names the fix. The two processes are started once and run every scenario."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

WORLD, STEPS, LR = 2, 4, 0.1
TOL = 1e-3  # bfloat16 rounding of the per-rank gradients, summed in another order


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()


class Net(nn.Module):
    """Blocks in a ModuleList (converted as modules of their own), a float32-read norm at the root."""

    def __init__(self, d=16, classes=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.layers:
            x = b(x)
        return self.head(self.norm(x))


def _batch(rank, i, n=4):
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _train(module, params, batches):
    """The user's loop: SGD with momentum over ``params`` (an update linear in the gradient, so data-parallel
    and one-process runs differ by rounding only), clip_grad_norm_, step, zero_grad; the losses."""
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _converted():
    torch.manual_seed(0)
    return autocastfx.convert(Net(), (_batch(0, 0)[0],), dtype=torch.bfloat16, pad_multiple=1)


def _full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _worker(rank, init_file, out_dir):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    try:
        batches = [_batch(rank, i) for i in range(STEPS)]
        gm = _converted()  # DDP, the user's optimizer over gm.parameters()
        ddp = nn.parallel.DistributedDataParallel(gm)
        out["ddp"] = (_train(ddp, list(gm.parameters()), batches), _full(gm.state_dict()))

        gm = _converted()  # fully_shard on the blocks, then the root (float32 gathers)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (WORLD,))
        for block in gm.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(gm, mesh=mesh)
        out["fsdp"] = (_train(gm, list(gm.parameters()), batches), _full(gm.state_dict()))

        gm = _converted()  # a low param_dtype over the root, whose norm the graph reads in float32: refused
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in gm.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(gm, mesh=mesh, mp_policy=bf16)
        try:
            gm(batches[0][0])
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)

        gm = _converted()  # param_dtype=None with float32 reduction composes
        fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
        for block in gm.layers:
            fully_shard(block, mesh=mesh, mp_policy=fp32)
        fully_shard(gm, mesh=mesh, mp_policy=fp32)
        out["fsdp_fp32_policy"] = (_train(gm, list(gm.parameters()), batches), _full(gm.state_dict()))

        from torch.distributed.fsdp import FullyShardedDataParallel
        try:  # FSDP1 with its views as new parameters on each module the graph reads: refused, naming FSDP2
            FullyShardedDataParallel(_converted(), use_orig_params=True, device_id=torch.device("cpu"))
            out["fsdp1"] = None
        except ValueError as e:
            out["fsdp1"] = str(e)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_worker, (os.path.join(d, "init"), d), WORLD)
        yield [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process():
    """The same loop in one process over both ranks' batches at once: what data parallelism must reproduce."""
    gm = _converted()
    batches = [tuple(torch.cat(t) for t in zip(*(_batch(r, i) for r in range(WORLD)))) for i in range(STEPS)]
    return _train(gm, list(gm.parameters()), batches), _full(gm.state_dict())


@pytest.mark.parametrize("scenario", ["ddp", "fsdp", "fsdp_fp32_policy"])
def test_plain_wrappers_train_like_one_process(ranks, one_process, scenario):
    """DDP(gm) and fully_shard over gm's blocks and root, driven by the user's own optimizer and clip_grad_norm_:
    every rank ends with the one-process weights (float32, the model's names) and the mean of the ranks' losses
    follows the one-process loss; training moved the weights well beyond that tolerance."""
    ref_losses, ref_state = one_process
    start = _converted().state_dict()
    errs = []
    for r in ranks:
        losses, state = r[scenario]
        assert set(state) == set(ref_state)
        for k, v in state.items():
            assert v.dtype == torch.float32
            err = float((v - ref_state[k]).abs().max())
            errs.append(err)
            assert err < TOL, (scenario, k, err)
    moved = max(float((ref_state[k] - start[k]).abs().max()) for k in ref_state)
    print(f"{scenario}: largest difference from one process {max(errs):.2e}, largest move {moved:.2e}")
    assert moved > 20 * TOL
    mean = [sum(r[scenario][0][i] for r in ranks) / WORLD for i in range(STEPS)]
    for a, b in zip(mean, ref_losses):
        assert abs(a - b) < 1e-3 * max(1.0, abs(b)), (mean, ref_losses)


def test_a_low_param_dtype_over_a_float32_read_weight_is_refused_naming_the_fix(ranks):
    """fully_shard(gm, mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16)) would hand the root's LayerNorm a
    rounded weight (the graph reads it in float32 and casts the linears' weights itself): refused at the first
    call, naming the parameter and both ways out."""
    for r in ranks:
        msg = r["refused"]
        assert msg is not None
        assert "norm.weight" in msg and "param_dtype=None" in msg and "autocastfx.shard" in msg


def test_fsdp1_with_its_original_parameters_is_refused_naming_fsdp2(ranks):
    """FSDP1 with ``use_orig_params=True`` sets views of its flat parameter as new parameters on each module: it was
    refused with the message for torch's pruning and weight_norm, which named neither FSDP1 nor the fix."""
    for out in ranks:
        assert out["fsdp1"] is not None and "FullyShardedDataParallel (FSDP1)" in out["fsdp1"]
        assert "fully_shard" in out["fsdp1"]
