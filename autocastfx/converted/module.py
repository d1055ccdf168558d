"""The converted module's class (:func:`install`): ``train()``/``eval()`` switching between each mode's program,
the call (ambient autocast off, other call structures sent to their own conversion), the model's surface
(``gm.generate()``, ``gm.config``), tied weights' state-dict names, and copies that keep all of it.
"""
from __future__ import annotations

import contextlib
import copy
import copyreg
import inspect
import itertools
import sys
import types
from typing import Any

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch.fx.experimental.symbolic_shapes import is_concrete_int
import torch.nn as nn

from . import calls as _calls
from ..base import keys as K
from ..base.keys import MIRROR
from ..base.runtime import KEEP_MODEL_MODES
from ..base.meta import is_converted, is_plain_setting, names_by_id, original_class
from ..base.quiet import torch_internal_warnings_off, warn_user
from ..core import weights as _weights
from ..base.meta import fetch
from ..core.modes import EVAL, GIVEN, TRAIN, Programs


def set_mode(gm: fx.GraphModule, mode: bool) -> fx.GraphModule:
    """Run ``mode``'s program (where the programs differ) and set every module's flag, as ``nn.Module.train`` does."""
    if not isinstance(mode, bool):
        raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
    programs: Programs | None = gm.meta.get(K.PROGRAMS)
    if programs is not None:
        key = TRAIN if mode else EVAL
        if programs.current != key:
            _run_program(gm, programs, key)
    nn.Module.train(gm, mode)
    info = gm.meta.get("autocastfx")
    guard = getattr(info, "state", None)
    for name, flag in (getattr(info, "mode_flags", None) or {}).get(mode, {}).items():
        sub = fetch(gm, name, None)  # as the model's own train() sets them (frozen batch norms)
        if isinstance(sub, nn.Module):
            sub.training = flag
    if guard is not None:  # the model takes these modes: one mode for both, the later call deciding
        guard.share_modes(gm)
    return gm


def follow_module_modes(gm: fx.GraphModule) -> None:
    """Run the program of the modes ``gm``'s modules are now in (after an enclosing capture switched them one by
    one): train or eval where all agree, else the conversion-time program."""
    programs: Programs | None = gm.meta.get(K.PROGRAMS)
    if programs is None:
        return
    flags = {m.training for m in gm.modules()}
    key = (TRAIN if flags.pop() else EVAL) if len(flags) == 1 else GIVEN
    if key != programs.current and key in programs.graphs:
        _run_program(gm, programs, key)


def _run_program(gm: fx.GraphModule, programs: Programs, key: str) -> None:
    """Make the program ``key`` the one ``gm`` runs."""
    _keep_wrapped_call(type(gm))
    programs.current = key
    _switch_graph(gm, programs, key)


_CODE_FIELDS = ("_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec")


def _switch_graph(gm: fx.GraphModule, programs: Programs, key: str) -> None:
    """Run the program ``key`` with the ``forward`` generated when it first ran: the same code object lets
    torch.compile's cache find each mode's code, so each mode compiles once."""
    for k, g in programs.graphs.items():  # the program running now, kept as it is before it is left
        if g is gm._graph and k not in programs.code:
            programs.code[k] = _running_code(gm)
    graph = programs.graphs[key]
    kept = programs.code.get(key)
    if kept is not None and kept["graph"] is graph:
        gm._graph = graph
        graph.owning_module = gm
        for name in _CODE_FIELDS:
            if name in kept:
                setattr(gm, name, kept[name])
        type(gm).forward = kept["forward"]
        _hold_forward(gm)
        return
    programs.switching = True
    try:
        gm.graph = graph  # the setter recompiles
    finally:
        programs.switching = False
    programs.code[key] = _running_code(gm)


def _running_code(gm: fx.GraphModule) -> dict:
    forward = type(gm).forward
    return {"graph": gm._graph, "forward": getattr(forward, _PROGRAM, forward),
            **{n: getattr(gm, n) for n in _CODE_FIELDS if hasattr(gm, n)}}


_HELD_FORWARD, _PROGRAM = "_autocastfx_forward", "_autocastfx_program"


def _hold_forward(gm: nn.Module) -> None:
    """Keep one function as ``type(gm).forward`` for ``gm``'s life, running the code generated for the program now
    current: a wrapper that took ``gm.forward.__func__`` and set itself on the instance (accelerate's mixed
    precision wraps it in autocast) then runs each mode's program, not the one it took. Each program's own function
    stays apart (``_autocastfx_program`` of the held one), and so do their code objects, which torch.compile caches
    by. Where two programs' code would read one global name as different objects, a new function is held."""
    cls = type(gm)
    fn, held = cls.__dict__.get("forward"), cls.__dict__.get(_HELD_FORWARD)
    if fn is None or fn is held or not isinstance(fn, types.FunctionType) or fn.__closure__:
        return
    if held is None or any(k in held.__globals__ and held.__globals__[k] is not v for k, v in fn.__globals__.items()
                           if k != "forward"):
        held = types.FunctionType(fn.__code__, dict(fn.__globals__), fn.__name__, fn.__defaults__)
        held.__qualname__, held.__module__ = fn.__qualname__, fn.__module__
        held.__dict__.update(fn.__dict__)
        setattr(cls, _HELD_FORWARD, held)
    else:
        held.__globals__.update(fn.__globals__)  # first: a call starting meanwhile finds every name the code reads
        held.__code__, held.__defaults__ = fn.__code__, fn.__defaults__
    held.__kwdefaults__ = fn.__kwdefaults__
    setattr(held, _PROGRAM, fn)
    cls.forward = held


def _keep_wrapped_call(cls: type) -> None:
    """Before a recompile, give a class made over the converted module's (FSDP2's from ``fully_shard``) its base's
    call wrapper, else GraphModule.recompile's wrapper recurses endlessly (pytorch/vision#5826,
    pytorch/pytorch#73866)."""
    if "_wrapped_call" in vars(cls):
        return
    for base in cls.__mro__[1:]:
        if "_wrapped_call" in vars(base):
            cls._wrapped_call = base._wrapped_call
            return


def _model_signature(gm: nn.Module) -> None:
    """Give ``gm``'s forward the model's signature, for code that reads it to choose what to pass (Hugging Face's
    ``generate`` passes ``position_ids`` only to a forward that names it)."""
    cls = getattr(gm.__dict__.get("meta", {}).get("autocastfx"), "model_class", None)
    if cls is not None and "forward" in vars(type(gm)):
        try:
            type(gm).forward.__signature__ = inspect.signature(cls.forward)
        except (TypeError, ValueError):
            pass


def _read_mode(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook of a compiled converted module: its mode, read where the compiler traces."""
    if module.training:
        pass


def _run_as(module: nn.Module, other: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module``'s call (its hooks, its compiled call) running ``other``'s forward: the conversion for a call of
    another structure, whose tensors are ``module``'s own."""
    if torch.compiler.is_compiling():  # the compiler traces this call: no swap of forward and hooks meanwhile
        user = [h for h in itertools.chain(module._forward_pre_hooks.values(), module._forward_hooks.values())
                if not getattr(getattr(h, "func", h), "__module__", "").startswith(("torch.export", __name__))]
        if user:
            raise ValueError(
                "a call of another structure than the captured one, compiled, on a converted module with forward "
                "hooks of its own: the hooks would not run. Remove the hooks, or compile a module converted for "
                "this call (autocastfx.convert(model, example_inputs=(...)))")
        with _without_autocast():
            return other(*args, **kwargs)
    saved = module.__dict__.get("forward", _NONE)
    module.__dict__["forward"] = other.forward
    hooks = module._forward_pre_hooks
    kept = list(hooks.items())
    for k, h in kept:  # torch.export's check of the inputs against the captured call's: not this call's
        if getattr(getattr(h, "func", h), "__module__", "").startswith("torch.export"):
            del hooks[k]
    try:
        with _without_autocast():  # as for the captured call: the program as planned, whatever the caller has on
            return nn.Module.__call__(module, *args, **kwargs)
    finally:
        hooks.clear()
        hooks.update(kept)
        if saved is _NONE:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = saved


_NONE = object()


def _check_wrapped_forward(gm: nn.Module) -> None:
    """Warn, once per wrapper, where ``gm.forward`` was replaced on the instance by a wrapper that runs it under an
    enabled ``torch.autocast`` (accelerate's ``mixed_precision="bf16"``/``"fp16"`` does, in ``prepare``)."""
    fn = gm.__dict__["forward"]
    if gm.__dict__.get("_autocastfx_wrapper_seen") == id(fn):
        return
    gm.__dict__["_autocastfx_wrapper_seen"] = id(fn)
    for _ in range(8):  # the wrappers' chain: __func__ of a method, __wrapped__ of functools.wraps, accelerate's
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, torch.amp.autocast_mode.autocast) and getattr(value, "_enabled", False):
                warn_user("autocastfx: the converted module's forward is wrapped in torch.autocast on the instance "
                          "(accelerate's mixed_precision='bf16' or 'fp16' does this in prepare()): autocast then runs "
                          "inside the converted program and recasts it, so ops its plan keeps in float32 (routers, "
                          "a float32 head, the loss) run low. The converted module is mixed precision already: use "
                          "Accelerator(mixed_precision='no') (train() and eval() are followed either way)")
                return
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
        if fn is None:
            return


