"""convert_graph: the passes on a module the caller captured (symbolic_trace, torch.export), as prepare_pt2e takes
one; the same program as convert() makes from the model, sharing the captured module's tensors."""
import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from autocastfx.tools.report import report
from helpers import AtenRecorder, one_thread_quiet


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.norm(self.conv(x)))
        return F.log_softmax(self.fc(x.mean((2, 3))), dim=-1)


def _casts(gm):
    return sorted(str(n.target) for n in gm.graph.nodes if n.name.startswith("to_"))


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    with one_thread_quiet():
        yield


def _low_gemms(gm, x):
    """The convolutions and matmuls that ran with bfloat16 inputs, seen at the aten level."""
    with AtenRecorder() as rec:
        out = gm(x)
    return out, [c.name for c in rec.calls if c.name in ("convolution", "addmm", "mm", "linear")
                 and torch.bfloat16 in c.in_dtypes]


def test_an_exported_module_converts_as_the_model_does():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8)
    captured = torch.export.export(model, (x,)).module()
    config = autocastfx.ConvertOptions(dtype=torch.bfloat16, pad_multiple=1)
    gm = autocastfx.convert_graph(captured, (x,), config)
    ref = autocastfx.convert(model, (x,), dtype=torch.bfloat16, pad_multiple=1, blocks=None)
    assert gm.meta["autocastfx"].dtype == torch.bfloat16 and gm.meta["autocastfx"].capture == "graph module"
    out, low = _low_gemms(gm, x)
    ref_out, ref_low = _low_gemms(ref, x)
    assert sorted(low) == sorted(ref_low) and len(low) == 2, (low, ref_low)  # the convolution and the linear
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    assert "bfloat16" in str(report(gm)) or "bf16" in str(report(gm))
    # the captured module's tensors are the result's: training one trains the other
    assert {id(p) for p in gm.parameters()} <= {id(t) for t in captured.parameters()}


def test_a_graph_whose_linear_and_conv_are_leaf_modules_is_refused_and_convert_traces_through_them():
    """Plain symbolic_trace keeps nn.Conv2d and nn.Linear as leaf calls: convert_graph, which captures nothing,
    says so instead of converting nothing; convert(), whose job capture is, traces through them."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8)
    traced = fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="Conv2d 'conv' as a leaf module.*torch.export.export"):
        autocastfx.convert_graph(traced, (x,), autocastfx.ConvertOptions(dtype=torch.bfloat16))
    gm = autocastfx.convert(traced, (x,), dtype=torch.bfloat16, pad_multiple=1, blocks=None)
    _, low = _low_gemms(gm, x)
    assert len(low) == 2, low


def test_anything_but_a_graph_module_or_options_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match="torch.export.export.*autocastfx.convert"):
        autocastfx.convert_graph(Net(), (torch.randn(1, 3, 8, 8),))
    with pytest.raises(TypeError, match="ConvertOptions"):
        autocastfx.convert_graph(fx.symbolic_trace(Net()), (torch.randn(1, 3, 8, 8),), {"dtype": torch.bfloat16})


def test_the_options_are_one_frozen_dataclass():
    config = autocastfx.ConvertOptions(dtype=torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = torch.float16
    assert not hasattr(config, "keys") and config.replace(pad_multiple=1).pad_multiple == 1
