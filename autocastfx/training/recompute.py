"""Per-block activation checkpointing and compilation of a converted module's blocks (:mod:`autocastfx.tree.blocks`),
applied block by block as TorchTitan does to a transformer's layers. Checkpointing swaps a block's class for a
subclass whose ``__call__`` runs under the checkpoint; the root's graph is unchanged.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as _checkpoint

from ..tree.blocks import BLOCK_META

__all__ = ["checkpoint_blocks", "compile_blocks", "block_names", "checkpointed", "compiled"]


class _Recomputed:
    """Mixed in before a block's class: its call runs under a non-reentrant checkpoint."""

    def __call__(self, *args, **kwargs):
        call = super().__call__
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)
        if kwargs:
            call = functools.partial(call, **kwargs)
        # whatever the block's own mode: a block in eval mode may still move buffers (a batch norm set back to
        # train() inside it, a counter), and the recompute must not move them twice
        saved = [(b, b._version, b.detach().clone()) for b in self.buffers()]
        before: list = []  # the buffers as the forward read them, of those it changed: kept until backward
        out = _checkpoint.checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True,
                                     context_fn=functools.partial(_contexts, before))
        if saved:  # changed: a new version, or a batch norm's statistics (its kernel moves them with no version bump)
            norms = {id(b) for m in self.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                     for b in m.buffers(recurse=False)}
            before[:] = [(b, v) for b, version, v in saved if b._version != version or id(b) in norms]
        return out


def _contexts(before: list):
    """Checkpoint contexts: the recompute reads the block's buffers as the forward did, and leaves them as the
    forward did, so batch-norm statistics move once a step (torch's own recompute would move them again)."""
    return contextlib.nullcontext(), _buffers_as(before)


@contextlib.contextmanager
def _buffers_as(before: list):
    after = [(b, b.detach().clone()) for b, _ in before]
    with torch.no_grad():
        for b, value in before:
            b.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in after:
                b.copy_(value)


_CLASSES: dict[type, type] = {}  # original class -> its checkpointed subclass (made once per class)


def _is_impl(c: type) -> bool:
    return c.__qualname__.split(".")[-1] == "GraphModuleImpl"


def _base(m: nn.Module) -> type:
    """The class to subclass: for a GraphModule the first MRO class that is not the per-instance
    ``GraphModuleImpl``, which GraphModule's deepcopy also rebuilds over, so copies stay checkpointed."""
    if isinstance(m, fx.GraphModule):
        return next(c for c in type(m).__mro__ if not _is_impl(c))
    return type(m)


def _set_class(m: nn.Module, base: type) -> None:
    if isinstance(m, fx.GraphModule):
        m.__class__ = type("GraphModuleImpl", (base,), {})  # a class of its own, for the forward recompile writes
        m.recompile()
    else:
        m.__class__ = base


def checkpointed(m: nn.Module) -> bool:
    """Whether ``m``'s calls run under :func:`checkpoint_blocks`' checkpoint."""
    return isinstance(m, _Recomputed)


def block_names(gm: nn.Module) -> list[str]:
    """Qualified names of ``gm``'s converted blocks in module order, leaving out any block that holds another
    (recomputing the outer one would hold all its inner activations at once)."""
    found = [(n, m) for n, m in gm.named_modules() if n and isinstance(getattr(m, "meta", None), dict)
             and BLOCK_META in m.meta]
    return [n for n, _ in found if not any(o != n and o.startswith(n + ".") for o, _ in found)]


