"""Plan: which dtype every value has and where the casts go.

Each call node gets a *label*, LOW or FP32. LOW and FP32 ops are fixed; FOLLOW, PROMOTE and NORM ops are labelled
to move the fewest bytes through casts. A cast is shared: value ``u`` costs ``numel(u)`` once per dtype some
consumer needs that ``u`` is not in. With two labels that is an exact s-t minimum cut.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..base.meta import is_converted, module_path, TensorInfo
from . import kernels as _kernels
from .aliases import alias_groups
from .policy import FP32_OUT_OPS, OpClass, Policy, op_name
from ..base import keys as K
from .mincut import cast_cost, FP32, LOW, naive_labels, Problem, Req, solve_min_cut
from ..base.quiet import warn_user


@dataclasses.dataclass
class NodePlan:
    op_class: OpClass | None
    label: bool | None          # LOW / FP32 / None (not a float value)
    reason: str
    fp32_out: bool = False      # takes dtype=float32 instead of a cast of its input


@dataclasses.dataclass
class CastPlan:
    """The printable result of planning. ``casts``: (value, to_low) pairs."""
    dtype: torch.dtype
    nodes: dict[str, NodePlan]
    reqs: dict[str, list[Req]]
    casts: list[tuple[str, bool]]
    unclassified: list[str]
    before: tuple[int, int]      # (elements cast, casts) with the naive rule
    after: tuple[int, int]       # (elements cast, casts) after the min-cut
    weight: dict[str, int]

    def __str__(self) -> str:
        lines = [f"CastPlan(dtype={self.dtype}, casts {self.before[1]} -> {self.after[1]}, "
                 f"elements cast {self.before[0]} -> {self.after[0]})"]
        for v, to_low in self.casts:
            lines.append(f"  cast {v} -> {'low' if to_low else 'fp32'} ({self.weight.get(v, 0)} elements)")
        return "\n".join(lines)


def _float_inputs(node: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for a in node.all_input_nodes:
        info = a.meta.get(K.INFO)
        if _is_float(info) or _is_multi_float(info):
            if a not in seen:
                seen.append(a)
    return seen


def _is_float(info: Any) -> bool:
    return isinstance(info, TensorInfo) and info.is_float


def _is_multi_float(info: Any) -> bool:
    return isinstance(info, tuple) and any(_is_float(i) for i in info)


def _unit_inputs(node: fx.Node, unit: nn.Module) -> list[tuple[fx.Node, torch.dtype]]:
    """(float input, the dtype the block was converted for) for a call of a converted block."""
    want = unit.meta.get(K.BLOCK, {}).get("inputs")
    leaves = torch.utils._pytree.tree_leaves((tuple(node.args), dict(node.kwargs)))
    if want is None or len(want) != len(leaves):
        raise ValueError(f"{node.name} calls the converted block {node.target} with inputs of another structure "
                         "than the one it was converted with")
    out = []
    for a, d in zip(leaves, want):
        if isinstance(a, fx.Node) and _is_float(a.meta.get(K.INFO)):
            if d is None:
                raise ValueError(f"{node.name}: input {a.name} of the converted block {node.target} is a float "
                                 "tensor where the block was converted for something else")
            out.append((a, d))
    return out


def _unit_output_label(node: fx.Node, info: Any, low: torch.dtype) -> bool:
    infos = [info] if _is_float(info) else [i for i in info if _is_float(i)] if _is_multi_float(info) else []
    dtypes = {i.dtype for i in infos}
    if len(dtypes) > 1:
        raise ValueError(f"the converted block {node.target} returns float tensors of several dtypes "
                         f"({sorted(map(str, dtypes))}): a tuple cannot be cast apart")
    return LOW if dtypes == {low} else FP32


def _on_cpu(fins: list[fx.Node]) -> bool:
    """Whether an op's float inputs live on the CPU (where a few ops have no low-precision kernel)."""
    for a in fins:
        info = a.meta.get(K.INFO)
        for i in (info if isinstance(info, tuple) else (info,)):
            if _is_float(i):
                return i.device == "cpu"
    return False