def _module_call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``nn.Module.__call__`` (as a capture may have patched it), or, where torch.compile traces, nn.Module's
    ``_call_impl`` itself: the hooks and ``forward``, past the converted class's own ``_call_impl``."""
    if torch.compiler.is_dynamo_compiling():
        return nn.Module._call_impl(module, *args, **kwargs)
    return nn.Module.__call__(module, *args, **kwargs)


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _without_autocast():
    """``autocast(enabled=False)`` for each device type whose autocast the caller left on: an ambient autocast
    would recast the module's plan (a bfloat16 module run in float16)."""
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for d in on:
        stack.enter_context(torch.autocast(d, enabled=False))
    return stack


class _GuardsChildren:
    """A module (the converted root, a held plain container) whose held children may not be replaced by modules of
    another class, settings or shapes (:func:`check_replacement`)."""

    def __setattr__(self, name, value):
        if name in self.__dict__.get(_READ, ()):
            _refuse_write(self, name)
        check_replacement(self, name, value, sys._getframe(1))
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in self.__dict__.get(_READ, ()):
            _refuse_write(self, name)
        super().__delattr__(name)

    def add_module(self, name, module):
        check_replacement(self, name, module)
        return super().add_module(name, module)


_READ = "_autocastfx_read"  # names of a module's attributes the model's code read as constants


def _refuse_write(module: nn.Module, name: str) -> None:
    value = getattr(module, name, _READ)
    if name in ("grad_checkpointing", "gradient_checkpointing"):
        raise ValueError(
            f"{name} is an attribute of the model the converted graph read at conversion: the graph holds no "
            "activation checkpointing of the model's (converted with it on, its ops are plain ops too). To recompute "
            "activations on the converted module, convert with blocks and call autocastfx.checkpoint_blocks(gm)")
    raise ValueError(
        f"{name} is an attribute of the model{f' ({name}={value!r})' if value is not _READ else ''}, a constant of "
        "the converted graph wherever the "
        "model's forward read it: setting it on the converted module changes nothing it computes. Set it on the "
        "model and convert again (autocastfx.convert(model, ...); gm.state_dict() loads into the model first if gm "
        "was trained), or keep a value that changes during training in a buffer (register_buffer) or pass it as a "
        "tensor input")


def refuse_writes(gm: nn.Module, reads) -> None:
    """Make the attributes ``reads`` names (``(module path, name)``) read-only on ``gm`` and its held containers."""
    by_path: dict[str, set] = {}
    for path, name in reads:
        by_path.setdefault(path, set()).add(name)
    for path, names in by_path.items():
        m = fetch(gm, path, None) if path else gm
        if isinstance(m, _GuardsChildren):
            m.__dict__[_READ] = frozenset(names) | m.__dict__.get(_READ, frozenset())


def _check_state(gm: nn.Module) -> None:
    info = gm.__dict__.get("meta", {}).get("autocastfx")
    guard = getattr(info, "state", None)
    if guard is not None:
        guard.check(gm)


@torch.compiler.disable
def _check_state_eagerly(gm: nn.Module) -> None:
    """:func:`_check_state` under torch.compile, for ``gm`` and each converted block inside it: the compiler runs
    the blocks' forward without their ``__call__``."""
    for m in units_inside(gm):
        _check_state(m)


def units_inside(gm: nn.Module) -> list[nn.Module]:
    """``gm`` and each converted module inside it, found once; those inside are marked as checked by ``gm``'s call
    (where the compiler traces ``gm``'s program, it runs theirs inline: see ``_Switchable._call_impl``)."""
    units = gm.__dict__.get("_autocastfx_units")
    if units is None:
        units = gm.__dict__["_autocastfx_units"] = [m for m in gm.modules() if isinstance(m, _Switchable)]
        for m in units:
            if m is not gm:
                m.__dict__[_INSIDE] = True
    return units


_INSIDE = "_autocastfx_inside"


