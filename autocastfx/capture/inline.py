"""Open up the functions ``torch.fx.wrap`` hides from symbolic tracing (torchvision's ``shifted_window_attention``):
each call is traced by torch.export on its example arguments and its aten graph replaces the node, so the plan
reaches the matmuls inside. A call that cannot be opened runs whole, with the reason in the report.
"""
from __future__ import annotations

import builtins
import dataclasses
import inspect
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind

from ..base.meta import TensorInfo
from ..core.policy import LOW_OPS, op_name
from ..base import keys as K
from .torch_export import run_export


@dataclasses.dataclass(frozen=True)
class InlineDecision:
    node: str
    function: str
    inlined: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.function} ({self.node}): {'inlined' if self.inlined else 'kept whole'}, {self.reason}"


def is_opaque(node: fx.Node) -> bool:
    """A call of a plain Python function that is not part of torch: what ``torch.fx.wrap`` leaves behind."""
    if node.op != "call_function" or not inspect.isfunction(node.target):
        return False
    module = getattr(node.target, "__module__", "") or ""
    return not (module == "torch" or module.startswith("torch.") or node.target.__module__ in (
        operator.__name__, builtins.__name__, "_operator", "math"))


class _Call(nn.Module):
    """forward(*tensors) = fn(*args, **kwargs) with the tensors put back where the graph had nodes."""

    def __init__(self, fn, args, kwargs):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def forward(self, *tensors):
        it = iter(tensors)
        put = (lambda a: next(it) if isinstance(a, fx.Node) else a)
        args = fx.node.map_aggregate(self.args, put)
        kwargs = fx.node.map_aggregate(self.kwargs, put)
        return self.fn(*args, **kwargs)


def _example(info: TensorInfo) -> torch.Tensor:
    if info.is_float:
        return torch.randn(info.shape, dtype=info.dtype, device=info.device)
    return torch.zeros(info.shape, dtype=info.dtype, device=info.device)


def inline_opaque_calls(gm: fx.GraphModule, traces: dict | None = None) -> list[InlineDecision]:
    """Inline every opaque call that holds a tensor-core op; returns a decision for each opaque call.

    ``traces`` caches each trace by function, constant arguments and tensor dtypes and shapes; pass one dict to
    several calls to share it."""
    decisions = []
    traces = {} if traces is None else traces
    for node in list(gm.graph.nodes):
        if is_opaque(node):
            decisions.append(_inline_one(gm, node, traces))
    if any(d.inlined for d in decisions):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return decisions


def _trace_key(node: fx.Node, infos: list[TensorInfo]):
    it = iter(infos)
    shape = fx.node.map_aggregate((node.args, node.kwargs),
                                  lambda a: ("tensor", next(it)) if isinstance(a, fx.Node) else ("value", repr(a)))
    return node.target, repr(shape)


def _inline_one(gm: fx.GraphModule, node: fx.Node, traces: dict) -> InlineDecision:
    fn_name = getattr(node.target, "__qualname__", str(node.target))

    def keep(reason: str) -> InlineDecision:
        return InlineDecision(node.name, fn_name, False, reason)

    inputs: list[fx.Node] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: inputs.append(a) if isinstance(a, fx.Node) else a)
    infos = [a.meta.get(K.INFO) for a in inputs]
    if not all(isinstance(i, TensorInfo) for i in infos):
        bad = next(a.name for a, i in zip(inputs, infos) if not isinstance(i, TensorInfo))
        return keep(f"argument {bad} is computed by the graph but is not a tensor, so the call cannot be traced "
                    "on its own; it runs whole, in the dtype the plan gives it")
    key = _trace_key(node, infos)
    if key not in traces:
        examples = [_example(i) for i in infos]
        try:
            with torch.no_grad():
                traces[key] = run_export(_Call(node.target, node.args, node.kwargs), tuple(examples), strict=False)
        except Exception as e:  # noqa: BLE001 - any failure leaves the call whole, with the cause
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            traces[key] = f"torch.export could not trace it ({type(e).__name__}: {first}); it runs whole"
    ep = traces[key]
    if isinstance(ep, str):
        return keep(ep)
    sub = ep.graph_module
    low_ops = sorted({op_name(n) for n in sub.graph.nodes if n.op == "call_function" and op_name(n) in LOW_OPS})
    if not low_ops:
        return keep("no matmul or convolution inside: nothing to gain from opening it")
    users = list(node.users)
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    n_user_outputs = sum(1 for s in ep.graph_signature.output_specs if s.kind.name == "USER_OUTPUT")
    if n_user_outputs != len(outs):
        return keep("it writes to its inputs or buffers; it runs whole")
    single = isinstance(node.meta.get(K.INFO), TensorInfo)
    if not single and not all(u.op == "call_function" and u.target is operator.getitem
                              and isinstance(u.args[1], int) for u in users):
        return keep("its tuple result is used other than by indexing; it runs whole")

    # map the export's placeholders: user inputs to the call's arguments, lifted constants to new buffers
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    user_i = 0
    for ph, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            env[ph] = inputs[user_i]
            user_i += 1
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.BUFFER):
            value = ep.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR else ep.state_dict[spec.target]
            attr = f"_inlined_{node.name}_{len(env)}"
            gm.register_buffer(attr, value.detach().clone(), persistent=False)
            with gm.graph.inserting_before(node):
                env[ph] = gm.graph.get_attr(attr)
            env[ph].meta[K.INFO] = TensorInfo(value.dtype, tuple(value.shape), value.device.type)
        else:
            return keep(f"its trace has a {spec.kind.name.lower()} input; it runs whole")
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op in ("placeholder", "output"):
                continue
            new = gm.graph.node_copy(sn, lambda a: env[a])
            # the call's own module: module-name policies and train/eval follow the module that made the call
            new.meta = {k: v for k, v in node.meta.items() if k == "nn_module_stack"}
            new.meta[K.INLINED_FROM] = fn_name
            env[sn] = new
    results = [env[o] if isinstance(o, fx.Node) else o for o in outs]
    if single:
        node.replace_all_uses_with(results[0])
    else:
        for u in users:
            u.replace_all_uses_with(results[u.args[1]])
            gm.graph.erase_node(u)
    gm.graph.erase_node(node)
    n_ops = sum(1 for sn in sub.graph.nodes if sn.op == "call_function")
    return InlineDecision(node.name, fn_name, True, f"{n_ops} ops, {', '.join(low_ops)} in the low dtype")
