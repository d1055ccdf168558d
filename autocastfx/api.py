"""``convert()`` and ``convert_graph()``: options checked once, then the model captured and rewritten by the core
passes, as one graph or as a tree of blocks. The tree gets this file's conversions as callbacks
(``tree.parts.Conversions``), so it never imports it.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .base import keys as K
from .base.errors import CaptureError, one_line
from .base.quiet import deepcopy_quietly, own_warnings_off, quiet_torch_logs, torch_internal_warnings_off, warn_user
from .base.meta import HOOK_TABLES, ConvertInfo, is_converted, names_by_id
from .base.options import LOW_DTYPES, ConvertOptions
from .base.runtime import KEEP_MODEL_MODES, no_recompile
from .capture import inline as _inline
from .capture.context import CaptureContext
from .capture.programs import Captured, ModeWritesError, capture as capture_programs, derive_from_graph, \
    no_tensor_writes
from .capture.trace import copy_model, tensors_kept, unregistered_tensors
from .converted import calls as _calls
from .converted import module as _module
from .converted.state import guard_for, warn_model_hooks
from .core import devices as _devices
from .core import layout as _layout
from .core import modes as _modes
from .core import rewrite as _rewrite
from .core import weights as _weights
from .core.pipeline import run_passes
from .core.policy import Policy, op_name
from .core.propagate import propagate
from .tree.blocks import Conversions, choose, convert_tree, why_not_captured
from .tree.parts import has_gemm
from .tree.piecewise import convert_piecewise

__all__ = ["convert", "convert_graph", "ConvertOptions", "ConvertInfo", "master_parameters", "materialize"]


def convert(model: nn.Module, example_inputs: tuple | None = None, *, example_kwargs: dict | None = None,
            dtype: torch.dtype | str | None = None, policy: Policy | None = None, pad_multiple: int = 8,
            master_weights: bool = False, keep_io_types: bool = True, memory_format: str = "auto",
            blocks: Any = "auto") -> fx.GraphModule:
    """Rewrite ``model`` into an explicit mixed-precision ``torch.fx.GraphModule`` over the same parameters and
    buffers, whose ``state_dict()`` is the float32 model; ``model``'s modules and code are not changed.

    Args:
        dtype: ``torch.float16`` (the default, ``None``), ``torch.bfloat16``, or ``"auto"``: the one with fast
            kernels on the model's device, else float32 compute (the report says which and why). An explicit dtype
            without fast kernels warns (``autocastfx.SlowDtypeWarning``).
        blocks: ``"auto"`` converts the repeated children of ``nn.ModuleList``s as modules of their own; a list of
            names or a function ``(name, module) -> bool`` picks others; ``None`` makes one graph. The README
            describes the other options.

    Raises ValueError for bad options, TypeError for a model that is not an ``nn.Module``,
    ``autocastfx.CaptureError`` if capture fails.

    Example::

        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    """
    if master_weights is not False:
        raise ValueError("master_weights=True is gone: a converted module's parameters are the float32 model, and "
                         "its graph casts each weight to the low dtype once per forward (gm.parameters() are the "
                         "masters). For a module that stores its weights low for deployment, use "
                         "autocastfx.for_inference(gm)")
    args, kwargs = _unaliased(*_check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple))
    dtype, note = _devices.resolve(dtype, _device_of(model, args, kwargs))
    if dtype == torch.float32:  # "auto" where no low dtype pays: the model's dtypes, no low copies, no padding
        pad_multiple = 1
    policy = policy if policy is not None else Policy.default()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an autocastfx.Policy, got {type(policy).__name__}")
    options = ConvertOptions(dtype=dtype, policy=policy, pad_multiple=pad_multiple,
                             keep_io_types=keep_io_types, memory_format=_layout.check_memory_format(memory_format),
                             blocks=blocks)
    out = _convert_any(model, args, kwargs, options, CaptureContext())
    _refuse_lost_backward_hooks(model, out)
    _weights.model_order(out, model)  # gm.parameters() in the model's order
    root = getattr(out, "meta", {}).get(K.CONVERTED) if isinstance(out, fx.GraphModule) else None
    if root is not None:
        root.state_keys = tuple(model.state_dict(keep_vars=True))
    _keep_checks(out, model, args, kwargs)
    if isinstance(out, fx.GraphModule):  # its converted blocks, found once: a compiled call checks their modes
        _module.index_blocks(out)
        _module.note_fixed_sizes(out)  # before any compile: read under one, it would cost a graph break
    if note:
        for _, unit in _weights.converted_units(out):
            unit.meta[K.CONVERTED].extra_totals["dtype_choice"] = note
    return out


def convert_graph(gm: fx.GraphModule, example_inputs: tuple | None = None, config: ConvertOptions | None = None,
                  *, example_kwargs: dict | None = None) -> fx.GraphModule:
    """Run ``convert()``'s passes, without capture, on a module the caller already captured as one graph (as
    ``prepare_pt2e`` takes one); the result shares ``gm``'s tensors.

    Args:
        gm: a ``torch.fx.GraphModule`` whose matmuls and convolutions are function or aten calls
            (``torch.export.export(model, args).module()``); one calling a Linear or convolution module as a leaf
            (plain ``torch.fx.symbolic_trace``) is a ValueError.
        config: an ``autocastfx.ConvertOptions``; ``None`` for the defaults. Its ``blocks`` does not apply.

    Example::

        gm = torch.export.export(model, (x,)).module()
        low = autocastfx.convert_graph(gm, (x,), autocastfx.ConvertOptions(dtype=torch.bfloat16))
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"convert_graph takes a torch.fx.GraphModule, got {type(gm).__name__}: capture the model "
                        "first (torch.export.export(model, args).module() or torch.fx.symbolic_trace(model)), or "
                        "use autocastfx.convert(model, example_inputs), which captures it itself")
    config = config if config is not None else ConvertOptions()
    if not isinstance(config, ConvertOptions):
        raise TypeError(f"config must be an autocastfx.ConvertOptions, got {type(config).__name__}")
    leaves = _gemm_leaves(gm)
    if leaves:
        raise ValueError(f"the graph calls {leaves[0][1]} {leaves[0][0]!r} as a leaf module ({len(leaves)} such "
                         "calls): the matmuls inside are out of reach of a pass over the graph, and nothing would "
                         "run low. Capture with torch.export.export(model, args).module(), whose graph holds the "
                         "aten ops, or let autocastfx.convert(model, example_inputs) capture the model")
    return convert(gm, example_inputs, example_kwargs=example_kwargs, dtype=config.dtype, policy=config.policy,
                   pad_multiple=config.pad_multiple, keep_io_types=config.keep_io_types,
                   memory_format=config.memory_format, blocks=None)


