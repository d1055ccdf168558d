"""The generated training step: the float32 parameters, scaling, skipping, clipping, accumulation, resume, no host
syncs."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autocastfx
from small_models import ALL, TinyResNet, example

SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in SYNC_OPS:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


class MLP(nn.Module):
    def __init__(self, d=16, classes=4):
        super().__init__()
        self.fc1 = nn.Linear(d, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def data(n=8, d=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def setup(opt="sgd", model=None, **kw):
    torch.manual_seed(0)
    model = model or MLP()
    x, y = data()
    gm = autocastfx.convert(model, (x,), pad_multiple=1)
    # fused: the kernels that take found_inf and skip an overflowed update on the device, with no host read
    if opt == "sgd":
        o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    elif opt == "adamw":
        o = torch.optim.AdamW(gm.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    else:
        o = torch.optim.Adam(gm.parameters(), lr=1e-2, fused=True)
    step = autocastfx.train_step(gm, F.cross_entropy, o, **kw)
    return gm, o, step, x, y


def snapshot(gm, opt):
    params = {n: p.detach().clone() for n, p in gm.named_parameters()}
    masters = [m.detach().clone() for m in autocastfx.master_parameters(gm)]
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    return params, masters, state


def same(a, b):
    pa, ma, sa = a
    pb, mb, sb = b
    return (all(torch.equal(pa[k], pb[k]) for k in pa) and all(torch.equal(x, y) for x, y in zip(ma, mb))
            and sa.keys() == sb.keys()
            and all(torch.equal(sa[i][k], sb[i][k]) if torch.is_tensor(sa[i][k]) else sa[i][k] == sb[i][k]
                    for i in sa for k in sa[i]))


def inject(gm, when, value=float("inf")):
    """Multiply one low-precision weight's gradient by inf/NaN on the calls listed in ``when``."""
    p = dict(gm.named_parameters())["fc1.weight"]
    count = {"n": 0}

    def hook(g):
        count["n"] += 1
        return g * value if count["n"] - 1 in when else g

    p.register_hook(hook)


def test_code_is_the_recipe_that_runs_and_says_its_options():
    _, _, step, _, _ = setup(loss_scale=128.0)
    o = step.options
    assert (o.scaler.mode, o.clip, o.retry, o.accum_steps) == ("static", None, False, 1)
    assert step.code.splitlines()[0] == f"# train_step: {autocastfx.training.recipe.describe(o)}"
    assert "loss scale static (init 128)" in step.code.splitlines()[0]
    assert "_amp_foreach_non_finite_check_and_unscale_" in step.code
    # the optimizer steps the module's own float32 parameters: no float32 copies to fill, nothing copied back
    assert "_foreach_copy_" not in step.code and "master" not in step.code
    assert "grads = [p.grad for p in params if p.grad is not None]" in step.code
    import inspect
    for f in (autocastfx.training.recipe.train_step, autocastfx.training.recipe.update):
        assert inspect.getsource(f) in step.code  # what runs, as written
    _, _, step, _, _ = setup(clip_grad_norm=1.0, hysteresis=2)
    assert step.options.clip == 1.0 and "clip grad norm 1, " in step.code and "hysteresis 2" in step.code
    _, _, step, _, _ = setup(on_overflow="retry")
    assert step.options.max_retries == 8 and "retry on overflow" in step.code.splitlines()[0]
    _, _, step, _, _ = setup(accum_steps=4)
    assert "4 micro-batches per update" in step.code.splitlines()[0]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_static_scale_one_equals_hand_written_float32_parameter_loop(opt):
    gm, o, step, x, y = setup(opt, loss_scale=1.0)
    # the reference: a plain loop over an untouched copy (taken before any step), backward into the float32
    # parameters' own .grad, the same optimizer settings (fused, as the step uses)
    gm_ref = copy.deepcopy(gm)
    assert all(a is not b for a, b in zip(gm.parameters(), gm_ref.parameters()))
    cls, kw = (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)) if opt == "sgd" else \
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01))
    ref_opt = cls(gm_ref.parameters(), fused=True, **kw)
    for i in range(3):
        xb, yb = data(seed=i)
        step((xb,), yb)
        ref_opt.zero_grad(set_to_none=True)
        F.cross_entropy(gm_ref(xb), yb).backward()
        assert all(p.grad.dtype == torch.float32 for p in gm_ref.parameters())  # the graph's casts backpropagate
        ref_opt.step()
    # the master weights are the module's own float32 parameters: the ones the graph casts to float16
    masters = autocastfx.master_parameters(gm)
    own = {id(p) for p in gm.parameters()}
    assert masters and all(id(m) in own and m.dtype == torch.float32 for m in masters)
    assert {id(m) for m in masters} == {id(gm.fc1.weight), id(gm.fc1.bias), id(gm.fc2.weight), id(gm.fc2.bias)}
    for a, b in zip(masters, autocastfx.master_parameters(gm_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (n, a), (_, b) in zip(gm.named_parameters(), gm_ref.named_parameters()):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_overflow_skips_step_and_halves_scale(opt, bad):
    gm, o, step, x, y = setup(opt, init_scale=1024.0)
    inject(gm, when={1, 3}, value=bad)
    step(x, y)  # a clean step first, so optimizer state exists
    assert float(step.stats.scale) == 1024.0
    before = snapshot(gm, o)
    step(x, y)  # overflow
    assert same(before, snapshot(gm, o)), "weights or optimizer state changed on a skipped step"
    assert float(step.stats.scale) == 512.0 and int(step.stats.skipped) == 1
    step(x, y)  # clean: weights move
    assert not same(before, snapshot(gm, o))
    before = snapshot(gm, o)
    step(x, y)  # overflow again
    assert same(before, snapshot(gm, o))
    assert float(step.stats.scale) == 256.0 and int(step.stats.skipped) == 2
    assert [f for _, f in step.stats.history()] == [False, True, False, True]


def test_skipped_first_step_leaves_no_optimizer_state_garbage():
    gm, o, step, x, y = setup("sgd", init_scale=1024.0)
    inject(gm, when={0})
    masters0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(masters0, autocastfx.master_parameters(gm)))
    for s in o.state.values():
        assert torch.count_nonzero(s["momentum_buffer"]) == 0
    step(x, y)
    assert all(torch.isfinite(m).all() for m in autocastfx.master_parameters(gm))


def test_growth_after_interval_and_hysteresis():
    gm, o, step, x, y = setup(init_scale=64.0, growth_interval=3)
    for _ in range(3):
        step(x, y)
    assert float(step.stats.scale) == 128.0
    gm, o, step, x, y = setup(init_scale=64.0, hysteresis=2)
    inject(gm, when={0, 2, 3})
    step(x, y)   # overflow 1: tolerated, skipped
    assert float(step.stats.scale) == 64.0 and int(step.stats.skipped) == 1
    step(x, y)   # clean: resets the count
    step(x, y)   # overflow 1 again: tolerated
    assert float(step.stats.scale) == 64.0
    step(x, y)   # overflow 2 in a row: back off
    assert float(step.stats.scale) == 32.0 and int(step.stats.skipped) == 3


def test_stuck_at_min_scale_raises_within_two_steps_without_a_sync():
    gm, o, step, x, y = setup(init_scale=4.0, min_scale=1.0)
    step(x, y)  # a clean step; then every gradient overflows: 4 -> 2 -> 1, then stuck at 1
    inject(gm, when=set(range(100)))
    masters0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    counter = SyncCounter()
    calls = 0
    with counter, pytest.raises(autocastfx.LossScaleError, match="min_scale.*clip_grad_norm.*calibrate"):
        for _ in range(10):
            calls += 1
            step(x, y)
    assert counter.syncs == [], counter.syncs
    history = step.stats.history()
    first_stuck = next(i for i, (scale, flow) in enumerate(history) if flow and scale <= 1.0)  # 0-based step
    raised_at = calls  # 0-based index of the step whose call raised (step 0 ran before the loop)
    assert first_stuck == 3 and first_stuck <= raised_at <= first_stuck + 1  # that step or the next
    assert float(step.stats.scale) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(masters0, autocastfx.master_parameters(gm)))
    with pytest.raises(autocastfx.LossScaleError):
        step.check()  # the explicit read agrees


