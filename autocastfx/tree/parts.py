"""Helpers the blocks and piecewise conversions share: putting parts in place, modes, the quiet run of the model,
the report's description of the parts."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple
import contextlib
import copy
from ..base.quiet import torch_internal_warnings_off
import torch
import torch.nn as nn
from ..base import keys as K
from ..base.errors import one_line
from ..base.meta import is_converted
from ..converted.module import follow_module_modes, set_mode
from ..core import weights as _weights


BLOCK_META = K.BLOCK  # gm.meta of a converted part: its name, its inputs' dtypes, whence its plan


def is_inside(name: str, outer) -> bool:
    """Whether ``name`` is one of the qualified names ``outer`` or inside one."""
    outer = outer if isinstance(outer, (set, frozenset, dict)) else set(outer)
    if name in outer:
        return True
    i = name.find(".")
    while i >= 0:
        if name[:i] in outer:
            return True
        i = name.find(".", i + 1)
    return False


_GEMM_TYPES: tuple[type, ...] = (nn.Linear, nn.modules.conv._ConvNd, nn.MultiheadAttention)


def has_gemm(m: nn.Module) -> bool:
    """Whether a module holds a matmul or convolution with weights: what converting it is for."""
    return any(isinstance(s, _GEMM_TYPES) or type(s).__name__ == "Conv1D" for s in m.modules())


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, key = name.rpartition(".")
    return (root.get_submodule(parent) if parent else root), key


def put_module(root: nn.Module, name: str, m: nn.Module) -> None:
    parent, key = _parent(root, name)
    parent._modules[key] = m


def set_modes(tree: nn.Module, model: nn.Module, modes: dict) -> None:
    """Every module of the tree in the mode its model's module has (a converted unit switched as one)."""
    originals = dict(model.named_modules())
    units: set[str] = set()
    for name, m in tree.named_modules():
        o = originals.get(name)
        if o is None or is_inside(name, units):
            continue
        if is_converted(m) and m is not tree:
            units.add(name)
            flags = {modes[id(s)] for s in o.modules()}
            if len(flags) == 1:
                m.train(flags.pop())
            else:  # mixed: each module's own flag, and the unit's program for them where it has one
                inner = dict(o.named_modules())
                for sub_name, sub in m.named_modules():
                    if sub_name in inner:
                        sub.training = modes[id(inner[sub_name])]
                follow_module_modes(m)
        else:
            m.training = modes[id(o)]
    if is_converted(tree) and hasattr(tree, "graph"):
        flags = {modes[id(s)] for s in model.modules()}
        programs = tree.meta.get(K.PROGRAMS)
        if programs is not None and len(flags) == 1:  # the root's running program is its mode's
            programs.current = None
            set_mode(tree, model.training)
            for name, m in tree.named_modules():
                o = originals.get(name)
                if o is not None and not is_inside(name, units) and not is_converted(m):
                    m.training = modes[id(o)]


def _device_type(value: Any) -> str:
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def no_autocast(value: Any):
    kind = _device_type(value)
    return torch.autocast(kind, enabled=False) if kind != "meta" else contextlib.nullcontext()


@contextlib.contextmanager
def quiet_run(tree: nn.Module, low: torch.dtype | None = None, inputs: Any = None):
    """The one run: eval mode, no gradients, the RNG left as it was. With ``low``, the code between the blocks runs
    under torch.autocast, so float32 code after a block takes its low output (the blocks disable it)."""
    auto = torch.autocast(_device_type(inputs), dtype=low) if low is not None and low != torch.float32 \
        else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), torch.no_grad(), auto, torch_internal_warnings_off():
        # a converted block's own modules keep its mode, which the block checks they have at each call
        inside = {id(s) for m in tree.modules() if is_converted(m) for s in m.modules()}
        flags = [(m, m.training) for m in tree.modules() if id(m) not in inside]
        for m, _ in flags:
            m.training = False
        try:
            yield
        finally:
            for m, f in flags:
                m.training = f


