"""Weights: low-precision parameters in the module, float32 masters beside it.

With ``master_weights=True`` a parameter read only by low-precision ops is stored in the module in the low
dtype (the "FP16 model"); its original float32 tensor, unrounded, is the master copy that the training step
updates and copies back. Masters live in ``gm.meta["autocastfx"].masters`` (name -> float32 Parameter): they
are not module parameters, so ``gm.parameters()`` is the low-precision model.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
from ..base.meta import info_of, is_converted, require_info


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


def retie(gm: nn.Module, groups: list[list[str]]) -> None:
    """Each group of names made one parameter again, the first name's."""
    for names in groups:
        first = gm.get_parameter(names[0])
        for alias in names[1:]:
            if gm.get_parameter(alias) is not first:
                _set(gm, alias, first)


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
    """The float32 master copies of the low-precision parameters, in a stable order: those of ``gm`` and of
    every converted block or piecewise part inside it."""
    return [m for _, m in master_pairs(gm)]


def master_pairs(gm: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(low-precision parameter in the module, float32 master) for every stored-low parameter of ``gm`` and of
    the converted units inside it."""
    _require(gm)
    return [(low, master) for _, low, master in named_master_pairs(gm)]


def named_master_pairs(gm: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(qualified name, low-precision parameter, float32 master) over ``gm`` and its converted units."""
    out = []
    for prefix, unit in converted_units(gm):
        params = dict(unit.named_parameters(remove_duplicate=False))
        out += [(prefix + name, params[name], m) for name, m in unit.meta["autocastfx"].masters.items()]
    return out


def converted_units(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name prefix, module) for the converted units inside ``gm`` (submodules with ``meta["autocastfx"]`` of
    their own, each planned and holding its masters apart), innermost first, then ``("", gm)`` where ``gm`` is
    converted itself."""
    out = [(name + ".", m) for name, m in gm.named_modules() if name and is_converted(m)]
    out.reverse()  # named_modules() is pre-order: reversed, a block comes before any block that holds it
    return out + ([("", gm)] if is_converted(gm) else [])


def all_masters(gm: nn.Module) -> dict[str, nn.Parameter]:
    """Qualified name -> float32 master, over ``gm`` and its converted units."""
    return {prefix + n: m for prefix, unit in converted_units(gm) for n, m in unit.meta["autocastfx"].masters.items()}


def float32_state_dict(gm: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own state-dict keys with float32 values: every stored-low weight (of ``gm`` and its converted
    blocks) as its master, unrounded; buffers and float32 parameters as they are. Loads into the unconverted model
    (``load_state_dict``, a Hugging Face model's ``from_pretrained`` state) and into a converted one. Tensors are
    shared with ``gm``, not copied: clone them to keep a snapshot while training goes on."""
    _require(gm)
    return dict(gm.state_dict())


# -------------------------------------------------------------------------------------- state-dict semantics
# A converted module's ``state_dict()`` is the float32 model's: under each stored-low weight's names, its master.
# ``load_state_dict()`` takes such a dict (float32, or bfloat16/float16 values as low-precision checkpoints hold
# them): the masters are filled from it, upcast where the checkpoint is low, and the low copies are made from the
# masters. The two hooks below run in the converted module class's ``state_dict``/``_load_from_state_dict``
# (modes._Switchable), once per converted unit, over the keys under that unit's prefix.

def masters_into_state_dict(unit: nn.Module, out: dict, prefix: str, keep_vars: bool) -> None:
    """Put ``unit``'s masters in ``out`` in place of their low copies, under every name of each weight."""
    info = info_of(unit)
    if info is None or not info.masters:
        return
    params, by_id = aliases(unit)
    for name, master in info.masters.items():
        value = master if keep_vars else master.detach()
        for alias in by_id.get(id(params.get(name)), [name]):
            if prefix + alias in out:
                out[prefix + alias] = value


def model_names_into_state_dict(unit: nn.Module, out: dict, prefix: str) -> None:
    """Every name the model had for a tied weight, where the converted module keeps fewer (a traced graph reads
    a tied weight under one name): the state dict has the model's own keys."""
    info = info_of(unit)
    if info is None:
        return
    for names in info.source_params.values():
        if len(names) < 2:
            continue
        have = next((n for n in names if prefix + n in out), None)
        if have is not None:
            for n in names:
                out.setdefault(prefix + n, out[prefix + have])


def model_names_from_state_dict(unit: nn.Module, state_dict: dict, prefix: str) -> None:
    """The other side of :func:`model_names_into_state_dict`: a tied weight's names the converted module does not
    have are dropped (their value taken where the name it keeps is missing, as in a checkpoint that stores a tied
    weight once)."""
    info = info_of(unit)
    if info is None:
        return
    own = None
    for names in info.source_params.values():
        if len(names) < 2:
            continue
        if own is None:
            own = {n for n, _ in unit.named_parameters(remove_duplicate=False)}
        kept = [n for n in names if n in own]
        if not kept:
            continue
        given = next((prefix + n for n in names if prefix + n in state_dict), None)
        for n in kept:
            if prefix + n not in state_dict and given is not None:
                state_dict[prefix + n] = state_dict[given]
        for n in names:
            if n not in own:
                state_dict.pop(prefix + n, None)


def masters_from_state_dict(unit: nn.Module, state_dict: dict, prefix: str, assign: bool) -> None:
    """Fill ``unit``'s masters from the entries of ``state_dict`` under their names (and aliases); the module's
    own loading then copies the same values into the low copies (rounded as ``master.to(low)`` rounds them, one
    tensor at a time). With ``assign=True`` the float32 values become the masters and the entries are replaced by
    their low copies, which loading then takes as they are. A master on the meta device (a module converted on
    meta, not yet materialised) takes the value only with ``assign=True``, as torch's own loading does."""
    info = info_of(unit)
    if info is None or not info.masters:
        return
    params, by_id = aliases(unit)
    for name, master in info.masters.items():
        low_param = params.get(name)
        names = by_id.get(id(low_param), [name]) if low_param is not None else [name]
        key = next((prefix + n for n in names if prefix + n in state_dict), None)
        if key is None:
            continue  # torch's loading reports the missing key
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != master.shape:
            continue  # torch's loading reports the mismatch on the low copy
        with torch.no_grad():
            if not assign:  # the low copy is made by the module's own loading: copy_ rounds as .to() does
                if not master.is_meta:
                    master.copy_(value.detach())
                continue
            new = value.detach()
            new = new if new.dtype == torch.float32 else new.to(torch.float32)
            _replace_data(master, new)
            low = _low_like(low_param, master)
        for n in names:
            if prefix + n in state_dict:
                state_dict[prefix + n] = low


def _low_like(low_param: torch.Tensor | None, master: torch.Tensor) -> torch.Tensor:
    """``master`` rounded to ``low_param``'s dtype, in its memory format (channels_last weights stay so)."""
    if low_param is None:
        return master
    out = master.to(low_param.dtype)
    if out.dim() == 4 and not low_param.is_meta and low_param.is_contiguous(memory_format=torch.channels_last) \
            and not low_param.is_contiguous():
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def _replace_data(master: nn.Parameter, new: torch.Tensor) -> None:
    """``master`` holds ``new`` from now on, the same Parameter object (an optimizer built over it keeps it)."""
    if torch._has_compatible_shallow_copy_type(master, new):
        master.data = new
    else:
        torch.utils.swap_tensors(master, nn.Parameter(new, requires_grad=master.requires_grad))


def apply_to_masters(unit: nn.Module, fn) -> None:
    """``nn.Module._apply``'s ``fn`` (``.to(device)``, ``.cuda()``, ``to_empty``) over ``unit``'s masters too, which
    are not module parameters: they follow the module to its device. A dtype change (``.half()``, ``.float()``) is
    the module's alone: masters stay float32."""
    info = info_of(unit)
    if info is None:
        return
    for master in info.masters.values():
        with torch.no_grad():
            new = fn(master)
            if new.dtype != torch.float32:
                new = master.to(device=new.device) if not master.is_meta else torch.empty_like(
                    master, device=new.device)
            if new is not master:
                _replace_data(master, new)
            if master.grad is not None:
                g = fn(master.grad)
                master.grad = g if g.dtype == torch.float32 else master.grad.to(device=g.device)


@contextlib.contextmanager
def float32_weights(gm: nn.Module):
    """Within the block, every stored-low weight of ``gm`` (and of its converted blocks) is its float32 master,
    as the unconverted model had it: an initialisation run there over ``gm.named_parameters()`` (by name, as
    TorchTitan's and GPT-2's are written; the converted module's submodules are not the model's classes, so an
    initialisation by module type does not apply) writes the masters, unrounded; on leaving, the low copies are
    made again from them. This is how a module converted on the meta device is initialised after ``gm.to_empty(...)`` when
    no checkpoint is loaded."""
    _require(gm)
    swapped = []
    for _, unit in converted_units(gm):
        params, by_id = aliases(unit)
        for name, master in unit.meta["autocastfx"].masters.items():
            low = params[name]
            for alias in by_id[id(low)]:
                _set(unit, alias, master)
            swapped.append((unit, by_id[id(low)], low, master))
    try:
        yield gm
    finally:
        with torch.no_grad():
            for unit, names, low, master in swapped:
                if low.shape == master.shape:
                    low.copy_(master)
                for alias in names:
                    _set(unit, alias, low)


def restore_masters(gm: fx.GraphModule) -> None:
    """Put the float32 masters back into the module in place of their low-precision copies (in place)."""
    info = _require(gm)
    params, by_id = aliases(gm)
    for name, master in info.masters.items():
        restored = nn.Parameter(master.detach().clone(), requires_grad=master.requires_grad)
        for alias in by_id[id(params[name])]:
            _set(gm, alias, restored)


def _require(gm: nn.Module):
    return require_info(gm, ValueError)


def materialize(gm: nn.Module, device, state_dict: dict | None = None, *, buffers=None, strict: bool = True
                ) -> nn.Module:
    """A module converted on the meta device, made real on ``device`` (in place; returns ``gm``).

    ``gm.to_empty(device=device)`` (parameters, masters and buffers allocated, uninitialised), keeping the values
    of buffers that were real already (``init_empty_weights(include_buffers=False)`` builds such models); then
    ``buffers`` (a module or a dict: name -> tensor, e.g. a model's rotary tables, which no checkpoint holds)
    fills the buffers it names; then ``gm.load_state_dict(state_dict, strict=strict)`` fills the masters (float32
    or low-precision values, upcast) and makes the low copies. Raises ValueError naming every buffer left without
    a value (a non-persistent buffer that neither was real nor is in ``buffers``): running with it would compute
    garbage. Without ``state_dict``, initialise the weights inside :func:`float32_weights`."""
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


# ------------------------------------------------------------- one set of tensors for two conversions of a model
# A converted module converted again for a call of another structure (core.calls.other_call) runs on the first's
# tensors: the same Parameter objects (so the step's updates reach both), buffers and masters.

def pair_modules(main: nn.Module, other: nn.Module) -> tuple[list, list]:
    """What :func:`share_tensors` re-points: (module of ``other``, module of ``main`` at the same name) for every
    module of ``other`` that holds tensors, and (masters of a unit of ``other``, name there, masters of ``main``'s
    unit, name there) for every master of ``other``, matched by qualified name (a unit of one capture may list
    the masters of the blocks inside it); ValueError naming the first that ``main`` lacks."""
    mains = dict(main.named_modules(remove_duplicate=False))
    pairs = []
    for name, m in other.named_modules(remove_duplicate=False):
        if not (m._parameters or m._buffers):
            continue
        if name not in mains:
            raise ValueError(f"the conversion for this call has a module {name!r} that the first conversion "
                             "does not have")
        pairs.append((m, mains[name]))
    firsts = {prefix + n: (unit.meta["autocastfx"].masters, n) for prefix, unit in converted_units(main)
              for n in unit.meta["autocastfx"].masters}
    masters = []
    for prefix, unit in converted_units(other):
        ours = unit.meta["autocastfx"].masters
        for n in ours:
            if prefix + n not in firsts:
                raise ValueError(f"the conversion for this call keeps a float32 master of {prefix + n!r}, which "
                                 "the first stores float32 itself: the two plans store it differently")
            masters.append((ours, n, *firsts[prefix + n]))
    return pairs, masters


def share_tensors(main: nn.Module, other: nn.Module, paired: tuple[list, list]) -> None:
    """Make ``other``'s parameters, buffers and masters ``main``'s own (where they are not already); ValueError
    where one has no counterpart of the same shape and dtype (its plan stores a weight otherwise)."""
    pairs, masters = paired
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
                        f"call and {_desc(want)} in the first: the two plans store it differently")
                mine[leaf] = want
    for ours, n, firsts, first_name in masters:
        if ours[n] is not firsts[first_name]:
            ours[n] = firsts[first_name]


def _desc(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
