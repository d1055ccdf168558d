"""Piecewise: a model that does not capture as one graph runs as its own Python around converted parts."""
from __future__ import annotations
import dis
import types

import torch
import torch.nn as nn
from .parts import (BLOCK_META, Conversions, describe_units, float_dtypes, has_gemm, keep_containers, put_module,
                     quiet_run, set_modes, why_not_captured)
from ..base.errors import CaptureError
from ..capture.trace import copy_model
from ..base.meta import ConvertInfo, is_converted, is_plain_setting, names_by_id
from ..base.options import ConvertOptions
from ..capture.context import CaptureContext, free_sizes
from ..core.plan import CastPlan
from ..base.quiet import own_warnings_off, warn_user
from ..converted.module import as_model_class
from ..converted.state import StateGuard, rebind
from .packed import convert_packed, has_recurrent, takes_packed


def convert_piecewise(model: nn.Module, args: tuple, kwargs: dict, conv: Conversions, options: ConvertOptions,
                      ctx: CaptureContext, why: str) -> nn.Module | None:
    """A model with no blocks that does not capture: its children that hold matmuls or convolutions converted,
    the rest its own Python; None when no part of it converts."""
    modes = {id(m): m.training for m in model.modules()}
    tree = copy_model(model, share_tensors=True)
    return piecewise_units(model, tree, {}, {}, args, kwargs, conv, options, ctx, modes, why, need_parts=True)


