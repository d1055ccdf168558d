"""The call a converted module was captured for, and a clear error for a call of another shape.

A graph is captured for one call: which positional inputs, which keyword inputs, which of them were ``None``. A
call that differs (``gm(x, y)`` where the example was ``(x,)``, a tensor where ``None`` was) fails inside the
generated code with torch's own message (``forward() takes 2 positional arguments``, ``Expected a proper Tensor
but got None``); the converted module says instead what it was converted for, what it was given, and how to
convert for that call.
"""
from __future__ import annotations

from typing import Any

import torch


def _kind(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')} tensor"
    if isinstance(v, (tuple, list, dict)):
        return type(v).__name__
    return type(v).__name__


def describe(args: tuple, kwargs: dict) -> tuple[tuple[str, str], ...]:
    """(input, kind) for each input of a call: ``("0", "int64 tensor")``, ``("targets", "None")``."""
    return tuple((str(i), _kind(a)) for i, a in enumerate(args)) + tuple((k, _kind(v)) for k, v in kwargs.items())


def _text(sig) -> str:
    parts = [f"{name}: {kind}" if not name.isdigit() else kind for name, kind in sig]
    return "(" + ", ".join(parts) + ")"


def check(captured: tuple, args: tuple, kwargs: dict, error: BaseException) -> None:
    """Raise a TypeError naming both calls where this call's inputs differ from the captured ones in number,
    names or None-ness; return where they do not (the original error is then the model's own)."""
    if not captured:
        return
    given = describe(args, kwargs)
    def shape(sig):
        return [(n, "None" if k == "None" else "value") for n, k in sig]
    if shape(given) == shape(captured):
        return
    raise TypeError(
        f"this module was converted for a call {_text(captured)} and was called with {_text(given)}: a graph is "
        "captured for one call's inputs (which are given, which are None). Convert with example inputs of "
        "this call: autocastfx.convert(model, example_inputs=(...), example_kwargs={...}) with every input this "
        "call passes (a model that takes targets and returns its loss: pass the targets in the example), and "
        f"keep one converted module per call ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})"
    ) from error
