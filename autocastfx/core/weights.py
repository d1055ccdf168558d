"""Weights: a converted module holds the float32 model's own parameters and buffers, and its graph casts each weight
a low op reads once per forward, so gradients arrive in float32. Also here: tied-weight names, making a meta
conversion real, and sharing tensors between conversions.
"""
from __future__ import annotations

import contextlib


import torch
import torch.fx as fx
import torch.nn as nn
from ..base import keys as K
from ..base.meta import info_of, is_converted, require_info


def aliases(gm: nn.Module) -> tuple[dict[str, nn.Parameter], dict[int, list[str]]]:
    """(every parameter name -> parameter, id(parameter) -> all its names, the first canonical)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    by_id: dict[int, list[str]] = {}
    for name, p in params.items():
        by_id.setdefault(id(p), []).append(name)
    return params, by_id


def _set(gm: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(gm.get_submodule(owner), attr, value)


def retie(gm: nn.Module, groups: list[list[str]]) -> None:
    """Each group of names made one parameter again, the first name's."""
    for names in groups:
        first = gm.get_parameter(names[0])
        for alias in names[1:]:
            if gm.get_parameter(alias) is not first:
                _set(gm, alias, first)


def cast_low_parameters(gm: nn.Module) -> list[nn.Parameter]:
    """The float32 master weights: parameters of ``gm`` and its converted units that the graphs read only through
    a cast to the low dtype (linear, convolution and matmul weights), each once, in a stable order."""
    _require(gm)
    out, seen = [], set()
    for _, unit in converted_units(gm):
        for name in low_read_names(unit):
            p = unit.get_parameter(name)
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def low_read_names(unit: nn.Module) -> list[str]:
    """The names of ``unit``'s own parameters that every graph of it reads only through a cast to its low dtype."""
    info = info_of(unit)
    graph = getattr(unit, "graph", None)
    if info is None or graph is None:
        return []
    graphs = _graphs_of(unit)
    params = dict(unit.named_parameters(remove_duplicate=False))
    verdict: dict[str, bool] = {}
    for g in graphs:
        for node in g.nodes:
            if node.op != "get_attr" or str(node.target) not in params:
                continue
            users = [u for u in node.users if u.target not in _CHECKS]
            low = bool(users) and all(_reaches_low_cast(u, info.dtype) for u in users)
            verdict[str(node.target)] = verdict.get(str(node.target), True) and low
    return [n for n, low in verdict.items() if low and info.dtype != torch.float32]


_SHAPE_ONLY = {"pad", "t", "transpose", "permute", "view", "reshape", "contiguous", "flatten", "unsqueeze", "squeeze",
               "constant_pad_nd", "_unsafe_view", "clone"}
# the graph's casts as torch.export writes them, in a program loaded from a file (no node annotations there)
_ATEN_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout}
_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}  # export's dtype assertions: read nothing


def _reaches_low_cast(node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``node`` is a cast to ``dtype`` (a cast node of the plan, or an aten cast of a loaded program), or
    an op that only moves or pads values (``F.pad`` of a padded weight, ``w.t()``) whose every reader is one."""
    decision = node.meta.get("autocastfx")
    if getattr(decision, "kind", None) == "cast":
        return getattr(decision, "dtype", None) == dtype
    if node.op == "call_function" and node.target in _ATEN_CASTS:
        to = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        return to == dtype
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "_opname", None) or getattr(target, "__name__", "")
    users = [u for u in node.users if u.target not in _CHECKS]
    return (name in _SHAPE_ONLY and bool(users) and node.op in ("call_method", "call_function")
            and all(_reaches_low_cast(u, dtype) for u in users))


def _graphs_of(unit: nn.Module) -> list:
    programs = getattr(unit, "meta", {}).get(K.PROGRAMS)
    if programs is not None:
        return list(programs.graphs.values())
    return [unit.graph]


def converted_units(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name prefix, module) for the converted units inside ``gm`` (each planned apart), innermost first, then
    ``("", gm)`` where ``gm`` is converted itself."""
    out = [(name + ".", m) for name, m in gm.named_modules() if name and is_converted(m)]
    out.reverse()  # named_modules() is pre-order: reversed, a block comes before any block that holds it
    return out + ([("", gm)] if is_converted(gm) else [])


def model_order(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm``'s modules, parameters and buffers the model's order (``fx.GraphModule`` orders them as the graph
    uses them), so what pairs them by position with the model's (an optimizer's state dict, an EMA) still works."""
    mine = dict(gm.named_modules(remove_duplicate=False))
    for path, theirs in model.named_modules(remove_duplicate=False):
        m = mine.get(path)
        if m is None or m is theirs:
            continue
        for table in ("_modules", "_parameters", "_buffers"):
            own, ref = m.__dict__[table], theirs.__dict__[table]
            order = [k for k in ref if k in own] + [k for k in own if k not in ref]
            if order != list(own):
                items = [(k, own[k]) for k in order]
                own.clear()
                own.update(items)


# A traced graph reads a tied weight under one name; converted.module._Switchable's state-dict hooks call
# model_names_into_state_dict and model_names_from_state_dict so its state dict has the model's keys.

_OWN_NAMES = "_autocastfx_own_names"


@contextlib.contextmanager
def own_names(gm: nn.Module):
    """Meanwhile ``gm.state_dict()`` names only the tensors ``gm`` holds: torch.distributed.checkpoint's
    ``get_state_dict`` looks every name up as an attribute, and a tied weight's second name (a head tied to the
    embedding) is not one of ``gm``'s."""
    units = [m for m in gm.modules() if info_of(m) is not None]
    for m in units:
        m.__dict__[_OWN_NAMES] = True
    try:
        yield
    finally:
        for m in units:
            m.__dict__.pop(_OWN_NAMES, None)


