"""Tensor-core padding: exact outputs and gradients, true-shaped parameters, aligned GEMMs at the aten level;
the gate's decisions (cost model and timed trial) with their reasons."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
import autocastfx.core.padding as padding
from autocastfx.core import cost as hardware
from autocastfx.core.propagate import propagate
from helpers import AtenRecorder
from small_models import TinyGPT


@pytest.fixture
def pad_always(monkeypatch):
    """The padding mechanism on toy models, whose layers the cost model rightly leaves alone (all
    memory-bound): the gate that pads every misaligned dim within the growth limit."""
    monkeypatch.setattr(padding, "DEFAULT_GATE", "always")


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


@pytest.mark.usefixtures("pad_always")
@pytest.mark.parametrize("name", list(CASES))
def test_padded_equals_unpadded_outputs_and_true_gradients(name):
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    # each conversion on tensors of its own (a converted module trains its model's): gradients apart
    g1 = autocastfx.convert(copy.deepcopy(model), inputs, pad_multiple=1)
    g8 = autocastfx.convert(model, inputs, pad_multiple=8)
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
        assert p8[k].shape == p1[k].shape and p8[k] is not p1[k]  # parameters keep their true shapes
        if p1[k].grad is not None:
            torch.testing.assert_close(p8[k].grad, p1[k].grad, rtol=2e-3, atol=1e-5, msg=k)


@pytest.mark.usefixtures("pad_always")
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


@pytest.mark.usefixtures("pad_always")
def test_cost_gate_skips_with_reason_and_can_be_raised():
    model, inputs = nn.Conv2d(1, 16, 3), (torch.randn(1, 1, 8, 8),)
    gm = autocastfx.convert(model, inputs)
    t = autocastfx.report(gm).totals["padding"]
    assert t["skipped"] and "FLOPs over the 4x limit" in t["skipped"][0]
    gm = autocastfx.convert(model, inputs, policy=autocastfx.Policy.default().override(pad_max_growth=10))
    assert autocastfx.report(gm).totals["padding"]["padded"]


@pytest.mark.usefixtures("pad_always")
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


@pytest.mark.usefixtures("pad_always")
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
            # eps above the FP16 rounding noise of near-zero gradients: at 1e-8 Adam turns that noise, whose
            # sign depends on the GEMM's summation order, padded or not, into whole +-lr steps
            o = torch.optim.AdamW(gm.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
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


@pytest.mark.usefixtures("pad_always")
def test_state_dict_round_trip_into_the_original_model():
    torch.manual_seed(0)
    model, inputs = CASES["conv"]()
    gm = autocastfx.convert(model, inputs)
    sd = {k: v.float() for k, v in gm.state_dict().items()}
    fresh = OddConvNet()
    fresh.load_state_dict(sd)  # same keys, original shapes
    gm2 = autocastfx.convert(fresh, inputs)
    gm2.load_state_dict(gm.state_dict())
    masters = autocastfx.master_parameters(gm)  # the model's own parameters, in their own shapes: padding
    params = dict(model.named_parameters())     # pads the low copies the graph casts, never a parameter
    names = {id(p): n for n, p in gm.named_parameters()}
    assert all(id(m) in names and m is params[names[id(m)]] and m.shape == params[names[id(m)]].shape
               for m in masters)
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


@pytest.mark.usefixtures("pad_always")
def test_padding_kept_through_batch_norm_with_true_running_statistics():
    torch.manual_seed(0)
    model, x = ConvBNChain(), torch.randn(4, 3, 8, 8)
    g1 = autocastfx.convert(copy.deepcopy(model), (x,), pad_multiple=1)  # statistics and gradients of its own
    g8 = autocastfx.convert(model, (x,))
    assert g1.bn1.running_mean is not g8.bn1.running_mean
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


# ------------------------------------------------------------------------------------ the gate's decisions

def _decisions(gm):
    """{node: (action, out, inp, rules, reason)} of a converted module's padding plan, from the report."""
    t = autocastfx.report(gm).totals["padding"]
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in t["padded"] + t["skipped"]}
    return t, lines


