"""Memory layout: channels_last end to end, checked at the aten level (conversions counted, every
convolution's strides), exactness against the contiguous model, the option's validation."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from autocastfx.base import keys as K
from autocastfx.core import layout
from autocastfx.base.meta import TensorInfo
from helpers import capture
from helpers import AtenRecorder
from small_models import example
from test_padding import OddConvNet


def _layout(t):
    """"nhwc" (channels innermost, dense or narrowed), "nchw", "any" (both read the same) or "-" (not 4-D)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return "-"
    cl, c = t.is_contiguous(memory_format=torch.channels_last), t.is_contiguous()
    if cl or c:
        return "any" if cl and c else "nhwc" if cl else "nchw"
    dims = sorted((d for d in range(4) if t.shape[d] > 1), key=lambda d: -t.stride(d))
    return "nhwc" if dims and dims[-1] == 1 else "nchw"


class LayoutRecorder(AtenRecorder):
    """AtenRecorder that also notes the layout of every tensor each aten op reads and writes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        flat = torch.utils._pytree.tree_flatten
        call = self.calls[-1]
        call.in_layouts = [_layout(a) for a in flat((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        call.out_layouts = [_layout(o) for o in flat(out)[0] if isinstance(o, torch.Tensor)]
        return out

    def conversions(self):
        """Copies that change a 4-D tensor's layout: clone/contiguous, casts, copy_ between layouts."""
        res = []
        for c in self.calls:
            if c.name in ("clone", "_to_copy") and c.in_layouts and c.out_layouts:
                pair = {c.in_layouts[0], c.out_layouts[0]}
            elif c.name == "copy_" and len(c.in_layouts) >= 2:
                pair = {c.in_layouts[0], c.in_layouts[1]}
            else:
                continue
            if pair == {"nhwc", "nchw"}:
                res.append(c)
        return res


def _model(name):
    if name == "odd":
        torch.manual_seed(0)
        return OddConvNet(), (torch.randn(2, 3, 8, 8),)
    return example(name)


def _step(gm, inputs, mode="train"):
    """Forward and backward of a float32 loss; returns (recorder, output)."""
    getattr(gm, mode)()
    rec = LayoutRecorder()
    with rec:
        out = gm(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().square().mean() for o in outs).backward()
    return rec, out


CONV_MODELS = ["resnet", "mobilenet", "densenet", "odd"]


# ------------------------------------------------------------------------------------------- the option

@pytest.mark.parametrize("bad, error, match", [
    ("contiguous", ValueError, "'preserve' leaves NCHW tensors NCHW"),
    ("NHWC", ValueError, r"channels_last: NHWC"),
    ("fast", ValueError, "memory_format must be 'auto' .* 'channels_last' or 'preserve'"),
    (torch.contiguous_format, ValueError, "not an option"),
    (1, TypeError, "memory_format must be a string"),
])
def test_memory_format_is_validated(bad, error, match):
    model, inputs = _model("resnet")
    with pytest.raises(error, match=match):
        autocastfx.convert(model, inputs, memory_format=bad)


def test_torch_memory_format_objects_are_accepted():
    model, inputs = _model("resnet")
    gm = autocastfx.convert(model, inputs, memory_format=torch.channels_last, pad_multiple=1)
    assert gm.meta["autocastfx"].options.memory_format == "channels_last"
    assert autocastfx.report(gm).totals["layout"]["memory_format"] == "channels_last"
    gm = autocastfx.convert(model, inputs, memory_format=torch.preserve_format, pad_multiple=1)
    assert gm.meta["autocastfx"].options.memory_format == "preserve"


def test_auto_changes_nothing_on_the_cpu():
    model, inputs = _model("resnet")
    auto = autocastfx.convert(model, inputs)
    kept = autocastfx.convert(model, inputs, memory_format="preserve")
    lay = autocastfx.report(auto).totals["layout"]
    assert lay["memory_format"] == "preserve" and lay["requested"] == "auto"
    assert "the model is on the cpu" in lay["reason"]
    assert auto.code == kept.code and "channels_last" not in auto.code
    rec, out = _step(auto, inputs, "eval")
    assert not rec.conversions()
    assert all(c.in_layouts[0] == "nchw" for c in rec.ops("convolution"))
    assert torch.equal(out, kept.eval()(*inputs))