class _Switchable(_GuardsChildren):
    """Mixed into the converted module's class; copies keep it, as GraphModule's ``copy.deepcopy`` builds a fresh
    class over the first base not named ``GraphModuleImpl``."""

    def train(self, mode: bool = True):
        return set_mode(self, mode)


    def compile(self, *args, **kwargs):
        """``nn.Module.compile``, with a forward pre-hook that reads the mode first: torch.compile traces hooks
        with the call it compiles, so it guards on the mode and runs each mode's program (see ``__call__``)."""
        if not getattr(self, "_autocastfx_mode_hook", False):
            self.register_forward_pre_hook(_read_mode)
            self._autocastfx_mode_hook = True
        # nn.Module.compile compiles self._call_impl, which here is __call__'s way in (below): its hooks and forward
        self._compiled_call_impl = torch.compile(types.MethodType(nn.Module._call_impl, self), *args, **kwargs)

    def recompile(self):
        programs = self.__dict__.get("meta", {}).get(K.PROGRAMS)
        if programs is not None and not programs.switching:  # the graph was edited: the kept code is stale
            programs.code.clear()
        out = super().recompile()
        _hold_forward(self)
        _model_signature(self)
        return out

    def eval(self):
        return set_mode(self, False)

    def _call_impl(self, *args, **kwargs):
        # torch.compile of a module holding this one traces a GraphModule's _call_impl, not its __call__
        # (torch/_dynamo/variables/nn_module.py): there the call goes through __call__ too, which checks the
        # model's state, the modes and the call's structure (a change the programs do not hold refused or converted
        # for, as in eager), unless this is a block of a converted module, whose own call checks it. Everywhere
        # else this is nn.Module's, reached from __call__.
        if torch.compiler.is_dynamo_compiling() and not self.__dict__.get(_INSIDE):
            return self.__call__(*args, **kwargs)
        return nn.Module._call_impl(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if "_autocastfx_fsdp_checked" not in self.__dict__ and hasattr(self, "_get_fsdp_state"):
            _check_fsdp_param_dtype(self)  # once, at the first call after fully_shard
        # the model's plain attributes the programs hold as constants: unchanged since convert()
        if torch.compiler.is_compiling() or self.__dict__.get("_compiled_call_impl") is not None:
            _check_state_eagerly(self)  # the blocks' too: the compiled code runs their forward, not their __call__
        else:
            _check_state(self)
            if "forward" in self.__dict__:
                _check_wrapped_forward(self)
            if "_autocastfx_units" not in self.__dict__:  # the blocks marked, for a compiler tracing the forward
                units_inside(self)
        # read the mode where torch.compile traces, so it guards on it: the programs' code holds it as constants
        if self.training:
            pass
        programs = self.__dict__.get("meta", {}).get(K.PROGRAMS)
        info = self.__dict__.get("meta", {}).get("autocastfx")
        convertible = _calls.convertible(info)
        nested = self.__dict__.get("_autocastfx_nested")  # None: not looked for yet
        if torch.compiler.is_compiling() and (programs is not None and programs.owners or nested is None or nested):
            # run at every call, outside the compiled code (it may switch programs), then the mode of each module
            # whose mode the programs hold read where the compiler traces, after the graph break: it guards on them
            computed = _check_modes_eagerly(self, programs, convertible)
            if self.training:
                pass
            for m in self.__dict__.get("_autocastfx_owners", (None, ()))[1] if programs and programs.owners else ():
                if m.training:
                    pass
            for _, block in self.__dict__.get("_autocastfx_nested", ()):
                for m in block.__dict__["_autocastfx_owners"][1]:
                    if m.training:
                        pass
        elif torch.compiler.is_compiling():  # a mode set without train(): the program switched through one break
            computed = _check_modes_eagerly(self, programs, convertible) if _off_program(self, programs) else True
        else:  # computed: whether the programs compute the modules' modes (else the call is converted for them)
            computed = _check_owner_modes(self, programs, convertible) if programs is not None else True
            # each converted block's modes, before any runs and updates statistics
            computed = _check_nested_modes(self, convertible) and computed
        if info is not None and (not computed or info.call_signature and
                                 _calls.raw_key(args, kwargs) != _calls.example_key(info)):
            # a call of another structure, or in modes no program computes: its own conversion (or the captured
            # call, spelled another way); under torch.compile chosen (and converted) through one graph break here,
            # outside any try block, where the compiler resumes after it
            if torch.compiler.is_compiling():
                other, args, kwargs = _other_eagerly(self, info, args, kwargs, not computed)
            else:
                other, args, kwargs = _other(self, info, args, kwargs, not computed)
            if other is not None:
                first = _first_at_sizes(self, other, args, kwargs)
                try:
                    out = _run_as(self, other, args, kwargs)
                except Exception as e:  # noqa: BLE001 - the model's own checks on this call, else as it came
                    done, out = _recover(self, info, args, kwargs, e, first)
                    if done:
                        return out
                    raise
                return out if first is None else first.ran(out)
        if info is not None and self.__dict__.get("_compiled_call_impl") is not None:
            _calls.mark_free_dims(info.free_dims, args, kwargs)  # gm.compile(): sizes free to vary left free
        if info is not None:
            other, a, k = _sized(self, info, args, kwargs)
            if other is None and (torch.compiler.is_compiling() or self.__dict__.get("_compiled_call_impl")):
                other, a, k = _compiled_at_fixed_sizes(self, info, args, kwargs)
            if other is not None:
                return _run_as(self, other, a, k)
        first = _first_at_sizes(self, self, args, kwargs) if info is not None else None
        try:
            with _without_autocast():  # the program gm.code shows, whatever autocast the caller has on
                out = _module_call(self, args, kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised below unless a clearer error says what went wrong
            if info is not None and isinstance(e, (TypeError, RuntimeError, ValueError, AttributeError)):
                _calls.check(info.call_signature, args, kwargs, e)
            if info is not None:
                done, out = _recover(self, info, args, kwargs, e, first)
                if done:
                    return out
            raise
        return out if first is None else first.ran(out)

    # the model's own names for its tied weights in the state dict (core/weights.py)
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        start = len(destination) if destination is not None else 0
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        _weights.model_names_into_state_dict(self, out, prefix, start)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        missing_keys.extend(_weights.model_names_from_state_dict(
            self, state_dict, prefix, assign=bool(local_metadata.get("assign_to_params_buffers", False))))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __deepcopy__(self, memo):
        """A copy that keeps non-persistent buffers and read-only names, which GraphModule's copy drops."""
        with torch_internal_warnings_off():  # the graph's pytree specs
            out = super().__deepcopy__(memo)
        add_model_surface(out)  # the copy's class is made anew, and its forward before the copy had its meta
        _model_signature(out)
        copies = dict(out.named_modules(remove_duplicate=False))
        for name, m in self.named_modules(remove_duplicate=False):
            c = copies.get(name)
            if c is not None and m._non_persistent_buffers_set:
                c._non_persistent_buffers_set = {b for b in m._non_persistent_buffers_set if b in c._buffers}
            if c is not None and _READ in m.__dict__:
                c.__dict__[_READ] = m.__dict__[_READ]
                c.__dict__.update({k: copy.deepcopy(m.__dict__[k], memo) for k in m.__dict__[_READ]
                                   if k in m.__dict__ and k not in c.__dict__})
        return out

    def __reduce_ex__(self, protocol):
        """Refused (``torch.save(gm)``, ``copy.copy``): it would rebuild a plain GraphModule of one program."""
        raise TypeError(
            f"a converted module ({type(self).__name__}) does not pickle or copy.copy: torch.save(gm) would write a "
            "file that loads, if at all, as a plain GraphModule running the one program it was saved in, whatever "
            "its mode. "
            "Save its state instead: torch.save(gm.state_dict()) is the float32 model under the model's own names; "
            "load it into the model, or into a module converted again (autocastfx.convert(model, example_inputs)). "
            "To save the whole module as before, save the model you converted: its parameters and buffers are this "
            "module's, trained (net = model; model = autocastfx.convert(net, ...); torch.save(net, f)). "
            "copy.deepcopy(gm) makes a working copy; autocastfx.export(gm, 'model.pt2') writes a program that loads "
            "without autocastfx")

    def __copy__(self):
        return self.__reduce_ex__(4)

    def _apply(self, fn, recurse=True):
        _refuse_low_parameters(self, fn)
        tied = [names for names in _weights.aliases(self)[1].values() if len(names) > 1]
        out = super()._apply(fn, recurse)
        _weights.retie(self, tied)  # to_empty from meta makes a new Parameter per module: tied weights stay tied
        return out


def _other(gm: nn.Module, info: Any, args: tuple, kwargs: dict, modes: bool, compiled: bool = False) -> tuple:
    """``(module, args, kwargs)`` for a call of another structure, or in ``modes`` no program computes: its
    conversion (:func:`calls.other_call`), or the one for its sizes where a capture fixed them and it was made;
    the module None where ``gm`` runs the call. The model's own error where its code refuses the call; the modes'
    ValueError where none converts for them."""
    try:
        other, args, kwargs = _calls.other_call(gm, info, args, kwargs, modes=modes)
    except Exception as e:  # noqa: BLE001 - it does not convert: the model's own check on it, if any
        _calls.model_check(info.checks, args, kwargs, e, gm.training)
        raise
    if other is None:
        if modes:  # not converted for these modes: refused, as without a model
            settle_programs(gm)  # raises the modes' ValueError, naming the modules
        return None, args, kwargs
    _check_state_eagerly(other) if compiled else _check_state(other)  # compiled: its blocks' forward runs too
    sized, a, k = _calls.sized_call(gm, info, args, kwargs)  # its sizes converted for earlier
    return (sized, a, k) if sized is not None else (other, args, kwargs)


@torch.compiler.disable
def _other_eagerly(gm: nn.Module, info: Any, args: tuple, kwargs: dict, modes: bool) -> tuple:
    """:func:`_other` under ``torch.compile(gm)``, through one graph break."""
    return _other(gm, info, args, kwargs, modes, compiled=True)


def _sized(gm: nn.Module, info: Any, args: tuple, kwargs: dict) -> tuple:
    """``(conversion, args, kwargs)`` for a call of sizes the capture fixed at the example's, converted for on an
    earlier call, or of a size of 0 or 1 where torch.export's program took sizes of 2 or more (converted for now);
    ``(None, args, kwargs)`` where ``gm``'s own program runs it."""
    other, a, k = _calls.sized_call(gm, info, args, kwargs)
    if other is None and (ones := _calls.single_sizes(gm, info, args, kwargs)) is not None:
        other, a, k = (_single_eagerly if torch.compiler.is_compiling() else _calls.other_call)(
            gm, info, args, kwargs, sizes=ones)
    return other, a, k


def _compiled_at_fixed_sizes(gm: nn.Module, info: Any, args: tuple, kwargs: dict) -> tuple:
    """Under torch.compile (or before ``gm.compile()``'s compiled call), ``(conversion, args, kwargs)`` for a call
    whose input sizes differ from the ones ``gm``'s torch.export program fixed (converted for them now, through one
    graph break), as eager calls get it through torch.export's guard; ``(None, args, kwargs)`` for a call of its
    sizes. The compiler guards on each comparison, so a compiled call of fixed sizes stays one graph."""
    fixed = gm.__dict__.get("_autocastfx_fixed_sizes")  # noted by convert() (read while compiling: a graph break)
    if fixed is None and not torch.compiler.is_compiling():
        fixed = _fixed_sizes_eagerly(gm, info)
    if fixed:
        flat = fx_pytree.tree_flatten_spec((args, kwargs), gm._in_spec)
        if any(flat[i].shape[d] != size for i, d, size in fixed):
            return _at_sizes_eagerly(gm, info, args, kwargs)
    return None, args, kwargs


def note_fixed_sizes(gm: nn.Module) -> None:
    """Note the input sizes ``gm``'s torch.export program fixes (see :func:`_fixed_sizes_eagerly`)."""
    info = gm.__dict__.get("meta", {}).get("autocastfx")
    if info is not None:
        _fixed_sizes_eagerly(gm, info)


@torch.compiler.disable
def _fixed_sizes_eagerly(gm: nn.Module, info: Any) -> tuple:
    """(input index, dim, size) of each input size the torch.export program fixes (an int in its placeholder's
    value); () where the capture was not torch.export's or another structure than its inputs' is kept."""
    fixed = []
    if getattr(info, "capture", None) == "torch.export" and _calls.convertible(info) \
            and getattr(gm, "_in_spec", None) is not None:
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                fixed += [(i, d, int(size)) for d, size in enumerate(val.shape) if is_concrete_int(size)]
    gm.__dict__["_autocastfx_fixed_sizes"] = out = tuple(fixed)
    return out


@torch.compiler.disable
def _at_sizes_eagerly(gm: nn.Module, info: Any, args: tuple, kwargs: dict) -> tuple:
    """:func:`calls.other_call` for sizes the capture fixed, under ``torch.compile(gm)``; the FixedSizeError an eager
    call would get where the model does not convert for them."""
    try:
        return _calls.other_call(gm, info, args, kwargs, sizes=True)
    except Exception as e:  # noqa: BLE001 - said as for an eager call
        guard = AssertionError("Guard failed: an input size differs from the one torch.export's program fixed")
        _calls.fixed_size(args, kwargs, guard, e)
        raise


@torch.compiler.disable
def _single_eagerly(gm: nn.Module, info: Any, args: tuple, kwargs: dict, sizes: tuple) -> tuple:
    """:func:`calls.other_call` for sizes of 0 and 1 under ``torch.compile(gm)``, through one graph break."""
    return _calls.other_call(gm, info, args, kwargs, sizes=sizes)


class _FirstAtSizes:
    """The buffers and the CPU generator before the first call at new input sizes of a module holding converted
    blocks: a block that refuses the sizes (its capture fixed them) stops the call after the code before it ran,
    and the call is run again converted for its sizes, which must find the statistics, counters and random state
    as the call found them, not moved twice."""

    def __init__(self, module: nn.Module, key: tuple):
        self.module, self.key = module, key
        seen, buffers = set(), []
        for b in module.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                buffers.append((b, b.detach().clone()))
        self.buffers, self.rng = buffers, torch.get_rng_state()

    def undo(self) -> None:
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
        torch.set_rng_state(self.rng)
        self.buffers = []

    def ran(self, out: Any) -> Any:
        """``out``, the call's result, once these sizes are noted as run."""
        sizes = self.module.__dict__.setdefault("_autocastfx_sizes_run", set())
        if len(sizes) >= 256:  # sizes that vary at every call: the oldest forgotten, all at once
            sizes.clear()
        sizes.add(self.key)
        self.buffers = []
        return out


def _first_at_sizes(module: nn.Module, runs: nn.Module, args: tuple, kwargs: dict) -> _FirstAtSizes | None:
    """A :class:`_FirstAtSizes` where ``runs`` (the program called) holds blocks captured by torch.export (which may
    fix a size) and ``module`` has not run a call of these input sizes; None otherwise (and under torch.compile,
    which guards on sizes itself)."""
    if torch.compiler.is_compiling():
        return None
    blocks = runs.__dict__.get("_autocastfx_has_blocks")
    if blocks is None:
        blocks = runs.__dict__["_autocastfx_has_blocks"] = any(  # a traced block fixes no size
            m is not runs and isinstance(m, _Switchable)
            and getattr(m.meta.get("autocastfx"), "capture", None) == "torch.export" for m in runs.modules())
    if not blocks:
        return None
    key = (id(runs), *_calls.input_sizes(args, kwargs))
    if key in module.__dict__.get("_autocastfx_sizes_run", ()):
        return None
    return _FirstAtSizes(module, key)


def _recover(gm: nn.Module, info: Any, args: tuple, kwargs: dict, error: BaseException,
             first: _FirstAtSizes | None) -> tuple[bool, Any]:
    """After a failed call: the model's own error where its code refuses the call (raised, ``error`` chained); the
    statistics of a first call at new sizes put back where a size guard refused it; then the call converted for its
    sizes where that guard was the cause. Returns ``(True, output)`` where that ran the call, else ``(False, None)``
    (the caller raises ``error``)."""
    _calls.model_check(info.checks, args, kwargs, error, gm.training)
    if first is not None and _calls.size_guard(error):
        first.undo()
    return _for_sizes(gm, info, args, kwargs, error)


def _for_sizes(gm: nn.Module, info: Any, args: tuple, kwargs: dict, error: BaseException) -> tuple[bool, Any]:
    """Where ``error`` is a size a capture fixed at the example's (torch.export's guard, or a converted block's
    refusal), ``(True, the call's result)`` run by the model converted for its sizes, or a
    :class:`calls.FixedSizeError` saying why it does not convert; ``(False, None)`` for any other error, which the
    caller re-raises as it is (raised here, the error and this frame would hold each other, and the call's
    activations with them, until the collector runs)."""
    if not _calls.size_guard(error):
        return False, None
    tried = None
    try:
        other, a, k = _calls.other_call(gm, info, args, kwargs, sizes=True)
    except Exception as failed:  # noqa: BLE001 - it does not convert for these sizes: said below
        other, tried = None, failed
    if other is not None:
        return True, _run_as(gm, other, a, k)
    _calls.fixed_size(args, kwargs, error, tried)
    return False, None


def _refuse_low_parameters(gm: nn.Module, fn) -> None:
    """ValueError where ``fn`` (``gm.half()``, ``gm.to(torch.float64)``) would give the float32 parameters another
    floating dtype."""
    if not any(p.dtype == torch.float32 for p in gm.parameters()):
        return
    probe = fn(torch.empty(0))
    if isinstance(probe, torch.Tensor) and probe.is_floating_point() and probe.dtype != torch.float32:
        raise ValueError(
            f"a converted module's parameters stay float32: they are the model's, the weights an optimizer trains, "
            f"and its programs cast them for each op. Making them {probe.dtype} would lose the small updates that "
            "float32 keeps and run a plan made for float32 weights. To train in another precision, convert with "
            "that dtype (autocastfx.convert(model, ..., dtype=...)); for a module that stores its weights low for "
            "inference, autocastfx.for_inference(gm)")


def _off_program(gm: nn.Module, programs: Programs | None) -> bool:
    """Whether ``gm``'s flag is not the mode of the program it runs (its flag set without ``train()``)."""
    return programs is not None and programs.current in (TRAIN, EVAL) and (programs.current == TRAIN) != gm.training


def _check_owner_modes(gm: fx.GraphModule, programs: Programs, convertible: bool = False) -> bool:
    """Before a call, check that the modules whose modes the programs hold as op flags match the running program;
    their conversion-time mixture (frozen batch norms) runs that program. Any other mixture returns False where
    ``convertible`` (the call is converted for it), else is a ValueError."""
    kept = gm.__dict__.get("_autocastfx_owners")  # the modules, found once per Programs (a copy has its own)
    if kept is None or kept[0] is not programs or not all(map(_still_at, itertools.repeat(gm), programs.owners,
                                                               kept[1])):  # one replaced since (gm.bn = ...)
        kept = gm.__dict__["_autocastfx_owners"] = (programs, [gm.get_submodule(n) for n in programs.owners],
                                                    list(programs.owners.values()))
    want = {TRAIN: True, EVAL: False}.get(programs.current)
    if want is None:
        if all(m.training == f for m, f in zip(kept[1], kept[2])):
            return True
    elif gm.training == want and all(m.training == want for m in kept[1]):
        return True
    flags = {name: m.training for name, m in zip(programs.owners, kept[1])}
    if programs.owners and flags == programs.owners and GIVEN in programs.graphs:
        _run_program(gm, programs, GIVEN)
        return True
    key = TRAIN if gm.training else EVAL
    if set(flags.values()) <= {gm.training} and key in programs.graphs:  # one mode for all, set without train()
        _run_program(gm, programs, key)                                   # (flag by flag: a capture's copy, apply())
        return True
    if convertible:
        return False
    odd = [f"{n} ({'train' if f else 'eval'})" for n, f in flags.items()
           if f != (programs.owners[n] if want is None else want)]
    raise ValueError(
        f"modules of this converted module are in another mode than the program it runs ({programs.current}): "
        f"{', '.join(odd[:4])}{' and more' if len(odd) > 4 else ''}. The converted graph holds each module's mode "
        "as its ops' flags, one program per mode of the whole module: gm.train() and gm.eval() switch them. A "
        "submodule's mode set on its own after convert() (frozen batch norms) is converted for at its first call "
        "only where the converted module keeps its model (not one loaded from a file, nor converted from a graph); "
        "here it is followed only where it is the mode it had at conversion: set the model's "
        "modules' modes before convert(), then after each gm.train() set those modules' modes again as they were")


def _still_at(gm: nn.Module, path: str, module: nn.Module) -> bool:
    """Whether ``module`` is still ``gm``'s module at ``path`` (none replaced on the way)."""
    m = gm
    for part in path.split("."):
        m = m._modules.get(part)
        if m is None:
            return False
    return m is module


def settle_programs(gm: nn.Module, convertible: bool = False) -> bool:
    """Make each converted module in ``gm`` run its current modes' program, as its next call would, for what reads
    the running graph uncalled (export, save); False where no program computes the modes and ``convertible`` (a
    call converts for them), else that mixture is a ValueError."""
    computed = True
    for m in gm.modules():
        programs = m.__dict__.get("meta", {}).get(K.PROGRAMS) if isinstance(m, _Switchable) else None
        if programs is not None:
            computed = _check_owner_modes(m, programs, convertible) and computed
    return computed


def _check_nested_modes(gm: nn.Module, convertible: bool = False) -> bool:
    """:func:`_check_owner_modes` for every converted block inside ``gm``, so a refused call is refused before any
    block has run; False where a block's modes are computed by none of its programs and ``gm`` is ``convertible``
    (the call is converted for them)."""
    nested = gm.__dict__.get("_autocastfx_nested")
    if nested is None or not all(_still_at(gm, n, m) for n, m in nested):  # a block replaced since
        nested = index_blocks(gm)
    return all([_check_owner_modes(m, m.meta[K.PROGRAMS], convertible) for _, m in nested])


def index_blocks(gm: nn.Module) -> list:
    """``(name, block)`` of each converted block inside ``gm`` whose programs hold modules' modes, kept on ``gm``
    (found again where one is replaced): a compiled call checks their modes only where there are any."""
    nested = gm.__dict__["_autocastfx_nested"] = [
        (n, m) for n, m in gm.named_modules() if m is not gm and isinstance(m, _Switchable)
        and getattr(m.__dict__.get("meta", {}).get(K.PROGRAMS), "owners", None)]
    return nested


@torch.compiler.disable
def _check_modes_eagerly(gm: fx.GraphModule, programs: Programs | None, convertible: bool = False) -> bool:
    """:func:`_check_owner_modes` and :func:`_check_nested_modes` under ``torch.compile(gm)``, run at every call
    through one graph break: the compiled code holds each mode's flags as constants, and runs the blocks' forward,
    not their ``__call__``."""
    computed = _check_owner_modes(gm, programs, convertible) if programs is not None else True
    return _check_nested_modes(gm, convertible) and computed


def _check_fsdp_param_dtype(unit: nn.Module) -> None:
    """ValueError where FSDP2's ``param_dtype`` would hand this unit's graph a low-precision copy of a parameter the
    plan reads in float32."""
    low_read = set(_weights.low_read_names(unit))
    nested = [m for name, m in unit.named_modules() if name and is_converted(m)]
    inner = {id(p) for m in nested for p in m.parameters()}
    names = {id(p): n for n, p in unit.named_parameters(remove_duplicate=False)}
    for m in unit.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None or any(m is x for x in nested):
            continue
        policy = getattr(get(), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        if dtype is None or dtype == torch.float32:
            continue
        fsdp_children = [c for c in m.modules() if c is not m and hasattr(c, "_get_fsdp_state")]
        theirs = {id(p) for c in fsdp_children for p in c.parameters()}
        for p in m.parameters():
            name = names.get(id(p))
            if id(p) in inner or id(p) in theirs or name is None or name in low_read:
                continue
            raise ValueError(
                f"fully_shard gathers {name!r} as {str(dtype).removeprefix('torch.')} (its MixedPrecisionPolicy's "
                "param_dtype), but the converted graph reads it in float32: it would compute with a rounded copy. "
                "The graph already casts each weight it reads low, so shard with "
                "MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32) (or no policy), or use "
                "autocastfx.shard(gm), which gathers only the weights the graph reads low in the low dtype")
        if m is unit and getattr(policy, "cast_forward_inputs", False) and _float32_inputs(unit):
            raise ValueError(
                f"fully_shard casts this converted module's inputs to {str(dtype).removeprefix('torch.')} (its "
                "MixedPrecisionPolicy's cast_forward_inputs=True, the default), but its plan takes "
                f"{', '.join(_float32_inputs(unit))} in float32 (a residual stream, as autocast keeps it): they would "
                "be rounded. Shard it with MixedPrecisionPolicy(..., cast_forward_inputs=False), or use "
                "autocastfx.shard(gm)")
    unit.__dict__["_autocastfx_fsdp_checked"] = True


def _float32_inputs(unit: nn.Module) -> list[str]:
    """The float inputs the unit's plan takes in float32 and some op reads so (not only cast low)."""
    plan = getattr(unit.meta.get(K.CONVERTED), "plan", None) if isinstance(unit, fx.GraphModule) else None
    if plan is None:
        return []

    def low(r) -> bool:
        return r.label is True if r.kind == "fixed" else r.kind == "same" and \
            getattr(plan.nodes.get(r.consumer), "label", None) is True
    return [n.name for n in unit.graph.nodes if n.op == "placeholder"
            and getattr(plan.nodes.get(n.name), "label", None) is False
            and not all(low(r) for r in plan.reqs.get(n.name, []))]


_MODULE_FIELDS = frozenset(vars(nn.Module()))
# what nn.Module does for a whole model and a class may do its own way: a module whose class overrides any of these
# may need more than its tensors and settings to answer them, so it keeps the plain container
_MODULE_PROTOCOL = ("train", "eval", "_apply", "state_dict", "_save_to_state_dict", "load_state_dict",
                    "_load_from_state_dict", "__getattr__", "__setattr__", "__delattr__", "__getstate__",
                    "__setstate__", "named_parameters", "named_buffers", "named_modules", "parameters", "children",
                    "get_extra_state", "set_extra_state")
_SETTINGS = "_autocastfx_settings"


def _layer_class(cls: type) -> bool:
    """A class whose instance is its parameters, buffers and plain settings: one of torch.nn's layers (not a
    container, recurrent or lazy layer), or a model's class that overrides none of ``_MODULE_PROTOCOL``."""
    if cls.__module__.startswith("torch.nn.modules."):
        return (cls.__module__ != "torch.nn.modules.container"
                and not issubclass(cls, (nn.RNNBase, nn.modules.lazy.LazyModuleMixin)))
    return (not cls.__module__.startswith("torch.") and type(cls) is type  # no metaclass of its own
            and all(getattr(cls, name) is getattr(nn.Module, name) for name in _MODULE_PROTOCOL))


class _Held:
    """Mixed into a converted module's parameter holder (:func:`adopt_model_classes`), which the graph never calls:
    writing a setting is refused (:class:`_Setting`) and a hook warns. No ``__setattr__`` of its own: FSDP2 swaps a
    parameter by ``_parameters`` alone where a module has none."""

    _autocastfx_fixed_settings = True  # read by calls.module_state: nothing to compare

    @classmethod
    def __init_subclass__(cls, **kwargs):
        """Nothing: the held subclass is not the model's own, so its class's hook (a subclass registry) skips it."""

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save(gm.head)``) as the model's class: the held class exists in this process only."""
        state = {k: v for k, v in self.__dict__.items() if k not in (_SETTINGS, _CLASS, _TIED, _ORDER, MIRROR)}
        return copyreg._reconstructor, (self.__dict__[_CLASS], object, None), state

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != MIRROR}, memo))
        return new  # a copy (an EMA) keeps its own modes

    def train(self, mode: bool = True):
        """``nn.Module.train`` (the model's class's), and the model's module of this name takes the mode: the model
        and the converted module are in one mode, the later call deciding (see ``StateGuard.share_modes``)."""
        out = super().train(mode)
        ref = self.__dict__.get(MIRROR)
        own = ref() if ref is not None else None
        if own is not None and not KEEP_MODEL_MODES.get():
            own.training = self.training  # its children take theirs in their own train()
        return out

    def register_parameter(self, name: str, param) -> None:
        """``nn.Module``'s, refusing what the graph would not read: a parameter under a new name (the first step of
        torch.nn.utils.prune, the legacy weight_norm and spectral_norm, all undone first), or None for a parameter
        the graph reads (``layer.bias = None``)."""
        params = self.__dict__.get("_parameters", {})
        if param is None and params.get(name) is not None:
            raise ValueError(
                f"{type(self).__name__}.{name} is read by the converted graph, which computes this module's ops "
                f"itself: setting it to None after convert() would break the graph, not remove the term. Set "
                f"{name} to None on the model and convert again (gm.state_dict() loads into the model)")
        if name not in params:
            _refuse_flat_parameters(sys._getframe(1))
            _undo_reparametrization(self, name, param, sys._getframe(1))
            raise ValueError(
                f"a new parameter {name!r} on the converted module's {type(self).__name__} would never be read: the "
                "converted graph computes this module's ops itself from the tensors it had at conversion (the "
                "weight a forward pre-hook of torch.nn.utils.prune, weight_norm or spectral_norm recomputes would "
                "be computed once). Prune or reparametrize the model with torch.nn.utils.parametrize "
                "(parametrizations.weight_norm, spectral_norm, or a mask as a parametrization) and convert it: a "
                "parametrization converts and trains as in the model")
        super().register_parameter(name, param)

    def _warn_hook(self, hook) -> None:
        fn = getattr(hook, "func", hook)
        if not getattr(fn, "__module__", "").startswith("torch.distributed."):  # FSDP2's own: it calls them itself
            warn_user(f"autocastfx: a hook on this {type(self).__name__} never runs: the converted graph computes "
                      "this module's ops itself and reads only its tensors. Hook a module the graph "
                      "calls (a converted block, or a leaf such as a norm under symbolic_trace), or return the value "
                      "from the model's forward")