class Stem(nn.Module):
    """ResNet's first layer at toy size: 3 -> 64 channels, 7x7, stride 2."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).mean((2, 3))


def _conv_calls(gm, x):
    rec = AtenRecorder()
    with rec, torch.no_grad():
        gm.eval()(x)
    return rec.ops("convolution")


def test_stem_keeps_three_channels_in_nchw():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    gm = autocastfx.convert(Stem(), (x,))
    t, lines = _decisions(gm)
    assert t["gate"] == "model" and "H100" in t["target"]
    assert lines["conv2d"].startswith("skip: in 3 kept: thin-input convolution in NCHW")
    assert "implicit_convolve_sgemm" in lines["conv2d"]
    (conv,) = _conv_calls(gm, x)
    assert conv.in_shapes[0][1] == 3 and conv.in_shapes[1] == (64, 3, 7, 7)  # nothing padded at the aten level


def test_policy_chooses_the_gate():
    """``Policy.pad_gate`` reaches the padding pass: 'always' pads the NCHW stem's 3 input channels to 8 (the old
    behaviour, with the slowdown docs/padding.md measures), the default cost model keeps 3; a bad name is refused
    when the policy is made, before any conversion."""
    torch.manual_seed(0)
    x, model = torch.randn(2, 3, 32, 32), Stem()
    always = autocastfx.convert(model, (x,), policy=autocastfx.Policy.default().override(pad_gate="always"))
    t, lines = _decisions(always)
    assert t["gate"] == "always" and lines["conv2d"].startswith("pad")
    (conv,) = _conv_calls(always, x)
    assert conv.in_shapes[0][1] == 8
    torch.testing.assert_close(always(x), autocastfx.convert(model, (x,)).eval()(x), rtol=2e-3, atol=2e-3)  # both eval
    with pytest.raises(ValueError, match="pad_gate must be one of 'model', 'trial', 'always', got 'fast'"):
        autocastfx.Policy.default().override(pad_gate="fast")
    with pytest.raises(ValueError, match="pad_max_growth must be a number >= 1"):
        autocastfx.Policy.default().override(pad_max_growth=0.5)


def test_stem_pads_three_channels_to_four_in_channels_last_exactly():
    torch.manual_seed(0)
    model, x = Stem(), torch.randn(2, 3, 32, 32)
    twin = copy.deepcopy(model)  # the reference's own weights: gradients apart
    gm = autocastfx.convert(model, (x,), memory_format="channels_last")
    t, lines = _decisions(gm)
    assert lines["conv2d"].startswith("pad (+33% FLOPs): in 3 -> 4: thin-input convolution in channels_last")
    (conv,) = _conv_calls(gm, x)
    assert conv.in_shapes[0] == (2, 4, 32, 32) and conv.in_shapes[1] == (64, 4, 7, 7)  # 4, not 8
    ref = autocastfx.convert(twin, (x,), memory_format="channels_last", pad_multiple=1)
    for g in (gm, ref):
        g.train()
    out, out_ref = gm(x), ref(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-3, atol=1e-5)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert gm.conv.weight.shape == (64, 3, 7, 7)  # the parameter keeps its true shape
    torch.testing.assert_close(gm.conv.weight.grad.float(), ref.conv.weight.grad.float(), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_model_never_pads_a_three_channel_input_to_eight(layout):
    """3 -> 8 vs 3 -> 4 vs leave, for stems of every width and stride: NCHW leaves, NHWC takes 4."""
    hw = hardware.profile(hardware.DEFAULT_CAPABILITY)
    for out, k, s in [(64, 7, 2), (32, 3, 2), (24, 3, 1), (13, 3, 1)]:
        hw_out = 56 // s
        site = hardware.Site("conv", out, 3, 1, layout, flops=2 * 8 * hw_out ** 2 * out * 3 * k * k,
                             act_elements=8 * (56 * 56 * 3 + hw_out ** 2 * out))
        v = hardware.model_gate(site, 8, 4.0, hw)
        assert v.inp == (4 if layout == "channels_last" else 3), v
        assert v.rules[0] == ("thin_input_nhwc" if layout == "channels_last" else "thin_input_nchw")


def test_ten_class_head_is_left_alone():
    torch.manual_seed(0)
    x = torch.randn(4, 2048)
    gm = autocastfx.convert(nn.Linear(2048, 10), (x,))
    t, lines = _decisions(gm)
    assert lines["linear"] == ("skip: out 10 -> 16 left (+60% FLOPs): memory-bound (10 FLOP/B < 148), padding "
                               "adds bytes and no faster kernel")
    assert t["padded"] == [] and t["extra_flops"] == 0


def test_large_vocabulary_gemm_pads_to_eight():
    torch.manual_seed(0)
    model, x = nn.Linear(384, 50257), torch.randn(2, 384)
    gm = autocastfx.convert(model, (x,))
    t, lines = _decisions(gm)
    assert lines["linear"].startswith("pad (+0.01% FLOPs): out 50257 -> 50264: compute-bound")
    assert "alignment 1 -> 8 elements" in lines["linear"]
    rec = AtenRecorder()
    with rec, torch.no_grad():
        out = gm(x)
    assert [c.in_shapes[-1] for c in rec.ops("addmm", "mm")] == [(384, 50264)]
    assert out.shape == (2, 50257)
    ref = model(x)
    assert ((out - ref).norm() / ref.norm()) < 2e-3


class MidNet(nn.Module):
    """100 odd channels in the middle of a network, between an aligned stem and a grouped convolution."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 100, 3, padding=1)
        self.mid = nn.Conv2d(100, 100, 3, padding=1)
        self.dw = nn.Conv2d(100, 100, 3, padding=1, groups=100)

    def forward(self, x):
        return self.dw(F.relu(self.mid(F.relu(self.stem(x)))))