def _accepts_dtype_kwarg(node: fx.Node) -> bool:
    if op_name(node) not in FP32_OUT_OPS:
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return any(a.name == "dtype" and a.kwarg_only for a in t._schema.arguments)
    return node.op in ("call_function", "call_method")


_AVG_POOLS = {"adaptive_avg_pool1d": 1, "adaptive_avg_pool2d": 2, "adaptive_avg_pool3d": 3,
              "_adaptive_avg_pool2d": 2, "_adaptive_avg_pool3d": 3}


def global_pool_dims(node: fx.Node, module: nn.Module | None = None) -> tuple[int, ...] | None:
    """The dims an adaptive average pooling averages away, when its output is 1 x ... x 1 (a global mean)."""
    if module is not None:
        k = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}.get(type(module))
    else:
        k = _AVG_POOLS.get(op_name(node)) if node.op in ("call_function", "call_method") else None
    info = node.meta.get(K.INFO)
    if not k or not isinstance(info, TensorInfo) or len(info.shape) < k or node.kwargs:
        return None
    if any(s != 1 for s in info.shape[-k:]):
        return None
    return tuple(range(-k, 0))


def _target_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _out_of_range_constant(node: fx.Node, low: torch.dtype) -> float | None:
    """A finite float constant argument beyond ``low``'s range, on which the op fails in ``low`` ("value cannot be
    converted to type c10::Half without overflow"): torch.export writes HF masks' float32-min fill as a number."""
    limit = torch.finfo(low).max
    for a in itertools.chain(node.args, node.kwargs.values()):
        if isinstance(a, float) and math.isfinite(a) and abs(a) > limit:
            return a
    return None


_GUARDS = {"clamp_min", "clamp", "clip", "maximum", "max", "add", "__add__", "__radd__", "iadd"}
_SHAPE_ONLY = {n: True for n in ("expand", "expand_as", "view", "reshape", "unsqueeze", "broadcast_to",
                                 "contiguous", "repeat", "permute", "transpose", "squeeze", "flatten", "clone")}


def _vanishing_constant(node: fx.Node, low: torch.dtype) -> float | None:
    """A nonzero float constant an op guards with (``norm.clamp_min(1e-12)``, ``x + 1e-12``) that ``low`` rounds to
    zero: in the low dtype the guard is gone, and the division it protects gives 0/0 (a zero vector under
    F.normalize, as swin_v2's cosine attention has in its padded windows)."""
    if op_name(node) not in _GUARDS:
        return None
    tiny = torch.finfo(low).smallest_normal * torch.finfo(low).eps  # the smallest subnormal
    for a in itertools.chain(node.args[1:], node.kwargs.values()):
        if isinstance(a, float) and a != 0.0 and math.isfinite(a) and abs(a) < tiny / 2:
            return a
    return None


def _builds_output(node: fx.Node, depth: int = 0) -> bool:
    """Whether ``node`` is the graph's output or packed into it (a dataclass the forward returns, in a tuple)."""
    return any(u.op == "output" or (depth < 4 and _builds_structure(u) and _builds_output(u, depth + 1))
               for u in node.users)


def _builds_structure(node: fx.Node) -> bool:
    """A call that only packs values into a container: a namedtuple, a dataclass (Hugging Face's ModelOutput
    is one), or the dict/tuple/list constructors. Not an op: no warning, and it follows what it packs."""
    t = node.target
    if node.op != "call_function":
        return False
    if t in (tuple, list, dict):
        return True
    if not isinstance(t, type):
        return False
    return ((issubclass(t, tuple) and hasattr(t, "_fields")) or dataclasses.is_dataclass(t)
            or any(b.__name__ == "ModelOutput" for b in t.__mro__))


_ROUTE_CHOICES = frozenset({"topk", "argmax", "argmin", "argsort", "sort"})  # a choice by rank: near-ties flip it
_GATES = frozenset({"linear", "matmul", "mm", "addmm", "einsum"})
# two float tensors are compared in float32: rounded, x < y can flip (a float32 x just below a low y)
_COMPARISONS = frozenset("eq ne lt le gt ge equal isclose __eq__ __ne__ __lt__ __le__ __gt__ __ge__".split())

