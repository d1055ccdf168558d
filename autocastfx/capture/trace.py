"""Capture: model -> GraphModule. torch.fx.symbolic_trace first, torch.export (training IR) second."""
from __future__ import annotations

import contextlib
import copy
import dis
import inspect
import itertools
import os
import random
import sys
import threading
import types
import weakref
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.policy import Policy
from ..base.errors import one_line, CaptureError
from ..base.quiet import warn_user
from ..base import keys as K
from .torch_export import capture_export
from ..base.meta import TensorInfo, is_converted, is_plain_setting
from ..base.runtime import no_recompile
from ..core.flops import node_flops
from ..core.propagate import flatten_inputs, propagate
from .watch import watch_training
from .context import CaptureContext


class ModelTracer(fx.Tracer):
    # a buffer read is a node, as a parameter read is: an expression of buffers alone (a normaliser's
    # sqrt(running_var + eps), an EMA's 0.5 * ema) is computed at each call from the buffer as it is then, not
    # once at the trace into a constant that a later update or load_state_dict would never reach; a buffer the
    # code branches on stops the trace (torch.export captures the model)
    proxy_buffer_attributes = True

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.policy.is_leaf(m) or (bool(qualname) and is_converted(m))  # a converted block: one call

    def trace(self, root, concrete_args=None):
        self._thread = threading.get_ident()
        self._param_names = {id(p): n for n, p in root.named_parameters()} if isinstance(root, nn.Module) else {}
        self._buffer_names = {id(b): n for n, b in root.named_buffers()} if isinstance(root, nn.Module) else {}
        self._arg_depth, self.output_type, self.why = 0, None, None
        self.checkpointed = False  # whether an op was traced inside torch.utils.checkpoint
        self._modes = _grad_modes()
        tables = [m._buffers for m in root.modules()] if isinstance(root, nn.Module) else []
        kept = [dict(t) for t in tables]
        try:
            return super().trace(root, concrete_args)
        finally:  # a buffer the code rebinds (self.steps = self.steps + 1) is no node: put back, and refused
            for table, before in zip(tables, kept):
                if table.keys() != before.keys() or any(table[k] is not v for k, v in before.items()):
                    if self.why is None:
                        name = next((k for k in table if table.get(k) is not before.get(k)), "a buffer")
                        self.why = f"its forward rebinds a buffer ({name} = ...), which symbolic tracing leaves out"
                    table.clear()
                    table.update(before)

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw):
        # an op traced inside ``torch.no_grad()``, ``inference_mode()`` or a ``torch.autocast`` region: symbolic
        # tracing records the op, not the region, so its gradients or its dtype would be lost
        if self.why is None and kind in ("call_function", "call_method", "call_module") \
                and _grad_modes() != self._modes and not _in_reentrant_checkpoint():
            self.why = ("its code runs ops in a region of its own grad mode or autocast (torch.no_grad(), "
                        "torch.autocast(..., enabled=False)), which symbolic tracing does not record")
        if not self.checkpointed and kind in ("call_function", "call_method", "call_module"):
            self.checkpointed = _in_checkpoint()
        return super().create_proxy(kind, target, args, kwargs, *rest, **kw)

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

    # fx patches nn.Module.__call__ and __getattr__ process-wide while it traces (torch/fx/_symbolic_trace.py): a
    # module another thread calls meanwhile (a converted module running) would enter this trace and fail with
    # "module is not installed as a submodule" (pytorch/pytorch#112775; torch after 2.13 checks the thread itself,
    # pytorch/pytorch#187589). Another thread's calls and reads run as they would untraced.
    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._thread:
            return attr_val
        # fx's own lookup scans every parameter and buffer on every access (quadratic in model size): use a dict
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        names = self._param_names if isinstance(attr_val, nn.Parameter) else self._buffer_names
        name = names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def copy_model(model: nn.Module, share_tensors: bool, keep: Iterable[nn.Module] = ()) -> nn.Module:
    """Deep-copy ``model``, sharing the modules in ``keep`` (the caller replaces them before handing the copy on)
    and, with ``share_tensors``, its parameters, buffers, plain tensor attributes and converted blocks."""
    memo: dict[int, Any] = {id(m): m for m in keep}
    if share_tensors:
        for t in itertools.chain(model.parameters(), model.buffers()):
            memo[id(t)] = t
        for t in unregistered_tensors(model):  # a table kept as a plain attribute, a teacher kept in a list: the
            memo[id(t)] = t                     # model's own, not copies to go stale (or never train)
        for name, m in model.named_modules():
            if name and is_converted(m):  # a converted block inside: the capture calls it, never copies it
                memo[id(m)] = m
    return copy.deepcopy(model, memo)