# One conversion at a time per process, as captures are not thread-safe: torch.fx's Tracer patches
# nn.Module.__call__ and __getattr__ process-wide while tracing (torch/fx/_symbolic_trace.py, _Patcher), and
# torch.export keeps tracing state in module globals (pytorch/pytorch#195099). Re-entrant: a conversion converts its
# blocks and parts through here. A module another thread calls meanwhile runs as it would untraced
# (capture.trace.ModelTracer checks the thread; torch.export's tracer runs a module it does not hold).
_KEEP_MODEL_MODES = threading.RLock()


def _convert_any(model: nn.Module, args: tuple, kwargs: dict, options: ConvertOptions,
                 ctx: CaptureContext) -> nn.Module:
    """A float32 model (or one on meta), or a low-precision checkpoint (converted as its float32 twin)."""
    with _KEEP_MODEL_MODES, quiet_torch_logs():  # once: each logger level set clears every logger's cache
        token = KEEP_MODEL_MODES.set(True)
        try:
            return _convert_any_alone(model, args, kwargs, options, ctx)
        finally:
            KEEP_MODEL_MODES.reset(token)


def _convert_any_alone(model: nn.Module, args: tuple, kwargs: dict, options: ConvertOptions,
                       ctx: CaptureContext) -> nn.Module:
    low = _low_weights(model)
    if low:  # a low-precision checkpoint: converted as its float32 form on meta, then its values loaded
        return _convert_low_model(model, low, args, kwargs, options, ctx)
    if any(t.is_meta for t in _tensors(model)):
        # shapes alone, for the device of the real example inputs (the CPU where they are on meta too): the
        # parameters and buffers stay on meta, for gm.to_empty(device=...) and gm.load_state_dict(...)
        ctx = ctx.replace(meta_device=_device_of(model, args, kwargs))
    return _convert_model(model, args, kwargs, options, ctx)


