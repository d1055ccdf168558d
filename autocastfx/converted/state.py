"""Guards on what a converted module's programs took from the model at convert() (the plain attributes its code
read, held as constants, and the parameters, buffers and modules it runs on): a later change to one is refused at
the next call."""
from __future__ import annotations

import dis
import operator
import types
import weakref
from typing import Any

import torch
import torch.nn as nn

from ..base.keys import MIRROR
from ..base.meta import is_converted
from ..base.runtime import KEEP_MODEL_MODES
from ..base.quiet import warn_user
from ..capture.watch import StateUse, fingerprint

# a converted block -> (the guard of the converted module holding it, the block's path there): what a block's own
# train() shares with the model, that guard records as shared too (it watches the same modules of the model)
_ENCLOSING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StateGuard:
    """The attributes read at capture: modules by weak reference (the model is not kept alive), values by identity,
    containers and plain tensors also by content. A copy (``copy.deepcopy(gm)``, an EMA) watches nothing until
    bound again: it holds its own tensors and modes, which the model's changes do not reach; dropped when pickled."""

    def __init__(self, reads: frozenset = frozenset(), unowned: frozenset = frozenset(), lazy: dict | None = None):
        self.reads = reads  # (module path, name) read at capture
        self.unowned = unowned  # (module path, name) read from the module's class, or absent, at capture
        self.lazy = lazy or {}  # (module path, name) the model's own call sets, as at capture -> that value
        self.looked: list[tuple] = []  # (module ref, path, name, value then, fingerprint) of those
        self.modules: list[list] = []  # [module ref, getter, values, path, names, fingerprints, {name: set lazily}]
        self.contents: list[tuple[Any, weakref.ref, str, str, Any]] = []
        self.tensors: list[tuple] = []  # (module ref, path, name, fingerprint, tensor ref or None)
        # each module: [ref, path, its parameters, buffers and children by id (None: it holds none), its training
        # flag and its number of hooks as last seen, the converted module's module of its path (a weak reference)]
        self.watched: list[list] = []
        self.root = None  # the module bound
        self.names: list[list] = []  # [module globals, name, value then, fingerprint, class reading it]
        self.target = None  # the converted module the entries' last fields point into (a weak reference)

    def bound(self, model: nn.Module, names: bool = True) -> StateGuard:
        """A guard of these attributes on ``model`` (the model, or the module of it the capture's copy was made of),
        as they are now; a module or attribute it lacks is not watched. With ``names``, also the module-level names
        holding plain values that the forward code of the model's classes reads (:func:`global_reads`)."""
        out = StateGuard(self.reads, self.unowned, self.lazy)
        out.root = weakref.ref(model)
        if names:
            out.names = [[g, n, g[n], fingerprint(g[n]), who] for g, n, who in global_reads(model)]
        for path, name in sorted(self.unowned):
            if _has(model, path):
                m = model.get_submodule(path)
                v = getattr(m, name, _MISSING)
                out.looked.append((weakref.ref(m), path, name, v, fingerprint(v)))
        inside = {id(s) for n, u in model.named_modules() if n and is_converted(u) for s in u.modules() if s is not u}
        out.watched = [[weakref.ref(m), path, _held(m) if m._parameters or m._buffers or m._modules else None,
                        m.training, None if path and is_converted(m) else _hooks(m), None]  # a block runs its own
                       for path, m in model.named_modules() if id(m) not in inside]
        by_owner: dict[tuple[str, str], list[str]] = {}  # (module path, attribute holding a config or "") -> names
        for path, name in self.reads:
            head, _, rest = name.rpartition(".")
            by_owner.setdefault((path, head), []).append(rest)
        for (path, head), names in sorted(by_owner.items()):
            try:
                m = model.get_submodule(path)
                m = vars(m)[head] if head else m
                ref = weakref.ref(m)
            except (AttributeError, KeyError, TypeError):
                continue
            lazy = {n.rpartition(".")[2]: v for (p, n), v in self.lazy.items()
                    if p == path and n.rpartition(".")[0] == head}
            path = f"{path}.{head}" if head and path else head or path
            own = vars(m)
            for n in sorted(names):  # tensors the guard must not keep alive: watched through the module
                if n in own and _holds_tensor(own[n]):
                    t = own[n]
                    out.tensors.append((ref, path, n, fingerprint(t),
                                        weakref.ref(t) if isinstance(t, torch.Tensor) else None))
            names = tuple(n for n in sorted(names) if n in own and not _holds_tensor(own[n]))
            if not names:
                continue
            prints = tuple(fingerprint(own[n]) for n in names)
            get = operator.itemgetter(*names, names[0])  # a tuple, also of one name
            out.modules.append([ref, get, get(own), path, names, prints, lazy])
            for n, fp in zip(names, prints):
                if _mutable(own[n]):
                    out.contents.append((own[n], ref, path, n, fp))  # changed in place: compared by content
        return out

    def check(self, gm: nn.Module | None = None) -> None:
        """ValueError naming the first attribute whose value changed since capture; a mode set on the model since
        (``model.eval()``, ``model.bn.eval()``) is set on ``gm``'s module of that name, as on a module compiled
        from the model."""
        self._check_modules(gm)
        try:
            for ref, get, values, *_ in self.modules:  # by identity first, the cheap check
                m = ref()
                if m is not None and get(m.__dict__) != values:
                    raise LookupError
        except Exception:  # noqa: BLE001 - a value replaced (or a tensor compared): told apart below
            self._compare()
        for value, ref, path, name, fp in self.contents:
            if fingerprint(value) != fp:
                _refuse(ref(), path, name, value, value, in_place=True)
        for ref, path, name, fp, tensor in self.tensors:
            m = ref()
            now = m.__dict__.get(name, _MISSING) if m is not None else None
            if m is not None and ((tensor is not None and tensor() is not now) or fingerprint(now) != fp):
                _refuse(m, path, name, _AT_CONVERT, now, in_place=tensor is not None and tensor() is now)
        for ref, path, name, old, fp in self.looked:
            m = ref()
            if m is not None and fingerprint(now := getattr(m, name, _MISSING)) != fp:
                _refuse(m, path, name, old, now)
        for entry in self.names:
            g, name, old, fp, who = entry
            now = g.get(name, _MISSING)
            if now is not old or type(old) in (dict, list):
                if fingerprint(now) != fp:
                    _refuse_name(g, name, old, now, who)
                entry[2] = now  # set again to an equal value

    def _check_modules(self, gm: nn.Module | None) -> None:
        """One pass over the model's modules: a tensor or child replaced is refused, a mode set since is followed
        on ``gm``, a hook registered since is warned about (it never runs)."""
        changed, replaced = [], None
        for entry in self.watched:
            m = entry[0]()
            if m is None:
                continue
            if entry[2] is not None and replaced is None and entry[2] != (now := _held(m)):
                replaced = (m, entry[1], entry[2][:-1] == now[:-1])
            if m.training is not entry[3]:
                entry[3] = m.training
                changed.append((entry[1], entry[3]))
            elif entry[5] is not None and (t := entry[5]()) is not None and t.training is not entry[3] \
                    and not KEEP_MODEL_MODES.get():
                m.training = entry[3] = t.training  # set on gm's module since: the model's follows (one mode)
            if entry[4] is not None and (hooks := _hooks(m)) != entry[4]:
                if hooks > entry[4]:
                    _warn_hook(m, entry[1])
                entry[4] = hooks
        if gm is not None and (self.target is None or self.target() is not gm):
            self.point_at(gm)
        if changed and gm is not None:
            self._follow_modes(gm, changed)
        if replaced is not None:
            _replaced(*replaced)

    def point_at(self, gm: nn.Module) -> None:
        """Pair each watched module with ``gm``'s module of its name; a held module (which the graph never calls)
        sets the model's module's mode in its ``train()``."""
        mods = dict(gm.named_modules(remove_duplicate=False))
        for entry in self.watched:
            t = mods.get(entry[1])
            entry[5] = weakref.ref(t) if t is not None else None
            if t is not None and entry[1] and getattr(type(t), "_autocastfx_fixed_settings", False):
                t.__dict__[MIRROR] = entry[0]
        for path, m in mods.items():
            if path and is_converted(m):
                _ENCLOSING[m] = (weakref.ref(self), path)
        self.target = weakref.ref(gm)

    def share_modes(self, gm: nn.Module) -> None:
        """Set the model's modules to the modes of ``gm``'s modules of their names: after ``gm.train()`` or
        ``gm.eval()`` the model and ``gm`` are in one mode, so a later ``model.train()``/``model.eval()`` is followed
        even where it changes none of the model's flags (the later call decides, as for one module)."""
        if KEEP_MODEL_MODES.get():
            return
        self.point_at(gm)
        for entry in self.watched:
            m, t = entry[0](), entry[5]() if entry[5] is not None else None
            if m is not None:
                if t is not None:
                    m.training = t.training
                entry[3] = m.training
        _shared_within(gm)

    def _follow_modes(self, gm: nn.Module, changed: list) -> None:
        """Set on ``gm`` the modes set on the model since the last call: the model's root set ``gm``'s (and runs its
        program), then every module takes the model's module's mode, as one module would be left."""
        if any(not path for path, _ in changed):
            token = KEEP_MODEL_MODES.set(True)  # gm's modules, held ones and blocks, leave the model's modes be
            try:
                gm.train(next(mode for path, mode in changed if not path))
            finally:
                KEEP_MODEL_MODES.reset(token)
            paths = None  # every module
        else:
            paths = {path for path, _ in changed}
        for entry in self.watched:
            m, t = entry[0](), entry[5]() if entry[5] is not None else None
            if m is not None and t is not None and (paths is None or entry[1] in paths):
                t.training = entry[3] = m.training

    def _compare(self) -> None:
        """Refuse a changed value; one set again to an equal value is taken as the one watched from now on."""
        for entry in self.modules:
            ref, get, values, path, names, prints, lazy = entry
            m = ref()
            if m is None:
                continue
            for n, old, fp in zip(names, values, prints):
                new = m.__dict__.get(n, _MISSING)
                if new is not old and (new is _MISSING or fingerprint(new) != fp) \
                        and not (n in lazy and fingerprint(new) == fingerprint(lazy[n])):  # the model's own call set it
                    _refuse(m, path, n, old, new)
            entry[2] = get(m.__dict__)

    def __deepcopy__(self, memo):
        return StateGuard(self.reads, self.unowned, self.lazy)  # unbound: a conversion's own copies rebind it

    def __reduce__(self):
        return (StateGuard, ())


