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
    # the peak: float32 weights + their low copies cast in the forward + optimizer state + the float32
    # gradients of one update, as autocast holds them (its cast cache). Within 10% on these small models,
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
    """A checkpoint whose groups say fused=False (a plain loop's) loads into a fused optimizer's step: the
    optimizer keeps its own kernel, whose found_inf the step feeds."""
    model, inputs, target, loss_fn = _workload("resnet")
    gm = autocastfx.convert(model, inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3, fused=True))
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


def test_convert_makes_no_copy_of_any_parameter():
    """The converted module holds the model's own tensors: convert makes no copy of a big weight at all (not a
    float32 copy, not a low one: the graph casts the weights it reads low in each forward), and training the
    converted module trains the model, whose state dict is the converted module's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10))
    x = torch.randn(4, 256)
    before = copy.deepcopy(model.state_dict())
    with _BigCopies(256 * 256) as rec:
        gm = autocastfx.convert(model, (x,))
    assert rec.made == [], rec.made
    theirs = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    ours = list(gm.parameters()) + list(gm.buffers()) + autocastfx.master_parameters(gm)
    assert ours and all(id(t) in theirs for t in ours)
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(3):
        step(x, torch.arange(4))
    trained = model.state_dict()
    assert trained.keys() == gm.state_dict().keys()
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in trained.items())
    assert not torch.equal(before["1.weight"], model[1].weight)  # the float32 norm weight trained
    assert not torch.equal(before["0.weight"], model[0].weight)  # and the weight the graph casts low


def test_tied_and_unused_parameters_of_the_model_in_its_optimizer():
    """An optimizer built over the original model's parameters trains the converted module as it is (they are
    its parameters): a weight tied under two names is one parameter, the buffer is the model's, a plain tensor
    attribute becomes a buffer of the converted module that is the model's tensor (no copy), and a parameter the
    forward never reads gets no gradient and is left as it was, as in the model itself."""

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
    assert gm.const.untyped_storage().data_ptr() == model.const.untyped_storage().data_ptr()
    assert gm.scale is model.scale and gm.fc.weight is model.fc.weight is model.fc2.weight
    step = autocastfx.train_step(gm, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2))
    (group,) = step.optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]  # the model's five, as given
    for _ in range(3):
        step(x, y)
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    for k in ("unused.weight", "unused.bias", "scale"):
        assert torch.equal(before[k], model.state_dict()[k]), k
    for k in ("fc.weight", "fc.bias", "fc2.bias"):
        assert not torch.equal(before[k], model.state_dict()[k]), k
    sd = gm.state_dict()
    assert torch.equal(sd["fc.weight"], sd["fc2.weight"]) if "fc2.weight" in sd else True
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in sd.items() if k != "const")  # the keys gm has


def test_convert_shares_the_models_tensors_as_they_are():
    """No tensor of the model is copied: a parameter held twice stays one parameter (the model's), a buffer that
    is a view of another stays a view of the model's storage, parameters stay the same Parameter objects, and a
    write to the model's buffer is seen by the converted module."""

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight  # held twice
            self.register_buffer("table", torch.randn(8))
            self.register_buffer("front", self.table[:4])  # a view of another buffer

        def forward(self, x):
            return self.a(x) + self.b(x) * self.table[4:] + self.front

    torch.manual_seed(0)
    model, x = Views(), torch.randn(2, 4)
    gm = autocastfx.convert(model, (x,))
    params = dict(gm.named_parameters(remove_duplicate=False))
    assert params["a.weight"] is model.a.weight and isinstance(params["a.weight"], torch.nn.Parameter)
    assert all(p is model.get_parameter(n) for n, p in params.items())
    assert gm.get_buffer("front") is model.front
    # the slice of the table the forward reads is a view of the model's storage, like the buffer "front"
    table = model.table.untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == table for b in gm.buffers())
    with torch.no_grad():
        expected = model(x)
        model.table.zero_()  # zeroes the view too
        assert not gm.get_buffer("front").any()
        torch.testing.assert_close(gm(x), model(x), rtol=1e-2, atol=1e-2)
        assert not torch.equal(model(x), expected)
