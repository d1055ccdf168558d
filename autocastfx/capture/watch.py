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
    """Meanwhile ``callback(module, name)`` is called for every attribute read of every module. Watchers nest:
    each one's ``__getattribute__`` calls its callback, then the one it was put in front of; the last one
    out gives ``nn.Module`` back its own attribute lookup."""
    before = nn.Module.__dict__.get("__getattribute__")
    read = before if before is not None else object.__getattribute__

    def getattribute(self, name):
        callback(self, name)
        return read(self, name)

    nn.Module.__getattribute__ = getattribute
    try:
        yield
    finally:
        if before is None:
            del nn.Module.__getattribute__
        else:
            nn.Module.__getattribute__ = before


def _outer_units(model: nn.Module) -> dict[str, nn.Module]:
    """The converted blocks inside ``model`` (not the model itself), outermost only, by qualified name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if n and is_converted(m) and not any(n.startswith(o + ".") for o in out):
            out[n] = m
    return out
