"""What the model's code reads while it is captured: modules' ``training`` flags, attributes of blocks."""
from __future__ import annotations
import contextlib
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


@contextlib.contextmanager
def watch_reads(callback):
    """Meanwhile ``callback(module, name)`` is called for every attribute read of every module. The first watcher
    puts a ``__getattribute__`` on ``nn.Module`` that calls the callbacks it holds (on the function itself, no
    module state); each watcher adds its callback there and takes it out when it ends, in any order (watchers in
    two threads may end in either order), and the last one out gives ``nn.Module`` its own lookup back."""
    installed = nn.Module.__dict__.get("__getattribute__")
    if installed is None or not hasattr(installed, "watchers"):
        watchers: list = []

        def getattribute(self, name):
            for w in watchers:
                w(self, name)
            return object.__getattribute__(self, name)

        getattribute.watchers = watchers
        nn.Module.__getattribute__ = installed = getattribute
    installed.watchers.append(callback)
    try:
        yield
    finally:
        installed.watchers.remove(callback)
        if not installed.watchers and nn.Module.__dict__.get("__getattribute__") is installed:
            del nn.Module.__getattribute__


def _outer_units(model: nn.Module) -> dict[str, nn.Module]:
    """The converted blocks inside ``model`` (not the model itself), outermost only, by qualified name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if n and is_converted(m) and not any(n.startswith(o + ".") for o in out):
            out[n] = m
    return out
