"""The CUDA kernel contract, enforced on the CPU at the aten level.

CPU kernels accept a float16 activation with float32 norm parameters; CUDA's layer_norm and group_norm do not
(autocastfx/kernels.py has each rule and its evidence). Every aten call of every test model and every norm type,
forward, backward and the optimizer step, is checked against the rules here, so CI catches what only a GPU
would show.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autocastfx
from autocastfx.core import kernels
from small_models import ALL, example


class ContractRecorder(TorchDispatchMode):
    """Checks every dispatched aten call against the CUDA rules, with its arguments' structure kept."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if name in kernels.RULES_BY_OP:
            self.seen[name] = self.seen.get(name, 0) + 1
            self.violations += kernels.violations(
                name, args, lambda a: a.dtype if isinstance(a, torch.Tensor) and a.is_floating_point() else None)
        return func(*args, **(kwargs or {}))


def _train_steps(gm, inputs, loss_fn, target, n=2, **step_kw):
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3, fused=True)
    step = autocastfx.train_step(gm, loss_fn, opt, **step_kw)
    for _ in range(n):
        step(inputs, target)


def _check(gm, inputs, loss_fn, target, expect_ops=(), steps=True):
    rec = ContractRecorder()
    with rec:
        gm.train()
        out = gm(*inputs)
        loss_fn(out, target).backward()
        gm.eval()
        with torch.no_grad():
            gm(*inputs)
        gm.train()
        if steps:
            _train_steps(gm, inputs, loss_fn, target)
    assert rec.violations == [], "\n".join(rec.violations[:10])
    for op in expect_ops:  # the check saw the op it is about
        assert rec.seen.get(op, 0) > 0, (op, rec.seen)
    return rec


def _cls_loss(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ALL)
def test_every_test_model_keeps_the_cuda_contract(name, dtype):
    model, inputs = example(name)
    gm = autocastfx.convert(model, inputs, dtype=dtype)
    out = gm(*inputs)
    target = torch.zeros(out.shape[:-1], dtype=torch.long)
    expect = ["native_layer_norm", "native_layer_norm_backward"] if name in ("vit", "gpt") else []
    rec = _check(gm, inputs, _cls_loss, target, expect)
    assert rec.seen.get("_fused_adamw_", 0) > 0  # the optimizer rule was checked too


