"""The CPU kernel contract: the aten ops without a float16/bfloat16 CPU kernel (kernels.CPU_GAPS) run in float32.

The probe runs the ops of torch's autocast lists (read from the installed torch) and the pooling, norm, padding
and upsampling ops on the CPU in both low dtypes, forward and backward, and finds which aten op raises "not
implemented for 'BFloat16'" (or 'Half') where the same call runs in float32. That set must be the data: a
kernel a new torch adds, or one it drops, fails here.
"""
import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import autocastfx
from autocastfx.core import kernels
from helpers import capture
from autocastfx.core.propagate import propagate
from autocastfx.core.plan import build_plan
from test_op_coverage import entries

pytestmark = [  # torch's own warnings about the probed calls
    pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated"),
    pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim"),
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),  # rms_norm: kernels.py
]

LOW = (torch.bfloat16, torch.float16)


def _r(*shape):
    return torch.randn(*shape)


def _bn(training):  # running statistics in the parameters' dtype
    return lambda x, w, b: F.batch_norm(x, torch.zeros(3, dtype=w.dtype), torch.ones(3, dtype=w.dtype), w, b,
                                        training=training)


# (name, fn, args, kwargs, float32 arguments that stay float32 in the mixed form a norm runs in)
EXTRA = [
    *[(f"{kind}_pool{k}d", getattr(F, f"{kind}_pool{k}d"), (_r(2, 3, *[8] * k), 2), {}, ())
      for kind in ("max", "avg") for k in (1, 2, 3)],
    *[(f"adaptive_{kind}_pool{k}d", getattr(F, f"adaptive_{kind}_pool{k}d"), (_r(2, 3, *[8] * k), 3), {}, ())
      for kind in ("max", "avg") for k in (1, 2, 3)],
    *[(f"lp_pool{k}d", getattr(F, f"lp_pool{k}d"), (_r(2, 3, *[8] * k), 2.0, 2), {}, ()) for k in (1, 2, 3)],
    *[(f"fractional_max_pool{k}d", getattr(F, f"fractional_max_pool{k}d"), (_r(2, 3, *[8] * k), 2),
       {"output_size": 4}, ()) for k in (2, 3)],
    ("avg_pool3d_ceil", F.avg_pool3d, (_r(2, 3, 5, 5, 5), 2), {"ceil_mode": True}, ()),
    ("batch_norm_train", _bn(True), (_r(4, 3, 5), _r(3), _r(3)), {}, (1, 2)),
    ("batch_norm_eval", _bn(False), (_r(4, 3, 5), _r(3), _r(3)), {}, (1, 2)),
    ("layer_norm", F.layer_norm, (_r(4, 6), (6,), _r(6), _r(6)), {}, (2, 3)),
    ("group_norm", F.group_norm, (_r(4, 6, 5), 2, _r(6), _r(6)), {}, (2, 3)),
    ("instance_norm", lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (_r(4, 6, 5), _r(6), _r(6)), {},
     (1, 2)),
    ("rms_norm", F.rms_norm, (_r(4, 6), (6,), _r(6)), {}, (2,)),
    ("local_response_norm", F.local_response_norm, (_r(2, 6, 5, 5), 3), {}, ()),
    *[(f"{mode}_pad{k}d", F.pad, (_r(2, 3, *[8] * k), (2,) * (2 * k)), {"mode": mode}, ())
      for mode in ("reflect", "replicate", "circular") for k in (1, 2, 3)],
    *[(f"upsample_{mode}", F.interpolate, (_r(2, 3, *[4] * k),), {"scale_factor": 2, "mode": mode}, ())
      for mode, k in (("nearest", 1), ("nearest", 2), ("nearest", 3), ("linear", 1), ("bilinear", 2),
                      ("bicubic", 2), ("trilinear", 3))],
    ("grid_sample_3d", F.grid_sample, (_r(2, 3, 4, 4, 4), _r(2, 2, 2, 2, 3)), {"align_corners": False}, ()),
    ("ctc_loss", F.ctc_loss, (_r(5, 2, 4).log_softmax(2), torch.tensor([[1, 2], [1, 1]]), torch.tensor([5, 5]),
                              torch.tensor([2, 2])), {}, ()),
]


def probes():
    """(name, fn, args, kwargs, kept float32) for every op probed."""
    out = [(e.id, e.fn, e.args[torch.float16], e.kwargs, ()) for e in entries()]
    return out + EXTRA


