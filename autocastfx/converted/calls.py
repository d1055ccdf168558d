"""Calls of a converted module, whose graph is captured for one call (which inputs are positional, keyword or
``None``): errors that name the captured call, sizes left free under torch.compile, and conversions for calls of
another structure.
"""
from __future__ import annotations

import enum
import functools
import types
import inspect
import os
import threading
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from ..base import keys as K
from ..base.errors import one_line
from ..base.meta import is_plain_setting
from ..base.quiet import warn_user
from ..capture.context import auto_axes, free_axes, free_sizes
from ..core import weights as _weights
from .state import follow_model


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


def text(sig) -> str:
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
        f"this module was converted for a call {text(captured)} and was called with {text(given)}: a graph is "
        "captured for one call's inputs (which are given, which are None). Convert with example inputs of "
        "this call: autocastfx.convert(model, example_inputs=(...), example_kwargs={...}) with every input this "
        "call passes (a model that takes targets and returns its loss: pass the targets in the example), and "
        f"keep one converted module per call ({one_line(error)})"
    ) from error


class FixedSizeError(ValueError):
    """A call's input size that a capture fixed at the example's, which that module cannot convert for."""


def size_guard(error: BaseException) -> bool:
    """Whether ``error`` is torch.export's guard on an input size (``Guard failed: x.size()[1] == 5``), or a
    converted block's refusal of one (:class:`FixedSizeError`), which the module holding it may convert for."""
    return isinstance(error, FixedSizeError) or (isinstance(error, AssertionError)
                                                 and str(error).startswith("Guard failed:"))


def fixed_size(args: tuple, kwargs: dict, error: BaseException, tried: BaseException | None = None) -> None:
    """Raise a ValueError saying which size the capture fixed, where ``error`` is torch.export's guard on an input
    size (``Guard failed: x.size()[1] == 5``), and why converting for this call's sizes failed (``tried``) where
    that was tried; return for any other error."""
    if not size_guard(error):
        return
    if isinstance(error, FixedSizeError):  # a block's: said once, with its own guard
        error = error.__cause__ or error
    message = str(error)
    shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    why = (f" Converting the model for these sizes failed too ({one_line(tried.__cause__ or tried)}): the model "
           "itself may not take them." if tried is not None else
           " The model is not kept with this module (loaded, or converted from a graph), so it cannot be converted "
           "for these sizes here.")
    raise FixedSizeError(
        f"this call's input sizes {shapes} differ from the example's in a size the capture fixed "
        f"({message.splitlines()[0]}): torch.export leaves free only the sizes it proves free in the model's code "
        f"and fixes the rest at the example's.{why} Convert with example inputs of this size (one converted module "
        "per size), or call with the example's sizes") from error


_PLAIN = (bool, int, float, str, torch.dtype, torch.device)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class ModelChecks:
    """The model on the meta device, kept to tell a failing call's own errors (:func:`model_check`). Shared by
    copies; dropped when pickled, as the model may hold what does not pickle (a lambda hook)."""

    def __init__(self, model: nn.Module | None, example: tuple = ((), {})):
        self.model = model
        self.example = example    # meta tensors shaped like the example's inputs: (args, kwargs)
        self.usable: bool | None = None  # whether the model on meta runs the example's call (found on first use)
        self.raw_key = raw_key(*example) if model is not None else None  # the example's call as written

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (ModelChecks, (None,))


def checks_for(model: nn.Module, args: tuple, kwargs: dict) -> ModelChecks:
    """The model on meta and the example's input shapes: nothing runs until a call fails."""
    return ModelChecks(model, _on_meta((args, kwargs)))


def _on_meta(tree):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), tree)


def accepts(checks: ModelChecks) -> bool:
    """Whether the model on meta runs the example's call (asked once): a model whose code needs what meta tensors
    lack (``assert x.device.type == "cpu"``, values) cannot judge calls."""
    if checks.usable is None:
        try:
            _run_on_meta(checks.model, *checks.example, training=False)
            checks.usable = True
        except Exception:  # noqa: BLE001 - any failure: the twin cannot tell the model's checks from its limits
            checks.usable = False
    return checks.usable


def _run_on_meta(model: nn.Module, args: tuple, kwargs: dict, training: bool) -> None:
    meta = _on_meta((args, kwargs))
    model.train(training)
    with torch.no_grad():
        model(*meta[0], **meta[1])


def model_check(checks: ModelChecks | None, args: tuple, kwargs: dict, error: BaseException,
                training: bool = False) -> None:
    """Raise the model's own error (an ``assert`` or ``torch._check`` in its code, run on meta copies of the
    inputs), ``error`` chained, where its code refuses this call; else return."""
    if checks is None or checks.model is None or not accepts(checks):
        return
    try:
        _run_on_meta(checks.model, args, kwargs, training)
    except Exception as own:  # noqa: BLE001 - only the model's own checks are raised, below
        if _is_model_check(own):
            raise own from error
    return