def test_mid_network_odd_channels_pad_and_grouped_convolutions_are_skipped():
    torch.manual_seed(0)
    model, x = MidNet(), torch.randn(1, 8, 4, 4)
    gm = autocastfx.convert(model, (x,))
    t, lines = _decisions(gm)
    assert lines["conv2d_1"].startswith("pad (+8% FLOPs): out 100 -> 104 in 100 -> 104: compute-bound (450 FLOP/B")
    assert "alignment 4 -> 8 elements, modeled 1.23x faster" in lines["conv2d_1"]
    assert lines["conv2d_2"] == "skip: grouped convolution (groups=100) keeps its group structure"
    # the stem's output (100 channels, 8 in) is memory-bound: left, so the middle conv pads its own input
    assert lines["conv2d"].startswith("skip: out 100 -> 104 left (+4% FLOPs): memory-bound")
    ref = autocastfx.convert(copy.deepcopy(model), (x,), pad_multiple=1)  # weights of its own: gradients apart
    out, out_ref = gm(x), ref(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-3, atol=1e-4)
    out.float().square().mean().backward()
    out_ref.float().square().mean().backward()
    for (n, p), (_, q) in zip(gm.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and p is not q
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2e-3, atol=1e-5, msg=n)


def test_every_rule_has_its_evidence():
    for rule in hardware.RULES:
        assert rule.says and len(rule.evidence) > 40, rule.name
    assert set(hardware.ALIGN_EFFICIENCY) == set(hardware.ALIGN_EVIDENCE) == {1, 2, 4, 8}
    # the measured end: an align1 GEMM is modeled 5x slower than an aligned one
    assert hardware.ALIGN_EFFICIENCY[1] / hardware.ALIGN_EFFICIENCY[8] == pytest.approx(0.2)
    assert hardware.alignment(50257) == 1 and hardware.alignment(100) == 4 and hardware.alignment(768, 10) == 2


def test_unknown_gate_is_refused():
    gm = _traced(nn.Linear(30, 100), torch.randn(2, 30))
    with pytest.raises(ValueError, match="pad_gate must be one of 'model', 'trial', 'always'"):
        padding.plan_padding(gm, 8, gate="fast")


# ------------------------------------------------------------------------------------------- timed trial

def _traced(model, x):
    gm = fx.symbolic_trace(model)
    propagate(gm, (x,), {})
    return gm


