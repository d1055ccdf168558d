"""A converted module never runs on a stale low-precision copy of its weights.

Its parameters are the float32 model's own, and its graph casts each weight to the low dtype in every forward.
So whatever changes a parameter (an optimizer step of any implementation, ``load_state_dict``, an initialiser
under ``torch.no_grad()``, an in-place ``.data`` edit, a new ``.data`` tensor, an edit made through the
unconverted model, the training step) shows in the very next forward. Each test compares that forward
with a fresh conversion of the updated float32 weights (bit for bit: the same program on the same values) and
requires that it moved away from the output before the change. ``for_inference`` is the one deliberate
exception: a deployment copy, which keeps the weights it was made from.

Last, an aten-level check of dtypes under a caller's autocast of another low dtype.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder, one_thread_quiet

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    with one_thread_quiet():
        yield


class Net(nn.Module):
    """A convolution with a BatchNorm (different in train and eval mode), then a linear, a LayerNorm and a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(F.gelu(self.norm(self.fc(x))))


def _x(seed=1):
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def _converted(seed=0):
    torch.manual_seed(seed)
    model = Net()
    with torch.no_grad():  # running statistics of their own, so eval mode differs from train mode
        model.bn.running_mean.normal_(0, 0.3)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model, autocastfx.convert(model, (_x(),), dtype=BF16)


def fresh_output(gm, x, training, memory_format=None):
    """What a fresh conversion of gm's current float32 weights (and buffers) gives on ``x`` in that mode."""
    state = {k: v.detach().clone() for k, v in gm.state_dict().items()}
    model = Net()
    model.load_state_dict(state)
    if memory_format is not None:
        model.to(memory_format=memory_format)
    fresh = autocastfx.convert(model, (x,), dtype=BF16)
    fresh.train(training)
    with torch.no_grad():
        return fresh(x)


def assert_fresh(gm, x, before, training, memory_format=None):
    """gm's output on ``x`` equals a fresh conversion's, bit for bit, and is not the output before the change."""
    want = fresh_output(gm, x, training, memory_format)
    gm.train(training)
    with torch.no_grad():
        got = gm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if before is not None:
        moved = float((got - before).abs().max())
        assert moved > 1e-2 * float(want.abs().max()), f"the output did not move ({moved:.3g}): stale weights"


def _loss(out):
    return out.square().mean()


def _optimizer_step(make_opt):
    def edit(gm, model, x):
        opt = make_opt(gm.parameters())
        for _ in range(2):
            _loss(gm(x)).backward()
            opt.step()
            opt.zero_grad()
    return edit


def _adam_capturable(params):
    return torch.optim.Adam(params, lr=0.05, capturable=True)


def _load_other_state(gm, model, x):
    torch.manual_seed(7)
    other = Net()
    gm.load_state_dict(other.state_dict())


def _no_grad_init(gm, model, x):
    with torch.no_grad():
        for p in gm.parameters():
            nn.init.normal_(p, std=0.3)


def _data_mul(gm, model, x):
    for p in gm.parameters():
        p.data.mul_(2)


def _data_assign(gm, model, x):
    g = torch.Generator().manual_seed(3)
    for p in gm.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3


def _edit_the_unconverted_model(gm, model, x):
    with torch.no_grad():
        model.head.weight.mul_(-1.5)
        model.conv.weight.add_(0.2)


def _generated_step(gm, model, x):
    opt = torch.optim.SGD(gm.parameters(), lr=0.5)
    step = autocastfx.train_step(gm, _loss, opt)
    step(x)
    step(x)


