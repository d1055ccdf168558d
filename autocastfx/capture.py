"""Capture: model -> GraphModule. torch.fx.symbolic_trace first, torch.export (training IR) second."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import io
import itertools
import logging
import traceback
import warnings
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn

from .policy import LOW_OPS, Policy, op_name

_COUNTED = LOW_OPS  # FLOPs are counted where tensor cores could run them


class CaptureError(RuntimeError):
    """Neither symbolic tracing nor torch.export could capture the model."""


class _Tracer(fx.Tracer):
    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.policy.is_leaf(m) or (bool(qualname) and _is_unit(m))  # a converted block: one call

    def trace(self, root, concrete_args=None):
        self._param_names = {id(p): n for n, p in root.named_parameters()} if isinstance(root, nn.Module) else {}
        self._arg_depth, self.output_type = 0, None
        return super().trace(root, concrete_args)

    def create_arg(self, a):
        # the forward's result is the last value made into a graph argument: a dict subclass there (a Hugging
        # Face ModelOutput) is written as a plain dict literal, so its type is noted to be given back
        if self._arg_depth == 0 and isinstance(a, dict) and type(a) is not dict \
                and type(a) in torch.utils._pytree.SUPPORTED_NODES:
            self.output_type = type(a)
        elif self._arg_depth == 0:
            self.output_type = None
        self._arg_depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._arg_depth -= 1

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # fx's own lookup scans every parameter on every access (quadratic in model size): use a dict
        name = self._param_names.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def capture(model: nn.Module, args: tuple, kwargs: dict, policy: Policy, *, compile_code: bool = True,
            share_tensors: bool = False) -> tuple[fx.GraphModule, str]:
    """Return (graph module, how) where how is ``"symbolic_trace"`` or ``"torch.export"``.

    The model is deep-copied first: nothing the capture does reaches the caller's model. The copy is put in
    training mode, so that every mode-dependent op shows its training form (an attention's dropout
    probability, which eval mode writes as 0.0); ``modes.py`` then gives the graph the modes the model had.
    A model that cannot be captured in training mode (batch norm on an example batch of one) is captured in
    the mode it is in. A traced graph must also run on the example inputs; one that does not goes to the
    torch.export fallback too. ``compile_code=False`` leaves a traced module's code to be written by its
    caller's ``gm.recompile()`` once its passes are done (``gm.recompile`` is a no-op on the instance until
    the caller deletes it): writing the code of a large graph costs a third of tracing it.
    ``share_tensors=True`` copies the module tree but not its parameters and buffers: the graph module holds
    the caller's tensors until the caller gives it copies of its own with ``own_tensors`` (``convert()`` does,
    after the conversion has replaced the weights it stores low), so that no second float32 copy of the
    whole model is ever made; the capture itself never writes to a tensor.
    """
    try:
        gm, how = _capture(_copy(model, share_tensors).train(), args, kwargs, policy, compile_code)
        gm.meta["autocastfx_captured_training"] = True
        return gm, how
    except CaptureError:
        if model.training:
            raise
    return _capture(_copy(model, share_tensors), args, kwargs, policy, compile_code)


def _copy(model: nn.Module, share_tensors: bool, keep: Iterable[nn.Module] = ()) -> nn.Module:
    """A deep copy of ``model``; with ``share_tensors`` its parameters, buffers and converted blocks are the
    model's own; the modules in ``keep`` are the model's own too (the caller puts something else in their
    place before it hands the copy on)."""
    memo: dict[int, Any] = {id(m): m for m in keep}
    if share_tensors:
        for t in itertools.chain(model.parameters(), model.buffers()):
            memo[id(t)] = t
        for name, m in model.named_modules():
            if name and _is_unit(m):  # a converted block inside: the capture calls it, never copies it
                memo[id(m)] = m
    return copy.deepcopy(model, memo)


def _is_unit(m: nn.Module) -> bool:
    meta = getattr(m, "meta", None)
    return isinstance(meta, dict) and meta.get("autocastfx") is not None


def own_tensors(gm: nn.Module, model: nn.Module, skip: set[int] = frozenset()) -> int:
    """Give ``gm`` copies of every parameter, buffer and tensor attribute it still shares with ``model`` (by
    object or by storage), copied together as ``copy.deepcopy`` would have: tied tensors stay tied, views stay
    views of one new storage, parameters keep their class and attributes. Returns how many were copied.
    Converted blocks inside ``gm`` own their tensors already and are left alone, as are the ids in ``skip``."""
    inner = [m for name, m in gm.named_modules() if name and _is_unit(m)]
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


def _capture(model: nn.Module, args: tuple, kwargs: dict, policy: Policy, compile_code: bool = True,
             method: str | None = None, check: bool = True, reads: list | None = None
             ) -> tuple[fx.GraphModule, str]:
    """Capture ``model`` as it is; ``method`` (``"symbolic_trace"`` or ``"torch.export"``) insists on one way,
    as the second capture of a model in another mode must take the way the first took. ``check=False`` skips
    the run of a traced graph on the example inputs (its caller propagates what it makes of it). ``reads``
    collects the modules whose ``training`` flag the model's code read while it was captured."""
    if method == "torch.export":
        return capture_export(model, args, kwargs, check=check, reads=reads)
    try:
        tracer = _Tracer(policy)
        with watch_training(reads):
            graph = tracer.trace(model)
        gm = _graph_module(tracer.root, graph, model.__class__.__name__, compile_code)
        if tracer.output_type is not None:
            gm.meta["autocastfx_output_type"] = tracer.output_type
        if kwargs and not _accepts_kwargs(gm, kwargs):
            raise TypeError(f"traced forward does not take keyword inputs {sorted(kwargs)}")
        if check:
            propagate(gm, args, kwargs)
        return gm, "symbolic_trace"
    except Exception as e:  # noqa: BLE001 - every tracing failure goes to the fallback
        if method is not None:
            raise CaptureError(f"cannot trace {type(model).__name__} in this mode: {_one_line(e)}") from e
        trace_error = e
    return capture_export(model, args, kwargs, trace_error, reads=reads)


