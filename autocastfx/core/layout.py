"""Memory layout: a model with 2-D convolutions runs channels_last (NHWC) end to end, which cuDNN's tensor-core
convolutions need (``memory_format="auto"``: only on CUDA). Inputs that feed convolutions are converted once at the
start, and runs on the example inputs find where NCHW is still needed; inserted nodes are tagged in
``node.meta[K.LAYOUT]`` with their reason.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from . import cost
from ..base.meta import TensorInfo
from .propagate import flatten_inputs
from .policy import op_name
from ..base import keys as K
from ..base.quiet import deepcopy_quietly

MEMORY_FORMATS = ("auto", "channels_last", "preserve")
_CONV2D = frozenset({"conv2d", "conv_transpose2d", "convolution", "_convolution"})
_STRIDED = frozenset({"as_strided", "stride", "data_ptr", "storage_offset", "is_contiguous"})  # read strides
_RESHAPES = frozenset({"view", "view_as", "_unsafe_view", "reshape", "reshape_as", "flatten", "unflatten"})
_TAG = K.LAYOUT
_ROUNDS = 4  # each round can only add conversions


def check_memory_format(value: Any) -> str:
    """The memory_format option's name; ValueError or TypeError for anything else."""
    by_object = {torch.channels_last: "channels_last", torch.preserve_format: "preserve"}
    if isinstance(value, torch.memory_format):
        if value not in by_object:
            raise ValueError(f"memory_format={value} is not an option: use 'channels_last', 'auto' or 'preserve' "
                             "('preserve' leaves NCHW tensors NCHW)")
        return by_object[value]
    if not isinstance(value, str):
        raise TypeError(f"memory_format must be a string, one of {MEMORY_FORMATS}, got {type(value).__name__}")
    if value not in MEMORY_FORMATS:
        hint = (" ('preserve' leaves NCHW tensors NCHW)" if value in ("contiguous", "contiguous_format", "nchw")
                else " (channels_last: NHWC)" if value.lower() in ("nhwc", "channels-last", "channelslast") else "")
        raise ValueError(f"memory_format must be 'auto' (channels_last for 2-D convolutions on CUDA, the default), "
                         f"'channels_last' or 'preserve' (leave layouts as they are), got {value!r}{hint}")
    return value


@dataclasses.dataclass
class LayoutPlan:
    """What the layout pass chose and did, for the report."""
    requested: str
    memory_format: str                   # "channels_last" | "preserve"
    reason: str
    params: list[str] = dataclasses.field(default_factory=list)       # weights read channels_last
    inputs: list[str] = dataclasses.field(default_factory=list)       # graph inputs converted at the start
    to_channels_last: list[str] = dataclasses.field(default_factory=list)  # "value: why", mid-graph
    to_contiguous: list[str] = dataclasses.field(default_factory=list)     # "value: why"
    reshape_copies: list[str] = dataclasses.field(default_factory=list)    # reshapes that copy to NCHW order

    def totals(self) -> dict:
        return {"memory_format": self.memory_format, "requested": self.requested, "reason": self.reason,
                "params_channels_last": len(self.params), "inputs": list(self.inputs),
                "to_channels_last": list(self.to_channels_last), "to_contiguous": list(self.to_contiguous),
                "reshape_copies": list(self.reshape_copies)}

    def __str__(self) -> str:
        lines = [f"LayoutPlan({self.memory_format}: {self.reason})"]
        if self.memory_format == "channels_last":
            lines.append(f"  weights read channels_last: {len(self.params)}; inputs converted once: "
                         f"{', '.join(self.inputs) or 'none'}")
            lines += [f"  to channels_last {v}" for v in self.to_channels_last]
            lines += [f"  to contiguous {v}" for v in self.to_contiguous]
            lines += [f"  reshape copies {v}" for v in self.reshape_copies]
        return "\n".join(lines)