def test_overflows_above_min_scale_do_not_raise():
    gm, o, step, x, y = setup(init_scale=2.0**10, min_scale=1.0)
    inject(gm, when=set(range(10)))
    for _ in range(10):  # 2^10 -> 2^0: never an overflow *at* min_scale
        step(x, y)
    step.check()
    assert float(step.stats.scale) == 1.0 and int(step.stats.skipped) == 10


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("kw", [{}, {"clip_grad_norm": 1.0}, {"loss_scale": 128.0}, {"hysteresis": 3}],
                         ids=["dynamic", "clip", "static", "hysteresis"])
def test_zero_host_syncs_per_step(opt, kw):
    gm, o, step, x, y = setup(opt, **kw)
    step(x, y)  # warm-up (lazy state)
    inject(gm, when={1})
    counter = SyncCounter()
    with counter:
        for _ in range(4):
            loss = step(x, y)
    assert counter.syncs == [], counter.syncs
    assert isinstance(loss, torch.Tensor)
    assert int(step.stats.skipped) == 1


def test_an_optimizer_without_fused_kernels_skips_after_one_host_read_and_keeps_its_options():
    """A plain (foreach) AdamW: the step leaves its options as built, reads found_inf once per update to skip an
    overflowed one (GradScaler's way), and trains exactly as the same loop over a fused AdamW does."""
    torch.manual_seed(0)
    gm = autocastfx.convert(MLP(), (data()[0],), pad_multiple=1)
    ref = copy.deepcopy(gm)
    plain = torch.optim.AdamW(gm.parameters(), lr=1e-2, weight_decay=0.01)
    options = [{k: v for k, v in g.items() if k != "params"} for g in plain.param_groups]
    step = autocastfx.train_step(gm, F.cross_entropy, plain, loss_scale=128.0)
    step_ref = autocastfx.train_step(ref, F.cross_entropy, torch.optim.AdamW(ref.parameters(), lr=1e-2,
                                                                              weight_decay=0.01, fused=True),
                                     loss_scale=128.0)
    assert not step.options.fused and "optimizer skipped after one host read" in step.code  # said in step.code
    x, y = data()
    step(x, y)
    step_ref(x, y)
    inject(gm, when={1})
    inject(ref, when={1})
    counter, counter_ref = SyncCounter(), SyncCounter()
    with counter:
        for _ in range(3):
            step(x, y)
    with counter_ref:
        for _ in range(3):
            step_ref(x, y)
    # at least the read of found_inf per update (AdamW's per-parameter CPU loop reads its step counts too)
    assert len(counter.syncs) >= 3 and counter_ref.syncs == []
    assert int(step.stats.skipped) == 1 == int(step_ref.stats.skipped)
    assert [{k: v for k, v in g.items() if k != "params"} for g in plain.param_groups] == options
    for a, b in zip(gm.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradscaler_syncs_for_comparison():
    model = MLP()
    x, y = data()
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    counter = SyncCounter()
    with counter:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(o)
        scaler.update()
    assert len(counter.syncs) >= 1


def test_resume_is_bit_identical():
    gm, o, step, x, y = setup("adamw")
    batches = [data(seed=i) for i in range(6)]
    for xb, yb in batches:
        step(xb, yb)
    straight = [p.clone() for p in gm.parameters()]

    gm2, o2, step2, _, _ = setup("adamw")
    for xb, yb in batches[:3]:
        step2(xb, yb)
    sd = copy.deepcopy(step2.state_dict())
    gm3, o3, step3, _, _ = setup("adamw")
    step3.load_state_dict(sd)
    for xb, yb in batches[3:]:
        step3(xb, yb)
    for a, b in zip(straight, gm3.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(autocastfx.master_parameters(gm), autocastfx.master_parameters(gm3)):
        assert torch.equal(a, b)
    assert float(step3.stats.scale) == float(step.stats.scale) and int(step3.stats.steps) == 6


def test_load_keeps_this_steps_optimizer_flags_and_drops_stale_gradients():
    """A checkpoint written by a CUDA-graph step has capturable=True in its groups; an eager step loading it
    keeps its own flag (and keeps `step` where its loop wants it). Gradients a run had accumulated before
    loading are not the checkpoint's: they are dropped, so the next update is the checkpoint's own."""
    gm, o, step, x, y = setup("adam", accum_steps=2)
    step(x, y)
    step(x, y)
    sd = copy.deepcopy(step.state_dict())
    for group in sd["optimizer"]["param_groups"]:
        group["capturable"] = True
    gm2, o2, step2, _, _ = setup("adam", accum_steps=2)
    step2(*data(seed=5))  # a micro-batch of another run, half way through its cycle
    assert any(p.grad is not None for p in gm2.parameters())
    step2.load_state_dict(sd)
    assert all(not g.get("capturable", False) for g in o2.param_groups)
    assert all(p.grad is None for p in list(gm2.parameters()) + autocastfx.master_parameters(gm2))
    for xb, yb in [data(seed=1), data(seed=2)]:
        step(xb, yb)
        step2(xb, yb)
    for a, b in zip(autocastfx.master_parameters(gm), autocastfx.master_parameters(gm2)):
        assert torch.equal(a, b)


def test_clipping_keeps_one_grad_norm_tensor():
    gm, o, step, x, y = setup("adamw", clip_grad_norm=1.0)
    norm = step.grad_norm
    step(x, y)
    step(*data(seed=1))
    assert step.grad_norm is norm and step.stats.grad_norm is norm and float(norm) > 0


def test_accumulation_equals_one_larger_batch():
    x, y = data(n=8)
    gm_a, o_a, step_a, _, _ = setup("sgd", accum_steps=2, loss_scale=1024.0)
    gm_b, o_b, step_b, _, _ = setup("sgd", loss_scale=1024.0)
    m0 = [m.clone() for m in autocastfx.master_parameters(gm_a)]
    step_a(x[:4], y[:4])
    assert all(torch.equal(a, b) for a, b in zip(m0, autocastfx.master_parameters(gm_a))), "updated mid-accumulation"
    step_a(x[4:], y[4:])
    step_b(x, y)
    for a, b, s in zip(autocastfx.master_parameters(gm_a), autocastfx.master_parameters(gm_b), m0):
        torch.testing.assert_close(a - s, b - s, rtol=2e-2, atol=2e-5)
    assert not torch.equal(autocastfx.master_parameters(gm_a)[0], m0[0])
    assert int(step_a.stats.steps) == 1


def test_overflow_in_any_micro_batch_skips_the_update():
    x, y = data(n=8)
    gm, o, step, _, _ = setup("sgd", accum_steps=2, init_scale=1024.0)
    inject(gm, when={0})
    m0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    step(x[:4], y[:4])
    step(x[4:], y[4:])
    assert all(torch.equal(a, b) for a, b in zip(m0, autocastfx.master_parameters(gm)))
    assert float(step.stats.scale) == 512.0


def test_retry_redoes_the_batch_at_lower_scale():
    gm, o, step, x, y = setup("sgd", init_scale=1024.0, on_overflow="retry")
    inject(gm, when={0})
    m0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    step(x, y)
    assert float(step.stats.scale) == 512.0
    assert not torch.equal(m0[0], autocastfx.master_parameters(gm)[0]), "the retried batch should update"
    assert [f for _, f in step.stats.history()] == [True, False]


def test_clipping_bounds_the_update_by_the_global_norm():
    torch.manual_seed(0)
    x, y = data()
    gm = autocastfx.convert(MLP(), (x,), pad_multiple=1)
    o = torch.optim.SGD(gm.parameters(), lr=1.0)  # update == -clipped gradient
    step = autocastfx.train_step(gm, F.cross_entropy, o, clip_grad_norm=0.01)
    before = [p.detach().clone() for g in o.param_groups for p in g["params"]]
    step(x, y)
    after = [p.detach() for g in o.param_groups for p in g["params"]]
    update_norm = torch.stack([(a - b).norm() for a, b in zip(after, before)]).norm()
    assert float(step.stats.grad_norm) > 0.05  # the norm before clipping
    assert abs(float(update_norm) - 0.01) < 1e-4


def test_optimizer_over_original_or_converted_parameters_and_scheduler():
    gm, o, step, x, y = setup("sgd")  # built over the ORIGINAL model's parameters: they are gm's, not re-pointed
    opt_params = [p for g in o.param_groups for p in g["params"]]
    assert [id(p) for p in opt_params] == [id(p) for p in gm.parameters()]
    assert all(any(m is p for p in opt_params) for m in autocastfx.master_parameters(gm))
    assert all(p.dtype == torch.float32 for g in o.param_groups for p in g["params"])
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.0)
    step(x, y)
    sched.step()  # lr is now 0: the next step leaves the parameters where they are (apart from momentum)
    for g in o.param_groups:
        g["momentum"] = 0.0
    m1 = [m.clone() for m in autocastfx.master_parameters(gm)]
    step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(m1, autocastfx.master_parameters(gm)))


