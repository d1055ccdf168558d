"""Warnings and logs: torch's own internal warnings set off by the way autocastfx drives it are hidden for the
call that sets them off, and autocastfx's warnings point at the user's line (:func:`warn_user`)."""
from __future__ import annotations
import contextlib
import copy
import os
import re
import sys
import logging
import threading
import warnings


# torch's warnings about its own code, set off by the way autocastfx drives it: by category and message, so that
# every other warning (the model's, autocastfx's own, torch's about the model) still reaches the caller
_TORCH_INTERNAL_WARNINGS = (
    # torch.export.unflatten writes get_attr nodes before it sets the attributes they read (one per submodule)
    (UserWarning, "Attempted to insert a get_attr Node with no underlying reference in the owning GraphModule"),
    # copy.deepcopy of a pytree spec (a graph's code generator, an export's call signatures) makes each leaf
    # anew through the class torch marks deprecated
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # nn.LSTM/GRU/RNN refresh their own _flat_weights list as they run; torch.export notes it and restores it
    (UserWarning, r"The tensor attributes? (self\.[\w.]*_flat_weights\[\d+\](, )?)+ (was|were) assigned during export"),
    # convert()'s run of a model between its blocks under autocast, where a float32 op meets a low block output
    (Warning, r".*[Mm]ismatch dtype.*"),
    # a capturable optimizer stepped outside a CUDA graph: the graphed step's warm-up does that on purpose
    (Warning, r".*capturable=True.*"),
)


# Warning filters and logger levels are process-wide, and warnings.catch_warnings is not thread-safe (CPython's
# documentation), so under one lock the first caller in installs them and the last one out removes them.
_LOCK = threading.Lock()
_ACTIVE: dict[str, list] = {"warnings": [], "logs": [], "onnx": []}  # per kind: [depth, what was installed]
_QUIET_LOGGERS = {"torch.fx.experimental.symbolic_shapes": logging.ERROR, "torch._export": logging.ERROR,
                  "torch.export": logging.ERROR, "torch._dynamo": logging.ERROR,
                  # fake tensors log a traceback for each op that raises: the raised error is enough
                  "torch._subclasses.fake_tensor": logging.CRITICAL}


def _install_warnings() -> list:
    # inserted as entries of their own (filterwarnings would first remove the caller's equal filter, for good)
    ours = [("ignore", re.compile(message, re.I), category, None, 0) for category, message in _TORCH_INTERNAL_WARNINGS]
    warnings.filters[:0] = ours
    _filters_changed()
    return ours


def _remove_warnings(ours: list) -> None:
    warnings.filters[:] = [f for f in warnings.filters if not any(f is o for o in ours)]
    _filters_changed()


def _filters_changed() -> None:
    """Invalidate the per-module caches of what was shown, as filterwarnings does."""
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()
    else:  # pragma: no cover - Pythons without the helper
        warnings.filterwarnings("ignore", message="\0", append=True)
        warnings.filters.pop()


def _install_logs(quiet: dict | None = None) -> list:
    saved = []
    for name, level in (quiet or _QUIET_LOGGERS).items():
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, level))
        logger.setLevel(level)
    return saved


def _remove_logs(saved: list) -> None:
    for logger, level, ours in saved:
        if logger.level == ours:  # a level set meanwhile (another thread's) stays
            logger.setLevel(level)


_INSTALL = {"warnings": (_install_warnings, _remove_warnings), "logs": (_install_logs, _remove_logs),
            "onnx": (lambda: _install_logs({"torch.onnx": logging.ERROR}), _remove_logs)}


@contextlib.contextmanager
def _shared(kind: str):
    install, remove = _INSTALL[kind]
    with _LOCK:
        active = _ACTIVE[kind]
        if not active:
            active[:] = [0, install()]
        active[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            active[0] -= 1
            if active[0] == 0:
                remove(active[1])
                active.clear()


def torch_internal_warnings_off():
    """Meanwhile, torch's warnings about its own internals (``_TORCH_INTERNAL_WARNINGS``) are not shown; every
    other warning still is."""
    return _shared("warnings")


def deepcopy_quietly(obj, memo=None):
    """``copy.deepcopy(obj, memo)``, where copying a graph's pytree specs (torch.export's code generator) would
    warn that torch's own leaf class is deprecated."""
    with torch_internal_warnings_off():
        return copy.deepcopy(obj, memo)


def quiet_torch_logs():
    """Meanwhile, torch.export's, dynamo's and fake tensors' loggers show only errors."""
    return _shared("logs")


def quiet_onnx_logs():
    """Meanwhile, torch.onnx's logger shows only errors."""
    return _shared("onnx")


_OWN = threading.local()


@contextlib.contextmanager
def own_warnings_off():
    """Meanwhile, in this thread only, :func:`warn_user` says nothing (a conversion repeating what the first one
    said); every other warning, in every thread, is shown."""
    _OWN.depth = getattr(_OWN, "depth", 0) + 1
    try:
        yield
    finally:
        _OWN.depth -= 1


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside autocastfx, however deep the warning is found (nothing
    inside :func:`own_warnings_off`)."""
    if getattr(_OWN, "depth", 0):
        return
    level, frame = 2, sys._getframe(1)  # stacklevel 1 is this function, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
