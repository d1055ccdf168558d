"""Tensor-core padding: exact outputs and gradients, true-shaped parameters, aligned GEMMs at the aten level."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder
from small_models import TinyGPT


class OddConvNet(nn.Module):
    """RGB stem, BN, residual add, DenseNet-style concat, depthwise + grouped convs, SE gating, channel
    shuffle, flatten into a linear: every kind of region boundary."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 13, 3, padding=1)
        self.bn = nn.BatchNorm2d(13)
        self.res = nn.Conv2d(13, 13, 3, padding=1)
        self.grow = nn.Conv2d(13, 7, 3, padding=1)           # concat: 13 + 7 = 20 channels
        self.dw = nn.Conv2d(20, 20, 3, padding=1, groups=20)  # depthwise
        self.gc = nn.Conv2d(20, 20, 1, groups=4)              # grouped, then shuffled
        self.se1, self.se2 = nn.Conv2d(20, 5, 1), nn.Conv2d(5, 20, 1)
        self.fc = nn.Linear(20 * 4 * 4, 11)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(x + self.res(x))
        x = torch.cat([x, F.relu(self.grow(x))], 1)
        x = F.relu(self.gc(self.dw(x)))
        b, c, h, w = x.shape
        x = x.view(b, 4, c // 4, h, w).transpose(1, 2).reshape(b, c, h, w)  # channel shuffle
        s = torch.sigmoid(self.se2(F.relu(self.se1(x.mean((2, 3), keepdim=True)))))
        x = F.max_pool2d(x * s, 2)
        return self.fc(torch.flatten(x, 1))


class OddMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(30, 100), nn.Linear(100, 50), nn.Linear(50, 7)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.dropout(F.relu(self.fc1(x)), 0.0, self.training))))