def _graph_on(device, model, x):
    """A traced graph whose recorded inputs say they are on ``device`` (no such device needed)."""
    gm = fx.symbolic_trace(model)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["autocastfx_info"] = TensorInfo(torch.float32, tuple(x.shape), device)
        elif n.op == "call_function" and n.target is F.conv2d:
            n.meta["autocastfx_info"] = TensorInfo(torch.float32, (2, 8, 6, 6), device)
    return gm


class ConvFn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 3, 3, 3))

    def forward(self, x):
        return F.conv2d(x, self.w).mean()


def test_auto_chooses_channels_last_for_convolutions_on_a_cuda_device():
    x = torch.randn(2, 3, 8, 8)
    on_cuda = layout.plan_layout(_graph_on("cuda", ConvFn(), x), "auto")
    assert on_cuda.memory_format == "channels_last" and on_cuda.reason.startswith("auto: 1 2-D convolutions on cuda")
    assert layout.plan_layout(_graph_on("cpu", ConvFn(), x), "auto").memory_format == "preserve"
    mlp = layout.plan_layout(_graph_on("cuda", nn.Linear(8, 4), torch.randn(2, 8)), "channels_last")
    assert mlp.memory_format == "preserve" and mlp.reason == "no 2-D convolution: layouts left as they are"


# ------------------------------------------------------------------------------ exactness and round trips

