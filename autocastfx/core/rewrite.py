"""Rewrite: carry out a CastPlan on the graph. Casts are real nodes, named for what they do."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..base.meta import TensorInfo
from .aliases import alias_groups, changes
from .plan import LOW, CastPlan, NodePlan, global_pool_dims
from .policy import CAST_OPS, OpClass, op_name
from ..base import keys as K
from ..base.quiet import deepcopy_quietly

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``node.meta["autocastfx"]`` holds for every node of a converted graph."""
    kind: str                       # "op" | "cast" | "input" | "param" | "output" | "other"
    op_class: str | None            # low / fp32 / promote / follow / norm / fp32_out, or None
    dtype: torch.dtype | None       # the dtype the node computes in (None: not a float value)
    reason: str
    casts_in: tuple[str, ...] = ()  # names of cast nodes feeding this node
    numel: int = 0                  # elements, for cast nodes: what they move
    added_dtype_kwarg: bool = False # the pass set dtype=torch.float32 on this op


def undo(gm: fx.GraphModule) -> None:
    """Take out what a previous conversion put in (its cast nodes and dtype= arguments), in place."""
    from ..base.runtime import rebuild_output
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is rebuild_output:  # made again after the passes
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        d = node.meta.pop("autocastfx", None)
        if d is None:
            continue
        if d.kind == "cast":
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif d.added_dtype_kwarg:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    gm.graph = deepcopy_quietly(gm.graph)  # a fresh namespace: the casts' names are free again
    gm.graph.lint()
    gm.recompile()


def absorb_casts(gm: fx.GraphModule) -> list[str]:
    """Remove the model's own float-to-float casts (``.half()``, ``.to(dtype)``, ``type_as``), as the plan decides
    those dtypes; returns their names. A cast that also changes the memory format becomes
    ``x.contiguous(memory_format=...)``. A cast to a literal float32 (``.float()``, ``.to(torch.float32)``) stays,
    marked: what follows it runs in float32, as the model asks (and as torch.autocast does)."""
    _dtype_reads_fixed(gm)
    changed = alias_groups(gm)  # values changed in place: a cast kept on them would copy where the model aliases
    removed = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_method", "call_function") or op_name(node) not in CAST_OPS:
            continue
        if not node.args or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0].meta.get(K.INFO)
        out = node.meta.get(K.INFO)
        if not (isinstance(src, TensorInfo) and isinstance(out, TensorInfo)):
            continue
        if src.dtype not in _CASTABLE or out.dtype not in _CASTABLE or src.shape != out.shape:
            continue
        if not _only_changes_dtype(node, src.device):
            continue
        if out.dtype == torch.float32 and _literal_float32(node) and node not in changed \
                and node.args[0] not in changed:  # the model asks for float32 from here on
            node.meta[K.UPCAST] = True
            continue
        replacement = node.args[0]
        if _changes_layout(node):
            with gm.graph.inserting_before(node):
                replacement = gm.graph.call_method("contiguous", (node.args[0],),
                                                   {"memory_format": node.kwargs["memory_format"]})
            replacement.meta = {**node.meta, K.INFO: dataclasses.replace(out, dtype=src.dtype)}
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        removed.append(node.name)
    return removed