def test_batchnorm_model_trains_and_the_low_weights_are_made_from_the_parameters():
    torch.manual_seed(0)
    model = TinyResNet()
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 10, (4,))
    gm = autocastfx.convert(model, (x,), pad_multiple=1)
    o = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9)
    step = autocastfx.train_step(gm, F.cross_entropy, o)
    losses = [float(step(x, y)) for _ in range(8)]
    assert losses[-1] < losses[0]
    # the module stores nothing low: every parameter and buffer is float32 (or integer), the model's own tensor,
    # trained in place (the running statistics too)
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    assert all(not b.is_floating_point() or b.dtype == torch.float32 for b in gm.buffers())
    assert {id(t) for t in gm.parameters()} == {id(t) for t in model.parameters()}
    assert {id(t) for t in gm.buffers()} <= {id(t) for t in model.buffers()}
    assert int(model.bn.num_batches_tracked) == 8
    # the float16 weights the kernels read are cast from the trained parameters at each forward, never stale: a
    # fresh conversion of a model holding the trained state gives the same outputs, bit for bit
    assert autocastfx.master_parameters(gm) and all(m.dtype == torch.float32 for m in autocastfx.master_parameters(gm))
    fresh = TinyResNet()
    fresh.load_state_dict(gm.state_dict())
    gm2 = autocastfx.convert(fresh, (x,), pad_multiple=1)
    gm.eval(), gm2.eval()
    with torch.no_grad():
        assert torch.equal(gm(x), gm2(x))