def _conversions() -> Conversions:
    """What the tree of blocks is given to convert its parts with."""
    def whole(module, args, kwargs, options, ctx):
        return _convert_any(module, args, kwargs, options.replace(blocks=None), ctx)

    def block(module, args, kwargs, options, ctx):
        return _convert_one_graph(module, args, kwargs, options, ctx, entry_casts=True)

    return Conversions(whole=whole, block=block)


def _device_of(model, example_inputs, example_kwargs) -> torch.device:
    """The device the model runs on: its first tensor not on meta, else its inputs', else the CPU."""
    tensors = list(_tensors(model)) if isinstance(model, nn.Module) else []
    tensors += [t for t in torch.utils._pytree.tree_leaves((example_inputs, example_kwargs))
                if isinstance(t, torch.Tensor)]
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def _low_weights(model) -> dict[str, torch.dtype]:
    """Name -> dtype of each float16/bfloat16 parameter or buffer of a model that holds no meta tensor (a
    low-precision checkpoint loaded as it is); empty for a float32 model and for a converted one."""
    if not isinstance(model, nn.Module) or isinstance(model, fx.GraphModule) or is_converted(model):
        return {}
    units = {id(t) for name, m in model.named_modules() if name and is_converted(m)
             for t in itertools.chain(m.parameters(), m.buffers())}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    if any(t.is_meta for _, t in named):
        return {}
    return {n: t.dtype for n, t in named if id(t) not in units and t.dtype in LOW_DTYPES}


def _convert_low_model(model: nn.Module, low: dict, args: tuple, kwargs: dict, options: ConvertOptions,
                       ctx: CaptureContext) -> nn.Module:
    """Convert a model holding float16/bfloat16 parameters or buffers after upcasting each in place, as
    ``model.float()`` does, so the converted module shares the model's Parameter objects (an optimizer built
    before ``convert()`` trains what it runs); a warning says the model is float32 after."""
    if any(is_converted(m) for name, m in model.named_modules() if name):
        raise ValueError("convert() takes a low-precision model without converted blocks inside; convert its "
                         "blocks after, or convert model.float()")
    upcast = set()
    with torch.no_grad():
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for t in table.values():
                    if t is not None and t.dtype in LOW_DTYPES:
                        upcast.add(id(t))
                        t.data = t.data.float()  # in place: the same object, for whatever holds it already
                        if t.grad is not None:
                            t.grad = t.grad.float()
    kinds = sorted({str(d).replace("torch.", "") for d in low.values()})
    warn_user(f"autocastfx: {type(model).__name__}'s {' and '.join(kinds)} parameters and buffers ({len(low)}) "
                  "are now float32, upcast exactly in place (as model.float() does): a converted module's "
                  "parameters are the model's float32 weights, which its programs cast per op. An optimizer that "
                  "has stepped them holds its state in the old dtype: reload it, which casts the state to the "
                  "parameters' (optimizer.load_state_dict(optimizer.state_dict()))")
    gm = _convert_any(model, args, kwargs, options, ctx)
    for _, unit in _weights.converted_units(gm):
        unit.meta[K.CONVERTED].upcast = frozenset(upcast)
        unit.meta[K.CONVERTED].extra_totals["weights_from"] = (
            f"the model's {' and '.join(kinds)} values ({len(low)} tensors), upcast exactly in place into float32")
    return gm