_ROUTE_THROUGH = (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.FP32, OpClass.FP32_OUT)
_ROUTE_DEPTH = 8  # ops between a gate and its choice (a router is a few: softmax or sigmoid, views, a bias)


def find_routers(gm: fx.GraphModule, policy: Policy) -> tuple[dict[str, str], set[str]]:
    """The gating networks of ``gm``, which run in float32 because a rounded near-tie sends a token to another
    expert: a low linear or matmul, narrower than its input (so not an LM head), whose result reaches a topk, argmax
    or sort through at most ``_ROUTE_DEPTH`` elementwise, shape and softmax ops.

    Returns:
        ({node: reason} for each gate, the ops up to its choice and the choice; the set of gates).
    """
    if not policy.fp32_routers:
        return {}, set()
    out: dict[str, str] = {}
    gates: set[str] = set()
    for choice in gm.graph.nodes:
        if choice.op not in ("call_function", "call_method") or op_name(choice) not in _ROUTE_CHOICES:
            continue
        fins = _float_inputs(choice)
        if not fins:
            continue
        toward = {fins[0]: choice}  # node -> its reader one step nearer the choice
        todo = [(fins[0], 1)]
        while todo:
            n, depth = todo.pop()
            if n.op not in ("call_function", "call_method") or policy.by_name(n, module_path(n)):
                continue
            name = op_name(n)
            if name in _GATES:  # the walk ends at the first matmul: a gate when low and narrow
                if policy.classify(n, None, None)[0] is OpClass.LOW and _narrows(n):
                    path, m = [], n
                    while m is not choice:
                        path.append(m)
                        m = toward[m]
                    via = [op_name(m) for m in path[1:]]
                    what = f"{op_name(choice)} ({choice.name})" + (f" through {', '.join(via)}" if via else "")
                    out[n.name] = (f"router: feeds {what}: logits in float32 from float32 inputs, so near-ties "
                                   "choose as float32 does (Policy.fp32_routers)")
                    gates.add(n.name)
                    for m in path[1:]:
                        out.setdefault(m.name, f"router: between the gate {n.name} and its choice {choice.name}: "
                                                "float32")
                    out.setdefault(choice.name, f"router: the choice of the gate {n.name}: float32")
                continue
            if depth >= _ROUTE_DEPTH or (policy.classify(n, None, None)[0] not in _ROUTE_THROUGH
                                         and not n.meta.get(K.UPCAST)):  # the model's own .float()
                continue
            for a in _float_inputs(n):
                if a not in toward:
                    toward[a] = n
                    todo.append((a, depth + 1))
    return out, gates


def _narrows(node: fx.Node) -> bool:
    """Whether a matmul's result is narrower than its input (last dims): scores over a few choices."""
    fins = _float_inputs(node)
    info, x = node.meta.get(K.INFO), fins[0].meta.get(K.INFO) if fins else None
    return (_is_float(info) and _is_float(x) and len(info.shape) > 0 and len(x.shape) > 0
            and info.shape[-1] < x.shape[-1])


@dataclasses.dataclass
class _Planning:
    """The working state of ``build_plan``: its arguments (read only), then what the walk learns, in graph order."""
    gm: fx.GraphModule
    policy: Policy
    low: torch.dtype
    keep_io_types: bool
    free_inputs: frozenset[str]
    params: dict[str, nn.Parameter]                 # the graph module's parameters, tied names included
    routers: dict[str, str]                         # node -> reason, for the gates, their paths and choices
    gates: set[str]
    nodes: dict[str, NodePlan] = dataclasses.field(default_factory=dict)
    fixed: dict[str, bool] = dataclasses.field(default_factory=dict)       # node -> its label, where fixed
    free: list[str] = dataclasses.field(default_factory=list)              # nodes whose label the min-cut picks
    weight: dict[str, int] = dataclasses.field(default_factory=dict)       # float value -> numel (its cast cost)
    reqs: dict[str, list[Req]] = dataclasses.field(default_factory=dict)   # value -> what its consumers need
    multi: set[str] = dataclasses.field(default_factory=set)               # tuples holding float tensors
    unclassified: list[str] = dataclasses.field(default_factory=list)      # "node (op)" for ops on no list
    promote: set[str] = dataclasses.field(default_factory=set)             # PROMOTE ops (for the naive rule)
    widen: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (value, reader): never rounded there
    inputs: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # call node -> its float inputs
    # values an epsilon keeps from zero that the low dtype would round to zero
    guarded: set[str] = dataclasses.field(default_factory=set)
    io_label: bool = FP32            # the first float input's label: the outputs keep it with keep_io_types
    seen_float_input: bool = False

    def req(self, u: fx.Node, r: Req) -> None:
        self.reqs.setdefault(u.name, []).append(r)


