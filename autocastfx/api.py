"""convert(): the pipeline, top to bottom."""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import gc
import itertools
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import blocks as _blocks
from . import calls as _calls
from . import capture as _capture
from . import devices as _devices
from . import inline as _inline
from . import layout as _layout
from . import modes as _modes
from . import padding as _padding
from . import plan as _plan
from . import rewrite as _rewrite
from . import weights as _weights
from .policy import Policy

LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class ConvertInfo:
    """What ``gm.meta["autocastfx"]`` holds for a converted module."""
    dtype: torch.dtype
    policy: Policy
    capture: str
    plan: _plan.CastPlan
    masters: dict[str, nn.Parameter]
    absorbed: list[str]
    options: dict[str, Any]
    extra_totals: dict[str, Any] = dataclasses.field(default_factory=dict)
    # id() of each parameter of the model convert() was given -> its name: lets an optimizer built over the
    # original model be re-pointed to the converted module's parameters and masters
    source_params: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False)  # all names
    # the model's class and its plain attributes (a config, sizes): the converted module answers the model's
    # own methods and attributes through them (modes._add_model_surface)
    model_class: type | None = dataclasses.field(default=None, repr=False)
    model_attrs: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    # the inputs of the call the graph was captured for (calls.describe): a call of another shape is refused
    # with both named
    call_signature: tuple = ()


def convert(model: nn.Module, example_inputs: tuple | None = None, *, example_kwargs: dict | None = None,
            dtype: torch.dtype | str | None = None, policy: Policy | None = None, pad_multiple: int = 8,
            master_weights: bool = True, keep_io_types: bool = True, memory_format: str = "auto",
            blocks: Any = "auto") -> fx.GraphModule:
    """Rewrite ``model`` into an explicit mixed-precision ``torch.fx.GraphModule``; ``model`` is not modified.

    ``dtype``: ``torch.float16`` (the default, ``None``), ``torch.bfloat16``, or ``"auto"``: the one that pays on
    the model's device (float16 on CUDA, bfloat16 on a CPU with native bfloat16); the report says which and why,
    and an explicit dtype with no fast kernels on the device is warned about (``autocastfx.SlowDtypeWarning``).
    See the README for the other options. Raises ValueError for bad options, TypeError for a model that is not
    an ``nn.Module``, and ``autocastfx.CaptureError`` when the model cannot be captured.
    """
    if _DTYPE_NOTE.get() is _OUTER:  # the call the user made (blocks convert theirs through here again)
        dtype, note = _devices.resolve(dtype, _device_of(model, example_inputs, example_kwargs))
        token = _DTYPE_NOTE.set(note)
        try:
            out = convert(model, example_inputs, example_kwargs=example_kwargs, dtype=dtype, policy=policy,
                          pad_multiple=pad_multiple, master_weights=master_weights, keep_io_types=keep_io_types,
                          memory_format=memory_format, blocks=blocks)
        finally:
            _DTYPE_NOTE.reset(token)
        if note:
            for _, unit in _weights.converted_units(out):
                unit.meta["autocastfx"].extra_totals["dtype_choice"] = note
        return out
    if dtype is None:
        dtype = torch.float16
    low = _low_weights(model)
    if low:  # a low-precision checkpoint: converted as its float32 form on meta, then its values loaded
        return _convert_low_model(model, low, example_inputs, example_kwargs, dtype=dtype, policy=policy,
                                  pad_multiple=pad_multiple, master_weights=master_weights,
                                  keep_io_types=keep_io_types, memory_format=memory_format, blocks=blocks)
    # a conversion makes many small objects and frees few: cyclic collections only cost time (with blocks, most
    # of a copied block's cost)
    with _no_gc(), _on_meta(model, example_inputs, example_kwargs):
        return _convert_model(model, example_inputs, example_kwargs, dtype, policy, pad_multiple, master_weights,
                              keep_io_types, memory_format, blocks)


_OUTER = object()
_DTYPE_NOTE: contextvars.ContextVar = contextvars.ContextVar("autocastfx_dtype_note", default=_OUTER)


