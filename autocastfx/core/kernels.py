"""The dtype contract the cast plan obeys, as data with its evidence: which CUDA kernels refuse a low activation with
float32 parameters (``CUDA_RULES``; the CPU accepts such mixes, so tests/test_contract.py checks them without a GPU),
and which aten ops have no low-precision CPU kernel (``CPU_GAPS``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

_H100 = "H100 80GB, torch 2.11.0+cu130, 2026-11-22 (float16 activation, float32 weight and bias)"


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """One aten op on CUDA. ``same_dtype``: positions of the tensor arguments that must share one dtype.
    ``graph_ops`` / ``modules``: the graph-level op names and leaf module types that dispatch to it."""
    op: str
    accepts_mixed: bool
    same_dtype: tuple[int, ...]
    evidence: str
    graph_ops: frozenset[str] = frozenset()
    modules: tuple[type, ...] = ()
    measured: bool = True
    one_dtype: bool = False  # every float tensor of the same_dtype arguments, lists flattened, in one dtype


def _ops(text: str) -> frozenset[str]:
    return frozenset(text.split())


_RNN_OPS = _ops("lstm gru rnn_tanh rnn_relu")
_RNN_EVIDENCE = (
    "cuDNN runs a whole recurrent layer from one flat weight buffer of one dtype: aten/src/ATen/native/cudnn/RNN.cpp "
    "takes the data type from the input (getCudnnDataType(input)) and copies every weight and bias into that "
    "buffer (_cudnn_rnn_flatten_weight, copy_weights_to_flat_buf_views with allow_type_change=false), hx and cx "
    "in the input's dtype; nn.RNNBase.flatten_parameters gives up on weights of mixed dtypes and forward raises "
    "'RNN input dtype ... does not match weight dtype'. A float32 bias beside low weights is no legal call; "
    "not yet measured here")

CUDA_RULES: tuple[KernelRule, ...] = (
    KernelRule("native_layer_norm", False, (0, 2, 3),
               f'{_H100}: RuntimeError "expected scalar type Half but found Float"; the CPU kernel accepts it',
               _ops("layer_norm native_layer_norm"), (nn.LayerNorm,)),
    KernelRule("native_layer_norm_backward", False, (0, 1, 5, 6),
               "the backward of native_layer_norm: grad, input, weight and bias in one dtype "
               "(mean and rstd are float32 accumulators in every form)"),
    KernelRule("native_group_norm", False, (0, 1, 2),
               f'{_H100}: RuntimeError "expected scalar type Half but found Float"; the CPU kernel accepts it',
               _ops("group_norm native_group_norm"), (nn.GroupNorm,)),
    KernelRule("native_group_norm_backward", False, (0, 1, 4),
               "the backward of native_group_norm: grad, input and weight in one dtype"),
    KernelRule("native_batch_norm", True, (),
               f"{_H100}: BatchNorm1d/BatchNorm2d accept it in train and eval (cuDNN mixed mode), output float16",
               _ops("batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training "
                    "_native_batch_norm_legit_functional cudnn_batch_norm _batch_norm_with_update "
                    "_batch_norm_no_update"),
               (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)),
    KernelRule("instance_norm", True, (),
               f"{_H100}: InstanceNorm2d(affine=True) accepts it (runs as batch_norm over N*C channels)",
               _ops("instance_norm"), (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)),
    KernelRule("rms_norm", True, (),
               f"{_H100}: nn.RMSNorm accepts it (the composite upcasts inside and returns the input dtype). "
               "torch warns 'Mismatch dtype between input and weight ... Cannot dispatch to fused "
               "implementation' (layer_norm.cpp) for this mix: the fused kernel needs equal dtypes; "
               "whether that costs time on a GPU has not been timed",
               _ops("rms_norm"), tuple(t for t in (getattr(nn, "RMSNorm", None),) if t is not None)),
    KernelRule("batch_norm_elemt", True, (),
               "SyncBatchNorm's CUDA kernels (batch_norm_stats, batch_norm_elemt) take float32 parameters and "
               "statistics with a float16 input, as mixed-precision data-parallel training needs; not yet "
               "measured here", _ops(""), (nn.SyncBatchNorm,), measured=False),
    # input, weight list, weight_buf, hx, cx
    KernelRule("_cudnn_rnn", False, (0, 1, 3, 4, 5), _RNN_EVIDENCE, _RNN_OPS, (nn.LSTM, nn.GRU, nn.RNN),
               measured=False, one_dtype=True),
)

# Step-level rule, not a graph op: the fused optimizers take parameters and gradients of one dtype.
FUSED_OPTIMIZER_RULE = KernelRule(
    "_fused_adamw_", False, (0, 1),
    f"{_H100}: torch._fused_adamw_ with float32 params and float16 grads raises; the float32 parameters get "
    "float32 gradients (the graph's cast of each weight has a float32 backward)", _ops("_fused_adamw_ _fused_adam_ _fused_sgd_ _fused_adagrad_"))

RULES_BY_OP: dict[str, KernelRule] = {r.op: r for r in CUDA_RULES}
for _name in _RNN_OPS:  # the graph-level call (aten.lstm.input / .data): input or data, hx, params, and the
    # params of the .data form; batch_sizes is an integer tensor, never compared
    RULES_BY_OP[_name] = dataclasses.replace(RULES_BY_OP["_cudnn_rnn"], op=_name, same_dtype=(0, 1, 2, 3))
for _name in FUSED_OPTIMIZER_RULE.graph_ops:
    RULES_BY_OP[_name] = dataclasses.replace(FUSED_OPTIMIZER_RULE, op=_name)


def rule_for(op_name: str | None, module: nn.Module | None = None) -> KernelRule | None:
    """The CUDA rule a graph node (by bare op name, or by its leaf module) dispatches to, if any."""
    if module is not None:
        for r in CUDA_RULES:
            if r.modules and isinstance(module, r.modules):
                return r
        return None
    if op_name is None:
        return None
    for r in CUDA_RULES:
        if op_name in r.graph_ops:
            return r
    return None


def norm_form(op_name: str | None, module: nn.Module | None = None) -> tuple[bool, str]:
    """(mixed allowed, why) for a norm: mixed is a low-precision activation with float32 parameters and statistics;
    otherwise the norm runs whole in float32."""
    r = rule_for(op_name, module)
    if r is None:
        return True, "norm: follows its input; parameters and statistics float32"
    if r.accepts_mixed:
        return True, f"norm: follows its input, float32 parameters and statistics ({r.op} accepts mixed dtypes on CUDA)"
    return False, (f"norm in float32: CUDA {r.op} rejects a low-precision input with float32 parameters, so it "
                   "runs on float32 input, parameters and statistics")


def violations(op: str, args: tuple, dtype_of) -> list[str]:
    """The ways one aten call breaks the contract; ``dtype_of(arg)`` gives a tensor argument's dtype or None.
    Tensor lists (the fused optimizers' params and grads) are compared element by element."""
    r = RULES_BY_OP.get(op)
    if r is None or r.accepts_mixed:
        return []
    if r.one_dtype:
        flat = [x for i in r.same_dtype if i < len(args)
                for x in (args[i] if isinstance(args[i], (list, tuple)) else [args[i]])]
        ds = {dtype_of(x) for x in flat} - {None}
        return [f"{op}: input, state and weights have dtypes {sorted(map(str, ds))}; CUDA needs one dtype "
                f"({r.evidence})"] if len(ds) > 1 else []
    groups: list[list] = []
    for i in r.same_dtype:
        if i >= len(args):
            continue
        a = args[i]
        groups.append(list(a) if isinstance(a, (list, tuple)) else [a])
    out = []
    width = max((len(g) for g in groups), default=0)
    for k in range(width):
        ds = {dtype_of(g[k if len(g) > 1 else 0]) for g in groups if g}
        ds.discard(None)
        if len(ds) > 1:
            out.append(f"{op}: arguments {r.same_dtype} (item {k}) have dtypes {sorted(map(str, ds))}; "
                       f"CUDA needs one dtype ({r.evidence})")
    return out


# The CPU: aten ops without a low-precision kernel.

_CPU = "torch 2.13.0+cpu, 2026-11-25 (every float argument in the low dtype, forward)"
_LOW = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class CpuGap:
    """An aten op the CPU runs in float32 only (NotImplementedError ``message`` in each of ``dtypes``).
    ``graph_ops`` / ``modules``: the op names and leaf module types that reach it."""
    op: str
    dtypes: tuple[torch.dtype, ...]
    message: str
    evidence: str
    graph_ops: frozenset[str] = frozenset()
    modules: tuple[type, ...] = ()


def _gap(op: str, kernel: str, graph_ops: str, modules: tuple[type, ...] = ()) -> CpuGap:
    message = f'"{kernel}" not implemented for'
    return CpuGap(op, _LOW, message, f"{_CPU}: NotImplementedError {message} 'BFloat16' and for 'Half'",
                  _ops(graph_ops), modules)


CPU_GAPS: tuple[CpuGap, ...] = (
    # avg_pool3d is the one a model meets in a layer that would run low: lp_pool3d averages with it too
    _gap("avg_pool3d", "avg_pool3d_out_frame", "avg_pool3d", (nn.AvgPool3d,)),
    # the rest are float32 ops in the default policy; listed so that a policy asking for them low still runs
    _gap("_pdist_forward", "pdist", "pdist _pdist_forward"),
    _gap("_cdist_forward", "cdist", "cdist _cdist_forward"),
    _gap("multilabel_margin_loss_forward", "multilabel_margin_loss_forward_out_frame",
         "multilabel_margin_loss multilabel_margin_loss_forward", (nn.MultiLabelMarginLoss,)),
    _gap("multi_margin_loss", "multi_margin_loss_cpu_kernel", "multi_margin_loss", (nn.MultiMarginLoss,)),
    _gap("_ctc_loss", "ctc_loss_cpu", "ctc_loss _ctc_loss", (nn.CTCLoss,)),
)


def cpu_gap(op_name: str | None, module: nn.Module | None, dtype: torch.dtype) -> CpuGap | None:
    """The CPU gap a graph node (by bare op name, or by its leaf module) meets in ``dtype``, if any."""
    for g in CPU_GAPS:
        if dtype in g.dtypes and ((module is not None and g.modules and isinstance(module, g.modules))
                                  or (module is None and op_name in g.graph_ops)):
            return g
    return None