def _refuse_flat_parameters(caller) -> None:
    """ValueError where FSDP1 (``FullyShardedDataParallel``) sets its views of a flat parameter on a held module."""
    for _ in range(4):
        if caller is None:
            return
        if caller.f_globals.get("__name__", "") == "torch.distributed.fsdp._flat_param":
            raise ValueError(
                "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) with use_orig_params=True sets its views of "
                "one flat parameter as new parameters on each module the converted graph reads by name, which a "
                "converted module refuses: shard it with FSDP2 (torch.distributed.fsdp.fully_shard, per block and "
                "then the root) or autocastfx.shard(gm), as docs/distributed.md describes")
        caller = caller.f_back


def _undo_reparametrization(module: nn.Module, name: str, param, caller) -> None:
    """Put back the parameter that torch's legacy weight_norm or spectral_norm has just removed from ``module`` before
    registering ``name`` (its ``_g``/``_v`` or ``_orig``): the module as it was, the model's own parameter again."""
    base = name.rpartition("_")[0]
    if not base or base in module._parameters:
        return
    fn = type(caller.f_locals.get("fn")).__name__ if caller.f_code.co_name == "apply" else None
    if fn == "WeightNorm" and isinstance(caller.f_locals.get("weight"), nn.Parameter):
        module._parameters[base] = caller.f_locals["weight"]  # deleted just before
    elif fn == "SpectralNorm" and name == base + "_orig" and isinstance(param, nn.Parameter):
        module._parameters[base] = param  # the original is the one registered
    else:
        return
    module.__dict__.pop(base, None)
    order = module.__dict__.get(_ORDER, ())  # its place among the parameters, for optimizers built by position
    kept = sorted(module._parameters.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    module._parameters.clear()
    module._parameters.update(kept)


def is_held(module: nn.Module) -> bool:
    """Whether ``module`` is a holder of tensors the converted graph reads (:class:`_Held`), which it never calls."""
    return isinstance(module, _Held)


_POSITIONS = "_autocastfx_positions"  # a held container: the model's container's children names, in order


class _HeldContainer(_GuardsChildren, _Held):
    """A held plain container: the parent of held modules. Where it holds every child of the model's container
    (an nn.ModuleList of blocks, each holding tensors), it is indexed, sliced, iterated and measured as that
    container is."""

    def _positional(self) -> list | None:
        names = self.__dict__.get(_POSITIONS)
        return list(self._modules.values()) if names is not None and tuple(self._modules) == names else None

    def __bool__(self):  # a module is true, as nn.Module's; a list of every child, as the model's list
        children = self._positional()
        return True if children is None else bool(children)

    def __len__(self):
        children = self._positional()
        if children is None:
            raise TypeError(f"this module stands for the model's container without all of its children: {_NO_LIST}")
        return len(children)

    def __iter__(self):
        children = self._positional()
        if children is None:
            raise TypeError(f"this module stands for the model's container without all of its children: {_NO_LIST}")
        return iter(children)

    def __getitem__(self, index):
        children = self._positional()
        if children is not None and isinstance(index, (int, slice)):
            return children[index]
        raise TypeError(
            "this module stands for the model's container (an nn.Sequential, an nn.ModuleList) as a plain one, of the "
            "modules whose tensors the converted graph reads (the graph computes the container's work itself, and "
            f"modules that hold nothing may be absent, so positions would not match): {_NO_LIST}, "
            f"module.get_submodule({str(index)!r}) or getattr(module, {str(index)!r})")


_NO_LIST = "reach a child by its name (module.named_children() lists them)"


class _Setting:
    """A held module's setting, on its class: read from the instance, refused on write (see :class:`_Held`)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        raise ValueError(
            f"{type(obj).__name__}.{self.name} is a constant of the converted graph, which computes this module's "
            "ops itself: setting it after convert() changes nothing the converted module computes. Set it on the "
            "model and convert again (autocastfx.convert(model, ...); gm.state_dict() loads into the model). For "
            "torch.optim.swa_utils.update_bn: load the averaged weights into the unconverted model "
            "(model.load_state_dict(swa_model.module.state_dict())) and run update_bn there")

    def __delete__(self, obj):
        self.__set__(obj, None)


class _Forward:
    """A held module's ``forward``, on its class: the class's own, and refused on write, as the graph never calls it
    (an adapter patched in, ``layer.forward = lambda x: base(x) + lora(x)``, would never run)."""

    def __get__(self, obj, owner=None):
        owner = owner if owner is not None else type(obj)
        forward = super(_Held, owner).forward  # the model's class's
        return forward if obj is None else forward.__get__(obj, owner)

    def __set__(self, obj, value):
        raise ValueError(
            f"{type(obj).__name__}.forward cannot be replaced on the converted module: its graph computes this "
            "module's ops itself and never calls its forward, so a patched forward (a LoRA adapter added as "
            "'layer.forward = ...') would never run. Add the adapter to the model and convert it after "
            "(autocastfx.convert(model, ...)): the frozen base and the adapter then train as in the model")

    def __delete__(self, obj):
        self.__set__(obj, None)


class _Constant(_Setting):
    """A plain attribute of the model (a temperature), answered by the converted module and refused on write."""

    def __init__(self, name: str, value: Any):
        super().__init__(name)
        self.value = value

    def __get__(self, obj, owner=None):
        return self if obj is None else self.value

    def __set__(self, obj, value):
        raise ValueError(
            f"{self.name} is an attribute of the model ({self.name}={self.value!r}), a constant of the converted graph "
            f"wherever the model's forward read it: setting it on the converted module changes nothing it computes. "
            "Set it on the model and convert again (autocastfx.convert(model, ...); gm.state_dict() loads into the "
            "model first if gm was trained)")


def _warned(method: str):
    """``nn.Module``'s ``method`` (a hook registration), warning first that the hook never runs (:class:`_Held`)."""
    def register(self, hook, *args, **kwargs):
        self._warn_hook(hook)
        return getattr(super(_Held, self), method)(hook, *args, **kwargs)
    register.__name__, register.__qualname__ = method, f"_Held.{method}"
    return register


for _method in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                "register_full_backward_pre_hook"):
    setattr(_Held, _method, _warned(_method))
