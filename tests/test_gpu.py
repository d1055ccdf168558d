"""On a CUDA device: every small test model and every norm type, end to end (skipped without one).

Covers what only a GPU shows: the kernels that reject mixed dtypes (re-measured against autocastfx/kernels.py),
the policy at the aten level, numerics within 2x autocast's error, training without host syncs, train()/eval()
switching and padding exactness, on the device the suite runs on.

``AUTOCASTFX_GPU_TESTS_ON_CPU=1`` runs the same tests on the CPU (slowly, and without the kernel and sync
checks that mean nothing there), to check the tests themselves where no GPU is at hand.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from autocastfx.core import kernels
from helpers import AtenRecorder
from small_models import ALL, example
from test_contract import NORM_KINDS, ContractRecorder, NormNet
from test_graphed import fake_cuda  # noqa: F401 - a fixture: CUDA graphs emulated on the CPU
from test_modes import HFLikeLM
from test_step import SyncCounter

ON_CPU = os.environ.get("AUTOCASTFX_GPU_TESTS_ON_CPU") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs a CUDA device")]
GEMMS = ("convolution", "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA-only fact")


def _to(inputs):
    return tuple(x.to(DEV) for x in inputs)


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def _loss(out, t):
    return F.cross_entropy(out.flatten(0, -2).float(), t.flatten())


def _train(gm, inputs, target, steps=5):
    step = autocastfx.train_step(gm, _loss, torch.optim.AdamW(gm.parameters(), lr=3e-3, fused=True))
    losses = [step(inputs, target) for _ in range(3)]  # warm-up: first kernels, cuDNN choices
    if DEV == "cuda":
        torch.cuda.synchronize()
    counter = SyncCounter()
    with counter:
        for _ in range(steps):
            losses.append(step(inputs, target))
    if DEV == "cuda":
        assert counter.syncs == [], counter.syncs
    losses = [float(x) for x in losses]
    return step, losses


# ---------------------------------------------------------------------------------------------- kernels

@needs_cuda
@pytest.mark.parametrize("rule", [r for r in kernels.CUDA_RULES if r.measured and r.graph_ops],
                         ids=lambda r: r.op)
def test_cuda_norm_kernels_match_contract(rule):
    """Re-measure each rule: a float16 activation with float32 parameters is accepted or rejected as written."""
    x = torch.randn(4, 8, 6, 6, device="cuda", dtype=torch.float16)
    w, b = torch.ones(8, device="cuda"), torch.zeros(8, device="cuda")
    calls = {
        "native_layer_norm": lambda: F.layer_norm(x.permute(0, 2, 3, 1), (8,), w, b),
        "native_group_norm": lambda: F.group_norm(x, 2, w, b),
        "native_batch_norm": lambda: F.batch_norm(x, torch.zeros(8, device="cuda"), torch.ones(8, device="cuda"),
                                                  w, b, training=True),
        "instance_norm": lambda: F.instance_norm(x, weight=w, bias=b),
        "rms_norm": lambda: F.rms_norm(x, (6,), torch.ones(6, device="cuda")),
    }
    try:
        calls[rule.op]()
        torch.cuda.synchronize()
        accepted = True
    except RuntimeError:
        accepted = False
    assert accepted == rule.accepts_mixed, f"{rule.op}: the contract says {rule.accepts_mixed}; update kernels.py"


@needs_cuda
def test_cuda_fused_adamw_rejects_mixed_dtypes():
    p = [torch.zeros(4, device="cuda")]
    g = [torch.zeros(4, device="cuda", dtype=torch.float16)]
    with pytest.raises(RuntimeError):
        torch._fused_adamw_(p, g, [torch.zeros_like(p[0])], [torch.zeros_like(p[0])], [],
                            [torch.zeros((), device="cuda")], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------- every test model

@pytest.mark.parametrize("name", ALL)
def test_every_small_model_on_the_device(name):
    model, inputs = example(name, batch=8)
    model = model.to(DEV)
    inputs = _to(inputs)
    gm = autocastfx.convert(model, inputs)
    # numerics first (running statistics untouched): eval output within 2x autocast's error against float64
    model.eval()
    gm.eval()
    ref = copy.deepcopy(model).double()(*[x.double() if x.is_floating_point() else x for x in inputs])
    with torch.no_grad():
        ours = gm(*inputs)
        with torch.autocast(DEV, dtype=torch.float16):
            theirs = model(*inputs)
    e_ours, e_theirs = _rel(ours, ref), _rel(theirs, ref)
    assert e_ours <= 2 * e_theirs + 1e-4, (e_ours, e_theirs)
    with torch.no_grad():
        assert torch.equal(gm(*inputs), ours)  # eval twice: the same answer
    # the policy, at the aten level, forward and backward in train mode; and the CUDA contract
    gm.train()
    rec, contract = AtenRecorder(), ContractRecorder()
    with rec, contract:
        out = gm(*inputs)
        out.float().sum().backward()
    gemms = rec.ops(*GEMMS)
    assert gemms and all(d == torch.float16 for c in gemms for d in c.in_dtypes if d.is_floating_point), gemms[:3]
    assert contract.violations == []
    for p in gm.parameters():
        p.grad = None
    target = torch.randint(0, out.shape[-1], out.shape[:-1], device=DEV)
    _, losses = _train(gm, inputs, target)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("capture", ["trace", "export"])
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_every_norm_type_on_the_device(kind, capture):
    torch.manual_seed(0)
    model, x = NormNet(kind).to(DEV), torch.randn(8, 3, 6, 6, device=DEV)
    y = torch.randint(0, 4, (8,), device=DEV)
    if capture == "export":
        gm, _ = autocastfx.capture.torch_export.capture_export(copy.deepcopy(model), (x,), {})
        gm = autocastfx.convert(gm, (x,))
    else:
        gm = autocastfx.convert(model, (x,))
    contract = ContractRecorder()
    with contract:
        gm(x).float().sum().backward()
    assert contract.violations == []
    for p in gm.parameters():
        p.grad = None
    gm.eval()
    ref = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(gm(x).float(), ref, rtol=2e-2, atol=1e-2)
    gm.train()
    step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(gm.parameters(), lr=3e-3, fused=True))
    losses = [float(step(x, y)) for _ in range(8)]
    assert losses[-1] < losses[0], losses


def test_exported_lm_switches_modes_on_the_device():
    torch.manual_seed(0)
    model = HFLikeLM().to(DEV)
    ids = torch.randint(0, 64, (4, 16), device=DEV)
    gm = autocastfx.convert(model, (ids,))
    gm.eval()
    ref = copy.deepcopy(model).eval()(ids).logits
    for _ in range(2):
        gm.eval()
        got = gm(ids).logits
        assert torch.equal(got, gm(ids).logits)
        assert _rel(got, ref.double()) < 3e-3
        gm.train()
        assert not torch.equal(gm(ids).logits, gm(ids).logits)


def test_padding_is_exact_on_the_device():
    """Odd sizes padded to multiples of 8: outputs and true-parameter gradients as unpadded, on the device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(250, 1001), nn.ReLU(), nn.Linear(1001, 499), nn.GELU(),
                          nn.Linear(499, 10)).to(DEV)
    x = torch.randn(1024, 250, device=DEV)  # large enough that the gate pads the misaligned GEMMs
    # each from a copy: a converted module's parameters are its model's, and the two gradients must not add up
    g1 = autocastfx.convert(copy.deepcopy(model), (x,), pad_multiple=1)
    g8 = autocastfx.convert(copy.deepcopy(model), (x,), pad_multiple=8)
    assert autocastfx.report(g8).totals["padding"]["padded"]
    o1, o8 = g1(x), g8(x)
    torch.testing.assert_close(o8, o1, rtol=1e-3, atol=1e-3)
    o1.float().square().mean().backward()
    o8.float().square().mean().backward()
    for (n, a), (_, b) in zip(g1.named_parameters(), g8.named_parameters()):
        assert a.grad.shape == b.grad.shape, n
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=1e-3, msg=n)