def _in_torch(code) -> bool:
    return os.path.abspath(code.co_filename).startswith(_TORCH_DIR + os.sep)


def _is_model_check(e: BaseException) -> bool:
    """An ``assert`` in code outside torch, or a ``torch._check*`` called directly by code outside torch (not the
    checks of torch's own meta kernels)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    if not frames:
        return False
    if isinstance(e, AssertionError):
        return not _in_torch(frames[-1])
    for caller, callee in zip(frames, frames[1:]):
        if callee.co_name.startswith("_check") and _in_torch(callee) \
                and os.path.basename(callee.co_filename) == "__init__.py" and not _in_torch(caller):
            return True
    return False


# ------------------------------------------------------------------------ sizes free to vary under torch.compile
# torch.compile specialises a first call's sizes; those free to vary are marked maybe-dynamic before a compiled
# call, so the first compile leaves them free (where the model's code fixes one, the compiler specialises it).

def free_dims(args: tuple, kwargs: dict) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(flat input index, dims) of the example's sizes free to vary (:func:`free_axes`); sizes of 0 and 1 are
    left fixed (the compiler specialises them)."""
    out = []
    for i, t in enumerate(torch.utils._pytree.tree_leaves((args, kwargs))):
        if isinstance(t, torch.Tensor):
            dims = tuple(d for d in free_axes(t) if t.shape[d] > 1)
            if dims:
                out.append((i, dims))
    return tuple(out)


def mark_free_dims(free: tuple, args: tuple, kwargs: dict) -> None:
    """Mark a compiled call's free sizes (see :func:`free_dims`) maybe-dynamic; nothing while the compiler traces
    (marks are made before it starts) or for a call of another structure than the example's."""
    if not free or torch.compiler.is_compiling():
        return
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    from torch._dynamo import maybe_mark_dynamic
    for i, dims in free:
        if i < len(leaves) and isinstance(leaves[i], torch.Tensor):
            for d in dims:
                if d < leaves[i].dim():
                    maybe_mark_dynamic(leaves[i], d)



# --------------------------------------------------------------------------- calls of another structure
# A call of another structure (targets where the example had none, a mask left out) is converted on first use
# from the model on meta, one conversion per structure and module state, sharing the first's tensors.

MAX_OTHER_CONVERSIONS = 16  # the oldest is dropped past this (a loop that keeps changing a setting)


class OtherCalls:
    """Conversions for other calls of one converted module, by call key and module state; not copied, not
    pickled."""

    def __init__(self):
        self.by_key: dict[tuple, tuple[nn.Module, list]] = {}  # (call key, state) -> (module, its tensor holders)
        self.example_key: tuple | None = None
        self.sized: set[tuple] = set()  # input sizes converted for where the capture fixed the example's
        self.warned = False  # the oldest conversion dropped, said once

    def __deepcopy__(self, memo):
        return OtherCalls()

    def __reduce__(self):
        return (OtherCalls, ())


def _constant(v: Any) -> Any:
    """The key of a value the capture holds as a constant: a plain value, an enum member, a numpy scalar or a
    function (by identity); None for anything else."""
    if isinstance(v, (_PLAIN, enum.Enum)) or (type(v).__module__ == "numpy" and getattr(v, "shape", None) == ()):
        return (type(v).__name__, v)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        return ("function", id(v))
    return None


def _raw(v: Any) -> Any:
    if v is None:
        return None
    key = _constant(v)
    return key if key is not None else True


def raw_key(args: tuple, kwargs: dict) -> tuple:
    """Which inputs a call gives, as written: None, a plain value (held by the capture as a constant), or another."""
    return tuple((str(i), _raw(a)) for i, a in enumerate(args)) + tuple((k, _raw(v)) for k, v in kwargs.items())


def example_key(info: Any) -> tuple:
    """:func:`raw_key` of the captured call: from the example's values where the model is kept, else from its
    :func:`describe` (which inputs were None)."""
    checks = info.checks
    if checks is not None and checks.raw_key is not None:
        return checks.raw_key
    return _described_key(info.call_signature)


@functools.lru_cache(maxsize=64)
def _described_key(signature: tuple) -> tuple:
    return tuple((name, None if kind == "None" else True) for name, kind in signature)


def _call_shape(v: Any) -> Any:
    """What a conversion is specific to in one argument: whether it is None, and a plain value itself (a scale, a
    flag: the capture holds it as a constant); a tensor only as a tensor."""
    if isinstance(v, (tuple, list)):
        return tuple(_call_shape(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _call_shape(x)) for k, x in v.items()))
    key = _constant(v)
    return key if key is not None else v is None