def unregistered_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s modules hold outside their parameters and buffers: plain tensor attributes, and
    tensors in lists, tuples and dicts of them, with every tensor of a module found there."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(v, depth):
        if isinstance(v, torch.Tensor):
            if type(v) in (torch.Tensor, nn.Parameter):  # not a fake or other wrapper a pass left behind
                found.setdefault(id(v), v)
        elif isinstance(v, nn.Module):
            if id(v) in seen:
                return
            seen.add(id(v))
            for m in v.modules():
                seen.add(id(m))
                for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                    walk(t, depth)
                own_cache = type(m).__module__.startswith("torch.")  # torch's private caches (an RNN's _flat_weights)
                for k, x in vars(m).items():
                    if k not in ("_parameters", "_buffers", "_modules") and not (own_cache and k[0] == "_"):
                        walk(x, depth + 1)
        elif depth < 4 and type(v) in (list, tuple, dict, set):
            for x in (v.values() if isinstance(v, dict) else v):
                walk(x, depth + 1)

    walk(model, 0)
    return list(found.values())


def capture_graph(model: nn.Module, args: tuple, kwargs: dict, policy: Policy, ctx: CaptureContext,
             compile_code: bool = True,
             method: str | None = None, check: bool = True, reads: list | None = None
             ) -> tuple[fx.GraphModule, str]:
    """Capture ``model`` by symbolic tracing, falling back to torch.export; returns the graph and the method used.

    Args:
        method: ``"symbolic_trace"`` or ``"torch.export"`` forces one way (a capture in another mode must take the
            way the first took).
        check: False skips propagating the graph and checking its values (the caller propagates it).
        reads: collects the modules whose ``training`` flag the model's code read.
    """
    devices = sorted({t.device.index or 0 for t in itertools.chain(model.parameters(), model.buffers())
                      if t.device.type == "cuda"})
    # captured as it trains: a no_grad region of its own is a change of mode to keep; a draw the capture runs for
    # real (a trace of ``torch.randn(8)``) leaves the caller's random stream as it was
    caller = torch.is_grad_enabled()
    with torch.enable_grad(), torch.random.fork_rng(devices=devices), _plain_tensors_kept(model), \
            _python_draws_refused(model):
        return _capture_graph(model, args, kwargs, policy, ctx, compile_code, method, check, reads, caller)


@contextlib.contextmanager
def _python_draws_refused(model: nn.Module):
    """Meanwhile Python's and NumPy's global random states are kept; CaptureError where the model's code drew from
    them (LayerDrop as ``random.random() < p``): a captured graph would fix that draw as the capture's one."""
    before = _python_random_states()
    drew = False
    try:
        yield
    finally:
        drew = _python_random_states() != before
        _set_python_random_states(before)
    if drew:
        raise CaptureError(
            f"{type(model).__name__}'s code draws random numbers from Python's random module or NumPy's (a "
            "LayerDrop written as random.random() < p), which a captured graph would fix as one draw: draw with "
            "torch (torch.rand(()) < p), which the converted module draws at each call")


