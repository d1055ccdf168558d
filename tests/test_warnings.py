"""convert() warns about real unclassified ops, once per op, and never about output-structure builders."""
import collections
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import autocastfx

Pair = collections.namedtuple("Pair", "logits total")


@dataclasses.dataclass
class DataOut:
    logits: torch.Tensor
    total: torch.Tensor


class Packs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = nn.Linear(8, 8), kind

    def forward(self, x):
        y = self.fc(x)
        if self.kind == "namedtuple":
            return Pair(y, y.sum())
        if self.kind == "dataclass":
            return DataOut(y, y.sum())
        if self.kind == "dict":
            return dict(logits=y, total=y.sum())
        if self.kind == "tuple":
            return tuple([y, y.sum()])
        return torch.special.erfcx(y) + torch.special.erfcx(2 * y) + torch.special.i0e(y)


def _convert(kind):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(Packs(kind), (torch.randn(2, 8),))
    return gm, [str(w.message) for w in caught if "autocastfx" in str(w.message)]


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "dict", "tuple"])
def test_output_structure_builders_are_not_warned_about(kind):
    gm, messages = _convert(kind)
    assert messages == []
    out = gm(torch.randn(2, 8))
    expected = {"namedtuple": Pair, "dataclass": DataOut, "dict": dict, "tuple": tuple}[kind]
    assert type(out) is expected
    rows = [r for r in autocastfx.report(gm).rows if "output structure" in r.reason]
    assert kind in ("tuple", "dict") or rows  # dict()/tuple() calls may be folded into the output by tracing


def test_a_real_unclassified_op_is_warned_once_per_op():
    gm, messages = _convert("ops")
    assert len(messages) == 1
    msg = messages[0]
    assert "special_erfcx (2 nodes)" in msg and "special_i0e" in msg and msg.count("erfcx") == 1
    assert "Policy.default().override" in msg
    assert gm.meta["autocastfx"].plan.unclassified  # and the report still lists every node