def test_bf16_defaults_to_no_scaling():
    torch.manual_seed(0)
    x, y = data()
    gm = autocastfx.convert(MLP(), (x,), dtype=torch.bfloat16, pad_multiple=1)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1))
    assert "loss scale off" in step.code and float(step.stats.scale) == 1.0
    step(x, y)
    gm = autocastfx.convert(MLP(), (x,), dtype=torch.bfloat16, pad_multiple=1)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1), loss_scale="dynamic")
    assert "loss scale dynamic" in step.code


def test_parameters_are_the_models_and_master_weights_true_is_refused():
    torch.manual_seed(0)
    x, y = data()
    model = MLP()
    with pytest.raises(ValueError, match="master_weights=True is gone.*for_inference"):
        autocastfx.convert(model, (x,), pad_multiple=1, master_weights=True)
    gm = autocastfx.convert(model, (x,), pad_multiple=1, master_weights=False)  # the only choice, accepted
    assert all(a is b for a, b in zip(gm.parameters(), model.parameters()))
    o = torch.optim.Adam(gm.parameters(), lr=1e-2)
    step = autocastfx.train_step(gm, F.cross_entropy, o)
    assert "master" not in step.code
    sd = step.state_dict()
    # no masters beside "model" ("outside": a parameter of the loss, where the optimizer holds one)
    assert sorted(sd) == ["cuda_rng", "grads", "micro", "model", "optimizer", "outside", "rng", "scaler"]
    assert sd["grads"] == {}  # no accumulation cycle under way
    assert all(v.dtype == torch.float32 for v in sd["model"].values())
    w0 = gm.fc1.weight.clone()
    step(x, y)
    assert not torch.equal(w0, gm.fc1.weight) and gm.fc1.weight.dtype == torch.float32
    assert model.fc1.weight is gm.fc1.weight  # the model object is trained too


def test_bad_arguments():
    torch.manual_seed(0)
    x, y = data()
    model = MLP()
    gm = autocastfx.convert(model, (x,), pad_multiple=1)
    o = torch.optim.SGD(gm.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="convert the model first"):
        autocastfx.train_step(model, F.cross_entropy, o)
    with pytest.raises(ValueError, match="loss_scale"):
        autocastfx.train_step(gm, F.cross_entropy, o, loss_scale="big")
    with pytest.raises(ValueError, match="retry"):
        autocastfx.train_step(gm, F.cross_entropy, o, on_overflow="retry", accum_steps=2)
    with pytest.raises(ValueError, match="backoff_factor"):
        autocastfx.train_step(gm, F.cross_entropy, o, backoff_factor=2.0)
    with pytest.raises(autocastfx.StepError, match="not a parameter of the converted module.*gm.parameters"):
        autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1))
    with pytest.raises(KeyError, match="state_dict"):
        step.load_state_dict({"scaler": {}})


def test_parameter_without_gradient_is_left_alone():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x, use_both):
            return self.used(x) + (self.unused(x) if use_both else 0)

    torch.manual_seed(0)
    x, y = data()
    m = Partial()
    gm = autocastfx.convert(m, (x, False), pad_multiple=1)
    o = torch.optim.SGD(gm.parameters(), lr=0.1)
    step = autocastfx.train_step(gm, F.cross_entropy, o)
    before = {n: p.clone() for n, p in gm.named_parameters()}
    step((x, False), y)
    after = dict(gm.named_parameters())
    assert not torch.equal(before["used.weight"], after["used.weight"])
    assert torch.equal(before["unused.weight"], after["unused.weight"])


# ------------------------------------------------------------------------------ the call: inputs, *targets

def test_zero_one_and_two_targets():
    torch.manual_seed(0)
    x, y = data()
    y2 = torch.randn(8, 4)
    for loss_fn, targets in [(lambda out: out.pow(2).mean(), ()),
                             (F.cross_entropy, (y,)),
                             (lambda out, a, b: F.cross_entropy(out, a) + F.mse_loss(out, b), (y, y2))]:
        gm = autocastfx.convert(MLP(), (x,), pad_multiple=1)
        step = autocastfx.train_step(gm, loss_fn, torch.optim.SGD(gm.parameters(), lr=0.1), loss_scale=1.0)
        assert "def train_step(step, inputs, *targets)" in step.code and "loss_fn(out, *targets)" in step.code
        with torch.no_grad():
            expected = loss_fn(gm(x), *targets)  # the same forward, before the update
        w0 = gm.fc1.weight.clone()
        assert torch.equal(step(x, *targets), expected)
        assert not torch.equal(w0, gm.fc1.weight)


class KeywordNet(nn.Module):
    def __init__(self, vocab=50, d=16, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, classes)

    def forward(self, input_ids, attention_mask):
        h = (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        return self.fc(h)


def test_dict_of_keyword_inputs_and_a_target():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 50, (4, 8)), torch.ones(4, 8)
    mask[:, 6:] = 0
    y = torch.randint(0, 4, (4,))
    gm = autocastfx.convert(KeywordNet(), example_kwargs={"input_ids": ids, "attention_mask": mask})
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(gm.parameters(), lr=1e-2))
    losses = [float(step({"input_ids": ids, "attention_mask": mask}, y)) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0]


