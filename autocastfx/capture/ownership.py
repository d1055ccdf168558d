"""TODO"""
from __future__ import annotations
import copy
import itertools
from typing import Any
import torch
import torch.nn as nn
from ..base.meta import is_converted


def own_tensors(gm: nn.Module, model: nn.Module, skip: set[int] = frozenset()) -> int:
    """Give ``gm`` copies of every parameter, buffer and tensor attribute it still shares with ``model`` (by
    object or by storage), copied together as ``copy.deepcopy`` would have: tied tensors stay tied, views stay
    views of one new storage, parameters keep their class and attributes. Returns how many were copied.
    Converted blocks inside ``gm`` own their tensors already and are left alone, as are the ids in ``skip``."""
    inner = [m for name, m in gm.named_modules() if name and is_converted(m)]
    skip = set(skip) | {id(t) for m in inner for t in itertools.chain(m.parameters(), m.buffers())}
    units = {id(s) for m in inner for s in m.modules()}
    theirs = {id(t) for t in itertools.chain(model.parameters(), model.buffers())} - skip
    storages = {_storage(t) for t in itertools.chain(model.parameters(), model.buffers()) if id(t) not in skip} - {None}
    found: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for mod in gm.modules():
        if id(mod) in units:
            continue
        places = [("_parameters", mod._parameters), ("_buffers", mod._buffers),
                  ("", {k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)})]
        for kind, entries in places:
            for name, t in entries.items():
                if t is not None and (id(t) in theirs or _storage(t) in storages):
                    found.append((mod, kind, name, t))
    copies = _copy_tensors([t for *_, t in found])
    for (mod, kind, name, _), c in zip(found, copies):
        if kind:
            getattr(mod, kind)[name] = c
        else:
            object.__setattr__(mod, name, c)
    return len(found)


def _copy_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies as one ``copy.deepcopy`` of the list would make them (a tensor met twice is copied once, tensors
    that share a storage get one new storage), with a plain clone where a tensor is alone on its storage and
    carries no attributes: deepcopy costs tens of microseconds per plain tensor, and a convolutional network's
    batch norms have thousands of them."""
    by_storage: dict[int | None, set[int]] = {}
    for t in tensors:
        by_storage.setdefault(_storage(t), set()).add(id(t))
    memo: dict[int, Any] = {}
    out = []
    for t in tensors:
        if id(t) not in memo:
            alone = _storage(t) is not None and len(by_storage[_storage(t)]) == 1 and not vars(t)
            if alone and isinstance(t, nn.Parameter):
                memo[id(t)] = type(t)(t.data.clone(memory_format=torch.preserve_format), t.requires_grad)
            elif alone and type(t) is torch.Tensor:
                memo[id(t)] = t.clone(memory_format=torch.preserve_format)
            else:
                memo[id(t)] = copy.deepcopy(t, memo)
        out.append(memo[id(t)])
    return out


def _storage(t: torch.Tensor) -> int | None:
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()