def _python_random_states() -> tuple:
    """Python's random state, and NumPy's global one where NumPy is imported (its key array as a tuple, comparable
    with ==)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return random.getstate(), None
    name, keys, *rest = numpy.random.get_state()
    return random.getstate(), (name, tuple(keys.tolist()), *rest)


def _set_python_random_states(states: tuple) -> None:
    random.setstate(states[0])
    numpy = sys.modules.get("numpy")
    if numpy is not None and states[1] is not None:
        name, keys, *rest = states[1]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), *rest))


def _capture_graph(model: nn.Module, args: tuple, kwargs: dict, policy: Policy, ctx: CaptureContext,
                   compile_code: bool, method: str | None, check: bool, reads: list | None, caller: bool
                   ) -> tuple[fx.GraphModule, str]:
    why = opaque_code(model)
    if why is not None:
        raise CaptureError(f"cannot capture {type(model).__name__} as a graph: {why}. blocks='auto' (the default) "
                           "converts the parts around that module and runs it as the model's own Python")
    if method == "torch.export":
        out = capture_export(model, args, kwargs, ctx, check=check, reads=reads)
        if _export_checkpointing(model):
            _warn_checkpointing(model)
        return out
    try:
        if _root_hooks(model):  # symbolic tracing runs forward, not the model's call with its hooks
            raise CaptureError("the model has forward hooks of its own, which tracing its forward would leave out")
        tracer = ModelTracer(policy)
        with watch_training(model, reads), _RealOps(model) as real:
            graph = tracer.trace(model)
        written = _buffers_written(graph, set(tracer._buffer_names.values()))
        if real.why is None and tracer.why is None and written:
            tracer.why = (f"its code updates its buffer {written[0]} in place, which torch.export captures with its "
                          "writes")
        if real.why is not None or tracer.why is not None:
            raise CaptureError(real.why or tracer.why)
        if tracer.checkpointed:
            _warn_checkpointing(model)
        gm = _graph_module(tracer.root, graph, model.__class__.__name__, compile_code)
        if tracer.output_type is not None:
            gm.meta[K.OUTPUT_TYPE] = tracer.output_type
        if kwargs and not _accepts_kwargs(gm, kwargs):
            raise TypeError(f"traced forward does not take keyword inputs {sorted(kwargs)}")
        if check:
            propagate(gm, args, kwargs, meta_device=ctx.meta_device)
            if method is None:
                with torch.set_grad_enabled(caller):  # no autograd graph where the caller records none
                    _computes_as_model(model, gm, args, kwargs)
        return gm, "symbolic_trace"
    except Exception as e:  # noqa: BLE001 - every tracing failure goes to the fallback
        if method is not None:
            raise CaptureError(f"cannot trace {type(model).__name__} in this mode: {one_line(e)}") from e
        trace_error = e
    out = capture_export(model, args, kwargs, ctx, trace_error, reads=reads)
    if _export_checkpointing(model):
        _warn_checkpointing(model)
    return out


def opaque_code(model: nn.Module) -> str | None:
    """Why no capture of ``model`` computes what its code computes, where its modules' code (their ``forward`` and
    the functions and methods it calls, two calls deep) uses a custom ``torch.autograd.Function`` (a graph holds
    the ops of its forward, and autograd differentiates those instead of running its backward) or
    ``torch.inference_mode()`` (which neither symbolic tracing nor torch.export records: the ops inside would
    record gradients); None otherwise."""
    seen: set[type] = set()
    for m in model.modules():
        cls = type(m)
        if cls not in seen and not is_converted(m) and not (cls.__module__ or "").startswith("torch."):
            seen.add(cls)
            why = _class_code(cls)
            if why is not None:
                return f"{cls.__name__}'s code {why}"
    return None


# each class's answer, for its forward as it was read (a Hugging Face model's code is read in about 10 ms): held
# weakly, so a class and its forward go when the program drops them
_READ: "weakref.WeakKeyDictionary[type, tuple]" = weakref.WeakKeyDictionary()


def _class_code(cls: type) -> str | None:
    fn = getattr(cls.forward, "__func__", cls.forward)
    hit = _READ.get(cls)
    if hit is not None and hit[0]() is fn:
        return hit[1]
    why = _opaque_function(cls, fn, 0)
    try:
        _READ[cls] = (weakref.ref(fn), why)
    except TypeError:  # a forward that is no function (a callable object): read again next time
        pass
    return why


def _opaque_function(cls: type, fn: Any, depth: int) -> str | None:
    code = getattr(fn, "__code__", None)
    if code is None or (getattr(fn, "__module__", None) or "").startswith("torch."):
        return None
    found = None
    codes = [code]
    while codes and found is None:
        c = codes.pop()
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        last = None
        for ins in dis.get_instructions(c):
            if ins.opname == "LOAD_GLOBAL":
                obj = getattr(fn, "__globals__", {}).get(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):  # torch.inference_mode, self.helper
                obj = getattr(last, ins.argval, None) if isinstance(last, types.ModuleType) else \
                    inspect.getattr_static(cls, ins.argval, None)
                obj = getattr(obj, "__func__", obj)
            else:
                last = None
                continue
            last = obj
            if obj is torch.inference_mode:
                return "runs a torch.inference_mode() region, which no capture records (its ops would record " \
                       "gradients): use torch.no_grad() there"
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) \
                    and not (obj.__module__ or "").startswith("torch."):
                return (f"calls the custom torch.autograd.Function {obj.__name__}, whose backward a captured graph "
                        "would not run (autograd would differentiate the ops of its forward)")
            if isinstance(obj, types.FunctionType) and depth < 2 and obj is not fn:
                found = _opaque_function(cls, obj, depth + 1)
                if found is not None:
                    break
    return found


def _warn_checkpointing(model: nn.Module) -> None:
    warn_user(f"autocastfx: {type(model).__name__}'s forward runs activation checkpointing (torch.utils.checkpoint; "
              "timm's set_grad_checkpointing(True), Hugging Face's gradient_checkpointing_enable()), and the "
              "converted graph holds the ops inside it as plain ops: their activations are kept for backward as "
              "without checkpointing. For recomputation, convert with blocks (a ModuleList of them, blocks=\"auto\", "
              "or blocks=[...] naming them) and call autocastfx.checkpoint_blocks(gm)")


def _export_checkpointing(model: nn.Module) -> bool:
    """Whether a module of ``model`` has its activation checkpointing switched on (timm's ``grad_checkpointing``,
    Hugging Face's ``gradient_checkpointing``), which a torch.export capture records as plain ops."""
    return any(getattr(m, "grad_checkpointing", False) is True or getattr(m, "gradient_checkpointing", False) is True
               for m in model.modules())


def _grad_modes() -> tuple:
    nesting = torch.autocast_increment_nesting()  # the autocast regions entered: read by moving it and back
    torch.autocast_decrement_nesting()
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), nesting


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _in_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint`` (either form)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


