"""The vocabulary every layer shares: what a value is (TensorInfo), what a converted module carries (ConvertInfo)
and how to tell one. Imports nothing of autocastfx outside ``base``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import keys as K
from .options import ConvertOptions


WATCHED_CLASS = "_autocastfx_watched_class"  # on the subclass a watched module has meanwhile: its own class


_RAISE = object()

# a module's hook tables that run at its call (nn.Module's own attribute names)
HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def fetch(module: Any, target: str, missing: Any = _RAISE) -> Any:
    """The attribute a ``get_attr`` node's dotted ``target`` names in ``module``; ``missing`` where absent, or an
    AttributeError when no ``missing`` is given."""
    obj = module
    for part in str(target).split("."):
        obj = getattr(obj, part, _RAISE)
        if obj is _RAISE:
            if missing is _RAISE:
                raise AttributeError(f"the graph reads {target!r}, which the module does not have")
            return missing
    return obj


def is_plain_setting(v: Any) -> bool:
    """Whether ``v`` is a number, string, flag, None, dtype or device, or a tuple or list of them."""
    if isinstance(v, (tuple, list)):
        return all(is_plain_setting(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device))


def original_class(module: Any) -> type:
    """The module's own class, also while capture.watch has swapped in a watching subclass."""
    return type(module).__dict__.get(WATCHED_CLASS, type(module))


def is_converted(m: Any) -> bool:
    """Whether ``m`` is a module made by ``convert()`` (a whole model, a block or a piecewise part)."""
    meta = getattr(m, "meta", None)
    return isinstance(meta, dict) and meta.get(K.CONVERTED) is not None


def info_of(m: Any) -> ConvertInfo | None:
    """``m.meta["autocastfx"]``, or None for anything autocastfx did not convert."""
    meta = getattr(m, "meta", None)
    return meta.get(K.CONVERTED) if isinstance(meta, dict) else None


def require_info(m: Any, error: type[Exception] = TypeError, fix: str = "convert it first") -> ConvertInfo:
    """``m``'s ConvertInfo; ``error`` naming the module and ``fix`` when ``m`` is not a converted module."""
    info = info_of(m)
    if info is None:
        raise error(f"expected a module made by autocastfx.convert(), got {type(m).__name__}: {fix}")
    return info


def refuse_piecewise(info: ConvertInfo, what: str) -> None:
    """Raise ValueError if ``info`` is of a module converted piecewise, which has no graph of its own to rewrite."""
    if info.capture == "piecewise":
        raise ValueError(f"{what} rewrites one converted graph, and this module was converted piecewise: the "
                         "model's own Python around converted parts, with no graph of its own. Apply it to a "
                         "converted part (gm.get_submodule(name); the names are in autocastfx.report(gm)), or to a "
                         "module converted as one graph")


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str = "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_info(v: Any) -> Any:
    """The TensorInfo of a tensor (a tuple of them for a sequence holding tensors), else None."""
    if isinstance(v, torch.Tensor):
        return TensorInfo(v.dtype, tuple(int(s) for s in v.shape), v.device.type)
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        return tuple(tensor_info(x) for x in v)
    return None


class ReadsThrough(nn.Module):
    """A module standing in for its ``block`` submodule, through which the model's code reads the block's
    attributes (Hugging Face Swin's ``layer.downsample is not None``)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


class _First:
    """Marks, in a block's result template, the place of the block's first input."""

    def __repr__(self):
        return "<the block's first input>"


FIRST = _First()


@dataclasses.dataclass
class ConvertInfo:
    """What ``gm.meta["autocastfx"]`` holds for a converted module."""
    dtype: torch.dtype
    policy: Any                          # autocastfx.core.policy.Policy
    capture: str
    plan: Any                            # autocastfx.core.plan.CastPlan (None for a piecewise tree)
    absorbed: list[str]
    options: ConvertOptions
    extra_totals: dict[str, Any] = dataclasses.field(default_factory=dict)
    # id(parameter) of the model convert() was given -> all its names (a tied weight has several)
    source_params: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False)
    # the model's state-dict keys in its order (the whole model's conversion only): gm.state_dict() keeps it
    state_keys: tuple = dataclasses.field(default=(), repr=False)
    # the model's class and plain attributes (a config, sizes), to answer its own methods
    # (converted.module.add_model_surface)
    model_class: type | None = dataclasses.field(default=None, repr=False)
    model_attrs: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    # the inputs of the captured call (calls.describe): a call of another shape is refused with both named
    call_signature: tuple = ()
    # (flat input index, dims) free to vary, marked maybe-dynamic so torch.compile does not recompile for a new
    # batch size (calls.free_dims)
    free_dims: tuple = ()
    # the model on the meta device: a failing call is rerun on it so the model's own checks raise their own message
    checks: Any = dataclasses.field(default=None, repr=False)  # converted.calls.ModelChecks
    # (converted module, args, kwargs, state) -> the model converted for a call of another structure, tensors shared
    # (converted.calls)
    convert_call: Any = dataclasses.field(default=None, repr=False)
    # guards the plain attributes the model's code read while captured: a change is refused at the next call
    # (converted.state.StateGuard)
    state: Any = dataclasses.field(default=None, repr=False)
    # id() of the model's tensors convert() upcast in place from float16/bfloat16 (an optimizer that stepped them
    # before holds state in the old dtype: training.step's check)
    upcast: frozenset = dataclasses.field(default=frozenset(), repr=False)
    # {mode: {module name: flag}}: what the model's own train()/eval() sets (frozen batch norms), where it has one
    mode_flags: dict | None = dataclasses.field(default=None, repr=False)


def names_by_id(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every name it has in ``model``, in order (a tied weight has several)."""
    names: dict[int, tuple[str, ...]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), ()) + (n,)
    return names


def module_path(node: fx.Node) -> str | None:
    """Qualified name of the innermost module a node came from: a leaf module's call is its module's."""
    if node.op == "call_module":
        return str(node.target)
    return issuer_path(node)


def issuer_path(node: fx.Node) -> str | None:
    """Qualified name of the module whose code issued ``node`` (``""``: the root), from ``nn_module_stack``, or
    None."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return path.removeprefix("L['self'].").replace("L__self___", "") if isinstance(path, str) else None
    return None


def example_inputs_of(gm: fx.GraphModule) -> tuple[tuple, dict]:
    """(args, kwargs) of zeros shaped like the example inputs convert() saw."""
    flat = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        info = n.meta.get(K.INFO)
        if not isinstance(info, TensorInfo):
            raise ValueError(f"input {n.target!r} of the converted module was not a tensor at convert time: "
                             "pass example_inputs explicitly")
        flat.append(torch.zeros(info.shape, dtype=info.dtype,
                                device=info.device if info.device != "meta" else "cpu"))
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:
        args, kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
        return tuple(args), dict(kwargs)
    return tuple(flat), {}
