"""Per-block activation checkpointing (autocastfx.checkpoint_blocks) and per-block compilation
(autocastfx.compile_blocks) of a module converted with blocks="auto"."""
import copy
import gc
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import one_thread_quiet, run_ranks
from autocastfx.training.recompute import block_names, checkpointed, compiled
from test_blocks import Layer, Stack, ids

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from measure import MemoryTracker, alive_storage_keys, step_memory, tensors_in  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with one_thread_quiet():
        yield


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def converted(layers=8, p=0.1, make=None, dtype=torch.float16):
    """The model (``make()``, or ``Stack(layers, p)``) from seed 0, converted with blocks="auto"."""
    torch.manual_seed(0)
    model = make() if make is not None else Stack(layers=layers, p=p)
    return autocastfx.convert(model, (ids(),), dtype=dtype)


def count_calls(gm):
    """How many times each block's call ran (a checkpointed block's hooks run again in the recompute)."""
    calls = []
    hooks = [b.register_forward_pre_hook(lambda m, a: calls.append(1)) for b in gm.layers]
    return calls, hooks


def train(gm, steps=5, lr=0.1):
    gm.train()
    step = autocastfx.train_step(gm, lm_loss, torch.optim.SGD(gm.parameters(), lr=lr))
    torch.manual_seed(1)  # the dropout masks of every step come from here
    return [step(ids(seed=i), ids(seed=100 + i)).detach().clone() for i in range(steps)]


def weights(gm):
    """Every trainable tensor: the module's parameters, the float32 weights the graphs cast low included."""
    out = {n: p.detach().clone() for n, p in gm.named_parameters()}
    assert all(p.dtype == torch.float32 for p in out.values())
    return out


# ------------------------------------------------------------------------------------------------ (a)
def test_checkpointed_blocks_train_bit_identical_with_dropout():
    """5 SGD steps through autocastfx's step on an 8-block language model with dropout 0.1: the same losses and
    weights, bit for bit, with and without checkpointing; the checkpointed blocks do run twice per step."""
    plain, ck = converted(), converted()
    assert autocastfx.checkpoint_blocks(ck) is ck
    assert block_names(ck) == [f"layers.{i}" for i in range(8)] and all(checkpointed(b) for b in ck.layers)
    assert not any(checkpointed(b) for b in plain.layers)
    runs = {}
    for name, gm in (("plain", plain), ("checkpointed", ck)):
        calls, hooks = count_calls(gm)
        runs[name] = (train(gm), weights(gm), len(calls))
        for h in hooks:
            h.remove()
    (la, wa, ca), (lb, wb, cb) = runs["plain"], runs["checkpointed"]
    print(f"losses: {[round(float(v), 4) for v in la]}; block calls in 5 steps: plain {ca}, checkpointed {cb}")
    assert ca == 5 * 8 and cb == 2 * 5 * 8  # forward, then the recompute in backward
    assert all(torch.equal(a, b) for a, b in zip(la, lb)), (la, lb)
    assert set(wa) == set(wb) and len(wa) > 8 * 12
    assert all(torch.equal(wa[n], wb[n]) for n in wa), [n for n in wa if not torch.equal(wa[n], wb[n])]
    # dropout was on: the first loss is a training-mode forward's (with the step's seed), not eval mode's
    x, y, fresh = ids(seed=0), ids(seed=100), converted()
    torch.manual_seed(1)
    assert torch.equal(lm_loss(fresh.train()(x), y), la[0])
    assert not torch.equal(lm_loss(fresh.eval()(x), y), la[0])


# ------------------------------------------------------------------------------------------------ (b)
def saved_bytes(gm, x, y):
    """Bytes of the tensors saved for backward during one forward and its loss
    (``torch.autograd.graph.saved_tensors_hooks``), each storage once; and the storages of the blocks' inputs."""
    seen, inputs = {}, set()

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.add(a[0].untyped_storage().data_ptr()))
             for b in gm.layers]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(gm(x), y)
    for h in hooks:
        h.remove()
    loss.backward()
    for p in gm.parameters():
        p.grad = None
    return sum(seen.values()), inputs <= set(seen)