def _in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint(..., use_reentrant=True)``, whose forward's
    ``no_grad`` does not mean the ops lose their gradients."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            return True
        frame = frame.f_back
    return False


def _root_hooks(model: nn.Module) -> bool:
    # the model's own; a process-wide hook (a profiler's, a monitor's) observes, and one that changes values is
    # caught by the value check
    return bool(model._forward_hooks or model._forward_pre_hooks)


@contextlib.contextmanager
def _plain_tensors_kept(model: nn.Module):
    """Meanwhile the capture may run the model's code for real: its plain tensor attributes (shared with the
    capture's copy; a counter it steps) get their values back on exit."""
    saved = {id(t): (t, t.detach().clone()) for t in unregistered_tensors(model)
             if not isinstance(t, nn.Parameter) and not t.is_meta}  # a list-held module's buffers too
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in saved.values():
                if not torch.equal(t, value):
                    t.copy_(value)


@contextlib.contextmanager
def tensors_kept(model: nn.Module):
    """Meanwhile the model's code may run for real: its buffers, plain tensor attributes and plain settings (an int
    it counts with) get their values back on exit, and Python's and NumPy's random streams their states."""
    tensors = {id(t): t for t in itertools.chain(model.buffers(), unregistered_tensors(model))
               if not t.is_meta and not isinstance(t, nn.Parameter)}  # a list-held module's buffers too
    saved = [(t, t._version, t.detach().clone()) for t in tensors.values()]
    plain = [(m.__dict__, k, v) for m in model.modules() for k, v in vars(m).items() if is_plain_setting(v)]
    draws = _python_random_states()
    try:
        yield
    finally:
        _set_python_random_states(draws)  # Python's and NumPy's random streams as the caller left them
        for own, k, v in plain:
            if own.get(k, plain) is not v:
                own[k] = v
        with torch.no_grad():
            for t, version, value in saved:  # a batch norm's kernel moves its statistics with no version bump
                if t._version != version or not torch.equal(t, value):
                    t.copy_(value)


