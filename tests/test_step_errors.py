"""The training step's clear failures: each is an autocastfx.StepError that names the problem and the fix, raised
before the step changed anything (the float32 weights, optimizer state, scale state, batch-norm statistics,
counters, the random-number state are all bit-identical afterwards)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from test_step import SyncCounter


class BNNet(nn.Module):
    """linear -> batch norm -> dropout -> linear: buffers and the RNG that a failed forward must not change."""

    def __init__(self, d=12, classes=4):
        super().__init__()
        self.fc1 = nn.Linear(d, 24)
        self.bn = nn.BatchNorm1d(24)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(24, classes)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


class MaskNet(nn.Module):
    """Keyword inputs, like a Hugging Face model's input_ids and attention_mask."""

    def __init__(self, vocab=50, d=16, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.bn = nn.BatchNorm1d(d)
        self.fc = nn.Linear(d, classes)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.fc(self.bn(h.sum(1) / attention_mask.sum(1, keepdim=True)))


def make(loss_fn=F.cross_entropy, model=None, example=None, **kw):
    torch.manual_seed(0)
    model = model or BNNet()
    example = example or (torch.randn(8, 12),)
    gm = autocastfx.convert(model, example)  # padding on: feature width 12 is padded inside the graph
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    step = autocastfx.train_step(gm, loss_fn, opt, **kw)
    return gm, opt, step


def state(gm, opt, step):
    """Everything a step may change, cloned."""
    s = step.state
    return {
        "params": {n: p.detach().clone() for n, p in gm.named_parameters()},
        "buffers": {n: b.clone() for n, b in gm.named_buffers()},
        "masters": [m.detach().clone() for m in autocastfx.master_parameters(gm)],
        "opt": [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for st in opt.state.values()],
        "groups": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "scale": {k: v.clone() if torch.is_tensor(v) else v for k, v in s.state_dict().items()},
        "micro": step.micro,
        "rng": torch.get_rng_state(),
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), k
            for n in x:
                assert torch.equal(x[n], y[n]) if torch.is_tensor(x[n]) else x[n] == y[n], (k, n)
        elif isinstance(x, list) and x and isinstance(x[0], dict):
            for d1, d2 in zip(x, y):
                for n in d1:
                    assert torch.equal(d1[n], d2[n]) if torch.is_tensor(d1[n]) else d1[n] == d2[n], (k, n)
        elif isinstance(x, list) and x and torch.is_tensor(x[0]):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), k
        elif torch.is_tensor(x):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


def fails_cleanly(gm, opt, step, args, match, grad=True):
    """One good step first (optimizer state, batch-norm statistics exist), then ``step(*args)`` changes nothing."""
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    step(x, y)
    before = state(gm, opt, step)
    with pytest.raises(autocastfx.StepError, match=match) as info, torch.set_grad_enabled(grad):
        step(*args)
    assert_same(before, state(gm, opt, step))
    step(x, y)  # still trains afterwards
    assert int(step.stats.steps) == 2
    return str(info.value)


LOSSES = {
    "not_scalar": (lambda out, y: F.cross_entropy(out, y, reduction="none"), r"shape \(6,\).*\.mean\(\)"),
    "not_float": (lambda out, y: (out.argmax(-1) == y).sum(), r"torch.int64, not floating point"),
    "detached": (lambda out, y: F.cross_entropy(out.detach(), y), r"not connected.*detach"),
    "no_grad": (lambda out, y: _no_grad_loss(out, y), r"not connected.*torch.no_grad\(\)"),
    "not_tensor": (lambda out, y: 1.0, r"not a tensor.*out\.loss"),
    "none": (lambda out, y: None, r"NoneType, not a tensor \(None: .*converted without them.*\(x, y\)"),
}


def _no_grad_loss(out, y):
    with torch.no_grad():
        return F.cross_entropy(out, y)


@pytest.mark.parametrize("case", list(LOSSES))
def test_bad_loss_raises_before_anything_changes(case):
    loss_fn, match = LOSSES[case]
    calls = {"n": 0}

    def first_good_then_bad(out, y):  # the first call (the good step) is fine; then the bad loss
        calls["n"] += 1
        return F.cross_entropy(out, y) if calls["n"] == 1 else loss_fn(out, y)
    gm, opt, step = make(first_good_then_bad)
    x, y = torch.randn(6, 12), torch.randint(0, 4, (6,))  # a new signature: its first run is guarded
    step(torch.randn(8, 12), torch.randint(0, 4, (8,)))
    before = state(gm, opt, step)
    with pytest.raises(autocastfx.StepError, match=match):
        step(x, y)
    assert_same(before, state(gm, opt, step))


def test_bad_loss_checks_read_no_values():
    gm, opt, step = make(lambda out, y: F.cross_entropy(out, y, reduction="none"))
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    counter = SyncCounter()
    with counter, pytest.raises(autocastfx.StepError):
        step(x, y)
    assert counter.syncs == []