class TinyHF(nn.Module):
    """A Hugging Face-like model: computes its own loss from ``labels=`` and returns it with the logits."""

    def __init__(self, vocab=50, d=16, as_dict=True):
        super().__init__()
        self.as_dict = as_dict
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.lm_head(self.ln(self.emb(input_ids) * attention_mask.unsqueeze(-1)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits} if self.as_dict else HFOutput(loss, logits)


HFOutput = __import__("collections").namedtuple("HFOutput", "loss logits")


@pytest.mark.parametrize("as_dict", [True, False], ids=["out['loss']", "out.loss"])
def test_model_that_computes_its_own_loss_trains_with_zero_targets(as_dict):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (4, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones(4, 8), "labels": ids.roll(1, 1)}
    model = TinyHF(as_dict=as_dict)
    ref = copy.deepcopy(model)  # the same training in float32, from the same start: copied before gm trains model
    gm = autocastfx.convert(model, example_kwargs=batch)
    loss_fn = (lambda out: out["loss"]) if as_dict else (lambda out: out.loss)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-2))
    losses = [float(step(batch)) for _ in range(15)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(ref(**batch))
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0] and int(step.stats.skipped) == 0
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < 2e-2 * b, (losses, ref_losses)


# ------------------------------------------------------------------------------------- init_scale="auto"

class Loud(nn.Module):
    """Gradients of about 10 from the first step on: at a loss scale of 2^16 they overflow float16."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x * 64)))


def _float32_grad_amax(model, x, y):
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    return max(float(p.grad.abs().max()) for p in m.parameters())


def test_auto_scale_is_the_largest_safe_power_of_two_and_the_first_update_counts():
    torch.manual_seed(0)
    model, (x, y) = Loud(), data()
    amax = _float32_grad_amax(model, x, y)
    assert amax * 2.0**16 > 65504  # the model this is about: 2^16 overflows
    gm = autocastfx.convert(model, (x,), pad_multiple=1)
    o = torch.optim.SGD(gm.parameters(), lr=1e-3, fused=True)
    step = autocastfx.train_step(gm, F.cross_entropy, o, init_scale="auto")
    assert "init auto" in step.code and "S.update_auto(amax)" in step.code
    masters0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    counter = SyncCounter()
    with counter:
        step(x, y)
    assert counter.syncs == []
    assert int(step.stats.skipped) == 0 and not step.state.auto_pending
    masters1 = autocastfx.master_parameters(gm)
    assert all(torch.isfinite(m).all() and not torch.equal(a, m) for a, m in zip(masters0, masters1))
    scale = float(step.stats.scale)
    margin = autocastfx.training.scaling.AUTO_MARGIN
    assert scale == 2.0 ** round(math.log2(scale))
    assert scale * amax * margin <= 65504 * 1.01 < 2 * scale * amax * margin  # the largest within the margin
    for _ in range(5):
        step(x, y)
    assert int(step.stats.skipped) == 0 and float(step.stats.scale) == scale


def test_auto_scale_is_capped_and_follows_an_overflow_like_a_fixed_scale():
    torch.manual_seed(0)
    x, y = data()
    gm = autocastfx.convert(MLP(), (x,), pad_multiple=1)
    quiet = lambda out, y: 1e-3 * F.cross_entropy(out, y)  # noqa: E731 - small gradients: safe far over 2^16
    step = autocastfx.train_step(gm, quiet, torch.optim.SGD(gm.parameters(), lr=0.1), init_scale="auto")
    step(x, y)
    assert float(step.stats.scale) == autocastfx.training.scaling.AUTO_MAX_SCALE == 2.0**16
    gm, o, step, x, y = setup(init_scale="auto", min_scale=0.25)
    inject(gm, when={0})  # the first update overflows even at the probe scale 1: skipped, backs off as usual
    m0 = [m.clone() for m in autocastfx.master_parameters(gm)]
    step(x, y)
    assert int(step.stats.skipped) == 1 and float(step.stats.scale) == 0.5 and not step.state.auto_pending
    assert all(torch.equal(a, b) for a, b in zip(m0, autocastfx.master_parameters(gm)))
    gm, o, step, x, y = setup(init_scale="auto")  # probe scale 1 == min_scale: no scale can help
    inject(gm, when={0})
    with pytest.raises(autocastfx.LossScaleError):
        step(x, y)


def test_a_parameter_of_the_loss_resumes_with_its_value_and_its_unfinished_gradient(tmp_path):
    """A learned loss weighting trained beside the module's parameters: ``step.state_dict()`` holds its value and,
    inside an accumulation cycle, its gradient (before: both were lost, the weighting 0.091 where the run without a
    stop reached 0.109); a DCP checkpoint, which names optimizer state by the module's parameters, says so."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        gm = autocastfx.convert(model, (torch.randn(8, 16),), dtype=torch.float16, pad_multiple=1)
        log_var = nn.Parameter(torch.zeros(()))
        opt = torch.optim.SGD([{"params": gm.parameters()}, {"params": [log_var]}], lr=0.1)
        step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out, y) * torch.exp(-log_var) + log_var,
                                     opt, accum_steps=2, init_scale=1024.0)
        return gm, log_var, step

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(7)]
    gm, log_var, step = build()
    for b in batches:
        step(*b)
    for cut in (3, 4):  # inside a cycle, at its end
        gm2, log_var2, step2 = build()
        for b in batches[:cut]:
            step2(*b)
        sd = copy.deepcopy(step2.state_dict())
        gm3, log_var3, step3 = build()
        step3.load_state_dict(sd)
        for b in batches[cut:]:
            step3(*b)
        assert torch.equal(log_var3, log_var), cut
        assert all(torch.equal(a, b) for a, b in zip(gm3.parameters(), gm.parameters())), cut
    step(*batches[0])  # the cycle finished
    with pytest.raises(ValueError, match="not the converted module's"):
        autocastfx.save_checkpoint(step, str(tmp_path / "ckpt"))


def test_auto_scale_state_resumes():
    gm, o, step, x, y = setup(init_scale="auto")
    sd = copy.deepcopy(step.state_dict())
    assert sd["scaler"]["auto_pending"] is True
    step(x, y)
    gm2, o2, step2, _, _ = setup(init_scale="auto")
    step2.load_state_dict(sd)
    step2(x, y)
    assert float(step2.stats.scale) == float(step.stats.scale)
    step2.load_state_dict(copy.deepcopy(step.state_dict()))
    assert not step2.state.auto_pending


def _train(model, inputs, y, init_scale, n):
    gm = autocastfx.convert(copy.deepcopy(model), inputs, pad_multiple=1)  # gm trains its model: each run a copy
    step = autocastfx.train_step(gm, _flat_ce, torch.optim.AdamW(gm.parameters(), lr=1e-3), init_scale=init_scale)
    losses = [float(step(inputs, y)) for _ in range(n)]
    return int(step.stats.skipped), losses[-1]


