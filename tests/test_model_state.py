"""The model's plain Python state (a temperature, a residual scale, a dropout probability, a function to call, a
dict of settings, a plain tensor) is what its code read while it was captured: the converted graph holds it as a
constant. Each way of changing it after convert() gave a converted module that went on with the old value and said
nothing. Each is now refused with a ValueError that names the attribute and the fix, and a forward that moves its own
plain state (a step counter) is refused at convert()."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import autocastfx
from helpers import one_thread_quiet

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    with one_thread_quiet():
        yield


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.temperature = nn.Linear(16, 16), 1.0
        self.act, self.cfg, self.shift = torch.relu, {"scale": 1.0}, torch.zeros(16)

    def forward(self, x):
        return torch.softmax(self.act(self.fc(x)) * self.cfg["scale"] / self.temperature + self.shift, -1)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleList([_Tempered() for _ in range(2)])
        self.drop, self.norm = nn.Dropout(0.0), nn.LayerNorm(16)

    def forward(self, x):
        for m in self.inner:
            x = m(x)
        return self.norm(self.drop(x))


def _convert(model, blocks=None):
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    return autocastfx.convert(model, (x,), dtype=BF16, blocks=blocks), x


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("blocks", [None, "auto"])
@pytest.mark.parametrize("change", ["root attr", "block attr", "function", "dict in place", "tensor in place",
                                    "dropout p", "norm eps", "deleted"])
def test_a_change_on_the_model_after_convert_is_refused_at_the_next_call(change, blocks):
    """Before: the converted module ran the old value (a temperature of 0.1 set on the model: softmax rows 0.8
    against 0.2). Now the next call is a ValueError naming the attribute; converting again follows the change."""
    model = _Stack().eval()
    gm, x = _convert(model, blocks)
    assert _rel(gm(x), model(x)) < 2e-2
    inner = model.inner[1]
    if change == "root attr":
        inner = model.inner[0]
        inner.temperature = 0.1
    elif change == "block attr":
        inner.temperature = 0.1
    elif change == "function":
        inner.act = torch.tanh
    elif change == "dict in place":
        inner.cfg["scale"] = 3.0
    elif change == "tensor in place":
        inner.shift.add_(1.0)
    elif change == "dropout p":
        model.drop.p = 0.5
    elif change == "norm eps":
        model.norm.eps = 0.5
    else:
        del inner.temperature
    name = {"function": "act", "dict in place": "cfg", "tensor in place": "shift", "dropout p": "p",
            "norm eps": "eps"}.get(change, "temperature")
    with pytest.raises(ValueError, match=rf"\.{name} .*after convert\(\).*Convert again"):
        gm(x)
    if change == "deleted":
        return
    again, _ = _convert(model, blocks)
    model.train(False)
    assert _rel(again(x), model(x)) < 2e-2


def test_an_equal_value_set_again_and_a_model_dropped_are_not_refused():
    """Setting a value equal to the one read (a new float 1.0) is no change; the converted module does not keep
    the model alive, and runs on when the model is gone."""
    model = _Tempered().eval()
    gm, x = _convert(model)
    model.temperature = float("1.0")
    model.cfg = {"scale": 1.0}
    gm(x)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    gm(x)


@pytest.mark.parametrize("target", ["root function", "nested attr", "root temperature"])
def test_a_write_on_the_converted_module_of_what_the_code_read_is_refused(target):
    """Before: ``gm.act = torch.tanh`` and ``gm.inner[0].temperature = 0.1`` were accepted and changed nothing the
    converted module computed."""
    gm, x = _convert(_Stack().eval() if target == "nested attr" else _Tempered().eval())
    before = gm(x)
    with pytest.raises(ValueError, match="a constant of the converted graph.*Set it on the model"):
        if target == "root function":
            gm.act = torch.tanh
        elif target == "nested attr":
            gm.get_submodule("inner.0").temperature = 0.1
        else:
            gm.temperature = 0.1
    torch.testing.assert_close(gm(x), before)


def test_a_dict_changed_through_the_converted_module_is_refused_at_the_next_call():
    """The converted module answers the model's dict attribute with the model's own dict: a change through it
    (``gm.cfg["scale"] = 3.0``) reached no graph, and now is a ValueError, also once the model is gone."""
    model = _Tempered().eval()
    gm, x = _convert(model)
    del model
    gc.collect()
    gm.cfg["scale"] = 3.0
    with pytest.raises(ValueError, match=r"\.cfg was changed in place after convert\(\)"):
        gm(x)


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.step = nn.Linear(16, 16), 0

    def forward(self, x):
        self.step += 1
        return self.fc(x) * min(1.0, self.step / 4)


class _BufferCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.step.add_(1)
        return self.fc(x) * torch.clamp(self.step / 4, max=1.0)


def test_a_forward_that_moves_its_own_plain_state_is_refused_at_convert_and_a_buffer_works():
    """Before: ``self.step += 1`` ran once, at capture, and every call after computed with step 1 (the warm-up
    factor stuck at 0.25). Now convert() says to keep it in a buffer; the buffer counts at every call."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = _Counter()
    with pytest.raises(ValueError, match=r"_Counter.forward changes its attribute 'step'.*register_buffer"):
        autocastfx.convert(model, (x,), dtype=BF16)
    assert model.step == 0
    gm = autocastfx.convert(_BufferCounter(), (x,), dtype=BF16)
    ref = _BufferCounter()
    ref.load_state_dict(gm.state_dict())
    for _ in range(5):
        out, want = gm(x), ref(x)
    assert int(gm.step) == int(ref.step) == 5
    assert _rel(out, want) < 2e-2


class _KeepsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.last = nn.Linear(16, 16), None

    def forward(self, x):
        y = self.fc(x)
        self.last = y.detach()
        return y


def test_a_forward_that_stores_what_it_does_not_read_is_warned_of():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autocastfx.convert(_KeepsLast(), (torch.randn(4, 16),), dtype=BF16)
    assert any("sets 'last' as it runs" in str(w.message) for w in caught)