def _meta_twin(model: nn.Module, everything: bool = False) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are float32 (floating ones) tensors on the meta device:
    its structure and code without its memory; ``everything``: its plain tensor attributes too."""
    memo = {}
    extra = [t for m in model.modules() for t in torch.utils._pytree.tree_leaves(
        [v for v in vars(m).values() if isinstance(v, (torch.Tensor, list, tuple, dict))])
        if isinstance(t, torch.Tensor)] if everything else []  # its tensors in lists and dicts too: no real copies
    for t in itertools.chain(_tensors(model), extra):
        if id(t) not in memo:
            shell = torch.empty_like(t, device="meta", dtype=torch.float32 if t.is_floating_point() else t.dtype)
            memo[id(t)] = nn.Parameter(shell, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else shell
    return copy.deepcopy(model, memo)


def _keep_checks(out: nn.Module, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Keep the model on meta on the converted module, for its own input checks (``calls.model_check``) and
    conversions for other calls."""
    info = out.meta.get(K.CONVERTED) if isinstance(getattr(out, "meta", None), dict) else None
    if info is None or isinstance(model, fx.GraphModule) or not hasattr(out, "graph"):
        return
    try:
        twin = _meta_twin(model, everything=True)
    except Exception:  # noqa: BLE001 - a model that does not deep-copy keeps torch's errors only
        return
    for m in twin.modules():  # the user's hooks are not run on meta (they may count, log or move tensors)
        for hooks in HOOK_TABLES:
            if isinstance(getattr(m, hooks, None), dict):
                getattr(m, hooks).clear()
    info.checks = _calls.checks_for(twin, args, kwargs)
    info.convert_call = _convert_for_call


@torch.compiler.disable  # under torch.compile(gm), converted eagerly: traced, the conversion took seconds more
def _convert_for_call(gm: nn.Module, args: tuple, kwargs: dict, state: tuple = (), widen: bool = True
                      ) -> nn.Module:
    """The model kept on meta, converted for a call of another structure with ``gm``'s options and module ``state``
    (``calls.module_state``), sharing ``gm``'s tensors (calls.other_call); TypeError naming both calls on failure.
    Not ``widen``: for the call's own sizes (a capture that fixed the example's)."""
    info = gm.meta[K.CONVERTED]
    try:
        try:  # sizes of 1 would be fixed by the capture (a first sample of one sequence): converted at 2
            if not widen:
                raise ValueError("converted for the call's own sizes")
            other = _convert_quietly(info, *_calls.widened(args, kwargs), state, gm)
        except Exception:  # noqa: BLE001 - a size of 1 the model needs as it is: converted for the call as given
            other = _convert_quietly(info, args, kwargs, state, gm)
        _weights.share_tensors(gm, other, _weights.pair_modules(gm, other))
    except Exception as e:  # noqa: BLE001 - any failure: the call is refused, naming both calls and the cause
        raise TypeError(
            f"this module was converted for a call {_calls.text(info.call_signature)} and was called with "
            f"{_calls.text(_calls.describe(args, kwargs))}; converting it for this call as well failed "
            f"({one_line(e)}). Convert with example inputs of "
            "this call: autocastfx.convert(model, example_inputs=(...), example_kwargs={...}), and keep one "
            "converted module per call") from e
    return other


def _convert_quietly(info: ConvertInfo, args: tuple, kwargs: dict, state: tuple = (), gm: nn.Module | None = None
                     ) -> nn.Module:
    """The model kept on meta, its modules in ``state`` (``calls.module_state``), converted for ``(args, kwargs)``
    with ``info``'s options and none of autocastfx's own warnings (the first conversion said them). Where every tensor
    of the model is found in ``gm``, the copy holds ``gm``'s tensors and converts for real: its trace is then
    checked against the model's own call, as convert()'s is."""
    twin = copy.deepcopy(info.checks.model)
    _calls.apply_module_state(twin, state)
    real = _holding_tensors_of(twin, gm) if gm is not None else False
    with own_warnings_off():
        try:
            return _convert_any(twin, args, kwargs, info.options, CaptureContext())
        except Exception:  # noqa: BLE001 - on real values it may refuse what the meta copy converts: tried so
            if not real:
                raise
    twin = copy.deepcopy(info.checks.model)
    _calls.apply_module_state(twin, state)
    with own_warnings_off():
        return _convert_any(twin, args, kwargs, info.options, CaptureContext())


def _holding_tensors_of(twin: nn.Module, gm: nn.Module) -> bool:
    """Give ``twin`` (the model on meta) ``gm``'s own parameters and buffers by the model's names; False, with
    ``twin`` left on meta, where one of them is not found."""
    found = gm.state_dict(keep_vars=True)
    for name, t in itertools.chain(gm.named_buffers(remove_duplicate=False), gm.named_parameters()):
        found.setdefault(name, t)  # the buffers a state dict leaves out (persistent=False)
    places = [(m, k, f"{n}.{k}" if n else k) for n, m in twin.named_modules(remove_duplicate=False)
              for k in itertools.chain(m._parameters, m._buffers)]
    given = []
    for module, key, name in places:
        own = module._parameters if key in module._parameters else module._buffers
        t = found.get(name)
        if own[key] is not None and (not isinstance(t, torch.Tensor) or t.is_meta or t.shape != own[key].shape
                                     or t.dtype != own[key].dtype):
            return False
        given.append((own, key, t))
    for own, key, t in given:
        if own[key] is not None:
            own[key] = t
    return True