def _flat_ce(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


class Quiet(MLP):
    """Gradients around 1e-6: float16 at the probe scale 1 keeps them only as subnormals."""

    def forward(self, x):
        return 1e-4 * super().forward(x)


@pytest.mark.parametrize("name", ALL + ["loud", "quiet"])
def test_auto_scale_is_never_worse_than_2_16(name):
    """The evidence for the default: no more skipped updates, and the loss after a few steps no worse (beyond
    float16 noise), on every test model, on one that overflows at 2^16 and on one with tiny gradients."""
    if name in ("loud", "quiet"):
        torch.manual_seed(0)
        model, inputs = (Loud() if name == "loud" else Quiet()), (data()[0],)
    else:
        model, inputs = example(name, batch=2)
    with torch.no_grad():
        out = model(*inputs)
    y = torch.randint(0, out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(0))
    fixed_skips, fixed_loss = _train(model, inputs, y, 2.0**16, 5)
    auto_skips, auto_loss = _train(model, inputs, y, "auto", 5)
    assert auto_skips == 0 and auto_skips <= fixed_skips
    assert auto_loss <= fixed_loss * 1.005 + 1e-4, (auto_loss, fixed_loss)
    if name == "loud":
        assert fixed_skips >= 3 and auto_loss < fixed_loss


def test_a_checkpoint_before_the_first_update_changes_nothing_and_resumes_as_saved(tmp_path):
    """save_checkpoint on a step that has not updated yet (a run's first checkpoint): torch's set-up of the
    optimizer state it reads (an AdamW step with zero gradients) counted a step and changed every update after. The
    run with it is the run without it; the checkpoint loads into a step that has trained since as that fresh start,
    and one saved after updates still carries the optimizer's state, also into a step holding a half-done
    accumulation cycle's gradients (where torch sets up no state to load into)."""
    def fresh(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        gm = autocastfx.convert(model, (torch.randn(8, 16),), dtype=torch.bfloat16)
        return autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(gm.parameters(), lr=1e-2), **kw)

    def train(step, n):
        g = torch.Generator().manual_seed(1)
        return [float(step(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))) for _ in range(n)]

    plain = fresh()
    expected = train(plain, 4)
    saved = fresh()
    autocastfx.save_checkpoint(saved, tmp_path / "start")
    assert not saved.optimizer.state  # nothing set up, nothing counted
    assert train(saved, 4) == expected
    assert all(torch.equal(a, b) for a, b in zip(plain.gm.parameters(), saved.gm.parameters()))
    autocastfx.save_checkpoint(saved, tmp_path / "after")

    trained = fresh()
    train(trained, 2)
    autocastfx.load_checkpoint(trained, tmp_path / "start")  # back to the start: the optimizer's state dropped
    assert not trained.optimizer.state
    assert train(trained, 4) == expected
    resumed = fresh()
    autocastfx.load_checkpoint(resumed, tmp_path / "after")  # after updates: AdamW's state comes back
    assert {float(s["step"]) for s in resumed.optimizer.state.values()} == {4.0}
    assert all(torch.equal(a, b) for a, b in zip(saved.gm.parameters(), resumed.gm.parameters()))
    pending = fresh(accum_steps=2)
    train(pending, 1)  # half an accumulation cycle: gradients held, no optimizer state yet
    autocastfx.load_checkpoint(pending, tmp_path / "after")
    assert {float(s["step"]) for s in pending.optimizer.state.values()} == {4.0}
    assert all(p.grad is None for p in pending.gm.parameters())