class NormNet(nn.Module):
    """conv -> norm -> relu -> conv, for one norm type given as a module or a functional call."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        self.w = nn.Parameter(torch.ones(8) * 1.1)
        self.b = nn.Parameter(torch.zeros(8) + 0.1)
        self.register_buffer("rm", torch.zeros(8))
        self.register_buffer("rv", torch.ones(8))
        mods = {
            "BatchNorm2d": lambda: nn.BatchNorm2d(8), "GroupNorm": lambda: nn.GroupNorm(2, 8),
            "InstanceNorm2d": lambda: nn.InstanceNorm2d(8, affine=True),
            "LayerNorm": lambda: nn.LayerNorm([8, 6, 6]), "RMSNorm": lambda: nn.RMSNorm([6]),
            "SyncBatchNorm": lambda: nn.SyncBatchNorm(8),
        }
        self.norm = mods[kind]() if kind in mods else None

    def forward(self, x):
        y = self.conv1(x)
        k = self.kind
        if self.norm is not None:
            y = self.norm(y)
        elif k == "F.layer_norm":
            y = F.layer_norm(y.permute(0, 2, 3, 1), (8,), self.w, self.b).permute(0, 3, 1, 2)
        elif k == "F.group_norm":
            y = F.group_norm(y, 4, self.w, self.b)
        elif k == "F.batch_norm":
            y = F.batch_norm(y, self.rm, self.rv, self.w, self.b, training=self.training)
        elif k == "F.instance_norm":
            y = F.instance_norm(y, weight=self.w, bias=self.b)
        elif k == "F.rms_norm":
            y = F.rms_norm(y, (6,), torch.ones(6, device=y.device))
        y = self.conv2(F.relu(y))
        return self.fc(y.mean((2, 3)))


NORM_KINDS = ["BatchNorm2d", "GroupNorm", "InstanceNorm2d", "LayerNorm", "RMSNorm", "F.layer_norm",
              "F.group_norm", "F.batch_norm", "F.instance_norm", "F.rms_norm"]
_RULE_OPS = {"GroupNorm": "native_group_norm", "F.group_norm": "native_group_norm",
             "LayerNorm": "native_layer_norm", "F.layer_norm": "native_layer_norm"}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # RMSNorm: kernels.py
@pytest.mark.parametrize("capture", ["trace", "export"])
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_every_norm_type_keeps_the_cuda_contract(kind, capture):
    torch.manual_seed(0)
    model, x = NormNet(kind), torch.randn(2, 3, 6, 6)
    y = torch.tensor([1, 2])
    if capture == "export":
        gm, how = autocastfx.capture.torch_export.capture_export(copy.deepcopy(model), (x,), {})
        assert how == "torch.export"
        gm = autocastfx.convert(gm, (x,))
    else:
        gm = autocastfx.convert(model, (x,))
    # the numbers stay close to float32's (eval: running statistics, no dropout)
    ref = copy.deepcopy(model).eval()(x)
    got = gm.eval()(x)
    assert torch.allclose(got, ref, atol=1e-2, rtol=1e-2), (got - ref).abs().max()
    expect = [_RULE_OPS[kind]] if kind in _RULE_OPS else []
    _check(gm, (x,), F.cross_entropy, y, expect)


def test_rejecting_norms_run_in_float32_and_the_report_says_why():
    torch.manual_seed(0)
    for kind, op in (("LayerNorm", "native_layer_norm"), ("GroupNorm", "native_group_norm")):
        gm = autocastfx.convert(NormNet(kind), (torch.randn(2, 3, 6, 6),))
        rows = [r for r in autocastfx.report(gm).rows if r.target == "norm"]
        assert len(rows) == 1 and rows[0].dtype == "fp32" and rows[0].op_class == "fp32", rows
        assert op in rows[0].reason and "rejects" in rows[0].reason
    gm = autocastfx.convert(NormNet("BatchNorm2d"), (torch.randn(2, 3, 6, 6),))
    (row,) = [r for r in autocastfx.report(gm).rows if r.target == "norm"]
    assert row.dtype == "fp16" and row.op_class == "norm" and "accepts mixed" in row.reason


def test_contract_checker_flags_a_mixed_layer_norm():
    """The check itself can fail: the call CUDA rejects is caught on the CPU."""
    rec = ContractRecorder()
    with rec:
        F.layer_norm(torch.randn(2, 8).half(), (8,), torch.ones(8), torch.zeros(8))
    assert len(rec.violations) == 1 and "native_layer_norm" in rec.violations[0]
    rec = ContractRecorder()
    with rec:
        F.batch_norm(torch.randn(2, 8).half(), torch.zeros(8), torch.ones(8), torch.ones(8), torch.zeros(8))
        F.layer_norm(torch.randn(2, 8).half(), (8,), torch.ones(8).half(), torch.zeros(8).half())
    assert rec.violations == []


def test_user_policy_cannot_reintroduce_a_rejected_mix():
    """Asking for 'norm' on LayerNorm still gets the float32 form; 'low' gets an all-low call, also legal."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    for cls in ("norm", "low"):
        policy = autocastfx.Policy.default().override(module_types={nn.LayerNorm: cls})
        gm = autocastfx.convert(NormNet("LayerNorm"), (x,), policy=policy)
        _check(gm, (x,), F.cross_entropy, torch.tensor([0, 1]), ["native_layer_norm"], steps=False)


def test_every_rule_has_evidence():
    for r in kernels.CUDA_RULES + (kernels.FUSED_OPTIMIZER_RULE,):
        assert len(r.evidence) > 40, r
        assert r.accepts_mixed or r.same_dtype, r
