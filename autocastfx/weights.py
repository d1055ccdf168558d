"""Weights: low-precision parameters in the module, float32 masters beside it.

With ``master_weights=True`` a parameter read only by low-precision ops is stored in the module in the low
dtype (the "FP16 model"); its original float32 tensor, unrounded, is the master copy that the training step
updates and copies back. Masters live in ``gm.meta["autocastfx"].masters`` (name -> float32 Parameter): they
are not module parameters, so ``gm.parameters()`` is the low-precision model.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn


def aliases(gm: nn.Module) -> tuple[dict[str, nn.Parameter], dict[int, list[str]]]:
    """(every parameter name -> parameter, id(parameter) -> all its names, first one canonical): tied weights
    appear under several names."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    by_id: dict[int, list[str]] = {}
    for name, p in params.items():
        by_id.setdefault(id(p), []).append(name)
    return params, by_id


def _set(gm: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(gm.get_submodule(owner), attr, value)


def store_low(gm: fx.GraphModule, names: list[str], dtype: torch.dtype) -> dict[str, nn.Parameter]:
    """Replace each named parameter (and every alias of it) by a ``dtype`` copy; return the float32 masters."""
    params, by_id = aliases(gm)
    masters: dict[str, nn.Parameter] = {}
    done: set[int] = set()
    for name in names:
        p = params[name]
        if id(p) in done:
            continue
        done.add(id(p))
        names_of_p = by_id[id(p)]
        low = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        for alias in names_of_p:
            _set(gm, alias, low)
        masters[names_of_p[0]] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    return masters


def master_parameters(gm: nn.Module) -> list[nn.Parameter]:
    """The float32 master copies of the low-precision parameters, in a stable order."""
    return [m for _, m in master_pairs(gm)]


def master_pairs(gm: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(low-precision parameter in the module, float32 master) for every stored-low parameter."""
    info = _info(gm)
    params = dict(gm.named_parameters(remove_duplicate=False))
    return [(params[name], master) for name, master in info.masters.items()]


def restore_masters(gm: fx.GraphModule) -> None:
    """Put the float32 masters back into the module in place of their low-precision copies (in place)."""
    info = _info(gm)
    params, by_id = aliases(gm)
    for name, master in info.masters.items():
        restored = nn.Parameter(master.detach().clone(), requires_grad=master.requires_grad)
        for alias in by_id[id(params[name])]:
            _set(gm, alias, restored)


def _info(gm: nn.Module):
    meta = getattr(gm, "meta", None)
    info = meta.get("autocastfx") if isinstance(meta, dict) else None
    if info is None:
        raise ValueError(f"{type(gm).__name__} is not a module made by autocastfx.convert(); convert it first")
    return info