class StubTimer:
    """Seconds per (out, inp) padding of the op; counts its calls, as a real timer's cost."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, case):
        self.calls.append(case)
        return self.times[(case.out, case.inp)]


def test_trial_pads_to_the_fastest_candidate_and_caches_per_shape():
    x = torch.randn(2, 3, 16, 16)
    gm = _traced(nn.Conv2d(3, 13, 3, padding=1), x)
    timer = StubTimer({(13, 3): 2e-3, (16, 3): 1.9e-3, (13, 4): 1.2e-3, (16, 4): 1.0e-3, (13, 8): 3e-3,
                       (16, 8): 2.5e-3})
    cache = {}
    plan = padding.plan_padding(gm, 8, gate="trial", timer=timer, cache=cache, layout="channels_last")
    (d,) = plan.decisions
    assert plan.gate == "trial" and d.action == "pad" and (d.out, d.inp) == ((13, 16), (3, 4))
    assert d.rules == ("trial",)
    assert d.reason == "pad (+64% FLOPs): timed on cpu: unpadded 2 ms, out 13 -> 16 in 3 -> 4 1 ms (2.00x)"
    assert len(timer.calls) == 6 and len(cache) == 6  # the unpadded op and the 5 candidates, once each
    case = timer.calls[0]
    assert (case.kind, case.x_shape, case.w_shape, case.layout) == ("conv", (2, 3, 16, 16), (13, 3, 3, 3),
                                                                    "channels_last")
    assert case.conv_args == ((1, 1), (1, 1), (1, 1)) and case.bias and not case.input_grad
    padding.plan_padding(gm, 8, gate="trial", timer=timer, cache=cache, layout="channels_last")
    assert len(timer.calls) == 6  # a second conversion of the same shapes times nothing
    gm2 = _traced(nn.Conv2d(3, 13, 3, padding=1), torch.randn(4, 3, 16, 16))
    padding.plan_padding(gm2, 8, gate="trial", timer=timer, cache=cache, layout="channels_last")
    assert len(timer.calls) == 12  # another batch size is another shape


def test_trial_skips_when_no_candidate_is_ten_percent_faster():
    x = torch.randn(4, 2048)
    gm = _traced(nn.Linear(2048, 10), x)
    timer = StubTimer({(10, 2048): 1.0e-5, (16, 2048): 0.95e-5})
    (d,) = padding.plan_padding(gm, 8, gate="trial", timer=timer, cache={}).decisions
    assert d.action == "skip" and d.rules == ("trial",)
    assert d.reason.endswith("unpadded 0.01 ms, out 10 -> 16 0.0095 ms (1.05x), not 1.1x faster")


def test_trial_without_a_cuda_device_falls_back_to_the_cost_model():
    gm = _traced(nn.Linear(2048, 10), torch.randn(4, 2048))
    plan = padding.plan_padding(gm, 8, gate="trial")
    assert plan.gate == "model" and "a timed trial needs a CUDA device" in plan.target
    assert plan.decisions[0].rules == ("memory_bound",)


class _Unbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 10, 3, padding=1), nn.Conv2d(10, 12, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


def test_a_convolution_of_an_unbatched_input_is_not_padded():
    """Before: padding took dim 1 as a convolution's channels, which is the height of an unbatched (C, H, W) input:
    the output came back (16, 12, 16) for (12, 16, 16), its values wrong, with no error."""
    torch.manual_seed(0)
    model, x = _Unbatched(), torch.randn(8, 16, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16,
                            policy=autocastfx.Policy.default().override(pad_gate="always"))
    out, want = gm(x), model(x)
    assert out.shape == want.shape and float((out.float() - want).norm() / want.norm()) < 2e-2


class _TokensThroughBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 20), nn.BatchNorm1d(24), nn.Linear(20, 12)

    def forward(self, x):  # (N, 24, 16): the batch norm's channels are the 24 tokens, not the features
        return self.fc2(self.bn(self.fc1(x)))


def test_a_linears_padded_features_do_not_pass_through_a_batch_norm_of_another_dim():
    """Before: a linear's padded output was kept padded through a BatchNorm1d whose channels (dim 1) are not the
    features (the last dim) of an (N, L, F) input, so the norm took statistics over the zero features (output
    0.115 off float32, running mean 0.167; autocast 0.004 and 0.002)."""
    torch.manual_seed(0)
    model, x = _TokensThroughBatchNorm(), torch.randn(4, 24, 16)
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16,
                            policy=autocastfx.Policy.default().override(pad_gate="always"))
    out, want = gm(x), ref(x)
    assert float((out.float() - want).norm() / want.norm()) < 2e-2
    assert float((gm.bn.running_mean - ref.bn.running_mean).norm() / ref.bn.running_mean.norm()) < 2e-2


@pytest.mark.usefixtures("pad_always")
def test_a_padded_batch_norm_saved_in_training_mode_loads(tmp_path):
    """The padded batch norm wrote its statistics back inside torch.no_grad(), which torch.export records as a
    region its own loader refuses: autocastfx.save and autocastfx.export wrote files in training mode that did not
    load ("wrap_with_set_grad_enabled is missing val field")."""
    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(100, 100, 3, padding=1), nn.BatchNorm2d(100)
            self.c2 = nn.Conv2d(100, 100, 3, padding=1)

        def forward(self, x):
            return self.c2(torch.relu(self.bn(self.c1(x))))

    torch.manual_seed(0)
    x = torch.randn(2, 100, 8, 8)
    gm = autocastfx.convert(ConvBN(), (x,), dtype=torch.bfloat16)
    assert type(gm.bn).__name__.startswith("ChannelPadded")
    autocastfx.save(gm, tmp_path / "m.acfx")
    loaded = autocastfx.load(tmp_path / "m.acfx")
    autocastfx.export(gm, tmp_path / "m.pt2", (x,))
    exported = torch.export.load(str(tmp_path / "m.pt2")).module()
    with torch.no_grad():
        want = gm(x)
        for other in (loaded, exported):
            torch.testing.assert_close(other(x), want)


def test_a_channel_padded_batch_norm_takes_momentum_none_as_batch_norm_does():
    """swa_utils.update_bn sets each batch norm's momentum to None (a cumulative average); the padded batch norm
    a pad_gate="always" conversion runs passed None on to F.batch_norm, a TypeError. It now averages as
    nn.BatchNorm2d does, its statistics those of the plain layer."""
    from autocastfx.core.padding import _padded_bn_class
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(6)
    padded = _padded_bn_class(nn.BatchNorm2d)(6)
    padded.padded_to = 8
    plain.momentum = padded.momentum = None
    for _ in range(3):
        x = torch.randn(4, 6, 5, 5) * 3 + 1
        plain(x)
        padded(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 2)))
    assert int(padded.num_batches_tracked) == 3
    torch.testing.assert_close(padded.running_mean, plain.running_mean)
    torch.testing.assert_close(padded.running_var, plain.running_var)