def test_wrong_feature_width_names_the_input_and_the_example_shape():
    gm, opt, step = make()
    msg = fails_cleanly(gm, opt, step, (torch.randn(8, 9), torch.randint(0, 4, (8,))),
                        r"input 'x' \(position 0\) has shape \(8, 9\)")
    assert "converted with (8, 12) torch.float32" in msg and "convert again" in msg
    assert msg.index("(8, 12)") < msg.index("Inside the module")  # our words first, the padded shapes after


def test_wrong_rank_and_wrong_dtype():
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12, 1), torch.randint(0, 4, (8,))),
                  r"has shape \(8, 12, 1\).*converted with \(8, 12\)")
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12, dtype=torch.float64), torch.randint(0, 4, (8,))),
                  r"input 'x' \(position 0\) is torch.float64.*x.to\(torch.float32\)")
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12).half(), torch.randint(0, 4, (8,))),
                  r"is torch.float16.*cast plan assumes torch.float32")


def test_wrong_device_names_both_devices_and_the_fix():
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12, device="meta"), torch.randint(0, 4, (8,))),
                  r"input 'x' \(position 0\) is on meta but the converted module is on cpu.*\.to\('cpu'\)")
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12), torch.randint(0, 4, (8,), device="meta")),
                  r"target 0 is on meta but the converted module is on cpu")


def test_inputs_that_do_not_fit_the_forward():
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, ((torch.randn(8, 12), torch.randn(8, 12)), torch.randint(0, 4, (8,))),
                  r"do not fit the module's forward\(x\).*too many positional.*step\(inputs, \*targets\)")
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, ({"z": torch.randn(8, 12)}, torch.randint(0, 4, (8,))),
                  r"do not fit.*a dict of keyword inputs")


def test_called_with_gradients_disabled():
    gm, opt, step = make()
    fails_cleanly(gm, opt, step, (torch.randn(8, 12), torch.randint(0, 4, (8,))),
                  r"gradients disabled.*outside those blocks", grad=False)


def test_keyword_input_of_the_wrong_shape():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 50, (4, 8)), torch.ones(4, 8)
    gm = autocastfx.convert(MaskNet(), example_kwargs={"input_ids": ids, "attention_mask": mask})
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    step = autocastfx.train_step(gm, F.cross_entropy, opt)
    y = torch.randint(0, 4, (4,))
    step({"input_ids": ids, "attention_mask": mask}, y)
    before = state(gm, opt, step)
    with pytest.raises(autocastfx.StepError, match=r"keyword input 'attention_mask' has shape \(4, 5\).*\(4, 8\)"):
        step({"input_ids": ids, "attention_mask": torch.ones(4, 5)}, y)
    assert_same(before, state(gm, opt, step))
    step({"input_ids": ids[:, :6], "attention_mask": mask[:, :6]}, y)  # a shorter sequence the model accepts


def test_another_batch_size_keeps_working_and_known_signatures_are_not_rechecked():
    gm, opt, step = make()
    for n in (8, 3, 8, 5):
        loss = step(torch.randn(n, 12), torch.randint(0, 4, (n,)))
        assert loss.shape == () and torch.isfinite(loss)
    assert len(step.checker.seen) == 3


def test_optimizer_over_foreign_tensors_changes_nothing():
    """An optimizer over none of the module's parameters (another model's, and a stray tensor) is refused; a stray
    tensor beside the module's own is a parameter of the loss, and trains (test_step.py)."""
    torch.manual_seed(0)
    model = BNNet()
    gm = autocastfx.convert(model, (torch.randn(8, 12),))
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([{"params": [stray]}, {"params": list(BNNet().parameters())}], lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    masters = [m.detach().clone() for m in autocastfx.master_parameters(gm)]
    with pytest.raises(autocastfx.StepError, match=r"shape \(3,\) \(param group 0, entry 0\).*gm.parameters\(\)"):
        autocastfx.train_step(gm, F.cross_entropy, opt)
    assert [list(g["params"]) for g in opt.param_groups] == groups  # the optimizer's groups untouched
    assert all(a is b for g, h in zip(opt.param_groups, groups) for a, b in zip(g["params"], h))
    assert not opt.defaults.get("fused") and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(masters, autocastfx.master_parameters(gm)))
    assert issubclass(autocastfx.StepError, ValueError)


