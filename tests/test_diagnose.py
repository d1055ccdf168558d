"""calibrate() moves what overflows float16 back to float32; grad_histogram() places gradients in its range."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from autocastfx.tools.diagnose import calibrate, grad_histogram
from helpers import AtenRecorder
from small_models import example


class Hot(nn.Module):
    """One layer whose outputs exceed float16's range; log_softmax takes any input in float32."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.hot = nn.Linear(32, 32)
        self.b = nn.Linear(16, 16)
        with torch.no_grad():
            self.hot.weight.mul_(1e3)

    def forward(self, x):
        return F.log_softmax(self.hot(torch.relu(self.a(x))), -1), self.b(x)


def test_calibration_moves_only_the_overflowing_layer():
    torch.manual_seed(0)
    m = Hot()
    x = torch.randn(4, 16) * 200
    gm = autocastfx.convert(m, (x,), pad_multiple=1)
    assert not torch.isfinite(gm(x)[0]).all()  # float16 overflows in `hot`
    cal = calibrate(gm, [(torch.randn(4, 16) * 200,) for _ in range(3)])
    out, ref = cal(x)[0], m(x)[0]
    assert torch.isfinite(out).all()
    assert ((out - ref).abs().max() / ref.abs().max()) < 1e-2
    moved = cal.meta["autocastfx"].extra_totals["calibration"]
    assert list(moved) == ["linear_1"]
    row = next(r for r in autocastfx.report(cal).rows if r.name == "linear_1")
    assert row.dtype == "fp32" and row.reason.startswith("calibration: |value| reaches")
    # checked at the aten level: the hot matmul runs in float32, the others stay float16
    rec = AtenRecorder()
    with rec, torch.no_grad():
        cal(x)
    mm = rec.ops("addmm", "mm")
    assert sorted(str(c.in_dtypes[1]) for c in mm) == ["torch.float16", "torch.float16", "torch.float32"]


def test_calibration_keeps_a_healthy_model():
    model, inputs = example("resnet")
    model.eval()
    gm = autocastfx.convert(model, inputs, pad_multiple=1)
    cal = calibrate(gm, [inputs])
    assert cal.meta["autocastfx"].extra_totals["calibration"] == {}
    assert cal.code == gm.code


def test_calibration_errors():
    with pytest.raises(TypeError, match="convert"):
        calibrate(nn.Linear(2, 2), [(torch.randn(1, 2),)])
    model, inputs = example("resnet")
    gm = autocastfx.convert(model, inputs, pad_multiple=1)
    with pytest.raises(ValueError, match="at least one batch"):
        calibrate(gm, [])


