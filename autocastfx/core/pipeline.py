"""The passes over one captured graph (one program, in one mode, TensorInfo recorded), in the order they run:
``run_passes``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..base import keys as K
from ..base.meta import TensorInfo
from ..base.options import ConvertOptions
from . import layout as _layout
from . import padding as _padding
from . import plan as _plan
from . import rewrite as _rewrite
from .propagate import placeholder_values, propagate


@dataclasses.dataclass
class Passed:
    """What the passes decided, for the converted module's ConvertInfo and report."""
    plan: _plan.CastPlan
    absorbed: list[str]
    layout: _layout.LayoutPlan
    padding: _padding.PadPlan | None


def run_passes(gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, options: ConvertOptions, *,
               meta_device: torch.device | None = None, entry_casts: bool = False) -> Passed:
    """Plan and rewrite ``gm`` (captured from ``model`` on ``args``/``kwargs``) into its mixed-precision form.

    ``entry_casts``: ``gm`` is a block of a larger model; its float32 inputs whose example values the low dtype
    holds are left for the plan to choose, and each input is cast on entry to the dtype it was planned for.
    ``meta_device``: the model is on meta (see ``propagate``)."""
    policy, dtype = options.policy, options.dtype
    absorbed = _rewrite.absorb_casts(gm)  # the model's own casts, where the plan decides dtypes instead
    layout = _layout.plan_layout(gm, options.memory_format)  # before padding: its gate depends on the layout
    pad_plan = None
    if options.pad_multiple > 1:
        pad_plan = _padding.plan_padding(gm, options.pad_multiple, policy.pad_max_growth,
                                         layout=layout.memory_format, dtype=dtype, gate=policy.pad_gate)
        if any(d.action == "pad" for d in pad_plan.decisions):
            _padding.apply_padding(gm, pad_plan)
            propagate(gm, args, kwargs, meta_device=meta_device)  # the padded values' shapes
    _layout.apply_layout(gm, layout, args, kwargs)
    # a block's float32 inputs the plan may take low (not under Policy.widest: a float32 input stays float32)
    free = _free_inputs(gm, args, kwargs, dtype) if entry_casts and not options.keep_io_types \
        and not policy.widest else frozenset()
    plan = _plan.build_plan(gm, policy, dtype, keep_io_types=options.keep_io_types, free_inputs=free)
    _inputs_as_planned(gm, plan, free)
    _rewrite.apply_plan(gm, plan)  # the casts: nodes of the graph
    _layout.weights_channels_last(gm, layout)  # a convolution's weight read NHWC, through its cast
    if entry_casts:
        _rewrite.entry_casts(gm)
    return Passed(plan=plan, absorbed=absorbed, layout=layout, padding=pad_plan)


def _free_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, low: torch.dtype) -> frozenset[str]:
    """A block's float32 inputs whose dtype its plan may choose: those whose example values the low dtype
    holds (a mask filled with float32's lowest value is not one of them)."""
    out = set()
    for p, v in placeholder_values(gm, args, kwargs):
        info = p.meta.get(K.INFO)
        # on the meta device the values are unknown: such an input stays float32
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and isinstance(info, TensorInfo) \
                and info.dtype == torch.float32 and not v.is_meta and bool(torch.isfinite(v.to(low)).all()):
            out.add(p.name)
    return frozenset(out)


def _inputs_as_planned(gm: fx.GraphModule, plan: Any, free: frozenset[str]) -> None:
    """A free input the plan labels low is recorded as a low input: no cast for it in the graph, and the entry
    cast (``rewrite.entry_casts``) takes whatever the caller gives in that dtype."""
    for p in gm.graph.nodes:
        if p.op == "placeholder" and p.name in free and plan.nodes[p.name].label == _plan.LOW:
            p.meta[K.INFO] = dataclasses.replace(p.meta[K.INFO], dtype=plan.dtype)
