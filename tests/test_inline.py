"""Functions hidden from tracing with torch.fx.wrap are opened up: their matmuls run in the low dtype."""
import copy

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder


def window_attention(x, qkv_weight, proj_weight, rel_bias, window: int, heads: int, shift: int,
                     attention_dropout: float = 0.0, qkv_bias=None, proj_bias=None, training: bool = True):
    """Shaped like torchvision's shifted_window_attention: Python control flow on the input's sizes (which
    symbolic tracing cannot follow), padding to whole windows, a cyclic shift, attention inside each window."""
    b, h, w, c = x.shape
    pad_h, pad_w = (window - h % window) % window, (window - w % window) % window
    x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    _, ph, pw, _ = x.shape
    if window >= ph:  # a window as large as the image: no shift
        shift = 0
    if shift > 0:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    nw = (ph // window) * (pw // window)
    x = x.view(b, ph // window, window, pw // window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(b * nw, window * window, c)
    qkv = F.linear(x, qkv_weight, qkv_bias).reshape(x.size(0), x.size(1), 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * (c // heads) ** -0.5).matmul(k.transpose(-2, -1)) + rel_bias
    attn = F.dropout(F.softmax(attn, dim=-1), p=attention_dropout, training=training)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), c)
    x = F.linear(x, proj_weight, proj_bias)
    x = x.view(b, ph // window, pw // window, window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(b, ph, pw, c)
    if shift > 0:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x[:, :h, :w, :].contiguous()


torch.fx.wrap("window_attention")


def relative_bias(table, index, heads: int, n: int):
    """A wrapped helper with no matmul inside: it stays whole."""
    return table[index].view(n, n, heads).permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("relative_bias")


class WindowBlock(nn.Module):
    def __init__(self, c=32, heads=4, window=4, shift=2, drop=0.2):
        super().__init__()
        self.window, self.heads, self.shift, self.drop = window, heads, shift, drop
        self.norm = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        n = window * window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        self.register_buffer("index", torch.randint(0, (2 * window - 1) ** 2, (n * n,)))
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))

    def forward(self, x):
        bias = relative_bias(self.table, self.index, self.heads, self.window * self.window)
        x = x + window_attention(self.norm(x), self.qkv.weight, self.proj.weight, bias, self.window, self.heads,
                                 self.shift, attention_dropout=self.drop, qkv_bias=self.qkv.bias,
                                 proj_bias=self.proj.bias, training=self.training)
        return x + self.mlp(x)


class TinySwin(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 2, stride=2)
        self.blocks = nn.Sequential(WindowBlock(shift=0), WindowBlock(shift=2))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.patch(x).permute(0, 2, 3, 1)
        return self.head(self.blocks(x).mean((1, 2)))


LOW_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "convolution")


@pytest.mark.filterwarnings("ignore:autocastfx. ops on no policy list")  # the helper function is unclassified on purpose
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wrapped_attention_runs_its_matmuls_low(dtype):
    torch.manual_seed(0)
    model, x = TinySwin(), torch.randn(2, 3, 12, 12)
    gm = autocastfx.convert(model, (x,), dtype=dtype)
    assert gm.meta["autocastfx"].capture == "symbolic_trace"
    lines = autocastfx.report(gm).totals["opaque_calls"]
    assert sum("window_attention" in s and "inlined" in s for s in lines) == 2, lines
    assert sum("relative_bias" in s and "kept whole" in s and "no matmul" in s for s in lines) == 2, lines
    assert "opaque calls" in str(autocastfx.report(gm))
    rec = AtenRecorder()
    with rec:
        gm(x).float().sum().backward()
    gemms = rec.ops(*LOW_GEMMS)
    assert len(gemms) >= 2 * 2 * 4  # forward and backward of qkv, proj, two attention matmuls, in each block
    for c in gemms:
        assert all(d == dtype for d in c.in_dtypes if d.is_floating_point), c
    # the weights cast low include the attention's projections: float32 parameters, cast once per forward
    low = {id(p) for p in autocastfx.master_parameters(gm)}
    names = {n for n, p in gm.named_parameters() if id(p) in low}
    assert {"blocks.0.qkv.weight", "blocks.1.proj.weight"} <= names, names


@pytest.mark.filterwarnings("ignore:autocastfx. ops on no policy list")  # the helper function is unclassified on purpose
def test_wrapped_attention_numerics_and_modes():
    torch.manual_seed(0)
    model, x = TinySwin(), torch.randn(2, 3, 12, 12)
    gm = autocastfx.convert(model, (x,))
    ref64 = copy.deepcopy(model).double().eval()(x.double())
    gm.eval()
    ours = gm(x)
    with torch.autocast("cpu", dtype=torch.float16):
        theirs = copy.deepcopy(model).eval()(x)
    err = ((ours.double() - ref64).norm() / ref64.norm()).item()
    err_ac = ((theirs.double() - ref64).norm() / ref64.norm()).item()
    assert err <= 2 * err_ac + 1e-4, (err, err_ac)
    assert torch.equal(gm(x), ours)  # eval: the inlined attention dropout is off
    gm.train()
    assert not torch.equal(gm(x), gm(x))  # train: it is on again
    # other spatial sizes still work where the trace is not specialised, or fail loudly where it is
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1))
    y = torch.tensor([1, 2])
    losses = [float(step(x, y)) for _ in range(5)]
    assert losses[-1] < losses[0]


@pytest.mark.filterwarnings("ignore:autocastfx. ops on no policy list")  # the helper function is unclassified on purpose
def test_untraceable_opaque_call_stays_whole_with_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return _call_data_dependent(x, self.w)

    gm = autocastfx.convert(M(), (torch.randn(4, 8),))
    lines = autocastfx.report(gm).totals.get("opaque_calls", [])
    assert any("kept whole" in s and "torch.export could not trace it" in s for s in lines), lines


def _data_dependent(x, w):
    if x.sum() > 0:  # a branch on values: torch.export cannot trace it either
        return F.linear(x, w)
    return F.linear(-x, w)


def _call_data_dependent(x, w):
    return _data_dependent(x, w)


torch.fx.wrap("_call_data_dependent")
