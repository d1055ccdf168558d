"""Tensor-core padding: the channel and feature dims of convolutions and linears grown to a multiple where a gate
(``core.cost``) says it pays. Weights are zero-padded inside the graph (``F.pad``) and outputs sliced back, so the
result is exact and parameters keep their true shapes; zero channels flow through zero-preserving ops to the next
padded layer without a slice.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import cost
from ..base.meta import TensorInfo
from .flops import node_flops
from .policy import PAD_GATES, op_name
from ..base import keys as K

_CONV = {"conv1d": 1, "conv2d": 2, "conv3d": 3}
_ZERO_PRESERVING = frozenset("""relu relu6 leaky_relu gelu silu hardswish mish tanh hardtanh elu selu celu
    dropout dropout1d dropout2d dropout3d feature_dropout alpha_dropout max_pool1d max_pool2d max_pool3d
    avg_pool1d avg_pool2d avg_pool3d identity contiguous clone softshrink hardshrink""".split())
DEFAULT_MAX_GROWTH = 4.0
DEFAULT_GATE = "model"


@dataclasses.dataclass
class PadDecision:
    node: str
    kind: str                  # "conv" | "linear"
    out: tuple[int, int]       # (true, padded) output channels/features
    inp: tuple[int, int]       # (true, padded) input channels/features
    action: str                # "pad" | "skip" | "aligned"
    reason: str
    flops: int = 0             # FLOPs of the op, unpadded
    extra_flops: int = 0
    extra_elements: int = 0    # more weight, input and output elements the padded op reads and writes
    rules: tuple[str, ...] = ()  # the gate's rules that decided (cost.RULES), or "trial"/"always"


@dataclasses.dataclass
class PadPlan:
    multiple: int
    decisions: list[PadDecision]
    persistent: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (producer, consumer) kept padded
    gate: str = "always"       # "model" | "trial" | "always": who decided
    target: str = ""           # the hardware the model or trial judged for, and why that one

    def totals(self) -> dict:
        gemm = [d for d in self.decisions]
        before = sum(1 for d in gemm if d.out[0] % self.multiple or d.inp[0] % self.multiple)
        after = sum(1 for d in gemm if (d.out[1] if d.action == "pad" else d.out[0]) % self.multiple
                    or (d.inp[1] if d.action == "pad" else d.inp[0]) % self.multiple)
        return {"multiple": self.multiple, "gate": self.gate, "target": self.target,
                "misaligned_before": before, "misaligned_after": after,
                "padded": [f"{d.node}: {d.reason}" for d in self.decisions if d.action == "pad"],
                "skipped": [f"{d.node}: {d.reason}" for d in self.decisions if d.action == "skip"],
                "extra_flops": sum(d.extra_flops for d in self.decisions if d.action == "pad"),
                "extra_bytes": 2 * sum(d.extra_elements for d in self.decisions if d.action == "pad"),
                "kept_padded": [f"{a} -> {b}" for a, b in self.persistent]}

    def __str__(self) -> str:
        t = self.totals()
        lines = [f"PadPlan(multiple={self.multiple}, gate={self.gate}: misaligned GEMM/conv ops "
                 f"{t['misaligned_before']} -> {t['misaligned_after']}, extra FLOPs {t['extra_flops']:,})"]
        lines += [f"  {d.node}: {d.reason}" for d in self.decisions if d.action != "aligned"]
        return "\n".join(lines)


def _up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _weight_param(gm: fx.GraphModule, node: fx.Node):
    w = _arg(node, 1, "weight")
    if isinstance(w, fx.Node) and w.op == "get_attr":
        info = w.meta.get(K.INFO)
        if isinstance(info, TensorInfo):
            return w, info
    return None, None


def plan_padding(gm: fx.GraphModule, multiple: int, max_growth: float = DEFAULT_MAX_GROWTH, *,
                 gate: str | None = None, layout: str = "contiguous", dtype: torch.dtype = torch.float16,
                 hardware: cost.Hardware | None = None,
                 timer: Callable[[cost.TrialCase], float] | None = None, cache: dict | None = None) -> PadPlan:
    """Decide, op by op, which dims pad.

    Args:
        gate: ``"model"`` (the cost model, default), ``"trial"`` (time the candidates on the model's CUDA device or
            with ``timer``; the cost model where there is neither) or ``"always"`` (within ``max_growth``).
        layout: the memory format the convolutions will run in.
        hardware: the target the cost model judges for (default: the model's CUDA device, else
            ``cost.DEFAULT_CAPABILITY``'s).
    """
    gate = DEFAULT_GATE if gate is None else gate
    if gate not in PAD_GATES:
        raise ValueError(f"pad_gate must be one of {', '.join(map(repr, PAD_GATES))}, got {gate!r}")
    device = cost.model_device(gm)
    hw, why = (hardware, "given") if hardware is not None else cost.target(device)
    if gate == "trial" and timer is None:
        if device is not None and device.type == "cuda":
            timer = cost.time_on_device
        else:
            gate, why = "model", why + "; a timed trial needs a CUDA device, so the cost model decided"
    plan = PadPlan(multiple, [], gate=gate, target="" if gate == "always" else f"{hw.name} ({why})")

    def decide(site: cost.Site, node: fx.Node, winfo: TensorInfo, x: TensorInfo | None) -> cost.Verdict:
        if gate == "always":
            return _growth_gate(site, multiple, max_growth)
        if gate == "trial":
            return cost.trial_gate(site, lambda o, i: _trial_case(node, winfo, x, o, i, site, dtype, device),
                                  multiple, max_growth, timer, cache)
        return cost.model_gate(site, multiple, max_growth, hw)

    for node in gm.graph.nodes:
        kind = "conv" if op_name(node) in _CONV else "linear" if op_name(node) == "linear" else None
        w, winfo = _weight_param(gm, node) if kind and node.op == "call_function" else (None, None)
        out_info = node.meta.get(K.INFO)
        if w is None or not isinstance(out_info, TensorInfo):
            continue
        c_out, c_in = winfo.shape[0], winfo.shape[1]
        flops = node_flops(gm, node)
        node.meta.pop(K.FLOPS, None)  # the padded op's FLOPs are counted again after padding
        p_out, p_in = _up(c_out, multiple), _up(c_in, multiple)
        d = PadDecision(node.name, kind, (c_out, p_out), (c_in, p_in), "aligned", "aligned", flops=flops)
        plan.decisions.append(d)
        if (p_out, p_in) == (c_out, c_in):
            continue
        x = node.args[0].meta.get(K.INFO) if isinstance(node.args[0], fx.Node) else None
        x = x if isinstance(x, TensorInfo) else None
        if kind == "conv" and (x is None or len(x.shape) != len(winfo.shape)):
            d.action, d.reason = "skip", "skip: an unbatched input, whose channels are not dim 1"
            continue
        site = cost.Site(kind, c_out, c_in, _arg(node, 6, "groups", 1) if kind == "conv" else 1,
                        layout if kind == "conv" else "contiguous", flops, (x.numel if x else 0) + out_info.numel)
        verdict = decide(site, node, winfo, x)
        d.rules, d.reason, d.action = verdict.rules, verdict.reason, "skip"
        o, i = verdict.out, verdict.inp
        if (o, i) != (c_out, c_in):
            growth = (o * i) / (c_out * c_in)
            d.out, d.inp, d.action = (c_out, o), (c_in, i), "pad"
            d.extra_flops = int(flops * (growth - 1)) if flops else 0
            d.extra_elements = int(winfo.numel * (growth - 1) + out_info.numel * (o / c_out - 1)
                                   + (x.numel * (i / c_in - 1) if x else 0))
    return plan


def _growth_gate(site: cost.Site, multiple: int, max_growth: float) -> cost.Verdict:
    """``gate="always"``: every misaligned dim pads, within ``max_growth`` (one dim alone when both are over)."""
    if site.kind == "conv" and site.groups != 1:
        return cost.Verdict(site.out, site.inp, ("grouped",),
                           f"skip: grouped convolution (groups={site.groups}) keeps its group structure")
    c_out, c_in = site.out, site.inp
    p_out, p_in = _up(c_out, multiple), _up(c_in, multiple)

    def dims(o, i):
        return " ".join(f"{w} {a} -> {b}" for w, (a, b) in (("out", (c_out, o)), ("in", (c_in, i))) if a != b)

    full = (p_out * p_in) / (c_out * c_in)
    over = f"skip {dims(p_out, p_in)}: +{full - 1:.0%} FLOPs over the {max_growth:g}x limit"
    choice = next(((o, i) for o, i in ((p_out, p_in), (p_out, c_in), (c_out, p_in))
                   if (o, i) != (c_out, c_in) and (o * i) / (c_out * c_in) <= max_growth), None)
    if choice is None:
        return cost.Verdict(c_out, c_in, ("growth_cap",), over)
    o, i = choice
    reason = f"pad {dims(o, i)}: tensor-core alignment (+{(o * i) / (c_out * c_in) - 1:.0%} FLOPs)"
    if (o, i) != (p_out, p_in):
        reason += f"; the rest skipped ({over})"
    return cost.Verdict(o, i, ("always",), reason)


def _trial_case(node: fx.Node, winfo: TensorInfo, x: TensorInfo | None, out: int, inp: int, site: cost.Site,
                dtype: torch.dtype, device: torch.device | None) -> cost.TrialCase:
    """What the trial times for this node padded to (out, inp): its true shapes and arguments, on the device."""
    dev = device or torch.device("cuda")
    label = str(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        label += f" ({torch.cuda.get_device_name(dev)})"
    conv_args = ()
    if site.kind == "conv":
        conv_args = tuple(_arg(node, k, n, dflt) for k, n, dflt in ((3, "stride", 1), (4, "padding", 0),
                                                                    (5, "dilation", 1)))
        conv_args = tuple(tuple(a) if isinstance(a, list) else a for a in conv_args)
    first = isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
    return cost.TrialCase(site.kind, tuple(x.shape) if x else (), tuple(winfo.shape), out, inp, conv_args,
                         _arg(node, 2, "bias") is not None, dtype, site.layout, label, input_grad=not first)


def _channel_dim(kind: str) -> int:
    return 1 if kind == "conv" else -1


def _pad_spec(ndim: int, dim: int, extra: int) -> tuple[int, ...]:
    """F.pad spec that appends ``extra`` zeros along ``dim`` of an ``ndim``-d tensor."""
    dim = dim % ndim
    spec = [0, 0] * (ndim - dim)
    spec[-1] = extra
    return tuple(spec)


_BN_PADDED: dict[type, type] = {}


def _padded_bn_class(cls: type) -> type:
    """A subclass of the given BatchNorm type that runs on channel-padded inputs, its parameters and buffers
    keeping their true shapes; zero gamma and beta keep the padded channels exactly zero."""
    if cls not in _BN_PADDED:
        def forward(self, x):
            c, extra = self.num_features, self.padded_to - self.num_features
            training = self.training or self.running_mean is None
            momentum = self.momentum
            if self.training and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if momentum is None:  # a cumulative average, as nn.BatchNorm's (swa_utils.update_bn sets it)
                    momentum = 1.0 / float(self.num_batches_tracked)
            rm = F.pad(self.running_mean, (0, extra)) if self.running_mean is not None else None
            rv = F.pad(self.running_var, (0, extra), value=1.0) if self.running_var is not None else None
            y = F.batch_norm(x, rm, rv, F.pad(self.weight, (0, extra)), F.pad(self.bias, (0, extra)),
                             training, 0.0 if momentum is None else momentum, self.eps)
            if self.training and rm is not None:  # no torch.no_grad() region: torch.export's loader refuses one
                self.running_mean.copy_(rm[:c].detach())  # that writes buffers ("missing val field")
                self.running_var.copy_(rv[:c].detach())
            return y

        _BN_PADDED[cls] = type(f"ChannelPadded{cls.__name__}", (cls,), {"forward": forward})
    return _BN_PADDED[cls]


def _bn_can_pad(module) -> bool:
    return (isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine
            and module.momentum is not None and type(module) in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d,
                                                                torch.nn.BatchNorm3d))


def _pad_bn_module(gm: fx.GraphModule, target: str, padded_to: int) -> None:
    bn = gm.get_submodule(target)
    new = _padded_bn_class(type(bn))(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    new.weight, new.bias = bn.weight, bn.bias
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(new, name, getattr(bn, name))
    new.padded_to = padded_to
    new.train(bn.training)
    owner, _, attr = target.rpartition(".")
    setattr(gm.get_submodule(owner), attr, new)


def apply_padding(gm: fx.GraphModule, plan: PadPlan) -> None:
    """Rewrite the graph as the plan says; the caller propagates the new shapes."""
    graph = gm.graph
    pads = {d.node: d for d in plan.decisions if d.action == "pad"}
    # node -> (kind, true, padded, the slice back to the true size) for each layer whose output is padded
    padded_out: dict[fx.Node, tuple[str, int, int, fx.Node]] = {}
    for node in list(graph.nodes):
        d = pads.get(node.name)
        if d is None:
            continue
        # a later layer may read the padded output through zero-preserving ops instead of its slice
        _pad_operands(gm, node, d, padded_out, plan)
        c_out, p_out = d.out
        if p_out != c_out:
            padded_out[node] = (d.kind, c_out, p_out, _slice_back(graph, node, _channel_dim(d.kind), c_out))
    for _, _, _, slicer in padded_out.values():
        if not slicer.users:  # every reader takes the padded value now
            graph.erase_node(slicer)
    graph.lint()
    gm.recompile()


def _pad_operands(gm: fx.GraphModule, node: fx.Node, d: PadDecision,
                  padded_out: dict[fx.Node, tuple[str, int, int, fx.Node]], plan: PadPlan) -> None:
    """Pad one layer's weight, bias and input in the graph just before it, and point the layer at them."""
    graph = gm.graph
    w_node, winfo = _weight_param(gm, node)
    b = _arg(node, 2, "bias")
    (c_out, p_out), (c_in, p_in) = d.out, d.inp
    with graph.inserting_before(node):
        wpad = (0, 0) * (len(winfo.shape) - 2) + (0, p_in - c_in, 0, p_out - c_out)
        w_new = graph.call_function(F.pad, (w_node, wpad))
        w_new._rename(f"pad_{w_node.name}")
        new_args = list(node.args)
        new_args[1] = w_new
        if isinstance(b, fx.Node) and p_out != c_out:
            b_new = graph.call_function(F.pad, (b, (0, p_out - c_out)))
            b_new._rename(f"pad_{b.name}")
            if len(new_args) > 2:
                new_args[2] = b_new
            else:
                node.kwargs = {**node.kwargs, "bias": b_new}
        if p_in != c_in:
            new_args[0] = _padded_input(gm, node, d, padded_out, plan)
        node.args = tuple(new_args)


def _padded_input(gm: fx.GraphModule, node: fx.Node, d: PadDecision,
                  padded_out: dict[fx.Node, tuple[str, int, int, fx.Node]], plan: PadPlan) -> fx.Node:
    """The layer's input padded to ``d.inp[1]`` channels: an earlier padded output of that size reached through
    zero-preserving ops, else an F.pad of the input inserted where the caller inserts."""
    x = node.args[0]
    c_in, p_in = d.inp
    src, path = _chain_source(gm, padded_out, x, d.kind) if isinstance(x, fx.Node) else (None, [])
    if src is not None and padded_out[src][2] == p_in:
        # the padded channels arrive already (all zeros): the chain reads the padded producer
        slicer = padded_out[src][3]
        if path:
            path[-1].replace_input_with(slicer, src)
        for v in path:  # batch norms on the way now see padded channels
            if v.op == "call_module":
                _pad_bn_module(gm, str(v.target), p_in)
        plan.persistent.append((src.name, node.name))
        return x if path else src
    ndim = len(x.meta[K.INFO].shape)
    x_new = gm.graph.call_function(F.pad, (x, _pad_spec(ndim, _channel_dim(d.kind), p_in - c_in)))
    x_new._rename(f"pad_{x.name}")
    return x_new


def _chain_source(gm: fx.GraphModule, padded_out: dict[fx.Node, tuple[str, int, int, fx.Node]], value: fx.Node,
                  kind: str) -> tuple[fx.Node | None, list[fx.Node]]:
    """Follow single-user zero-preserving ops (and batch norms that can run padded) back from ``value`` to the
    slice of a padded producer: (that producer if it is a layer of the same kind, else None; the ops on the way,
    nearest the reader first). (None, []) where the chain breaks before it reaches one."""
    path = []
    v = value
    slicers = {info[3]: k for k, info in padded_out.items()}
    while v not in slicers:
        if v.op != "call_function" and v.op != "call_method" and v.op != "call_module":
            return None, []
        if v.op == "call_module":
            # a batch norm normalises dim 1: a linear's padded features only where they are dim 1 (an (N, F) input)
            if not (_bn_can_pad(gm.get_submodule(str(v.target))) and len(v.users) == 1 and v.args
                    and isinstance(v.args[0], fx.Node)
                    and (kind == "conv" or len(getattr(v.args[0].meta.get(K.INFO), "shape", ())) == 2)):
                return None, []
        elif op_name(v) not in _ZERO_PRESERVING or len(v.users) != 1 or not v.args:
            return None, []
        src = v.args[0]
        if not isinstance(src, fx.Node):
            return None, []
        path.append(v)
        v = src
    producer = slicers[v]
    return (producer if padded_out[producer][0] == kind else None), path


def _slice_back(graph: fx.Graph, node: fx.Node, ch: int, c_out: int) -> fx.Node:
    """A narrow of the layer's padded output back to its ``c_out`` true channels, which every reader now reads."""
    with graph.inserting_after(node):
        sl = graph.call_method("narrow", (node, ch, 0, c_out))
    sl._rename(f"unpad_{node.name}")
    node.replace_all_uses_with(sl, delete_user_cb=lambda u: u is not sl)
    return sl