def build_plan(gm: fx.GraphModule, policy: Policy, low: torch.dtype, *, keep_io_types: bool, free_inputs: frozenset[str] = frozenset()) -> CastPlan:
    """The cast plan of ``gm``: a label (low or float32) for every float value, by a min-cut over the casts.
    ``free_inputs``: placeholders whose dtype the plan chooses too (a block's inputs, cast on entry)."""
    routers, gates = find_routers(gm, policy)
    st = _Planning(gm, policy, low, keep_io_types, free_inputs,
                   dict(gm.named_parameters(remove_duplicate=False)), routers, gates)
    for node in gm.graph.nodes:
        _plan_node(st, node)
    for value, reader in st.widen:  # a parameter a widening op reads: say why it gets no cast there
        if value in st.nodes and st.nodes[value].reason == "parameter, kept float32":
            st.nodes[value].reason = (f"parameter read by {reader}, which does not round a float32 value "
                                      "(Policy.widest, as autocast): kept float32")
    # the naive rule's cost, for the report to compare with
    problem = Problem(st.fixed, st.free, st.weight, st.reqs, st.multi, widen=st.widen)
    order = [n.name for n in gm.graph.nodes]
    before = cast_cost(problem, naive_labels(problem, order, st.inputs, st.promote))
    labels = solve_min_cut(problem)
    _share_tensor_dtypes(st, labels)
    after = cast_cost(problem, labels)
    _label_nodes(st, labels)
    casts = _casts(st, labels)
    _warn_unclassified(st.unclassified)
    return CastPlan(low, st.nodes, st.reqs, casts, st.unclassified, before, after, st.weight)


def _plan_node(st: _Planning, node: fx.Node) -> None:
    """Record one node: its float value's size, and its label or op class by what kind of node it is."""
    info = node.meta.get(K.INFO)
    if _is_float(info):
        st.weight[node.name] = info.numel
    elif _is_multi_float(info):
        st.multi.add(node.name)
    is_value = node.name in st.weight or node.name in st.multi
    if node.op == "placeholder":
        _plan_input(st, node, info, is_value)
    elif node.op == "get_attr":
        if is_value:
            _plan_attr(st, node)
    elif node.op == "output":
        if st.keep_io_types:
            for a in _float_inputs(node):
                st.req(a, Req(node.name, "fixed", st.io_label))
    elif not is_value and not node.users and not isinstance(node.target, torch._ops.HigherOrderOperator):
        # runs for its effect only (guards, asserts): nothing to decide; a region's body (no_grad) still takes
        # its inputs in the dtypes it was captured with
        st.nodes[node.name] = NodePlan(None, None, "no tensor result")
    else:
        _plan_call(st, node, info, is_value)


def _plan_input(st: _Planning, node: fx.Node, info: Any, is_value: bool) -> None:
    """A placeholder: fixed to the dtype it comes in, or chosen by the plan when it is one of ``free_inputs``.
    The first float input's label is the one the outputs keep with ``keep_io_types``."""
    if is_value and node.name in st.free_inputs and _is_float(info):
        st.free.append(node.name)
        st.nodes[node.name] = NodePlan(None, None, f"input ({info.dtype} in the example): its dtype chosen "
                                                   "by the plan, the model around the block delivers it so")
        lab = LOW if info.dtype == st.low else FP32
    elif is_value:
        dtype = info.dtype if _is_float(info) else next(i.dtype for i in info if _is_float(i))  # a list's first
        lab = LOW if dtype == st.low else FP32
        st.fixed[node.name] = lab
        st.nodes[node.name] = NodePlan(None, lab, f"input ({dtype})")
    else:
        return
    if not st.seen_float_input:
        st.io_label, st.seen_float_input = lab, True