def _shared_within(gm: nn.Module) -> None:
    """After ``gm`` (a converted block) shared its modes with the model in its own ``train()``: the guards of the
    converted modules holding it record the model's modules under it as shared, not as set on the model since
    (which a call would set on ``gm``'s modules, over a mode set on one of them after)."""
    while (enclosing := _ENCLOSING.get(gm)) is not None and (outer := enclosing[0]()) is not None:
        prefix = enclosing[1] + "."
        for entry in outer.watched:
            if entry[1] == enclosing[1] or entry[1].startswith(prefix):
                m = entry[0]()
                if m is not None:
                    entry[3] = m.training
        gm = outer.target() if outer.target is not None else None
        if gm is None:
            return


class _Missing:
    def __repr__(self):
        return "unset"


_MISSING = _Missing()


class _AtConvert:
    def __repr__(self):
        return "its value at convert()"


_AT_CONVERT = _AtConvert()
_CHECKPOINTING = ("(activation checkpointing: convert with the model as it is and wrap the converted blocks with "
                  "autocastfx.checkpoint_blocks instead) ")


def _refuse(module, path: str, name: str, old: Any, new: Any, in_place: bool = False) -> None:
    where = f"{type(module).__name__ if module is not None else 'the model'}{f' (at {path!r})' if path else ''}"
    what = "was changed in place" if in_place else "was deleted" if new is _MISSING else \
        f"was set to {_short(new)} (it was {_short(old)})"
    raise ValueError(
        f"{where}.{name} {what} after convert(): the converted module's programs hold the value the model's code "
        "read at conversion as a constant and would go on computing with it. Convert again after the change "
        f"{_CHECKPOINTING if 'checkpoint' in name else ''}"
        "(autocastfx.convert(model, ...); gm.state_dict() loads into the model first if gm was trained), or keep a "
        "value that changes during training in a buffer (register_buffer) or pass it as a tensor input")