_CHECK_BYTES = 16 << 20  # the largest activation of the check's rows
_CHECK_FLOPS = 3e9  # the matmul and convolution FLOPs of one of its runs (about one image through a small vision model)
_ALL_ROWS_FLOPS, _ALL_ROWS_BYTES = 3e8, 4 << 20  # under these, as many rows as fit (a branch may spare row 0)


def _computes_as_model(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """CaptureError where the traced graph, run on the example, gives other values than the model's own call (a
    branch on ``isinstance(x, torch.Tensor)`` or another fact of the trace rather than of the call).

    Both run in the caller's grad mode, from the same random state, on copies of the rows of the inputs' shared
    batch that fit under ``_ALL_ROWS_FLOPS`` and ``_ALL_ROWS_BYTES``, or of one row (two where the model refuses
    one, as a batch norm in training may). Nothing is checked on meta tensors,
    where the model's own call fails, or past ``_CHECK_BYTES`` or ``_CHECK_FLOPS``."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in itertools.chain(tensors, model.parameters(), model.buffers())):
        return
    rows = {t.shape[0] if t.dim() else 0 for t in tensors}
    rows = rows.pop() if len(rows) == 1 else 0
    infos = [n.meta.get(K.INFO) for n in gm.graph.nodes]
    largest = max((i.numel * i.dtype.itemsize for i in infos if isinstance(i, TensorInfo)), default=0)
    if largest * (1 / rows if rows > 1 else 1) > _CHECK_BYTES:
        return  # before counting FLOPs, which runs each matmul's shapes on meta
    flops = _flops(gm)
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):  # each run from the same random state; the caller's kept
        state = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        fit = min(_ALL_ROWS_FLOPS * rows / max(flops, 1), _ALL_ROWS_BYTES * rows / max(largest, 1)) if rows else 0
        fit = min(rows, int(fit))
        for take in ((fit,) if fit > 1 else (1, 2) if rows > 1 else (rows,)):
            share = take / rows if rows else 1
            if largest * share > _CHECK_BYTES or flops * share > _CHECK_FLOPS:
                return
            theirs = _run(model, args, kwargs, take, lambda a, k: model(*a, **k), state, devices)
            if theirs is not None:
                break
        else:
            return  # the model's call fails where its trace ran: not a judge
        ours = _run(model, args, kwargs, take, lambda a, k: fx.Interpreter(gm).run(*flatten_inputs(gm, a, k)),
                    state, devices, must=True)
    floating = [x.dtype.is_floating_point or y.dtype.is_floating_point for x, y in zip(ours, theirs)]
    if len(ours) != len(theirs) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(ours, theirs)) \
            or any(not (torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-5, equal_nan=True) if f
                        else torch.equal(x, y)) for x, y, f in zip(ours, theirs, floating)):
        raise CaptureError("its traced graph gives other values than its own call on the example (a branch on "
                           "isinstance(x, torch.Tensor) or on another fact of tracing rather than of the inputs)")


def _flops(gm: fx.GraphModule) -> int:
    """The matmul and convolution FLOPs of one run of ``gm`` on the example, left uncached (passes that change
    shapes count again)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            total += node_flops(gm, node)
            node.meta.pop(K.FLOPS, None)
    return total


def _run(model: nn.Module, args: tuple, kwargs: dict, take: int, run, state: tuple, devices: list,
         must: bool = False) -> list | None:
    """The tensors ``run`` returns on copies of the first ``take`` rows of the inputs (all where ``take`` is 0),
    from the random ``state``, the model's buffers and settings put back after; None where it raises, unless
    ``must``."""
    a, k = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: (t[:take] if take else t).detach().clone(), (args, kwargs))
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1]):
        torch.cuda.set_rng_state(s, d)
    with tensors_kept(model), _WritesUndone(model.parameters()):
        try:
            out = run(a, k)
        except Exception:  # noqa: BLE001 - told to the caller
            if must:
                raise
            return None
    return [t.detach() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


# random ops: symbolic tracing runs one with no traced argument for real, fixing its draw as a graph constant
_RANDOM = frozenset(getattr(torch.ops.aten, n) for n in (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "multinomial", "native_dropout", "poisson") if hasattr(torch.ops.aten, n))


_TO_PYTHON = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.equal}


