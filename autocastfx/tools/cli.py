"""``autocastfx inspect | export | graph``: convert a model built by a factory and show or ship the result.

    autocastfx inspect pkg.module:factory --input 2x3x224x224 [--input-dtype long] [--dtype bf16] [--json]
    autocastfx export  pkg.module:factory --input 1x3x224x224 -o model.pt2
    autocastfx graph   pkg.module:factory --input 1x3x224x224 -o graph.svg [--depth 2] [--model-explorer]

User mistakes print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings

import torch
from ..api import convert
from ..base.errors import CaptureError
from .report import report

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "auto": "auto"}
_INPUT_DTYPES = {"float": torch.float32, "float32": torch.float32, "long": torch.int64, "int64": torch.int64,
                 "int": torch.int32, "int32": torch.int32, "bool": torch.bool}


class UsageError(Exception):
    pass


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"bad --input shape {text!r}: write sizes joined by x, like 2x3x224x224") from None
    if not dims or any(d <= 0 for d in dims):
        raise UsageError(f"bad --input shape {text!r}: every size must be a positive integer")
    return dims


def load_factory(spec: str):
    if ":" not in spec:
        raise UsageError(f"bad model {spec!r}: write module.path:factory, like torchvision.models:resnet50")
    mod_name, _, attr = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import {mod_name!r}: {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec!r} is not callable: give a class or a function that returns an nn.Module")
    return obj


def build(args) -> tuple[torch.nn.Module, tuple]:
    factory = load_factory(args.model)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{args.model} returned {type(model).__name__}, not an nn.Module")
    model.eval()
    if not args.input:
        raise UsageError("give at least one --input shape, like --input 1x3x224x224")
    dtypes = args.input_dtype or ["float"]
    if len(dtypes) == 1:
        dtypes = dtypes * len(args.input)
    if len(dtypes) != len(args.input):
        raise UsageError("give one --input-dtype, or one per --input")
    inputs = []
    for shape, dt in zip(args.input, dtypes):
        if dt not in _INPUT_DTYPES:
            raise UsageError(f"bad --input-dtype {dt!r}: use one of {sorted(_INPUT_DTYPES)}")
        dims = parse_shape(shape)
        t = _INPUT_DTYPES[dt]
        inputs.append(torch.randn(dims) if t.is_floating_point else torch.zeros(dims, dtype=t))
    return model, tuple(inputs)


def convert_from_args(args):
    model, inputs = build(args)
    if args.dtype not in _DTYPES:
        raise UsageError(f"bad --dtype {args.dtype!r}: use fp16, bf16 or auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gm = convert(model, inputs, dtype=_DTYPES[args.dtype], pad_multiple=args.pad_multiple)
        except CaptureError as e:
            raise UsageError("the model does not trace: " + str(e).splitlines()[0] +
                             " (see `python -c 'import autocastfx; help(autocastfx.convert)'`)") from None
    return gm, inputs


def cmd_inspect(args) -> int:
    gm, _ = convert_from_args(args)
    rep = report(gm)
    print(rep.to_json(indent=1) if args.json else rep)
    return 0


def cmd_export(args) -> int:
    from .export import export
    from .export import ExportCheckError, ExportError
    gm, inputs = convert_from_args(args)
    try:
        export(gm, args.output, inputs)
    except (ExportCheckError, ExportError, ImportError) as e:
        raise UsageError(f"cannot export to {args.output}: {e}") from None
    except ValueError as e:  # an extension that names no format
        raise UsageError(str(e)) from None
    if str(args.output).lower().endswith(".onnx"):
        print(f"wrote {args.output}: loaded and checked in onnxruntime where it is installed; "
              f"onnxruntime.InferenceSession({args.output!r}) runs it")
    else:
        print(f"wrote {args.output}: load it with torch.export.load({args.output!r}).module()")
    return 0


def cmd_graph(args) -> int:
    from .export import export, model_explorer_overlay
    from .graph import render, to_dot
    gm, inputs = convert_from_args(args)
    if args.model_explorer:
        base = os.path.splitext(args.output)[0]
        ep = export(gm, base + ".pt2", inputs)
        overlay = model_explorer_overlay(gm, ep)
        with open(base + ".node_data.json", "w") as f:
            json.dump(overlay["node_data"], f, indent=1)
        with open(base + ".reasons.json", "w") as f:
            json.dump(overlay["notes"], f, indent=1)
        print(f"wrote {base}.pt2, {base}.node_data.json (Model Explorer node data: open the .pt2 in "
              f"model-explorer and load the node data) and {base}.reasons.json")
        return 0
    try:
        render(to_dot(gm, depth=args.depth, title=f"{args.model} ({args.dtype})"), args.output)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {args.output}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autocastfx", description="Explicit mixed precision for PyTorch models.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (("inspect", cmd_inspect, "convert and print the report"),
                               ("export", cmd_export, "convert and write a torch.export .pt2 or, for -o NAME.onnx, an ONNX model"),
                               ("graph", cmd_graph, "convert and draw the graph")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("model", help="module.path:factory returning an nn.Module")
        s.add_argument("--input", action="append", default=[], help="input shape like 2x3x224x224 (repeatable)")
        s.add_argument("--input-dtype", action="append", help="float (default), long, int, bool (repeatable)")
        s.add_argument("--dtype", default="fp16", help="fp16 (default) or bf16")
        s.add_argument("--pad-multiple", type=int, default=8)
        if name == "inspect":
            s.add_argument("--json", action="store_true", help="the report as JSON")
        if name in ("export", "graph"):
            s.add_argument("-o", "--output", required=True)
        if name == "graph":
            s.add_argument("--depth", type=int, default=2, help="collapse modules at this depth (0: every node)")
            s.add_argument("--model-explorer", action="store_true",
                           help="write the .pt2 and a Model Explorer node-data overlay instead of a picture")
        s.set_defaults(fn=fn)
    return p




def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"autocastfx: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"autocastfx: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
