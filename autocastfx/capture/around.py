"""The model around its converted blocks as one graph, each block a ``call_module``, captured by torch.export for
models ``symbolic_trace`` cannot follow. Blocks keep their call signatures through the export and unflatten, and
:func:`graph_around` inlines the rest; meanwhile each block stands in as :class:`_Float32Results`, so the root's plan
decides where the blocks' low results are cast.
"""
from __future__ import annotations

import contextlib
import operator
import re
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from ..base.errors import one_line
from ..base.meta import FIRST, ReadsThrough, fetch
from ..base.quiet import torch_internal_warnings_off

_CALL_INDEX = re.compile(r"@\d+$")


class AroundError(RuntimeError):
    """torch.export cannot keep the blocks as calls (the reason is the message)."""


class _Float32Results(ReadsThrough):
    """A converted block as torch.export sees it, giving float32 results of the right structure and shapes: copies
    of its first input where its result template allows (a decoder layer), else the float32 block it came from, else
    the converted block's results cast up."""

    def __init__(self, unit: nn.Module, sources: Mapping[int, tuple]):
        super().__init__()
        source, self.template = sources.get(id(unit), (None, None))
        self.first = FIRST
        self.mode_of = [unit] if source is not None else None  # whose mode the model's block runs in (a list: no
        # submodule of this one, so the export lifts none of its tensors)
        self.block = source if source is not None else unit

    def forward(self, *args, **kwargs):
        if self.template is not None:
            # every tensor argument is read (nothing: a scalar times zero), or torch.export would pass None for
            # the ones not read, and the converted block does read them
            x = args[0].float().clone()
            for t in pytree.tree_leaves((args[1:], kwargs)):
                if isinstance(t, torch.Tensor):
                    x = x + (t.sum() * 0).to(x.dtype)
            return pytree.tree_map(lambda v: x if v is self.first else v, self.template)
        if self.mode_of is not None:  # the model's own block: in the converted block's mode for the call only
            modes = [(m, m.training) for m in self.block.modules()]
            for m, _ in modes:
                m.training = self.mode_of[0].training
            try:
                out = self.block(*args, **kwargs)
            finally:
                for m, t in modes:
                    m.training = t
        else:
            out = self.block(*args, **kwargs)
        return pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)
            else t, out)


def export_around(model: nn.Module, args: tuple, kwargs: dict, units: dict[str, nn.Module], export,
                  sources: Mapping[int, tuple]) -> fx.GraphModule:
    """``model`` (holding the converted blocks ``units`` by qualified name) as one graph module that calls each block,
    the model left as it was; AroundError where that cannot be done.

    Args:
        export: the caller's torch.export, called as ``export(model, args, kwargs, preserve)``.
        sources: what stands in for each block meanwhile (``CaptureContext.sources``).
    """
    parents = {}
    for name, unit in units.items():
        parent, _, key = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        parents[name] = (owner, key, unit)
        owner._modules[key] = _Float32Results(unit, sources)
    try:
        try:
            ep = export(model, args, kwargs, tuple(units))
        except Exception as e:  # noqa: BLE001 - the caller falls back to a flat capture, saying why
            raise AroundError(f"torch.export cannot keep the blocks' signatures ({one_line(e)})") from e
    finally:
        for owner, key, unit in parents.values():
            owner._modules[key] = unit
    mutated = [b for b in list(ep.graph_signature.buffers_to_mutate.values())
               if not any(b == n or b.startswith(n + ".") for n in units)]
    if mutated or ep.graph_signature.user_inputs_to_mutate:
        raise AroundError("the model's code around its blocks writes to buffers or inputs "
                          f"({', '.join((mutated + list(ep.graph_signature.user_inputs_to_mutate.values()))[:3])})")
    try:
        with torch_internal_warnings_off(), _meta_state(ep) as originals:
            flat = torch.export.unflatten(ep)
    except Exception as e:  # noqa: BLE001
        raise AroundError(f"torch.export.unflatten failed ({one_line(e)})") from e
    _share_model_tensors(flat, originals)
    try:
        return graph_around(flat, units, ep)
    finally:
        _release(ep)