@pytest.mark.parametrize("name", CONV_MODELS)
def test_layout_pass_computes_the_same_function_in_float32(name):
    """The layout pass alone, in float32, where rounding is far below any wrong value: eval outputs, then
    train outputs, parameter gradients and batch-norm statistics, equal to the captured graph's within
    float32 rounding (kernels sum in another order in NHWC)."""
    model, inputs = _model(name)
    runs = []
    for fmt in ("preserve", "channels_last"):
        gm, _ = capture(model, inputs, {}, autocastfx.Policy.default())
        layout.apply_layout(gm, layout.plan_layout(gm, fmt), inputs, {})
        with torch.no_grad():
            evaluated = gm.eval()(*inputs)
        out = gm.train()(*inputs)
        out.square().mean().backward()
        runs.append((gm, evaluated, out))
    (g0, e0, o0), (g1, e1, o1) = runs
    assert "channels_last" in g1.code and "channels_last" not in g0.code
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)
    scale = max(p.grad.abs().max().item() for p in g0.parameters())
    for (n, a), (_, b) in zip(g0.named_parameters(), g1.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * scale, msg=n)
    for (n, a), (_, b) in zip(g0.named_buffers(), g1.named_buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", CONV_MODELS)
def test_channels_last_mixed_precision_as_accurate_as_contiguous(name):
    """The whole conversion (padding in NHWC included). Eval outputs are bitwise equal. In training, batch
    norm sums its statistics in another order in channels_last: a last-bit float32 difference can round an
    FP16 activation the other way, so outputs agree within an FP16 rounding step and gradients differ at the
    level of the mixed-precision error itself; measured against the float32 model they are as accurate either
    way."""
    model, inputs = _model(name)
    ref = copy.deepcopy(model).train()
    ref(*inputs).square().mean().backward()
    runs = []
    for fmt in ("preserve", "channels_last"):
        # a copy each: a converted module trains the model's own tensors (its weights, gradients and
        # batch-norm statistics), and channels_last gives its convolution weights that layout in place
        gm = autocastfx.convert(copy.deepcopy(model), inputs, memory_format=fmt)
        with torch.no_grad():
            evaluated = gm.eval()(*inputs)
        _, out = _step(gm, inputs, "train")
        errs = {n: ((p.grad.double() - q.grad).norm() / q.grad.norm()).item()
                for (n, p), (_, q) in zip(gm.named_parameters(), ref.named_parameters()) if q.grad.norm() > 0}
        runs.append((evaluated, out, errs))
    (v0, o0, e0), (v1, o1, e1) = runs
    assert torch.equal(v0, v1)
    torch.testing.assert_close(o1, o0, rtol=1e-3, atol=2 ** -10 * o0.abs().max().item())
    for n in e0:
        assert e1[n] <= 1.25 * e0[n] + 2e-3, (n, e0[n], e1[n])


def _of_weights(rec, gm):
    """The layout conversions of activations: a convolution weight's own (its cast writes NHWC; its gradient is
    copied back into the float32 parameter's NCHW layout) are weight-sized and left out."""
    shapes = {tuple(p.shape) for p in gm.parameters() if p.dim() == 4}
    shapes |= {tuple(n.meta[K.INFO].shape) for n in gm.graph.nodes  # padded weights, as their casts read them
               if n.kwargs.get("memory_format") is torch.channels_last
               and getattr(n.meta.get("autocastfx"), "kind", None) == "cast"}
    return [c for c in rec.conversions() if not (c.in_shapes and tuple(c.in_shapes[0]) in shapes)]


@pytest.mark.parametrize("name", CONV_MODELS)
def test_one_conversion_per_step_and_every_convolution_channels_last(name):
    model, inputs = _model(name)
    plain = copy.deepcopy(model)
    gm = autocastfx.convert(model, inputs, memory_format="channels_last")
    assert all(p.is_contiguous() for p in model.parameters())  # the shared parameters keep the model's layout
    model(*inputs)  # and the model still runs as it did
    lay = autocastfx.report(gm).totals["layout"]
    assert lay["inputs"] == ["x"] and lay["to_channels_last"] == [] and lay["to_contiguous"] == []
    assert lay["params_channels_last"] == sum(1 for m in model.modules() if isinstance(m, nn.Conv2d))
    rec, _ = _step(gm, inputs, "train")
    # the input once; each convolution weight's cast to float16 writes NHWC in the same copy, and its gradient
    # comes back into the parameter's NCHW layout (weight-sized copies, counted apart)
    conversions = _of_weights(rec, gm)
    assert len(conversions) == 1, [(c.overload, c.in_layouts, c.out_layouts) for c in conversions]
    assert conversions[0].name == "clone" and conversions[0].out_layouts == ["nhwc"]  # the input, once
    weights = [c for c in rec.conversions() if c not in conversions]
    n = lay["params_channels_last"]
    casts = [c for c in weights if c.name == "_to_copy" and c.out_dtypes == [torch.float16]]
    assert 1 <= len(casts) <= n and len(weights) <= 2 * n  # (a 1x1 kernel is laid out alike either way)
    convs = rec.ops("convolution", "convolution_backward")
    assert len(convs) == 2 * lay["params_channels_last"]
    for c in convs:  # input, weight, output (and gradients) of every convolution, forward and backward
        assert set(c.in_layouts + c.out_layouts) <= {"nhwc", "any", "-"}, (c.overload, c.in_layouts, c.out_layouts)
    rec0, _ = _step(autocastfx.convert(plain, inputs, memory_format="preserve"), inputs, "train")
    assert not rec0.conversions()


class ViewHead(nn.Module):
    """``view`` of a convolution's output: fails on channels_last strides."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        y = F.relu(self.conv(x))
        return self.fc(y.view(y.shape[0], -1))


class Shuffle(nn.Module):
    """A channel shuffle whose NCHW result feeds another convolution; a 4-D output; the input also read by
    a reshape."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.c1(x))
        b, c, h, w = y.shape
        y = y.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)
        return self.c2(y), x.reshape(b, -1).sum(1)


def test_view_reads_a_contiguous_copy():
    torch.manual_seed(0)
    model, x = ViewHead(), torch.randn(2, 3, 6, 6)
    plain = copy.deepcopy(model)  # the model as given: channels_last restrides the weights it shares in place
    gm = autocastfx.convert(model, (x,), memory_format="channels_last")
    lay = autocastfx.report(gm).totals["layout"]
    assert len(lay["to_contiguous"]) == 1
    assert lay["to_contiguous"][0].startswith("relu: view (view) fails on channels_last: view size is not compatible")
    assert "contiguous_relu = relu.contiguous()" in gm.code
    rec, out = _step(gm, (x,), "eval")
    assert [c.out_layouts for c in _of_weights(rec, gm)][:2] == [["nhwc"], ["nchw"]]  # input in, relu out
    ref = autocastfx.convert(plain, (x,), memory_format="preserve").eval()
    assert torch.equal(out, ref(x))


