"""Capture: model -> GraphModule. torch.fx.symbolic_trace first, torch.export (training IR) second."""
from __future__ import annotations

import copy
import itertools
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.policy import Policy
from ..base.errors import one_line, CaptureError
from ..base import keys as K
from .torch_export import capture_export
from ..base.meta import is_converted
from ..base.runtime import no_recompile
from ..core.propagate import propagate
from .watch import watch_training
from .context import CaptureContext


class ModelTracer(fx.Tracer):
    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.policy.is_leaf(m) or (bool(qualname) and is_converted(m))  # a converted block: one call

    def trace(self, root, concrete_args=None):
        self._param_names = {id(p): n for n, p in root.named_parameters()} if isinstance(root, nn.Module) else {}
        self._arg_depth, self.output_type = 0, None
        return super().trace(root, concrete_args)

    def create_arg(self, a):
        # the forward's result is the last top-level create_arg; fx writes a dict subclass there (a Hugging Face
        # ModelOutput) as a plain dict, so its type is noted to restore it
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


def copy_model(model: nn.Module, share_tensors: bool, keep: Iterable[nn.Module] = ()) -> nn.Module:
    """Deep-copy ``model``, sharing the modules in ``keep`` (the caller replaces them before handing the copy on)
    and, with ``share_tensors``, its parameters, buffers and converted blocks."""
    memo: dict[int, Any] = {id(m): m for m in keep}
    if share_tensors:
        for t in itertools.chain(model.parameters(), model.buffers()):
            memo[id(t)] = t
        for name, m in model.named_modules():
            if name and is_converted(m):  # a converted block inside: the capture calls it, never copies it
                memo[id(m)] = m
    return copy.deepcopy(model, memo)


def capture_graph(model: nn.Module, args: tuple, kwargs: dict, policy: Policy, ctx: CaptureContext,
             compile_code: bool = True,
             method: str | None = None, check: bool = True, reads: list | None = None
             ) -> tuple[fx.GraphModule, str]:
    """Capture ``model`` by symbolic tracing, falling back to torch.export; returns the graph and the method used.

    ``method`` (``"symbolic_trace"`` or ``"torch.export"``) forces one way: a second capture in another mode must
    take the way the first took. ``check=False`` skips running a traced graph on the example inputs (the caller
    propagates it). ``reads`` collects the modules whose ``training`` flag the model's code read."""
    if method == "torch.export":
        return capture_export(model, args, kwargs, ctx, check=check, reads=reads)
    try:
        tracer = ModelTracer(policy)
        with watch_training(model, reads), _RealOps(model) as real:
            graph = tracer.trace(model)
        if real.why is not None:
            raise CaptureError(real.why)
        gm = _graph_module(tracer.root, graph, model.__class__.__name__, compile_code)
        if tracer.output_type is not None:
            gm.meta[K.OUTPUT_TYPE] = tracer.output_type
        if kwargs and not _accepts_kwargs(gm, kwargs):
            raise TypeError(f"traced forward does not take keyword inputs {sorted(kwargs)}")
        if check:
            propagate(gm, args, kwargs, meta_device=ctx.meta_device)
        return gm, "symbolic_trace"
    except Exception as e:  # noqa: BLE001 - every tracing failure goes to the fallback
        if method is not None:
            raise CaptureError(f"cannot trace {type(model).__name__} in this mode: {one_line(e)}") from e
        trace_error = e
    return capture_export(model, args, kwargs, ctx, trace_error, reads=reads)


# random ops: symbolic tracing runs one with no traced argument for real, fixing its draw as a graph constant
_RANDOM = frozenset(getattr(torch.ops.aten, n) for n in (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "multinomial", "native_dropout", "poisson") if hasattr(torch.ops.aten, n))


class _RealOps(TorchDispatchMode):
    """Notes (``why``) ops that symbolic tracing runs for real, their inputs untraced, leaving a graph constant.

    Flagged: a random draw (``h + torch.randn(8)``, a layer drop by ``torch.rand(()).item()``), which would be the
    same draw at every call, and an in-place update of the model's own tensors (a moving-average buffer, a step
    counter), which would happen once, at trace time. Updated tensors get their values back on exit. Either sends
    the capture to torch.export, which records both as ops."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.own = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
        self.storages = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())
                         if not t.is_meta and t.untyped_storage().data_ptr()}
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.why: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket in _RANDOM and self.why is None:
            self.why = (f"its code draws random numbers ({func._overloadpacket.__name__}) from no input, which "
                        "symbolic tracing would fix as one draw")
        if func._schema.is_mutable:
            for arg, value in zip(func._schema.arguments, itertools.chain(args, kwargs.values())):
                if arg.alias_info is not None and arg.alias_info.is_write and self._owns(value):
                    self.saved.append((value, value.detach().clone()))
                    if self.why is None:
                        self.why = (f"its code updates a tensor of its own in place ({func._overloadpacket.__name__}), "
                                    "which symbolic tracing would do once, while tracing")
        return func(*args, **kwargs)

    def _owns(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return id(t) in self.own or (not t.is_meta and t.untyped_storage().data_ptr() in self.storages)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        with torch.no_grad():
            for t, value in reversed(self.saved):  # the first value saved is the one before the trace
                t.copy_(value)
        return out


def _graph_module(root: nn.Module, graph: fx.Graph, name: str, compile_code: bool) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, name)``, without code when ``compile_code`` is False: an instance-level no-op
    ``recompile`` shadows the constructor's ``self.recompile()`` until the caller deletes it and recompiles."""
    if compile_code:
        return fx.GraphModule(root, graph, name)
    gm = fx.GraphModule.__new__(fx.GraphModule, root, graph, name)  # the per-instance class GraphModule makes
    object.__setattr__(gm, "recompile", no_recompile)
    gm.__init__(root, graph, name)
    return gm


def _accepts_kwargs(gm: fx.GraphModule, kwargs: dict) -> bool:
    names = {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    return all(k in names for k in kwargs)