def _plan_attr(st: _Planning, node: fx.Node) -> None:
    """A float get_attr (parameter, buffer, constant) stays float32; the graph casts it where a low op reads it."""
    p = st.params.get(str(node.target))
    st.fixed[node.name] = FP32
    what = "parameter" if p is not None else "buffer or constant"
    st.nodes[node.name] = NodePlan(None, FP32, f"{what}, kept float32")


def _plan_call(st: _Planning, node: fx.Node, info: Any, is_value: bool) -> None:
    """A call: a converted block, a source of floats (no float inputs), or an op classified by the rules below."""
    fins = _float_inputs(node)
    st.inputs[node.name] = [a.name for a in fins]
    module = st.gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    if module is not None and is_converted(module):  # a converted block: its inputs in the dtypes it was made for
        lab = _unit_output_label(node, info, st.low)
        st.fixed[node.name] = lab
        for a, d in _unit_inputs(node, module):
            st.req(a, Req(node.name, "fixed", LOW if d == st.low else FP32))
        st.nodes[node.name] = NodePlan(None, lab, "converted block (a module of its own, planned apart): takes "
                                                  "its inputs in the dtypes its plan chose")
        return
    cls, reason = st.policy.classify(node, module, module_path(node))
    if node.meta.get(K.UPCAST) and not st.policy.by_name(node, module_path(node)):
        cls, reason = OpClass.FP32, "the model's own cast to float32: what follows runs in float32, as it asks"
    if not fins:
        if is_value:  # a source: creation op, or computed from integers only
            lab = LOW if (isinstance(info, TensorInfo) and info.dtype == st.low) else FP32
            st.fixed[node.name] = lab
            st.nodes[node.name] = NodePlan(cls, lab, "no float inputs: keeps its own dtype")
        else:
            st.nodes[node.name] = NodePlan(cls, None, reason or "no float inputs")
        return
    # the policy's class, then the plan's own accuracy rules, then what the kernels can run: each may overrule
    cls, reason = _policy_class(st, node, module, fins, cls, reason)
    cls, reason = _numeric_class(st, node, fins, cls, reason)
    cls, reason = _kernel_class(node, module, fins, st.low, cls, reason)
    if st.keep_io_types and _builds_structure(node) and _builds_output(node):  # the outputs, packed: as outputs
        st.fixed[node.name] = st.io_label
        for a in fins:
            st.req(a, Req(node.name, "fixed", st.io_label))
        st.nodes[node.name] = NodePlan(cls, st.io_label, reason + "; the model's output: in the inputs' dtype "
                                                                  "(keep_io_types)")
        return
    _require_inputs(st, node, fins, cls)
    st.nodes[node.name] = NodePlan(cls, None, reason)


def _policy_class(st: _Planning, node: fx.Node, module: nn.Module | None, fins: list[fx.Node],
                  cls: OpClass | None, reason: str) -> tuple[OpClass, str]:
    """The policy's class, completed: a structure built follows; an op on no list (remembered for the warning),
    a router and a comparison of two float tensors are float32."""
    if cls is None and _builds_structure(node):
        cls, reason = OpClass.FOLLOW, f"builds the output structure ({_target_name(node)}): not an op"
    if cls is None:
        st.unclassified.append(f"{node.name} ({op_name(node) if module is None else type(module).__name__})")
        cls, reason = OpClass.FP32, "unclassified op: float32 (add it to the policy)"
    if node.name in st.routers and cls in (OpClass.LOW, OpClass.FOLLOW, OpClass.PROMOTE):
        cls, reason = OpClass.FP32, st.routers[node.name]
    if cls is OpClass.LOW and _sums_over_nothing(node) and not st.policy.by_name(node, module_path(node)):
        cls, reason = OpClass.PROMOTE, ("a product that sums over no index (an outer product, such as positions "
                                        "times frequencies): no matrix product to speed up, so a multiply in its "
                                        "inputs' dtype")
    if op_name(node) in _COMPARISONS and len(fins) >= 2 and cls in (OpClass.FOLLOW, OpClass.PROMOTE):
        cls, reason = OpClass.FP32, ("compares two float tensors: in float32 (autocast's widest type), where "
                                     "widening a low operand is exact and rounding a float32 one would change "
                                     "the answer")
    return cls, reason