def global_reads(model: nn.Module) -> list[tuple[dict, str, str]]:
    """``(module globals, name, class)`` of each module-level name that the ``forward`` of a class in ``model``
    (outside torch) loads and never assigns, whose value is plain (a number, a string, a flag, or a dict, list or
    tuple of them): a graph holds what it read as a constant (``x * SCALE``, ``CFG["temperature"]``)."""
    out, seen = {}, set()
    for m in model.modules():
        fn = getattr(type(m).forward, "__func__", type(m).forward)
        code, g = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or g is None or code in seen or g.get("__name__", "").split(".")[0] in ("torch", "autocastfx"):
            continue
        seen.add(code)
        loads, stores, edits = _global_names(code)
        for name in loads - stores:
            v = g.get(name, _MISSING)
            if _plain_value(v) and not (type(v) in (dict, list) and (edits or _leaves(v) > 64)):
                out.setdefault((id(g), name), (g, name, type(m).__qualname__))
    return list(out.values())


_EDITS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "sort",
          "reverse", "__setitem__", "__delitem__"}


def _global_names(code: types.CodeType) -> tuple[set[str], set[str], bool]:
    """(names loaded, names assigned, whether the code may change a container in place: an item stored or
    deleted, or a changing method called; its dict and list globals are then not watched, a counter dict the
    forward moves being no constant of the graph)."""
    loads, stores, edits = set(), set(), False
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            loads.add(ins.argval)
        elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.add(ins.argval)
        elif ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") or \
                ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in _EDITS:
            edits = True
    for const in code.co_consts:  # comprehensions, nested functions and lambdas
        if isinstance(const, types.CodeType):
            inner = _global_names(const)
            loads |= inner[0]
            stores |= inner[1]
            edits = edits or inner[2]
    return loads, stores, edits


