"""CudaGraphStep: autocastfx's step captured and replayed as CUDA graphs.

CPU tier: every refusal that needs no GPU, the optimizer's transformation (capturable, a device lr that LR
schedulers fill in place), the settings guard, the signature check, the capture schedule, loading into the
tensors a graph holds; and the whole graph step against the eager step with CUDA graphs emulated on the CPU
(``fake_cuda``, below). GPU tier (marked ``gpu``, skipped without CUDA): the graph step against the eager step
on real graphs, with what the emulation leaves out (the shared memory pool, streams, the pinned flag copy, RNG).
"""
import contextlib
import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autocastfx
from autocastfx.training import graphed
from autocastfx.training.graphed import CudaGraphStep, TensorSpec
from autocastfx.training.scaling import LossScaleError
from helpers import small_if_emulated

LR = 2.0**-7   # exact in float32: the graph's float32 device lr equals the eager step's Python float


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def batch(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=2.0**-6, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=LR, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=LR),
}


def make(opt="adamw", model=None, **kw):
    torch.manual_seed(0)
    gm = autocastfx.convert(model or MLP(), (batch()[0],), pad_multiple=1)
    return gm, autocastfx.train_step(gm, F.cross_entropy, OPTIMIZERS[opt](gm.parameters()), **kw)


def untouched(step):
    """The optimizer as train_step left it: no capturable flag, float lr."""
    return all(not g.get("capturable", False) and isinstance(g["lr"], float) for g in step.optimizer.param_groups)


# -------------------------------------------------------------------------- refusals, before any change
def test_cpu_model_is_refused_before_anything_changes():
    _, step = make()
    with pytest.raises(ValueError, match=r"model is on cpu: a CUDA graph needs .* one CUDA device"):
        CudaGraphStep(step)
    assert untouched(step)


def test_retry_is_refused_with_the_reason():
    _, step = make(on_overflow="retry")
    with pytest.raises(ValueError, match=r"on_overflow='retry' cannot be captured.*host.*on_overflow='skip'"):
        CudaGraphStep(step)
    assert untouched(step)


def test_optimizer_without_a_fused_skip_is_refused():
    _, step = make("rmsprop")   # has capturable=, but no fused kernel taking found_inf
    with pytest.raises(ValueError, match=r"RMSprop cannot run inside a CUDA graph.*found_inf on the host"):
        CudaGraphStep(step)
    assert untouched(step)


def test_ddp_is_refused(tmp_path):
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already running")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        gm = autocastfx.convert(MLP(), (batch()[0],), pad_multiple=1)
        ddp = nn.parallel.DistributedDataParallel(gm)
        step = autocastfx.train_step(ddp, F.cross_entropy, OPTIMIZERS["adamw"](gm.parameters()))
        with pytest.raises(ValueError, match="does not support DistributedDataParallel.*eager step"):
            CudaGraphStep(step)
        assert untouched(step)
    finally:
        dist.destroy_process_group()


def test_bad_arguments():
    _, step = make()
    with pytest.raises(TypeError, match="wraps the step autocastfx.train_step"):
        CudaGraphStep(step.gm)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="warmup must be an int >= 1"):
            CudaGraphStep(step, warmup=bad)
    assert untouched(step)


# ------------------------------------------------------------------- the optimizer's transformation
@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd"])
def test_make_capturable_sets_the_flag_and_a_device_lr(opt):
    _, step = make(opt)
    o = step.optimizer
    graphed.make_capturable(o, "cpu")
    lr = o.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.dtype == torch.float32 and lr.dim() == 0 and lr.device.type == "cpu"
    assert lr.item() == LR
    if opt == "sgd":
        assert "capturable" not in o.param_groups[0]   # SGD has no such option: its fused kernel keeps no host state
    else:
        assert o.param_groups[0]["capturable"] is True and o.defaults["capturable"] is True
    graphed.make_capturable(o, "cpu")
    assert o.param_groups[0]["lr"] is lr, "a second call must keep the tensor a graph may hold"