def _sums_over_nothing(node: fx.Node) -> bool:
    """An einsum whose every input index is in its output, or a matrix product over an inner size of 1."""
    name = op_name(node)
    if name == "einsum":
        eq = node.args[0] if node.args and isinstance(node.args[0], str) else node.kwargs.get("equation")
        if not isinstance(eq, str) or "->" not in eq or "." in eq:
            return False
        ins, out = eq.replace(" ", "").split("->")
        return set(ins.replace(",", "")) <= set(out)
    if name in ("matmul", "mm", "bmm") and node.args and isinstance(node.args[0], fx.Node):
        info = node.args[0].meta.get(K.INFO)
        return isinstance(info, TensorInfo) and len(info.shape) >= 2 and info.shape[-1] == 1
    return False


def _numeric_class(st: _Planning, node: fx.Node, fins: list[fx.Node], cls: OpClass,
                   reason: str) -> tuple[OpClass, str]:
    """Float32 for an op whose constants the low dtype cannot hold (an epsilon it rounds to zero, a mask fill
    beyond its range) and for the ops that read a value such an epsilon guards; records the guarded values."""
    low = st.low
    eps = _vanishing_constant(node, low)
    if eps is not None:
        st.guarded.add(node.name)
    elif _SHAPE_ONLY.get(op_name(node)) and fins and fins[0].name in st.guarded:
        st.guarded.add(node.name)  # the guarded value, broadcast or viewed
    elif any(a.name in st.guarded for a in fins) and cls in (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.LOW):
        cls, reason = OpClass.FP32, ("reads a value an epsilon keeps from zero (a normalisation's "
                                     f"clamp_min), which {low} would round to zero: float32")
    if eps is not None and cls in (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.LOW):
        cls, reason = OpClass.FP32, (f"takes the constant {eps!r}, which {low} rounds to zero (an epsilon "
                                     "written for float32): float32")
    big = _out_of_range_constant(node, low)
    if big is not None and cls in (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.LOW):
        cls, reason = OpClass.FP32, (f"takes the constant {big!r}, which {low} cannot hold (a mask fill "
                                     "written for float32): float32")
    return cls, reason


def _kernel_class(node: fx.Node, module: nn.Module | None, fins: list[fx.Node], low: torch.dtype,
                  cls: OpClass, reason: str) -> tuple[OpClass, str]:
    """The class as the kernels can run it: global average pooling as mean(dtype=float32), an FP32_OUT op without
    dtype= as a cast, float32 where the CPU has no low kernel, a norm in its mixed or float32 form, and float32 for
    a low leaf module whose kernel would not mix its float32 parameters with a low input."""
    if cls is OpClass.FP32 and global_pool_dims(node, module) is not None:
        cls, reason = OpClass.FP32_OUT, reason + ": global average pooling, as mean(dtype=float32)"
    if cls is OpClass.FP32_OUT and not _accepts_dtype_kwarg(node) and global_pool_dims(node, module) is None:
        cls, reason = OpClass.FP32, reason + " (no dtype= argument: cast instead)"
    if cls in (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.NORM, OpClass.LOW) and _on_cpu(fins):
        gap = _kernels.cpu_gap(op_name(node) if module is None else None, module, low)
        if gap is not None:
            cls, reason = OpClass.FP32, (f"{reason}; float32 on the CPU, which has no {low} kernel for "
                                         f"{gap.op} (kernels.CPU_GAPS)")
    if cls is OpClass.NORM:
        mixed_ok, why = _kernels.norm_form(op_name(node) if module is None else None, module)
        reason = f"{reason}; {why}"
        if not mixed_ok:
            cls = OpClass.FP32
    elif cls is OpClass.LOW and module is not None and not _kernels.norm_form(None, module)[0]:
        # a leaf module's parameters are not graph values the plan can cast: low input, float32 weight
        cls, reason = OpClass.FP32, (f"{reason}: asked for low, but its float32 parameters live inside the "
                                     f"module and {_kernels.rule_for(None, module).op} on CUDA rejects the mix; "
                                     "float32 form")
    return cls, reason