def test_a_checkpoint_of_a_model_with_a_tied_head_saves_and_resumes(tmp_path):
    """Before: save_checkpoint raised AttributeError on any model whose head is tied to its embedding (GPT-2,
    nanoGPT): torch's get_state_dict looks each state-dict name up as an attribute, and the converted module holds
    the tied weight under one name."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.fc, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx):
            return self.head(F.gelu(self.fc(self.wte(idx))))

    def fresh():
        torch.manual_seed(0)
        gm = autocastfx.convert(Tied(), (torch.randint(0, 64, (2, 8)),), dtype=torch.bfloat16)
        return autocastfx.train_step(gm, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                                     torch.optim.AdamW(gm.parameters(), lr=1e-2))

    def train(step, n, seed):
        g = torch.Generator().manual_seed(seed)
        return [float(step(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)))
                for _ in range(n)]

    saved = fresh()
    train(saved, 2, 1)
    autocastfx.save_checkpoint(saved, tmp_path / "tied")
    assert "head.weight" in saved.gm.state_dict()  # the model's names, outside a checkpoint
    expected = train(saved, 3, 2)
    resumed = fresh()
    autocastfx.load_checkpoint(resumed, tmp_path / "tied")
    assert train(resumed, 3, 2) == expected


# ------------------------------------------------------------------ what the step leaves as a plain loop would
def _stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(n=6):
    return [data(seed=i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("late", ["unfrozen", "param_group"])
def test_a_parameter_trained_after_the_step_was_built_is_unscaled_and_freed_as_a_plain_loop(dtype, late):
    """A layer unfrozen, or a param group added, after train_step(): its gradient is unscaled and freed at each
    update, so it trains as in the plain loop (before, a float16 update was times the scale and the gradient
    summed over steps)."""
    def run(use_step):
        gm = autocastfx.convert(_stack(), (data()[0],), dtype=dtype)
        first = gm.get_submodule("0")
        temperature = nn.Parameter(torch.ones(()))  # a parameter of the loss, added to the optimizer later

        def loss_fn(out, y):
            return F.cross_entropy(out / temperature, y)
        if late == "unfrozen":
            first.requires_grad_(False)
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        scaled = {"init_scale": 2.0**10} if dtype == torch.float16 else {}
        step = autocastfx.train_step(gm, loss_fn, opt, **scaled) if use_step else None
        for i, (x, y) in enumerate(_batches()):
            if i == 2:
                if late == "unfrozen":
                    first.requires_grad_(True)
                else:
                    opt.add_param_group({"params": [temperature]})
            if step is not None:
                step(x, y)
            else:
                loss_fn(gm(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return first if late == "unfrozen" else temperature
    a, b = run(True), run(False)
    if late == "unfrozen":
        assert a.weight.grad is None
        a, b = a.weight, b.weight
    else:
        assert a.grad is None
    assert (a - b).abs().max().item() < 1e-6


def test_the_steps_state_dict_is_a_snapshot_of_the_optimizer_too():
    gm, opt, step, x, y = setup("adamw")
    for _ in range(3):
        step(x, y)
    snap = step.state_dict()
    frozen = copy.deepcopy(snap)
    for _ in range(3):
        step(x, y)
    for k, st in snap["optimizer"]["state"].items():
        for name, v in st.items():
            assert torch.equal(v, frozen["optimizer"]["state"][k][name]), name


def test_a_fused_optimizer_is_left_as_it_was_for_a_plain_step_after():
    """The step hands the fused kernel found_inf for its own update only (as GradScaler does): a plain
    optimizer.step() after a skipped update still updates."""
    torch.manual_seed(0)
    model = _stack()
    x, y = data()
    gm = autocastfx.convert(model, (x,), dtype=torch.float16)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2, fused=True)
    step = autocastfx.train_step(gm, F.cross_entropy, opt, init_scale=2.0**16)
    step(x * 1e4, y)
    assert step.stats.summary()["skipped"] == 1
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    w = gm.get_submodule("0").weight.detach().clone()
    F.cross_entropy(gm(x), y).backward()
    opt.step()
    assert not torch.equal(w, gm.get_submodule("0").weight)


@pytest.mark.parametrize("how", ["load_state_dict", "load_checkpoint", "param_group"])
def test_a_skipped_first_fused_sgd_update_leaves_zero_momentum_whatever_came_before(how, tmp_path):
    """torch's fused SGD allocates a new momentum buffer with empty_like and a skipped update leaves it so; the
    step starts each new buffer at zero, after a load or for a group added later too."""
    weights = [1e6, 1.0, 1.0, 1.0]  # the first update overflows float16 and is skipped

    def make(fused):
        gm = autocastfx.convert(_stack(), (data()[0],), dtype=torch.float16)
        params = list(gm.parameters()) if how != "param_group" else list(gm.get_submodule("2").parameters())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=fused)
        return gm, autocastfx.train_step(gm, lambda out, y, w: F.cross_entropy(out, y) * w, opt, init_scale=2.0**8)

    def train(gm, step):
        for i, ((x, y), w) in enumerate(zip(_batches(4), weights)):
            if how == "param_group" and i == 0:
                step.optimizer.add_param_group({"params": list(gm.get_submodule("0").parameters())})
            step(x, y, torch.tensor(w))
        return max(p.abs().max().item() for p in gm.parameters())

    fresh = train(*make(True))
    gm, step = make(True)
    if how == "load_state_dict":
        step.load_state_dict(make(False)[1].state_dict())
    elif how == "load_checkpoint":
        autocastfx.save_checkpoint(make(False)[1], tmp_path)
        autocastfx.load_checkpoint(step, tmp_path)
    assert math.isfinite(train(gm, step))
    assert abs(train(*make(True)) - fresh) < 1e-6 and fresh < 1.0


def test_a_retried_batch_updates_the_batch_norm_statistics_once():
    """on_overflow="retry" redoes the batch from the buffers it started with: the statistics are those of one
    forward of the batch, and the counter counts it once."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    x, y = data()
    ref = autocastfx.convert(copy.deepcopy(base), (x,), dtype=torch.float16)
    gm = autocastfx.convert(base, (x,), dtype=torch.float16)
    step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out, y) * 1e3,
                                 torch.optim.SGD(gm.parameters(), lr=0.01), init_scale=2.0**16, on_overflow="retry")
    step(x, y)
    assert step.stats.summary()["scale"] < 2.0**16  # it retried
    ref(x)
    bn, bn_ref = gm.get_submodule("1"), ref.get_submodule("1")
    assert int(bn.num_batches_tracked) == 1
    assert torch.equal(bn.running_mean, bn_ref.running_mean) and torch.equal(bn.running_var, bn_ref.running_var)


def test_auto_init_scale_is_measured_before_clipping():
    """init_scale="auto" sizes the scale on the gradients as computed, not as clipped: clipping does not lead to
    a scale too large and the skipped updates that follow."""
    def skipped(clip):
        torch.manual_seed(0)
        model = _stack()
        x, y = data()
        gm = autocastfx.convert(model, (x,), dtype=torch.float16)
        step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out, y) * 300.0,
                                     torch.optim.AdamW(gm.parameters(), lr=1e-3), clip_grad_norm=clip)
        for xb, yb in _batches(8):
            step(xb * 30, yb)
        return step.stats.summary()["skipped"], step.stats.summary()["scale"]
    assert skipped(None) == skipped(1e-3)


def test_a_checkpoint_loads_where_a_trainable_parameter_had_no_optimizer_state(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

        def forward(self, x):
            h = F.relu(self.body(x))
            return self.head(h), self.aux(h)

    torch.manual_seed(0)
    base = TwoHeads()
    x, y = data()

    def make():
        gm = autocastfx.convert(copy.deepcopy(base), (x,), dtype=torch.bfloat16)
        return gm, autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out[0], y),
                                         torch.optim.AdamW(gm.parameters(), lr=1e-2))
    gm, step = make()
    step(x, y)
    autocastfx.save_checkpoint(step, tmp_path)
    gm2, step2 = make()
    autocastfx.load_checkpoint(step2, tmp_path)
    assert gm2.aux.weight not in step2.optimizer.state
    for s in (step, step2):
        for _ in range(2):
            s(x, y)
    for a, b in zip(gm.parameters(), gm2.parameters()):
        assert torch.equal(a, b)