def _leaves(v: Any) -> int:
    return sum(_leaves(x) for x in (v.values() if isinstance(v, dict) else v)) if type(v) in (dict, list, tuple) else 1


def _plain_value(v: Any, depth: int = 0) -> bool:
    if isinstance(v, bool) or v is None or type(v) in (int, float, str):
        return True
    if depth < 3 and type(v) in (tuple, list):
        return all(_plain_value(x, depth + 1) for x in v)
    if depth < 3 and type(v) is dict:
        return all(_plain_value(x, depth + 1) for x in v.values())
    return False


def _refuse_name(g: dict, name: str, old: Any, new: Any, who: str) -> None:
    what = "was deleted" if new is _MISSING else f"was set to {_short(new)} (it was {_short(old)})" \
        if new is not old else "was changed in place"
    raise ValueError(
        f"the module-level name {g.get('__name__', '?')}.{name}, which {who}.forward reads, {what} after convert(): "
        "the converted module's programs hold the value the model's code read at conversion as a constant and would "
        "go on computing with it. Convert again after the change (autocastfx.convert(model, ...); gm.state_dict() "
        "loads into the model first if gm was trained), or keep a value that changes during training in a buffer "
        "(register_buffer) or pass it as a tensor input")


def _mutable(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` can change in place: a list, dict, set or tensor, or a tuple holding one."""
    if isinstance(v, (list, dict, set, torch.Tensor)):
        return True
    return depth < 4 and type(v) is tuple and any(_mutable(x, depth + 1) for x in v)


def _holds_tensor(v: Any, depth: int = 0) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if depth < 4 and type(v) in (tuple, list, set, frozenset):
        return any(_holds_tensor(x, depth + 1) for x in v)
    return depth < 4 and type(v) is dict and any(_holds_tensor(x, depth + 1) for x in v.values())


def _hooks(m: nn.Module) -> int:
    return len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)


def _warn_hook(m: nn.Module, path: str) -> None:
    warn_user(f"autocastfx: a hook registered on the model's {type(m).__name__}{f' at {path!r}' if path else ''} "
              "after convert() never runs: the converted module computes the model's ops in its own graph and "
              "never calls the model's modules. Return the value from forward, or hook a converted block (convert "
              "with blocks=...), which the converted module calls")


def _torchs(hook) -> bool:
    """A hook of torch's own (the legacy weight_norm's, prune's): what it computes on tensors is in the graph."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    plain = isinstance(fn, (types.FunctionType, types.MethodType, types.BuiltinFunctionType))
    return str(getattr(fn, "__module__", "") if plain else type(fn).__module__).startswith("torch.")


def hooked_paths(model: nn.Module, prefix: str = "") -> list[str]:
    """The names (after ``prefix``) of ``model``'s modules, converted blocks' aside, with forward hooks not torch's."""
    inside = {id(s) for n, u in model.named_modules() if n and is_converted(u) for s in u.modules()}
    return [".".join(p for p in (prefix, path) if p) or type(model).__name__
            for path, m in model.named_modules() if id(m) not in inside
            and any(not _torchs(h) for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))]


def warn_model_hooks(model: nn.Module, hooked: list[str] | None = None) -> None:
    """Warn where the model's modules have forward hooks at conversion (``hooked``, else found in ``model``): the
    capture ran them once, so the graph holds what they compute on tensors, and none of their Python runs at later
    calls."""
    hooked = hooked_paths(model) if hooked is None else hooked
    if hooked:
        warn_user(f"autocastfx: forward hooks on the model's {', '.join(map(repr, hooked[:4]))}"
                  f"{f' and {len(hooked) - 4} more' if len(hooked) > 4 else ''} ran once, at conversion: the "
                  "converted graph holds what they compute on tensors, and none of their Python (recording a "
                  "feature, logging a statistic) runs at later calls. Return such values from forward, or hook a "
                  "converted block (convert with blocks=...), which the converted module calls")


def _held(m: nn.Module) -> tuple:
    # by id, so the guard keeps nothing of the model alive; last the first parameter's dtype, which model.half()
    # changes in place
    first = next(iter(m._parameters.values()), None)
    return (*map(id, m._parameters.values()), *map(id, m._buffers.values()), *map(id, m._modules.values()),
            getattr(first, "dtype", None))


def _replaced(module: nn.Module, path: str, in_place: bool = False) -> None:
    if in_place:
        raise ValueError(
            f"the parameters of the model's {type(module).__name__}{f' at {path!r}' if path else ''} changed dtype "
            "after convert() (model.half(), model.to(dtype)): they are the converted module's too, the float32 "
            "weights its programs cast per op and the optimizer trains, and low they would lose small updates. "
            "Put them back (model.float()), or convert with the dtype wanted")
    raise ValueError(
        f"a parameter, buffer or submodule of the model's {type(module).__name__}"
        f"{f' at {path!r}' if path else ''} was replaced after convert() (a new layer, load_state_dict(..., "
        "assign=True), a move of the model to another device): the converted module runs on the tensors "
        "and modules it had, so it would not compute the changed model, and an optimizer over the model's new "
        "tensors would train what it never reads. Make the change before convert() and convert again, or make it "
        "on the converted module (gm.load_state_dict(...), gm.to(...))")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _legacy_reparametrization(module: nn.Module, name: str) -> str | None:
    """``"spectral_norm"`` or ``"weight_norm"`` where ``module``'s attribute ``name`` is set by the forward pre-hook
    of torch's older form of that reparametrization; else None."""
    for hook in module._forward_pre_hooks.values():
        kind = {"SpectralNorm": "spectral_norm", "WeightNorm": "weight_norm"}.get(type(hook).__name__)
        if kind is not None and getattr(hook, "name", None) == name and type(hook).__module__.startswith("torch.nn"):
            return kind
    return None


def guard_for(state: StateUse | None, model: nn.Module) -> StateGuard | None:
    """The guard of what ``state`` says the capture read, watching ``model`` (None: nothing read); ValueError where
    the model's code changes an attribute it reads (a counter the forward moves)."""
    if state is None:
        return None
    leaves = state.leaves
    for (path, name), (old, new) in sorted(state.changed.items(), key=lambda kv: kv[0]):
        if (path, name) in state.read and path not in leaves and not isinstance(new, torch.Tensor):
            owner = type(model.get_submodule(path)).__name__ if _has(model, path) else type(model).__name__
            legacy = _legacy_reparametrization(model.get_submodule(path) if _has(model, path) else model, name)
            if legacy is not None:
                raise ValueError(
                    f"{owner}.{name} is recomputed before each call by torch.nn.utils.{legacy} (a forward pre-hook "
                    "that sets the attribute), which a converted graph cannot repeat. Use "
                    f"torch.nn.utils.parametrizations.{legacy} (a parametrization), which converts and trains as "
                    "in the model")
            raise ValueError(
                f"{owner}.forward changes its attribute {name!r} ({_short(old)} -> {_short(new)}), which it also "
                "reads: a converted graph repeats the tensor ops only, so the change would happen once, at "
                "conversion, and never again. Keep the value in a tensor buffer updated in place "
                f"(self.register_buffer({name!r}, torch.tensor(...)); self.{name}.add_(1)), which the converted "
                "module updates at each call, or change it in the training loop")
    # a registered buffer the code rebinds (self.steps = self.steps + 1) is a write torch.export records: the
    # converted module copies the new value into the model's buffer at each call (symbolic tracing refuses one)
    changed = {k: v for k, v in state.changed.items() if not _is_buffer(model, *k)}
    carried = sorted(name for (path, name) in changed if (path, name) in state.read and path not in leaves)
    if carried:
        warn_user(f"autocastfx: {type(model).__name__}'s code sets the tensor attribute(s) "
                  f"{', '.join(repr(n) for n in carried)} and reads them: the converted graph computes them as the "
                  "capture did, from each call's inputs, or as the constant the capture saw where they come from "
                  "none (a counter). That is right for a cache of values computed from the inputs, not for state "
                  "carried from one call to the next (a counter, a running average), which belongs in a buffer "
                  "updated in place (self.register_buffer(...); self.n.add_(1))")
    unread = sorted(name for (path, name) in changed if (path, name) not in state.read and path not in leaves)
    if unread:
        warn_user(f"autocastfx: {type(model).__name__}'s code sets {', '.join(repr(n) for n in unread)} as it runs; "
                  "the converted module runs the captured tensor ops only and does not set it (it keeps its value "
                  "from before conversion). Read it from the model run without autocastfx, or return it from forward")
    reads = frozenset(k for k in state.read if k not in state.changed)  # what the code sets is its own
    return StateGuard(reads, frozenset(state.unowned), state.lazy).bound(model)


def _is_buffer(model: nn.Module, path: str, name: str) -> bool:
    return _has(model, path) and name in (model.get_submodule(path) if path else model)._buffers


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def rebind(unit: nn.Module, module: nn.Module) -> None:
    """Watch ``module`` (the model's own) for a converted ``unit`` made from a copy of it or from a module alike."""
    info = unit.meta.get("autocastfx") if isinstance(getattr(unit, "meta", None), dict) else None
    if getattr(info, "state", None) is not None:
        info.state = info.state.bound(module)


def follow_model(other: nn.Module, guard: StateGuard | None, settings: frozenset = frozenset()) -> None:
    """Bind the guard of ``other`` (a conversion for another call, with the module ``settings`` ((module name,
    attribute)) applied) to the model ``guard`` watches; ValueError where an attribute ``other``'s conversion read,
    outside ``settings``, has changed on the model since."""
    info = other.meta.get("autocastfx") if isinstance(getattr(other, "meta", None), dict) else None
    mine, model = getattr(info, "state", None), guard.root() if guard is not None and guard.root else None
    if mine is None or model is None:
        return
    now = mine.bound(model)
    then = {(e[3], n): (v, fp) for e in mine.modules for n, v, fp in zip(e[4], e[2], e[5])}
    for e in now.modules:
        for n, v, fp in zip(e[4], e[2], e[5]):
            old = then.get((e[3], n))
            # a copy's objects are other objects (compared by identity): only values are compared
            if old is not None and old[1] != fp and fp[0] != "id" and (e[3], n) not in settings:
                _refuse(e[0](), e[3], n, old[0], v)
    now.modules = [e for e in now.modules if not any((e[3], n) in settings for n in e[4])]
    info.state = now