def _device_of(model, example_inputs, example_kwargs) -> torch.device:
    """The device the model runs on: its first tensor not on meta, else its inputs', else the CPU."""
    tensors = list(_tensors(model)) if isinstance(model, nn.Module) else []
    tensors += [t for t in torch.utils._pytree.tree_leaves((example_inputs, example_kwargs))
                if isinstance(t, torch.Tensor)]
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def _low_weights(model) -> dict[str, torch.dtype]:
    """Name -> dtype of each float16/bfloat16 parameter or buffer of a model that holds no meta tensor (a
    low-precision checkpoint loaded as it is); empty for a float32 model and for a converted one."""
    if not isinstance(model, nn.Module) or isinstance(model, fx.GraphModule) or _blocks.is_unit(model):
        return {}
    units = {id(t) for name, m in model.named_modules() if name and _blocks.is_unit(m)
             for t in itertools.chain(m.parameters(), m.buffers())}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    if any(t.is_meta for _, t in named):
        return {}
    return {n: t.dtype for n, t in named if id(t) not in units and t.dtype in LOW_DTYPES}


def _convert_low_model(model: nn.Module, low: dict, example_inputs, example_kwargs, **options) -> nn.Module:
    """A model whose weights are float16/bfloat16 (``from_pretrained(..., torch_dtype=torch.bfloat16)``), converted
    without a float32 copy of the whole model: its float32 form is built on the meta device (no memory), converted
    there, materialised on the model's device, and its values loaded: the masters are the upcast weights (exactly
    what converting ``model.float()`` gives), the low copies made from them."""
    if any(_blocks.is_unit(m) for name, m in model.named_modules() if name):
        raise ValueError("convert() takes a low-precision model without converted blocks inside; convert its "
                         "blocks after, or convert model.float()")
    memo = {}
    for t in _tensors(model):
        if id(t) not in memo:
            shell = torch.empty_like(t, device="meta", dtype=torch.float32 if t.is_floating_point() else t.dtype)
            memo[id(t)] = nn.Parameter(shell, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else shell
    twin = copy.deepcopy(model, memo)
    device = _device_of(model, example_inputs, example_kwargs)
    gm = convert(twin, example_inputs, example_kwargs=example_kwargs, **options)
    del twin, memo
    # the model's own tensors, not float32 copies of them: loading upcasts each into its master, one at a time
    values = {n: t.detach() for n, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                                         model.named_buffers(remove_duplicate=False))}
    own = dict(gm.named_buffers(remove_duplicate=False))
    _weights.materialize(gm, device, {n: v for n, v in values.items() if n not in own},
                         buffers={n: v for n, v in values.items() if n in own}, strict=False)
    kinds = sorted({str(d).replace("torch.", "") for d in low.values()})
    for _, unit in _weights.converted_units(gm):
        unit.meta["autocastfx"].extra_totals["weights_from"] = (
            f"the model's {' and '.join(kinds)} values ({len(low)} tensors), upcast exactly into the float32 "
            "masters and float32 values")
    return gm


@contextlib.contextmanager
def _on_meta(model, example_inputs, example_kwargs):
    """A model on the meta device is captured and planned on shapes alone, for the device of its real example
    inputs (the CPU where they are on meta too): its parameters, masters and buffers stay on meta, to be
    materialised with ``gm.to_empty(device=...)`` and filled by ``gm.load_state_dict(...)``."""
    if not isinstance(model, nn.Module) or not any(t.is_meta for t in _tensors(model)):
        yield
        return
    token = _capture.META_DEVICE.set(_device_of(model, example_inputs, example_kwargs))
    try:
        yield
    finally:
        _capture.META_DEVICE.reset(token)


def _tensors(model: nn.Module):
    return itertools.chain(model.parameters(), model.buffers())


def _convert_model(model, example_inputs, example_kwargs, dtype, policy, pad_multiple, master_weights,
                   keep_io_types, memory_format, blocks) -> nn.Module:
    """convert(): with blocks as modules of their own, as one graph, or piecewise where nothing else captures."""
    options = dict(dtype=dtype, policy=policy, pad_multiple=pad_multiple, master_weights=master_weights,
                   keep_io_types=keep_io_types, memory_format=memory_format)
    if blocks is not None and blocks is not False and not isinstance(model, fx.GraphModule) \
            and isinstance(model, nn.Module):
        names = _blocks.choose(model, blocks, policy if policy is not None else Policy.default())
        if names:
            args, kwargs = _check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple)
            _check_params(model)
            try:
                return _blocks.convert_tree(model, names, args, kwargs, convert, options, explicit=blocks != "auto")
            except Exception:  # noqa: BLE001 - on meta, blocks="auto" is one graph where the model's run needs values
                if _capture.META_DEVICE.get() is None or blocks != "auto":
                    raise
    try:
        return _convert(model, example_inputs, example_kwargs, dtype, policy, pad_multiple, master_weights,
                        keep_io_types, memory_format)
    except _capture.CaptureError as e:
        if blocks is None or blocks is False or isinstance(model, fx.GraphModule):
            raise
        args, kwargs = _check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple)
        part = _blocks.convert_piecewise(model, args, kwargs, convert, options, _blocks._why(e))
        if part is None:  # nothing in it captures either
            raise
        return part


