"""Memory of a training step against autocast + GradScaler, counted as bench/ counts it (tensor storage alive,
by holder), and what the step keeps between calls."""
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import autocastfx
from small_models import ALL, example

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from measure import Runner  # noqa: E402


def _workload(name):
    model, inputs = example(name, batch=4)
    if name == "gpt":
        return model, inputs, torch.roll(inputs[0], -1, 1), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
    return model, inputs, torch.arange(4) % 10, F.cross_entropy


# bfloat16 where the dtype changes no byte of the account (2 bytes either way) and its CPU kernels are fast;
# float16 (GradScaler and the dynamic loss scale holding their state) on the smallest model
DTYPES = {name: torch.float16 if name == "mobilenet" else torch.bfloat16 for name in ALL}


@pytest.mark.parametrize("name", ALL)
def test_between_steps_no_more_than_autocast(name):
    model, inputs, target, loss_fn = _workload(name)
    ac = Runner("autocast", model, inputs, target, loss_fn, dtype=DTYPES[name]).memory()
    fx = Runner("autocastfx", model, inputs, target, loss_fn, dtype=DTYPES[name]).memory()
    assert fx.grads == 0  # no gradient of any precision is kept between steps
    assert fx.between <= ac.between, (fx, ac)
    # the peak: float32 masters + float16 weights + optimizer state + the float32 gradients of one update;
    # autocast holds float32 weights + float32 gradients + optimizer state. Within 10% on these small models,
    # where weights, not activations, dominate
    assert fx.peak <= 1.10 * ac.peak, (fx.peak, ac.peak)


def test_master_gradients_are_freed_after_each_update():
    model, inputs, target, loss_fn = _workload("resnet")
    gm = autocastfx.convert(model, inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    for _ in range(2):
        step(inputs, target)
        assert all(p.grad is None for p in gm.parameters())
        assert all(m.grad is None for m in autocastfx.master_parameters(gm))
    assert not hasattr(step, "master_grads")


def test_load_state_dict_copies_the_checkpoint_and_keeps_the_fused_skip():
    model, inputs, target, loss_fn = _workload("resnet")
    gm = autocastfx.convert(model, inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    step(inputs, target)
    sd = step.state_dict()
    for group in sd["optimizer"]["param_groups"]:  # as a checkpoint of a plain optimizer would have it
        group["fused"] = False
    kept = copy.deepcopy(sd["optimizer"]["state"])
    step.load_state_dict(sd)
    assert all(g["fused"] for g in step.optimizer.param_groups)
    for _ in range(2):
        step(inputs, target)
    for k, st in kept.items():  # training on did not write into the caller's checkpoint
        for n, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, sd["optimizer"]["state"][k][n]), (k, n)


class _OptimizerLayouts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for each fused optimizer kernel call, the parameters whose gradient has other strides."""

    def __init__(self):
        super().__init__()
        self.calls, self.mismatches = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname.startswith("_fused_"):
            self.calls += 1
            params, grads = args[0], args[1]
            self.mismatches += [(tuple(p.shape), p.stride(), g.stride()) for p, g in zip(params, grads)
                                if p.stride() != g.stride()]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [True, False])
def test_master_gradients_take_each_masters_layout(fused):
    """A model whose weights are stored channels_last (``model.to(memory_format=torch.channels_last)``) keeps
    that layout in its masters; each master's gradient must have it too, since fused and foreach optimizer
    kernels walk a parameter and its gradient as flat memory. Trained side by side with the same model stored
    NCHW, the masters must agree."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    x, target = torch.randn(4, 3, 8, 8), torch.arange(4)
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        m = copy.deepcopy(model).to(memory_format=layout)
        gm = autocastfx.convert(m, (x,), memory_format="preserve")
        masters = autocastfx.master_parameters(gm)
        if layout is torch.channels_last:
            assert any(p.dim() == 4 and not p.is_contiguous() for p in masters)
        step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9, fused=fused))
        with _OptimizerLayouts() as seen:
            for _ in range(3):
                step(x, target)
        if fused:  # at the aten level: the fused kernel saw every gradient laid out as its parameter
            assert seen.calls and seen.mismatches == [], seen.mismatches
        results.append([p.detach().clone().contiguous() for p in masters])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # float16 kernels of the two layouts sum in other orders