def _tensors(model: nn.Module):
    if not isinstance(model, nn.Module):
        return iter(())
    return itertools.chain(model.parameters(), model.buffers())


def _convert_model(model: nn.Module, args: tuple, kwargs: dict, options: ConvertOptions,
                   ctx: CaptureContext) -> nn.Module:
    """With blocks as modules of their own, as one graph, or piecewise where nothing else captures."""
    blocks = options.blocks
    if blocks is not None and blocks is not False and not isinstance(model, fx.GraphModule):
        names = choose(model, blocks, options.policy)
        if names:
            _check_params(model)
            try:
                with tensors_kept(model):  # the tree's runs of the model are runs for real, on its buffers
                    return convert_tree(model, names, args, kwargs, _conversions(), options, ctx,
                                        explicit=blocks != "auto")
            except Exception:  # noqa: BLE001 - on meta, blocks="auto" is one graph where the model's run needs values
                if ctx.meta_device is None or blocks != "auto":
                    raise
    try:
        return _convert_one_graph(model, args, kwargs, options, ctx)
    except CaptureError as e:
        if blocks is None or blocks is False or isinstance(model, fx.GraphModule):
            raise
        with tensors_kept(model):
            part = convert_piecewise(model, args, kwargs, _conversions(), options, ctx, why_not_captured(e))
        if part is None:  # nothing in it captures either
            raise
        return part


def _mode_flags(model: nn.Module) -> dict | None:
    """{mode: {module name: flag}} that the model's own ``train(mode)`` sets, where a module of it overrides
    ``train``/``eval`` (a backbone that keeps its batch norms frozen in training); None where none does."""
    if isinstance(model, fx.GraphModule):
        return None
    inside = {id(s) for name, m in model.named_modules() if name and is_converted(m) for s in m.modules()}
    if all(id(m) in inside or (type(m).train is nn.Module.train and type(m).eval is nn.Module.eval)
           for m in model.modules()):
        return None
    # on a copy with meta tensors, else (a train() that reads a buffer's value) on one over the model's tensors
    for make in (_meta_twin, lambda m: copy_model(m, True)):
        try:
            with torch_internal_warnings_off():
                twin = make(model)
            flags = {}
            for mode in (True, False):  # a converted block's modules too: the model's train() may set them
                with no_tensor_writes(twin, mode):
                    twin.train(mode)
                flags[mode] = {name: m.training for name, m in twin.named_modules() if m.training != mode}
            return flags
        except ModeWritesError:
            raise
        except Exception:  # noqa: BLE001 - a model that does not copy: the modes nn.Module.train sets
            continue
    return None