class _WritesUndone(TorchDispatchMode):
    """Meanwhile each of ``tensors`` an op writes in place (``self.w.data.mul_(0.5)`` in a forward, which no version
    counter of the parameter sees, or a write through a view) is saved before its first write, and put back on exit:
    a run for real leaves the model's tensors as they were, at the cost of a copy of those it writes only."""

    def __init__(self, tensors):
        super().__init__()
        tensors = list(tensors)
        self.own = {id(t): t for t in tensors}
        self.by_storage: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            if _storage(t):
                self.by_storage.setdefault(_storage(t), []).append(t)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def written(self, func, args, kwargs) -> list[torch.Tensor]:
        """The tensors of the mode's that ``func`` writes (each saved on its first write)."""
        if not func._schema.is_mutable:
            return []
        out = []
        for arg, value in zip(func._schema.arguments, itertools.chain(args, kwargs.values())):
            if arg.alias_info is None or not arg.alias_info.is_write or not isinstance(value, torch.Tensor):
                continue
            owners = [self.own[id(value)]] if id(value) in self.own else self.by_storage.get(_storage(value), [])
            for t in owners:
                if id(t) not in self.saved:
                    self.saved[id(t)] = (t, t.detach().clone())
            out.extend(owners)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.written(func, args, kwargs)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        with torch.no_grad():
            for t, value in self.saved.values():
                t.copy_(value)
        return out


def _storage(t: torch.Tensor) -> int:
    """The address of a real strided tensor's memory; 0 for any other."""
    if t.is_meta or t.layout != torch.strided or type(t) not in (torch.Tensor, nn.Parameter):
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


class _RealOps(_WritesUndone):
    """Notes (``why``) ops that symbolic tracing would run once and bake into the graph: a random draw from no
    traced input (``h + torch.randn(8)``) and an in-place update of the model's own tensors (a step counter); either
    sends the capture to torch.export. Updated tensors get their values back on exit."""

    def __init__(self, model: nn.Module):
        super().__init__(itertools.chain(model.parameters(), model.buffers()))
        self.why: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket in _RANDOM and self.why is None:
            self.why = (f"its code draws random numbers ({func._overloadpacket.__name__}) from no input, which "
                        "symbolic tracing would fix as one draw")
        if func._overloadpacket in _TO_PYTHON and self.why is None and args and self._owns(args[0]):
            self.why = ("its code reads the value of a tensor of its own into Python (.item(), float(), bool()), "
                        "which symbolic tracing would fix as a constant, stale once the tensor changes")
        if self.written(func, args, kwargs) and self.why is None:
            self.why = (f"its code updates a tensor of its own in place ({func._overloadpacket.__name__}), "
                        "which symbolic tracing would do once, while tracing")
        return func(*args, **kwargs)

    def _owns(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.own or _storage(t) in self.by_storage)


_VIEWS = frozenset({"view", "view_as", "narrow", "select", "t", "transpose", "permute", "squeeze", "unsqueeze",
                    "expand", "flatten", "unflatten", "reshape", "__getitem__", "getitem", "detach", "data"})


def _buffers_written(graph: fx.Graph, buffers: set[str]) -> list[str]:
    """The buffers a traced graph writes in place (``self.count.add_(1)``, ``self.avg.mul_(0.9).add_(...)``,
    ``self.table[0] = x``), through views of them."""
    def name(n: fx.Node) -> str:
        t = n.target
        return t if isinstance(t, str) else getattr(t, "__name__", "")

    def base(n: Any) -> str | None:
        while isinstance(n, fx.Node) and n.op in ("call_method", "call_function") and n.args and \
                (name(n) in _VIEWS or _in_place(name(n))):
            n = n.args[0]
        return n.target if isinstance(n, fx.Node) and n.op == "get_attr" and n.target in buffers else None

    out = []
    for n in graph.nodes:
        if n.op in ("call_method", "call_function") and n.args and (_in_place(name(n)) or name(n) == "setitem"):
            b = base(n.args[0])
            if b is not None and b not in out:
                out.append(b)
    return out


def _in_place(op: str) -> bool:
    return op.endswith("_") and not op.startswith("_") and not op.endswith("__")


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