@contextlib.contextmanager
def _meta_state(ep):
    """Make the program's parameters, buffers and constants meta tensors meanwhile, as ``torch.export.unflatten``
    clones every one it reads; yields name -> the real tensor, which :func:`_share_model_tensors` puts back."""
    state, constants = ep.state_dict, ep.constants
    memo: dict[int, Any] = {}

    def shell(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.is_meta:
            return t
        if id(t) not in memo:
            m = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return memo[id(t)]

    ep._state_dict = {k: shell(v) for k, v in state.items()}
    ep._constants = {k: shell(v) for k, v in constants.items()}
    try:
        yield {**constants, **state}
    finally:
        ep._state_dict, ep._constants = state, constants


def _share_model_tensors(flat: nn.Module, sources: dict) -> None:
    """The unflattened module holding the model's own tensors (see :func:`_meta_state`)."""
    for name, original in sources.items():
        if not isinstance(original, torch.Tensor):
            continue
        owner, _, field = name.rpartition(".")
        try:
            mod = flat.get_submodule(owner) if owner else flat
        except AttributeError:
            continue
        for table in (mod._parameters, mod._buffers):
            held = table.get(field)
            if held is not None and held is not original and held.shape == original.shape \
                    and held.dtype == original.dtype:
                table[field] = original
        held = mod.__dict__.get(field)
        if isinstance(held, torch.Tensor) and held is not original and held.shape == original.shape:
            mod.__dict__[field] = original
    if any(isinstance(o, torch.Tensor) and o.is_meta for o in sources.values()):
        return  # a model on the meta device: its tensors are meta tensors anyway
    left = [n for n, t in [*flat.named_parameters(remove_duplicate=False), *flat.named_buffers(remove_duplicate=False)]
            if t.is_meta]
    if left:
        raise AroundError(f"torch.export.unflatten put tensors at names the program does not have ({left[:3]})")


def _release(ep) -> None:
    """Drop the unflattened module from the program's ``graph_module.meta``: torch keeps the last export's graph
    alive (``proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``), which would keep the model's float32 weights
    past ``convert()``."""
    meta = getattr(getattr(ep, "graph_module", None), "meta", None)
    if isinstance(meta, dict):
        meta.pop("unflattened_module", None)


def graph_around(flat: nn.Module, units: dict[str, nn.Module], ep) -> fx.GraphModule:
    """One graph module from the unflattened ``flat``: its nested modules inlined, the preserved blocks called
    as the converted ``units``, its inputs and outputs those of the exported program (pytree code)."""
    b = _Inliner(flat, units, {e.fqn: e.signature.in_spec.child(0).num_children
                               for e in ep.module_call_graph if e.fqn in units and e.signature is not None})
    out = b.run()
    graph = b.graph
    graph.output(out)
    from torch.export._unlift import _get_codegen
    call = ep.module_call_graph[0].signature
    graph._codegen = _get_codegen(ep.call_spec.in_spec, ep.call_spec.out_spec,
                                  call.forward_arg_names if call is not None else None)
    sig = ep.graph_signature
    loose = set(sig.non_persistent_buffers)
    root = nn.Module()
    for target, value in b.attrs.items():
        _assign(root, target, value, persistent=target not in loose)
    gm = fx.GraphModule(root, graph, type(flat).__name__)
    for name in loose:  # fx's copy registers every buffer persistent
        parent, _, field = name.rpartition(".")
        owner = fetch(gm, parent, None) if parent else gm
        if isinstance(owner, nn.Module) and field in owner._buffers:
            owner._non_persistent_buffers_set.add(field)
    # every parameter and buffer of the model around the blocks under each of its names, read or not (a tied
    # head's weight under the head's name too: the model's state dict has both)
    held = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    for name, t in [*flat.named_parameters(remove_duplicate=False), *flat.named_buffers(remove_duplicate=False)]:
        name = ".".join(_CALL_INDEX.sub("", a) for a in name.split("."))
        if name not in held and not any(name.startswith(u + ".") for u in units):
            _assign(gm, name, t, persistent=name not in loose)
            held[name] = t
    for name, t in b.attrs.items():  # lifted constants stay constants (no state-dict entries)
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and name not in sig.buffers:
            parent, _, field = name.rpartition(".")
            owner = gm.get_submodule(parent) if parent else gm
            if field in owner._buffers:
                del owner._buffers[field]
                owner._non_persistent_buffers_set.discard(field)
                setattr(owner, field, t)
    inside = sorted(t for t in b.attrs if t not in units and any(t.startswith(u + ".") for u in units))
    if inside:  # the model's code reads a block's weights outside the block's call: no block of its own
        raise AroundError(f"the model's code uses {inside[0]} outside the call of its block")
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    missing = set(units) - called
    if missing:
        raise AroundError(f"the blocks {sorted(missing)[:3]} are not called in the exported graph")
    return gm


def _assign(root: nn.Module, target: str, value: Any, persistent: bool = True) -> None:
    *path, field = target.split(".")
    mod = root
    for atom in path:
        nxt = mod._modules.get(atom)
        if nxt is None:
            nxt = nn.Module()
            mod._modules[atom] = nxt
        mod = nxt
    if isinstance(value, nn.Parameter):
        mod.register_parameter(field, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(field, value, persistent=persistent)
    elif isinstance(value, nn.Module):
        mod._modules[field] = value
    else:
        setattr(mod, field, value)


class _Inliner:
    """Writes one graph from an unflattened module: see :func:`graph_around`."""

    def __init__(self, flat: nn.Module, units: dict[str, nn.Module], positional: dict[str, int]):
        self.flat, self.units, self.positional = flat, units, positional
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}      # qualified name in the result -> parameter, buffer, constant, block
        self.get_attrs: dict[str, fx.Node] = {}
        self.by_id: dict[int, str] = {}      # id(tensor) -> its first qualified name (tied weights stay tied)

    def run(self) -> Any:
        inputs = []
        for node in self.flat.graph.nodes:
            if node.op == "placeholder":
                p = self.graph.placeholder(node.name)
                p.meta = dict(node.meta)
                inputs.append(p)
        return self.inline(self.flat, "", inputs, {})

    def inline(self, mod: nn.Module, prefix: str, args: list, kwargs: dict) -> Any:
        env: dict[fx.Node, Any] = {}
        positional = iter(args)
        for node in mod.graph.nodes:
            if node.op == "placeholder":
                if node.target in kwargs:
                    env[node] = kwargs[node.target]
                else:
                    try:
                        env[node] = next(positional)
                    except StopIteration:
                        env[node] = node.args[0] if node.args else None
            elif node.op == "get_attr":
                env[node] = self.get_attr(mod, prefix, str(node.target))
            elif node.op == "output":
                return self.load(node.args[0], env)
            elif node.op == "call_module":
                env[node] = self.call_module(mod, prefix, node, env)
            elif node.op == "call_function" and node.target is pytree.tree_unflatten:
                leaves, spec = self.load(node.args, env)
                env[node] = pytree.tree_unflatten(list(leaves), spec)
            elif node.op == "call_function" and node.target is fx_pytree.tree_flatten_spec:
                value, spec = self.load(node.args, env)
                env[node] = self.flatten(value, spec)
            elif node.op == "call_function" and node.target is operator.getitem \
                    and not isinstance(self.load(node.args[0], env), fx.Node):
                container, key = self.load(node.args, env)
                env[node] = container[key]
            else:
                new = self.graph.node_copy(node, lambda n: env[n])
                env[node] = new
        raise AssertionError("a graph without output")

    def load(self, a: Any, env: dict) -> Any:
        return fx.node.map_aggregate(a, lambda x: env[x] if isinstance(x, fx.Node) else x)

    def get_attr(self, mod: nn.Module, prefix: str, target: str) -> Any:
        obj = mod
        for atom in target.split("."):
            obj = getattr(obj, atom)
        if not isinstance(obj, (torch.Tensor, nn.Module)):  # a pytree spec: evaluated here, never a node
            return obj  # (a module is a higher-order op's body, ``wrap_with_set_grad_enabled``'s: a node)
        name = self.by_id.get(id(obj))
        if name is None:
            name = _CALL_INDEX.sub("", ".".join(_CALL_INDEX.sub("", a) for a in f"{prefix}.{target}".strip(".").split(".")))
            base, i = name, 0
            while name in self.attrs and self.attrs[name] is not obj:
                i += 1
                name = f"{base}_{i}"
            self.by_id[id(obj)] = name
            self.attrs[name] = obj
        node = self.get_attrs.get(name)
        if node is None:  # made where it is first read: it comes before every later reader
            node = self.get_attrs[name] = self.graph.get_attr(name)
        return node

    def call_module(self, mod: nn.Module, prefix: str, node: fx.Node, env: dict) -> Any:
        target = str(node.target)
        full = ".".join(_CALL_INDEX.sub("", a) for a in f"{prefix}.{target}".strip(".").split("."))
        args, kwargs = self.load((node.args, node.kwargs), env)
        if full in self.units:
            # unflatten puts the model's inputs a block's code reads beyond its arguments (the sizes of a
            # dynamic export are read off the inputs) in front of its arguments: the converted block reads none
            n = self.positional.get(full)
            if n is None:
                raise AroundError(f"torch.export kept no call signature for the block {full!r}")
            args = tuple(args)[len(args) - n:]
            self.attrs[full] = self.units[full]
            new = self.graph.call_module(full, tuple(args), dict(kwargs))
            new.meta = dict(node.meta)
            return new
        sub = mod.get_submodule(target)
        if not hasattr(sub, "graph"):
            raise AroundError(f"torch.export.unflatten made {full!r} a {type(sub).__name__}, not a graph")
        return self.inline(sub, full, list(args), dict(kwargs))

    def flatten(self, value: Any, spec: pytree.TreeSpec) -> list:
        """A block's result, flattened as ``spec`` says: ``getitem`` nodes where it is a node."""
        if not isinstance(value, fx.Node):
            return fx_pytree.tree_flatten_spec(value, spec)
        if spec.is_leaf():
            return [value]
        if spec.type in (tuple, list):
            out = []
            for i in range(spec.num_children):
                item = self.graph.call_function(operator.getitem, (value, i))
                out += self.flatten(item, spec.child(i))
            return out
        if spec.type is dict:
            out = []
            for i, key in enumerate(spec.context):
                item = self.graph.call_function(operator.getitem, (value, key))
                out += self.flatten(item, spec.child(i))
            return out
        raise AroundError(f"a block returns a {spec.type.__name__}: only tensors, tuples, lists and dicts "
                          "can be taken apart around a block")