def _convert_one_graph(model: nn.Module, args: tuple, kwargs: dict, options: ConvertOptions, ctx: CaptureContext,
                  entry_casts: bool = False) -> fx.GraphModule:
    """``model`` captured as one graph (both modes), planned and rewritten by the core passes, sharing its tensors.
    ``entry_casts``: a block converted as its own module casts its inputs on entry to its plan's dtypes."""
    model_class, model_attrs = _model_surface(model)
    guard = None
    if isinstance(model, fx.GraphModule) and not _gemm_leaves(model):  # the graph is the program: converted as it is
        captured, model_class, model_attrs = _reconvert(model, args, kwargs, ctx, model_class, model_attrs)
        gm = next(iter(captured.programs.values()))
    else:
        _check_params(model)
        # each mode's program a graph module over the model's own tensors (shared, not copied); opaque calls
        # (torch.fx.wrap'd functions) traced by torch.export and inlined; propagated on the inputs
        captured = capture_programs(model, args, kwargs, options.policy, ctx, share_tensors=True)
        guard = guard_for(captured.state, model)  # a forward that moves its own plain state is refused here
        if not entry_casts:  # a block's own hooks: the tree's conversion watches it as the model's module
            warn_model_hooks(model)
        elif guard is not None:
            guard.watched = [e if e[1] else [*e[:4], None, None] for e in guard.watched]
        for _, unit in _weights.converted_units(model):  # converted blocks, shared: switched by the captures
            if unit is not model:
                _module.follow_module_modes(unit)
        gm = next(iter(captured.programs.values()))
        modes_now = dict(model.named_modules())
        for name, sub in gm.named_modules():
            if name in modes_now:
                sub.training = modes_now[name].training
        _module.hold_unread(gm, model)  # the model's tensors no program of this mode reads, at its names
        _module.adopt_model_classes(gm, model)  # the model's layer classes where the graph reads their tensors
        _unsaved_constants(gm, model)
        if captured.how == "torch.export":  # symbolic tracing takes such a tensor only as what the model made of it
            _trained_constants(gm, model)
    graphs = {k: p.graph for k, p in captured.programs.items()}
    one = len(graphs) == 1 or _modes.same_program(graphs)
    programs = {captured.current: gm} if one else captured.programs
    # what the mode changes, before the passes (whose plans may differ by mode too)
    modes = _modes.describe({"both": gm.graph} if one else graphs, captured.found)
    # the modules whose modes a call checks: those that issued an op the programs differ in, and those whose flag
    # the code read (a block whose forward skips its dropout in eval mode: the dropout's flag alone does not say)
    owners = set() if one else _modes.owner_names(graphs) | captured.readers
    for key, p in programs.items():  # each mode's program planned on its own
        if p is not gm:
            object.__setattr__(p, "recompile", no_recompile)  # its graph runs in gm, which writes its code
            run_passes(p, model, args, kwargs, options, meta_device=ctx.meta_device, entry_casts=entry_casts)
            _rewrite.rebuild_output_type(p)
    with _one_recompile(gm):
        passed = run_passes(gm, model, args, kwargs, options, meta_device=ctx.meta_device, entry_casts=entry_casts)
        _keep_non_persistent(gm, model)
        gm.meta[K.CONVERTED] = ConvertInfo(
            dtype=options.dtype, policy=options.policy, capture=captured.how, plan=passed.plan,
            absorbed=passed.absorbed, source_params=names_by_id(model), model_class=model_class,
            model_attrs=model_attrs, call_signature=_calls.describe(args, kwargs),
            free_dims=_calls.free_dims(args, kwargs), options=options, state=guard, mode_flags=_mode_flags(model),
            extra_totals={**({"padding": passed.padding.totals()} if passed.padding is not None else {}),
                          "layout": passed.layout.totals(),
                          "shapes": gm.meta.get(K.PROPAGATED, "fake"),
                          "modes": modes,
                          **({"opaque_calls": [str(d) for d in captured.decisions]} if captured.decisions else {})})
        _rewrite.rebuild_output_type(gm)
        _module.install(gm, programs, captured.current, owners)
    if not isinstance(model, fx.GraphModule):  # after install, whose class refuses new children
        _module.stand_in_for_settings(gm, model)
        _module.note_owners(gm, owners)  # a stand-in's mode (a dropout's) is one the programs hold as a flag
    if guard is not None and (guard.reads or guard.unowned):
        _module.refuse_writes(gm, guard.reads | guard.unowned)
    if guard is not None:
        guard.point_at(gm)  # one mode for the model and gm from here on
    return gm