def to_float32(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t,
        value)


def float_dtypes(value: Any) -> list:
    return [t.dtype if isinstance(t, torch.Tensor) and t.is_floating_point() else None
            for t in torch.utils._pytree.tree_leaves(value)]


def keep_containers(gm: nn.Module, tree: nn.Module, units: dict) -> None:
    """The blocks' containers (a ModuleList) in place of the bare modules fx made on their paths, holding what
    ``gm`` holds at each index."""
    done = set()
    for name in units:
        parent = name.rpartition(".")[0]
        if not parent or parent in done:
            continue
        done.add(parent)
        container = tree.get_submodule(parent)
        try:
            made = gm.get_submodule(parent)
        except AttributeError:
            continue
        kept = copy.copy(container)
        kept._modules = {k: made._modules[k] if k in made._modules else
                         (c if is_converted(c) else copy.deepcopy(c)) for k, c in container._modules.items()}
        kept.__class__ = _fixed_length(type(container))
        put_module(gm, parent, kept)


_RESIZING = ("append", "extend", "insert", "pop", "__delitem__", "__iadd__", "update", "clear", "popitem")
_FIXED: dict[type, type] = {}


def _refuse_resize(name: str):
    def refuse(self, *args, **kwargs):
        raise ValueError(
            f"{type(self).__name__}.{name}() on a converted module's container of blocks: the graph around the "
            f"blocks calls its {len(self._modules)} entries by name, so a block added would never run and one "
            "removed would be called still; nothing was changed. Change the model's container and convert it "
            "again (gm.state_dict() loads into the model first if gm was trained); replacing a block at an "
            "existing index by one of the same class and shapes is followed")
    refuse.__name__ = name
    return refuse


def _fixed_length(cls: type) -> type:
    """``cls`` (a ModuleList, ModuleDict or Sequential of blocks) with the methods that add or remove entries
    refused; ``isinstance`` of ``cls``, and its entries replaced in place as before."""
    if cls not in _FIXED:
        refused = {n: _refuse_resize(n) for n in _RESIZING if hasattr(cls, n)}
        if hasattr(cls, "__setitem__") and issubclass(cls, nn.ModuleDict):
            def setitem(self, key, module, _set=cls.__setitem__):
                if key not in self._modules:
                    _refuse_resize("__setitem__")(self)
                _set(self, key, module)
            refused["__setitem__"] = setitem
        _FIXED[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                  **refused})
    return _FIXED[cls]


def describe_units(units: dict, skipped: dict) -> dict:
    out = {}
    for name, unit in units.items():
        b = unit.meta[BLOCK_META]
        casts = sum(1 for n in unit.graph.nodes if getattr(n.meta.get("autocastfx"), "kind", None) == "cast")
        out[name] = {"plan": b["plan"], "casts": casts, "low_parameters": len(_weights.low_read_names(unit)),
                     "inputs": [str(d).removeprefix("torch.") for d in b["inputs"] if d is not None]}
    for name, why in skipped.items():
        out[name] = {"plan": f"stays in the model's code ({why})"}
    return out


class RootError(Exception):
    pass


def data_dependent(e: BaseException) -> bool:
    """Whether torch.export failed on a branch on a tensor's values (no capture takes the model as one graph)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, GuardOnDataDependentSymNode):
            return True
        e = e.__cause__ or e.__context__
    return False


def why_not_captured(e: BaseException) -> str:
    """A capture error in one line: what each way of capturing said."""
    lines = [ln.strip() for ln in str(e).splitlines() if "failed:" in ln]
    return "; ".join(lines)[:400] if lines else one_line(e)


class Conversions(NamedTuple):
    """The conversions the tree is given by api.py (which it never imports), each called as ``(module, args, kwargs,
    options, ctx)``. ``whole``: the module converted without blocks; ``block``: a block as a converted module of its
    own, its inputs cast on entry to the dtypes it was planned for."""
    whole: Callable
    block: Callable