def model_names_into_state_dict(unit: nn.Module, out: dict, prefix: str, start: int = 0) -> None:
    """Add to ``out`` every name the model had for a tied weight that the converted module keeps fewer names for
    (not inside :func:`own_names`), and put the unit's entries (from position ``start``) in the model's order, so
    what pairs two state dicts by position (an EMA) pairs them right."""
    info = info_of(unit)
    if info is None or unit.__dict__.get(_OWN_NAMES):
        return
    added = False
    for names in info.source_params.values():
        if len(names) < 2:
            continue
        have = next((n for n in names if prefix + n in out), None)
        if have is not None:
            for n in names:
                added |= prefix + n not in out
                out.setdefault(prefix + n, out[prefix + have])
    if added and info.state_keys:
        mine = list(out)[start:]
        wanted = [prefix + k for k in info.state_keys if prefix + k in out]
        known = set(wanted)
        order = wanted + [k for k in mine if k not in known]
        if order != mine and set(order) == set(mine):
            items = [(k, out.pop(k)) for k in mine]
            values = dict(items)
            out.update((k, values[k]) for k in order)


def model_names_from_state_dict(unit: nn.Module, state_dict: dict, prefix: str, assign: bool = False) -> list[str]:
    """Drop the tied-weight names the converted module does not have, keeping the value the model's own load would
    (the last of its names ``state_dict`` holds). Returns the tied-weight names ``state_dict`` lacks, which the
    model's own load reports missing (safetensors' ``load_model`` relies on it). With ``assign``, where the model's
    own load would untie them, different values under tied names are a ValueError."""
    info = info_of(unit)
    missing: list[str] = []
    if info is None or unit.__dict__.get(_OWN_NAMES):  # within own_names(): the names are gm's own
        return missing
    own = None
    for names in info.source_params.values():
        if len(names) < 2:
            continue
        if own is None:
            own = {n for n, _ in unit.named_parameters(remove_duplicate=False)}
        kept = [n for n in names if n in own]
        if not kept:
            continue
        absent = [n for n in names if prefix + n not in state_dict]
        given = next((prefix + n for n in reversed(names) if prefix + n in state_dict), None)
        if assign:
            _refuse_untied(names, [state_dict[prefix + n] for n in names if prefix + n in state_dict])
        for n in kept:
            if given is not None:
                state_dict[prefix + n] = state_dict[given]
        for n in names:
            if n not in own:
                state_dict.pop(prefix + n, None)
        # as the model would: each name absent is missing (a kept one with no value at all, torch says itself)
        missing.extend(prefix + n for n in absent if given is not None or n not in own)
    return missing


def _refuse_untied(names, values: list) -> None:
    """ValueError where ``values`` (a checkpoint's, under tied names) differ: ``load_state_dict(..., assign=True)``
    would untie the model's weights, and the converted graph reads them as one."""
    real = [v for v in values if isinstance(v, torch.Tensor) and not v.is_meta]
    if all(v.shape == real[0].shape and torch.equal(v.to(real[0].dtype), real[0]) for v in real[1:]):
        return
    raise ValueError(
        f"the state dict holds different values for {', '.join(sorted(names))}, weights tied in the model, which the "
        "converted graph reads as one: load_state_dict(..., assign=True) would untie them in the model and here "
        "could not. Untie them in the model (give the head its own nn.Parameter), load the checkpoint there and "
        "convert again; or load without assign=True, which copies into the tied weight as the model's own load does")


def _require(gm: nn.Module):
    return require_info(gm, ValueError)