@needs_cuda
def test_cuda_softmax_upcast_has_no_cast_kernel():
    x = torch.randn(4, 64, device="cuda").half()
    rec = AtenRecorder()
    with rec:
        torch.softmax(x, -1, dtype=torch.float32)
    assert rec.float_casts() == []


@pytest.mark.parametrize("name", ALL)
def test_every_small_model_trains_as_a_cuda_graph(name, request):
    """train_step(..., cuda_graph=True) captures each test model's whole step (convolutions, depthwise and
    grouped ones, concatenation, attention both ways, a tied embedding) and its replays follow the eager step.
    On the CPU the graphs are emulated (test_graphed.fake_cuda): no host read in the captured step, the same bits."""
    if DEV == "cpu":
        request.getfixturevalue("fake_cuda")
    model, inputs = example(name, batch=8)
    model, inputs = model.to(DEV), _to(inputs)
    steps = []
    for graph in (False, True):
        gm = autocastfx.convert(copy.deepcopy(model), inputs)  # each step trains a model of its own
        steps.append(autocastfx.train_step(gm, _loss, torch.optim.AdamW(gm.parameters(), lr=2.0**-9, fused=True),
                                           cuda_graph=graph))
    eager, gstep = steps
    with torch.no_grad():
        out = model(*inputs)
    target = torch.randint(0, out.shape[-1], out.shape[:-1], device=DEV)
    losses = [(eager(inputs, target).clone(), gstep(inputs, target).clone()) for _ in range(8)]
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert gstep.captures == 1 and gstep.replays == 5
    le, lg = (torch.stack(x).double() for x in zip(*losses))
    if DEV == "cpu":
        assert torch.equal(lg, le)
    else:   # atomics in some backward kernels (cuDNN, attention) make the bits vary from run to run
        torch.testing.assert_close(lg, le, rtol=1e-3, atol=1e-4)
    assert torch.isfinite(lg).all() and lg[-1] < lg[0], lg


# ---------------------------------------------------------------------- real models, when installed here

def test_torchvision_swin_attention_runs_low():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.swin_t(num_classes=10).to(DEV)
    x = torch.randn(2, 3, 64, 64, device=DEV)
    gm = autocastfx.convert(model, (x,))
    lines = autocastfx.report(gm).totals.get("opaque_calls", [])
    assert any("shifted_window_attention" in s and "inlined" in s for s in lines), lines
    rec, contract = AtenRecorder(), ContractRecorder()
    with rec, contract, torch.no_grad():
        gm(x)
    assert contract.violations == []
    gemms = rec.ops("mm", "addmm", "bmm")
    assert gemms and all(d == torch.float16 for c in gemms for d in c.in_dtypes if d.is_floating_point)


def test_huggingface_gpt2_trains_on_the_device():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # use_cache=False: with the cache on, GPT-2 returns a DynamicCache, which convert() cannot capture
    # (docs/huggingface.md)
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).to(DEV)
    ids = torch.randint(0, 1000, (4, 32), device=DEV)
    mask = torch.ones_like(ids)
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids})
    contract = ContractRecorder()
    with contract:
        gm(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert contract.violations == []
    for p in gm.parameters():
        p.grad = None
    step = autocastfx.train_step(gm, lambda out: out.loss, torch.optim.AdamW(gm.parameters(), lr=3e-3, fused=True))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    losses = [float(step(batch)) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