class LastOp(TorchDispatchMode):
    """The aten op that raised: the last one entered."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func._opname
        return func(*args, **(kwargs or {}))


def _call(fn, args, kwargs, dtype, keep=(), backward=True):
    """Run forward (and backward) with every float tensor in ``dtype`` (those at ``keep`` float32)."""
    def cast(i, v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(torch.float32 if i in keep else dtype).requires_grad_(backward)
        return v
    args = tuple(tree_map(functools.partial(cast, i), v) for i, v in enumerate(args))
    kwargs = tree_map(functools.partial(cast, -1), kwargs)
    out = fn(*args, **kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        sum(o.float().sum() for o in outs).backward()


def _runs(fn, args, kwargs, backward) -> bool:
    try:
        _call(fn, args, kwargs, torch.float32, backward=backward)
        return True
    except Exception:  # noqa: BLE001 - no float32 kernel (cuDNN only) or no derivative: nothing to ask in low
        return False


def probe_cpu() -> tuple[dict, list[str]]:
    """({(aten op, dtype): message} for each kernel the CPU lacks, [probes that failed another way])."""
    gaps, odd = {}, []
    for name, fn, args, kwargs, keep in probes():
        backward = _runs(fn, args, kwargs, True)  # forward alone where float32 has no backward
        if not backward and not _runs(fn, args, kwargs, False):
            continue
        for dtype in LOW:
            for form in ((), keep) if keep else ((),):
                last = LastOp()
                try:
                    with last:
                        _call(fn, args, kwargs, dtype, form, backward)
                except Exception as ex:  # noqa: BLE001 - sorted below
                    msg = str(ex).splitlines()[0]
                    what = {torch.bfloat16: "'BFloat16'", torch.float16: "'Half'"}[dtype]
                    if f"not implemented for {what}" in msg:
                        gaps[(last.op, dtype)] = msg
                    else:
                        odd.append(f"{name} ({dtype}, float32 at {form}): {type(ex).__name__}: {msg[:160]}")
    return gaps, odd


def test_cpu_gaps_are_what_the_installed_torch_lacks():
    gaps, odd = probe_cpu()
    assert odd == [], "probes failing for a reason other than a missing kernel:\n" + "\n".join(odd)
    data = {(g.op, d): g for g in kernels.CPU_GAPS for d in g.dtypes}
    new = sorted(f"{op} {d}: {gaps[(op, d)]}" for op, d in set(gaps) - set(data))
    gone = sorted(f"{op} {d}" for op, d in set(data) - set(gaps))
    assert not new, "the CPU lacks kernels kernels.CPU_GAPS does not list:\n" + "\n".join(new)
    assert not gone, "kernels.CPU_GAPS lists kernels the installed torch has:\n" + "\n".join(gone)
    for key, msg in gaps.items():
        assert data[key].message in msg, (key, msg, data[key].message)


def test_every_cpu_gap_has_evidence_and_graph_names():
    table = autocastfx.Policy.default().op_table
    for g in kernels.CPU_GAPS:
        assert g.evidence.startswith("torch ") and g.message in g.evidence and g.dtypes, g
        assert any(op in table for op in g.graph_ops), g  # a name the plan classifies
        for op in g.graph_ops:
            assert kernels.cpu_gap(op, None, torch.bfloat16) is g
        for m in g.modules:
            assert kernels.cpu_gap(None, m.__new__(m), torch.float16) is g


class Pool3dNet(nn.Module):
    """conv3d -> relu -> AvgPool3d (module) -> avg_pool3d (functional) -> linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.pool = nn.AvgPool3d(2)
        self.fc = nn.Linear(64, 4)

    def forward(self, x):
        y = self.pool(F.relu(self.conv(x)))
        y = F.avg_pool3d(y, 2)
        return self.fc(y.flatten(1))


@pytest.mark.parametrize("capture", ["trace", "export"])
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_avg_pool3d_runs_in_float32_on_the_cpu(dtype, capture):
    torch.manual_seed(0)
    model, x = Pool3dNet(), torch.randn(2, 3, 8, 8, 8)
    with pytest.raises(NotImplementedError, match="avg_pool3d_out_frame"):  # what a low avg_pool3d meets here
        F.avg_pool3d(torch.randn(1, 1, 4, 4, 4, dtype=dtype), 2)
    if capture == "export":
        gm, how = autocastfx.capture.torch_export.capture_export(copy.deepcopy(model), (x,), {})
        assert how == "torch.export"
        gm = autocastfx.convert(gm, (x,), dtype=dtype)
    else:
        gm = autocastfx.convert(model, (x,), dtype=dtype)
    out = gm(x)
    out.sum().backward()
    ref = model(x)
    assert torch.allclose(out, ref, atol=5e-2, rtol=5e-2), (out - ref).abs().max()
    rows = [r for r in autocastfx.report(gm).rows if "pool" in r.name and r.kind == "op"]
    assert len(rows) == 2, [(r.name, r.target) for r in autocastfx.report(gm).rows]
    for r in rows:
        assert r.dtype == "fp32" and "no " in r.reason and "avg_pool3d" in r.reason, r
    conv = [r for r in autocastfx.report(gm).rows if "conv" in r.name and r.op_class == "low"]
    assert conv and conv[0].dtype != "fp32"  # the rest of the model stays low


def test_the_cpu_gap_is_the_cpu_only():
    """Planned for tensors on another device, avg_pool3d follows its input as before."""
    model, x = Pool3dNet(), torch.randn(2, 3, 8, 8, 8)
    labels = {}
    for device in ("cpu", "cuda"):
        gm, _ = capture(model, (x,), {}, autocastfx.Policy.default())
        propagate(gm, (x,), {})
        for n in gm.graph.nodes:
            info = n.meta.get("autocastfx_info")
            if isinstance(info, autocastfx.base.meta.TensorInfo):
                n.meta["autocastfx_info"] = dataclasses.replace(info, device=device)
        plan = build_plan(gm, autocastfx.Policy.default(), torch.bfloat16, keep_io_types=True)
        labels[device] = {k: (v.op_class, v.label) for k, v in plan.nodes.items() if "pool" in k}
    assert set(labels["cpu"].values()) == {(autocastfx.core.policy.OpClass.FP32, False)}, labels
    assert set(labels["cuda"].values()) == {(autocastfx.core.policy.OpClass.FOLLOW, True)}, labels
