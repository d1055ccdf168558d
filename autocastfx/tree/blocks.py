"""A model converted block by block: each block (by default a repeated child of an ``nn.ModuleList``) converted as a
module of its own, during one run of the model, with the inputs it gets there, then the model around them with each
block a ``call_module`` node, or piecewise where that does not trace (docs/blocks.md).
"""
from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from ..base.errors import one_line, CaptureError
from ..base.meta import FIRST, HOOK_TABLES, is_converted, original_class, ReadsThrough, TensorInfo
from ..base import keys as K
from ..capture.trace import copy_model, ModelTracer
from .piecewise import piecewise_units
from ..core.propagate import placeholder_values
from ..base.quiet import torch_internal_warnings_off
from ..converted.module import add_model_surface
from ..converted.state import hooked_paths, rebind, warn_model_hooks
from ..core.modes import EVAL, TRAIN
from .parts import (BLOCK_META, Conversions, data_dependent, describe_units, float_dtypes, has_gemm, is_inside,
                     keep_containers, no_autocast, put_module, quiet_run, RootError, set_modes, to_float32,
                     why_not_captured)
from ..base.options import ConvertOptions
from ..capture.context import CaptureContext, free_sizes


AUTO = "auto"


# --------------------------------------------------------------------------------------------- choice

def choose(model: nn.Module, blocks: Any, policy) -> list[str]:
    """The qualified names of the blocks to convert on their own, in the model's order (outermost only)."""
    if blocks is None or blocks is False:
        return []
    named = dict(model.named_modules())
    if blocks == AUTO or blocks is True:
        names: list[str] = []
        for name, m in model.named_modules():
            if not isinstance(m, nn.ModuleList) or is_inside(name, set(names)):
                continue
            kinds = collections.Counter(type(c) for c in m.children())
            for key, c in m.named_children():
                if kinds[type(c)] >= 2 and not isinstance(c, (nn.ModuleList, nn.ModuleDict)) \
                        and not policy.is_leaf(c) and has_gemm(c):  # a list of lists: the inner lists' blocks
                    names.append(f"{name}.{key}" if name else key)
        return names
    if callable(blocks):
        picked = [n for n, m in model.named_modules() if n and blocks(n, m)]
    elif isinstance(blocks, (list, tuple)) and all(isinstance(b, str) for b in blocks):
        picked = list(blocks)
        missing = [b for b in picked if b not in named or not b]
        if missing:
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
            raise ValueError(f"blocks={missing} are not submodules of {type(model).__name__}; blocks takes qualified "
                             f"names such as 'layers.0' (its ModuleLists: {lists[:8]}), a function (name, module) "
                             "-> bool, 'auto' or None")
    else:
        raise TypeError("blocks must be 'auto', None (one graph for the whole model), a list of submodule names "
                        f"or a function (name, module) -> bool; got {blocks!r}")
    containers = [n for n in picked if isinstance(named.get(n), (nn.ModuleList, nn.ModuleDict))]
    if containers:
        kind = type(named[containers[0]]).__name__
        first = next(iter(named[containers[0]]._modules), "0")
        raise ValueError(f"blocks={containers} names a {kind}, which holds blocks but is never called itself: name the "
                         f"blocks ('{containers[0]}.{first}', ...), pass a function (name, module) -> bool, or "
                         "blocks='auto', which takes the repeated children of every ModuleList")
    order = {n: i for i, n in enumerate(named)}
    out: list[str] = []
    for n in sorted(set(picked), key=order.__getitem__):
        if not is_inside(n, out):
            out.append(n)
    return out


# ------------------------------------------------------------------------------------------ conversion