del _method


_HELD: dict[tuple, type] = {}
_CLASS = "_autocastfx_class"  # a held module's model class (nn.Module for a plain container)
_TIED = "_autocastfx_tied"  # a held module's weights the model ties to other names -> those names
_ORDER = "_autocastfx_order"  # a held module's parameter names, in order
# not settings: nn.Module's, and a held module's own
_OWN_FIELDS = _MODULE_FIELDS | {_SETTINGS, _CLASS, _TIED, _ORDER, MIRROR}


def check_replacement(parent: nn.Module, name: str, value: Any, caller=None) -> None:
    """ValueError where ``value`` would replace ``parent``'s held child ``name`` (see :class:`_Held`) with a module
    of another class: the graph would read the new module's tensors and go on computing the old one's ops."""
    old = parent.__dict__.get("_modules", {}).get(name)
    if old is None and isinstance(value, (nn.Module, nn.Parameter)):
        held = parent.__dict__.get("_parameters", {})
        if name not in held:
            _refuse_tied_name(parent, name)
        elif value is not held[name] and not _trusted_write(caller or sys._getframe(2), root=True):
            tied = _root_tie(parent, name)
            if tied is not None:
                _refuse_retie(*tied)
    if not isinstance(old, _Held) or value is old or not isinstance(value, nn.Module):
        return
    for leaf, tied in old.__dict__.get(_TIED, {}).items():
        if value._parameters.get(leaf) is not old._parameters.get(leaf):
            _refuse_retie(*tied)
    cls = old.__dict__.get(_CLASS)
    if cls is None:
        return
    if type(value) in (cls, type(old)):
        shapes = [{k: tuple(t.shape) for k, t in getattr(m, table).items() if t is not None}
                  for m in (old, value) for table in ("_parameters", "_buffers")]
        settings = {k: (old.__dict__.get(k), value.__dict__.get(k)) for k in old.__dict__.get(_SETTINGS, ())}
        changed = {k: v for k, (u, v) in settings.items() if u != v}
        if shapes[:2] == shapes[2:] and not changed:
            return
        if changed:
            raise ValueError(
                f"{name!r} is a {cls.__name__} whose ops the converted graph computes itself with its settings as "
                f"constants; the new one's differ ({', '.join(f'{k}={v!r}' for k, v in changed.items())}). Make the "
                "change on the model and convert again (gm.state_dict() loads into the model where the shapes agree)")
        raise ValueError(
            f"{name!r} is a {cls.__name__} whose ops the converted graph computes itself, planned for its tensors' "
            f"shapes {shapes[0]}; the new one's are {shapes[2]}. Make the change on the model and convert again "
            "(gm.state_dict() loads into the model where the shapes agree)")
    what = f"a {cls.__name__}" if cls is not nn.Module else "the holder of the tensors of the model's module of " \
        "that name,"
    raise ValueError(
        f"{name!r} is {what} whose ops the converted graph computes itself, reading only its tensors: "
        f"replacing it with a {type(value).__name__} (SyncBatchNorm.convert_sync_batchnorm, a LoRA wrapper) would "
        "change nothing the graph computes. Make the change on the model and convert again (gm.state_dict() loads "
        "into the model)")