def test_shuffle_then_convolution_and_a_4d_output():
    torch.manual_seed(0)
    model, x = Shuffle(), torch.randn(2, 3, 6, 6)
    plain = copy.deepcopy(model)  # the model as given: channels_last restrides the weights it shares in place
    gm = autocastfx.convert(model, (x,), memory_format="channels_last", pad_multiple=1)
    lay = autocastfx.report(gm).totals["layout"]
    assert lay["to_channels_last"] == ["reshape: conv2d_1 reads it"]  # the shuffle's NCHW copy, back once
    assert lay["to_contiguous"] == ["conv2d_1: graph output"]
    rec, out = _step(gm, (x,), "eval")
    assert out[0].is_contiguous() and out[0].shape == (2, 8, 6, 6)  # returned as the model returns it
    assert all(c.in_layouts[0] == "nhwc" for c in rec.ops("convolution"))
    # the input's reshape reads the NCHW input, no copy (in float32: a reshape never rounds a float32 value)
    assert "reshape_1 = x.reshape" in gm.code
    assert len([c for c in _of_weights(rec, gm) if c.in_layouts[0] == "nchw"]) == 2  # the input, the shuffle
    ref = autocastfx.convert(plain, (x,), memory_format="preserve", pad_multiple=1).eval()
    for a, b in zip(out, ref(x)):  # within an FP16 rounding step (a convolution with bias in NHWC adds it apart)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2 ** -10 * b.abs().max().item())


