"""CaptureContext: what a capture needs beyond the model and its inputs, made per ``convert()`` call and passed
explicitly (never a module global), so two conversions never see each other's state.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class CaptureContext:
    """What one capture is told beyond the model and its inputs.

    ``meta_device``: the device a meta-device model will run on (None: a real model). ``dynamic_sizes``: sizes of
    the model's inputs free to vary (:func:`free_sizes`), left free when a block is exported alone. ``sources``:
    id(converted block) -> (the model's block, its result template), for capture.around. ``watch(module, name)``:
    called on every attribute read of the capture's copy (capture.watch)."""
    meta_device: torch.device | None = None
    dynamic_sizes: frozenset[int] = frozenset()
    sources: Mapping[int, tuple[nn.Module, Any]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    watch: Callable[[nn.Module, str], None] | None = None

    def replace(self, **changes) -> CaptureContext:
        if "sources" in changes:
            changes["sources"] = types.MappingProxyType(dict(changes["sources"]))
        return dataclasses.replace(self, **changes)


def free_axes(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of a model input free to vary: the first (batch), and a 2-D integer tensor's second (sequence
    length). One rule for the capture (:func:`free_sizes`), the compile marks (``converted.calls.free_dims``) and
    the conversion for another call (``converted.calls.widened``)."""
    if not t.dim():
        return ()
    return (0, 1) if not t.is_floating_point() and not t.is_complex() and t.dim() == 2 else (0,)


def auto_axes(t: torch.Tensor, sizes: frozenset[int]) -> tuple[int, ...]:
    """The dims of a model input that a torch.export capture leaves free (``Dim.AUTO``): :func:`free_axes`, and any
    dim whose size is one of the inputs' free ``sizes`` (:func:`free_sizes`)."""
    return tuple(sorted(set(free_axes(t)) | {i for i, n in enumerate(t.shape) if n in sizes}))


def free_sizes(args: tuple, kwargs: dict) -> frozenset[int]:
    """The sizes along :func:`free_axes` of a model's inputs; sizes of 1 are never free (torch.export specializes
    them)."""
    sizes = {t.shape[d] for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
             for d in free_axes(t)}
    return frozenset(n for n in sizes if n > 1)