def live_bytes(gm, x, y):
    """bench/measure.py's CPU memory account (every storage an aten op returns, alive until freed) over one forward
    and backward: bytes alive when the forward ends, and the most alive at once, beyond what was alive before."""
    gc.collect()
    tracker = MemoryTracker(alive_storage_keys())
    with tracker:
        loss = lm_loss(gm(x), y)
        after_forward = tracker.now
        loss.backward()
    del loss
    for p in gm.parameters():
        p.grad = None
    return after_forward, tracker.peak


def step_activation_peak(gm, x, y):
    """One step of autocastfx's step (SGD, after a warm-up step) under bench/measure.py's step_memory: the peak
    during the step less what is alive between steps (the float32 weights, buffers, scale state)."""
    step = autocastfx.train_step(gm, lm_loss, torch.optim.SGD(gm.parameters(), lr=0.01))
    step(x, y)

    def holders():
        params = list(gm.parameters()) + list(gm.buffers())
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": [], "scaler": list(tensors_in(step.state))}
    acc = step_memory(lambda: step(x, y), holders, alive_storage_keys())
    return acc.peak - acc.between


def test_checkpointing_cuts_saved_activation_bytes_by_more_than_40_percent():
    x, y = ids(batch=8, t=64, seed=1), ids(batch=8, t=64, seed=2)
    figures = {}
    for name in ("plain", "checkpointed"):
        gm = converted(dtype=torch.bfloat16)  # the bytes of float16 (2 a value), on the CPU's fast kernels
        if name == "checkpointed":
            autocastfx.checkpoint_blocks(gm)
        gm.train()
        torch.manual_seed(3)
        saved, inputs_counted = saved_bytes(gm, x, y)
        # the blocks' inputs a checkpoint keeps (it saves them for backward itself) are among the bytes counted
        assert inputs_counted or name == "plain"
        torch.manual_seed(3)
        after_forward, peak = live_bytes(gm, x, y)
        torch.manual_seed(3)
        figures[name] = (saved, after_forward, peak, step_activation_peak(gm, x, y))
    labels = ("saved for backward (saved_tensors_hooks)", "alive when the forward ends (memory account)",
              "peak during forward+backward (memory account)", "peak in a train_step less between-step bytes")
    print("\n8-block Stack(p=0.1), batch 8 x 64 tokens, d 32, bfloat16:")
    for i, label in enumerate(labels):
        a, b = figures["plain"][i], figures["checkpointed"][i]
        print(f"  {label}: plain {a:,} B, checkpointed {b:,} B, {1 - b / a:.1%} less")
        assert b <= 0.6 * a, (label, a, b)


