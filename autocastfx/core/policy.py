"""Op classes, the default tables, and the frozen Policy that says which op runs in which precision.

Ops are named by a bare *op name*, the same for ``F.conv2d``, ``torch.conv2d``, ``x.conv2d(...)`` and
``aten.conv2d.default``; leaf modules are classified by type. Precedence, lowest first: op name or module type,
qualified-name glob, node name.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import operator
from typing import Any, Mapping

import torch
import torch.nn as nn

from ..base.meta import original_class

PAD_GATES = ("model", "trial", "always")  # padding.py decides with these


class OpClass(str, enum.Enum):
    LOW = "low"            # runs in the low dtype: tensor-core ops
    FP32 = "fp32"          # runs in float32, every float input cast up
    PROMOTE = "promote"    # several float inputs, one dtype for all of them (chosen by the plan)
    FOLLOW = "follow"      # runs in whatever arrives (shape ops, activations, max pooling)
    NORM = "norm"          # follows its activation input; parameters and statistics stay float32
    FP32_OUT = "fp32_out"  # float32 result from any input, through the op's own dtype= argument

    def __str__(self) -> str:
        return self.value


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


LOW_OPS = _names("""
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution _convolution
    conv_tbc linear matmul mm bmm addmm addbmm baddbmm addmv mv addr einsum bilinear chain_matmul
    linalg_multi_dot linalg_vecdot _addmm_activation cudnn_convolution cudnn_convolution_transpose
    lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell lstm gru rnn_tanh rnn_relu
    scaled_dot_product_attention _scaled_dot_product_flash_attention
    _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention _native_multi_head_attention
""")
# (an RNN cell or layer runs low with its state, weights and biases, as CUDA autocast casts it: kernels.py's
# _cudnn_rnn rule)

NORM_OPS = _names("""
    batch_norm layer_norm group_norm instance_norm rms_norm native_batch_norm native_layer_norm
    native_group_norm _native_batch_norm_legit _native_batch_norm_legit_no_training
    _native_batch_norm_legit_functional cudnn_batch_norm
""")

# float32 results that the op itself can produce from a low-precision input via ``dtype=``
FP32_OUT_OPS = _names("softmax log_softmax sum mean cumsum cumprod prod nansum")

FP32_OPS = _names("""
    _softmax _log_softmax var std var_mean std_mean norm linalg_vector_norm linalg_norm frobenius_norm
    nuclear_norm renorm logsumexp logcumsumexp exp exp2 expm1 log log2 log10 log1p pow float_power sqrt
    rsqrt reciprocal sin cos tan asin acos atan sinh cosh asinh acosh atanh erfinv lgamma digamma polygamma
    softplus dist cdist pdist cosine_similarity pairwise_distance local_response_norm
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d
    cross_entropy cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss
    binary_cross_entropy binary_cross_entropy_with_logits kl_div cosine_embedding_loss ctc_loss
    margin_ranking_loss hinge_embedding_loss multilabel_margin_loss soft_margin_loss
    multilabel_soft_margin_loss triplet_margin_loss triplet_margin_with_distance_loss multi_margin_loss
    poisson_nll_loss gaussian_nll_loss
    wrap_with_set_grad_enabled wrap_with_autocast wrap
    shifted_window_attention _get_relative_position_bias _get_relative_position_bias_v2
""")
# (the last line: functions torchvision hides from tracing with torch.fx.wrap; they run whole, in float32)

PROMOTE_OPS = _names("""
    add sub rsub mul div true_divide floor_divide truediv floordiv mod remainder fmod
    cat concat concatenate stack hstack vstack dstack where addcmul addcdiv lerp maximum minimum fmax fmin
    atan2 hypot copysign eq ne lt le gt ge index_put index_add scatter scatter_add scatter_reduce
    masked_scatter prelu _prelu_kernel clamp clip xlogy cross linalg_cross dot vdot tensordot equal
    grid_sample grid_sampler grid_sampler_2d grid_sampler_3d
""")

FOLLOW_OPS = _names("""
    relu relu6 leaky_relu elu selu celu gelu silu mish hardswish hardsigmoid hardtanh sigmoid tanh softsign
    tanhshrink threshold glu logsigmoid softshrink hardshrink rrelu
    max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices
    adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d avg_pool1d avg_pool2d avg_pool3d
    dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout feature_dropout native_dropout
    view reshape _unsafe_view view_as reshape_as permute transpose t contiguous flatten unflatten squeeze
    unsqueeze expand expand_as repeat tile split split_with_sizes chunk unbind narrow select slice getitem
    index_select gather take roll flip pad constant_pad_nd reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d clone detach neg abs max min amax amin argmax argmin topk sort
    argsort masked_fill zeros_like ones_like empty_like full_like rand_like randn_like new_zeros new_ones
    new_empty new_full embedding pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle
    interpolate upsample upsample_nearest1d upsample_nearest2d upsample_bilinear2d upsample_bicubic2d
    alias lift_fresh_copy sign floor ceil round trunc identity isnan isinf isfinite logical_not
    masked_select nonzero movedim moveaxis swapaxes diagonal tril triu unfold fill fill_ zero_
    as_strided expand_copy permute_copy view_copy clamp_min clamp_max nan_to_num
    ones zeros empty full arange rand randn randint scalar_tensor linspace eye tensor
    sym_size size dim numel _assert_scalar sym_constrain_range_for_size getattr stochastic_depth _patch_merging_pad
    bernoulli uniform normal exponential geometric cauchy log_normal random
