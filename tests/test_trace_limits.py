"""What symbolic tracing cannot see, sent to torch.export or planned as the model means it.

Symbolic tracing records the ops a forward runs on traced values, not the Python around them. Each case here gave a
converted module that computed something else than the model, with no error: a ``torch.no_grad()`` branch trained, a
``torch.autocast(..., enabled=False)`` region run in bfloat16, a branch on ``isinstance(x, torch.Tensor)`` dropped,
the model's own forward hooks left out; and ``1.0 / h`` planned as a division (float16 overflow) where it is a
reciprocal, float32 as on CUDA autocast's list."""
from __future__ import annotations

import copy

import warnings

import pytest
import torch
import torch.nn as nn

import autocastfx
from helpers import AtenRecorder, one_thread_quiet

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    with one_thread_quiet():
        yield


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class _Teacher(nn.Module):
    """A frozen branch under ``torch.no_grad()`` (a teacher or a target network) and a trained one."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(16, 16), nn.Linear(16, 16), how

    def _frozen(self, x):
        return self.a(x)

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                t = self.a(x)
        elif self.how == "decorator":
            t = torch.no_grad()(self._frozen)(x)
        else:
            with torch.set_grad_enabled(False):
                t = self.a(x)
        return (self.b(x) * t).sum()


@pytest.mark.parametrize("how", ["no_grad", "decorator", "set_grad_enabled"])
def test_a_no_grad_region_in_forward_keeps_its_branch_out_of_the_gradients(how):
    """Before: the branch under no_grad got gradients (``a.weight.grad`` set; the input's gradient norm 7.6 where
    the model's is 4.7)."""
    torch.manual_seed(0)
    model, x = _Teacher(how), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    model(xs[0]).backward()
    ref_grad, model.a.weight.grad, model.b.weight.grad = xs[0].grad, None, None
    gm(xs[1]).backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    assert _rel(xs[1].grad, ref_grad) < 2e-2


class _Rotary(nn.Module):
    """Hugging Face Llama's rotary idiom: the position angles in float32 inside ``autocast(enabled=False)``."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.register_buffer("inv_freq", (1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32))[:, None],
                             persistent=False)

    def forward(self, x, pos):
        with torch.autocast(device_type="cpu", enabled=False):
            freqs = (self.inv_freq.float() @ pos.float()).T
            emb = torch.cat((freqs, freqs), dim=-1)
        return self.q(x) * emb.cos()


def test_an_autocast_disabled_region_in_forward_runs_in_float32():
    """Before: the angles' matmul ran in bfloat16 (positions near 4000: outputs 0.78 off float32, where
    torch.autocast is 3e-3 off)."""
    torch.manual_seed(0)
    model = _Rotary()
    x, pos = torch.randn(64, 32), torch.arange(4000, 4064)[None].float()
    gm = autocastfx.convert(model, (x, pos), dtype=BF16)
    with torch.no_grad(), AtenRecorder() as rec:
        out = gm(x, pos)
    assert _rel(out, model(x, pos)) < 2e-2
    assert any(c.in_dtypes == [torch.float32, torch.float32] for c in rec.ops("mm", "matmul"))
    assert any(BF16 in c.in_dtypes for c in rec.ops("addmm", "linear", "mm"))  # the projection stays low


class _Masked(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(16, 16), how

    def forward(self, x, mask):
        h = self.fc(x)
        if self.how == "isinstance" and isinstance(mask, torch.Tensor):
            h = h.masked_fill(mask, 0.0)
        if self.how == "is_tensor" and torch.is_tensor(mask):
            h = h.masked_fill(mask, 0.0)
        return h


@pytest.mark.parametrize("how", ["isinstance", "is_tensor"])
def test_a_branch_on_isinstance_of_an_input_is_kept(how):
    """Before: a traced input is no Tensor to ``isinstance``, so the masking branch was dropped (1.2 off)."""
    torch.manual_seed(0)
    model, x = _Masked(how), torch.randn(4, 16)
    mask = torch.rand(4, 16) > 0.5
    gm = autocastfx.convert(model, (x, mask), dtype=BF16)
    out = gm(x, mask)
    assert bool((out[mask] == 0).all())
    assert _rel(out, model(x, mask)) < 2e-2


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_the_models_own_forward_hooks_run_in_the_converted_module(hook):
    """Before: hooks on the model itself were left out (symbolic tracing runs forward, not the call): 0.67 and 1.6
    off."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), torch.randn(4, 16)
    if hook == "forward":
        model.register_forward_hook(lambda m, i, o: o * 3)
    else:
        model.register_forward_pre_hook(lambda m, i: (i[0] * 0 + 1,))
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert _rel(gm(x), model(x)) < 2e-2


