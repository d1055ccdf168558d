"""Propagation: the dtype, shape and device of every graph value (``TensorInfo`` in ``node.meta``), found on fake
tensors, or on the real example values where a fake run cannot work. Like torch.fx's ``passes/shape_prop.py``, with
the model's tensors virtualized and module calls memoized by structure (a repeated block runs once).
"""
from __future__ import annotations
import collections
import contextvars
import itertools
import logging
from typing import Any
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402
from ..base.errors import one_line, CaptureError
from ..base import keys as K
from ..base.meta import fetch, is_converted, tensor_info, TensorInfo
from ..base.quiet import quiet_torch_logs


class _Recorder(fx.Interpreter):
    """Runs the graph for real, storing a TensorInfo on every node."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta[K.INFO] = tensor_info(out)
        return out


_log = logging.getLogger("autocastfx.propagate")


# Propagations on fake tensors ("fake"), on real values ("real"), and real runs after a failed fake one ("fallback").
propagate_counts: collections.Counter = collections.Counter()


def propagate(gm: fx.GraphModule, args: tuple, kwargs: dict, *, mode: str = "fake",
              meta_device: torch.device | None = None) -> Any:
    """Store a ``TensorInfo`` (or a tuple of them) for every value in ``node.meta[K.INFO]``; return the output's.

    ``mode="fake"`` never touches the model's parameters, buffers or RNG state; where it fails (a value-dependent
    shape such as ``nonzero``, an op without a fake kernel) the graph runs once for real, as ``mode="real"`` always
    does, and ``gm.meta[K.PROPAGATED]`` says which. ``meta_device``: the device the graph's meta tensors stand for;
    a graph whose shapes need values is then refused."""
    if mode not in ("fake", "real"):
        raise ValueError(f"propagate mode must be 'fake' or 'real', got {mode!r}")
    token = _META_DEVICE.set(meta_device)  # read deep in the fake run (_meta): set for this call only
    try:
        return _propagate(gm, args, kwargs, mode)
    finally:
        _META_DEVICE.reset(token)


def _propagate(gm: fx.GraphModule, args: tuple, kwargs: dict, mode: str) -> Any:
    flat_args = flatten_inputs(gm, args, kwargs)
    check_example_values(flat_args, _META_DEVICE.get())
    if mode == "fake":
        try:
            out = _FakeRun(gm).run(flat_args)
        except Exception as e:  # noqa: BLE001 - whatever the fake run cannot do, the real run decides
            reason = one_line(e)
            propagate_counts["fallback"] += 1
            _log.info("fake propagation of %s failed (%s); running it on the example values",
                      type(gm).__name__, reason)
        else:
            propagate_counts["fake"] += 1
            gm.meta[K.PROPAGATED] = "fake"
            return out
    if _META_DEVICE.get() is not None:
        raise CaptureError(f"{type(gm).__name__} cannot be converted on the meta device: its shapes are not known "
                           f"without values ({reason}); materialise it (model.to_empty(device=...) and load its "
                           "weights) and convert that")
    out = _propagate_real(gm, flat_args)
    propagate_counts["real"] += 1
    gm.meta[K.PROPAGATED] = "real" if mode == "real" else f"real (fake run failed: {reason})"
    return out


def _propagate_real(gm: fx.GraphModule, flat_args: list) -> Any:
    """Run the graph once on the example values, without gradients; buffers and RNG state are restored after."""
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
    return out.meta.get(K.INFO)


def check_example_values(flat_args: list, meta_device: torch.device | None) -> None:
    if meta_device is not None:
        return
    for i, a in enumerate(torch.utils._pytree.tree_leaves(flat_args)):
        if isinstance(a, torch.Tensor) and a.is_meta:
            raise ValueError(f"example input {i} is on the meta device and has no values: pass a real tensor of "
                             f"the same shape and dtype (e.g. torch.zeros({tuple(a.shape)}, dtype={a.dtype}))")


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
        device = _META_DEVICE.get() or device
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, device, t.requires_grad)


# The device meta tensors stand for (propagate()'s meta_device); set for one propagate() call only.
_META_DEVICE: contextvars.ContextVar = contextvars.ContextVar("autocastfx_propagate_device", default=None)


class _FakeRun:
    """One propagation of ``gm`` on fake tensors, results memoized by the metadata of their inputs."""

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
        with torch.no_grad(), quiet_torch_logs():  # fake tensors log a traceback per op that raises
            for node in self.gm.graph.nodes:
                op = node.op
                if op == "placeholder":  # as fx.Interpreter: ``*args`` takes every input left
                    value = (_virtualize(list(inputs)) if str(node.target).startswith("*")
                             else _virtualize(next(inputs)))
                elif op == "get_attr":
                    value = _virtualize(fetch(self.gm, node.target))
                elif op == "output":
                    value = _load(node.args[0], env)
                else:
                    value = self.call(node, _load(node.args, env), _load(node.kwargs, env))
                env[node] = value
                node.meta[K.INFO] = self.info(value)
        return _output_info(self.gm)

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
            family = getattr(m, "meta", {}).get(K.BLOCK, {}).get("family") if is_converted(m) else None
            # converted blocks copied from one plan compute the same metadata from the same inputs
            self.module_keys[target] = ("autocastfx block", family, m.training) if family else _module_key(m)
        return self.module_keys[target]

    def fake_mode(self):
        if self.mode is None:
            # a real tensor reaching an op is an error, and so is an op without a fake kernel (by default
            # FakeTensorMode would run it for real on zeros): either sends the graph to the real run
            self.mode = FakeTensorMode(allow_fallback_kernels=False)
        return self.mode

    def fake_of(self, v: Any) -> torch.Tensor:
        """The fake tensor for a value, made from metadata alone, once per _Virtual or real tensor (tied
        parameters stay one)."""
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
    if isinstance(a, tuple) and hasattr(a, "_fields"):
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
    """What a memo keeps of a result: tensors as metadata, constants as they are; None for anything else
    (a mutable object, a fake tensor that knows its values)."""
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
    """Whether a call_function target's result metadata depends only on its arguments' metadata (torch ops,
    Python operators and getattr, not in place)."""
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


def placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[tuple[fx.Node, Any]]:
    """(placeholder, the example value it takes) for each of ``gm``'s inputs; empty where they cannot be paired."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        values = flatten_inputs(gm, args, kwargs)
    except TypeError:
        return []
    return list(zip(places, values)) if len(values) == len(places) else []


def flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
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