def capture_export(model: nn.Module, args: tuple, kwargs: dict, trace_error: BaseException | None = None,
                   check: bool = True, reads: list | None = None) -> tuple[fx.GraphModule, str]:
    _check_example_values(torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs))))
    units = _outer_units(model)
    try:
        with _quiet():  # torch.export prints graphs and shape warnings while it fails; the error says it all
            if units:  # the converted blocks inside stay calls of one graph around them
                from .around import block_modules, export_around
                seen: list | None = [] if reads is not None else None
                with watch_training(seen):
                    gm = export_around(model, tuple(args), dict(kwargs), units, _export)
                if reads is not None:  # what the blocks read of their own modes is theirs: not the root's
                    inner = block_modules(units)
                    reads.extend(m for m in seen if id(m) not in inner)
            else:
                with watch_training(reads), torch_internal_warnings_off():
                    gm = _export(model, tuple(args), dict(kwargs)).module()
        _strip_export_asserts(gm)
        if check:
            propagate(gm, args, kwargs)
        return gm, "torch.export"
    except Exception as e:  # noqa: BLE001
        export_error = e
    raise CaptureError(
        f"cannot capture {type(model).__name__} as a graph.\n"
        f"  torch.fx.symbolic_trace failed: {_one_line(trace_error) if trace_error else 'not tried'}\n"
        f"  torch.export.export(strict=False) failed: {_one_line(export_error)}\n"
        "Ways out: convert a submodule that traces (autocastfx.convert(model.backbone, ...)); mark the "
        "module that breaks tracing as a leaf (Policy.default().override(leaf_modules=(MyBlock,))); remove "
        "data-dependent Python control flow from forward (if x.sum() > 0: ...); or pass example_inputs "
        "that match forward's signature so the torch.export fallback can run."
    ) from export_error


@contextlib.contextmanager
def watch_training(reads: list | None):
    """Append to ``reads`` every module whose ``training`` attribute is read meanwhile (``None``: watch nothing).
    A capture that reads none wrote no mode-dependent code (leaf modules, which switch by themselves, are not
    run by a capture), so the model's eval capture would be the same graph."""
    if reads is None:
        yield
        return

    def seen(module, name):
        if name == "training":
            reads.append(module)

    with watch_reads(seen):
        yield


_WATCHERS: list = []


def _watched_getattribute(self, name):
    for w in _WATCHERS:
        w(self, name)
    return object.__getattribute__(self, name)


@contextlib.contextmanager
def watch_reads(callback):
    """Meanwhile ``callback(module, name)`` is called for every attribute read of every module (watchers nest)."""
    _WATCHERS.append(callback)
    if len(_WATCHERS) == 1:
        nn.Module.__getattribute__ = _watched_getattribute
    try:
        yield
    finally:
        _WATCHERS.remove(callback)
        if not _WATCHERS:
            del nn.Module.__getattribute__