def _resolve(gm: nn.Module, blocks: Iterable[str] | None, what: str) -> list[tuple[str, nn.Module]]:
    if blocks is None:
        names = block_names(gm)
        if not names:
            raise ValueError(
                f"{what}: {type(gm).__name__} has no converted blocks (submodules with meta['autocastfx_block']). "
                "Convert the model with autocastfx.convert(model, inputs, blocks=\"auto\") (the default; it makes "
                "the repeated children of the model's nn.ModuleLists blocks), or blocks=[names] / "
                "blocks=lambda name, module: ... for blocks elsewhere; blocks=None makes one graph with no blocks")
    else:
        if isinstance(blocks, str):
            blocks = [blocks]
        names = list(blocks)
        have = dict(gm.named_modules())
        missing = [n for n in names if not n or n not in have]
        if missing:
            raise ValueError(f"{what}: {missing} are not submodules of {type(gm).__name__} (its converted blocks: "
                             f"{block_names(gm)[:8]})")
    return [(n, gm.get_submodule(n)) for n in names]


def checkpoint_blocks(gm: nn.Module, blocks: Iterable[str] | None = None, *, enabled: bool = True) -> nn.Module:
    """Checkpoint each converted block of ``gm`` (non-reentrant, RNG state preserved, so results match the plain
    run bit for bit), in place; returns ``gm``. Apply it before ``shard()``/``fully_shard``.

    Args:
        blocks: qualified names of the submodules; default every converted block (:func:`block_names`).
        enabled: False undoes it, restoring the original class.
    """
    if not isinstance(gm, nn.Module):
        raise TypeError(f"checkpoint_blocks() takes a module, got {type(gm).__name__}")
    if not enabled:
        if blocks is None:
            targets = [(n, m) for n, m in gm.named_modules() if checkpointed(m)]
        else:
            targets = _resolve(gm, blocks, "checkpoint_blocks")
        for name, m in targets:
            if checkpointed(m):
                _undo(name, m)
        return gm
    todo = []
    for name, m in _resolve(gm, blocks, "checkpoint_blocks"):  # every check before anything changes
        if m is gm:
            raise ValueError("checkpoint_blocks: the root itself cannot be a block (nothing would be kept)")
        if checkpointed(m):
            continue
        base = _base(m)
        if isinstance(m, fx.GraphModule) and any(_is_impl(c) for c in base.__mro__[1:]):
            # a class FSDP2's fully_shard made over the GraphModule's own: GraphModule's call looks its wrapped call
            # up on the instance's class, so a subclass over this one would call itself
            raise ValueError(f"checkpoint_blocks: {name!r} is a {base.__name__}, a class made over the converted "
                             "block's (fully_shard / shard() makes one): checkpoint the blocks before sharding, as "
                             "TorchTitan applies activation checkpointing before FSDP")
        todo.append((m, base))
    for m, base in todo:
        sub = _CLASSES.get(base)
        if sub is None:
            sub = _CLASSES[base] = type(f"Recomputed{base.__name__}", (_Recomputed, base),
                                        {"__module__": __name__, "_autocastfx_original": base})
        _set_class(m, sub)
    return gm


def _undo(name: str, m: nn.Module) -> None:
    base = _base(m)
    original = base.__dict__.get("_autocastfx_original")
    if original is None:  # another subclass (FSDP2's) was made over the checkpointed class
        raise ValueError(f"checkpoint_blocks(enabled=False): {name!r} is now a {type(m).__name__} (a class made "
                         "over the checkpointed one, by fully_shard or another wrapper); undo checkpointing before "
                         "sharding, or convert the model again")
    _set_class(m, original)


def compile_blocks(gm: nn.Module, blocks: Iterable[str] | None = None, **compile_kwargs: Any) -> nn.Module:
    """``nn.Module.compile(**compile_kwargs)`` on each converted block of ``gm`` (or those named in ``blocks``), in
    place; the root's graph around them stays eager. Returns ``gm``."""
    if not isinstance(gm, nn.Module):
        raise TypeError(f"compile_blocks() takes a module, got {type(gm).__name__}")
    for _, m in _resolve(gm, blocks, "compile_blocks"):
        m.compile(**compile_kwargs)
    return gm


def compiled(m: nn.Module) -> bool:
    """Whether ``m`` was compiled in place (``nn.Module.compile``)."""
    return getattr(m, "_compiled_call_impl", None) is not None

