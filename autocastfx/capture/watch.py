"""What the model's code reads while it is captured: modules' ``training`` flags, attributes of blocks."""
from __future__ import annotations
import contextlib
import threading
import torch.nn as nn
from ..base.meta import is_converted


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


_LOCK = threading.Lock()


@contextlib.contextmanager
def watch_reads(callback):
    """Meanwhile ``callback(module, name)`` is called for every attribute read of a module made by this thread.

    The first watcher puts a ``__getattribute__`` on ``nn.Module`` that calls the callbacks of the reading thread
    only (each watcher is keyed by the thread that started it, so another thread's reads are neither recorded nor
    changed); the last one out, in any order and from any thread, gives ``nn.Module`` its own lookup back. The
    install and removal hold a lock. Every thread's module attribute reads pay one Python call meanwhile."""
    me = threading.get_ident()
    with _LOCK:
        installed = nn.Module.__dict__.get("__getattribute__")
        if installed is None or not hasattr(installed, "watchers"):
            watchers: dict[int, list] = {}

            def getattribute(self, name):
                mine = watchers.get(threading.get_ident())
                if mine:
                    for w in mine:
                        w(self, name)
                return object.__getattribute__(self, name)

            getattribute.watchers = watchers
            nn.Module.__getattribute__ = installed = getattribute
        installed.watchers.setdefault(me, []).append(callback)
    try:
        yield
    finally:
        with _LOCK:
            mine = installed.watchers.get(me, [])
            mine.remove(callback)
            if not mine:
                installed.watchers.pop(me, None)
            if not installed.watchers and nn.Module.__dict__.get("__getattribute__") is installed:
                del nn.Module.__getattribute__


def outer_units(model: nn.Module) -> dict[str, nn.Module]:
    """The converted blocks inside ``model`` (not the model itself), outermost only, by qualified name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if n and is_converted(m) and not any(n.startswith(o + ".") for o in out):
            out[n] = m
    return out
