"""Numerical diagnostics of where the low dtype is unsafe: ``calibrate`` moves nodes that overflow or lose too much
on real batches back to float32, and ``grad_histogram`` shows a float32 step's activation gradients against the
float16 range.
"""
from __future__ import annotations


import copy
import dataclasses
import math
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..core import rewrite as _rewrite
from ..api import convert
from ..base.meta import info_of, is_converted, refuse_piecewise


def _info(gm):
    info = info_of(gm)
    if info is None or info.plan is None:
        raise TypeError("calibrate() needs a module returned by autocastfx.convert()")
    return info


def _float32_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The converted module's float32 form (casts and dtype= arguments undone), node names kept."""
    f32 = copy.deepcopy(gm)
    for p in f32.parameters():
        p.data = p.data.float()
    _rewrite.undo(f32)
    return f32


class _Probe(fx.Interpreter):
    """A float32 run recording max |value| per node and, for low-precision ops, their own rounding error."""

    def __init__(self, gm, low_nodes: dict[str, torch.dtype], amax: dict, err: dict):
        super().__init__(gm)
        self.low_nodes, self.amax, self.err = low_nodes, amax, err

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            v = float(out.detach().abs().max())
            self.amax[n.name] = max(self.amax.get(n.name, 0.0), v)
            if n.name in self.low_nodes and math.isfinite(v):
                low = self.low_nodes[n.name]
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                down = lambda t: t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
                try:
                    with torch.no_grad():
                        lo = getattr(self, n.op)(n.target, tree_map(down, args), tree_map(down, kwargs))
                    ref = out.detach().double()
                    e = float((lo.double() - ref).norm() / ref.norm().clamp_min(1e-30))
                except Exception:  # noqa: BLE001 - an op without a low-precision kernel: nothing to learn
                    e = 0.0
                self.err[n.name] = max(self.err.get(n.name, 0.0), e if math.isfinite(e) else float("inf"))
        return out


def calibrate(gm: fx.GraphModule, batches: Iterable, *, margin: float = 4.0, max_rel_error: float = 0.05,
              rounds: int = 3) -> fx.GraphModule:
    """A re-planned copy of ``gm`` (sharing its tensors) with the nodes that overflow the low dtype, or lose more
    than ``max_rel_error`` relative error in it, moved to float32.

    Args:
        batches: input tuples like convert()'s ``example_inputs``.
        margin: headroom on the largest value seen: values over the low dtype's maximum / ``margin`` move.
        rounds: re-plans at most, each on the previous plan.
    """
    info = _info(gm)
    refuse_piecewise(info, "autocastfx.calibrate")
    blocks = [n for n, m in gm.named_modules() if n and is_converted(m)]
    if blocks:
        raise ValueError(
            f"autocastfx.calibrate re-plans the nodes of one graph, and {len(blocks)} converted blocks of this module "
            f"({', '.join(blocks[:3])}{' ...' if len(blocks) > 3 else ''}) are graphs of their own that it does not "
            "reach: an overflow inside them would stay. Convert with blocks=None (one graph) to calibrate: "
            "autocastfx.calibrate(autocastfx.convert(model, example, blocks=None), batches)")
    batches = [b if isinstance(b, tuple) else (b,) for b in batches]
    if not batches:
        raise ValueError("calibrate() needs at least one batch of inputs")
    fmax = torch.finfo(info.dtype).max
    f32 = _float32_copy(gm)
    f32.eval() if gm.training is False else None
    moved: dict[str, str] = {}
    current = gm
    for _ in range(rounds):
        decisions = {n.name: n.meta["autocastfx"] for n in current.graph.nodes if "autocastfx" in n.meta}
        low_ops = {k: info.dtype for k, d in decisions.items() if d.kind == "op" and d.dtype == info.dtype
                   and d.op_class == "low"}
        amax: dict[str, float] = {}
        err: dict[str, float] = {}
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(f32)):  # its dropout draws: not the caller's
            for b in batches:
                _Probe(f32, low_ops, amax, err).run(*_flat(f32, b))
        new = {}
        for node in f32.graph.nodes:
            d = decisions.get(node.name)
            if d is None or d.kind != "op" or d.dtype != info.dtype or node.name in moved:
                continue
            big_out = amax.get(node.name, 0.0) * margin > fmax
            ins = [a.name for a in node.all_input_nodes if a.name in amax]
            big_in = [a for a in ins if amax[a] * margin > fmax]
            if big_out or big_in:
                worst = max([amax.get(node.name, 0.0)] + [amax[a] for a in big_in])
                new[node.name] = (f"calibration: |value| reaches {worst:.3g}, over {str(info.dtype)[6:]}'s "
                                  f"{fmax:g} / margin {margin:g}")
            elif err.get(node.name, 0.0) > max_rel_error:
                new[node.name] = (f"calibration: relative error {err[node.name]:.3g} in "
                                  f"{str(info.dtype)[6:]}, over {max_rel_error:g}")
        if not new:
            break
        moved.update(new)
        policy = info.policy.override(node_names={k: "fp32" for k in moved})
        ex_args, ex_kwargs = batches[0], {}
        current = convert(gm, ex_args, example_kwargs=ex_kwargs or None, dtype=info.dtype, policy=policy,
                          **info.options.saved())
    if current is gm:  # nothing moved: a copy that shares gm's tensors, as a conversion of gm does
        current = copy.deepcopy(gm, {id(t): t for t in [*gm.parameters(), *gm.buffers()]})
    for node in current.graph.nodes:
        if node.name in moved and "autocastfx" in node.meta:
            node.meta["autocastfx"] = dataclasses.replace(node.meta["autocastfx"], reason=moved[node.name])
    current.meta["autocastfx"].extra_totals["calibration"] = dict(moved)
    return current