def _outer_units(model: nn.Module) -> dict[str, nn.Module]:
    """The converted blocks inside ``model`` (not the model itself), outermost only, by qualified name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if n and _is_unit(m) and not any(n.startswith(o + ".") for o in out):
            out[n] = m
    return out


def _export(model: nn.Module, args: tuple, kwargs: dict, preserve: tuple[str, ...] = ()):
    """torch.export with the batch size, and the sequence length of token inputs, free to vary where the model
    allows it (``Dim.AUTO``), so that a converted model takes other batch sizes and sequence lengths than the
    example's; a static export when the dynamic one fails (a model whose code needs concrete sizes).

    Other sizes (an image's height and width, feature widths) are the example's: free spatial sizes cost a
    windowed vision model's export nearly a minute of symbolic reasoning on its padding arithmetic (a small
    Hugging Face Swin: 59 s with every size free, 1.9 s with a free batch, 1.1 s static)."""
    target = META_DEVICE.get()
    if target is not None:  # on the meta device: the inputs too, and the device the program will run on after
        args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with _explicit_keywords(model, kwargs):
        try:
            spec = _auto_dynamic_shapes(model, args, kwargs)
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=spec, strict=False,
                                     preserve_module_call_signature=preserve)
        except Exception:  # noqa: BLE001 - the static export below reports its own failure
            ep = torch.export.export(model, args, kwargs, strict=False, preserve_module_call_signature=preserve)
    if target is not None:
        _retarget_devices(ep.graph_module, torch.device("meta"), target)
    return ep


def _retarget_devices(gm: fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Every ``device=old`` argument of ``gm``'s graph (``torch.arange(..., device=x.device)`` as the export of a
    model on the meta device records it) made ``new``, in nested graphs too."""
    def swap(a):
        return new if isinstance(a, torch.device) and a == old else a

    for m in gm.modules():
        graph = getattr(m, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if isinstance(m, fx.GraphModule):
            m.recompile()


@contextlib.contextmanager
def _explicit_keywords(model: nn.Module, kwargs: dict):
    """Meanwhile ``model.forward`` names every keyword input it takes through ``**kwargs`` (a Hugging Face layer's
    ``position_ids``): torch.export matches dynamic shapes against the inputs bound to the signature in one place
    and against the keyword inputs laid out flat in another, and the two differ for a ``**kwargs`` forward, so
    every dynamic export of such a block failed and fell back to a static one (its batch size fixed)."""
    import inspect

    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        yield
        return
    params = list(sig.parameters.values())
    extra = [k for k in kwargs if k not in sig.parameters]
    if not extra or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        yield
        return
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in extra]
    own = model.__dict__.get("forward")
    original = model.forward

    def forward(*a, **k):
        return original(*a, **k)

    forward.__signature__ = sig.replace(parameters=named)
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


_DYNAMIC_SIZES: list[frozenset] = []


@contextlib.contextmanager
def dynamic_sizes(args: tuple, kwargs: dict):
    """Meanwhile, a capture by torch.export (a block's) also leaves free every size of its inputs that is one of
    the sizes free in the model's own inputs (``args``, ``kwargs``): the batch, a token input's sequence length.
    A block exported for a hidden state of shape (batch, sequence, width) then takes other sequence lengths,
    as the model converted as one graph does. Free sizes that the code fixes are fixed by torch.export."""
    sizes = set()
    for t in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim():
            sizes.add(t.shape[0])
            if not t.is_floating_point() and t.dim() == 2:
                sizes.add(t.shape[1])
    _DYNAMIC_SIZES.append(frozenset(n for n in sizes if n > 1))
    try:
        yield
    finally:
        _DYNAMIC_SIZES.pop()