def test_a_scalar_divided_by_a_tensor_is_a_float32_reciprocal():
    """Before: ``1.0 / h`` was planned as a division, low: in float16 a small ``h`` gave inf where float32 gives
    1.7e5 (``torch.reciprocal(h)`` was float32)."""
    class Inverse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return 1.0 / self.fc(x)

    torch.manual_seed(0)
    model, x = Inverse(), torch.randn(64, 8)
    with torch.no_grad():
        model.fc.weight.mul_(1e-3)
        model.fc.bias.fill_(1e-5)
    gm = autocastfx.convert(model, (x,), dtype=torch.float16)
    with torch.no_grad(), AtenRecorder() as rec:
        out = gm(x)
    assert torch.isfinite(out).all()
    assert all(c.in_dtypes[0] == torch.float32 for c in rec.ops("reciprocal", "div"))


class _Reordered(nn.Module):
    """Layers registered in another order than forward runs them."""

    def __init__(self):
        super().__init__()
        self.dec, self.enc, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.register_buffer("scale", torch.ones(32))

    def forward(self, x):
        return self.head(torch.relu(self.dec(torch.relu(self.enc(x)) * self.scale)))


def test_parameters_and_state_dict_come_in_the_models_order_and_an_optimizer_resumes_across():
    """Before: ``gm.parameters()`` listed enc before dec (the graph's order), so an optimizer state saved over
    ``gm.parameters()`` and loaded into one over ``model.parameters()`` gave dec enc's moments, with no error."""
    torch.manual_seed(0)
    model, x, y = _Reordered(), torch.randn(8, 32), torch.randint(0, 4, (8,))
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(gm.state_dict()) == list(model.state_dict())
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    for _ in range(2):
        torch.nn.functional.cross_entropy(gm(x), y).backward()
        opt.step()
        opt.zero_grad()
    again = torch.optim.AdamW(model.parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_a_reentrant_checkpoint_in_forward_still_traces_and_trains():
    """``torch.utils.checkpoint(..., use_reentrant=True)`` runs its function under no_grad and recomputes it with
    gradients in backward: its region is not the model's own grad mode (torch.export's capture of it gave outputs
    that needed no gradient)."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=True))

    model, x = Ckpt(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"activation checkpointing.*activations are kept for backward"):
        gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert gm.meta["autocastfx"].capture == "symbolic_trace"
    gm(x).sum().backward()
    assert model.a.weight.grad is not None and model.b.weight.grad is not None


@pytest.mark.parametrize("capture", ["symbolic_trace", "torch.export"])
def test_checkpointing_in_the_models_forward_is_said_to_be_left_out(capture):
    """timm's ``set_grad_checkpointing(True)`` (``torch.utils.checkpoint`` around its blocks): the converted graph
    holds the ops as plain ops, so their activations are saved as without checkpointing. Said, naming the way to
    recompute (checkpoint_blocks); nothing said for the same model without it."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.grad_checkpointing = nn.Linear(8, 8), nn.Linear(8, 4), False

        def forward(self, x):
            if capture == "torch.export":
                b, *_ = x.shape  # symbolic tracing refuses the unpacking
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False) if self.grad_checkpointing \
                else torch.relu(self.a(x))
            return self.b(h)

    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        autocastfx.convert(Net(), (x,), dtype=BF16)
    assert not [w for w in seen if "checkpointing" in str(w.message)]
    model = Net()
    model.grad_checkpointing = True
    with pytest.warns(UserWarning, match=r"activation checkpointing.*checkpoint_blocks"):
        gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert gm.meta["autocastfx"].capture == capture
    if capture == "symbolic_trace":  # the flag the graph read: switching it on gm names the way that recomputes
        with pytest.raises(ValueError, match=r"no activation checkpointing.*checkpoint_blocks\(gm\)"):
            gm.grad_checkpointing = False