def _flat(gm: fx.GraphModule, batch: tuple) -> list:
    if getattr(gm, "_in_spec", None) is not None:
        return tree_flatten((tuple(batch), {}))[0]
    return list(batch)


# ------------------------------------------------------------------------------------ gradient histogram

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24


@dataclasses.dataclass
class GradHistogram:
    """Activation-gradient magnitudes of one float32 step, in log2 bins, against the float16 range."""
    exponents: list[int]          # bin k holds |g| in [2^k, 2^(k+1))
    counts: list[int]
    zeros: int                    # exact zeros in float32 (not counted in the bins)
    total: int
    max_abs: float
    share_normal: float           # of the nonzero values: normal in float16
    share_subnormal: float        # subnormal in float16 (precision lost)
    share_flushed: float          # would become 0 in float16 without scaling
    share_overflow: float         # over 65504
    max_safe_scale: float         # largest power of two keeping the largest gradient under 65504
    scale_to_keep_999: float      # smallest power of two lifting 99.9% of nonzero gradients to normal range

    def text(self, width: int = 50) -> str:
        peak = max(self.counts) if self.counts else 1
        lines = ["activation gradients of one float32 step (log2 |g|), float16 ranges marked"]
        for e, c in zip(self.exponents, self.counts):
            v = 2.0**e
            zone = ("overflow " if v >= FP16_MAX else "normal   " if v >= FP16_MIN_NORMAL
                    else "subnormal" if v >= FP16_MIN_SUBNORMAL else "-> zero  ")
            lines.append(f"2^{e:>4} {zone} {c:>10,} {'#' * max(1 if c else 0, round(width * c / peak))}")
        nz = self.total - self.zeros
        lines.append(f"{self.total:,} values, {self.zeros:,} exactly zero, {nz:,} nonzero; max |g| {self.max_abs:.3g}")
        lines.append(f"of the nonzero: {self.share_normal:.1%} normal in float16, {self.share_subnormal:.1%} subnormal, "
                     f"{self.share_flushed:.1%} would become zero without scaling, {self.share_overflow:.1%} overflow")
        lines.append(f"largest safe power-of-two loss scale: {self.max_safe_scale:g} (max |g| x scale < 65504); "
                     f"scale that lifts 99.9% into the normal range: {self.scale_to_keep_999:g}")
        return "\n".join(lines)

    __str__ = text

    def plot(self, path: str) -> str:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("grad_histogram plots need matplotlib: pip install 'autocastfx[plot]'") from e
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(self.exponents, self.counts, width=0.9, color="#4a90d9")
        for x, label in ((math.log2(FP16_MIN_SUBNORMAL), "fp16 smallest subnormal"),
                         (math.log2(FP16_MIN_NORMAL), "fp16 smallest normal"), (math.log2(FP16_MAX), "fp16 max")):
            ax.axvline(x, color="#e63946", ls="--", lw=1)
            ax.text(x, ax.get_ylim()[1] * 0.95, label, rotation=90, va="top", ha="right", fontsize=8)
        ax.set_xlabel("log2 |activation gradient|")
        ax.set_ylabel("count")
        ax.set_title(f"{self.share_flushed:.1%} of gradients would flush to zero in float16 without scaling")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