def test_optimizer_over_a_model_whose_tensors_the_module_does_not_share_names_the_fix():
    """A module converted on the meta device (then gm.to_empty + load_state_dict) has float32 parameters of its
    own, not the model's: an optimizer built over the model's parameters would train tensors the module never
    reads. The step refuses it before anything changes, naming the fix; over gm.parameters() it trains. (A
    low-precision model's tensors are made float32 in place and shared: tests/test_large_models.py.)"""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    make_model = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # noqa: E731
    with torch.device("meta"):
        model = make_model()
    gm = autocastfx.convert(model, (x,))
    gm.to_empty(device="cpu")
    gm.load_state_dict(make_model().state_dict())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in gm.parameters())
    assert not {id(p) for p in gm.parameters()} & {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    weights = [p.detach().clone() for p in gm.parameters()]
    says = (r"shape \(16, 8\) \(param group 0, entry 0\) that is a parameter of the model it was converted from, "
            r"which the converted module does not share .*: build the optimizer over gm.parameters\(\)")
    with pytest.raises(autocastfx.StepError, match=says):
        autocastfx.train_step(gm, F.cross_entropy, opt)
    assert all(a is b for g, h in zip(opt.param_groups, groups) for a, b in zip(g["params"], h))
    assert not opt.state and all(torch.equal(a, b) for a, b in zip(weights, gm.parameters()))
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1))
    step(x, y)
    assert not all(torch.equal(a, b) for a, b in zip(weights, gm.parameters()))


def test_cuda_graph_with_retry_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = BNNet()
    gm = autocastfx.convert(model, (torch.randn(8, 12),))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"cuda_graph=True cannot be combined with on_overflow='retry'.*'skip'"):
        autocastfx.train_step(gm, F.cross_entropy, opt, cuda_graph=True, on_overflow="retry")
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], groups[0]))


def test_a_loss_function_error_stays_its_own_and_changes_nothing():
    gm, opt, step = make()
    args = (torch.randn(3, 12), torch.randint(0, 4, (5,)))  # the forward runs; cross_entropy refuses the targets
    step(torch.randn(8, 12), torch.randint(0, 4, (8,)))
    before = state(gm, opt, step)
    with pytest.raises(ValueError, match="batch_size") as info:
        step(*args)
    assert not isinstance(info.value, autocastfx.StepError)  # not blamed on the input's batch size
    assert_same(before, state(gm, opt, step))


def test_a_step_leaves_torchs_clipping_functions_and_the_loops_clip_sees_float32_gradients():
    """Nothing of torch is replaced by building or running a step, and a plain loop's own clip_grad_norm_ over
    gm.parameters() clips the float32 gradients the backward left there: the same norm the float32 model's
    parameters would give for the same gradients."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    before = (utils.clip_grad_norm_, utils.clip_grad_value_, clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    step = autocastfx.train_step(gm, lambda out, t: F.cross_entropy(out.float(), t),
                                 torch.optim.AdamW(gm.parameters(), lr=1e-3))
    step(x, y)
    assert (utils.clip_grad_norm_, utils.clip_grad_value_, clip_grad.clip_grad_norm_,
            clip_grad.clip_grad_value_) == before
    F.cross_entropy(gm(x), y).backward()
    grads = [p.grad for p in gm.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    norm = torch.nn.utils.clip_grad_norm_(gm.parameters(), 1e-3)
    assert float(norm) == pytest.approx(float(expected)) and float(norm) > 0
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in gm.parameters()]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)


def test_optimizer_state_from_before_a_low_precision_model_was_upcast_names_the_reload():
    """A bfloat16 model that an Adam has stepped, then converted (upcast in place to float32): the optimizer's
    moments are still bfloat16, which torch's own step rejects with a bare dtype error. The step names the reload,
    and after it trains as float32 Adam from the same state does."""
    import warnings
    torch.manual_seed(0)
    model, x = BNNet().bfloat16(), torch.randn(8, 12)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(x.bfloat16()).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    with pytest.warns(UserWarning, match=r"optimizer\.load_state_dict\(optimizer\.state_dict\(\)\)"):
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(autocastfx.StepError, match=r"exp_avg, exp_avg_sq of a float32 parameter.*is bfloat16.*"
                                                       r"optimizer\.load_state_dict\(optimizer\.state_dict\(\)\)"):
            autocastfx.train_step(gm, lambda out: out.float().square().mean(), opt)
        opt.load_state_dict(opt.state_dict())
        step = autocastfx.train_step(gm, lambda out: out.float().square().mean(), opt)
        opt.param_groups[0]["lr"] = 3e-2
        losses = [float(step(x)) for _ in range(8)]
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    assert losses[-1] < losses[0]


class _LowMomentumSGD(torch.optim.Optimizer):
    """SGD with momentum kept in bfloat16 by design (as AnyPrecisionAdamW keeps its moments)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p, dtype=torch.bfloat16))
                buf.mul_(0.9).add_(p.grad.to(torch.bfloat16))
                p.add_(buf.float(), alpha=-group["lr"])


def test_an_optimizer_that_keeps_low_precision_state_by_design_is_not_refused():
    """Only state from before convert() upcast the model is stale: an optimizer built over the converted module that
    keeps bfloat16 state by design trains through one step and then a second one built on it."""
    torch.manual_seed(0)
    model, x = BNNet(), torch.randn(8, 12)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    opt = _LowMomentumSGD(gm.parameters())
    loss = lambda out: out.float().square().mean()  # noqa: E731
    first = [float(autocastfx.train_step(gm, loss, opt)(x)) for _ in range(2)]
    again = autocastfx.train_step(gm, loss, opt, accum_steps=2)
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values())
    assert float(again(x)) < first[0]