def test_converting_leaves_the_callers_random_state_and_the_models_settings_alone():
    """The value check runs the model: the caller's random state is put back (the CPU's, and no device is seeded),
    and a setting the forward moves is put back too, so convert()'s refusal of a forward that counts its calls
    names the one change a call makes (0 -> 1, not 0 -> 2)."""
    class Counting(nn.Module):
        def __init__(self, counts: bool):
            super().__init__()
            self.fc, self.calls, self.counts = nn.Linear(8, 8), 0, counts

        def forward(self, x):
            if self.counts:
                self.calls += 1
            return torch.nn.functional.dropout(self.fc(x), 0.5, self.training)

    torch.manual_seed(123)
    model, x = Counting(False), torch.randn(4, 8)
    expected = torch.rand(3)
    torch.manual_seed(123)
    model, x = Counting(False), torch.randn(4, 8)
    autocastfx.convert(model, (x,), dtype=BF16)
    assert torch.initial_seed() == 123 and torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match=r"changes its attribute 'calls' \(0 -> 1\)"):
        autocastfx.convert(Counting(True), (x,), dtype=BF16)


class _RowMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, mask=None):
        h = torch.relu(self.l1(x))
        if isinstance(mask, torch.Tensor):  # False for a traced value: the trace drops the mask
            h = h * mask[:, None]
        return self.l2(h)


def test_a_branch_that_spares_the_first_row_is_still_caught():
    """The check runs every row of a small example: a mask that keeps row 0 as it is does not hide the dropped
    branch (before, one row was checked and the trace kept: outputs 0.44 off)."""
    torch.manual_seed(0)
    model = _RowMask()
    x, mask = torch.randn(8, 16), torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0])
    gm = autocastfx.convert(model, (x,), example_kwargs={"mask": mask}, dtype=BF16)
    with torch.no_grad():
        assert _rel(gm(x, mask=mask), model(x, mask=mask)) < 2e-2


def test_a_call_of_another_structure_is_checked_against_the_model_too():
    """Converted from ``(x,)``, ``gm(x, mask=mask)`` is converted on first use: from a copy of the model holding
    gm's own tensors, so its trace is checked as convert()'s is (before, from the model on meta, unchecked: the
    mask was dropped, outputs 0.36 off, and gm(x, mask) equalled gm(x))."""
    torch.manual_seed(0)
    model = _RowMask()
    x, mask = torch.randn(8, 16), torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1])
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    with torch.no_grad():
        assert _rel(gm(x, mask=mask), model(x, mask=mask)) < 2e-2
        assert not torch.equal(gm(x, mask=mask), gm(x))
    gm(x, mask=mask).sum().backward()  # and it trains the model's own parameters
    assert model.l1.weight.grad is not None


class _NormBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            n = h.norm(dim=-1, keepdim=True)  # no gradient through the normaliser
        return x + h / n


