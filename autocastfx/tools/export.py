"""``export``: a converted module as a .pt2 archive or ONNX model that loads without autocastfx. ``save``/``load``:
the converted module as its torch.export program plus its policy, options and report as schema-checked JSON, so
nothing is unpickled.
"""
from __future__ import annotations

from ..base.options import SAVED, ConvertOptions
from ..base.quiet import quiet_onnx_logs

import inspect
import io
import json
import os
import zipfile
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..base import keys as K
from ..base.meta import ConvertInfo, example_inputs_of, require_info
from ..capture.torch_export import run_export
from ..converted import calls as _calls
from ..converted import module as _module
from ..core.policy import OpClass, Policy
from .report import Report, Row

FORMAT = "autocastfx.save"
VERSION = 2  # 2: the program holds the float32 parameters
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class FormatError(ValueError):
    """A file that is not a well-formed autocastfx save (truncated, tampered with, or something else)."""


def _info(gm) -> ConvertInfo:
    return require_info(gm, TypeError)


def export_program(gm: fx.GraphModule, example_inputs: tuple | None = None, example_kwargs: dict | None = None,
                   dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    info = _info(gm)
    computed = _module.settle_programs(gm, _calls.convertible(info))  # the program of the modes now, as a call's
    piecewise = info.capture == "piecewise"
    if example_inputs is None and example_kwargs is None:
        if piecewise:
            raise ValueError("a module converted piecewise has no graph of its own to take example inputs from: "
                             "pass example_inputs (and example_kwargs) to export it")
        example_inputs, example_kwargs = example_inputs_of(gm)
    if isinstance(example_inputs, torch.Tensor):
        raise TypeError("example_inputs must be a tuple of inputs: write (x,) instead of x")
    args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    if not computed or info.call_signature and _calls.raw_key(args, kwargs) != _calls.example_key(info):
        # the conversion a call of this kind, or in these modes, runs
        other, args, kwargs = _calls.other_call(gm, info, args, kwargs, modes=not computed)
        if other is not None:
            return export_program(other, args, kwargs, dynamic_shapes)
        if not computed:
            _module.settle_programs(gm)  # refused, naming the modules
    try:
        return run_export(gm, tuple(example_inputs or ()), in_signature_order(gm, dict(example_kwargs or {})),
                          dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # noqa: BLE001 - said with the part that stops it
        if not piecewise:
            raise
        eager = info.extra_totals.get("eager", {})
        parts = "; ".join(f"{n or type(gm).__name__}: {why}" for n, why in eager.items())
        raise ExportError(
            f"{type(gm).__name__} was converted piecewise and torch.export cannot capture it either: the code "
            f"that stays eager stops it ({parts}). torch.export says: {str(e).strip().splitlines()[0][:300]}. "
            "Export a converted part instead (autocastfx.export(gm.get_submodule(name), ...), names in "
            "report(gm)), or call the model so that the data-dependent branch is not taken (without labels=)"
        ) from e


def in_signature_order(module: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` in the order of ``module.forward``'s parameters: torch.export of a GraphModule binds keyword
    inputs given in another order to the wrong parameters, silently (pytorch/pytorch#143732)."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    ordered = {k: kwargs[k] for k in names if k in kwargs}
    ordered.update((k, v) for k, v in kwargs.items() if k not in ordered)  # a **kwargs forward's own
    return ordered


class ExportError(RuntimeError):
    """A converted module that cannot be exported, and why."""


FORMATS = {".pt2": "a torch.export archive", ".onnx": "an ONNX model"}


class ExportCheckError(RuntimeError):
    """A written file that its runtime refuses, or whose outputs differ from the converted module's."""


def export(gm: fx.GraphModule, path: str | os.PathLike, example_inputs: tuple | None = None, *,
           example_kwargs: dict | None = None, dynamic_shapes: Any = None, inference: bool | None = None,
           check: bool = True) -> Any:
    """Write the converted module to ``path`` in the format its extension names: ``.pt2`` (returns the
    ExportedProgram) or ``.onnx`` (returns the ONNXProgram).

    Args:
        inference: export :func:`autocastfx.for_inference`'s deployment copy; the default for ONNX, which otherwise
            exports the eval program as converted.
        check: ONNX only: run the file in onnxruntime, where installed, against the module on the example inputs
            (:class:`ExportCheckError` if it does not load or match).

    Example::

        autocastfx.export(gm, "model.pt2", (x,))
    """
    fmt = os.path.splitext(os.fspath(path))[1].lower()
    if fmt not in FORMATS:
        raise ValueError(f"cannot tell which format to write from {os.fspath(path)!r}: export() writes "
                         + ", ".join(f"{k} ({v})" for k, v in FORMATS.items()) + "; name the file model.pt2 or "
                         "model.onnx")
    if fmt == ".onnx":
        return export_onnx(gm, path, example_inputs, example_kwargs=example_kwargs, dynamic_shapes=dynamic_shapes,
                           inference=True if inference is None else inference, check=check)
    if inference:
        from .inference import for_inference
        gm = for_inference(gm, example_inputs, example_kwargs=example_kwargs)
    ep = export_program(gm, example_inputs, example_kwargs, dynamic_shapes)
    torch.export.save(ep, os.fspath(path))
    return ep


def export_onnx(gm: fx.GraphModule, path: str | os.PathLike, example_inputs: tuple | None = None, *,
                example_kwargs: dict | None = None, dynamic_shapes: Any = None, inference: bool = True,
                check: bool = True, rtol: float = 2e-2) -> Any:
    """See :func:`export`; a file written with the exporter's optimizer that the runtime refuses is written and
    checked again without it."""

    for need in ("onnx", "onnxscript"):
        try:
            __import__(need)
        except ImportError as e:
            raise ImportError(f"writing ONNX needs {need}: pip install 'autocastfx[onnx]'") from e
    from .inference import for_inference

    _info(gm)
    if example_inputs is None and example_kwargs is None:
        example_inputs, example_kwargs = example_inputs_of(gm)
    args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    module = for_inference(gm, args, example_kwargs=kwargs) if inference else _eval_copy(gm)
    path = os.fspath(path)
    refused = None
    for optimize in (True, False):
        with quiet_onnx_logs():
            program = torch.onnx.export(module, args, path, kwargs=in_signature_order(module, kwargs) or None,
                                        dynamo=True, optimize=optimize,
                                        dynamic_shapes=dynamic_shapes, verbose=False)
        if inference and optimize:
            _store_folded_casts_low(path)
        if not check:
            return program
        refused = _check_onnx(module, path, args, in_signature_order(module, kwargs), rtol)
        if refused is None:
            return program
        if not refused.startswith("onnxruntime refuses"):
            break
    raise ExportCheckError(f"{path}: {refused}")


def _store_folded_casts_low(path: str) -> int:
    """Store as float16, behind a Cast, every float32 initializer whose values are all float16 values (the
    exporter's constant folding makes them of upcast float16 weights); returns how many."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from onnx.external_data_helper import load_external_data_for_model

    model = onnx.load(path, load_external_data=False)
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    if external:
        load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
    graph = model.graph
    inputs = {i.name for i in graph.input}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | inputs
    casts, keep, moved = [], [], 0
    for t in graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT or t.name in inputs:
            keep.append(t)
            continue
        a = numpy_helper.to_array(t)
        if a.size < 2 or not np.isfinite(a).all():
            keep.append(t)
            continue
        low = a.astype(np.float16)
        if not np.array_equal(low.astype(np.float32), a):
            keep.append(t)
            continue
        name, i = f"{t.name}_float16", 0
        while name in taken:
            i += 1
            name = f"{t.name}_float16_{i}"
        taken.add(name)
        keep.append(numpy_helper.from_array(low, name))
        casts.append(helper.make_node("Cast", [name], [t.name], to=onnx.TensorProto.FLOAT, name=f"{name}_cast"))
        moved += 1
    if not moved:
        return 0
    del graph.initializer[:]
    graph.initializer.extend(keep)
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    data = os.path.basename(path) + ".data"
    if external and os.path.exists(os.path.join(os.path.dirname(os.path.abspath(path)), data)):
        os.remove(os.path.join(os.path.dirname(os.path.abspath(path)), data))
    onnx.save_model(model, path, save_as_external_data=external, all_tensors_to_one_file=True, location=data)
    return moved


def _eval_copy(gm: fx.GraphModule) -> fx.GraphModule:
    import copy
    return copy.deepcopy(gm).eval()


def _check_onnx(module: nn.Module, path: str, args: tuple, kwargs: dict, rtol: float) -> str | None:
    """None if onnxruntime (where installed) loads the file and its outputs match the module's, else why not."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None  # no onnxruntime here: the file goes unchecked
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - the runtime's words are the message
        return f"onnxruntime refuses the file: {str(e).strip().splitlines()[0][:300]}"
    flat = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), flat)}
    got = session.run(None, feeds)
    with torch.no_grad():
        want = [t for t in torch.utils._pytree.tree_leaves(module(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    if len(got) != len(want):
        return f"onnxruntime gives {len(got)} outputs, the module {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = torch.from_numpy(g).double(), w.detach().double().cpu()
        if g.shape != w.shape:
            return f"output {i} has shape {tuple(g.shape)} in onnxruntime, {tuple(w.shape)} in the module"
        err = ((g - w).norm() / w.norm().clamp_min(1e-12)).item() if w.is_floating_point() else float(not torch.equal(g, w))
        if not err <= rtol:
            return f"output {i} differs from the module's by {err:.2e} (relative), more than {rtol:.0e}"
    return None


# --------------------------------------------------------------------------------------------- save/load

def _policy_to_data(p: Policy) -> dict:
    return {
        "op_table": {k: v.value for k, v in p.op_table.items()},
        "module_types": {f"{t.__module__}.{t.__qualname__}": v.value for t, v in p.module_types.items()},
        "module_names": [[g, c.value] for g, c in p.module_names],
        "node_names": {k: v.value for k, v in p.node_names.items()},
        "fp32_routers": p.fp32_routers, "widest": p.widest,
    }


def _policy_from_data(d: dict) -> Policy:
    types = {}
    for qual, c in d["module_types"].items():
        mod, _, name = qual.rpartition(".")
        if mod.startswith("torch.nn") and hasattr(nn, name):  # only torch.nn types are looked up, by name
            types[getattr(nn, name)] = OpClass(c)
    return Policy(op_table={k: OpClass(v) for k, v in d["op_table"].items()}, module_types=types,
                  module_names=tuple((g, OpClass(c)) for g, c in d["module_names"]),
                  node_names={k: OpClass(v) for k, v in d["node_names"].items()},
                  fp32_routers=bool(d.get("fp32_routers", True)), widest=bool(d.get("widest", False)))


def save(gm: fx.GraphModule, path: str | os.PathLike, example_inputs: tuple | None = None, *,
         example_kwargs: dict | None = None) -> None:
    """Save a converted module as its torch.export program, with its policy, options and report, for :func:`load`."""
    from .report import report
    info = _info(gm)
    ep = export_program(gm, example_inputs, example_kwargs)
    program = io.BytesIO()
    torch.export.save(ep, program)
    meta = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__,
        "dtype": str(info.dtype).removeprefix("torch."), "capture": info.capture,
        "options": info.options.saved(), "policy": _policy_to_data(info.policy),
        "report": report(gm).to_dict(), "training": bool(gm.training),
    }
    with zipfile.ZipFile(os.fspath(path), "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("meta.json", json.dumps(meta))
        z.writestr("program.pt2", program.getvalue())


def _check(cond: bool, what: str, path) -> None:
    if not cond:
        raise FormatError(f"{path}: {what}; the file was changed or is not an autocastfx.save() file")


def load(path: str | os.PathLike) -> fx.GraphModule:
    """Load what :func:`save` wrote; FormatError for a truncated, tampered or foreign file."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            _check(names == {"meta.json", "program.pt2"}, f"unexpected members {sorted(names)}", path)
            bad = z.testzip()
            _check(bad is None, f"member {bad} is corrupt (CRC mismatch)", path)
            meta_bytes, program = (z.read(n) for n in ("meta.json", "program.pt2"))
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise FormatError(f"{path}: not a readable autocastfx save file ({e}); it may be truncated") from None
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:
        raise FormatError(f"{path}: meta.json is not valid JSON ({e})") from None
    _check(isinstance(meta, dict) and meta.get("format") == FORMAT, "meta.json has no autocastfx format tag", path)
    _check(meta.get("version") == VERSION, f"format version {meta.get('version')!r}, expected {VERSION}", path)
    schema = {"dtype": str, "capture": str, "options": dict, "policy": dict, "report": dict}
    for key, typ in schema.items():
        _check(isinstance(meta.get(key), typ), f"meta.json field {key!r} missing or not a {typ.__name__}", path)
    _check(meta["dtype"] in _DTYPES, f"dtype {meta['dtype']!r}", path)
    try:
        policy = _policy_from_data(meta["policy"])
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise FormatError(f"{path}: the saved policy is malformed ({e})") from None
    try:
        gm = torch.export.load(io.BytesIO(program)).module()
    except Exception as e:  # noqa: BLE001
        raise FormatError(f"{path}: program.pt2 does not load ({type(e).__name__}: {str(e)[:200]})") from None
    low = _DTYPES[meta["dtype"]]
    floats = {p.dtype for p in gm.parameters() if p.is_floating_point()}
    _check(floats <= {torch.float32}, f"the program holds {sorted(map(str, floats))} parameters, not the float32 "
           "ones a save writes", path)
    _check(set(meta["options"]) <= set(SAVED), f"options {sorted(set(meta['options']) - set(SAVED))} are not "
           "options a save records", path)
    report_rows = [Row(**r) for r in meta["report"].get("nodes", [])]
    info = ConvertInfo(dtype=low, policy=policy, capture=meta["capture"], plan=None,
                       absorbed=[], options=ConvertOptions(dtype=low, policy=policy, **meta["options"]),
                       extra_totals={"saved_report": Report(report_rows, meta["report"].get("totals", {}))})
    gm.meta["autocastfx"] = info
    training = bool(meta.get("training", True))  # the program of the mode it was saved in, its only one
    for m in gm.modules():
        m.training = training
    gm.meta[K.SAVED_MODE] = "train" if training else "eval"
    return gm


def model_explorer_overlay(gm: fx.GraphModule, ep: torch.export.ExportedProgram, graph_id: str = "main") -> dict:
    """Node data for Google's Model Explorer over the exported program (value 1 for a low node or a cast to low,
    0 for float32), with a sidecar of reasons and casts keyed by the same node ids."""
    decisions = {n.name: n.meta["autocastfx"] for n in gm.graph.nodes if "autocastfx" in n.meta}
    low = _info(gm).dtype
    colour = {"low": "#f4a261", "fp32": "#4a90d9", "cast": "#e63946"}
    results, notes = {}, {}
    for node in ep.graph.nodes:
        if node.op not in ("call_function",):
            continue
        sources = [s.name for s in node.meta.get("from_node", []) or []]
        d = next((decisions[s] for s in sources if s in decisions), None)
        if d is None:
            continue
        if d.kind == "cast":
            value, bg = (1.0 if d.dtype == low else 0.0), colour["cast"]
        elif d.dtype == low:
            value, bg = 1.0, colour["low"]
        elif d.dtype == torch.float32:
            value, bg = 0.0, colour["fp32"]
        else:
            continue
        results[node.name] = {"value": value, "bgColor": bg}
        notes[node.name] = {"dtype": str(d.dtype).removeprefix("torch."), "class": d.op_class, "kind": d.kind,
                            "reason": d.reason, "casts_in": list(d.casts_in), "source_node": sources[0]}
    return {"node_data": {graph_id: {"results": results,
                                     "thresholds": [{"value": 0.25, "bgColor": colour["fp32"]},
                                                    {"value": 1.0, "bgColor": colour["low"]}]}},
            "notes": notes}