def convert_block(block: nn.Module, args: tuple, kwargs: dict, options: dict, keep_io_types: bool = False
                  ) -> fx.GraphModule:
    """A block of a model, converted as a module of its own: its inputs and outputs in the dtypes its plan
    prefers (or, with ``keep_io_types``, its outputs in its first input's dtype); an input first becomes the
    dtype the block was converted for, no copy when it already is."""
    o = options  # called within convert(), the collector already off
    return _convert(block, args, kwargs, o["dtype"], o["policy"], o["pad_multiple"], o["master_weights"],
                    keep_io_types, o["memory_format"], entry_casts=True)


def _convert(model, example_inputs, example_kwargs, dtype, policy, pad_multiple, master_weights, keep_io_types,
             memory_format, entry_casts: bool = False) -> fx.GraphModule:
    args, kwargs = _check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple)
    memory_format = _layout.check_memory_format(memory_format)
    policy = policy if policy is not None else Policy.default()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an autocastfx.Policy, got {type(policy).__name__}")

    model_class, model_attrs = _model_surface(model)
    if isinstance(model, fx.GraphModule):
        gm, how = copy.deepcopy(model), "graph module"
        if "autocastfx" in gm.meta:
            how = gm.meta["autocastfx"].capture
            model_class, model_attrs = gm.meta["autocastfx"].model_class, gm.meta["autocastfx"].model_attrs
            _weights.restore_masters(gm)     # start again from the float32 model
            _modes.restore_union(gm)         # every mode's program, as the passes saw them
            _rewrite.undo(gm)
            del gm.meta["autocastfx"]
        _check_params(gm)
        _capture.propagate(gm, args, kwargs)
        inlined = _inline.inline_opaque_calls(gm)  # torch.fx.wrap'd functions: traced by torch.export, inlined
        if any(d.inlined for d in inlined):
            _capture.propagate(gm, args, kwargs)
    else:
        _check_params(model)
        # the model in training mode and in eval mode, merged into one graph that every pass below sees; its
        # opaque calls (torch.fx.wrap'd functions) traced by torch.export and inlined; propagated on the inputs
        gm, how, inlined = _modes.capture(model, args, kwargs, policy,
                                          share_tensors=True)  # the model's tensors until own_tensors, below

    with _one_recompile(gm):
        _modes.record(gm, model)  # a module of one program: flags from self.training follow gm.train()/eval()
        absorbed = _rewrite.absorb_casts(gm)
        layout = _layout.plan_layout(gm, memory_format)  # channels_last or not: padding's gate depends on it
        pad_plan = None
        if pad_multiple > 1:
            pad_plan = _padding.plan_padding(gm, pad_multiple, policy.pad_max_growth, layout=layout.memory_format,
                                             dtype=dtype, gate=policy.pad_gate)
            if any(d.action == "pad" for d in pad_plan.decisions):
                _padding.apply_padding(gm, pad_plan)
                _capture.propagate(gm, args, kwargs)  # the padded values' shapes
        _layout.apply_layout(gm, layout, args, kwargs)
        free = _free_inputs(gm, args, kwargs, dtype) if entry_casts and not keep_io_types else frozenset()
        plan = _plan.build_plan(gm, policy, dtype, master_weights=master_weights, keep_io_types=keep_io_types,
                                free_inputs=free)
        _inputs_as_planned(gm, plan, free)
        masters = _weights.store_low(gm, plan.low_params, dtype)
        _layout.store_weights(gm, layout)  # after the masters, which keep NCHW like their gradients
        _rewrite.apply_plan(gm, plan)
        if entry_casts:
            _rewrite.entry_casts(gm)
        _capture.own_tensors(gm, model)  # what still is the model's (float32 weights, buffers) is copied
        _keep_non_persistent(gm, model)
        gm.meta["autocastfx"] = ConvertInfo(
            dtype=dtype, policy=policy, capture=how, plan=plan, masters=masters, absorbed=absorbed,
            source_params=_names_by_id(model), model_class=model_class, model_attrs=model_attrs,
            call_signature=_calls.describe(args, kwargs),
            options=dict(pad_multiple=pad_multiple, master_weights=master_weights, keep_io_types=keep_io_types,
                         memory_format=memory_format),
            extra_totals={**({"padding": pad_plan.totals()} if pad_plan is not None else {}),
                          "layout": layout.totals(),
                          "shapes": gm.meta.get("autocastfx_propagate", "fake"),
                          "modes": _modes.describe(gm),
                          **({"opaque_calls": [str(d) for d in inlined]} if inlined else {})})
        _rewrite.rebuild_output_type(gm)
        _modes.install(gm)
    return gm


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


