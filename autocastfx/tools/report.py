"""Report: one row per node (dtype, class, reason, casts) and the totals, as a table or as JSON-ready data."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.fx as fx

from ..core import weights as _weights
from ..core.flops import node_flops as node_flops_of

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", None: "-"}
_CAST_BYTES = 6  # a cast between a 2-byte and a 4-byte float reads one and writes the other


@dataclasses.dataclass
class Row:
    name: str
    op: str
    target: str
    kind: str
    op_class: str | None
    dtype: str
    reason: str
    casts: list[str]


@dataclasses.dataclass
class Report:
    rows: list[Row]
    totals: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"totals": self.totals, "nodes": [dataclasses.asdict(r) for r in self.rows]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        w_name = min(36, max([4] + [len(r.name) for r in self.rows]))
        w_tgt = min(34, max([6] + [len(r.target) for r in self.rows]))
        head = f"{'node':<{w_name}}  {'target':<{w_tgt}}  {'class':<8}  {'dtype':<5}  reason"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            casts = f"  [casts in: {', '.join(r.casts)}]" if r.casts else ""
            lines.append(f"{_cut(r.name, w_name):<{w_name}}  {_cut(r.target, w_tgt):<{w_tgt}}  "
                         f"{r.op_class or '-':<8}  {r.dtype:<5}  {r.reason}{casts}")
        t = self.totals
        lines.append("")
        if t.get("eager"):
            lines.append("converted piecewise; these parts stay eager (the model's own Python runs them):")
            lines.extend(f"  {name or '(the model itself)'}: {why}" for name, why in t["eager"].items())
        if t.get("blocks"):
            lines.append("blocks: converted modules of their own (report(gm.get_submodule(name)) for each):")
            for name, b in t["blocks"].items():
                extra = (f"; casts {b['casts']}, parameters read only low {b['low_parameters']}, inputs "
                         f"{', '.join(b['inputs']) or '-'}") if "casts" in b else ""
                lines.append(f"  {name}: {b['plan']}{extra}")
        if t.get("capture") == "piecewise":
            return "\n".join(lines)
        if t.get("options"):
            lines.append(f"options: {t['options']}")
        summary = _summary(t)
        if t.get("blocks"):  # the totals are the root graph's; each block's are in its own report
            summary = [summary[0] + " (the graph around the blocks: a block's call is one node, its output's dtype)",
                       *(line.replace(" per forward", " per forward of the graph around the blocks")
                         for line in summary[1:])]
        lines += summary
        if t.get("shapes", "fake") != "fake":
            lines.append(f"shapes and dtypes learnt from a {t['shapes']}")
        if t.get("dtype_choice"):
            lines.append(f"{'compute dtype float32 (' if t['dtype'] == 'fp32' else 'low dtype: '}"
                         f"{t['dtype_choice']}{')' if t['dtype'] == 'fp32' else ''}")
        if t.get("weights_from"):
            lines.append(f"weights: {t['weights_from']}")
        if t.get("unclassified"):
            lines.append(f"unclassified: {t['unclassified']}")
        if t.get("opaque_calls"):
            lines.append("opaque calls (functions hidden from tracing):")
            lines.extend(f"  {line}" for line in t["opaque_calls"])
        md = t.get("modes")
        if md:
            diff = md["differences"]
            lines.append(f"modes: {md['how']}; the rows above are the {md.get('running', 'running')} program; "
                         + ("the modes differ here:" if diff else "the modes do not differ"))
            lines.extend(f"  {line}" for line in diff[:40])
            if len(diff) > 40:
                lines.append(f"  ... and {len(diff) - 40} more (Report.totals['modes'])")
        pad = t.get("padding")
        if pad:
            lines.append(f"padding to multiples of {pad['multiple']}: misaligned GEMM/conv ops {pad['misaligned_before']} "
                         f"-> {pad['misaligned_after']}, extra FLOPs {pad['extra_flops']:,}, extra bytes {pad['extra_bytes']:,} (2-byte)"
                         + (f", kept padded across {len(pad['kept_padded'])} chains" if pad["kept_padded"] else ""))
            if pad.get("target"):
                lines.append(f"  gate: {pad['gate']}, for {pad['target']}")
            for line in pad["padded"] + pad["skipped"]:
                lines.append(f"  {line}")
        lay = t.get("layout")
        if lay:
            lines.append(f"layout: {lay['memory_format']} ({lay['reason']})")
            if lay["memory_format"] == "channels_last":
                lines.append(f"  convolution weights read channels_last: {lay['params_channels_last']}; inputs "
                             f"converted once: {', '.join(lay['inputs']) or 'none'}")
                for key, label in (("to_channels_last", "to channels_last"), ("to_contiguous", "to contiguous"),
                                   ("reshape_copies", "reshape copy")):
                    lines += [f"  {label}: {v}" for v in lay[key]]
        return "\n".join(lines)


def _summary(t: dict[str, Any]) -> list[str]:
    """The totals' lines on dtypes, casts, parameters and FLOPs; for a float32-compute conversion (``"auto"``
    where no low dtype pays), what it kept float32 instead."""
    per_dtype = ", ".join(f"{k} {v}" for k, v in t["nodes_per_dtype"].items())
    if t["dtype"] == "fp32":
        return [f"captured by {t['capture']}; compute dtype float32, no low dtype; nodes per dtype: {per_dtype}",
                f"casts per forward: {t['casts']} ({t['cast_bytes']:,} bytes)",
                f"parameters: float32, read as they are (no casts); model casts absorbed: "
                f"{t['absorbed_casts']}",
                f"matmul/conv FLOPs: {t['flops']:,} per forward, all in float32"]
    return [f"captured by {t['capture']}; low dtype {t['dtype']}; nodes per dtype: {per_dtype}",
            f"casts per forward: {t['casts']} ({t['cast_bytes']:,} bytes); naive rule would use "
            f"{t['casts_naive']} ({t['cast_bytes_naive']:,} bytes)",
            _parameters_line(t) + f"; model casts absorbed: {t['absorbed_casts']}",
            f"matmul/conv FLOPs in low precision: {t['low_flop_share']:.1%} of {t['flops']:,} per forward"]


def _parameters_line(t: dict[str, Any]) -> str:
    stored = (t.get("inference") or {}).get("weights_stored_low_and_cast_up")
    if stored:  # a deployment copy (autocastfx.for_inference)
        return (f"parameters stored low: {len(stored)} (in the low dtype in the module; cast up where the graph "
                "reads one in float32)")
    return (f"parameters read only low: {t['low_parameters']} (float32 in the module, cast once per forward; a "
            "weight also read in float32, as a tied embedding, is not counted)")


def _cut(s: str, w: int) -> str:
    return s if len(s) <= w else s[: w - 1] + "~"


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    return f"{mod.replace('torch.nn.functional', 'F')}.{getattr(t, '__name__', t)}".lstrip(".")


def report(gm: fx.GraphModule) -> Report:
    """The report of a converted GraphModule."""
    info = getattr(gm, "meta", {}).get("autocastfx")
    if info is None:
        raise ValueError("report() needs a module made by autocastfx.convert()")
    if info.plan is None and "saved_report" in info.extra_totals:  # loaded by autocastfx.load()
        return info.extra_totals["saved_report"]
    if not hasattr(gm, "graph"):  # converted piecewise: the model's own Python around converted parts
        totals = {"capture": info.capture, "dtype": _SHORT[info.dtype], "nodes_per_dtype": {}, "casts": 0,
                  "cast_elements": 0, "cast_bytes": 0, "casts_naive": 0, "cast_bytes_naive": 0,
                  "low_parameters": 0, "absorbed_casts": 0, "flops": 0, "low_flops": 0, "low_flop_share": 0.0,
                  "unclassified": []}
        totals.update(info.extra_totals)
        return Report([], totals)
    rows = []
    per_dtype: dict[str, int] = {}
    casts = cast_elems = 0
    flops = low_flops = 0
    for node in gm.graph.nodes:
        d = node.meta.get("autocastfx")
        if d is None:
            continue
        node_flops = node_flops_of(gm, node) if d.kind == "op" else 0  # a matmul the policy keeps float32 too
        rows.append(Row(node.name, node.op, _target(node), d.kind, d.op_class, _SHORT.get(d.dtype, str(d.dtype)),
                        d.reason, list(d.casts_in)))
        inside = getattr(gm.get_submodule(str(node.target)), "casts_per_call", None) \
            if node.op == "call_module" else None
        if inside is not None:  # a deployment copy's leaf module, casting its low parameters up
            casts += len(inside())
            cast_elems += sum(inside())
        if d.kind == "cast":
            casts += 1
            cast_elems += d.numel
        elif d.kind == "op" and d.dtype is not None:
            per_dtype[_SHORT[d.dtype]] = per_dtype.get(_SHORT[d.dtype], 0) + 1
        if node_flops:
            flops += node_flops
            if d.dtype == info.dtype and info.dtype != torch.float32:  # float32 compute: no low FLOPs
                low_flops += node_flops
    plan = info.plan
    totals = {
        "capture": info.capture,
        "dtype": _SHORT[info.dtype],
        "nodes_per_dtype": per_dtype,
        "casts": casts,
        "cast_elements": cast_elems,
        "cast_bytes": cast_elems * _CAST_BYTES,
        "casts_naive": plan.before[1],
        "cast_bytes_naive": plan.before[0] * _CAST_BYTES,
        "low_parameters": len(_weights.low_read_names(gm)),
        "absorbed_casts": len(info.absorbed),
        "flops": flops,
        "low_flops": low_flops,
        "low_flop_share": (low_flops / flops) if flops else 0.0,
        "unclassified": list(plan.unclassified),
        "options": str(info.options),
    }
    totals.update({k: v for k, v in info.extra_totals.items() if k != "saved_report"})
    if "modes" in totals:
        totals["modes"] = {**totals["modes"], "running": "training" if gm.training else "eval"}
    return Report(rows, totals)