def piecewise_units(model, tree, units, skipped, args, kwargs, conv: Conversions, options: ConvertOptions,
               ctx: CaptureContext, modes, reason, need_parts: bool = False) -> nn.Module | None:
    """The model's own Python around converted parts: its children that hold matmuls or convolutions and capture
    are converted (float32 at their boundaries), recursing into those that do not; None where ``need_parts`` and
    none converts."""
    eager: dict[str, str] = {"": reason or "the model's forward does not capture as one graph"}
    parts: dict[str, nn.Module] = {}
    candidates = _candidates(tree, "", units)
    inputs: dict[str, tuple] = {}
    hooks = []
    for name in candidates:
        hooks.append(tree.get_submodule(name).register_forward_pre_hook(
            lambda m, a, k, name=name: inputs.setdefault(name, (a, k)) and None, with_kwargs=True))
    try:
        with quiet_run(tree):
            tree(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the model does not run on its example: the capture's error says why
        if need_parts:
            return None
        raise
    finally:
        for h in hooks:
            h.remove()
    todo = [n for n in candidates if n in inputs]
    part_options = options.replace(keep_io_types=True)  # float32 at the boundaries: the Python around is the model's
    part_ctx = ctx.replace(dynamic_sizes=free_sizes(args, kwargs))  # the model's free sizes
    while todo:
        name = todo.pop(0)
        m = tree.get_submodule(name)
        a, k = inputs[name]
        try:
            part, plan, dtypes = _convert_part(m, a, k, conv, part_options, part_ctx)
            rebind(part, model.get_submodule(name))  # converted from the tree's copy of the model's module
        except (CaptureError, ValueError) as e:
            eager[name] = why_not_captured(e)
            inner = _candidates(m, name, units)
            if inner:  # its children, with their inputs from a run of this part
                hooks = [tree.get_submodule(n).register_forward_pre_hook(
                    lambda mm, aa, kk, n=n: inputs.setdefault(n, (aa, kk)) and None, with_kwargs=True)
                    for n in inner]
                try:
                    with quiet_run(m):
                        m(*a, **k)
                finally:
                    for h in hooks:
                        h.remove()
                todo = [n for n in inner if n in inputs] + todo
            continue
        part.meta[BLOCK_META] = {"name": name, "inputs": dtypes, "plan": plan}
        keep_containers(part, m, {n[len(name) + 1:]: u for n, u in units.items() if n.startswith(name + ".")})
        parts[name] = part
        as_model_class(part, m)  # isinstance(part, nn.Linear), as of the module it stands in for
        put_module(tree, name, part)
    for name in list(inputs):
        if name not in parts and name not in eager:
            eager[name] = "not reached"
    if need_parts and not parts:
        return None
    set_modes(tree, model, modes)
    every = {**units, **parts}
    tree.meta = {"autocastfx": ConvertInfo(
        dtype=options.dtype, policy=options.policy,
        capture="piecewise", plan=CastPlan(options.dtype, {}, {}, [], [], (0, 0), (0, 0), {}),
        absorbed=[], source_params=names_by_id(model), options=options,
        extra_totals={"blocks": describe_units(every, skipped), "eager": eager})}
    _guard_model(tree, model, parts)
    if options.keep_io_types:
        tree.register_forward_hook(_outputs_float32)
    lines = [f"{n or type(model).__name__}: {why}" for n, why in eager.items()]
    warn_user(f"autocastfx: {type(model).__name__} is converted piecewise: {len(every)} parts converted "
                  f"({', '.join(list(every)[:4])}{' ...' if len(every) > 4 else ''}); the code around them runs "
                  f"as the model's own Python ({'; '.join(lines[:3])}). report(model) lists every part")
    return tree


def _convert_part(m: nn.Module, a: tuple, k: dict, conv: Conversions, options: ConvertOptions,
                  ctx: CaptureContext) -> tuple[nn.Module, str, list]:
    """(the part, its plan in words, its inputs' dtypes) for one module, its own warnings said once by the piecewise conversion; a recurrent layer called
    with a packed sequence through packed.py."""
    with own_warnings_off():  # the piecewise conversion says what there is to say, once
        if takes_packed(m, a, k, options.policy):
            return convert_packed(m, a, k, conv.whole, options, ctx)
        part = conv.whole(m, a, k, options, ctx)
    return part, f"converted ({part.meta['autocastfx'].capture}), float32 at its boundary", float_dtypes((a, k))


def _guard_model(tree: nn.Module, model: nn.Module, parts: dict) -> None:
    """What a single graph's guard does, for the model's own Python around the parts: at each call, a mode set on
    the model since is set on the tree's module of that name; a tensor or module replaced on the model, or a plain
    setting of a module that runs as the model's Python (a batch norm's momentum) changed, is refused. The parts
    guard their own modules."""
    def outside(name: str) -> bool:
        return not any(name == p or name.startswith(p + ".") for p in parts)
    reads = frozenset((n, k) for n, m in tree.named_modules() if outside(n) and (not n or not is_converted(m))
                      for k, v in vars(m).items() if k[0] != "_" and k != "training" and is_plain_setting(v)
                      and k not in _assigned(type(m)))
    tree.meta["autocastfx"].state = StateGuard(reads).bound(model, names=False)  # its Python reads them live
    tree.register_forward_pre_hook(_check_model)
    tree.train = types.MethodType(train, tree)  # its class is the model's: the mode handed on by the instance


def train(self: nn.Module, mode: bool = True) -> nn.Module:
    """A piecewise conversion's ``train()``: its class's, then the model's modules take the modes (one mode for
    both, as for a single graph: ``StateGuard.share_modes``). Named ``train``: a pickled module loads with its
    class's."""
    type(self).train(self, mode)
    guard = getattr(self.meta.get("autocastfx"), "state", None)
    if guard is not None and guard.root is not None:
        guard.share_modes(self)
    return self


def _assigned(cls: type) -> set[str]:
    """The attributes ``cls.forward`` assigns (``self.calls += 1``): state its Python moves, not a setting."""
    code = getattr(getattr(cls.forward, "__func__", cls.forward), "__code__", None)
    out, todo = set(), [code] if code is not None else []
    while todo:
        c = todo.pop()
        out |= {ins.argval for ins in dis.get_instructions(c) if ins.opname in ("STORE_ATTR", "DELETE_ATTR")}
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return out


def _check_model(module: nn.Module, args: tuple) -> None:
    guard = getattr(module.meta.get("autocastfx"), "state", None)
    if guard is not None and guard.root is not None:  # a copy (an EMA) watches nothing
        guard.check(module)


def _outputs_float32(module, args, out):
    return torch.utils._pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t, out)


def _candidates(root: nn.Module, prefix: str, units: dict) -> list[str]:
    """The children of ``root`` worth converting on their own (they hold matmuls, convolutions or recurrent layers
    and are not converted yet), by qualified name in the tree."""
    out = []
    for key, c in root.named_children():
        name = f"{prefix}.{key}" if prefix else key
        if name in units or is_converted(c):
            continue
        if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
            out += _candidates(c, name, units)
        elif has_gemm(c) or has_recurrent(c):
            out.append(name)
    return out