def test_grad_histogram_shares_and_scale(tmp_path):
    model, inputs = example("resnet")
    y = torch.tensor([1, 2])
    h = grad_histogram(model, inputs, F.cross_entropy, y)
    assert abs(h.share_normal + h.share_subnormal + h.share_flushed + h.share_overflow - 1) < 0.02
    assert sum(h.counts) + h.zeros == h.total
    assert h.max_safe_scale * h.max_abs < 65504 <= 2 * h.max_safe_scale * h.max_abs
    # a loss scaled down makes gradients tiny: more of them flush to zero
    tiny = grad_histogram(model, inputs, lambda o, t: F.cross_entropy(o, t) * 2.0**-20, y)
    assert tiny.share_flushed > h.share_flushed and tiny.scale_to_keep_999 > h.scale_to_keep_999
    text = h.text()
    assert "would become zero without scaling" in text and "largest safe power-of-two loss scale" in text
    pytest.importorskip("matplotlib")
    assert (tmp_path / "g.png").exists() is False
    h.plot(str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 1000
    # on the converted module it would count the low program's gradients and the weight casts' (32 where the
    # model's scale is 4): refused, naming the model
    with pytest.raises(TypeError, match="call it on the model you converted"):
        grad_histogram(autocastfx.convert(model, inputs, pad_multiple=1), inputs, F.cross_entropy, y)


def test_calibrate_and_for_inference_of_a_piecewise_module_say_what_to_apply_them_to():
    """Before: AttributeError "'DataDependentLoss' object has no attribute 'graph'"."""
    from test_blocks import DataDependentLoss, ids
    torch.manual_seed(0)
    gm = autocastfx.convert(DataDependentLoss(), (ids(),), example_kwargs={"labels": ids(seed=3)},
                            dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="autocastfx.calibrate rewrites one converted graph.*converted piecewise"):
        calibrate(gm, [(ids(),)])
    with pytest.raises(ValueError, match="autocastfx.for_inference rewrites one converted graph.*piecewise"):
        autocastfx.for_inference(gm)


def test_the_low_flop_share_counts_the_matmuls_kept_in_float32():
    """A matmul moved to float32 (by calibration or the policy) was left out of the FLOP count: the report said
    100% low where one of two matmuls ran in float32."""
    torch.manual_seed(0)
    m = Hot()
    x = torch.randn(4, 16) * 200
    gm = autocastfx.convert(m, (x,), pad_multiple=1, dtype=torch.float16)
    full = autocastfx.report(gm).totals["flops"]
    cal = calibrate(gm, [(x,)])
    t = autocastfx.report(cal).totals
    moved = 2 * 4 * 32 * 32  # linear_1's FLOPs, now float32
    assert t["flops"] == full and t["low_flops"] == full - moved
    assert abs(t["low_flop_share"] - (full - moved) / full) < 1e-9


def test_calibrate_and_grad_histogram_leave_the_callers_random_stream():
    """Their float32 runs of a model with dropout drew from the global generator: the next training step after
    calibrate() was not the one a run without it takes."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)
    gm = autocastfx.convert(m, (x,), pad_multiple=1)
    state = torch.get_rng_state()
    calibrate(gm, [(x,)])
    grad_histogram(m, (x,), lambda out: out.square().mean())
    assert torch.equal(torch.get_rng_state(), state)


def test_the_report_of_a_deployment_copy_counts_the_casts_that_run_and_says_where_weights_are():
    """report(for_inference(gm)) left out the casts up of weights stored low (graph nodes without a decision, and
    those inside a leaf module), 3 where 7 run, and said the parameters were float32, cast once per forward."""
    class PreAct(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.conv = nn.BatchNorm2d(3), nn.Conv2d(3, 16, 3, padding=1)
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 10)

        def forward(self, x):
            return self.fc(self.ln(self.conv(F.relu(self.bn(x))).mean((2, 3))))

    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    inf = autocastfx.for_inference(autocastfx.convert(PreAct(), (x,), dtype=torch.bfloat16))
    rec = AtenRecorder()
    with rec, torch.no_grad():
        inf(x)
    ran = len(rec.float_casts())
    report = autocastfx.report(inf)
    assert report.totals["casts"] == ran
    assert "parameters stored low: 6" in str(report)


def test_calibrate_refuses_a_module_with_converted_blocks_and_calibrates_it_as_one_graph():
    """calibrate() re-plans the root graph's nodes; a linear inside a converted block is a node of the block's own
    graph, which it never reached: it returned the module unchanged, still overflowing, and said nothing moved.
    It now refuses such a module, naming blocks=None, with which the overflow moves to float32."""
    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

        def forward(self, x):
            return self.ln(x + self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 4)
            self.layers = nn.ModuleList([Block() for _ in range(2)])
            with torch.no_grad():
                self.layers[1].fc.weight.mul_(80000)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(8, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.float16).eval()
    assert any(n.startswith("layers.") for n in gm.meta["autocastfx"].extra_totals["blocks"])
    with pytest.raises(ValueError, match=r"converted blocks.*blocks=None"):
        calibrate(gm, [(x,)])
    one = autocastfx.convert(model, (x,), dtype=torch.float16, blocks=None).eval()
    cal = calibrate(one, [(x,)]).eval()
    assert cal.meta["autocastfx"].extra_totals["calibration"]
    with torch.no_grad():
        assert torch.isfinite(cal(x)).all()