def _dtype_reads_fixed(gm: fx.GraphModule) -> None:
    """Each ``x.dtype`` the graph reads as it runs (symbolic tracing keeps the read) made the dtype the model had
    there: the plan decides dtypes, and a read would see the low one it chose (``torch.zeros(n, dtype=h.dtype)``
    made low beside a float32 the plan kept)."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is getattr and len(node.args) == 2
                and node.args[1] == "dtype" and isinstance(node.args[0], fx.Node)):
            continue
        info = node.args[0].meta.get(K.INFO)
        if not isinstance(info, TensorInfo) or node.args[0].op == "placeholder":  # an input's: the caller's to pick
            continue
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a: info.dtype if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: info.dtype if a is node else a)
            user.meta[_READ_DTYPE] = True  # a cast to it is to another tensor's dtype, not the model's float32
        if not node.users:
            gm.graph.erase_node(node)


_READ_DTYPE = "autocastfx_read_dtype"  # a node given the dtype another value had at capture (_dtype_reads_fixed)


def _literal_float32(node: fx.Node) -> bool:
    """Whether the cast names float32 itself (not another tensor's dtype, which the plan may make low)."""
    name = op_name(node)
    if node.meta.get(_READ_DTYPE):
        return False
    if name == "float":
        return True
    if name == "type_as":
        return False
    return any(a is torch.float32 for a in (*node.args[1:], *node.kwargs.values()))


def _changes_layout(node: fx.Node) -> bool:
    fmt = node.kwargs.get("memory_format")
    return fmt is not None and fmt != torch.preserve_format


def _same_device(a: object, device: str) -> bool:
    """Whether ``a`` (a device, its name, or a traced ``t.device``) is of the type ``device`` the tensor is on."""
    if isinstance(a, fx.Node):  # ``x.to(device=y.device)`` as symbolic_trace records it
        if a.op == "call_function" and a.target is getattr and len(a.args) == 2 and a.args[1] == "device" \
                and isinstance(a.args[0], fx.Node):
            info = a.args[0].meta.get(K.INFO)
            return isinstance(info, TensorInfo) and torch.device(info.device).type == device
        return False
    if not isinstance(a, (torch.device, str)):
        return False
    try:
        return torch.device(a).type == device
    except (RuntimeError, ValueError):
        return False


def _only_changes_dtype(node: fx.Node, device: str) -> bool:
    """Whether the call converts dtype and nothing else the plan cannot redo (a memory format is kept apart)."""
    extra_args = node.args[1:]
    name = op_name(node)
    if name == "type_as":
        return len(extra_args) == 1 and not node.kwargs
    if name in ("float", "half", "bfloat16"):
        return not extra_args and set(node.kwargs) <= {"memory_format"}
    if name == "type":
        return len(extra_args) == 1 and isinstance(extra_args[0], torch.dtype)
    if any(not (isinstance(a, (torch.dtype, bool)) or _same_device(a, device)) for a in extra_args):
        return False  # ``x.to(x.device, torch.float32)`` (aten's to.device) only changes the dtype too
    allowed = {"dtype", "copy", "non_blocking", "memory_format"}
    for k, v in node.kwargs.items():
        if k == "device":
            if v is not None and not _same_device(v, device):
                return False
        elif k in ("layout", "pin_memory"):
            if v is not None and not (k == "layout" and v == torch.strided) and v is not False:
                return False
        elif k not in allowed:
            return False
    return True


def apply_plan(gm: fx.GraphModule, plan: CastPlan) -> None:
    """Insert the planned casts, switch the fp32_out ops to ``dtype=torch.float32`` and record every node's
    Decision; a float32-compute plan gets no cast or dtype= for values already float32."""
    graph = gm.graph
    low = plan.dtype
    by_name = {n.name: n for n in graph.nodes}
    last_placeholder = None
    for n in graph.nodes:
        if n.op == "placeholder":
            last_placeholder = n
    casts_in: dict[str, list[str]] = {}
    label = {k: v.label for k, v in plan.nodes.items()}
    shared = alias_groups(gm)  # values an op changes in place, and their views

    for value_name, to_low in plan.casts:
        value = by_name[value_name]
        target = low if to_low else torch.float32
        if low == torch.float32 and value.meta[K.INFO].dtype == torch.float32:
            continue  # float32 compute: both labels are float32, and so is this value already
        readers = {r.consumer for r in plan.reqs[value_name]
                   if ((r.kind == "same" and label.get(r.consumer) == to_low)
                       or (r.kind == "fixed" and r.label == to_low))
                   and not changes(by_name[r.consumer], value, gm)}  # a change made on a copy would be lost
        if not readers:
            continue
        # a value changed in place: a cast for each reader, where it reads, which sees the changes made before it
        groups = [sorted(readers)] if value not in shared else [[r] for r in readers]
        for group in groups:
            where = graph.inserting_before(by_name[group[0]]) if value in shared else \
                graph.inserting_after(last_placeholder if value.op == "placeholder" else value)
            with where:
                cast = graph.call_method("to", (value, target))
            cast._rename(f"to_{_SHORT[target]}_{value_name}")
            src_info = value.meta[K.INFO]
            cast.meta[K.INFO] = TensorInfo(target, src_info.shape, src_info.device)
            cast.meta["autocastfx"] = Decision("cast", None, target, f"cast {value_name} for {', '.join(sorted(group))}",
                                               numel=plan.weight[value_name])
            for r in group:
                by_name[r].replace_input_with(value, cast)
                casts_in.setdefault(r, []).append(cast.name)

    for node in graph.nodes:
        if "autocastfx" in node.meta and node.meta["autocastfx"].kind == "cast":
            continue
        np_: NodePlan | None = plan.nodes.get(node.name)
        dtype = None if np_ is None or np_.label is None else (low if np_.label == LOW else torch.float32)
        fp32_out = np_ is not None and np_.fp32_out and low != torch.float32  # float32 inputs need no dtype=
        if fp32_out:
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            dims = global_pool_dims(node, module)
            if dims is not None:  # adaptive average pooling to 1x1 is a mean, which takes dtype=
                node.op, node.target = "call_function", torch.mean
                node.args, node.kwargs = (node.args[0], dims), {"keepdim": True}
            node.kwargs = {**node.kwargs, "dtype": torch.float32}
        kind = {"placeholder": "input", "get_attr": "param", "output": "output"}.get(node.op, "op")
        if np_ is None:
            reason = "output" if node.op == "output" else "not a float tensor"
            node.meta["autocastfx"] = Decision(kind if node.op == "output" else "other", None, None, reason,
                                               tuple(casts_in.get(node.name, ())))
            continue
        reason = np_.reason
        if np_.op_class in (OpClass.FOLLOW, OpClass.PROMOTE, OpClass.NORM) and np_.label is not None:
            reason += f" -> {_SHORT[dtype]} (min-cut)"
        if fp32_out:
            reason += " -> dtype=torch.float32 on a low input"
        node.meta["autocastfx"] = Decision(kind, None if np_.op_class is None else np_.op_class.value, dtype,
                                           reason, tuple(casts_in.get(node.name, ())),
                                           added_dtype_kwarg=fp32_out)
    graph.lint()
    gm.recompile()


def entry_casts(gm: fx.GraphModule) -> list[str]:
    """Cast each float input on entry to the dtype the graph was converted for, so a block converted for float16
    also takes float32; on the dtype it was made for, ``Tensor.to`` returns the tensor itself."""
    graph = gm.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    made = []
    for p in places:
        info = p.meta.get(K.INFO)
        if not (isinstance(info, TensorInfo) and info.dtype in _CASTABLE) or not p.users:
            continue
        with graph.inserting_after(places[-1]):
            c = graph.call_method("to", (p, info.dtype))
        c._rename(f"{p.name}_as_{_SHORT[info.dtype]}")
        p.replace_all_uses_with(c, delete_user_cb=lambda u: u is not c)
        c.meta[K.INFO] = info
        c.meta["autocastfx"] = Decision("other", None, info.dtype, "the input in the dtype this block was converted "
                                        "for (no copy when it already is)")
        made.append(c.name)
    graph.lint()
    gm.recompile()
    return made


def rebuild_output_type(gm: fx.GraphModule) -> bool:
    """Add a ``rebuild_output`` call before the output where tracing wrote the model's result type (a ModelOutput)
    as a plain dict; True if one was added."""
    from ..base.runtime import rebuild_output
    from ..base.runtime import type_name
    cls = gm.meta.get(K.OUTPUT_TYPE)
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if cls is None or out is None or not isinstance(out.args[0], dict):
        return False
    if any(n.op == "call_function" and n.target is rebuild_output for n in gm.graph.nodes):
        return False
    with gm.graph.inserting_before(out):
        node = gm.graph.call_function(rebuild_output, (out.args[0], type_name(cls)))
    node.meta["autocastfx"] = Decision("other", None, None, f"the model's result type, {cls.__name__}")
    out.args = (node,)
    gm.graph.lint()
    gm.recompile()
    return True