def _gemm_leaves(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(target, class name) of each call the graph makes of a module holding a Linear or a convolution as a leaf
    (plain ``torch.fx.symbolic_trace``), whose matmuls a pass over the graph cannot reach; none in a converted
    module."""
    if K.CONVERTED in gm.meta:
        return []
    leaves = [(str(n.target), gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    return [(name, type(m).__name__) for name, m in leaves if has_gemm(m) and not is_converted(m)]


def _reconvert(model: fx.GraphModule, args: tuple, kwargs: dict, ctx: CaptureContext, model_class, model_attrs):
    """A graph module given to convert(): a copy of it, back to its float32 form where autocastfx converted it
    (each mode's program, casts undone), propagated, its opaque calls inlined; its tensors are ``model``'s own.
    Returns (captured programs, the model's class and attributes)."""
    gm, how = copy.deepcopy(model, {id(t): t for t in _tensors(model)}), "graph module"
    info = gm.meta.get(K.CONVERTED)
    found = "captures"
    if info is not None:
        how = info.capture
        model_class, model_attrs = info.model_class, info.model_attrs
        kept = gm.meta.pop(K.PROGRAMS, None)
        del gm.meta[K.CONVERTED]
        if kept is not None:  # every mode's program, each a graph module over the copy's tensors
            programs = {k: gm if g is gm.graph else _over(gm, g) for k, g in kept.graphs.items()}
            current = next(k for k, g in kept.graphs.items() if g is gm.graph)
        else:
            programs, current = {"given": gm}, "given"
    else:
        programs, current = derive_from_graph(gm)
        found = "flags"
    programs = {current: programs[current], **{k: p for k, p in programs.items() if k != current}}
    decisions = []
    for p in programs.values():
        _rewrite.undo(p)
        _check_params(p)
        propagate(p, args, kwargs, meta_device=ctx.meta_device)
        found_calls = _inline.inline_opaque_calls(p)  # torch.fx.wrap'd functions: traced by torch.export, inlined
        if any(d.inlined for d in found_calls):
            propagate(p, args, kwargs, meta_device=ctx.meta_device)
        decisions += found_calls
    return Captured(programs, current, how, decisions, found), model_class, model_attrs


def _over(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A graph module running a copy of ``graph`` over ``gm``'s modules and tensors."""
    out = fx.GraphModule(gm, deepcopy_quietly(graph), type(gm).__name__)
    out.meta.update({k: v for k, v in gm.meta.items() if k != K.CONVERTED})
    return out


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward"}


def _model_surface(model: nn.Module) -> tuple[type | None, dict[str, Any]]:
    """The model's class and its plain instance attributes (no tensors, no modules, nothing of nn.Module's own
    bookkeeping), which the converted module answers for the model."""
    if isinstance(model, fx.GraphModule):
        return None, {}
    attrs = {k: v for k, v in vars(model).items() if k not in _MODULE_INTERNALS
             and not isinstance(v, (torch.Tensor, nn.Module))}
    return type(model), attrs


def _keep_non_persistent(gm: nn.Module, model: nn.Module) -> None:
    """The model's non-persistent buffers (rotary tables) stay out of the converted module's state dict: a traced
    graph module registers every buffer it reads as persistent."""
    for prefix, m in model.named_modules(remove_duplicate=False):
        for field in m._non_persistent_buffers_set:
            owner, _, attr = f"{prefix}.{field}".strip(".").rpartition(".")
            try:
                mod = gm.get_submodule(owner)
            except AttributeError:
                continue
            if attr in mod._buffers:
                mod._non_persistent_buffers_set.add(attr)


@contextlib.contextmanager
def _one_recompile(gm: fx.GraphModule):
    """Generate ``gm``'s code once, after the passes, whose own ``gm.recompile()`` calls are skipped (none needs
    the code inside ``convert()``)."""
    gm.recompile = no_recompile  # an instance attribute, in front of the method
    try:
        yield
    finally:
        gm.__dict__.pop("recompile", None)
    gm.recompile()  # not reached when a pass raised: the half-converted module is dropped


def _unsaved_constants(gm: nn.Module, model: nn.Module) -> None:
    """Leave out of ``gm``'s state dict the tensors the capture made buffers of that are none of the model's
    buffers (a plain tensor attribute, a tensor in a list), as the model's state dict leaves them out."""
    own, saved = {id(t) for t in model.buffers()}, set(model.state_dict(keep_vars=True))
    for path, sub in gm.named_modules():
        for name, t in sub._buffers.items():
            if t is not None and id(t) not in own and f"{path}.{name}".lstrip(".") not in saved \
                    and name not in sub._non_persistent_buffers_set:
                sub._non_persistent_buffers_set.add(name)


def _trained_constants(gm: nn.Module, model: nn.Module) -> None:
    """Where the capture took a trained tensor the model keeps outside its parameters (an ``nn.Parameter`` in a
    plain list) as a constant that views it, ``gm`` reads the tensor itself, so its gradient reaches it as in the
    model."""
    def key(t):
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                t.dtype)

    trained = {key(t): t for t in unregistered_tensors(model)
               if t.requires_grad and t.is_leaf and not t.is_meta and t.layout == torch.strided}
    if not trained:
        return
    for node in gm.graph.nodes:  # read as it is: not through the model's own .detach() (torch.export keeps it)
        if node.op != "get_attr" or all(op_name(u) in ("detach", "alias") for u in node.users):
            continue
        owner, _, name = str(node.target).rpartition(".")
        sub = gm.get_submodule(owner)
        t = getattr(sub, name, None)
        if type(t) is torch.Tensor and not t.requires_grad and not t.is_meta and t.layout == torch.strided \
                and key(t) in trained:
            sub._buffers.pop(name, None)
            sub._non_persistent_buffers_set.discard(name)
            sub.__dict__[name] = trained[key(t)]



def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example with each tensor that shares memory with an earlier one cloned (labels=input_ids): torch.export
    makes one input of inputs that alias, and the graph would read one for the other at every later call."""
    seen: set = set()

    def own(t):
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_meta:  # a sparse or wrapper tensor
            return t
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return t
        key = (t.device, storage.data_ptr())
        if key in seen and storage.nbytes():
            return t.clone()
        seen.add(key)
        return t
    return torch.utils._pytree.tree_map(own, (args, kwargs))


def _refuse_lost_backward_hooks(model: nn.Module, gm: nn.Module) -> None:
    """ValueError where a module of the model has a backward hook and ``gm`` no longer calls a module of its own at
    that name with the hook (the graph computes its ops: a linear under symbolic tracing, every layer under
    torch.export, the model itself): the hook would never run."""
    mine = dict(gm.named_modules())
    hooked = []
    for name, m in model.named_modules():
        count = len(m._backward_hooks) + len(m._backward_pre_hooks)
        sub = mine.get(name)
        if count and (sub is None or _module.is_held(sub) or isinstance(sub, fx.GraphModule)
                      or len(sub._backward_hooks) + len(sub._backward_pre_hooks) != count):
            hooked.append(name or "the model")
    if hooked:
        raise ValueError(
            f"{', '.join(hooked[:4])}{' and more' if len(hooked) > 4 else ''} of {type(model).__name__} "
            f"{'have' if len(hooked) > 1 else 'has'} a backward hook (register_full_backward_hook or "
            "register_full_backward_pre_hook). The converted graph computes those modules' ops itself, so the hook "
            "would never run, and a hook that changes or blocks gradients would be lost. Remove the hooks before "
            "convert(), then hook the converted module (gm.register_full_backward_hook) or the tensors in forward "
            "(tensor.register_hook); hooks on the layers kept as modules (norms, activations, dropout) are kept")


def _check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple):
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    if not (dtype is None or (isinstance(dtype, str) and dtype == "auto") or dtype in LOW_DTYPES):
        raise ValueError(f"dtype must be {_devices.ACCEPTED}, got {dtype!r}")
    if not isinstance(pad_multiple, int) or isinstance(pad_multiple, bool) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be a positive int (1 turns padding off), got {pad_multiple!r}")
    if example_inputs is None and example_kwargs is None:
        raise ValueError("convert() needs example inputs to learn every value's dtype and shape: "
                         "pass example_inputs=(x,) (a tuple of tensors like the ones forward takes)")
    if isinstance(example_inputs, torch.Tensor):
        raise TypeError("example_inputs must be a tuple of inputs: write (x,) instead of x")
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    return args, kwargs


def _check_params(model: nn.Module) -> None:
    units = {id(t) for name, m in model.named_modules() if name and is_converted(m)
             for t in list(m.parameters()) + list(m.buffers())}  # converted blocks: theirs are low already
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in units:
            continue
        if t.is_floating_point() and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}; convert() takes a float32 model, whose weights become the "
                             "float32 parameters of the converted module. Call model.float() first, or pass the "
                             "model as it is when all its weights are low (a bfloat16 checkpoint): its float32 "
                             "parameters are then made from them")


def master_parameters(gm: nn.Module) -> list[nn.Parameter]:
    """The float32 parameters that ``gm``'s graphs (and its converted blocks') cast to the low dtype: the
    mixed-precision master weights, which are ``gm``'s own parameters."""
    return _weights.cast_low_parameters(gm)


materialize = _weights.materialize