def materialize(gm: nn.Module, device, state_dict: dict | None = None, *, buffers=None, strict: bool = True
                ) -> nn.Module:
    """Make a module converted on the meta device real on ``device``, in place, keeping buffers already real;
    returns ``gm``.

    Args:
        state_dict: the parameters' values (float32 or low, upcast); without it, initialise them afterwards.
        buffers: a module or name -> tensor for the buffers no checkpoint holds (rotary tables).

    Raises:
        ValueError: naming every buffer left without a value.
    """
    _require(gm)
    kept = {n: b.detach().clone() for n, b in gm.named_buffers(remove_duplicate=False) if not b.is_meta}
    gm.to_empty(device=device)
    given = dict(buffers.named_buffers(remove_duplicate=False)) if isinstance(buffers, nn.Module) \
        else dict(buffers or {})
    own = dict(gm.named_buffers(remove_duplicate=False))
    unknown = sorted(set(given) - set(own))
    if unknown:
        raise ValueError(f"buffers names {unknown[:5]}, which the converted module does not have (its buffers: "
                         f"{sorted(own)[:8]})")
    with torch.no_grad():
        for name, value in {**kept, **given}.items():
            own[name].copy_(value)
    persistent = set()
    if state_dict is not None:
        gm.load_state_dict(state_dict, strict=strict)
        persistent = {n for n in own if n in state_dict}
    missing = sorted(n for n in own if n not in kept and n not in given and n not in persistent
                     and (state_dict is None or not _is_persistent(gm, n)))
    if missing:
        raise ValueError(f"buffers {missing[:8]} have no values after materialising: they were on the meta device "
                         "and no state dict holds them (non-persistent buffers such as rotary tables). Pass them: "
                         "autocastfx.materialize(gm, device, state_dict, buffers=...) with a module or dict that "
                         "has them (e.g. the model built with its buffers real: accelerate's "
                         "init_empty_weights(include_buffers=False))")
    return gm


def _is_persistent(gm: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr not in gm.get_submodule(owner)._non_persistent_buffers_set


# A module converted again for a call of another structure (converted.calls.other_call) runs on the first
# conversion's Parameter objects and buffers.

def tensor_holders(other: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for every module of ``other`` that holds parameters or buffers."""
    return [(name, m) for name, m in other.named_modules(remove_duplicate=False) if m._parameters or m._buffers]


def pair_modules(main: nn.Module, other: nn.Module, mains: dict[str, nn.Module] | None = None,
                 holders: list[tuple[str, nn.Module]] | None = None) -> list[tuple[nn.Module, nn.Module]]:
    """(module of ``other``, module of ``main`` at the same name) for each tensor-holding module of ``other``, for
    :func:`share_tensors`; ValueError names the first that ``main`` lacks."""
    mains = dict(main.named_modules(remove_duplicate=False)) if mains is None else mains
    pairs = []
    for name, m in tensor_holders(other) if holders is None else holders:
        mine = mains[name] if name in mains else _tied_stand(main, name, m)
        if mine is None:
            raise ValueError(f"the conversion for this call has a module {name!r} that the first conversion "
                             "does not have")
        pairs.append((m, mine))
    return pairs


def _tied_stand(main: nn.Module, name: str, m: nn.Module) -> nn.Module | None:
    """A module holding ``main``'s parameters under the model's names ``name.<leaf>`` of ``m``'s, where ``main`` has
    no module ``name`` as it reads them elsewhere (a head tied to the embedding); None where one is missing."""
    info = main.meta.get("autocastfx") if isinstance(getattr(main, "meta", None), dict) else None
    own = dict(main.named_parameters(remove_duplicate=False))  # by name: a copy of ``main`` has other tensors
    by_name = {}
    for names in getattr(info, "source_params", {}).values():
        kept = next((n for n in names if n in own), None)
        if kept is not None:
            by_name.update((n, own[kept]) for n in names)
    if any(b is not None for b in m._buffers.values()):
        return None
    stand = nn.Module()
    for leaf, t in m._parameters.items():
        if t is not None:
            if f"{name}.{leaf}" not in by_name:
                return None
            stand._parameters[leaf] = by_name[f"{name}.{leaf}"]
    return stand


def share_tensors(main: nn.Module, other: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Make ``other``'s parameters and buffers ``main``'s own (where they are not already); ValueError where one
    has no counterpart of the same shape and dtype."""
    for o, m in pairs:
        for kind in ("_parameters", "_buffers"):
            mine, theirs = getattr(o, kind), getattr(m, kind)
            for leaf, t in mine.items():
                want = theirs.get(leaf)
                if want is t or t is None:
                    continue
                if want is None or want.shape != t.shape or want.dtype != t.dtype:
                    raise ValueError(
                        f"{kind[1:-1]} {leaf!r} of {type(o).__name__} is {_desc(t)} in the conversion for this "
                        f"call and {_desc(want)} in the first")
                mine[leaf] = want


def _desc(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