""")

# name of the dtype cast ops that the pass absorbs (float -> float casts only)
CAST_OPS = _names("to type type_as float half bfloat16 _to_copy _to_dtype to_dtype")

DEFAULT_OP_TABLE: Mapping[str, OpClass] = {
    **{n: OpClass.FOLLOW for n in FOLLOW_OPS},
    **{n: OpClass.PROMOTE for n in PROMOTE_OPS},
    **{n: OpClass.FP32 for n in FP32_OPS},
    **{n: OpClass.FP32_OUT for n in FP32_OUT_OPS},
    **{n: OpClass.NORM for n in NORM_OPS},
    **{n: OpClass.LOW for n in LOW_OPS},
}

# Leaf modules, kept as ``call_module`` nodes. Every other module (Conv, Linear, Embedding included) is traced
# through, so its parameters become graph values the plan can cast.
_mods = nn.modules
DEFAULT_MODULE_TABLE: Mapping[type, OpClass] = {
    **{t: OpClass.NORM for t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                                  nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                                  nn.InstanceNorm3d, getattr(nn, "RMSNorm", nn.LayerNorm))},
    **{t: OpClass.FOLLOW for t in (
        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
        nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
        nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softsign, nn.Tanhshrink, nn.Threshold, nn.GLU,
        nn.LogSigmoid, nn.Softshrink, nn.Hardshrink,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
        nn.AdaptiveMaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.Flatten, nn.Unflatten,
        nn.Identity, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle, nn.ZeroPad2d,
        nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d,
        nn.ReplicationPad1d, nn.ReplicationPad2d)},
    **{t: OpClass.FP32 for t in (
        nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softplus, nn.LocalResponseNorm, nn.AdaptiveAvgPool1d,
        nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss,
        nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.KLDivLoss, nn.CTCLoss,
        nn.CosineEmbeddingLoss, nn.MarginRankingLoss, nn.HingeEmbeddingLoss, nn.MultiLabelMarginLoss,
        nn.SoftMarginLoss, nn.MultiLabelSoftMarginLoss, nn.TripletMarginLoss, nn.MultiMarginLoss,
        nn.PoissonNLLLoss, nn.GaussianNLLLoss, nn.CosineSimilarity, nn.PairwiseDistance)},
}

_OPERATOR_NAMES = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.matmul: "matmul",
    operator.neg: "neg", operator.getitem: "getitem", operator.pow: "pow", operator.eq: "eq",
    operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.and_: "logical_and_op", operator.or_: "logical_or_op", operator.invert: "logical_not",
    getattr: "getattr", operator.abs: "abs", operator.pos: "identity",
}


def op_name(node: torch.fx.Node) -> str:
    """The bare op name a node is classified by (``aten.conv2d.default`` -> ``conv2d``)."""
    t = node.target
    if node.op == "call_method":
        name = str(t)
    elif node.op == "call_function":
        if t is operator.truediv and node.args and not isinstance(node.args[0], torch.fx.Node):
            return "reciprocal"  # ``1.0 / h`` is Tensor.__rtruediv__: a reciprocal, as autocast on CUDA lists it
        if t in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[t]
        if isinstance(t, torch._ops.OpOverload):
            name = t._opname
        elif isinstance(t, torch._ops.OpOverloadPacket):
            name = t._qualified_op_name.split("::")[-1]
        else:
            name = getattr(t, "__name__", str(t))
    else:
        return node.op
    if name.endswith("_") and not name.endswith("__") and name[:-1] in DEFAULT_OP_TABLE:
        name = name[:-1]  # in-place variant classifies as its out-of-place op
    return name


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which precision each op runs in. Frozen data; build variants with :meth:`override`.

    ``module_names``: (glob over qualified module names, class), later entries win. ``leaf_modules``: extra module
    types kept whole when tracing. ``fp32_routers``: gating networks and the ops up to their routing choice run in
    float32 (``plan.find_routers``) unless classed by module or node name. ``widest``: autocast's widest-type rule,
    so a FOLLOW or PROMOTE op with a float32 input runs in float32 (a transformer's residual stream stays float32);
    False lets the min-cut place every value (docs/policy.md).
    """

    op_table: Mapping[str, OpClass] = dataclasses.field(default_factory=lambda: dict(DEFAULT_OP_TABLE))
    module_types: Mapping[type, OpClass] = dataclasses.field(default_factory=lambda: dict(DEFAULT_MODULE_TABLE))
    module_names: tuple[tuple[str, OpClass], ...] = ()
    node_names: Mapping[str, OpClass] = dataclasses.field(default_factory=dict)
    leaf_modules: tuple[type, ...] = ()
    pad_max_growth: float = 4.0   # padding a GEMM/conv may grow its FLOPs at most this much (cost gate)
    pad_gate: str | None = None   # who decides each pad: "model" (cost model; None), "trial" (timed), "always"
    fp32_routers: bool = True     # a mixture-of-experts router computes its logits and choice in float32
    widest: bool = True           # an op that is not a low op never rounds a float32 input (autocast's rule)

    def __post_init__(self):
        if self.pad_gate is not None and self.pad_gate not in PAD_GATES:
            raise ValueError(f"pad_gate must be one of {', '.join(map(repr, PAD_GATES))}, got {self.pad_gate!r}: "
                             "'model' decides from a cost model of the GPU, 'trial' times both shapes on the "
                             "model's CUDA device, 'always' pads every misaligned dim within pad_max_growth")
        if not self.pad_max_growth >= 1:
            raise ValueError(f"pad_max_growth must be a number >= 1 (how many times an op's FLOPs may grow "
                             f"when padded), got {self.pad_max_growth!r}")
        if not isinstance(self.widest, bool):
            raise ValueError(f"widest must be True (float32 values stay float32 until a low op reads them) or False "
                             f"(the min-cut chooses), got {self.widest!r}")
        if not isinstance(self.fp32_routers, bool):
            raise ValueError(f"fp32_routers must be True (routers in float32) or False (routers low like any "
                             f"linear), got {self.fp32_routers!r}")

    @classmethod
    def default(cls) -> "Policy":
        return cls()

    def override(self, *, ops: Mapping[str, Any] | None = None, module_types: Mapping[type, Any] | None = None,
                 module_names: Mapping[str, Any] | None = None, node_names: Mapping[str, Any] | None = None,
                 leaf_modules: tuple[type, ...] = (), pad_max_growth: float | None = None,
                 pad_gate: str | None = None, fp32_routers: bool | None = None,
                 widest: bool | None = None) -> "Policy":
        """A new Policy with these entries added (classes given as OpClass or its value, e.g. ``"fp32"``)."""
        def conv(d):
            return {k: _as_class(v) for k, v in (d or {}).items()}
        return dataclasses.replace(
            self,
            op_table={**self.op_table, **conv(ops)},
            module_types={**self.module_types, **conv(module_types)},
            module_names=self.module_names + tuple(conv(module_names).items()),
            node_names={**self.node_names, **conv(node_names)},
            leaf_modules=self.leaf_modules + tuple(leaf_modules),
            pad_max_growth=self.pad_max_growth if pad_max_growth is None else float(pad_max_growth),
            pad_gate=self.pad_gate if pad_gate is None else pad_gate,
            fp32_routers=self.fp32_routers if fp32_routers is None else fp32_routers,
            widest=self.widest if widest is None else widest,
        )

    def is_leaf(self, module: nn.Module) -> bool:
        return original_class(module) in self.module_types or isinstance(module, self.leaf_modules)

    def classify(self, node: torch.fx.Node, module: nn.Module | None, module_path: str | None
                 ) -> tuple[OpClass | None, str]:
        """(class, reason) for a call node; class None means the op is on no list."""
        cls: OpClass | None = None
        reason = ""
        if module is not None:
            for t in type(module).__mro__:
                if t in self.module_types:
                    cls, reason = self.module_types[t], f"module type {t.__name__}"
                    break
        else:
            name = op_name(node)
            if name in self.op_table:
                cls, reason = self.op_table[name], f"op {name}"
        if module_path is not None:
            for pattern, c in self.module_names:
                if fnmatch.fnmatchcase(module_path, pattern):
                    cls, reason = c, f"module name {pattern!r}"
        if node.name in self.node_names:
            cls, reason = self.node_names[node.name], f"node name {node.name!r}"
        return cls, reason

    def by_name(self, node: torch.fx.Node, module_path: str | None) -> bool:
        """Whether a module-name glob or the node's own name classifies ``node``: the user's word, which the
        plan's own accuracy rules (routers in float32) leave alone."""
        return node.name in self.node_names or (module_path is not None and any(
            fnmatch.fnmatchcase(module_path, pattern) for pattern, _ in self.module_names))


def _as_class(v: Any) -> OpClass:
    try:
        return OpClass(v.value if isinstance(v, OpClass) else str(v).lower())
    except ValueError:
        raise ValueError(f"unknown op class {v!r}: use one of {[c.value for c in OpClass]}") from None