def _auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    import inspect

    auto = torch.export.Dim.AUTO

    sizes = _DYNAMIC_SIZES[-1] if _DYNAMIC_SIZES else frozenset()

    def spec(v):
        if isinstance(v, torch.Tensor):
            if not v.dim():
                return None
            token = not v.is_floating_point() and v.dim() == 2  # ids, masks, positions: (batch, sequence)
            free = set(range(2 if token else 1)) | {i for i, n in enumerate(v.shape) if n in sizes}
            return {i: auto for i in sorted(free)}
        if isinstance(v, (tuple, list)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(model.forward).parameters[name].kind
        out[name] = (tuple(spec(x) for x in value) if kind is inspect.Parameter.VAR_POSITIONAL
                     else {k: spec(x) for k, x in value.items()} if kind is inspect.Parameter.VAR_KEYWORD
                     else spec(value))
    return out


# torch's warnings about its own code, set off by the way autocastfx drives it: by category and message, so that
# every other warning (the model's, autocastfx's own, torch's about the model) still reaches the caller
_TORCH_INTERNAL_WARNINGS = (
    # torch.export.unflatten writes get_attr nodes before it sets the attributes they read (one per submodule)
    (UserWarning, "Attempted to insert a get_attr Node with no underlying reference in the owning GraphModule"),
    # copy.deepcopy of a pytree spec (a graph's code generator, an export's call signatures) makes each leaf
    # anew through the class torch marks deprecated
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # nn.LSTM/GRU/RNN refresh their own _flat_weights list as they run; torch.export notes it and restores it
    (UserWarning, r"The tensor attributes? (self\.[\w.]*_flat_weights\[\d+\](, )?)+ (was|were) assigned during export"),
)


@contextlib.contextmanager
def torch_internal_warnings_off():
    """Meanwhile, torch's warnings about its own internals (``_TORCH_INTERNAL_WARNINGS``) are not shown."""
    with warnings.catch_warnings():
        for category, message in _TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch._export",
                                               "torch.export", "torch._dynamo", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # fake tensors log a traceback for each op that raises: the raised error is enough
        lg.setLevel(logging.CRITICAL if lg.name == "torch._subclasses.fake_tensor" else logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _graph_module(root: nn.Module, graph: fx.Graph, name: str, compile_code: bool) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, name)``; without its code when ``compile_code`` is False: the instance's
    ``recompile`` is a no-op until the caller deletes it and recompiles (the constructor writes the code through
    ``self.recompile()``, which finds the instance attribute first)."""
    if compile_code:
        return fx.GraphModule(root, graph, name)
    gm = fx.GraphModule.__new__(fx.GraphModule, root, graph, name)  # the per-instance class GraphModule makes
    object.__setattr__(gm, "recompile", no_recompile)
    gm.__init__(root, graph, name)
    return gm


def no_recompile() -> None:
    """Stands in for ``gm.recompile`` while a conversion's passes edit the graph."""
    return None


def _accepts_kwargs(gm: fx.GraphModule, kwargs: dict) -> bool:
    names = {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    return all(k in names for k in kwargs)


def _one_line(e: BaseException) -> str:
    lines = [ln for ln in "".join(traceback.format_exception_only(type(e), e)).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) < 300 else text[:297] + "..."


def _strip_export_asserts(gm: fx.GraphModule) -> None:
    """torch.export pins every dtype with ``_assert_tensor_metadata``; the rewrite changes dtypes on purpose."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
        ) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


# ----------------------------------------------------------------------------------------------------------
# Facts about every value: dtype, shape, bytes, FLOPs, from one run of the graph on fake tensors.

from dataclasses import dataclass  # noqa: E402

from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


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


def _info(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorInfo(v.dtype, tuple(int(s) for s in v.shape), v.device.type)
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        return tuple(_info(x) for x in v)
    return None


class _Recorder(fx.Interpreter):
    """Runs the graph for real, storing a TensorInfo on every node."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["autocastfx_info"] = _info(out)
        return out


_log = logging.getLogger("autocastfx.propagate")

# How many propagations ran on fake tensors, how many on the real values, and how many of those because
# the fake run could not work (an op whose output shape depends on values, an op without a fake kernel).
propagate_counts: collections.Counter = collections.Counter()


def propagate(gm: fx.GraphModule, args: tuple, kwargs: dict, *, mode: str = "fake") -> Any:
    """Record the dtype, shape and device of every value of the graph on the example inputs, as a
    ``TensorInfo`` (or a tuple of them) in ``node.meta["autocastfx_info"]``; returns the output's.

    ``mode="fake"`` runs the graph on fake tensors: no real op runs, no memory holds activations, and the
    model's parameters, buffers and random-number state are never touched. Where the fake run cannot work
    (an op whose output shape depends on values, such as ``nonzero``, or one without a fake kernel), the
    graph runs once for real instead; that is counted in ``propagate_counts["fallback"]``, logged on the
    ``autocastfx.propagate`` logger and written in ``gm.meta["autocastfx_propagate"]``. ``mode="real"``
    always runs for real (the reference the fake run is tested against)."""
    if mode not in ("fake", "real"):
        raise ValueError(f"propagate mode must be 'fake' or 'real', got {mode!r}")
    flat_args = _flatten_inputs(gm, args, kwargs)
    _check_example_values(flat_args)
    if mode == "fake":
        try:
            out = _FakeRun(gm).run(flat_args)
        except Exception as e:  # noqa: BLE001 - whatever the fake run cannot do, the real run decides
            reason = _one_line(e)
            propagate_counts["fallback"] += 1
            _log.info("fake propagation of %s failed (%s); running it on the example values",
                      type(gm).__name__, reason)
        else:
            propagate_counts["fake"] += 1
            gm.meta["autocastfx_propagate"] = "fake"
            return out
    if META_DEVICE.get() is not None:
        raise CaptureError(f"{type(gm).__name__} cannot be converted on the meta device: its shapes are not known "
                           f"without values ({reason}); materialise it (model.to_empty(device=...) and load its "
                           "weights) and convert that")
    out = _propagate_real(gm, flat_args)
    propagate_counts["real"] += 1
    gm.meta["autocastfx_propagate"] = "real" if mode == "real" else f"real (fake run failed: {reason})"
    return out


def _propagate_real(gm: fx.GraphModule, flat_args: list) -> Any:
    """Run the graph once, in float32 and without gradients, on the example values. Buffers (batch-norm
    statistics) and the random-number state are restored after, so the run leaves no trace."""
    saved = {k: v.detach().clone() for k, v in gm.state_dict(keep_vars=True).items()}
    devices = sorted({a.device.index or 0 for a in flat_args if isinstance(a, torch.Tensor) and a.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            _Recorder(gm).run(*flat_args)
    finally:
        with torch.no_grad():
            for k, v in gm.state_dict(keep_vars=True).items():
                if k in saved and v.shape == saved[k].shape:
                    v.copy_(saved[k])
    return _output_info(gm)


def _output_info(gm: fx.GraphModule) -> Any:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return out.meta.get("autocastfx_info")


def _check_example_values(flat_args: list) -> None:
    if META_DEVICE.get() is not None:
        return  # converting on the meta device: shapes alone
    for i, a in enumerate(torch.utils._pytree.tree_leaves(flat_args)):
        if isinstance(a, torch.Tensor) and a.is_meta:
            raise ValueError(f"example input {i} is on the meta device and has no values: pass a real tensor of "
                             f"the same shape and dtype (e.g. torch.zeros({tuple(a.shape)}, dtype={a.dtype}))")


# ----------------------------------------------------------------------------------------------------------
# The fake run. Every op runs on fake tensors (FakeTensorMode: metadata only, on the example's devices), and
# each node's result is memoised by what the op is and the metadata of what it reads: a stack of identical
# blocks runs its first block on fake tensors and looks the others up. Values whose op was looked up stay
# _Virtual (metadata only) until an op that must really run reads them.

_Meta = tuple  # (shape, stride, storage offset, dtype, device, requires_grad)
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                   torch.layout, type(Ellipsis))
_MODULE_STATE = ("_parameters", "_buffers")


class _Uncacheable(Exception):
    """The node reads something whose effect on the result metadata cannot be keyed: run it each time."""


class _Virtual:
    """A tensor known by its metadata; ``source`` is the real tensor it stands for (inputs, parameters)."""
    __slots__ = ("meta", "source")

    def __init__(self, meta: _Meta, source: torch.Tensor | None = None):
        self.meta = meta
        self.source = source


def _meta(t: torch.Tensor) -> _Meta:
    device = t.device
    if device.type == "meta":  # a model converted on the meta device: planned for the device it will run on
        device = META_DEVICE.get() or device
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, device, t.requires_grad)


# The device a model converted on the meta device is planned for (its example inputs' device, else the CPU): its
# meta tensors are propagated as fake tensors of that device. Set by ``convert()`` for the conversion only.
META_DEVICE: contextvars.ContextVar = contextvars.ContextVar("autocastfx_meta_device", default=None)


class _FakeRun:
    """One propagation of ``gm`` on fake tensors; see the comment above."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.mode: Any = None            # FakeTensorMode, made at the first op that must run
        self.memo: dict = {}             # (node kind, target, metadata of the inputs) -> result template
        self.fakes: dict[int, torch.Tensor] = {}   # id(_Virtual) -> its fake tensor, once made
        self.keep: list = []             # the _Virtuals behind ``fakes`` (their ids stay unique)
        self.module_keys: dict[str, Any] = {}
        self.infos: dict[_Meta, TensorInfo] = {}

    def run(self, flat_args: list) -> Any:
        env: dict[fx.Node, Any] = {}
        inputs = iter(flat_args)
        with torch.no_grad(), _quiet_logger("torch._subclasses.fake_tensor"):
            for node in self.gm.graph.nodes:
                op = node.op
                if op == "placeholder":  # as fx.Interpreter: ``*args`` takes every input left
                    value = (_virtualize(list(inputs)) if str(node.target).startswith("*")
                             else _virtualize(next(inputs)))
                elif op == "get_attr":
                    value = _virtualize(_fetch_attr(self.gm, node.target))
                elif op == "output":
                    value = _load(node.args[0], env)
                else:
                    value = self.call(node, _load(node.args, env), _load(node.kwargs, env))
                env[node] = value
                node.meta["autocastfx_info"] = self.info(value)
        return _output_info(self.gm)

    # ---------------------------------------------------------------------------------------- one node
    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        key = self.key(node, args, kwargs)
        if key is not None:
            template = self.memo.get(key)
            if template is not None:
                return _instantiate(template)
        fargs, fkwargs = self.materialize(args), self.materialize(kwargs)
        if node.op == "call_module":
            out = self.call_module(str(node.target), fargs, fkwargs)
        else:
            with self.fake_mode():
                if node.op == "call_function":
                    out = node.target(*fargs, **fkwargs)
                else:
                    out = getattr(fargs[0], node.target)(*fargs[1:], **fkwargs)
        # a call whose result is None was made for its effect (an assert, a grad-mode switch): it runs each time
        if key is not None and out is not None and not _reads_constant((fargs, fkwargs)):
            template = _template(out)
            if template is not None:
                self.memo[key] = template
        return out

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        """The module runs with fake copies of its parameters and buffers in place of its own
        (torch.func.functional_call puts the originals back after), so nothing real is read or written."""
        module = self.gm.get_submodule(target)
        state = {name: self.fake_of(t) for name, t in
                 itertools.chain(module.named_parameters(remove_duplicate=False),
                                 module.named_buffers(remove_duplicate=False))}
        with self.fake_mode():
            if not state:
                return module(*args, **kwargs)
            return torch.func.functional_call(module, state, args, kwargs, tie_weights=False, strict=True)

    # ------------------------------------------------------------------------------------ memo keys
    def key(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """What the result's metadata is a function of, or None where that cannot be keyed."""
        op, target = node.op, node.target
        if op == "call_function":
            if not _pure_function(target) or kwargs.get("inplace") is True or "out" in kwargs:
                return None
        elif op == "call_method":
            if not (args and isinstance(args[0], (_Virtual, torch.Tensor))) or _mutating_name(target):
                return None
        else:
            target = self.module_key(str(target))
            if target is None:
                return None
        try:
            return (op, target, _key(args), _key(kwargs))
        except _Uncacheable:
            return None

    def module_key(self, target: str) -> Any:
        if target not in self.module_keys:
            m = self.gm.get_submodule(target)
            family = getattr(m, "meta", {}).get("autocastfx_block", {}).get("family") if _is_unit(m) else None
            # converted blocks copied from one plan compute the same metadata from the same inputs
            self.module_keys[target] = ("autocastfx block", family, m.training) if family else _module_key(m)
        return self.module_keys[target]

    # ------------------------------------------------------------------------------------ fake values
    def fake_mode(self):
        if self.mode is None:
            # a real tensor reaching an op is an error, and so is an op without a fake kernel (by default
            # FakeTensorMode would run it for real on zeros): either sends the graph to the real run
            self.mode = FakeTensorMode(allow_fallback_kernels=False)
        return self.mode

    def fake_of(self, v: Any) -> torch.Tensor:
        """The fake tensor for a value: made once per _Virtual and once per real tensor (tied parameters
        stay one), from metadata alone: the real tensor's storage is never read."""
        if isinstance(v, _Virtual):
            fake = self.fakes.get(id(v))
            if fake is None:
                fake = self.fake_of(v.source) if v.source is not None else self.empty(v.meta)
                self.fakes[id(v)] = fake
                self.keep.append(v)
            return fake
        if _is_fake(v):
            return v
        fake = self.fakes.get(id(v))
        if fake is None:
            fake = self.fakes[id(v)] = self.empty(_meta(v))
            self.keep.append(v)
        return fake

    def empty(self, meta: _Meta) -> torch.Tensor:
        shape, stride, offset, dtype, device, requires_grad = meta
        mode = self.fake_mode()
        with unset_fake_temporarily():
            if offset:
                extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
                t = torch.empty(offset + extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
            else:
                t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, t, device)
        return fake.requires_grad_() if requires_grad else fake

    def materialize(self, v: Any) -> Any:
        if isinstance(v, (_Virtual, torch.Tensor)):
            return self.fake_of(v)
        if isinstance(v, (tuple, list)):
            items = [self.materialize(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)  # namedtuples take fields
        if isinstance(v, dict):
            return {k: self.materialize(x) for k, x in v.items()}
        if isinstance(v, slice):
            return slice(self.materialize(v.start), self.materialize(v.stop), self.materialize(v.step))
        return v

    def info(self, v: Any) -> Any:
        if isinstance(v, _Virtual):
            meta = v.meta
        elif isinstance(v, torch.Tensor):
            meta = _meta(v)
        elif isinstance(v, (tuple, list)) and any(isinstance(x, (_Virtual, torch.Tensor)) for x in v):
            return tuple(self.info(x) for x in v)
        else:
            return None
        info = self.infos.get(meta)
        if info is None:
            info = self.infos[meta] = TensorInfo(meta[3], meta[0], meta[4].type)
        return info


@contextlib.contextmanager
def _quiet_logger(name: str):
    """FakeTensorMode logs a traceback for every op that raises; the caller reports failures itself."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for atom in target.split("."):
        if not hasattr(obj, atom):
            raise RuntimeError(f"graph reads {target!r}, which the module does not have")
        obj = getattr(obj, atom)
    return obj


def _virtualize(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _Virtual(_meta(v), v)
    if type(v) in (tuple, list):
        return type(v)(_virtualize(x) for x in v)
    if type(v) is dict:
        return {k: _virtualize(x) for k, x in v.items()}
    return v


def _load(a: Any, env: dict) -> Any:
    """The node's arguments with every input node replaced by its value."""
    if isinstance(a, fx.Node):
        return env[a]
    t = type(a)
    if t is tuple or t is list:
        return t(_load(x, env) for x in a)
    if t is dict or t is fx.immutable_collections.immutable_dict:
        return {k: _load(x, env) for k, x in a.items()}
    if t is fx.immutable_collections.immutable_list:
        return [_load(x, env) for x in a]
    if t is slice:
        return slice(_load(a.start, env), _load(a.stop, env), _load(a.step, env))
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # a namedtuple
        return t(*(_load(x, env) for x in a))
    return a


def _key(v: Any) -> Any:
    if isinstance(v, _Virtual):
        return v.meta
    if isinstance(v, torch.Tensor):
        if getattr(v, "constant", None) is not None:
            raise _Uncacheable  # a fake tensor that knows its values: results may depend on them
        return _meta(v)
    t = type(v)
    if t in _CONSTANT_TYPES:
        return (t, v)
    if t is tuple or t is list or t is torch.Size:
        return (t, tuple(_key(x) for x in v))
    if t is dict:
        return (t, tuple((k, _key(x)) for k, x in v.items()))
    if t is slice:
        return (t, _key(v.start), _key(v.stop), _key(v.step))
    raise _Uncacheable


def _template(out: Any) -> Any:
    """What a memo keeps of a result: tensors as their metadata, constants as they are; None when the
    result holds something else (a mutable object, a fake tensor that knows its values)."""
    if isinstance(out, torch.Tensor):
        return None if getattr(out, "constant", None) is not None else ("t", _meta(out))
    t = type(out)
    if t in _CONSTANT_TYPES or t is torch.Size:
        return ("c", out)
    if t is tuple or t is list:
        parts = [_template(x) for x in out]
        return None if any(p is None for p in parts) else ("s", t, parts)
    return None


def _instantiate(template: Any) -> Any:
    kind = template[0]
    if kind == "t":
        return _Virtual(template[1])
    if kind == "c":
        return template[1]
    return template[1](_instantiate(p) for p in template[2])


def _reads_constant(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return getattr(v, "constant", None) is not None
    if isinstance(v, (tuple, list)):
        return any(_reads_constant(x) for x in v)
    if isinstance(v, dict):
        return any(_reads_constant(x) for x in v.values())
    return False


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _mutating_name(name: str) -> bool:
    """In-place ops (``add_``, ``unsqueeze_``, ``operator.iadd``) may change what later readers see."""
    return name.endswith("_") and not name.endswith("__")


_PURE: dict[Any, bool] = {}


def _pure_function(fn: Any) -> bool:
    """Whether a call_function target's result metadata depends only on its arguments' metadata: torch's own
    ops and Python's operators and getattr, not in place. Other functions run every time."""
    pure = _PURE.get(fn)
    if pure is None:
        if isinstance(fn, torch._ops.OpOverload):
            pure = not fn._schema.is_mutable
        elif isinstance(fn, torch._ops.OpOverloadPacket):
            pure = not _mutating_name(fn.__name__)
        else:
            module = getattr(fn, "__module__", None) or ""
            name = getattr(fn, "__name__", "")
            pure = ((module == "torch" or module.startswith(("torch.", "torch._C")) or module == "_operator"
                     or fn is getattr) and not _mutating_name(name)
                    and not (module == "_operator" and name.startswith("i") and name not in ("index", "is_", "is_not", "invert"))
                    and name not in ("setitem", "delitem"))
        _PURE[fn] = pure
    return pure


_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _module_key(m: nn.Module) -> Any:
    """A leaf module's result metadata as a function of its type, its plain attributes and its tensors'
    metadata; None for modules that hold submodules, hooks or attributes of other kinds."""
    cls = type(m)
    if not (getattr(cls.forward, "__module__", "") or "").startswith(("torch.", "autocastfx.")):
        return None
    if m._modules or any(getattr(m, h, None) for h in _HOOKS) or _global_module_hooks():
        return None
    items = []
    for name, value in m.__dict__.items():
        if name in _MODULE_STATE:
            items.append((name, tuple((k, None if t is None else _meta(t)) for k, t in value.items())))
        elif name == "_modules" or "hook" in name or name == "_non_persistent_buffers_set":
            continue
        else:
            try:
                items.append((name, _key(value)))
            except _Uncacheable:
                return None
    return (cls, tuple(items))


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as _m
    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks)


def node_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """FLOPs of one node (matmul/conv/attention, as torch.utils.flop_counter counts them), from the recorded
    shapes, on meta tensors. Computed on demand by the report and cached in ``node.meta``."""
    if "autocastfx_flops" in node.meta:
        return node.meta["autocastfx_flops"]
    flops = 0
    if node.op in ("call_function", "call_method") and op_name(node) in _COUNTED:
        def meta_of(a):
            if not isinstance(a, fx.Node):
                return a
            info = a.meta.get("autocastfx_info")
            if not isinstance(info, TensorInfo):
                raise ValueError(f"no recorded tensor for {a.name}")
            return torch.empty(info.shape, dtype=torch.float32 if info.is_float else info.dtype, device="meta")
        try:
            args = fx.node.map_aggregate(node.args, meta_of)
            kwargs = fx.node.map_aggregate(node.kwargs, meta_of)
            fn = node.target if node.op == "call_function" else getattr(type(args[0]), node.target)
            with FlopCounterMode(display=False) as fc:
                fn(*args, **kwargs)
            flops = int(fc.get_total_flops())
        except Exception:  # noqa: BLE001 - an op without a meta kernel counts as unknown (0)
            flops = 0
    node.meta["autocastfx_flops"] = flops
    return flops


def placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[tuple[fx.Node, Any]]:
    """(placeholder, the example value it takes) for each of ``gm``'s inputs; empty where they cannot be paired."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        values = _flatten_inputs(gm, args, kwargs)
    except TypeError:
        return []
    return list(zip(places, values)) if len(values) == len(places) else []


def _flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """Positional values for the graph's placeholders, in order."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is not None:  # torch.export module: the graph takes the flattened (args, kwargs)
        flat, _ = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
        return flat
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(args) > len(placeholders) and not any(str(p.target).startswith("*") for p in placeholders):
        names = ", ".join(str(p.target) for p in placeholders)
        raise TypeError(f"{len(args)} example inputs given, but the graph takes {len(placeholders)} ({names}): "
                        "pass one example value per argument of forward")
    values = list(args)
    for p in placeholders[len(values):]:
        if p.target in kwargs:
            values.append(kwargs[p.target])
        elif p.args:
            values.append(p.args[0])  # default value
        else:
            raise TypeError(f"no example value for input {p.target!r}: pass it in example_inputs/example_kwargs")
    return values



_OUTPUT_TYPES: dict[str, type] = {}


def rebuild_output(values: dict, cls: str) -> Any:
    """The model's own result type (a Hugging Face ModelOutput, named ``module:qualname``) from the dict a
    trace wrote in its place."""
    t = _OUTPUT_TYPES.get(cls)
    if t is None:
        import importlib
        module, _, qual = cls.partition(":")
        t = importlib.import_module(module)
        for part in qual.split("."):
            t = getattr(t, part)
        _OUTPUT_TYPES[cls] = t
    return t(**values)


def type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