def is_conv2d(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or op_name(node) not in _CONV2D or not node.args:
        return False
    x = node.args[0]
    info = x.meta.get(K.INFO) if isinstance(x, fx.Node) else None
    return isinstance(info, TensorInfo) and len(info.shape) == 4


def plan_layout(gm: fx.GraphModule, memory_format: str) -> LayoutPlan:
    """Choose the layout, after taking out an earlier conversion's layout nodes (convert is re-entrant)."""
    requested = check_memory_format(memory_format)
    undo(gm)
    n = sum(1 for node in gm.graph.nodes if is_conv2d(node))
    device = cost.model_device(gm)
    if requested == "preserve":
        return LayoutPlan(requested, "preserve", "memory_format='preserve': layouts left as they are")
    if not n:
        return LayoutPlan(requested, "preserve", "no 2-D convolution: layouts left as they are")
    if requested == "channels_last":
        return LayoutPlan(requested, "channels_last", f"memory_format='channels_last': {n} 2-D convolutions run NHWC")
    if device is not None and device.type == "cuda":
        return LayoutPlan(requested, "channels_last",
                          f"auto: {n} 2-D convolutions on {device}: cuDNN's tensor-core convolutions are NHWC "
                          "(NCHW costs ~4.5 ms of transposes per ResNet-50 b128 step on an H100)")
    return LayoutPlan(requested, "preserve",
                      f"auto: {n} 2-D convolutions, but the model is on the {device.type if device else 'CPU'}: "
                      "layouts left as they are (memory_format='channels_last' forces NHWC)")


def apply_layout(gm: fx.GraphModule, plan: LayoutPlan, args: tuple, kwargs: dict) -> None:
    """Carry out a channels_last plan; a "preserve" plan changes nothing."""
    if plan.memory_format != "channels_last":
        return
    plan.params = _conv_weights(gm)
    plan.inputs = _convert_inputs(gm)
    for _ in range(_ROUNDS):
        run = _LayoutRun(gm)
        _run_quietly(gm, run, args, kwargs)
        plan.reshape_copies = sorted(run.copies)
        if not run.to_cl and not run.to_contig:
            break
        for value, why in run.to_cl.items():
            plan.to_channels_last.append(f"{value.name}: {why}")
            _to_channels_last(gm, value, f"{value.name}: {why}")
        for value, readers in run.to_contig.items():
            plan.to_contiguous.append(f"{value.name}: {'; '.join(sorted(set(readers.values())))}")
            _to_contiguous(gm, value, readers)
    gm.graph.lint()
    gm.recompile()


def undo(gm: fx.GraphModule) -> None:
    """Take out the layout nodes of an earlier conversion (its weight casts go with the cast plan's undo)."""
    gm.meta.pop(_TAG, None)
    changed = False
    for node in list(gm.graph.nodes):
        if _TAG in node.meta:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph = deepcopy_quietly(gm.graph)  # a fresh namespace: the removed nodes' names are free again
        gm.graph.lint()
        gm.recompile()


def _order(t: torch.Tensor) -> str:
    """"nhwc" when channels are innermost (dense or not: a narrowed channels_last tensor counts), "nchw" when
    laid out as NCHW, "any" when both read the same (1x1 spatial, one channel)."""
    if t.dim() != 4:
        return "any"
    c_last = t.is_contiguous(memory_format=torch.channels_last)
    c_first = t.is_contiguous()
    if c_last and c_first:
        return "any"
    if c_last:
        return "nhwc"
    if c_first:
        return "nchw"
    dims = [d for d in range(4) if t.shape[d] > 1]
    order = sorted(dims, key=lambda d: -t.stride(d))
    return "nhwc" if order and order[-1] == 1 else "nchw"


def _is_nhwc(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point() and _order(v) == "nhwc"


def weights_channels_last(gm: fx.GraphModule, plan: LayoutPlan) -> None:
    """Every 2-D convolution reads its weight channels_last (its cast writes NHWC, else a ``contiguous`` node), so
    the float32 parameter and its gradient keep their layout. Runs after the casts are in the graph."""
    if plan.memory_format != "channels_last":
        return
    for node in list(gm.graph.nodes):
        if not is_conv2d(node) or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
            continue
        w = node.args[1]
        info = w.meta.get(K.INFO)
        if not isinstance(info, TensorInfo) or len(info.shape) != 4:
            continue
        if getattr(w.meta.get("autocastfx"), "kind", None) == "cast":
            w.kwargs = {**w.kwargs, "memory_format": torch.channels_last}
            continue
        with gm.graph.inserting_before(node):
            cl = gm.graph.call_method("contiguous", (w,), {"memory_format": torch.channels_last})
        cl.meta[K.INFO] = info
        cl.meta[_TAG] = "the convolution's weight, read channels_last"
        node.update_arg(1, cl)
    gm.graph.lint()
    gm.recompile()


def _conv_weights(gm: fx.GraphModule) -> list[str]:
    """The parameters that 2-D convolutions read as their weight (through the padding pass's ``F.pad``)."""
    names = []
    for node in gm.graph.nodes:
        if not is_conv2d(node):
            continue
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        while isinstance(w, fx.Node) and w.op == "call_function" and op_name(w) == "pad":  # padded in-graph
            w = w.args[0]
        if isinstance(w, fx.Node) and w.op == "get_attr" and w.target not in names:
            names.append(str(w.target))
    return names


def _convert_inputs(gm: fx.GraphModule) -> list[str]:
    """Convert, right after the inputs, every 4-D float input from which a convolution's input is computed."""
    feeds = set()
    stack = [n.args[0] for n in gm.graph.nodes if is_conv2d(n)]
    while stack:
        v = stack.pop()
        if isinstance(v, fx.Node) and v not in feeds:
            feeds.add(v)
            stack.extend(v.all_input_nodes)
    converted = []
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n in feeds]:
        info = node.meta.get(K.INFO)
        if isinstance(info, TensorInfo) and info.is_float and len(info.shape) == 4:
            _to_channels_last(gm, node, f"input {node.target}: read by convolutions")
            converted.append(str(node.target))
    return converted


def _insert_after(gm: fx.GraphModule, value: fx.Node, fmt: torch.memory_format, name: str, why: str) -> fx.Node:
    graph = gm.graph
    anchor = value
    if value.op == "placeholder":
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(anchor):
        kwargs = {"memory_format": fmt} if fmt != torch.contiguous_format else {}
        node = graph.call_method("contiguous", (value,), kwargs)
    node._rename(name)
    node.meta[_TAG] = why
    if K.INFO in value.meta:
        node.meta[K.INFO] = value.meta[K.INFO]
    return node


def _twin(value: fx.Node) -> fx.Node | None:
    """The other-layout original of a layout node this pass inserted, if ``value`` is one."""
    return value.args[0] if _TAG in value.meta else None


def _to_channels_last(gm: fx.GraphModule, value: fx.Node, why: str) -> None:
    """Readers of ``value`` read it channels_last from now on, except those that want NCHW (reshapes, stride
    readers, the graph output): they keep the original."""
    twin = _twin(value)
    readers = [u for u in value.users if u.op != "output" and op_name(u) not in _RESHAPES | _STRIDED]
    if twin is not None:  # value = twin.contiguous(): read twin, channels_last already
        for u in readers:
            u.replace_input_with(value, twin)
        return
    cl = _insert_after(gm, value, torch.channels_last, f"channels_last_{value.name}", why)
    for u in readers:
        if u is not cl:
            u.replace_input_with(value, cl)


def _to_contiguous(gm: fx.GraphModule, value: fx.Node, readers: dict[fx.Node, str]) -> None:
    twin = _twin(value)
    if twin is not None:  # value = twin.contiguous(memory_format=channels_last): twin is the NCHW original
        for u in readers:
            u.replace_input_with(value, twin)
        return
    why = f"{value.name}: {'; '.join(sorted(set(readers.values())))}"
    c = _insert_after(gm, value, torch.contiguous_format, f"contiguous_{value.name}", why)
    for u in readers:
        u.replace_input_with(value, c)


class _LayoutRun(fx.Interpreter):
    """Runs the graph, noting which values must change layout for which readers; each reader is fed what it would
    get after the fix, so one run sees the whole graph."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.to_cl: dict[fx.Node, str] = {}
        self.to_contig: dict[fx.Node, dict[fx.Node, str]] = {}
        self.copies: set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            for v in n.all_input_nodes:
                if _is_nhwc(self.env[v]):
                    self.to_contig.setdefault(v, {})[n] = "graph output"
            return super().run_node(n)
        if n.op in ("placeholder", "get_attr"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if is_conv2d(n):
            x = args[0]
            if isinstance(x, torch.Tensor) and _order(x) == "nchw":
                self.to_cl.setdefault(n.args[0], f"{n.name} reads it")
                args = (x.contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
            return getattr(self, n.op)(n.target, args, kwargs)
        name = op_name(n)
        if name in _STRIDED:
            return self._contiguous_run(n, args, kwargs, f"{n.name} ({name}) reads strides")
        try:
            out = getattr(self, n.op)(n.target, args, kwargs)
        except RuntimeError as e:
            first = str(e).splitlines()[0][:80]
            return self._contiguous_run(n, args, kwargs, f"{n.name} ({name}) fails on channels_last: {first}",
                                        error=e)
        if name in _RESHAPES and args and _is_nhwc(args[0]) and isinstance(out, torch.Tensor) \
                and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
            self.copies.add(f"{n.name} ({name}) copies {n.args[0].name} to NCHW order")
        return out

    def _contiguous_run(self, n: fx.Node, args, kwargs, why: str, error: Exception | None = None) -> Any:
        """Run ``n`` on contiguous copies of its channels_last inputs and note the conversions it needs."""
        swapped = []

        def swap(v):
            if _is_nhwc(v):
                swapped.append(id(v))
                return v.contiguous()
            return v
        args2 = fx.node.map_aggregate(args, swap)
        kwargs2 = fx.node.map_aggregate(kwargs, swap)
        if not swapped:
            if error is not None:
                raise error
            return getattr(self, n.op)(n.target, args, kwargs)
        out = getattr(self, n.op)(n.target, args2, kwargs2)
        for v in n.all_input_nodes:
            if id(self.env[v]) in swapped:
                self.to_contig.setdefault(v, {})[n] = why
        return out


def _run_quietly(gm: fx.GraphModule, run: fx.Interpreter, args: tuple, kwargs: dict) -> None:
    """One run on the example inputs without gradients; buffers and the random state are restored after."""
    flat = flatten_inputs(gm, args, kwargs)
    saved = {k: v.detach().clone() for k, v in gm.state_dict(keep_vars=True).items()}
    devices = sorted({a.device.index or 0 for a in flat if isinstance(a, torch.Tensor) and a.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            run.run(*flat)
    finally:
        with torch.no_grad():
            for k, v in gm.state_dict(keep_vars=True).items():
                if k in saved and v.shape == saved[k].shape:
                    v.copy_(saved[k])