class _GradCollector(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.grads: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() and t.grad_fn is not None:
                t.register_hook(lambda g: self.grads.append(g.detach().abs().float().flatten()))
        return out


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})


def grad_histogram(model: nn.Module, inputs: tuple, loss_fn: Callable, *targets: Any) -> GradHistogram:
    """The activation gradients of one float32 forward/backward of ``loss_fn(model(*inputs), *targets)`` on a copy
    of ``model``."""
    if isinstance(inputs, torch.Tensor):
        raise TypeError("inputs must be a tuple: write (x,) instead of x")
    if any(is_converted(sub) for sub in model.modules()):
        raise TypeError("grad_histogram measures the float32 model's activation gradients, and this is a module "
                        "autocastfx converted (a copy would run its low-precision program): call it on the model "
                        "you converted, whose parameters are the converted module's, trained ones included")
    m = copy.deepcopy(model).float()
    col = _GradCollector()
    with torch.random.fork_rng(devices=_cuda_devices(m)):  # its dropout draws: not the caller's
        with col:
            out = m(*inputs)
        loss = loss_fn(out, *targets)
        loss.backward()
    if not col.grads:
        raise ValueError("no activation gradient was recorded: does the loss depend on the model's output?")
    g = torch.cat(col.grads)
    total = g.numel()
    nz = g[g > 0]
    zeros = total - nz.numel()
    if nz.numel() == 0:
        raise ValueError("every activation gradient is exactly zero")
    exps = torch.floor(torch.log2(nz)).to(torch.int64)
    lo, hi = int(exps.min()), int(exps.max())
    counts = torch.bincount(exps - lo, minlength=hi - lo + 1).tolist()
    n = nz.numel()
    normal = float(((nz >= FP16_MIN_NORMAL) & (nz <= FP16_MAX)).sum()) / n
    sub = float(((nz >= FP16_MIN_SUBNORMAL) & (nz < FP16_MIN_NORMAL)).sum()) / n
    flushed = float((nz < FP16_MIN_SUBNORMAL / 2).sum()) / n  # below half the smallest subnormal: rounds to 0
    over = float((nz > FP16_MAX).sum()) / n
    max_abs = float(nz.max())
    safe = 2.0 ** math.floor(math.log2(FP16_MAX / max_abs)) if max_abs > 0 else 1.0
    if safe * max_abs >= FP16_MAX:
        safe /= 2
    q = float(torch.quantile(nz[torch.randperm(n)[:1_000_000]] if n > 1_000_000 else nz, 0.001))
    lift = 2.0 ** max(0, math.ceil(math.log2(FP16_MIN_NORMAL / q))) if q > 0 else safe
    return GradHistogram(list(range(lo, hi + 1)), counts, zeros, total, max_abs, normal, sub, flushed, over,
                         safe, lift)