class ExportOnly(nn.Module):
    """A shape test symbolic tracing cannot follow: captured by torch.export, an aten graph."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 6 * 6, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        if y.shape[0] > 1:
            y = self.c2(y)
        return self.fc(y.reshape(y.shape[0], -1))


def test_torch_export_capture_in_channels_last():
    torch.manual_seed(0)
    model, x = ExportOnly().eval(), torch.randn(2, 3, 6, 6)
    plain = copy.deepcopy(model)  # the model as given: channels_last restrides the weights it shares in place
    gm = autocastfx.convert(model, (x,), memory_format="channels_last")
    assert gm.meta["autocastfx"].capture == "torch.export"
    lay = autocastfx.report(gm).totals["layout"]
    assert lay["params_channels_last"] == 2
    assert lay["reshape_copies"] == ["reshape (reshape) copies conv2d_1 to NCHW order"]
    rec, out = _step(gm, (x,), "eval")
    assert all(c.in_layouts[0] == "nhwc" for c in rec.ops("convolution"))
    ref = autocastfx.convert(plain, (x,), memory_format="preserve").eval()
    torch.testing.assert_close(out, ref(x), rtol=1e-3, atol=2 ** -10 * out.abs().max().item())


def test_stem_padding_runs_in_channels_last():
    model, inputs = _model("resnet")
    gm = autocastfx.convert(model, inputs, memory_format="channels_last")
    padded = autocastfx.report(gm).totals["padding"]["padded"]
    assert padded and padded[0].startswith("conv2d: pad (+33% FLOPs): in 3 -> 4")
    rec, _ = _step(gm, inputs, "train")
    stem = rec.ops("convolution")[0]
    assert stem.in_shapes[0][1] == 4 and stem.in_layouts[:2] == ["nhwc", "nhwc"]
    assert len(_of_weights(rec, gm)) == 1  # the pad keeps channels_last


def test_reconvert_gives_the_same_graph():
    model, inputs = _model("densenet")
    gm = autocastfx.convert(model, inputs, memory_format="channels_last")
    again = autocastfx.convert(gm, inputs, memory_format="channels_last")
    assert again.code == gm.code
    back = autocastfx.convert(gm, inputs, memory_format="preserve")
    assert "channels_last" not in back.code
    assert all(p.is_contiguous() for p in back.parameters())  # the weights' NCHW layout throughout
    rec, _ = _step(back, inputs, "eval")
    assert all(c.in_layouts[0] == "nchw" and c.out_layouts[0] == "nchw" for c in rec.ops("convolution"))


@pytest.mark.filterwarnings("ignore:No complete tensor found in the group")  # torch.export.save on channels_last weights
def test_export_and_training_step_in_channels_last(tmp_path):
    model, inputs = _model("resnet")
    plain = copy.deepcopy(model)  # the reference trains weights of its own
    gm = autocastfx.convert(model, inputs, memory_format="channels_last")
    weights = [p for p in gm.parameters() if p.dim() == 4]
    assert weights and all(p.is_contiguous() for p in weights)  # the model's own float32 weights, NCHW as given
    assert "memory_format = torch.channels_last" in gm.code  # the casts write what the convolutions read
    # the float32 weights the graph casts low are these parameters; their gradients come back in their layout,
    # as a fused optimizer needs
    low = {id(m) for m in autocastfx.master_parameters(gm)}
    assert all(id(w) in low for n, w in gm.named_parameters() if w.dim() == 4)
    assert all(w is model.get_parameter(n) for n, w in gm.named_parameters())
    _step(gm, inputs, "train")
    assert all(w.grad is not None and w.grad.stride() == w.stride() for w in weights)
    gm.zero_grad(set_to_none=True)
    gm.eval()
    autocastfx.export(gm, tmp_path / "m.pt2", inputs)
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    assert torch.equal(loaded(*inputs), gm(*inputs))
    gm.train()
    ref = autocastfx.convert(plain, inputs, memory_format="preserve")
    y = torch.tensor([1, 3])
    for g in (gm, ref):
        opt = torch.optim.SGD(g.parameters(), lr=0.1, momentum=0.9)
        step = autocastfx.train_step(g, F.cross_entropy, opt, loss_scale=1024.0)
        for _ in range(3):
            step(*inputs, y)
    for (n, a), (_, b) in zip(gm.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3, msg=n)


def test_report_says_the_layout_and_why():
    model, inputs = _model("mobilenet")
    text = str(autocastfx.report(autocastfx.convert(model, inputs, memory_format="channels_last")))
    assert "layout: channels_last (memory_format='channels_last': 11 2-D convolutions run NHWC)" in text
    assert "convolution weights read channels_last: 11; inputs converted once: x" in text
    text = str(autocastfx.report(autocastfx.convert(model, inputs)))
    assert "layout: preserve (auto: 11 2-D convolutions, but the model is on the cpu" in text


# ------------------------------------------------------------------------------------- on a CUDA device

@pytest.mark.parametrize("name", CONV_MODELS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_runs_convolutions_channels_last_on_cuda(name):
    model, inputs = _model(name)
    model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    gm = autocastfx.convert(model, inputs)
    lay = autocastfx.report(gm).totals["layout"]
    assert lay["memory_format"] == "channels_last" and lay["reason"].startswith("auto:")
    rec, _ = _step(gm, inputs, "train")
    assert len(rec.conversions()) == 1
    for c in rec.ops("convolution", "convolution_backward"):
        assert set(c.in_layouts + c.out_layouts) <= {"nhwc", "any", "-"}, (c.overload, c.in_layouts)
    ref = autocastfx.convert(model, inputs, memory_format="preserve")
    with torch.no_grad():
        torch.testing.assert_close(gm.eval()(*inputs), ref.eval()(*inputs), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_timed_trial_on_cuda_decides_the_stem_with_measured_times():
    from autocastfx.core import cost as hardware, padding
    gm, _ = capture(nn.Conv2d(3, 64, 7, stride=2, padding=3).cuda(), (torch.randn(32, 3, 112, 112).cuda(),), {},
                    autocastfx.Policy.default())
    cache = {}
    plan = padding.plan_padding(gm, 8, gate="trial", layout="channels_last", cache=cache)
    (d,) = plan.decisions
    assert plan.gate == "trial" and d.rules == ("trial",) and "timed on cuda" in d.reason
    assert len(cache) == len(hardware.candidates(hardware.Site("conv", 64, 3), 8, 4.0)) + 1
    print(d.reason)