def bound_key(model: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The call's structure as the model's forward sees it (positional or keyword alike, defaults filled in), with
    its plain values (:func:`_call_shape`); None where the call does not bind to it."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return tuple((name, _call_shape(v)) for name, v in bound.arguments.items())


def input_sizes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor inputs, in order."""
    return tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


def _auto_dims(info: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(flat input index, dims) the torch.export capture left free to vary (``Dim.AUTO``, as
    ``capture.torch_export`` marks them) where the example's size was above 1."""
    example = torch.utils._pytree.tree_leaves(info.checks.example)
    free = free_sizes(*info.checks.example)
    out = []
    for i, t in enumerate(example):
        if isinstance(t, torch.Tensor) and t.dim():
            dims = tuple(d for d in auto_axes(t, free) if t.shape[d] > 1)
            if dims:
                out.append((i, dims))
    return tuple(out)


@torch.compiler.disable
def _auto_dims_eagerly(gm: nn.Module, info: Any) -> tuple:
    dims = gm.__dict__["_autocastfx_auto_dims"] = _auto_dims(info)
    return dims


def single_sizes(gm: nn.Module, info: Any, args: tuple, kwargs: dict) -> tuple | None:
    """Where ``gm``'s torch.export capture left a size free and this call gives it 0 or 1: ``("sizes of 0 and 1",
    (flat index, dim, size), ...)``, the key of a conversion for such calls; else None. torch.export takes a free
    size to be 2 or more and records no check of it, so its program may have taken another branch than the
    model's (``if ids.shape[1] == 1``) with nothing to refuse the call."""
    if getattr(info, "capture", None) != "torch.export" or not convertible(info):
        return None
    dims = gm.__dict__.get("_autocastfx_auto_dims")
    if dims is None:
        dims = _auto_dims_eagerly(gm, info)
    if not dims:
        return None
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    ones = tuple((i, d, leaves[i].shape[d]) for i, ds in dims if i < len(leaves) and isinstance(leaves[i], torch.Tensor)
                 for d in ds if d < leaves[i].dim() and leaves[i].shape[d] <= 1)
    return ("sizes of 0 and 1", *ones) if ones else None


def sized_call(gm: nn.Module, info: Any, args: tuple, kwargs: dict) -> tuple[nn.Module | None, tuple, dict]:
    """:func:`other_call` for a call whose sizes the capture fixed otherwise, where a conversion for them was made
    (``(None, args, kwargs)`` where none was: the call runs ``gm``)."""
    holder = gm.__dict__.get("meta", {}).get(K.OTHER_CALLS)
    if holder is None or not holder.sized or input_sizes(args, kwargs) not in holder.sized:
        return None, args, kwargs
    return other_call(gm, info, args, kwargs, sizes=True)


def convertible(info: Any) -> bool:
    """Whether a converted module with this ``info`` keeps its model (on meta) to convert for other calls."""
    checks = getattr(info, "checks", None)
    return checks is not None and checks.model is not None and info.convert_call is not None


def other_call(gm: nn.Module, info: Any, args: tuple, kwargs: dict, sizes: bool | tuple = False,
               modes: bool = False) -> tuple[nn.Module | None, tuple, dict]:
    """``(module, args, kwargs)`` for a call of another structure, with ``sizes`` of other input sizes than a
    capture that fixed them (torch.export's guard refused the call; a tuple: the key of a conversion for sizes of
    0 and 1, :func:`single_sizes`), or with ``modes`` in modules' modes none of
    ``gm``'s programs computes: the model converted for it (on first use) in the state of ``gm``'s modules, sharing
    ``gm``'s tensors, the call spelled as that conversion's was; the module is None (``gm`` runs it) for the
    captured call spelled another way, or where no model is kept."""
    checks = info.checks
    if not convertible(info):
        return None, args, kwargs
    key = bound_key(checks.model, args, kwargs)
    if key is None:
        return None, args, kwargs
    meta = gm.__dict__.get("meta")
    holder = meta.get(K.OTHER_CALLS)
    if holder is None:
        holder = meta.setdefault(K.OTHER_CALLS, OtherCalls())  # one holder where two threads make one
    if holder.example_key is None:
        holder.example_key = bound_key(checks.model, *checks.example)
    if sizes:
        key = (key, sizes if isinstance(sizes, tuple) else input_sizes(args, kwargs))
    elif key == holder.example_key and not modes:
        return (None, *(respelled(checks.model, info.call_signature, args, kwargs) or (args, kwargs)))
    mods = dict(gm.named_modules(remove_duplicate=False))
    state = module_state(mods)
    with _CONVERTING:  # one conversion at a time: a capture holds the model the others would capture too
        made = holder.by_key.get((key, state)) or _convert_other(gm, info, holder, args, kwargs, key, state, sizes)
    other, holders = made
    # every call: a move or load may have replaced gm's tensors, or a same-class module one of its modules
    _weights.share_tensors(gm, other, _weights.pair_modules(gm, other, mods, holders))
    # the same call spelled another way than the one it was converted for (gm(x, 1.0, True) after gm(x, relu=True))
    made_for = other.meta[K.CONVERTED].call_signature \
        if isinstance(getattr(other, "meta", None), dict) and K.CONVERTED in other.meta else ()
    spelled = respelled(checks.model, made_for, args, kwargs) if made_for else None  # () for a piecewise one
    return (other, *(spelled or (args, kwargs)))


# Conversions for other calls, one at a time in the process: a capture runs the model, whose modules and settings
# another thread's capture of the same model would see half changed, and two threads making the same call at once
# convert it once.
_CONVERTING = threading.RLock()


def _convert_other(gm: nn.Module, info: Any, holder: Any, args: tuple, kwargs: dict, key: Any, state: tuple,
                   sizes: bool | tuple) -> tuple:
    """The model converted for this call, kept in ``holder`` under ``(key, state)``: ``(module, its holders)``."""
    other = info.convert_call(gm, args, kwargs, state, widen=not sizes)
    # converted from the model as it was: the model's attributes as they are, but for the settings of gm's
    # modules it was converted with
    follow_model(other, info.state, frozenset((e[0], k) for e in state if len(e) == 3 for k, _ in e[2]))
    holders = _weights.tensor_holders(other)
    if len(holder.by_key) >= MAX_OTHER_CONVERSIONS:
        del holder.by_key[next(iter(holder.by_key))]
        if not holder.warned:
            holder.warned = True
            name = getattr(info.model_class, "__name__", type(gm).__name__)
            warn_user(f"autocastfx: {name} has been converted for {MAX_OTHER_CONVERSIONS} other calls: "
                      "each call whose structure, plain values (a scale, a step number), module modes or sizes the "
                      "capture fixed are new "
                      "is converted on first use, which takes seconds. Pass a value that changes from call to "
                      f"call as a tensor. This call: {text(describe(args, kwargs))}")
    made = holder.by_key[(key, state)] = (other, holders)
    if sizes is True:  # later calls of these sizes go to it first (converted.module)
        holder.sized.add(key[1])
    return made


def module_state(mods: dict[str, nn.Module]) -> tuple:
    """What a conversion for another call depends on beyond its structure: each module's mode, and the public plain
    settings of those the model's own code runs (not graphs, nor modules whose settings a graph holds)."""
    out = []
    for name, m in mods.items():
        if isinstance(m, fx.GraphModule) or getattr(type(m), "_autocastfx_fixed_settings", False):
            out.append((name, m.training))
            continue
        settings = tuple((k, v) for k, v in m.__dict__.items()
                         if k[0] != "_" and k != "training" and is_plain_setting(v))
        out.append((name, m.training, settings))
    return tuple(out)


def apply_module_state(model: nn.Module, state: tuple) -> None:
    """Give ``model``'s modules the modes and settings of :func:`module_state`; a module not named there (a dropout
    a torch.export capture holds no module for) takes its parent's mode, as ``train()`` would."""
    given = {name: (training, settings[0] if settings else ()) for name, training, *settings in state}
    modes: dict[str, bool] = {}
    for name, m in model.named_modules():
        if name in given:
            training, settings = given[name]
            own = m.__dict__
            for k, v in settings:
                if k in own and (type(own[k]) is type(v) or is_plain_setting(own[k])):  # p=0 for 0.5, momentum=None
                    own[k] = v
        else:
            training = modes.get(name.rpartition(".")[0], m.training) if name else m.training
        m.training = modes[name] = training


def widened(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with free sizes of 1 made 2 by repetition, as an example to capture from (a capture fixes sizes
    of 1)."""
    def widen(t):
        if not isinstance(t, torch.Tensor):
            return t
        for d in free_axes(t):
            if t.shape[d] == 1:
                t = torch.cat([t, t], dim=d)
        return t
    return torch.utils._pytree.tree_map(widen, (args, kwargs))


def respelled(model: nn.Module, captured: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """``(args, kwargs)`` as the captured call spelled them (which positionally, which by keyword), the same
    arguments bound to the model's forward; None where they cannot be."""
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        names = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        new_args, new_kwargs = [], {}
        for name, _ in captured:
            if name.isdigit():
                new_args.append(bound.arguments[names[int(name)]])
            else:
                new_kwargs[name] = bound.arguments[name]
        return tuple(new_args), new_kwargs
    except (TypeError, ValueError, KeyError, IndexError):
        return None