def _root_tie(parent: nn.Module, name: str) -> tuple | None:
    """(name, the model's other names) where ``parent``'s own parameter ``name`` is a weight the model ties to names
    the converted module does not hold (see :func:`_tied_setattr`); else None."""
    info = parent.__dict__.get("meta", {}).get(K.CONVERTED) if isinstance(parent, fx.GraphModule) else None
    for names in getattr(info, "source_params", {}).values():
        if name in names and len(names) > 1:
            own = {n for n, _ in parent.named_parameters(remove_duplicate=False)}
            others = tuple(n for n in names if n not in own)
            return (name, others) if others else None
    return None


def _refuse_tied_name(parent: nn.Module, name: str) -> None:
    """ValueError where ``name`` is where the model had a module or weight that the converted module reads through
    another name (a head tied to the embedding): a new one there would be in its parameters and state dict, unread."""
    info = parent.__dict__.get("meta", {}).get(K.CONVERTED) if isinstance(parent, fx.GraphModule) else None
    for names in getattr(info, "source_params", {}).values():
        if len(names) > 1 and any(n == name or n.startswith(name + ".") for n in names):
            here = next(n for n in names if n == name or n.startswith(name + "."))
            raise ValueError(
                f"{name!r} is where the model had {here!r}, a weight tied to "
                f"{', '.join(repr(n) for n in names if n != here)}, which the converted graph reads under one name: a "
                "module or parameter set there would be in gm.parameters() and gm.state_dict() and never read (and a "
                "checkpoint would carry it over the tied weight). Make the change on the model (untie or replace its "
                "head) and convert again")


def _no_flat_buffer(self) -> None:
    """``flatten_parameters()`` of a recurrent layer the converted graph computes: it reads each weight by name,
    so there is no flat buffer to lay out (on a CPU the layer's own is a no-op too)."""


def _tied_setattr(self, name, value):
    """A held module's ``__setattr__`` where it holds a weight the model ties to another name (an embedding whose
    matrix is the head's too): the graph reads both uses through this one parameter, so a new one here is refused,
    but for the writes :func:`_trusted_write` names."""
    tied = self.__dict__.get(_TIED, {}).get(name)
    if tied and value is not self._parameters.get(name) and not _trusted_write(sys._getframe(1)):
        _refuse_retie(*tied)
    _next_after(self, "__setattr__", _tied_setattr)(name, value)