EDITS = {
    "SGD(foreach=True)": _optimizer_step(lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=True)),
    "SGD(foreach=False)": _optimizer_step(lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=False)),
    "AdamW(fused=True)": _optimizer_step(lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True)),
    "Adam(capturable=True)": _optimizer_step(_adam_capturable),
    "gm.load_state_dict": _load_other_state,
    "nn.init.normal_ under no_grad": _no_grad_init,
    "p.data.mul_(2)": _data_mul,
    "p.data = new tensor": _data_assign,
    "edit of the unconverted model": _edit_the_unconverted_model,
    "autocastfx.train_step": _generated_step,
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("how", list(EDITS))
def test_next_forward_sees_the_change(how, training):
    """After each way of changing parameters (optimizer steps of each implementation, ``load_state_dict``, an
    initialiser under no_grad, ``.data`` edits in place and by assignment, an edit made through the unconverted
    model whose tensors gm shares, two steps of ``autocastfx.train_step``), gm's next forward, in train and in
    eval mode, equals a fresh conversion of the updated float32 weights and differs from its output before: a
    low-precision copy cached anywhere (per mode, per version counter, per storage) would fail one of them."""
    if how == "Adam(capturable=True)":
        try:
            probe = nn.Parameter(torch.zeros(1))
            probe.grad = torch.ones(1)
            _adam_capturable([probe]).step()
        except (RuntimeError, AssertionError) as e:  # torch asserts the device in the step
            pytest.skip(f"Adam(capturable=True) is refused on the CPU by this torch: {e}")
    model, gm = _converted()
    x = _x()
    gm.train(training)
    with torch.no_grad():
        gm(x)  # a forward in this mode first: anything it could cache is in place before the change
        before = gm(x)
    EDITS[how](gm, model, x)
    assert [p.dtype for p in gm.parameters()] == [torch.float32] * len(list(gm.parameters()))
    assert all(a is b for a, b in zip(gm.parameters(), model.parameters()))
    assert_fresh(gm, x, before, training)
    # and again: a second change after the forward that followed the first
    with torch.no_grad():
        again_before = gm(x)
    _data_mul(gm, model, x)
    assert_fresh(gm, x, again_before, training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_switching_modes_between_changes(training):
    """Both modes' programs run before the change (a converted module may keep a program per mode); the change, made
    while in one mode, shows in the next forward of the other mode, and then of its own: a copy kept per mode
    would be stale in one of them."""
    model, gm = _converted()
    x = _x()
    gm.train(training)
    with torch.no_grad():
        first = gm(x)
        gm.train(not training)
        other_before = gm(x)
        gm.train(training)
    _data_mul(gm, model, x)
    assert_fresh(gm, x, other_before, not training)
    assert_fresh(gm, x, first, training)


@pytest.mark.parametrize("to", ["cpu", "channels_last"])
def test_module_to_keeps_the_parameters_live(to):
    """``gm.to("cpu")`` and ``gm.to(memory_format=torch.channels_last)`` (which gives the 4-D convolution weight a
    new ``.data``): the output is a fresh conversion's of the same weights in that layout, the parameters are
    still the model's objects, and a later in-place edit still shows in the next forward."""
    model, gm = _converted()
    x = _x()
    with torch.no_grad():
        before = gm(x)
    kwargs = {"memory_format": torch.channels_last} if to == "channels_last" else {}
    out = gm.to("cpu", **kwargs) if to == "cpu" else gm.to(**kwargs)
    assert out is gm
    fmt = kwargs.get("memory_format")
    if fmt is not None:
        assert gm.get_parameter("conv.weight").is_contiguous(memory_format=fmt)
    assert all(a is b for a, b in zip(gm.parameters(), model.parameters()))
    assert_fresh(gm, x, None, True, memory_format=fmt)
    torch.testing.assert_close(gm(x), before, rtol=2e-2, atol=2e-2)  # the same weights, another layout
    _data_mul(gm, model, x)
    assert_fresh(gm, x, before, True, memory_format=fmt)


def test_for_inference_is_a_snapshot():
    """``autocastfx.for_inference(gm)`` is a deployment copy: its weights are stored low, made from gm's weights
    at that moment, and it does NOT follow later edits of gm (gm itself does). Documented here so that nobody
    mistakes it for a live view of the training module."""
    model, gm = _converted()
    x = _x()
    gm.eval()
    inf = autocastfx.for_inference(gm)
    with torch.no_grad():
        inf_before = inf(x)
        gm_before = gm(x)
    torch.testing.assert_close(inf_before, gm_before, rtol=5e-2, atol=5e-2)
    assert not any(p is q for p in inf.parameters() for q in gm.parameters())
    _data_mul(gm, model, x)
    assert_fresh(gm, x, gm_before, False)
    with torch.no_grad():
        assert torch.equal(inf(x), inf_before)  # the snapshot keeps the weights it was made from
        assert not torch.allclose(inf(x), gm(x), rtol=5e-2, atol=5e-2)


def test_a_converted_module_runs_its_own_dtype_under_the_callers_float16_autocast():
    """Under ``torch.autocast("cpu", dtype=torch.float16)``, a module converted to bfloat16 runs its plan: every
    linear inside it (aten addmm/mm, forward and backward) sees bfloat16 and no op inside it sees float16; the
    caller's own matmul after it, in the same autocast region, runs in float16 as autocast says. Recorded at
    the aten level with a TorchDispatchMode (tests/helpers.AtenRecorder), which sees what the kernels receive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    gm = autocastfx.convert(model, (torch.randn(4, 8),), dtype=BF16)
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        with AtenRecorder() as inside:
            y = gm(x)
        with AtenRecorder() as outside:
            z = y @ w
    with AtenRecorder() as backward_inside:
        torch.autograd.grad(y.sum(), list(gm.parameters()))
    assert y.dtype == torch.float32 and z.dtype == torch.float16
    for rec in (inside, backward_inside):
        linears = rec.ops("addmm", "mm")
        assert linears, [c.name for c in rec.calls]
        assert all(set(c.in_dtypes) == {BF16} for c in linears), [(c.name, c.in_dtypes) for c in linears]
        f16 = [c for c in rec.calls if torch.float16 in c.in_dtypes + c.out_dtypes]
        assert not f16, [(c.name, c.in_dtypes, c.out_dtypes) for c in f16]
    caller = outside.ops("mm", "addmm", "matmul")
    assert caller and all(c.in_dtypes == [torch.float16, torch.float16] for c in caller), \
        [(c.name, c.in_dtypes) for c in outside.calls]