def _require_inputs(st: _Planning, node: fx.Node, fins: list[fx.Node], cls: OpClass) -> None:
    """The op's label (fixed, or free for the min-cut) and what it needs of each float input, by its class."""
    if cls is OpClass.LOW:
        st.fixed[node.name] = LOW
        for a in fins:
            st.req(a, Req(node.name, "fixed", LOW))
    elif cls is OpClass.FP32:
        st.fixed[node.name] = FP32
        for a in fins:
            st.req(a, Req(node.name, "fixed", FP32))
    elif cls is OpClass.FP32_OUT:  # float32 out of any input dtype (dtype=float32, or a cast of its input)
        st.fixed[node.name] = FP32
        for a in fins:
            st.req(a, Req(node.name, "any"))
    elif cls is OpClass.NORM:  # the activation in the norm's own label, the affine parameters in float32
        st.free.append(node.name)
        act = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else fins[0]
        for a in fins:
            st.req(a, Req(node.name, "same") if a is act else Req(node.name, "fixed", FP32))
        if st.policy.widest:
            st.widen.append((act.name, node.name))
    else:  # FOLLOW and PROMOTE: every float input in the op's own label
        st.free.append(node.name)
        if cls is OpClass.PROMOTE:
            st.promote.add(node.name)
        for a in fins:
            st.req(a, Req(node.name, "same"))
            if st.policy.widest:  # a float32 input is never rounded here: the op runs in float32 (autocast's rule)
                st.widen.append((a.name, node.name))


def _share_tensor_dtypes(st: _Planning, labels: dict[str, bool]) -> None:
    """A view of a value some op changes in place, and that op, in the value's own label: a cast between them
    would be a copy, and the change would be lost to the value's other readers."""
    for node, root in alias_groups(st.gm).items():
        if node is root or node.name not in labels or root.name not in labels:
            continue
        if labels[node.name] != labels[root.name]:
            labels[node.name] = labels[root.name]
            for rs in st.reqs.values():  # its other inputs in that dtype too (x.addmm_(a, b) on a float32 x)
                rs[:] = [Req(r.consumer, r.kind, labels[root.name]) if r.consumer == node.name and r.kind == "fixed"
                         else r for r in rs]
            if node.name in st.nodes:
                st.nodes[node.name].reason += f"; shares {root.name}'s memory, which is changed in place: its dtype"


def _label_nodes(st: _Planning, labels: dict[str, bool]) -> None:
    """The min-cut's labels onto the node plans (an FP32_OUT op on a low input takes dtype=float32)."""
    for name, np_ in st.nodes.items():
        if name in labels:
            np_.label = labels[name]
        if np_.op_class is OpClass.FP32_OUT:
            np_.fp32_out = any(labels.get(i) == LOW for i in st.inputs.get(name, []))


def _casts(st: _Planning, labels: dict[str, bool]) -> list[tuple[str, bool]]:
    """(value, to_low) for each dtype some consumer needs a castable value in that the value is not in."""
    casts: list[tuple[str, bool]] = []
    for u, rs in st.reqs.items():
        if u in st.multi or u not in st.weight:
            continue
        need = {labels[r.consumer] if r.kind == "same" else r.label for r in rs if r.kind != "any"}
        for d in sorted(need):
            if d != labels[u]:
                casts.append((u, d))
    return casts


def _warn_unclassified(unclassified: list[str]) -> None:
    """One warning naming the ops on no policy list (counted per op), which the plan ran in float32."""
    if not unclassified:
        return
    per_op: dict[str, int] = {}
    for u in unclassified:
        op = u[u.rindex("(") + 1:-1]
        per_op[op] = per_op.get(op, 0) + 1
    names = [f"{op} ({n} nodes)" if n > 1 else op for op, n in per_op.items()]
    warn_user("autocastfx: ops on no policy list run in float32: " + ", ".join(names[:20])
              + (" ..." if len(names) > 20 else "")
              + ". Classify them with Policy.default().override(ops={name: 'follow'|'low'|...}).")