_Fake = torch._subclasses.fake_tensor.FakeTensor


class _BigCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records real (not fake, not meta) tensors of at least ``numel`` elements in new memory that ops create (views and
    in-place results, which share an input's storage, are not counted)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and not isinstance(t, _Fake)}
        for o in torch.utils._pytree.tree_leaves(out):
            if (isinstance(o, torch.Tensor) and o.numel() >= self.numel and not isinstance(o, _Fake)
                    and o.device.type != "meta" and o.untyped_storage().data_ptr() not in ins):
                self.made.append((func._opname, o.dtype))
        return out


def test_convert_makes_no_second_float32_copy_of_the_model():
    """The model's weights are read, not copied, until the conversion knows which it stores low: the only
    float32 copies of a big weight are its master, and the one low copy is the module's weight. Nothing the
    converted module or its training does reaches the model afterwards."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10))
    x = torch.randn(4, 256)
    before = copy.deepcopy(model.state_dict())
    with _BigCopies(256 * 256) as rec:
        gm = autocastfx.convert(model, (x,))
    assert sorted(rec.made) == [("_to_copy", torch.float16), ("clone", torch.float32)], rec.made
    theirs = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    ours = list(gm.parameters()) + list(gm.buffers()) + autocastfx.master_parameters(gm)
    assert not any(t.untyped_storage().data_ptr() in theirs for t in ours)
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(3):
        step(x, torch.arange(4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(gm.get_parameter("1.weight"), model[1].weight)  # the float32 norm weight trained


def test_tied_and_unused_parameters_of_the_model_in_its_optimizer():
    """An optimizer built over the original model's parameters: a weight tied under two names is one
    master, a tensor attribute and a buffer are the converted module's own, and a parameter the forward never
    reads is left out of the update (it gets no gradient, as in the model itself)."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.fc2 = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
            self.fc2.weight = self.fc.weight
            self.unused = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(4))
            self.const = torch.full((4,), 2.0)

        def forward(self, x):
            return self.fc(x) * self.scale + self.fc2(x) * self.const

    torch.manual_seed(0)
    model, x, y = Tied(), torch.randn(4, 8), torch.randn(4, 4)
    before = copy.deepcopy(model.state_dict())
    gm = autocastfx.convert(model, (x,))
    assert gm.const.untyped_storage().data_ptr() != model.const.untyped_storage().data_ptr()
    step = autocastfx.train_step(gm, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2))
    (group,) = step.optimizer.param_groups
    assert len(group["params"]) == 3 and all(p is not None for p in group["params"])  # fc.weight, fc.bias, fc2.bias
    for _ in range(3):
        step(x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    sd = gm.state_dict()
    assert torch.equal(sd["fc.weight"], sd["fc2.weight"]) if "fc2.weight" in sd else True


def test_own_tensors_copies_as_deepcopy_would():
    """Tensors the converted module shares with the model are copied once each: a tensor held twice stays one
    tensor, two views of one storage stay views of one new storage, parameters stay parameters."""
    from autocastfx.capture.ownership import own_tensors

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(4, 4))
    model.register_buffer("table", torch.randn(8))
    model.register_buffer("front", model.table[:4])  # a view of another buffer
    gm = torch.nn.Module()
    gm.a, gm.b = torch.nn.Module(), torch.nn.Module()
    gm.a.w = gm.b.w = model.w  # held twice
    gm.a.register_buffer("table", model.table)
    gm.b.register_buffer("front", model.front)
    gm.b.const = model.table  # a plain attribute
    assert own_tensors(gm, model) == 5
    assert gm.a.w is gm.b.w and isinstance(gm.a.w, torch.nn.Parameter) and gm.a.w is not model.w
    assert torch.equal(gm.a.w, model.w) and gm.a.w.requires_grad
    mine = gm.a.table.untyped_storage().data_ptr()
    assert mine != model.table.untyped_storage().data_ptr()
    assert gm.b.front.untyped_storage().data_ptr() == mine == gm.b.const.untyped_storage().data_ptr()
    gm.a.table.zero_()
    assert not gm.b.front.any() and model.front.abs().sum() > 0  # the views followed their new storage
    assert own_tensors(gm, model) == 0