def _tied_delattr(self, name):
    """:func:`_tied_setattr` for deleting the weight (the first step of ``register_parametrization``)."""
    tied = self.__dict__.get(_TIED, {}).get(name)
    if tied and not _trusted_write(sys._getframe(1)):
        _refuse_retie(*tied)
    _next_after(self, "__delattr__", _tied_delattr)(name)


def _tied_load(self, state_dict, prefix, local_metadata, *args):
    """A held tied module's ``_load_from_state_dict``: a load into it alone with ``assign=True`` (``prefix`` empty)
    that gives the tied weight a new tensor is refused before any of its tensors is assigned (torch's own loop
    would assign the others, then raise)."""
    if not prefix and local_metadata.get("assign_to_params_buffers", False):
        for name, tied in self.__dict__.get(_TIED, {}).items():
            value = state_dict.get(name)
            if value is not None and value is not self._parameters.get(name):
                _refuse_retie(*tied)
    _next_after(self, "_load_from_state_dict", _tied_load)(state_dict, prefix, local_metadata, *args)


def _next_after(obj, method: str, fn):
    """``obj``'s ``method`` as the class after the one that defines it as ``fn`` has it (``super()`` for a function
    put in a class made at run time, whose class may be subclassed again: FSDP2's)."""
    mro = type(obj).__mro__
    at = next(i for i, c in enumerate(mro) if c.__dict__.get(method) is fn)
    return getattr(super(mro[at], obj), method)


def _trusted_write(caller, root: bool = False) -> bool:
    """FSDP2's own swap of a parameter (sharded, unsharded), or a ``load_state_dict(..., assign=True)`` of a module
    above the held one, whose untying loads :func:`weights._refuse_untied` refuses first (a load of the held module
    alone, ``prefix`` empty, is not; the converted ``root``'s own is)."""
    return caller.f_globals.get("__name__", "").startswith("torch.distributed.") or (
        caller.f_code is nn.Module._load_from_state_dict.__code__ and (root or bool(caller.f_locals.get("prefix"))))


def _refuse_retie(name: str, others: tuple[str, ...]) -> None:
    raise ValueError(
        f"{name!r} is a weight the model ties to {', '.join(map(repr, others))}, and the converted graph reads every "
        "use of it through this one parameter: a new one here (or a parametrization, or a load into this module "
        "alone with assign=True) would change it in all of them, where the same change on the model unties them "
        "(the others keep the old tensor). To give the tied weight new values, copy into it "
        f"(with torch.no_grad(): gm.{name}.copy_(new)); to untie it, make the change on the model and convert "
        "again")


def _held_class(cls: type, settings: frozenset = frozenset(), recurrent: bool = False, tied: bool = False) -> type:
    """``cls`` with :class:`_Held` in front (:class:`_HeldContainer` for a plain container) and a :class:`_Setting`
    for each of ``settings``: the same name, ``isinstance`` of ``cls``; a plain container standing for a
    ``recurrent`` layer keeps its ``flatten_parameters()``, which training scripts call after loading; one holding a
    ``tied`` weight refuses a new one (:func:`_tied_setattr`)."""
    if issubclass(cls, _Held):
        return cls
    key = (cls, settings, recurrent, tied)
    if key not in _HELD:
        mixin = _HeldContainer if cls is nn.Module else _Held
        extra = {"flatten_parameters": _no_flat_buffer} if recurrent else {}
        extra.update({"__setattr__": _tied_setattr, "__delattr__": _tied_delattr,
                      "_load_from_state_dict": _tied_load} if tied else {})
        _HELD[key] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                        "forward": _Forward(), **extra,
                                                        **{k: _Setting(k) for k in settings}})
    return _HELD[key]


def _tensor_names(m: nn.Module, table: str) -> set[str]:
    return {k for k, v in getattr(m, table).items() if v is not None}


def _hold(sub: nn.Module, cls: type, settings: dict, recurrent: bool = False, tied: dict | None = None) -> bool:
    """Make ``sub`` a held ``cls`` with ``settings`` (read-only where public) and ``tied`` (its tied weights' names
    -> their names in the converted module and their other names in the model); False, ``sub`` as it was, where the
    class does not take the container's layout (``__slots__``) or cannot describe it (its ``extra_repr``)."""
    kept = dict(sub.__dict__)
    public = frozenset(k for k in settings if not k.startswith("_"))
    sub.__dict__.update(settings)
    sub.__dict__.update({_SETTINGS: public, _CLASS: cls, _ORDER: tuple(sub._parameters),
                         **({_TIED: tied} if tied else {})})
    try:
        sub.__class__ = _held_class(cls, public, recurrent, bool(tied))
        sub.extra_repr()
        return True
    except Exception:  # noqa: BLE001 - the plain container it was
        sub.__class__ = nn.Module
        sub.__dict__.clear()
        sub.__dict__.update(kept)
        return False


