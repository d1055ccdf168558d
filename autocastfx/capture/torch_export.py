"""Capture by torch.export: the program of a model that symbolic_trace cannot trace, with free batch and sequence
sizes where the model allows them, on the meta device too."""
from __future__ import annotations
import contextlib
import copy
import functools
import threading
import torch
import torch.fx as fx
import torch.nn as nn
from ..base.errors import one_line, CaptureError
from .around import export_around
from .context import CaptureContext, auto_axes
from ..core.propagate import check_example_values, propagate
from .watch import outer_units, watch_training
from ..base.quiet import quiet_torch_logs, torch_internal_warnings_off


# torch's fake-tensor dispatch cache slows an export with free sizes: a cache hit rebuilds its output's symbolic
# sizes and strides at more cost than the op's meta function (pytorch/pytorch#191500, pytorch/pytorch#192047), so
# it is turned off around each such export. No export records a source stack per node
# (``torch.fx.config.do_not_emit_stack_traces``, where this torch has it): nothing reads them, the generated code never
# shows them, a converted module's own export would find only generated code, and extracting and formatting one stack
# per traced op costs time (docs/benchmarks.md). Both configs are
# process-wide: an export in another thread meanwhile may run with or without the cache and stacks, which changes
# its speed and its nodes' ``stack_trace`` metadata, never its program.


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t.detach().clone().requires_grad_(t.requires_grad)


def run_export(model: nn.Module, args: tuple, kwargs: dict | None = None,
               **options) -> torch.export.ExportedProgram:
    """``torch.export.export`` without node stack traces; with ``dynamic_shapes``, without the fake-tensor cache
    (see above). An input that is a view (``idx[:, :5]``) is given as a copy: torch.export
    guards on a view's base (``x._base.size()``), and the program's guard then fails on a later input that is no
    view (``'NoneType' object has no attribute 'size'``)."""
    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, _not_a_view, (tuple(args), kwargs))
    cache = contextlib.nullcontext() if options.get("dynamic_shapes") is None else \
        torch._dynamo.config.patch(fake_tensor_cache_enabled=False)
    with cache, _no_stack_traces():
        return torch.export.export(model, args, kwargs, **options)