class _NormStack(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList([_NormBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("blocks", ["auto", None])
def test_a_no_grad_region_inside_a_block_keeps_its_branch_out_of_the_gradients(blocks):
    """Blocks are captured during a run without gradients: a no_grad region inside one changed no mode there and
    was dropped (the first layer's gradient 0.19 off float32, where autocast is 4e-3 off)."""
    torch.manual_seed(0)
    model, x = _NormStack(), torch.randn(4, 5, 16)
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (x,), dtype=BF16, blocks=blocks)
    gm(x).float().square().sum().backward()
    ref(x).square().sum().backward()
    assert _rel(model.layers[0].fc.weight.grad, ref.layers[0].fc.weight.grad) < 2e-2


class _ItemScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        return self.fc(x) * self.scale.item()


def test_a_buffer_read_into_python_is_read_at_each_call():
    """``self.scale.item()`` on a buffer: symbolic tracing made it the constant 1.0 and left the buffer out of
    gm's state dict; a checkpoint loaded into the model then went unseen (outputs 1.76 where the model gives
    8.78). The capture takes torch.export, which reads the buffer at each call."""
    torch.manual_seed(0)
    model, x = _ItemScale(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert "scale" in gm.state_dict()
    with torch.no_grad():
        model.scale.fill_(5.0)
        assert _rel(gm(x), model(x)) < 2e-2


class _NoiseFromNothing(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(32, 32)

    def forward(self, x):
        return self.l(x) + torch.randn(32)


def test_a_draw_from_no_input_leaves_the_callers_random_stream_as_it_was():
    """The trace runs ``torch.randn(32)`` for real before it goes to torch.export: the draw is undone."""
    torch.manual_seed(0)
    model, x = _NoiseFromNothing(), torch.randn(4, 32)
    before = torch.get_rng_state()
    autocastfx.convert(model, (x,), dtype=BF16)
    assert torch.equal(before, torch.get_rng_state())


class _ObsNorm(nn.Module):
    """A normaliser of inputs whose statistics the loop updates (``update``), read by an expression of the
    buffers alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("running_mean", torch.zeros(16))
        self.register_buffer("running_var", torch.ones(16))

    @torch.no_grad()
    def update(self, x):
        self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.running_var.mul_(0.9).add_(0.1 * x.var(0))

    def forward(self, x):
        return self.fc((x - self.running_mean) / torch.sqrt(self.running_var + 1e-5))


class _EmaWeight(nn.Module):
    """An average of a weight kept as a buffer, updated in forward in training and used in evaluation."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("ema", self.fc.weight.detach().clone())

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.ema.copy_(0.5 * self.ema + 0.5 * self.fc.weight)
            return self.fc(x)
        return nn.functional.linear(x, self.ema, self.fc.bias)


@pytest.mark.parametrize("blocks", ["auto", None])
def test_an_expression_of_buffers_alone_is_computed_at_each_call(blocks):
    """Before: ``torch.sqrt(self.running_var + eps)`` and ``0.5 * self.ema`` were computed once, at the trace, into
    constants of the graph: after the loop's updates gm was 4.2 from the model (autocast 3.3e-3), 8.6 after a
    load_state_dict, and an EMA drifted from the model's by 0.1 in four calls."""
    torch.manual_seed(0)
    model, x = _ObsNorm(), torch.randn(64, 16) * 5 + 3
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (torch.randn(8, 16),), dtype=BF16, blocks=blocks)
    for _ in range(20):
        model.update(x)
        ref.update(x)
    assert _rel(gm(x), ref(x)) < 2e-2
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["running_var"].fill_(100.0)
    gm.load_state_dict(state)
    ref.load_state_dict(state)
    assert _rel(gm(x), ref(x)) < 2e-2
    model, x = _EmaWeight(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (x,), dtype=BF16, blocks=blocks)
    for _ in range(3):
        with torch.no_grad():
            ref.fc.weight.add_(0.1)  # a step on the shared weight, as an optimizer's
            model.fc.weight.add_(0.1)
        gm(x), ref(x)
    torch.testing.assert_close(model.ema, ref.ema)
    gm.eval()
    ref.eval()
    assert _rel(gm(x), ref(x)) < 2e-2


class _WarmUp(nn.Module):
    """A step counter rebound in forward (``self.steps = self.steps + 1``), read as a warm-up factor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.steps = self.steps + 1
        return self.fc(x) * torch.clamp(self.steps / 3.0, max=1.0)


def test_a_buffer_rebound_in_forward_counts_from_the_models_value_at_each_call():
    """Before: the captures moved a copy's counter to 2 and the converted module kept that copy's tensor: its first
    call was 2.0 from the model's, and the warning said it did not set the counter, which it did."""
    torch.manual_seed(0)
    model, x = _WarmUp(), torch.randn(4, 16)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert not [w for w in caught if "'steps'" in str(w.message)], [str(w.message) for w in caught]
    assert float(model.steps) == 0.0
    for i in range(3):
        out, expected = gm(x), ref(x)
        assert float(model.steps) == float(ref.steps) == i + 1
        assert _rel(out, expected) < 2e-2, i


class _Reversal(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): the identity forward, the negated gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _Adversarial(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(_Reversal.apply(self.a(x)))


class _InferenceTeacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.inference_mode():
            t = self.teacher(x).softmax(-1)
        return self.student(x) * t.clone()


def test_a_custom_autograd_function_and_an_inference_mode_region_keep_their_gradients():
    """Before: a graph held the ops of ``_Reversal.forward`` and autograd differentiated them (a.weight's gradient
    of the wrong sign, 1.8 from the model's), and the ops inside ``torch.inference_mode()`` recorded gradients (the
    teacher trained). Their modules now run as the model's own Python around the converted parts; one graph
    (``blocks=None``) is refused, naming them."""
    torch.manual_seed(0)
    for cls, name in ((_Adversarial, "_Reversal"), (_InferenceTeacher, "inference_mode")):
        model, x = cls(), torch.randn(8, 16)
        gm = autocastfx.convert(model, (x,), dtype=BF16)
        ref = copy.deepcopy(model)
        gm(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            assert p.grad is None or _rel(p.grad, q.grad) < 3e-2, (n, _rel(p.grad, q.grad))
        with pytest.raises(autocastfx.CaptureError, match=name):
            autocastfx.convert(cls(), (x,), dtype=BF16, blocks=None)