# ------------------------------------------------------------------------------------------------ (c)
class FunctionalDrop(Layer):
    """Dropout written F.dropout(x, p, self.training): the converted block switches its graph per mode."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(a), 0.2, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.2, self.training)


class FunctionalStack(Stack):
    def __init__(self, layers=3):
        super().__init__(layers=layers)
        self.layers = nn.ModuleList(FunctionalDrop() for _ in range(layers))


@pytest.mark.parametrize("model", ["Stack", "FunctionalStack"])
def test_modes_deepcopy_and_state_dict_of_checkpointed_blocks(model):
    make = (lambda: Stack(layers=3, p=0.2)) if model == "Stack" else FunctionalStack
    ref, gm = converted(make=make), converted(make=make)
    autocastfx.checkpoint_blocks(gm)
    from autocastfx.core.modes import mode_nodes
    assert bool(mode_nodes(gm.layers[0])) is (model == "FunctionalStack")  # flags in the graph, or nn.Dropout
    x, y = ids(seed=5), ids(seed=6)
    for mode in (False, True, False):  # switched back and forth (a converted block recompiles its own graph)
        ref.train(mode)
        gm.train(mode)
        assert all(b.training is mode and checkpointed(b) for b in gm.layers)
        torch.manual_seed(7)
        a = ref(x)
        torch.manual_seed(7)
        b = gm(x)
        assert torch.equal(a, b)
        torch.manual_seed(8)
        assert torch.equal(gm(x), b) is (not mode)  # dropout in training mode only
    gm.train()
    ref.train()
    # a deep copy is checkpointed too, with weights of its own, and trains as the original does
    twin = copy.deepcopy(gm)
    assert all(checkpointed(b) for b in twin.layers) and isinstance(twin.layers, nn.ModuleList)
    assert {p.data_ptr() for p in twin.parameters()}.isdisjoint(p.data_ptr() for p in gm.parameters())
    calls, _ = count_calls(twin)
    la, lb = train(twin, steps=2), train(ref, steps=2)
    assert len(calls) == 2 * 2 * 3 and all(torch.equal(a, b) for a, b in zip(la, lb))
    # state_dict: the same keys and values as the module's without checkpointing; loads back
    sd, sr = gm.state_dict(), converted(make=make).state_dict()
    assert list(sd) == list(sr) and all(torch.equal(sd[k], sr[k]) for k in sd)
    gm.load_state_dict(twin.state_dict())
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in gm.state_dict().items())
    with torch.no_grad():  # no checkpoint where no graph is recorded
        calls, _ = count_calls(gm)
        gm(x)
        assert len(calls) == 3


def test_undo_some_blocks_by_name_and_refusals():
    gm = converted(layers=3)
    kinds = [type(b).__mro__[1] for b in gm.layers]
    autocastfx.checkpoint_blocks(gm, ["layers.1"])
    assert [checkpointed(b) for b in gm.layers] == [False, True, False]
    autocastfx.checkpoint_blocks(gm)
    autocastfx.checkpoint_blocks(gm)  # again: nothing more
    assert all(checkpointed(b) for b in gm.layers)
    assert all(type(b).__mro__[1].__name__.startswith("Recomputed") for b in gm.layers)
    autocastfx.checkpoint_blocks(gm, ["layers.0"], enabled=False)
    assert [checkpointed(b) for b in gm.layers] == [False, True, True]
    assert autocastfx.checkpoint_blocks(gm, enabled=False) is gm
    assert not any(checkpointed(b) for b in gm.layers) and [type(b).__mro__[1] for b in gm.layers] == kinds
    calls, _ = count_calls(gm)
    train(gm, steps=1)
    assert len(calls) == 3  # each block once again: no recompute
    with pytest.raises(ValueError, match=r'no converted blocks.*blocks="auto"'):
        autocastfx.checkpoint_blocks(autocastfx.convert(Stack(layers=2), (ids(),), blocks=None))
    with pytest.raises(ValueError, match=r'no converted blocks.*blocks="auto"'):
        autocastfx.compile_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not submodules"):
        autocastfx.checkpoint_blocks(gm, ["layers.9"])
    assert not any(checkpointed(b) for b in gm.layers)  # a refusal changes nothing


def _fsdp_run(ck):
    torch.manual_seed(0)
    gm = autocastfx.convert(Stack(layers=3, p=0.1), (ids(),))
    if ck:
        autocastfx.checkpoint_blocks(gm)
    autocastfx.shard(gm)  # fully_shard of each block, after checkpointing
    assert all(checkpointed(b) == ck for b in gm.layers)
    calls = []
    for b in gm.layers:
        b.register_forward_pre_hook(lambda m, a: calls.append(1))
    step = autocastfx.train_step(gm, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
                                 torch.optim.SGD(gm.parameters(), lr=0.1))
    torch.manual_seed(1)
    losses = [step(ids(seed=i), ids(seed=100 + i)).clone() for i in range(3)]
    return gm, losses, [p.full_tensor().clone() for p in gm.parameters()], len(calls)


def _fsdp_rank(rank, init_file):
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        _, la, wa, ca = _fsdp_run(False)
        _, lb, wb, cb = _fsdp_run(True)
        assert (ca, cb) == (9, 18), (ca, cb)
        if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
            assert all(torch.equal(a, b) for a, b in zip(la, lb)), (la, lb)
            assert all(torch.equal(a, b) for a, b in zip(wa, wb))
        else:  # torch 2.11's FSDP2: a float16 ulp apart (the test's docstring)
            assert all(abs(float(a - b)) < 5e-4 for a, b in zip(la, lb)), (la, lb)
            assert all(float((a - b).abs().max()) < 1e-4 for a, b in zip(wa, wb))
        with pytest.raises(ValueError, match="before sharding"):
            autocastfx.checkpoint_blocks(autocastfx.shard(autocastfx.convert(Stack(layers=2), (ids(),))))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_fsdp2_shards_checkpointed_blocks_and_trains_bit_identical(tmp_path):
    """shard() (FSDP2's fully_shard of each block) after checkpoint_blocks, one gloo rank in a process of its own:
    the same losses and weights as the sharded module without checkpointing; checkpointing after shard() is
    refused.

    Bit for bit on torch 2.13 and newer. torch 2.11's FSDP2 gives a checkpointed block's float16 weight gradients
    one float16 ulp apart (measured there: at most 3.05e-5 on gradients up to 0.06, each as close to the float32
    model's gradients as without checkpointing; losses after 3 SGD steps 1.1e-4 apart, weights 2.5e-5): there the
    run is compared within those bounds (torch 2.12 was not measured, and is held to them too). Unsharded,
    checkpointing is bit for bit on both (``test_checkpointed_blocks_train_bit_identical_with_dropout``)."""
    run_ranks(_fsdp_rank, (str(tmp_path / "init"),), 1)


# ------------------------------------------------------------------------------------------------ (d)
def test_compile_blocks_gives_the_same_outputs_and_trains():
    """Each block compiled on its own (block.compile(), as TorchTitan does), backend aot_eager (Dynamo and
    AOTAutograd without Inductor's C++ code generation, which takes about a minute for these two blocks on this
    2-core CPU; Inductor gave outputs within 2e-3 of eager, float16 rounding): the same outputs as the
    uncompiled tree; it trains through autocastfx's step, checkpointed too."""
    ref, gm = converted(layers=2), converted(layers=2)
    assert autocastfx.compile_blocks(gm, backend="aot_eager") is gm
    assert all(compiled(b) for b in gm.layers) and not compiled(gm)
    x = ids(seed=3)
    ref.eval()
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(x), ref(x))
    la, lb = train(ref, steps=3), train(gm, steps=3)
    print(f"losses eager {[round(float(v), 5) for v in la]}, blocks compiled {[round(float(v), 5) for v in lb]}")
    assert torch.equal(la[0], lb[0])  # the same forward; later steps within float16 rounding of the eager run
    torch.testing.assert_close(torch.stack(lb), torch.stack(la), rtol=1e-3, atol=0)
    # compiled and checkpointed: the compiled code runs inside the checkpoint and again in the recompute
    autocastfx.checkpoint_blocks(gm)
    calls, _ = count_calls(gm)
    assert all(torch.isfinite(v) for v in train(gm, steps=2)) and len(calls) == 2 * 2 * 2


def test_scoreboard_row_compile_per_block_builds_on_the_cpu():
    """bench/gpu.py's "autocastfx compile per block" row (GPU workloads only) builds and steps here, dry."""
    import gpu
    assert "fx-block-compile" in gpu.RECIPES and "fx-block-compile" in gpu.COMPILED
    assert {w.key for w in gpu.workloads(False) if "fx-block-compile" in w.recipes} == {"vit", "gpt2"}
    assert not any("fx-block-compile" in w.recipes for w in gpu.workloads(True))  # the dry run is unchanged
    w = next(w for w in gpu.workloads(True) if w.key == "gpt2")
    torch.manual_seed(0)
    data = [gpu.batch(w.shape, w.classes, "cpu", s) for s in range(2)]
    built = gpu.build("fx-block-compile", w.make(), w.loss, data[0][0], "cpu", dry=True)
    assert built.note == "1 block compiled, aot_eager backend (dry run)"
    assert [n for n, m in built.module.named_modules() if compiled(m)] == ["blocks.0"]
    assert all(torch.isfinite(built.step(*d)) for d in data)


class _CenteredBlock(nn.Module):
    """Reads a running statistic it also updates (batch-renorm or EMA centering)."""

    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("rm", torch.zeros(d))

    def forward(self, x):
        h = self.fc(x)
        c = h - self.rm
        if self.training:
            with torch.no_grad():
                self.rm.mul_(0.5).add_(0.5 * h.detach().float().mean((0, 1)))
        return x + F.relu(c) ** 2


class _Centered(nn.Module):
    def __init__(self, d=16, block=_CenteredBlock, n=3, pool=True):
        super().__init__()
        self.layers = nn.ModuleList([block(d) for _ in range(n)])
        self.head, self.pool = nn.Linear(d, 3), pool

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean(1) if self.pool else self.head(x)


def plain_and_checkpointed(base: nn.Module, x: torch.Tensor):
    """(model, gm) for a copy of ``base`` converted, then for another copy converted with its blocks checkpointed."""
    for checkpoint in (False, True):
        model = copy.deepcopy(base)
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
        if checkpoint:
            autocastfx.checkpoint_blocks(gm)
            assert all(checkpointed(b) for b in gm.layers)
        yield model, gm


def test_the_recompute_reads_the_buffers_the_forward_read():
    """A block that reads a buffer it updates: the recompute runs on the buffer as the forward read it and
    leaves it as the forward left it (before, it read the updated statistic: gradients 0.3-0.6 off)."""
    torch.manual_seed(0)
    base, x, y = _Centered(), torch.randn(4, 5, 16) + 1, torch.randint(0, 3, (4,))
    runs = []
    for model, gm in plain_and_checkpointed(base, x):
        F.cross_entropy(gm(x).float(), y).backward()
        runs.append(([m.fc.weight.grad for m in model.layers], [m.rm.clone() for m in model.layers]))
    (grads, stats), (grads_ck, stats_ck) = runs
    for a, b in zip(grads, grads_ck):
        assert torch.equal(a, b)
    for a, b in zip(stats, stats_ck):
        assert torch.equal(a, b)


class _CountingBlock(nn.Module):
    """Moves buffers whatever its own mode: a call counter, and a batch norm that may be in training mode."""

    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x + self.bn(self.fc(x)) / self.calls


@pytest.mark.parametrize("frozen", ["block", "block_but_its_batch_norm"])
def test_a_block_in_eval_mode_moves_its_buffers_once_when_checkpointed(frozen):
    """A block set to eval() alone still updates what it updates regardless of its mode (a counter; a batch norm
    set back to train() inside it): checkpointed, its buffers move once a step and its gradients are the
    uncheckpointed ones, bit for bit (before, the recompute moved them again: a counter at 6 after 3 steps, the
    gradients halved)."""
    torch.manual_seed(0)
    base, x, y = _Centered(block=_CountingBlock, n=2, pool=False), torch.randn(8, 16), torch.randint(0, 3, (8,))
    runs = []
    for model, gm in plain_and_checkpointed(base, x):
        gm.train()
        gm.layers[1].eval()
        if frozen == "block_but_its_batch_norm":
            gm.layers[1].bn.train()
        for _ in range(3):
            gm.zero_grad()
            F.cross_entropy(gm(x).float(), y).backward()
        runs.append(({n: p.grad.clone() for n, p in model.named_parameters()},
                     {n: b.clone() for n, b in model.named_buffers()}))
    (grads, bufs), (grads_ck, bufs_ck) = runs
    assert float(bufs["layers.1.calls"]) == 3.0 and float(bufs_ck["layers.1.calls"]) == 3.0
    if frozen == "block_but_its_batch_norm":
        assert int(bufs_ck["layers.1.bn.num_batches_tracked"]) == 3
    for n in grads:
        assert torch.equal(grads[n], grads_ck[n]), n
    for n in bufs:
        assert torch.equal(bufs[n], bufs_ck[n]), n