class _Stand(ReadsThrough):
    """Where a block was, during the one run: converts it on its first call, with that call's inputs."""

    def __init__(self, name: str, block: nn.Module, make: Callable):
        super().__init__()
        self.name, self.block, self.make = name, block, make
        self.unit: nn.Module | None = None
        self.calls = 0
        self.template: Any = None
        self.changes_inputs = False  # whether its call changed a list, dict or set it was given

    def forward(self, *args, **kwargs):
        self.calls += 1
        if any(isinstance(t, torch.Tensor) and t.is_nested for t in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise RootError(f"{self.name} is given a nested tensor in the run that finds the blocks' inputs (eval, no "
                            "gradients: nn.TransformerEncoder's fast path with a padding mask), which no block "
                            "converts for; convert it as one graph (blocks=None)")
        if self.unit is None:
            if _has_fake((args, kwargs)):  # the one run of a model on the meta device: converted from shapes
                with unset_fake_temporarily():
                    self.unit = self.make(self.name, self.block, *_as_meta((args, kwargs)))
            else:
                self.unit = self.make(self.name, self.block, args, kwargs)
        elif self.calls > 1:
            raise _CalledTwice(self.name)
        if not is_converted(self.unit):  # not converted: it runs as the code around the blocks does
            return self.unit(*args, **kwargs)
        with no_autocast(args):
            out, changed = _as_unit_gives(self.unit, self.block, args, kwargs)
        self.changes_inputs = self.changes_inputs or changed
        self.template = _residual_template(self.unit, args, out)
        return out


def _container_pairs(real: Any, up: Any) -> list[tuple]:
    """(container, its float32 copy, the copy's items by identity -> the container's) for each list, dict and set
    of ``real`` and the same place in ``up`` (``to_float32(real)``)."""
    out: list[tuple] = []

    def walk(r, u):
        if isinstance(r, dict) and isinstance(u, dict):
            out.append((r, u, {id(u[k]): r[k] for k in r if k in u}, list(map(id, u)) + list(map(id, u.values()))))
            for k in r:
                if k in u:
                    walk(r[k], u[k])
        elif isinstance(r, (list, tuple)) and isinstance(u, (list, tuple)) and len(r) == len(u):
            if isinstance(r, list):
                out.append((r, u, {id(b): a for a, b in zip(r, u)}, list(map(id, u))))
            for a, b in zip(r, u):
                walk(a, b)
    walk(real, up)
    return out


def _mirrored(pairs: list[tuple]) -> bool:
    """Give each container of :func:`_container_pairs` what the block changed in its copy; whether any changed."""
    changed = False
    for real, up, back, before in pairs:
        now = list(map(id, up)) + (list(map(id, up.values())) if isinstance(up, dict) else [])
        if now == before:
            continue
        changed = True
        if isinstance(real, dict):  # (``up`` may be ``real`` itself: its new content first)
            content = {k: back.get(id(v), v) for k, v in up.items()}
            real.clear()
            real.update(content)
        else:
            real[:] = [back.get(id(v), v) for v in up]
    return changed


def _residual_template(unit: nn.Module, args: tuple, out: Any) -> Any:
    """The block's result structure with each tensor marked ``FIRST``, where every tensor has its first input's
    (symbolic) shape, else None; with it torch.export need not trace the block to export the model around it
    (``capture.around._Float32Results``)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    if not args[0].is_floating_point() or not any(isinstance(t, torch.Tensor) for t in leaves) or any(
            isinstance(t, torch.Tensor) and (t.shape != args[0].shape or not t.is_floating_point()) for t in leaves):
        return None
    places = [n for n in unit.graph.nodes if n.op == "placeholder"]
    first = places[0].meta.get("val") if places else None
    out_node = next(n for n in reversed(unit.graph.nodes) if n.op == "output")
    if not isinstance(first, torch.Tensor):
        return None
    for a in torch.utils._pytree.tree_leaves(out_node.args[0]):
        if not isinstance(a, fx.Node):
            continue
        while "val" not in a.meta and a.args and isinstance(a.args[0], fx.Node):  # a cast the plan put there
            a = a.args[0]
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(map(str, val.shape)) != tuple(map(str, first.shape)):
            return None
    return torch.utils._pytree.tree_unflatten(
        [FIRST if isinstance(t, torch.Tensor) else t for t in leaves], spec)


@contextlib.contextmanager
def _buffers_kept(block: nn.Module):
    """Put ``block``'s buffers back, the same tensors with the same values, after a run that may update them."""
    kept = [(m, name, t, t.clone()) for m in block.modules() for name, t in m._buffers.items() if t is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, t, value in kept:
                m._buffers[name] = t
                t.copy_(value)


def _as_unit_gives(unit: nn.Module, block: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """What the converted block gives, for the rest of the one run: the model's block run in float32 (emulated low
    kernels are slow, and only dtypes and shapes matter here) cast to the unit's output dtypes, else the unit's own
    result where the two do not match up; and whether the block changed a list, dict or set it was given."""
    graph = unit.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    want = [getattr(a.meta.get(K.INFO), "dtype", None) if isinstance(a, fx.Node) else None
            for a in torch.utils._pytree.tree_leaves(out_node.args[0])]
    given = _container_pairs((args, kwargs), (args, kwargs))  # for a unit run on the call's own values
    up = to_float32((args, kwargs))
    pairs = _container_pairs((args, kwargs), up)
    try:
        with _buffers_kept(block):  # the block runs in the model's modes
            out = block(*up[0], **up[1])
    except Exception:  # noqa: BLE001 - the converted block then
        out = unit(*args, **kwargs)
        return out, _mirrored(given)
    changed = _mirrored(pairs)
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    if len(leaves) != len(want):
        return unit(*args, **kwargs), changed
    leaves = [t.to(d) if isinstance(t, torch.Tensor) and t.is_floating_point() and d is not None else t
              for t, d in zip(leaves, want)]
    return torch.utils._pytree.tree_unflatten(leaves, spec), changed


class _CalledTwice(Exception):
    pass


@contextlib.contextmanager
def _fake_on(device: torch.device | None):
    """For the one run of a model on the meta device: a FakeTensorMode that makes meta tensors fake tensors of
    ``device``, so the model's code runs as there without values; nothing where ``device`` is None."""
    if device is None:
        yield
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    convert = mode.fake_tensor_converter
    real = convert.from_real_tensor
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def from_real(fake_mode, t, *args, **kwargs):
        if not t.is_meta:
            return real(fake_mode, t, *args, **kwargs)
        hit = made.get(id(t))
        if hit is None or hit[0] is not t:
            with unset_fake_temporarily():
                fake = convert.from_meta_and_device(fake_mode, t, device)
            hit = made[id(t)] = (t, fake)
        return hit[1]

    convert.from_real_tensor = from_real
    with mode:
        yield


def _has_fake(tree: Any) -> bool:
    return any(isinstance(t, FakeTensor) for t in torch.utils._pytree.tree_leaves(tree))


def _as_meta(tree: Any) -> Any:
    """Fake tensors as plain meta tensors of their shapes, strides and dtypes (a block converted from them)."""
    def meta(t):
        if not isinstance(t, FakeTensor):
            return t
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
    return torch.utils._pytree.tree_map_only(torch.Tensor, meta, tree)


def convert_tree(model: nn.Module, names: list[str], args: tuple, kwargs: dict, conv: Conversions,
                 options: ConvertOptions, ctx: CaptureContext, explicit: bool) -> nn.Module:
    """Convert ``model`` with the blocks ``names`` as modules of their own, the model around them by ``conv.whole``.
    Where the model around does not convert, ``blocks="auto"`` (``explicit=False``) tries one graph before going
    piecewise; named blocks go piecewise."""
    traced = _traces_around(model, names, options.policy)
    try:
        return _tree(model, names, args, kwargs, conv, options, ctx, piecewise=False)
    except RootError as e:
        why = why_not_captured(e.__cause__) if isinstance(e.__cause__, CaptureError) else \
            f"{traced}; {e}" if traced is not None else str(e)
        if traced is not None and data_dependent(e):  # its Python branches on values: as one graph neither
            return _tree(model, names, args, kwargs, conv, options, ctx, piecewise=True, why=why)
    if not explicit:
        try:
            return conv.whole(model, args, kwargs, options, ctx)
        except CaptureError as e:
            why = why_not_captured(e)
    return _tree(model, names, args, kwargs, conv, options, ctx, piecewise=True, why=why)


def _tree(model, names, args, kwargs, conv, options, ctx, *, piecewise: bool, why: str | None = None) -> nn.Module:
    """Convert the blocks ``names`` in one run of the model (each on its first call), then the model around them:
    as one graph (:func:`_root`), or ``piecewise`` as the model's own Python."""
    modes = {id(m): m.training for m in model.modules()}
    tree, keep = _tree_copy(model, names)
    make = _Maker(model, conv, options, ctx, args, kwargs, piecewise=piecewise, modes=modes)
    stands = {}
    for name in names:
        stands[name] = _Stand(name, tree.get_submodule(name), make)
        put_module(tree, name, stands[name])
    hooks = _hooks_of(keep.values())
    before = {name: set(st.block._forward_hooks) for name, st in stands.items()}
    hooked = {name: hooked_paths(st.block, name) for name, st in stands.items()}  # the model's, before the run
    try:
        with quiet_run(tree, None if piecewise else options.dtype, (args, kwargs)), _fake_on(ctx.meta_device):
            ran = torch.utils._pytree.tree_structure(tree(*args, **kwargs))
    except _CalledTwice as e:  # a block called twice (weights shared between calls) is no block: again without
        rest = [n for n in names if n != str(e)]
        if not rest:
            return conv.whole(model, args, kwargs, options, ctx)
        return _tree(model, rest, args, kwargs, conv, options, ctx, piecewise=piecewise, why=why)
    finally:
        added = {name: {k: h for k, h in st.block._forward_hooks.items() if k not in before[name]}
                 for name, st in stands.items()}
        _put_back(tree, stands, keep)
        set_modes(tree, model, modes)
        _restore_hooks(hooks)  # the model's own blocks: hooks its code registered as it ran go (HF's output capture)
    units = {n: st.unit for n, st in stands.items() if st.unit is not None and is_converted(st.unit)}
    skipped = {n: make.failed.get(n, "not called by the model's forward on the example inputs") for n in stands
               if n not in units}
    if not units:
        return conv.whole(model, args, kwargs, options, ctx)
    # a converted block's graph holds what the hooks on the model's block computed on tensors, once
    hooked = [p for n in units for p in hooked[n]]
    if piecewise:  # the model's code runs around the blocks: the hooks it put on them run on the units
        for name, unit in units.items():
            unit._forward_hooks.update(added[name])
        warn_model_hooks(model, hooked)
        return piecewise_units(model, tree, units, skipped, args, kwargs, conv, options, ctx, modes, why)
    changing = [n for n in units if stands[n].changes_inputs]
    if changing:  # a graph around the blocks would hold the list as it was before the block's call
        raise RootError(f"{', '.join(changing)} change{'s' if len(changing) == 1 else ''} a list, dict or set "
                        "the model's code gives it (an append to a list of auxiliary losses): a graph around "
                        "the blocks would not see the change")
    # what torch.export traces for the converted blocks: a copy of the input where that has the block's
    # result's shape, else the model's own block
    sources = {id(u): (model.get_submodule(n), stands[n].template) for n, u in units.items()}
    gm = _root(model, tree, units, skipped, args, kwargs, conv, options, ctx.replace(sources=sources), modes, make)
    made = _eval_out_spec(gm)
    if made is not None and made != ran:
        # the model's code collects more than its blocks return (Hugging Face's output_hidden_states, through
        # forward hooks it puts on the blocks): a graph calling the blocks would return less
        raise RootError("the model around its blocks returns another structure than the model's own call (output "
                        "its code collects from the blocks, such as output_hidden_states=True in the config)")
    warn_model_hooks(model, hooked)
    return gm


def _hooks_of(blocks) -> list[tuple[dict, dict]]:
    """Each hook table of every module of ``blocks``, with a copy of what it holds now."""
    return [(table, dict(table)) for b in blocks for m in b.modules()
            for table in (getattr(m, name, None) for name in HOOK_TABLES) if isinstance(table, dict)]


def _restore_hooks(saved: list[tuple[dict, dict]]) -> None:
    for table, before in saved:
        if table.keys() != before.keys():
            table.clear()
            table.update(before)


def _eval_out_spec(gm: nn.Module):
    """The output structure of ``gm``'s eval program where its code builds it from a pytree spec (torch.export's),
    else None."""
    programs = gm.meta.get(K.PROGRAMS)
    graph = programs.graphs.get(EVAL, programs.graphs.get(TRAIN)) if programs is not None else gm.graph
    info = getattr(graph._codegen, "pytree_info", None)
    return getattr(info, "out_spec", None)


def _tree_copy(model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[int, nn.Module]]:
    """The model's structure (its tensors until the end), and the blocks it holds at one name only, by id."""
    # blocks are not copied but replaced; one the model also holds under another name is copied where it stays
    # the model's module, since that other place keeps the model's own
    seen = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    keep = {id(m): m for m in (model.get_submodule(n) for n in names) if seen[id(m)] == 1}
    tree = copy_model(model, share_tensors=True, keep=keep.values())
    return tree, keep


def _put_back(tree: nn.Module, stands: dict[str, _Stand], keep: dict[int, nn.Module]) -> None:
    """Replace each stand by its converted unit, or else by the model's block (copied per :func:`_tree_copy`)."""
    for name, st in stands.items():
        m = st.unit if st.unit is not None else st.block
        put_module(tree, name, copy_model(m, share_tensors=True) if id(m) in keep else m)


class _Maker:
    """Converts a :class:`_Stand`'s block with its first call's inputs, in the model's modes, reusing the plan of a
    block alike; a block that does not capture on its own stays the model's module (``failed`` says why)."""

    def __init__(self, model: nn.Module, conv: Conversions, options: ConvertOptions, ctx: CaptureContext,
                 args: tuple, kwargs: dict, *, piecewise: bool, modes: dict[int, bool]):
        self.model, self.conv, self.options, self.piecewise, self.modes = model, conv, options, piecewise, modes
        self.plans: dict[Any, list[tuple[nn.Module, dict]]] = {}  # key -> [(converted block, the attributes it read)]
        self.made: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        self.low_refused: dict[type, bool] = {}
        self.codes: dict[int, tuple] = {}
        self.block_options = options.replace(keep_io_types=piecewise)
        # a block exported on its own leaves free the sizes free in the model's inputs (batch, sequence length)
        self.block_ctx = ctx.replace(dynamic_sizes=free_sizes(args, kwargs))

    def __call__(self, name: str, block: nn.Module, a: tuple, k: dict) -> nn.Module:
        self._in_model_modes(name, block)
        given = a
        if not self.piecewise and not self.low_refused.get(type(block)) and not self.options.policy.widest:
            a = _hidden_low(a, self.options.dtype)  # (under Policy.widest a float32 stream stays float32)
        key = _signature(block, a, k)
        ref = next((u for u, read in self.plans.get(key, ()) if _same_reads(block, read)), None) \
            if key is not None else None
        unit = _reuse(ref, block, self.codes) if ref is not None else None
        if unit is not None:
            how = f"the plan of {ref.meta[BLOCK_META]['name']}, reused (same structure and input shapes)"
        else:
            ref = None
            try:
                unit, a, key, read = self._convert(block, a, k, given, key)
            except CaptureError as e:  # stays the model's module: traced with the model, or eager
                self.failed[name] = f"does not capture on its own ({why_not_captured(e)})"
                return block
            how = f"converted ({unit.meta['autocastfx'].capture})"
            if key is not None and read is not None:
                self.plans.setdefault(key, []).append((unit, read))
        family = ref.meta[BLOCK_META]["family"] if ref is not None else name
        unit.meta[BLOCK_META] = {"name": name, "inputs": _planned_inputs(unit, a, k), "plan": how,
                                 "family": family}
        self.made[name] = unit.meta[BLOCK_META]
        unit.eval()  # for the rest of the run: no batch-norm statistics updated, no dropout
        return unit

    def _in_model_modes(self, name: str, block: nn.Module) -> None:
        """Put the block's modules in the modes of the model's modules at their names."""
        originals = dict(self.model.get_submodule(name).named_modules())
        for rel, m in block.named_modules():
            o = originals.get(rel)
            if o is not None:
                m.training = self.modes.get(id(o), m.training)

    def _convert(self, block: nn.Module, a: tuple, k: dict, given: tuple, key: Any) -> tuple:
        """The block converted for the inputs ``a``, or for ``given`` in float32 where its code refuses a low input;
        returns (unit, the inputs it was converted for, their signature, the attributes its conversion read)."""
        try:
            with no_autocast(a), _watch_attributes(block) as (read, seen):
                unit = self.conv.block(block, a, k, self.block_options, self.block_ctx.replace(watch=seen))
        except Exception:  # noqa: BLE001 - the block's float32 code refuses a low input (a convolution's
            f32 = to_float32(given)  # float32 bias): converted for a float32 input
            if float_dtypes(a) == float_dtypes(f32):
                raise
            self.low_refused[type(block)] = True
            a = f32
            key = _signature(block, a, k)
            with no_autocast(a), _watch_attributes(block) as (read, seen):
                unit = self.conv.block(block, a, k, self.block_options, self.block_ctx.replace(watch=seen))
        return unit, a, key, read


def _hidden_low(args: tuple, low: torch.dtype) -> tuple:
    """A block's first input (a stack's hidden state) taken low where its values fit, as the blocks before give it,
    so every block of a stack is converted for the same input; other inputs keep their dtype."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point() \
            or args[0].dtype == low:
        return args
    x = args[0]
    # on the meta device there are no values: a hidden state is taken to fit, as in any model that trains
    if x.numel() and not x.is_meta and not bool(torch.isfinite(x.to(low)).all()):
        return args
    return (x.to(low),) + tuple(args[1:])


def _planned_inputs(unit: nn.Module, args: tuple, kwargs: dict) -> list:
    """The dtype a converted block takes each float input in (``float_dtypes``'s order): the example's, or the one
    its plan chose for a free input (``core.pipeline._free_inputs``)."""
    given = float_dtypes((args, kwargs))
    chosen = {}
    for p, v in placeholder_values(unit, args, kwargs):
        info = p.meta.get(K.INFO)
        if isinstance(v, torch.Tensor) and isinstance(info, TensorInfo):
            chosen.setdefault(id(v), info.dtype)
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return [chosen.get(id(t), d) if d is not None else None for t, d in zip(leaves, given)]


# --------------------------------------------------------------------------------------------- reuse

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"})
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


def _signature(block: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A key of what a block's conversion depends on (None: convert it on its own), but for its own classes'
    attribute values, which :func:`_same_reads` compares apart so an unread ``layer_idx`` does not split a plan."""
    parts: list = []
    for name, m in block.named_modules():
        items = [name, type(m), m.training]
        ours = not _is_torch_class(type(m))
        for k, v in sorted(vars(m).items()):
            if k in _MODULE_STATE:
                continue
            if "hook" in k:
                if v:
                    return None
                continue
            if isinstance(v, torch.Tensor):  # a tensor that is neither parameter nor buffer: its values would
                return None                  # not be copied into a reused plan's copy
            try:
                items.append((k, _plain(v) if not ours else type(v)))
            except TypeError:
                return None
        for store in (m._parameters, m._buffers):
            items.append(tuple((k, None if t is None else (t.shape, t.dtype, t.requires_grad, t.stride()))
                               for k, t in store.items()))
        parts.append(tuple(items))
    try:
        parts.append(_plain((args, kwargs)))
    except TypeError:
        return None
    return tuple(parts)


def _is_torch_class(cls: type) -> bool:
    return (getattr(cls, "__module__", "") or "").startswith("torch.")


@contextlib.contextmanager
def _watch_attributes(block: nn.Module):
    """Yields (a dict, the ``CaptureContext.watch`` callback); after conversion the dict maps (module name,
    attribute) to each plain attribute of the block's own classes the capture read (a read counts for every module
    of that class, as the capture reads a copy), or is ``{None: None}`` where a value cannot be compared."""
    classes = {type(m) for m in block.modules() if not _is_torch_class(type(m))}
    names: set[tuple[type, str]] = set()

    def seen(module, name):
        cls = original_class(module)
        if cls in classes and (cls, name) not in names and name not in _MODULE_STATE:
            if name in object.__getattribute__(module, "__dict__"):
                names.add((cls, name))

    out: dict = {}
    yield out, seen
    try:
        for rel, m in block.named_modules():
            for cls, name in names:
                if type(m) is cls and name in vars(m):
                    out[(rel, name)] = _plain(vars(m)[name])
    except TypeError:
        out.clear()
        out[None] = None  # never the same: compared with anything, differs


def _same_reads(block: nn.Module, read: dict) -> bool:
    """Whether ``block`` has the values a converted block's conversion read (see :func:`_watch_attributes`)."""
    if None in read:
        return False
    for (rel, name), value in read.items():
        try:
            m = block.get_submodule(rel)
            if name not in vars(m) or _plain(vars(m)[name]) != value:
                return False
        except (AttributeError, TypeError):
            return False
    return True


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("t", v.shape, v.dtype, v.requires_grad, v.stride(), v.device)
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_plain(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _plain(x)) for k, x in v.items()))
    if callable(v) or hasattr(v, "__dict__"):  # a shared object (a config, a function): the same one
        return ("id", id(v))
    raise TypeError(type(v).__name__)


def _fresh_containers(module: nn.Module, memo: dict) -> None:
    """Enter in a ``copy.deepcopy`` memo a new empty container for each empty hook dict and set of ``module``'s
    modules, skipping ``deepcopy``'s slow path for ``OrderedDict``."""
    for m in module.modules():
        for v in vars(m).values():
            if type(v) is collections.OrderedDict and not v and not vars(v):
                memo[id(v)] = collections.OrderedDict()
            elif type(v) is set and not v:
                memo[id(v)] = set()


def _reuse(ref: nn.Module, block: nn.Module, codes: dict) -> nn.Module | None:
    """A copy of the converted block ``ref`` that runs on ``block``'s own parameters and buffers (the same
    tensors, not copies); None where the two do not correspond name for name, shape and dtype."""
    info = ref.meta["autocastfx"]
    # a conversion's decisions are read-only after it: the copies share them; the tensors are ``block``'s
    memo = {id(x): x for x in (info.plan, info.policy, info.extra_totals, info.source_params, info.absorbed,
                               info.options)}
    for mine, theirs in ((ref.named_parameters(remove_duplicate=False), block.named_parameters(remove_duplicate=False)),
                         (ref.named_buffers(remove_duplicate=False), block.named_buffers(remove_duplicate=False))):
        mine, theirs = dict(mine), dict(theirs)
        if set(mine) != set(theirs):
            return None
        for n, t in mine.items():
            if theirs[n].shape != t.shape or theirs[n].dtype != t.dtype or type(theirs[n]) is not type(t):
                return None
            memo[id(t)] = theirs[n]
    _fresh_containers(ref, memo)
    # reuse the code already written for ``ref``'s graph: writing it is most of a GraphModule copy's time
    code = codes.get(id(ref))  # id(block) -> (its graph, that graph's code)
    if code is None or code[0] is not ref._graph:
        code = codes[id(ref)] = (ref._graph, ref._graph.python_code(root_module="self"))
    with torch_internal_warnings_off():  # copying the specs of a block torch.export captured
        graph = copy.deepcopy(ref._graph, memo)
        graph.python_code = lambda *a, **k: code[1]
        try:
            unit = copy.deepcopy(ref, memo)
        finally:
            del graph.python_code
    if unit.graph is not graph:  # the copy did not take the prepared graph: its code is its own, written again
        unit.recompile()
    rebind(unit, block)
    return unit


# ---------------------------------------------------------------------------------------------- root

def _root(model, tree, units, skipped, args, kwargs, conv: Conversions, options: ConvertOptions,
          ctx: CaptureContext, modes, make: _Maker) -> nn.Module:
    """The model around its converted blocks: one graph with the blocks as call_module nodes."""
    from ..base.meta import names_by_id
    try:
        gm = conv.whole(tree, args, kwargs, options, ctx)
    except (CaptureError, ValueError) as e:
        raise RootError(f"the model around its blocks does not convert ({one_line(e)})") from e
    late = _inputs_made_late(gm, units)
    if late and (ctx.meta_device is not None or not _convert_again(gm, model, units, late, make, args, kwargs)):
        name, given = next(iter(late.items()))
        raise RootError(f"{name} was converted for a call with {given}=None: the example's values made it None "
                        "where the model's code computes it from its inputs, so the block's graph never reads it "
                        "(an all-ones attention mask)")
    keep_containers(gm, tree, units)
    set_modes(gm, model, modes)
    rebind(gm, model)  # the model's own modules, not the tree's copies, hold the attributes read
    info = gm.meta["autocastfx"]
    own = vars(model)  # gm.config is the model's config, not the tree's copy of it
    info.model_attrs = {k: own.get(k, v) for k, v in info.model_attrs.items()}
    add_model_surface(gm)
    info.source_params = names_by_id(model)
    info.extra_totals["blocks"] = describe_units(units, skipped)
    return gm


_SIZE_READS = frozenset({"sym_size", "size", "dim", "numel", "sym_numel", "sym_stride", "stride"})


def _reads_input_values(node: fx.Node) -> bool:
    """Whether ``node``'s value depends on an input's values (not only on its sizes, dtype or device)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        t = n.target
        name = t if isinstance(t, str) else getattr(getattr(t, "overloadpacket", t), "__name__", "")
        if name in _SIZE_READS or (t is getattr and len(n.args) == 2 and n.args[1] in ("shape", "dtype", "device")):
            continue
        stack.extend(n.all_input_nodes)
    return False


def _inputs_made_late(gm: fx.GraphModule, units: dict[str, nn.Module]) -> dict[str, str]:
    """{block: input} for each converted block that the graph around it calls with a value computed from the
    model's inputs where the block was converted for None (the one run's call: Hugging Face passes no mask for an
    all-ones attention mask, and computes one from the input under torch.export)."""
    late = {}
    for node in gm.graph.nodes:
        unit = units.get(str(node.target)) if node.op == "call_module" else None
        if unit is None:
            continue
        given = {**{str(i): a for i, a in enumerate(node.args)}, **node.kwargs}
        for name, kind in unit.meta[K.CONVERTED].call_signature:
            value = given.get(name)
            if kind == "None" and isinstance(value, fx.Node) and _reads_input_values(value):
                late[str(node.target)] = name
                break
    return late


def _convert_again(gm: fx.GraphModule, model: nn.Module, units: dict[str, nn.Module], late: dict[str, str],
                   make: _Maker, args: tuple, kwargs: dict) -> bool:
    """Convert the blocks ``late`` again for the calls the graph around them makes (one run of ``gm`` on the
    example, in eval mode, its buffers and the random state put back), in place in ``gm`` and ``units``; False
    where a block's new conversion is not one."""
    calls: dict[str, tuple] = {}
    hooks = [gm.get_submodule(name).register_forward_pre_hook(
        lambda module, a, k, name=name: calls.setdefault(name, (a, dict(k))), with_kwargs=True) for name in late]
    training = gm.training
    try:
        with _buffers_kept(gm), torch.random.fork_rng(devices=[]), torch.no_grad():
            gm.eval()
            gm(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        gm.train(training)
    for name in late:
        if name not in calls:
            return False
        unit = make(name, model.get_submodule(name), *calls[name])
        if not is_converted(unit):
            return False
        parent, _, leaf = name.rpartition(".")
        gm.get_submodule(parent)._modules[leaf] = unit  # the parent refuses a new child through setattr
        units[name] = unit
    return not _inputs_made_late(gm, units)


def _traces_around(model: nn.Module, names: list[str], policy) -> str | None:
    """None if ``model`` traces with the blocks as calls (``symbolic_trace``, nothing run), else why not."""
    from ..core.policy import Policy
    policy = policy if policy is not None else Policy.default()
    leaves = set(names)

    class Around(ModelTracer):
        def is_leaf_module(self, m, qualname):
            return qualname in leaves or super().is_leaf_module(m, qualname)

    try:
        Around(policy).trace(model)
    except Exception as e:  # noqa: BLE001 - any failure means: not as one graph around the blocks
        return f"the model's forward does not trace around its blocks ({one_line(e)})"
    return None