def test_clipping_measures_every_trained_gradient_as_under_fsdp2():
    """The global norm covers the parameters the step trains (the module's that require grad, as
    ``clip_grad_norm_(gm.parameters())`` in a plain loop and the step under FSDP2), not only the optimizer's
    (before: 0.58 where the loop measures 1.05, with the head not yet in the optimizer)."""
    x, y = data()
    gm = autocastfx.convert(_stack(), (x,), dtype=torch.bfloat16)
    ref = autocastfx.convert(_stack(), (x,), dtype=torch.bfloat16)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.get_submodule("0").parameters(), lr=0.1),
                                 clip_grad_norm=0.05)
    step(x, y)
    F.cross_entropy(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert abs(float(step.stats.grad_norm) - float(want)) < 1e-4 * float(want)


def test_a_parameter_frozen_mid_accumulation_has_its_gradient_unscaled_and_freed():
    """Frozen after the first of two micro-batches: the optimizer still steps the gradient it holds, so the step
    unscales and frees it (before: applied at the scale, 6.2 where a plain loop moves it 0.006)."""
    x, y = data()
    gm = autocastfx.convert(_stack(), (x,), dtype=torch.float16)
    w = gm.get_submodule("0").weight
    start = w.detach().clone()
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1), accum_steps=2,
                                 init_scale=1024.0)
    step(x, y)
    w.requires_grad_(False)
    step(x, y)
    assert w.grad is None and (w - start).abs().max().item() < 0.1


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_first_update_of_a_damped_fused_sgd_leaves_no_momentum(fused):
    """With dampening, no start value of the buffer stands for torch's first update (the buffer is the gradient):
    the fused skip left torch's uninitialised buffer as the momentum, and the weights went to 1e27 or NaN. The
    first update of such a group is skipped from the host, as a plain loop skips it."""
    weights = [1e6, 1.0, 1.0, 1.0]  # the first update overflows float16 and is skipped

    def run(use_fused):
        gm = autocastfx.convert(_stack(), (data()[0],), dtype=torch.float16)
        opt = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9, dampening=0.5, fused=use_fused)
        step = autocastfx.train_step(gm, lambda out, y, w: F.cross_entropy(out, y) * w, opt, init_scale=2.0**8)
        for (x, y), w in zip(_batches(4), weights):
            step(x, y, torch.tensor(w))
        assert step.stats.summary()["skipped"] == 1
        return [p.detach().clone() for p in gm.parameters()]

    got, want = run(fused), run(False)
    assert all(torch.isfinite(p).all() for p in got)
    assert max((p - q).abs().max().item() for p, q in zip(got, want)) < 1e-5


def test_a_retry_under_hysteresis_redoes_the_batch_at_a_lower_scale():
    """With hysteresis, an overflow lowers the scale only after N of them, so a retry redid the batch at the same
    scale, overflowed again, and lost the update once the retries ran out (4 of 6 batches applied). A retry now
    lowers the scale itself."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(6)]

    def applied(hysteresis):
        torch.manual_seed(0)
        gm = autocastfx.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), (batches[0][0],),
                                dtype=torch.float16)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
        step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out, y) * 3000, opt, init_scale=2.0**9,
                                     on_overflow="retry", max_retries=2, hysteresis=hysteresis)
        for x, y in batches:
            step(x, y)
        assert any(overflow for _, overflow in step.stats.history())  # retries happened
        return int(next(iter(opt.state.values()))["step"])

    assert applied(2) == applied(1) == 6


def test_dynamic_scaling_options_given_where_no_dynamic_scale_runs_are_named():
    """bfloat16 with init_scale and hysteresis, or a static scale with a growth interval: the options were
    accepted and did nothing, without a word."""
    def build(dtype, **kw):
        gm = autocastfx.convert(_stack(), (data()[0],), dtype=dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1), **kw)
        return [str(w.message) for w in caught if "dynamic loss scaling only" in str(w.message)]

    assert build(torch.bfloat16, init_scale=1024.0, hysteresis=4) == [
        "autocastfx: init_scale=1024.0, hysteresis=4 apply to dynamic loss scaling only, and bfloat16 needs no loss "
        "scale: they are not used. Drop them, or pass loss_scale='dynamic'"]
    assert "static (512)" in build(torch.float16, loss_scale=512.0, growth_interval=5)[0]
    assert build(torch.float16, init_scale=1024.0, hysteresis=4) == []
    assert build(torch.bfloat16) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sparse_embedding_gradient_is_unscaled_and_checked(dtype):
    """``nn.Embedding(sparse=True)``: the step's fused unscale-and-check has no sparse kernel and raised torch's
    NotImplementedError, with the gradient left on the weight; GradScaler handles the sparse gradient's values."""
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(50, 16, sparse=True), nn.Linear(16, 4)

        def forward(self, ids):
            return self.fc(self.emb(ids).mean(1))

    torch.manual_seed(0)
    ids, y = torch.randint(0, 50, (8, 6)), torch.randint(0, 4, (8,))
    model = Bag()
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (ids,), dtype=dtype)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        step(ids, y)
        with torch.autocast("cpu", dtype):
            out = ref(ids)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    assert model.emb.weight.grad is None
    assert (model.emb.weight - ref.emb.weight).abs().max().item() < 1e-2


def test_a_parameter_of_the_loss_beside_the_modules_own_trains_as_under_gradscaler():
    """A learned loss weighting in the optimizer beside gm.parameters() was refused at train_step() (and accepted
    when added with add_param_group later): it is none of the model's, and the step trains it as a plain loop."""
    def run(use_step):
        torch.manual_seed(0)
        gm = autocastfx.convert(_stack(), (data()[0],), dtype=torch.float16)
        s = nn.Parameter(torch.zeros(()))
        opt = torch.optim.SGD([*gm.parameters(), s], lr=0.1)
        loss = lambda out, y: F.cross_entropy(out, y) * torch.exp(-s) + s
        if use_step:
            step = autocastfx.train_step(gm, loss, opt, init_scale=2.0**8)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for x, y in _batches(4):
            if use_step:
                step(x, y)
            else:
                scaler.scale(loss(gm(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        return s.item(), [p.detach().clone() for p in gm.parameters()]

    (s1, w1), (s2, w2) = run(True), run(False)
    assert s1 != 0.0 and abs(s1 - s2) < 1e-6
    assert max((p - q).abs().max().item() for p, q in zip(w1, w2)) < 1e-6
