"""Checkpoints of a training step with ``torch.distributed.checkpoint`` (DCP): torch's own model and optimizer
state dicts, plus the step's loss-scale state and micro-batch count.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..core.weights import own_names
from .step import TrainStep


def _state(step: TrainStep, optimizer_state: bool | None = None) -> dict[str, Any]:
    """The step's whole state as DCP reads and writes it.

    Args:
        optimizer_state: whether the optimizer's per-parameter state is included; None: where it has any. torch
            sets up a fresh optimizer's state by running a step (which counts for Adam), so that set-up is undone
            unless it is kept for DCP to load into.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    opt = step.optimizer
    outside = step.outside_params()
    if outside:
        raise ValueError(
            f"the optimizer trains {len(outside)} tensor(s) that are not the converted module's (a parameter of the "
            f"loss, such as a learned weighting: {outside[0][0]}), and a DCP checkpoint names optimizer state by "
            "the module's parameter names. Keep them in a module the converted model holds, or save with "
            "torch.save(step.state_dict(), f), which holds them")
    fresh = not opt.state
    if optimizer_state is None:
        optimizer_state = not fresh
    kept = {k: opt.__dict__[k] for k in ("grad_scale", "found_inf") if k in opt.__dict__}
    opt.grad_scale = opt.found_inf = None  # torch's set-up of missing state runs a step: never skipped
    try:
        with own_names(step.gm):
            model, optim = get_state_dict(step.gm, opt)
    finally:
        del opt.grad_scale, opt.found_inf
        opt.__dict__.update(kept)
    if not optimizer_state:
        if fresh:
            opt.state.clear()
        optim = {"state": {}, "param_groups": optim["param_groups"]}
    return {"model": model, "optimizer": optim,
            "scaler": {k: v for k, v in step.state.state_dict().items() if torch.is_tensor(v)},
            "extra": {"micro": step.micro, "auto_pending": step.state.auto_pending}}


def _saved_keys(path: str) -> set[str]:
    """The keys of the checkpoint at ``path`` (``optimizer.state.<parameter>.<name>`` for optimizer state)."""
    try:  # the reader dcp.load picks for this checkpoint id (a directory, or an fsspec URL)
        from torch.distributed.checkpoint._storage_utils import _storage_setup
        reader = _storage_setup(None, path, reader=True)
    except ImportError:
        from torch.distributed.checkpoint import FileSystemReader
        reader = FileSystemReader(path)
    return set(reader.read_metadata().state_dict_metadata)


def save_checkpoint(step, path: str | os.PathLike) -> None:
    """Write ``step``'s whole training state to the directory ``path``; call it on every rank.

    Args:
        step: a step made by :func:`autocastfx.train_step` (or a :class:`CudaGraphStep`), at the end of an
            accumulation cycle (mid-cycle is a ValueError, as the cycle's gradients would be lost).
        path: the checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp
    step = getattr(step, "step", step)  # a CudaGraphStep: its eager step holds the state
    done = step.micro % step.accum_steps
    if done:
        raise ValueError(
            f"this step is {done} micro-batches into an accumulation cycle of {step.accum_steps}: their gradients "
            "are not part of a checkpoint, and a resumed run would update without them. Save after the cycle's last "
            "micro-batch (when step.micro % accum_steps == 0); nothing was written")
    dcp.save(_state(step), checkpoint_id=os.fspath(path))


def load_checkpoint(step, path: str | os.PathLike) -> None:
    """Read a :func:`save_checkpoint` checkpoint into ``step``, whatever the number of ranks that wrote it; call it
    on every rank. ``step``'s optimizer must be built as the saved one was; unfinished gradients are dropped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    outer, step = step, getattr(step, "step", step)
    path = os.fspath(path)
    # gradients first: torch sets up missing optimizer state (for DCP to load into) only where none is held
    for p in step.trained_params():
        p.grad = None
    step.parallel.drop_unsynced_grads()
    saved = _saved_keys(path)
    stateful = any(k.startswith("optimizer.state.") for k in saved)
    fresh = not step.optimizer.state
    sd = _state(step, stateful)
    # a parameter the saved optimizer held no state for (no gradient before the save: an unused head) gets none
    state = {name: {k: v for k, v in st.items() if f"optimizer.state.{name}.{k}" in saved}
             for name, st in sd["optimizer"]["state"].items()}
    sd["optimizer"]["state"] = {name: st for name, st in state.items() if st}
    own = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in step.optimizer.param_groups]
    try:
        dcp.load(sd, checkpoint_id=path)
        with own_names(step.gm):
            set_model_state_dict(step.gm, sd["model"], options=StateDictOptions(strict=True))
            # not strict: a parameter without saved state (above) keeps none; every other entry came from the load
            set_optimizer_state_dict(step.gm, step.optimizer, sd["optimizer"], options=StateDictOptions(strict=False))
    except BaseException:
        if fresh:  # the set-up made for the load goes with it
            step.optimizer.state.clear()
        raise
    if not stateful:  # saved before the first update: the optimizer starts afresh, as it did then
        step.optimizer.state.clear()
    elif not step.optimizer.state:
        raise RuntimeError(f"the checkpoint {path!r} holds optimizer state, and none was loaded into "
                           f"{type(step.optimizer).__name__}: load it into a step whose optimizer is built as the "
                           "saved one was (the same type, over the same parameters)")
    for group, keep in zip(step.optimizer.param_groups, own):  # the step's own kernel choice stays
        group.update(keep)
    scaler = dict(sd["scaler"])
    scaler["auto_pending"] = bool(sd["extra"]["auto_pending"])
    step.state.load_state_dict(scaler)
    step.micro = int(sd["extra"]["micro"])
    if outer is not step:  # a CudaGraphStep: its graphs read the tensors that were there before
        outer.reloaded()