def _free_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, low: torch.dtype) -> frozenset[str]:
    """A block's float32 inputs whose dtype its plan may choose: those whose example values the low dtype
    holds (a mask filled with float32's lowest value is not one of them)."""
    out = set()
    for p, v in _capture.placeholder_values(gm, args, kwargs):
        info = p.meta.get("autocastfx_info")
        # on the meta device the values are unknown: such an input stays float32 (a mask of float32's lowest
        # value would overflow the low dtype)
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and isinstance(info, _capture.TensorInfo) \
                and info.dtype == torch.float32 and not v.is_meta and bool(torch.isfinite(v.to(low)).all()):
            out.add(p.name)
    return frozenset(out)


def _inputs_as_planned(gm: fx.GraphModule, plan: _plan.CastPlan, free: frozenset[str]) -> None:
    """A free input the plan labels low is recorded as a low input: no cast for it in the graph, and the entry
    cast (``rewrite.entry_casts``) takes whatever the caller gives in that dtype."""
    for p in gm.graph.nodes:
        if p.op == "placeholder" and p.name in free and plan.nodes[p.name].label == _plan.LOW:
            p.meta["autocastfx_info"] = dataclasses.replace(p.meta["autocastfx_info"], dtype=plan.dtype)


@contextlib.contextmanager
def _no_gc():
    """The cyclic garbage collector off for the duration (and back on only if it was on): a graph of thousands
    of nodes, each with its dicts and proxies, set off collections that were a fifth of convert()'s time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _one_recompile(gm: fx.GraphModule):
    """Generate and compile ``gm``'s code once, when the passes are done. Each pass calls ``gm.recompile()``
    after its edits, as a pass run on its own must; inside ``convert()`` none of them needs the code (shapes are
    propagated by an interpreter), and every recompile writes and compiles the whole forward again: the five
    of them (the traced module's first included, see ``capture(compile_code=False)``) were 40% of the
    conversion time of a 3,700-node graph."""
    gm.recompile = _capture.no_recompile  # an instance attribute, in front of the method
    try:
        yield
    finally:
        gm.__dict__.pop("recompile", None)
    gm.recompile()  # not reached when a pass raised: the half-converted module is dropped


def _names_by_id(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every name it has in ``model``, first one first (tied weights have several, and the
    graph keeps one of them)."""
    names: dict[int, tuple[str, ...]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), ()) + (n,)
    return names


def _check_inputs(model, example_inputs, example_kwargs, dtype, pad_multiple):
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
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
    units = {id(t) for name, m in model.named_modules() if name and _blocks.is_unit(m)
             for t in list(m.parameters()) + list(m.buffers())}  # converted blocks: theirs are low already
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in units:
            continue
        if t.is_floating_point() and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}; convert() takes a float32 model, whose weights become the "
                             "float32 masters. Call model.float() first (converting an already-halved model "
                             "would keep rounded masters)")


def master_parameters(gm: nn.Module) -> list[nn.Parameter]:
    """The float32 master copies of the parameters stored in low precision, of ``gm`` and of every converted
    block or piecewise part inside it."""
    return _weights.master_parameters(gm)


float32_state_dict = _weights.float32_state_dict
float32_weights = _weights.float32_weights
materialize = _weights.materialize