class OddAttention(nn.Module):
    """Head dim 12 (d=36, 3 heads): the projections pad, the per-head matmuls keep their sizes."""

    def __init__(self, d=36, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.ln = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


def _gpt():
    return TinyGPT(vocab=1001, d=40, ctx=16), (torch.randint(0, 1001, (2, 16)),)


CASES = {
    "conv": lambda: (OddConvNet(), (torch.randn(2, 3, 8, 8),)),
    "mlp": lambda: (OddMLP(), (torch.randn(4, 30),)),
    "attention": lambda: (OddAttention(), (torch.randn(2, 5, 36),)),
    "gpt_vocab_1001_tied": _gpt,
}


def _loss(out):
    return out.float().square().mean()


@pytest.mark.parametrize("name", list(CASES))
def test_padded_equals_unpadded_outputs_and_true_gradients(name):
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    g1 = autocastfx.convert(model, inputs, pad_multiple=1, master_weights=False)
    g8 = autocastfx.convert(model, inputs, pad_multiple=8, master_weights=False)
    pad = autocastfx.report(g8).totals["padding"]
    assert pad["padded"], "nothing was padded"
    assert pad["misaligned_after"] < pad["misaligned_before"]
    assert pad["extra_flops"] > 0 and pad["extra_bytes"] > 0
    o1, o8 = g1(*inputs), g8(*inputs)
    assert o1.dtype == o8.dtype and o1.shape == o8.shape
    assert ((o8 - o1).norm() / o1.norm()) < 1e-3
    _loss(o1).backward()
    _loss(o8).backward()
    p1, p8 = dict(g1.named_parameters()), dict(g8.named_parameters())
    assert p1.keys() == p8.keys()
    for k in p1:
        assert p8[k].shape == p1[k].shape  # parameters keep their true shapes
        if p1[k].grad is not None:
            torch.testing.assert_close(p8[k].grad, p1[k].grad, rtol=2e-3, atol=1e-5, msg=k)


def test_every_gemm_aligned_at_aten_level_except_reported_skips():
    torch.manual_seed(0)
    model, inputs = CASES["conv"]()
    gm = autocastfx.convert(model, inputs)
    skipped = autocastfx.report(gm).totals["padding"]["skipped"]
    assert len(skipped) == 2 and all("grouped convolution" in s for s in skipped)  # dw and gc
    rec = AtenRecorder()
    with rec, torch.no_grad():
        gm(*inputs)
    convs = rec.ops("convolution")
    misaligned = [c for c in convs if c.in_shapes[1][0] % 8 or c.in_shapes[1][1] % 8]
    assert [c.in_shapes[1] for c in misaligned] == [(20, 1, 3, 3), (20, 5, 1, 1)]  # the two grouped convs
    for c in rec.ops("addmm", "mm"):
        w = c.in_shapes[-1]
        assert w[0] % 8 == 0 and w[1] % 8 == 0, c.in_shapes


def test_cost_gate_skips_with_reason_and_can_be_raised():
    model, inputs = nn.Conv2d(1, 16, 3), (torch.randn(1, 1, 8, 8),)
    gm = autocastfx.convert(model, inputs)
    t = autocastfx.report(gm).totals["padding"]
    assert t["skipped"] and "FLOPs over the 4x limit" in t["skipped"][0]
    gm = autocastfx.convert(model, inputs, policy=autocastfx.Policy.default().override(pad_max_growth=10))
    assert autocastfx.report(gm).totals["padding"]["padded"]


def test_padding_persists_across_zero_preserving_chain():
    torch.manual_seed(0)
    model, inputs = CASES["mlp"]()
    gm = autocastfx.convert(model, inputs)
    kept = autocastfx.report(gm).totals["padding"]["kept_padded"]
    assert len(kept) == 2  # fc1 -> relu -> dropout -> fc2 and fc2 -> gelu -> fc3 stay padded
    rec = AtenRecorder()
    with rec, torch.no_grad():
        gm(*inputs)
    narrows = [c for c in rec.calls if c.name in ("narrow", "slice")]
    assert len(narrows) == 1  # only the output of fc3 is sliced back


@pytest.mark.parametrize("opt", ["sgd", "adamw", "clip"])
def test_twenty_steps_padded_equals_unpadded(opt):
    torch.manual_seed(0)
    model, _ = CASES["mlp"]()
    runs = []
    for pm in (1, 8):
        m = copy.deepcopy(model)
        x = torch.randn(8, 30)
        gm = autocastfx.convert(m, (x,), pad_multiple=pm)
        if opt == "adamw":
            o = torch.optim.AdamW(gm.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            o = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        step = autocastfx.train_step(gm, F.cross_entropy, o, clip_grad_norm=0.5 if opt == "clip" else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            step(torch.randn(8, 30, generator=g), torch.randint(0, 7, (8,), generator=g))
        runs.append((gm, o))
    (g1, o1), (g8, o8) = runs
    for (n, a), (_, b) in zip(g1.named_parameters(), g8.named_parameters()):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=n)
    true_shapes = sorted(tuple(p.shape) for p in model.parameters())
    opt_params = [p for grp in o8.param_groups for p in grp["params"]]
    assert sorted(tuple(p.shape) for p in opt_params) == true_shapes  # no padded tensor to drift
    for p in opt_params:
        for v in o8.state[p].values():
            if torch.is_tensor(v) and v.dim():
                assert v.shape == p.shape


def test_state_dict_round_trip_into_the_original_model():
    torch.manual_seed(0)
    model, inputs = CASES["conv"]()
    gm = autocastfx.convert(model, inputs)
    sd = {k: v.float() for k, v in gm.state_dict().items()}
    fresh = OddConvNet()
    fresh.load_state_dict(sd)  # same keys, original shapes
    gm2 = autocastfx.convert(fresh, inputs)
    gm2.load_state_dict(gm.state_dict())
    masters = autocastfx.master_parameters(gm)
    assert all(m.shape == dict(model.named_parameters())[n].shape
               for n, m in gm.meta["autocastfx"].masters.items())
    assert len(masters) > 0
    gm.eval(), gm2.eval()
    torch.testing.assert_close(gm(*inputs), gm2(*inputs))


class ConvBNChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 13, 3, padding=1), nn.BatchNorm2d(13)
        self.c2, self.bn2 = nn.Conv2d(13, 10, 3, padding=1), nn.BatchNorm2d(10)

    def forward(self, x):
        return self.bn2(self.c2(F.relu(self.bn1(self.c1(x))))).mean((2, 3))


def test_padding_kept_through_batch_norm_with_true_running_statistics():
    torch.manual_seed(0)
    model, x = ConvBNChain(), torch.randn(4, 3, 8, 8)
    g1 = autocastfx.convert(model, (x,), pad_multiple=1)
    g8 = autocastfx.convert(model, (x,))
    assert autocastfx.report(g8).totals["padding"]["kept_padded"] == ["conv2d -> conv2d_1"]
    rec = AtenRecorder()
    with rec:
        for g in (g1, g8):
            g.train()
            out = g(x)
            out.square().mean().backward()
    assert torch.equal(g1(x), g8(x)) or ((g1(x) - g8(x)).norm() / g1(x).norm()) < 1e-3
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        a, b = getattr(g1.bn1, name), getattr(g8.bn1, name)
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(g8.bn1.weight.grad, g1.bn1.weight.grad, rtol=2e-3, atol=1e-5)
    for g in (g1, g8):
        g.eval()
    assert ((g1(x) - g8(x)).norm() / g1(x).norm()) < 1e-3
    assert list(g8.state_dict()) == list(g1.state_dict())
    ConvBNChain().load_state_dict({k: v.float() for k, v in g8.state_dict().items()})
    # the batch norm between the two convolutions really ran on 16 channels
    bns = [c for c in rec.ops("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional")]
    assert any(c.in_shapes[0][1] == 16 for c in bns)