_STACKS = {"depth": 0, "before": None}  # the exports under way in this process, and the caller's flag before them
_STACKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_stack_traces():
    """Meanwhile exports record no node stack traces; the first export of overlapping ones (other threads') turns
    them off, and the last one puts the caller's flag back."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    with _STACKS_LOCK:
        if _STACKS["depth"] == 0:
            _STACKS["before"] = config.do_not_emit_stack_traces
        _STACKS["depth"] += 1
        config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        with _STACKS_LOCK:
            _STACKS["depth"] -= 1
            if _STACKS["depth"] == 0:
                config.do_not_emit_stack_traces = _STACKS["before"]


def capture_export(model: nn.Module, args: tuple, kwargs: dict, ctx: CaptureContext = CaptureContext(),
                   trace_error: BaseException | None = None, check: bool = True, reads: list | None = None) -> tuple[fx.GraphModule, str]:
    check_example_values(torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs))), ctx.meta_device)
    units = outer_units(model)
    try:
        with quiet_torch_logs():  # torch.export prints graphs and shape warnings while it fails; the error says it all
            if units:  # the converted blocks inside stay calls of one graph around them; what the blocks read of
                # their own modes is theirs, not the root's: only the root's own modules are watched
                with watch_training(model, reads):
                    gm = export_around(model, tuple(args), dict(kwargs), units, functools.partial(_export, ctx=ctx),
                                       ctx.sources)
            else:
                with watch_training(model, reads), torch_internal_warnings_off():
                    gm = _export(model, tuple(args), dict(kwargs), ctx=ctx).module()
        _strip_export_asserts(gm)
        if check:
            propagate(gm, args, kwargs, meta_device=ctx.meta_device)
        return gm, "torch.export"
    except Exception as e:  # noqa: BLE001
        export_error = e
    raise CaptureError(
        f"cannot capture {type(model).__name__} as a graph.\n"
        f"  torch.fx.symbolic_trace failed: {one_line(trace_error) if trace_error else 'not tried'}\n"
        f"  torch.export.export(strict=False) failed: {one_line(export_error)}\n"
        "Ways out: convert a submodule that traces (autocastfx.convert(model.backbone, ...)); mark the "
        "module that breaks tracing as a leaf (Policy.default().override(leaf_modules=(MyBlock,))); remove "
        "data-dependent Python control flow from forward (if x.sum() > 0: ...); or pass example_inputs "
        "that match forward's signature so the torch.export fallback can run."
    ) from export_error


def _export(model: nn.Module, args: tuple, kwargs: dict, preserve: tuple[str, ...] = (), *, ctx: CaptureContext):
    """torch.export with the batch size, and the sequence length of token inputs, free (``Dim.AUTO``), else static.
    Other sizes stay the example's, as free spatial sizes make a windowed vision model's export slow
    (docs/benchmarks.md, "Free sizes in torch.export")."""
    target = ctx.meta_device
    if target is not None:  # on the meta device: the inputs too, and the device the program will run on after
        args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with _explicit_keywords(model, kwargs), _data_dependence_raised_quietly(model):
        try:
            spec = _auto_dynamic_shapes(model, args, kwargs, ctx.dynamic_sizes)
            ep = run_export(model, args, kwargs, dynamic_shapes=spec, strict=False,
                            preserve_module_call_signature=preserve)
        except _DataDependent as e:  # the static export would stop at the same line of the model's code
            raise e.__cause__ from None
        except Exception:  # noqa: BLE001 - the static export below reports its own failure
            try:
                ep = run_export(model, args, kwargs, strict=False, preserve_module_call_signature=preserve)
            except _DataDependent as e:
                raise e.__cause__ from None
    if target is not None:
        _retarget_devices(ep.graph_module, torch.device("meta"), target)
        _constants_with_values(ep, model, args, kwargs, target, preserve)
    return ep


def _constants_with_values(ep, model: nn.Module, args: tuple, kwargs: dict, target: torch.device,
                           preserve: tuple[str, ...]) -> None:
    """Fill the constants a model on meta makes from Python values (``x[:, [-1]]``'s index, ``torch.tensor([...])``),
    which no loading fills, from a second export of a copy whose tensors are fake tensors of ``target``;
    CaptureError where that fails."""
    lifted = set(ep.graph_signature.lifted_tensor_constants)  # not the model's non-persistent buffers (loaded)
    missing = {k for k, v in ep.constants.items() if k in lifted and isinstance(v, torch.Tensor) and v.is_meta}
    if not missing:
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()

    def fake(t):
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)

    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            memo[id(t)] = nn.Parameter(fake(t), t.requires_grad) if isinstance(t, nn.Parameter) else fake(t)
    found = {}
    try:
        twin = copy.deepcopy(model, memo)
        fargs, fkwargs = torch.utils._pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
        with _explicit_keywords(twin, fkwargs):
            again = run_export(twin, fargs, fkwargs, strict=False, preserve_module_call_signature=preserve)
        found = {k: v for k, v in again.constants.items() if k in missing and isinstance(v, torch.Tensor)
                 and not v.is_meta and not isinstance(v, torch._subclasses.fake_tensor.FakeTensor)
                 and v.shape == ep.constants[k].shape and v.dtype == ep.constants[k].dtype}
        error = None
    except Exception as e:  # noqa: BLE001 - reported below, with the constants it leaves without values
        error = e
    if missing - set(found):
        raise CaptureError(
            f"the model's code makes tensors from Python values ({', '.join(sorted(missing - set(found)))}: an index "
            "list such as x[:, [-1]], a torch.tensor([...])), which on the meta device have no values, and they "
            f"could not be found another way ({one_line(error) if error else 'the program made them otherwise'}). "
            "Convert the model materialised (on its device), or make such values from the inputs' device in its "
            "code") from error
    for k, v in found.items():
        ep.constants[k] = v


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


class _DataDependent(Exception):
    """A data-dependence error of the model's code, carried through torch.export as a non-RuntimeError, since for a
    RuntimeError saying "data-dependent" torch.export prints the graph so far to stderr (pytorch/pytorch#146298)."""


@contextlib.contextmanager
def _data_dependence_raised_quietly(model: nn.Module):
    """Meanwhile ``model.forward`` (of the capture's own copy) raises a data-dependence error as
    :class:`_DataDependent`, its cause the model's error."""
    original = model.forward

    @functools.wraps(original)
    def forward(*a, **k):
        try:
            return original(*a, **k)
        except RuntimeError as e:
            if e.args and isinstance(e.args[0], str) and "data-dependent" in e.args[0]:
                raise _DataDependent() from e
            raise

    with _forward_as(model, forward):
        yield


@contextlib.contextmanager
def _forward_as(model: nn.Module, forward):
    """Meanwhile ``model.forward`` is ``forward`` (an instance attribute of the capture's copy), then as it was."""
    own = model.__dict__.get("forward")
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


@contextlib.contextmanager
def _explicit_keywords(model: nn.Module, kwargs: dict):
    """Meanwhile ``model.forward`` names every keyword input it takes through ``**kwargs`` (a Hugging Face layer's
    ``position_ids``), without which torch.export's dynamic export of a ``**kwargs`` forward fails."""
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
    original = model.forward

    def forward(*a, **k):
        return original(*a, **k)

    forward.__signature__ = sig.replace(parameters=named)
    with _forward_as(model, forward):
        yield


def _auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict, sizes: frozenset[int]) -> dict:
    import inspect

    auto = torch.export.Dim.AUTO

    def spec(v):
        if isinstance(v, torch.Tensor):
            if not v.dim():
                return None
            return {i: auto for i in auto_axes(v, sizes)}  # ids, masks, positions: (batch, sequence)
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


def _strip_export_asserts(gm: fx.GraphModule) -> None:
    """torch.export pins every dtype with ``_assert_tensor_metadata``; the rewrite changes dtypes on purpose."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
        ) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