def hold_unread(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` each parameter and buffer of ``model`` that it does not hold (a layer no program reads, or one
    only another mode's program reads), at the model's name, in plain containers as the graph's own: ``gm``'s
    parameters and state dict are then the model's whole (an unused layer's weights too), not only what this
    program reads. Converted blocks inside ``gm`` hold their own."""
    held = {id(t) for _, t in itertools.chain(gm.named_parameters(remove_duplicate=False),
                                              gm.named_buffers(remove_duplicate=False))}
    for path, mod in model.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for name, t in mod.__dict__[table].items():
                if t is None or id(t) in held:
                    continue
                held.add(id(t))
                holder = _plain_container(gm, path, model)
                if holder is None or name in holder.__dict__[table] or name in holder.__dict__ \
                        or name in holder.__dict__["_modules"]:
                    continue
                holder.__dict__[table][name] = t
                if table == "_buffers" and name in mod._non_persistent_buffers_set:
                    holder._non_persistent_buffers_set.add(name)


def _plain_container(gm: nn.Module, path: str, model: nn.Module) -> nn.Module | None:
    """``gm``'s module at ``path``, plain containers made where there is none (in the model's modes); None where a
    converted block or another non-plain module is on the way."""
    m = gm
    walked = []
    for part in path.split(".") if path else ():
        walked.append(part)
        child = m._modules.get(part)
        if child is None:
            child = nn.Module()
            child.training = model.get_submodule(".".join(walked)).training
            m._modules[part] = child
        elif type(child) is not nn.Module:
            return None
        m = child
    return m


def adopt_model_classes(gm: nn.Module, model: nn.Module) -> None:
    """Give each plain container of ``gm`` the class and read-only settings of the model's module of that name where
    :func:`_adoptable`, so loops that find modules by class (freezing batch norms, weight-decay groups) still find
    them; other containers stay plain, held too."""
    models = dict(model.named_modules(remove_duplicate=False))
    ties = {i: names for i, names in names_by_id(model).items() if len(names) > 1}
    tied: dict[str, dict[str, tuple]] = {}  # held module -> its tied weights -> (its name, their other names)
    mine: dict[int, list[str]] = {}
    for n, p in gm.named_parameters(remove_duplicate=False):
        mine.setdefault(id(p), []).append(n)
    for i, names in mine.items():
        if i in ties and len(names) < len(ties[i]):  # read under fewer names than the model has
            for n in names:
                path, _, leaf = n.rpartition(".")
                tied.setdefault(path, {})[leaf] = (n, tuple(x for x in ties[i] if x not in names))
    for name, sub in gm.named_modules(remove_duplicate=False):
        if not name or type(sub) is not nn.Module:
            continue
        own = models.get(name)
        if own is not None and _adoptable(sub, own):
            for table in ("_parameters", "_buffers"):  # a convolution without bias: its bias None, as in the model
                for key, value in getattr(own, table).items():
                    if value is None:
                        getattr(sub, table).setdefault(key, None)
            settings = {k: v for k, v in vars(own).items() if k not in _OWN_FIELDS and k not in sub.__dict__}
            if _hold(sub, own.__dict__.get(_CLASS, original_class(own)), settings, tied=tied.get(name)):
                continue
        # a container the model's code reads settings of (``layer.self_attn.batch_first`` in TransformerEncoder):
        # its plain settings, read-only
        plain = {k: v for k, v in vars(own).items() if k[0] != "_" and k not in _OWN_FIELDS
                 and k not in sub.__dict__ and is_plain_setting(v)} if own is not None else {}
        if isinstance(own, (nn.ModuleList, nn.Sequential)):  # positions hold where every child is held
            sub.__dict__[_POSITIONS] = tuple(own._modules)
        recurrent = isinstance(own, nn.RNNBase)
        if not (plain or recurrent or name in tied) or not _hold(sub, nn.Module, plain, recurrent, tied.get(name)):
            _hold(sub, nn.Module, {}, tied=tied.get(name))


def stand_in_for_settings(gm: nn.Module, model: nn.Module) -> None:
    """A held module for each of the model's modules with plain settings and no tensors that the graph computes
    itself (a drop path, a dropout subclass): a schedule that finds them by class (``for m in gm.modules(): if
    isinstance(m, DropPath): m.drop_prob = ...``) finds them, and its write is refused (:class:`_Setting`) where it
    would otherwise change nothing."""
    mine = dict(gm.named_modules(remove_duplicate=False))
    for name, own in model.named_modules(remove_duplicate=False):
        parent = mine.get(name.rpartition(".")[0])
        if not name or name in mine or parent is None or own._modules or own._parameters or own._buffers:
            continue
        cls = own.__dict__.get(_CLASS, original_class(own))
        settings = {k: v for k, v in vars(own).items() if k not in _OWN_FIELDS}
        if not (_layer_class(cls) and any(k[0] != "_" for k in settings)
                and all(is_plain_setting(v) for v in settings.values())):
            continue
        sub = nn.Module()
        sub.training = own.training
        if _hold(sub, cls, settings):
            parent._modules[name.rpartition(".")[2]] = sub  # not set through the parent: it refuses new children
            mine[name] = sub


def _adoptable(sub: nn.Module, own: nn.Module) -> bool:
    """Whether the container ``sub`` can be the model's module ``own``: a layer's class, no children, the same
    tensors, and nothing else in the instance but plain settings."""
    cls = own.__dict__.get(_CLASS, original_class(own))
    return (_layer_class(cls) and not own._modules
            and all(_tensor_names(sub, t) == _tensor_names(own, t) for t in ("_parameters", "_buffers"))
            and all(is_plain_setting(v) for k, v in vars(own).items()
                    if k not in _OWN_FIELDS and k not in sub.__dict__))


_BASES: dict[type, type] = {}


# the model's methods that change its tensors' shapes in place (Hugging Face's): the graph holds the shapes, and
# the model itself would be left changed before the converted module could refuse the new modules
_RESHAPING = frozenset({"resize_token_embeddings", "prune_heads", "resize_position_embeddings"})


def _refused(name: str):
    def refuse(self, *args, **kwargs):
        raise ValueError(
            f"{name}() changes the model's tensor shapes, which the converted graph holds as constants; nothing was "
            f"changed. Call model.{name}(...) on the model, then convert it again (autocastfx.convert(model, ...); "
            "gm.state_dict() loads into the model first if gm was trained)")
    refuse.__name__ = name
    return refuse


def add_model_surface(gm: nn.Module) -> None:
    """Put on the converted module's own class what the model has and GraphModule lacks: methods, properties and
    class attributes (``gm.generate()``), plain attributes (``gm.config``) and ``dtype`` (float32). On the class,
    not in a ``__getattr__``, so the generated forward's attribute reads stay fast."""
    info = gm.meta.get("autocastfx")
    cls = getattr(info, "model_class", None)
    if cls is None:
        return
    own = type(gm)
    base = own.__mro__[1]
    own._get_name = lambda self: cls.__name__  # the model's name, which libraries match (HF's causal-LM list)
    for klass in reversed(cls.__mro__):
        if klass in (nn.Module, object) or klass in base.__mro__:
            continue
        for name, value in vars(klass).items():
            if not (name.startswith("__") or name == "dtype" or hasattr(base, name)):
                setattr(own, name, _refused(name) if name in _RESHAPING and callable(value) else value)
    for name, value in info.model_attrs.items():
        if not hasattr(base, name) and name not in gm.__dict__:
            if name[0] != "_" and is_plain_setting(value):  # the graph holds what the model's code read of it
                value = _Constant(name, value)
            setattr(own, name, staticmethod(value) if inspect.isfunction(value) else value)
    if hasattr(cls, "dtype") and not hasattr(base, "dtype"):
        own.dtype = property(lambda self: torch.float32)


def install(gm: fx.GraphModule, programs: dict[str, fx.GraphModule] | None = None, current: str | None = None,
            owners: set[str] = frozenset()) -> None:
    """Give ``gm`` its class (``train()``/``eval()``, the call, the model's surface), replacing torch.export's methods
    that raise. With several ``programs`` (by mode, ``gm`` among them): a graph per mode over ``gm``'s tensors,
    ``current``'s running, and the modes of ``owners`` (module names) checked at each call."""
    base = next(c for c in type(gm).__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    if not issubclass(base, _Switchable):
        if base not in _BASES:
            _BASES[base] = type(f"Converted{base.__name__.lstrip('_')}", (_Switchable, base), {})
        base = _BASES[base]
    gm.__dict__.pop("train", None)  # ep.module() sets instance attributes that raise NotImplementedError
    gm.__dict__.pop("eval", None)
    gm.__class__ = type("GraphModuleImpl", (base,), {})  # GraphModule keeps forward on a class of its own
    add_model_surface(gm)
    if programs and len(programs) > 1:
        graphs = {k: p.graph if p is gm else _adopt(gm, p) for k, p in programs.items()}
        gm.meta[K.PROGRAMS] = Programs(graphs, current)
        note_owners(gm, owners)
        gm.graph = graphs[current]
    gm.recompile()


def note_owners(gm: fx.GraphModule, owners: set[str]) -> None:
    """Note the mode now of each of ``owners`` (module names) that ``gm`` holds, checked at each call: called again
    once ``gm`` holds more of the model's modules (:func:`stand_in_for_settings`)."""
    programs: Programs | None = gm.meta.get(K.PROGRAMS)
    if programs is None:
        return
    for name in owners:
        if name not in programs.owners:
            try:
                programs.owners[name] = gm.get_submodule(name).training
            except AttributeError:  # a module the graph module does not keep: nothing to check
                pass


class _Unannounced:
    """First base of a class made over the model's: its ``__init_subclass__`` does nothing, so the model class's
    hook (a registry of its subclasses) is not told of it."""

    @classmethod
    def __init_subclass__(cls, **kwargs):
        pass


_AS_MODEL: dict[tuple[type, type], type] = {}


def _module_init(self, *args, **kwargs):
    nn.Module.__init__(self)


def as_model_class(part: nn.Module, original: nn.Module) -> None:
    """Make ``part`` (a converted part in place of the model's module ``original``) an instance of ``original``'s
    class too where that is a layer's class (:func:`_layer_class`), its plain settings read-only."""
    cls = original_class(original)
    if cls is nn.Module or not _layer_class(cls) or isinstance(part, cls):
        return
    impl = type(part)
    base = next(c for c in impl.__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    if (base, cls) not in _AS_MODEL:
        # GraphModule.__init__ calls super().__init__() (a copy runs it): the model's class comes after it, through
        # a class whose __init__ is nn.Module's
        shim = type(cls.__name__, (_Unannounced, cls), {"__init__": _module_init, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
        _AS_MODEL[base, cls] = type(f"{base.__name__}As{cls.__name__}", (base, shim), {"__module__": base.__module__})
    settings = {k: v for k, v in vars(original).items()
                if k != "training" and k not in part.__dict__ and is_plain_setting(v)}
    part.__dict__.update(settings)
    part.__dict__[_READ] = frozenset(settings) | part.__dict__.get(_READ, frozenset())
    part.__class__ = type("GraphModuleImpl", (_AS_MODEL[base, cls],), {})
    add_model_surface(part)
    part.recompile()


def _stateless_twins(a, b) -> bool:
    """Two graph modules that run the same code on no state of their own (torch.export's ``_guards_fn``)."""
    return (isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule) and a.code == b.code
            and not any(True for _ in a.parameters()) and not any(True for _ in a.buffers())
            and not any(True for _ in b.parameters()) and not any(True for _ in b.buffers()))


def _twin_modules(a, b) -> bool:
    """Two leaf modules of one class over the same tensors with the same settings (a copy's and the model's)."""
    if not (isinstance(a, nn.Module) and isinstance(b, nn.Module)) or isinstance(a, fx.GraphModule) \
            or original_class(a) is not original_class(b) or a._modules or b._modules:
        return False
    same = all(getattr(a, t).keys() == getattr(b, t).keys() and all(v is getattr(b, t)[k] for k, v in
                                                                      getattr(a, t).items())
               for t in ("_parameters", "_buffers"))
    plain = lambda m: {k: v for k, v in vars(m).items() if k != "training" and is_plain_setting(v)}  # noqa: E731
    return same and plain(a) == plain(b)


def _adopt(gm: fx.GraphModule, other: fx.GraphModule) -> fx.Graph:
    """``other``'s graph, reading ``gm``'s attributes: what ``other`` holds under a name where ``gm`` holds something
    else (a capture's own constant, a module of its own) is given to ``gm`` under a new name."""
    for n in other.graph.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        theirs, mine = fetch(other, n.target), fetch(gm, n.target, None)
        if theirs is mine or (isinstance(theirs, torch.Tensor) and isinstance(mine, torch.Tensor)
                              and theirs.shape == mine.shape and theirs.dtype == mine.dtype
                              and theirs.device == mine.device and (mine.is_meta or torch.equal(theirs, mine))) \
                or _stateless_twins(theirs, mine) or _twin_modules(theirs, mine):
            continue
        base = str(n.target).replace(".", "_") + "_mode"
        name, i = base, 0
        while fetch(gm, name, None) is not None:
            i += 1
            name = f"{base}{i}"
        if isinstance(theirs, nn.Module):
            gm.add_submodule(name, theirs)
        elif isinstance(theirs, nn.Parameter):
            gm.register_parameter(name, theirs)
        elif isinstance(theirs, torch.Tensor):
            gm.register_buffer(name, theirs, persistent=False)
        else:
            setattr(gm, name, theirs)
        n.target = name
    return other.graph