def test_make_capturable_rounds_lr_to_float32_and_refuses_a_vector():
    o = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3)
    graphed.make_capturable(o, "cpu")
    assert o.param_groups[0]["lr"].item() == torch.tensor(1e-3, dtype=torch.float32).item()
    o.param_groups[0]["lr"] = torch.ones(2)
    with pytest.raises(ValueError, match="one value"):
        graphed.make_capturable(o, "cpu")


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("built", ["before", "after"])
def test_schedulers_fill_the_same_lr_tensor(built):
    _, step = make("adamw")
    o = step.optimizer
    if built == "before":   # a scheduler built before the transformation holds float base lrs
        sched = torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (e + 1))
        graphed.make_capturable(o, "cpu")
        expect = [LR / 2, LR / 3]
    else:
        graphed.make_capturable(o, "cpu")
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        expect = [LR / 2, LR / 4]
    lr = o.param_groups[0]["lr"]
    for value in expect:
        sched.step()
        assert o.param_groups[0]["lr"] is lr, "the scheduler replaced the tensor a graph reads"
        assert lr.item() == torch.tensor(value, dtype=torch.float32).item()


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_transformed_optimizer_steps_bit_identically_under_a_scheduler(opt):
    """The device lr is what the fused kernel reads: a scheduler's halving reaches the update exactly."""
    runs = []
    for transform in (False, True):
        gm, step = make(opt)
        if transform:
            graphed.make_capturable(step.optimizer, "cpu")
        sched = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1, gamma=0.5)
        for i in range(4):
            step(*batch(i))
            sched.step()
        runs.append([p.detach().clone() for p in list(gm.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # and the schedule matters: without it the weights differ
    gm, step = make(opt)
    graphed.make_capturable(step.optimizer, "cpu")
    for i in range(4):
        step(*batch(i))
    assert not all(torch.equal(a, b) for a, b in zip(runs[1], list(gm.parameters())))


def test_settings_a_replay_reads_follow_and_baked_ones_are_guarded():
    _, step = make("sgd")
    o = step.optimizer
    graphed.make_capturable(o, "cpu")
    lrs, baked = [g["lr"] for g in o.param_groups], graphed.baked_settings(o)
    o.param_groups[0]["lr"] = 0.125                     # replaced by a float: the captured tensor takes the value
    graphed.follow_optimizer_settings(o, lrs, baked)
    assert o.param_groups[0]["lr"] is lrs[0] and lrs[0].item() == 0.125
    o.param_groups[0]["momentum"] = 0.5                 # baked into the graph: refused, with the way out
    with pytest.raises(RuntimeError, match=r"\['momentum'\] changed from 0.9 to 0.5 .*recapture\(\)"):
        graphed.follow_optimizer_settings(o, lrs, baked)
    o.param_groups[0]["momentum"] = 0.9
    o.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(RuntimeError, match="2 parameter groups.*captured with 1.*recapture"):
        graphed.follow_optimizer_settings(o, lrs, baked)


# --------------------------------------------------------------------------------- input signatures
def test_signature_names_and_equal_calls_match():
    ids, mask, y = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), torch.zeros(2, dtype=torch.long)
    sig, leaves = graphed.signature({"ids": ids, "mask": mask, "causal": True}, (y,))
    assert [n for n, _ in sig.leaves] == ["inputs['ids']", "inputs['mask']", "inputs['causal']", "targets[0]"]
    assert sig.leaves[0][1] == TensorSpec((2, 5), torch.long, torch.device("cpu")) and sig.leaves[2][1] is True
    assert leaves[0] is ids and leaves[3] is y
    again, _ = graphed.signature({"ids": ids.clone(), "mask": mask + 1, "causal": True}, (y,))
    assert graphed.mismatch(sig, again) is None


@pytest.mark.parametrize("change, expect", [
    (lambda x, y: ((x[:4],), (y[:4],)), r"inputs\[0\]: captured float32\[8, 16\] on cpu, given float32\[4, 16\]"),
    (lambda x, y: ((x.double(),), (y,)), r"captured float32\[8, 16\] on cpu, given float64\[8, 16\]"),
    (lambda x, y: ((x.to("meta"),), (y,)), r"given float32\[8, 16\] on meta"),
    (lambda x, y: ((x, x), (y,)), r"structure changed: captured \(inputs\[0\], targets\[0\]\), given "
                                  r"\(inputs\[0\], inputs\[1\], targets\[0\]\)"),
    (lambda x, y: ((x,), (y, y)), r"structure changed"),
    (lambda x, y: ((x,), ()), r"structure changed"),
], ids=["shape", "dtype", "device", "more-inputs", "more-targets", "no-target"])
def test_mismatch_says_what_changed_and_the_ways_out(change, expect):
    x, y = batch()
    captured, _ = graphed.signature((x,), (y,))
    why = graphed.mismatch(captured, graphed.signature(*change(x, y))[0])
    assert why is not None and re.search(expect, why), why
    assert "make a CudaGraphStep per shape, or pad batches to one shape, or call recapture()" in why


def test_a_changed_constant_is_a_mismatch():
    x, y = batch()
    captured, _ = graphed.signature((x, 2), (y,))
    assert "captured the constant 2, given 3; a graph bakes Python values in" in \
        graphed.mismatch(captured, graphed.signature((x, 3), (y,))[0])


def test_a_constant_changing_type_is_a_mismatch():
    x, y = batch()
    a, _ = graphed.signature((x, 1), (y,))
    b, _ = graphed.signature((x, True), (y,))   # 1 == True in Python, not to a graph that baked an int
    assert "captured the constant 1, given True" in graphed.mismatch(a, b)


def test_unsupported_argument_types_are_refused():
    x, y = batch()
    with pytest.raises(TypeError, match=r"inputs\[1\] is a object: a CUDA graph step takes tensors"):
        graphed.signature((x, object()), (y,))


def test_inputs_must_be_on_the_models_cuda_device():
    x, y = batch()
    sig, _ = graphed.signature((x,), (y,))
    with pytest.raises(ValueError, match=r"inputs\[0\] is on cpu, the model on cuda:0: a CUDA graph needs"):
        graphed.check_devices(sig, torch.device("cuda", 0))
    graphed.check_devices(sig, torch.device("cpu"))


# ------------------------------------------------------------------------------- capture schedule
def test_capture_schedule():
    assert graphed.positions(1) == [("update", 0)]
    assert graphed.positions(2) == [("first", 0), ("update", 1)]
    assert graphed.positions(4) == [("first", 0), ("middle", 1), ("update", 3)]
    for n in (1, 2, 3, 5):
        kinds = {k for k, _ in graphed.positions(n)}
        assert {graphed.kind_at(p, n) for p in range(n)} == kinds
        assert all(graphed.kind_at(p, n) == k for k, p in graphed.positions(n))
    assert graphed.ready_to_capture(calls=3, micro=0, warmup=3, accum_steps=1)
    assert not graphed.ready_to_capture(calls=2, micro=0, warmup=3, accum_steps=1)
    assert not graphed.ready_to_capture(calls=3, micro=3, warmup=3, accum_steps=4)   # no update yet
    assert not graphed.ready_to_capture(calls=5, micro=5, warmup=3, accum_steps=4)   # inside a cycle
    assert graphed.ready_to_capture(calls=4, micro=4, warmup=3, accum_steps=4)


# ------------------------------------------------------------------------------------- state dicts
def state_tensors(step):
    return [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def test_state_dict_is_a_portable_snapshot():
    _, step = make("adamw")
    graphed.make_capturable(step.optimizer, "cpu")
    step(*batch(0))
    sd = graphed.portable_state_dict(step)
    assert all(isinstance(g["lr"], float) and g["lr"] == LR for g in sd["optimizer"]["param_groups"])
    saved = [t for s in sd["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)]
    live = state_tensors(step)
    assert len(saved) == len(live) and all(a is not b and torch.equal(a, b) for a, b in zip(saved, live))
    step(*batch(1))
    assert not all(torch.equal(a, b) for a, b in zip(saved, state_tensors(step))), "the snapshot must not move"


def test_load_keeps_the_tensors_a_graph_holds_and_resumes_bit_for_bit():
    batches = [batch(i) for i in range(8)]
    gm_ref, ref = make("adamw")
    graphed.make_capturable(ref.optimizer, "cpu")
    for b in batches:
        ref(*b)

    gm_a, a = make("adamw")
    graphed.make_capturable(a.optimizer, "cpu")
    for b in batches[:4]:
        a(*b)
    sd = copy.deepcopy(graphed.portable_state_dict(a))

    gm_b, b_step = make("adamw")                  # trained on other data: its tensors are what a graph would hold
    graphed.make_capturable(b_step.optimizer, "cpu")
    for i in range(3):
        b_step(*batch(100 + i))
    held, lr = state_tensors(b_step), b_step.optimizer.param_groups[0]["lr"]
    assert graphed.load_keeping_tensors(b_step, sd) is True
    assert all(x is y for x, y in zip(held, state_tensors(b_step))) and b_step.optimizer.param_groups[0]["lr"] is lr
    for x in batches[4:]:
        b_step(*x)
    for p, q in zip(gm_ref.parameters(), gm_b.parameters()):
        assert torch.equal(p, q)
    assert float(b_step.stats.scale) == float(ref.stats.scale) and int(b_step.stats.steps) == 8


def test_load_into_an_optimizer_without_state_asks_for_a_new_capture():
    _, a = make("adamw")
    a(*batch(0))
    sd = graphed.portable_state_dict(a)
    _, fresh = make("adamw")
    assert graphed.load_keeping_tensors(fresh, sd) is False      # no tensors to keep: state created by the load
    assert graphed.load_keeping_tensors(fresh, sd) is True       # now there are


def test_load_copies_rather_than_trains_the_callers_dict():
    _, a = make("adamw")
    a(*batch(0))
    sd = graphed.portable_state_dict(a)
    saved = [t.clone() for s in sd["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)]
    _, fresh = make("adamw")
    graphed.load_keeping_tensors(fresh, sd)
    for i in range(2):
        fresh(*batch(i))
    after = [t for s in sd["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)]
    assert all_equal_cpu(saved, after), "training after the load changed the checkpoint it was loaded from"


def all_equal_cpu(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_load_rejects_a_foreign_state_dict_before_changing_anything():
    _, step = make("adamw")
    step(*batch(0))
    before = [t.clone() for t in state_tensors(step)]
    with pytest.raises(KeyError, match="not a train_step state_dict"):
        graphed.load_keeping_tensors(step, {"model": {}})
    assert all(torch.equal(a, b) for a, b in zip(before, state_tensors(step)))


# ================================================================ the graph step, with CUDA graphs emulated
# A capture records device work without running it; a replay runs that work again on the same memory, and no
# Python. On the CPU this is emulated at the aten level: "capture" runs the step's ops once under a dispatch mode,
# remembers each op with the very tensors it read and wrote, and then puts back every tensor that existed before
# (and the RNG), so the capture costs no step, as on a GPU. "replay" runs the remembered ops again and copies
# each fresh result into the tensor the capture produced. Whatever the step decides in Python at capture time
# (the micro-batch branch, the auto-scale branch, which grad_norm tensor it keeps, the training flags in the
# module's code) is thereby baked in as in a real graph, and an op that reads the device from the host raises
# as it would inside a capture.
SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero"}


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs):
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = kwargs.get(a.name) if (a.kwarg_only or a.name in kwargs) else (args[i] if i < len(args) else None)
        yield from (t for t in tree_leaves(value) if torch.is_tensor(t))


class FakeGraph:
    def __init__(self, *args, **kwargs):
        self.ops = []

    def replay(self):
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for kept, fresh in zip(tree_leaves(out), tree_leaves(new)):
                    if torch.is_tensor(kept) and _ptr(kept) != _ptr(fresh):   # a view of kept memory: up to date
                        kept.copy_(fresh)


class _Recording(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph, self.fresh, self.saved = graph, set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._opname in SYNC_OPS:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
        for t in _written(func, args, kwargs):   # a tensor from before the capture: put back afterwards
            if _ptr(t) and _ptr(t) not in self.fresh and _ptr(t) not in self.saved:
                self.saved[_ptr(t)] = (t.untyped_storage(), t.untyped_storage().clone())
        out = func(*args, **kwargs)
        read = {_ptr(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        self.fresh.update(_ptr(t) for t in tree_leaves(out) if torch.is_tensor(t) and _ptr(t) not in read)
        self.graph.ops.append((func, args, kwargs, out))
        return out


@contextlib.contextmanager
def fake_capture(graph, pool=None, stream=None, capture_error_mode="global"):
    rng, mode = torch.get_rng_state(), _Recording(graph)
    try:
        with mode:
            yield
    except Exception:   # as torch.cuda.graph's __exit__: ending a broken capture raises again
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    finally:
        for storage, before in mode.saved.values():
            storage.copy_(before)
        torch.set_rng_state(rng)


class FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """CudaGraphStep on the CPU: torch.cuda's streams, device guards and graphs replaced by the emulation."""
    streams = {"set": []}
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: streams.setdefault("current", FakeStream()))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: streams["set"].append(s))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    refuse = graphed._refuse_what_cannot_be_captured

    def refuse_but_the_device(step):
        try:
            refuse(step)
        except ValueError as e:
            if "a CUDA graph needs every parameter" not in str(e):
                raise
    monkeypatch.setattr(graphed, "_refuse_what_cannot_be_captured", refuse_but_the_device)
    return streams


def cpu_weights(gm, step):
    return [p.detach().clone() for p in list(gm.parameters())]


EMULATED = {
    "adamw": ("adamw", {}),
    "sgd": ("sgd", {}),
    "hysteresis": ("adamw", dict(init_scale=2.0**10, hysteresis=2)),
    "static-scale": ("sgd", dict(loss_scale=2.0**8)),
    "accum3-clip": ("adamw", dict(accum_steps=3, clip_grad_norm=0.25)),
    "accum2-clip": ("sgd", dict(accum_steps=2, clip_grad_norm=0.5)),
}


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("case", list(EMULATED))
def test_emulated_graph_step_equals_the_eager_step(fake_cuda, case):
    """Warm-up, capture, static buffers, replays, accumulation, clipping and a scheduler on a device lr: the same
    bits as the eager step, with no host read inside the captured region (the emulation raises on one)."""
    opt, kw = EMULATED[case]
    (gm_e, eager), (gm_g, step) = make(opt, **kw), make(opt, **kw)
    gstep = CudaGraphStep(step, warmup=3)
    scheds = [torch.optim.lr_scheduler.StepLR(s.optimizer, step_size=4, gamma=0.5) for s in (eager, step)]
    n = step.accum_steps
    for i in range(8 * n):
        assert torch.equal(eager(*batch(i)), gstep(*batch(i))), i
        if (i + 1) % n == 0:
            for s in scheds:
                s.step()
    assert gstep.captures == 1 and gstep.replays >= 4 * n
    assert set(gstep.graphs) == {k for k, _ in graphed.positions(n)}
    assert all(torch.equal(a, b) for a, b in zip(cpu_weights(gm_e, eager), cpu_weights(gm_g, step)))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(eager), state_tensors(step)))
    assert torch.equal(eager.stats.scale, step.stats.scale) and int(step.stats.steps) == 8
    assert (eager.stats.grad_norm is None) == (step.stats.grad_norm is None)
    if step.stats.grad_norm is not None:
        assert torch.equal(eager.stats.grad_norm, step.stats.grad_norm)
    assert step.optimizer.param_groups[0]["lr"].item() == LR / 4


def test_emulated_replays_train(fake_cuda, monkeypatch):
    """The emulation is not vacuous: replays that do nothing part from the eager step."""
    (_, eager), (_, step) = make(), make()
    gstep = CudaGraphStep(step, warmup=2)
    monkeypatch.setattr(FakeGraph, "replay", lambda self: None)
    losses = [(eager(*batch(i)), gstep(*batch(i))) for i in range(4)]
    assert not torch.equal(*losses[-1])


def test_grad_norm_stays_the_update_graphs_after_eager_calls(fake_cuda):
    """A load inside an accumulation cycle runs eager calls to the cycle's end; the eager update's grad_norm goes
    into the tensor the update graph writes, so stats.grad_norm follows the replays after it."""
    kw = dict(accum_steps=3, clip_grad_norm=0.25)
    _, step = make("adamw", **kw)
    gstep = CudaGraphStep(step, warmup=3)
    for i in range(7):
        gstep(*batch(i))
    sd = copy.deepcopy(gstep.state_dict())           # micro-batch 1 of a cycle
    norm = step.stats.grad_norm
    gm_e, eager = make("adamw", **kw)
    eager.load_state_dict(copy.deepcopy(sd))
    gstep.load_state_dict(sd)
    for i in range(7, 16):
        assert torch.equal(eager(*batch(i)), gstep(*batch(i))), i
        assert step.stats.grad_norm is norm, "stats.grad_norm must stay the tensor the update graph writes"
    assert gstep.replays == 4 + 7 and torch.equal(eager.stats.grad_norm, step.stats.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(cpu_weights(gm_e, eager), cpu_weights(step.gm, step)))


def test_capture_waits_for_the_auto_scale(fake_cuda):
    """init_scale="auto" picks the scale in the first update, on a host branch: a state that still has it to do
    drops the graphs and captures after that update, or every replay would jump the scale again."""
    _, step = make("adamw")
    gstep = CudaGraphStep(step, warmup=2)
    for i in range(4):
        gstep(*batch(i))
    sd = copy.deepcopy(gstep.state_dict())
    sd["scaler"]["auto_pending"] = True
    sd["scaler"]["scale"].fill_(1.0)
    gm_e, eager = make("adamw")
    eager(*batch(0))
    eager.load_state_dict(copy.deepcopy(sd))
    gstep.load_state_dict(sd)
    assert gstep.graph is None
    for i in range(4, 10):
        assert torch.equal(eager(*batch(i)), gstep(*batch(i))), i
    assert gstep.captures == 2 and not step.state.auto_pending and gstep.replays == 2 + 5
    assert torch.equal(eager.stats.scale, step.stats.scale) and float(step.stats.scale) > 1.0
    assert all(torch.equal(a, b) for a, b in zip(cpu_weights(gm_e, eager), cpu_weights(step.gm, step)))


def test_a_changed_training_mode_is_refused(fake_cuda):
    gm, step = make("adamw")
    gstep = CudaGraphStep(step, warmup=2)
    for i in range(3):
        gstep(*batch(i))
    w, replays = cpu_weights(gm, step), gstep.replays
    gm.eval()
    with pytest.raises(RuntimeError, match=r"switched to eval mode after capture.*replays the train mode.*"
                                           r"gm\.train\(\).*recapture\(\)"):
        gstep(*batch(3))
    assert gstep.replays == replays and all(torch.equal(a, b) for a, b in zip(w, cpu_weights(gm, step)))
    gm.train()
    gstep(*batch(3))
    assert gstep.replays == replays + 1


def test_a_host_read_in_the_loss_fails_the_capture_with_its_cause(fake_cuda):
    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        return loss * 2 if loss.item() > 100 else loss    # a Python branch on a device value

    torch.manual_seed(0)
    gm = autocastfx.convert(MLP(), (batch()[0],), pad_multiple=1)
    step = autocastfx.train_step(gm, loss_fn, OPTIMIZERS["adamw"](gm.parameters()))
    gstep = CudaGraphStep(step, warmup=2)
    gstep(*batch(0))
    with pytest.raises(RuntimeError, match=r"(?s)capturing the training step in a CUDA graph failed: RuntimeError: "
                                           r"CUDA error: operation not permitted when stream is capturing .*ending the "
                                           r"capture then raised .*previous error during capture.*\.item\(\).*eager"):
        gstep(*batch(1))
    assert gstep.graph is None and int(step.stats.steps) == 2, "the eager call ran; the failed capture did not"
    assert fake_cuda["set"] == [fake_cuda["current"]], "the stream before the capture is restored"
    assert all(p.grad is None for p in step.all_params)


def test_emulated_shape_change_raises_and_recapture_takes_the_new_shape(fake_cuda):
    gm, step = make("adamw")
    gstep = CudaGraphStep(step, warmup=2)
    for i in range(3):
        gstep(*batch(i))
    with pytest.raises(ValueError, match=r"captured float32\[8, 16\] on cpu, given float32\[4, 16\].*recapture"):
        gstep(*batch(3, n=4))
    gstep.recapture()
    gstep(*batch(3, n=4))
    assert gstep.captures == 2 and gstep.static_inputs.shape == (4, 16)
    gstep(*batch(4, n=4))
    assert gstep.replays == 2


# =========================================================================================== GPU tier
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def reproducible():
    """Deterministic cuDNN and the math attention kernel: the eager step then gives the same bits run after run,
    so a graph that runs the same kernels must give them too (flash attention's backward accumulates with
    atomics, in no fixed order)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def flat_ce(out, target):
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


# rows of the GPU tier's batches and example inputs; where that tier runs emulated (below) on a CPU whose float16
# convolutions and matmuls run in torch's scalar loops (50x float32), the same steps and counts on 2 rows
BATCH = 8


def cuda_batches(name, n, size=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    size = size or BATCH
    if name == "gpt":
        data = [(torch.randint(0, 101, (size, 16), generator=g), torch.randint(0, 101, (size, 16), generator=g))
                for _ in range(n)]
    else:
        data = [(torch.randn(size, 3, 16, 16, generator=g), torch.randint(0, 10, (size,), generator=g))
                for _ in range(n)]
    return [(x.cuda(), t.cuda()) for x, t in data]


def cuda_steps(name, count, make_opt=None, loss_fn=flat_ce, **kw):
    """``count`` identical (gm, step) pairs: one CUDA model converted once, each pair a deep copy of that conversion
    (a converted module trains its model's own tensors: each pair gets tensors of its own)."""
    from small_models import example
    model, inputs = example(name, batch=BATCH)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    make_opt = make_opt or (lambda ps: torch.optim.AdamW(ps, lr=2.0**-10, weight_decay=2.0**-6, fused=True))
    converted = autocastfx.convert(model, inputs)
    out = []
    for _ in range(count):
        gm = copy.deepcopy(converted)
        out.append((gm, autocastfx.train_step(gm, loss_fn, make_opt(gm.parameters()), **kw)))
    return out


def weights(gm, step):
    return [p.detach().clone() for p in list(gm.parameters())]


def opt_state(step):
    return [t.detach().clone() for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def all_equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_graph_step_equals_eager_step_bit_for_bit(name):
    """Bitwise, not within a tolerance: a replay launches the kernels the eager step launches, with the same
    arguments (the lr 2^-10 is exact in the graph's float32 lr tensor), on deterministic kernels."""
    with reproducible():
        (gm_e, eager), (gm_g, step) = cuda_steps(name, 2, growth_interval=5)
        untrained = weights(gm_g, step)
        gstep = CudaGraphStep(step, warmup=3)
        losses_e, losses_g = [], []
        for x, t in cuda_batches(name, 20):
            losses_e.append(eager(x, t))
            losses_g.append(gstep(x, t).clone())
        torch.cuda.synchronize()
    assert gstep.captures == 1 and gstep.replays == 17 and gstep.graph is not None
    assert torch.equal(torch.stack(losses_e), torch.stack(losses_g)), (losses_e, losses_g)
    assert all_equal(weights(gm_e, eager), weights(gm_g, step))
    assert all_equal(opt_state(eager), opt_state(step))
    assert torch.equal(eager.stats.scale, step.stats.scale) and int(step.stats.steps) == 20
    assert not all_equal(weights(gm_g, step), untrained), "the replays must train"


def boosted_loss():
    """A loss times a device tensor the test sets to inf: an overflow injected into the captured graph."""
    boost = torch.ones((), device="cuda")
    return boost, lambda out, t: flat_ce(out, t) * boost


@pytest.mark.gpu
@needs_cuda
def test_overflow_inside_the_graph_skips_halves_and_growth_comes_back():
    boost, loss_fn = boosted_loss()
    ((gm, step),) = cuda_steps("resnet", 1, loss_fn=loss_fn, init_scale=2.0**10, growth_interval=3)
    gstep = CudaGraphStep(step, warmup=2)
    data = cuda_batches("resnet", 10)
    for x, t in data[:4]:
        gstep(x, t)
    assert gstep.replays == 2
    torch.cuda.synchronize()
    w, s = weights(gm, step), opt_state(step)
    scale, skipped = float(step.stats.scale), int(step.stats.skipped)
    boost.fill_(float("inf"))
    gstep(*data[4])
    torch.cuda.synchronize()
    assert all_equal(w, weights(gm, step)) and all_equal(s, opt_state(step)), "a skipped update changed state"
    assert float(step.stats.scale) == scale / 2 and int(step.stats.skipped) == skipped + 1
    boost.fill_(1.0)
    for x, t in data[5:8]:   # growth_interval clean steps: the scale doubles back
        gstep(x, t)
    assert float(step.stats.scale) == scale and int(step.stats.skipped) == skipped + 1
    assert not all_equal(w, weights(gm, step))


@pytest.mark.gpu
@needs_cuda
def test_stuck_scale_raises_within_two_calls():
    boost, loss_fn = boosted_loss()
    ((gm, step),) = cuda_steps("resnet", 1, loss_fn=loss_fn, init_scale=1.0, min_scale=1.0)
    gstep = CudaGraphStep(step, warmup=2)
    data = cuda_batches("resnet", 8)
    for x, t in data[:4]:
        gstep(x, t)
    assert gstep.replays == 2
    boost.fill_(float("inf"))   # every step from here overflows with the scale at min_scale
    calls = 0
    with pytest.raises(LossScaleError, match="min_scale"):
        for x, t in data[4:]:
            calls += 1
            gstep(x, t)
    assert calls <= 2, "the error must come on the call that got stuck or the next one"
    assert not bool(step.stats.scale < 1.0)


@pytest.mark.gpu
@needs_cuda
def test_lr_scheduler_changes_the_replayed_update():
    sgd = lambda ps: torch.optim.SGD(ps, lr=2.0**-4, momentum=0.9, fused=True)   # noqa: E731
    with reproducible():
        (gm_e, eager), (gm_g, step), (gm_n, plain) = cuda_steps("resnet", 3, make_opt=sgd)
        gstep, gplain = CudaGraphStep(step, warmup=2), CudaGraphStep(plain, warmup=2)
        lr = step.optimizer.param_groups[0]["lr"]
        sched_e = torch.optim.lr_scheduler.StepLR(eager.optimizer, step_size=2, gamma=0.5)
        sched_g = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=2, gamma=0.5)
        for x, t in cuda_batches("resnet", 10):
            eager(x, t)
            gstep(x, t)
            gplain(x, t)
            sched_e.step()
            sched_g.step()
        torch.cuda.synchronize()
    assert step.optimizer.param_groups[0]["lr"] is lr and lr.item() == 2.0**-4 * 0.5**5
    assert all_equal(weights(gm_e, eager), weights(gm_g, step))
    assert not all_equal(weights(gm_g, step), weights(gm_n, plain)), "the schedule must reach the replays"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accum", [2, 3])
def test_accumulation_and_clipping_inside_graphs(accum):
    with reproducible():
        (gm_e, eager), (gm_g, step) = cuda_steps("resnet", 2, accum_steps=accum, clip_grad_norm=0.25)
        gstep = CudaGraphStep(step, warmup=3)
        data = cuda_batches("resnet", 4 * accum + 1, size=BATCH // 2)
        for x, t in data[:-1]:
            assert torch.equal(eager(x, t), gstep(x, t))
        torch.cuda.synchronize()
        norm = step.stats.grad_norm.clone()
        # the next cycle's first micro-batch: its graph's scratch memory must not be where stats.grad_norm lives
        # (the graphs share one pool and the update graph was captured after the first)
        assert torch.equal(eager(*data[-1]), gstep(*data[-1]))
        torch.cuda.synchronize()
    assert set(gstep.graphs) == {k for k, _ in graphed.positions(accum)} and gstep.replays > 0
    assert all_equal(weights(gm_e, eager), weights(gm_g, step))
    assert torch.equal(step.stats.grad_norm, norm) and torch.equal(eager.stats.grad_norm, step.stats.grad_norm)
    assert eager.micro == step.micro == 4 * accum + 1 and int(step.stats.steps) == 4


@pytest.mark.gpu
@needs_cuda
def test_state_dict_resume_is_bit_identical_and_keeps_the_captured_buffers():
    with reproducible():
        data = cuda_batches("resnet", 14)
        (gm_a, a), (gm_b, b), (gm_c, c), (gm_d, d), (gm_e, e) = cuda_steps("resnet", 5)
        ga, gb, gc, gd = (CudaGraphStep(s, warmup=2) for s in (a, b, c, d))
        for x, t in data:
            ga(x, t)
        for x, t in data[:8]:
            gb(x, t)
        sd = gb.state_dict()
        gc.load_state_dict(copy.deepcopy(sd))       # a new graph step: warms up again, then captures
        for x, t in data[8:]:
            gc(x, t)
        for x, t in cuda_batches("resnet", 5, seed=7):
            gd(x, t)                                # captured on other data
        graph, statics = gd.graph, gd.static_inputs
        gd.load_state_dict(copy.deepcopy(sd))       # into the tensors the graph holds
        for x, t in data[8:]:
            gd(x, t)
        e.load_state_dict(copy.deepcopy(sd))        # and the eager step reads the same checkpoint
        for x, t in data[8:]:
            e(x, t)
        torch.cuda.synchronize()
    final = weights(gm_a, a)
    assert all_equal(final, weights(gm_c, c)) and all_equal(final, weights(gm_d, d))
    assert all_equal(final, weights(gm_e, e))
    assert gd.graph is graph and gd.static_inputs is statics and gd.captures == 1
    assert int(d.stats.steps) == 14 and torch.equal(a.stats.scale, d.stats.scale)


@pytest.mark.gpu
@needs_cuda
def test_replays_have_no_host_syncs():
    from test_step import SyncCounter
    ((gm, step),) = cuda_steps("resnet", 1)
    gstep = CudaGraphStep(step, warmup=2)
    data = cuda_batches("resnet", 10)
    for x, t in data[:3]:
        gstep(x, t)
    torch.cuda.synchronize()
    counter = SyncCounter()
    with counter:
        for x, t in data[3:]:
            loss = gstep(x, t)
    assert counter.syncs == [] and gstep.replays == 8
    torch.cuda.synchronize()
    assert torch.isfinite(loss)


@pytest.mark.gpu
@needs_cuda
def test_a_changed_shape_or_a_cpu_input_raises_and_recapture_takes_the_new_shape():
    ((gm, step),) = cuda_steps("resnet", 1)
    gstep = CudaGraphStep(step, warmup=2)
    for x, t in cuda_batches("resnet", 3):
        gstep(x, t)
    torch.cuda.synchronize()
    w, replays = weights(gm, step), gstep.replays
    (x4, t4), = cuda_batches("resnet", 1, size=4)
    with pytest.raises(ValueError, match=r"captured float32\[8, 3, 16, 16\].*given float32\[4, 3, 16, 16\].*"
                                         r"recapture\(\)"):
        gstep(x4, t4)
    with pytest.raises(ValueError, match=r"is on cpu.*a CUDA graph needs its inputs on the model's device"):
        gstep(x4.cpu(), t4.cpu())
    torch.cuda.synchronize()
    assert gstep.replays == replays and all_equal(w, weights(gm, step))
    gstep.recapture()
    gstep(x4, t4)
    assert gstep.captures == 2 and gstep.static_inputs.shape == (4, 3, 16, 16)


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 64), nn.Dropout(0.25), nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


@pytest.mark.gpu
@needs_cuda
def test_dropout_in_the_graph_draws_what_the_eager_step_draws():
    """torch.cuda.graph registers the default CUDA generator: each replay advances its offset by what the eager
    step would draw, and the capture itself draws nothing. Run one after the other from one seed (the two share
    the global generator), the graph step's masks and so its weights equal the eager step's."""
    data = [tuple(t.cuda() for t in batch(i)) for i in range(10)]
    runs = []
    for graph in (False, True):
        torch.manual_seed(0)
        gm = autocastfx.convert(DropoutMLP().cuda(), (data[0][0],), pad_multiple=1)
        step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(gm.parameters(), lr=LR, fused=True))
        run = CudaGraphStep(step, warmup=3) if graph else step
        torch.cuda.manual_seed(1)
        losses = torch.stack([run(x, y).clone() for x, y in data])
        torch.cuda.synchronize()
        runs.append((losses, weights(gm, step), torch.cuda.get_rng_state()))
    (le, we, re), (lg, wg, rg) = runs
    assert torch.equal(le, lg) and all_equal(we, wg)
    assert torch.equal(re, rg), "the replays must advance the generator as the eager steps do"


@pytest.mark.gpu
@needs_cuda
def test_a_failed_capture_names_its_cause_and_leaves_the_eager_step_usable():
    """A host read inside the step breaks the capture; torch.cuda.graph's exit then raises again before it puts
    the stream back. The error names the first cause, this thread is back on its stream, and the eager step
    (or a new graph step on a fixed loss) goes on."""
    def loss_fn(out, t):
        loss = flat_ce(out, t)
        return loss * 2 if loss.item() > 1e6 else loss   # a Python branch on a device value
    ((gm, step),) = cuda_steps("resnet", 1, loss_fn=loss_fn)
    gstep = CudaGraphStep(step, warmup=1)
    data = cuda_batches("resnet", 4)
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match=r"(?s)capturing the training step in a CUDA graph failed: .*"
                                           r"captur.*\.item\(\)"):
        gstep(*data[0])
    assert torch.cuda.current_stream() == before
    assert gstep.graph is None and all(p.grad is None for p in step.all_params)
    for x, t in data[1:]:
        step(x, t)
    torch.cuda.synchronize()
    assert int(step.stats.steps) == 4


def test_train_step_with_cuda_graph_refuses_before_touching_the_optimizer():
    """cuda_graph=True on a CPU model: refused before the optimizer is made capturable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = autocastfx.convert(model, (torch.randn(4, 8),))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3, fused=True)
    groups = [list(g["params"]) for g in opt.param_groups]
    settings = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match="CUDA"):
        autocastfx.train_step(gm, F.cross_entropy, opt, cuda_graph=True)
    assert [list(g["params"]) for g in opt.param_groups] == groups
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == settings
    rms = torch.optim.RMSprop(gm.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="fused"):
        autocastfx.train_step(gm, F.cross_entropy, rms, cuda_graph=True)


# ----------------------------------------------------------------- the GPU tier's own logic, on the CPU
GPU_TIER_EMULATED = [
    ("test_graph_step_equals_eager_step_bit_for_bit", "resnet"),
    ("test_graph_step_equals_eager_step_bit_for_bit", "gpt"),
    ("test_lr_scheduler_changes_the_replayed_update", None),
    ("test_accumulation_and_clipping_inside_graphs", 2),
    ("test_accumulation_and_clipping_inside_graphs", 3),
    ("test_state_dict_resume_is_bit_identical_and_keeps_the_captured_buffers", None),
    ("test_replays_have_no_host_syncs", None),
    ("test_dropout_in_the_graph_draws_what_the_eager_step_draws", None),
    ("test_a_failed_capture_names_its_cause_and_leaves_the_eager_step_usable", None),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tier runs for real here")
@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("test, arg", GPU_TIER_EMULATED, ids=lambda v: str(v))
def test_gpu_tier_runs_emulated_on_the_cpu(fake_cuda, monkeypatch, test, arg):
    """The GPU tier's tests (those without a literal device="cuda") run with graphs emulated and .cuda() a no-op:
    their counts, orders and resume bookkeeping are checked before they meet a GPU. What only a GPU shows (the
    pool, streams, cuDNN and cuBLAS under capture, the generator's offsets) still needs the real run."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setitem(globals(), "BATCH", small_if_emulated(BATCH, 2, torch.float16))
    globals()[test](*([] if arg is None else [arg]))


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_loaded_into_a_captured_step_is_the_state_it_trains_on(fake_cuda, tmp_path):
    """load_checkpoint into a CudaGraphStep that has captured: its graphs read the optimizer tensors that were
    there, so they are captured again, and it trains on as an eager step given the same checkpoint, both for one
    saved before the first update (the optimizer starts afresh) and one saved after updates."""
    _, early = make("adamw")
    autocastfx.save_checkpoint(early, tmp_path / "start")
    for i in range(3):
        early(*batch(i))
    autocastfx.save_checkpoint(early, tmp_path / "after")
    for name in ("start", "after"):
        _, step = make("adamw")
        gstep = CudaGraphStep(step, warmup=2)
        for i in range(5):
            gstep(*batch(10 + i))
        assert gstep.graph is not None
        gm_e, eager = make("adamw")
        autocastfx.load_checkpoint(eager, tmp_path / name)
        autocastfx.load_checkpoint(gstep, tmp_path / name)
        assert gstep.graph is None  # dropped: captured again after the warm-up
        for i in range(3, 9):
            assert torch.equal(eager(*batch(i)), gstep(*batch(i))), (name, i)
        assert gstep.graph is not None
        assert all(torch.equal(a, b) for a, b in zip(cpu_weights(gm_e, eager), cpu_weights(step.gm, step))), name


# ----------------------------------------------------------- what changed since capture (emulated on the CPU)
def test_a_mid_cycle_state_dict_holds_the_gradients_the_graphs_accumulated(fake_cuda):
    """The graphs keep a cycle's gradients in their own memory and no ``.grad`` holds them between replays: a
    state saved one micro-batch into a cycle had none, and its resumes updated without it (0.022 off the
    uninterrupted run, where the eager step's resumes are exact)."""
    kw, n, cut = dict(accum_steps=3), 16, 7
    gm_a, a = make("adamw", **kw)
    ga = CudaGraphStep(a, warmup=3)
    for i in range(n):
        ga(*batch(i))
    gm_b, b = make("adamw", **kw)
    gb = CudaGraphStep(b, warmup=3)
    for i in range(cut):
        gb(*batch(i))
    sd = copy.deepcopy(gb.state_dict())
    assert sd["micro"] % 3 == 1 and len(sd["grads"]) == len(list(gm_b.parameters()))
    for resume in ("eager", "graph"):
        gm_c, c = make("adamw", **kw)
        run = c if resume == "eager" else CudaGraphStep(c, warmup=3)
        run.load_state_dict(copy.deepcopy(sd))
        for i in range(cut, n):
            run(*batch(i))
        assert all(torch.equal(p, q) for p, q in zip(gm_a.parameters(), gm_c.parameters())), resume


@pytest.mark.parametrize("change", ["freeze", "replace", "rewind"])
def test_tensors_changed_after_capture_are_captured_again(fake_cuda, change):
    """The replays read the tensors and flags of the capture: a layer frozen after it kept training (0.039 where
    the eager step leaves it), a head swapped in was never read, and ``optimizer.load_state_dict`` left the
    replays updating the old state. At a cycle's start such a change now means eager calls and a new capture."""
    gm_e, e = make("adamw")
    gm_g, s = make("adamw")
    g = CudaGraphStep(s, warmup=3)
    saved = None
    for i in range(12):
        if i == 2:
            saved = [copy.deepcopy(x.optimizer.state_dict()) for x in (e, s)]
        if i == 6:
            for gm, step, sd in ((gm_e, e, saved[0]), (gm_g, s, saved[1])):
                if change == "freeze":
                    gm.fc1.requires_grad_(False)
                elif change == "replace":
                    torch.manual_seed(5)
                    gm.fc2 = nn.Linear(32, 4)
                    step.optimizer.add_param_group({"params": list(gm.fc2.parameters())})
                else:
                    step.optimizer.load_state_dict(sd)
        e(*batch(i))
        g(*batch(i))
    assert g.captures == 2
    assert all(torch.equal(p, q) for p, q in zip(gm_e.parameters(), gm_g.parameters()))
