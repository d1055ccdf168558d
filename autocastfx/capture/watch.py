"""What the model's code reads while it is captured: modules' ``training`` flags and plain attributes. Only the
capture's own copy is watched, each module's class swapped meanwhile for a subclass that reports attribute reads, so
neither the model's classes nor ``nn.Module`` change.
"""
from __future__ import annotations
import contextlib
import dataclasses
import inspect
import os
import sys
from typing import Any, Callable, Iterable
import torch
import torch.fx as fx
import torch.nn as nn
from ..base.meta import WATCHED_CLASS, is_converted, original_class
_CALLBACKS: dict[int, list] = {}  # id(a watched module) -> what is called on each of its reads
_WRITES: dict[int, list] = {}  # id(a watched module) -> what is called before each of its attribute writes


class _Unannounced:
    """First base of a watched class: its ``__init_subclass__`` does nothing, so a class's hook (a registry of its
    subclasses) is not told of a subclass that exists only while a capture runs."""

    @classmethod
    def __init_subclass__(cls, **kwargs):
        pass


def _reporting(cls: type) -> type:
    """A subclass of ``cls`` that calls the callbacks of the instance on every attribute read, and before every
    attribute write (``self.x = v``); made per watch, not cached."""
    def __getattribute__(self, name):
        for callback in _CALLBACKS.get(id(self), ()):
            callback(self, name)
        return super(sub, self).__getattribute__(name)

    def __setattr__(self, name, value):
        for callback in _WRITES.get(id(self), ()):
            callback(self, name, value)
        super(sub, self).__setattr__(name, value)

    sub = type(cls.__name__, (_Unannounced, cls), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                                   "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                   WATCHED_CLASS: cls})
    return sub


def watchable(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose reads are the model's own: not those of its converted blocks, which read for
    themselves."""
    inside = {id(s) for m in model.modules() if m is not model and is_converted(m) for s in m.modules()}
    return [m for m in model.modules() if id(m) not in inside]


@contextlib.contextmanager
def watch_reads(modules: Iterable[nn.Module], callback: Callable[[nn.Module, str], None],
                written: Callable[[nn.Module, str, Any], None] | None = None):
    """Meanwhile ``callback(module, name)`` is called on every attribute read of one of ``modules``, and
    ``written(module, name, value)`` before every attribute write, which must be the caller's own (a copy it made):
    their classes are swapped meanwhile. Watches nest."""
    mods = list({id(m): m for m in modules}.values())
    swapped, made = [], {}
    for m in mods:
        _CALLBACKS.setdefault(id(m), []).append(callback)
        if written is not None:
            _WRITES.setdefault(id(m), []).append(written)
        cls = type(m)
        if WATCHED_CLASS not in cls.__dict__:  # not watched already (by an enclosing watch)
            if cls not in made:
                made[cls] = _reporting(cls)
            try:
                m.__class__ = made[cls]
            except TypeError:  # a layout a subclass cannot take (__slots__): its reads are not seen
                continue
            swapped.append((m, cls))
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        for m in mods:
            left = _CALLBACKS.get(id(m), [])
            left.remove(callback)
            if not left:
                _CALLBACKS.pop(id(m), None)
            if written is not None:
                left = _WRITES.get(id(m), [])
                left.remove(written)
                if not left:
                    _WRITES.pop(id(m), None)


_CLASS_KEYS = ("nn_module_stack", "source_fn_stack")  # the node metadata that names modules' classes


def own_classes(gm: nn.Module) -> None:
    """Put the modules' own classes back in place of the watching subclasses a capture recorded in the node metadata
    of every graph in ``gm``: a class that exists only while a capture runs would not pickle."""
    for m in gm.modules():
        graph = getattr(m, "graph", None)
        if isinstance(graph, fx.Graph):
            for node in graph.nodes:
                for key in _CLASS_KEYS:
                    if key in node.meta:
                        node.meta[key] = _unwatched(node.meta[key])


def _unwatched(v):
    if isinstance(v, type):
        return v.__dict__.get(WATCHED_CLASS, v)
    if isinstance(v, dict):
        return {k: _unwatched(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unwatched(x) for x in v]
    if type(v) is tuple:
        return tuple(_unwatched(x) for x in v)
    return v


@contextlib.contextmanager
def watch_training(model: nn.Module, reads: list | None):
    """Meanwhile append ``(module, code object)`` to ``reads`` for every read of ``training`` by a module of
    ``model`` (the capture's copy); ``None`` watches nothing."""
    if reads is None:
        yield
        return

    def seen(module, name):
        if name == "training":  # the frame that read it: above this callback and the reporting __getattribute__
            reads.append((module, sys._getframe(2).f_code))

    with watch_reads(watchable(model), seen):
        yield


def outer_units(model: nn.Module) -> dict[str, nn.Module]:
    """The converted blocks inside ``model`` (not the model itself), outermost only, by qualified name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if n and is_converted(m) and not any(n.startswith(o + ".") for o in out):
            out[n] = m
    return out


_MODULE_OWN = frozenset(vars(nn.Module())) | {"forward"}  # nn.Module's bookkeeping: not the model's state


def fingerprint(v: Any, depth: int = 0) -> Any:
    """What a value read as a constant is compared by: plain values and containers of them by value, a tensor that
    is not a parameter by identity and version, anything else by identity."""
    if isinstance(v, torch.Tensor):  # a parameter moves at every step: by identity
        return ("id", id(v)) if isinstance(v, nn.Parameter) else ("tensor", id(v), v._version)
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return (type(v), v)
    if depth < 4 and type(v) in (tuple, list, set, frozenset, dict, torch.Size):
        items = sorted(v.items(), key=repr) if isinstance(v, dict) else sorted(v, key=repr) \
            if isinstance(v, (set, frozenset)) else v
        return (type(v), tuple(fingerprint(x, depth + 1) for x in items))
    return ("id", id(v))


@dataclasses.dataclass
class StateUse:
    """The plain attributes (``(module path, name)``) the model's code read while it was captured, and those it
    changed: ``changed`` maps each to (value before, value after)."""
    read: set = dataclasses.field(default_factory=set)
    changed: dict = dataclasses.field(default_factory=dict)
    leaves: set = dataclasses.field(default_factory=set)  # paths of the modules the graph calls (their own forward)
    unowned: set = dataclasses.field(default_factory=set)  # public names read from a module's class, or found absent
    lazy: dict = dataclasses.field(default_factory=dict)  # read, and set by the code itself first: -> the value set
    switching: bool = False  # the capture is setting the copy's modes (its train() may set attributes): no writes


@contextlib.contextmanager
def switching(use: StateUse):
    """Meanwhile the copy's attribute writes are not the model's forward's (the capture calls its ``train()``)."""
    use.switching = True
    try:
        yield
    finally:
        use.switching = False


def _own_state(model: nn.Module, mods: list[nn.Module]) -> dict:
    keep = {id(m) for m in mods}
    return {(path, k): (v, fingerprint(v)) for path, m in model.named_modules() if id(m) in keep
            for k, v in vars(m).items() if state_name(m, k)}


def state_name(m: nn.Module, name: str) -> bool:
    # torch's own modules keep private caches they refresh themselves (an RNN's _flat_weights); fx's tracer puts
    # the tensor constants it meets on the traced module
    return name not in _MODULE_OWN and not name.startswith("_tensor_constant") \
        and not (name[0] == "_" and original_class(m).__module__.startswith("torch."))


@contextlib.contextmanager
def watch_state(model: nn.Module):
    """Yields a :class:`StateUse` of ``model`` (the capture's copy) that collects the plain attributes of its
    modules read meanwhile (not those inside converted blocks, which watch their own)."""
    mods = watchable(model)
    paths = {id(m): n for n, m in model.named_modules()}
    use = StateUse()
    held: dict[int, tuple] = {}  # id(a plain object a module holds: a config) -> (module path, attribute)
    for m in mods:
        for k, v in vars(m).items():
            if plain_object(v) and state_name(m, k) and id(m) in paths:
                held.setdefault(id(v), (paths[id(m)], k, v))

    looked: dict[tuple[type, str], bool] = {}

    def seen(obj, name):
        own = object.__getattribute__(obj, "__dict__")
        if name not in own:
            if name[0] != "_" and id(obj) in paths and _model_code(sys._getframe(2)) \
                    and _class_value(looked, own, object.__getattribute__(obj, "__class__"), name):
                use.unowned.add((paths[id(obj)], name))
            return
        if id(obj) in held:  # an attribute of a config: (module path, "config.name")
            if not name.startswith("_"):
                use.read.add((held[id(obj)][0], f"{held[id(obj)][1]}.{name}"))
        elif state_name(obj, name):
            path = paths.get(id(obj))
            if path is not None:
                use.read.add((path, name))
                first.setdefault((path, name), True)

    first: dict[tuple[str, str], bool] = {}  # (module path, name) -> whether the code read it before any write
    written: dict[tuple[str, str], list] = {}  # (module path, name) -> [value before, fingerprints of values set]

    def wrote(obj, name, value):
        path = paths.get(id(obj))  # a module's attribute, not a config's; not its class (a watch's swap)
        if path is None or use.switching or name[:2] == "__" or not state_name(obj, name):
            return
        first.setdefault((path, name), False)
        entry = written.setdefault((path, name), [object.__getattribute__(obj, "__dict__").get(name, _ABSENT), {}])
        entry[1][fingerprint(value)] = value

    before = {id(v): dict(vars(v)) for _, _, v in held.values()}
    with watch_reads(mods + [v for _, _, v in held.values()], seen, wrote):
        yield use
    _set_while_captured(use, first, written)
    _lazily_set(use, held, before)


_ABSENT = object()


def _set_while_captured(use: StateUse, first: dict, written: dict) -> None:
    """Note the plain attributes of modules the code set while it was captured, from its writes: torch.export puts
    every module attribute back as it was (``_detect_attribute_assignment``), so no change is left to see after it.
    One the code read before setting it (a counter), or set and never read, is a change the program does not
    repeat (``use.changed``), as is one set before reading it to different plain values in the capture's runs. One
    set to one plain value before any read is the model's own setting, made at each call (Swin's ``shift_size`` where
    the resolution is no larger than its window): the program holds that value, which the model's own first call
    sets too (``use.lazy``). One set from the call's sizes before each read (a symbolic size) is computed by the
    program, not taken from the model: not watched."""
    for key, (old, values) in written.items():
        if old is not _ABSENT and set(values) == {fingerprint(old)}:
            continue  # set again to the value it had
        new = list(values.values())[-1]
        plain = all(isinstance(v, _PLAIN) for v in values.values())
        if first[key] or key not in use.read or (plain and len(values) > 1) \
                or any(isinstance(v, torch.Tensor) for v in values.values()):
            use.changed.setdefault(key, (None if old is _ABSENT else old, new))
        elif plain:
            use.lazy[key] = new
            use.changed.pop(key, None)
        else:
            use.read.discard(key)
            use.changed.pop(key, None)


def _lazily_set(use: StateUse, held: dict, before: dict) -> None:
    """Record in ``use.lazy`` each config attribute read that the code set from None (Hugging Face's
    ``config.problem_type``, set at the first call with labels): the graph holds the value set, which the model's
    own first call sets too."""
    objs = {(path, name): v for path, name, v in held.values()}
    for path, name in use.read:
        head, dot, attr = name.rpartition(".")
        obj = objs.get((path, head)) if dot else None
        if obj is not None and attr in before[id(obj)] and before[id(obj)][attr] is None:
            now = vars(obj).get(attr)
            if now is not None and isinstance(now, _PLAIN):
                use.lazy[(path, name)] = now


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, tuple, frozenset, type(None))


def _model_code(frame) -> bool:
    name = frame.f_code.co_filename
    return not name.startswith((_TORCH_DIR, _OWN_DIR))


def _class_value(looked: dict, own: dict, cls: type, name: str) -> bool:
    """Whether a read of ``name``, which a module of class ``cls`` does not hold itself, gives the model's code a
    constant: a plain value of its class (``scale = 1.0`` in the class body), or nothing (``getattr(self, name,
    default)``), not a method, property, parameter, buffer or submodule."""
    if any(name in own.get(t, ()) for t in ("_parameters", "_buffers", "_modules")) or name in _MODULE_OWN:
        return False
    key = (cls, name)
    if key not in looked:
        try:
            looked[key] = isinstance(inspect.getattr_static(cls, name), _PLAIN)
        except AttributeError:
            looked[key] = True
    return looked[key]


def plain_object(v: Any) -> bool:
    """An instance of a class of the model's code or a library's (a config), not a module, tensor, function,
    class or builtin value: its attributes are read as constants too."""
    return hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type, torch.dtype, torch.device)) \
        and not callable(v) and type(v).__module__ not in ("builtins", "functools") \
        and type(type(v)) is type  # not an enum member, nor anything else a metaclass makes


@contextlib.contextmanager
def note_changes(model: nn.Module, use: StateUse | None):
    """Meanwhile (one run of the model's code) note in ``use.changed`` the plain attributes of ``model``'s modules
    that change."""
    if use is None:
        yield
        return
    mods = watchable(model)
    before = _own_state(model, mods)
    yield
    after = _own_state(model, mods)
    for key in before.keys() | after.keys():
        old, new = before.get(key, (None, None)), after.get(key, (None, None))
        if old[1] != new[1]:  # by value: a capture may put an equal tuple back
            use.changed[key] = (old[0], new[0])
