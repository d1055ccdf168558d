"""Warnings and logs: torch's own internal warnings set off by the way autocastfx drives it are hidden for the
call that sets them off, and autocastfx's warnings point at the user's line (:func:`warn_user`)."""
from __future__ import annotations
import contextlib
import os
import sys
import logging
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
)


@contextlib.contextmanager
def torch_internal_warnings_off():
    """Meanwhile, torch's warnings about its own internals (``_TORCH_INTERNAL_WARNINGS``) are not shown."""
    with warnings.catch_warnings():
        for category, message in _TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


@contextlib.contextmanager
def quiet_torch_logs():
    """Meanwhile, torch.export's and fake tensors' loggers speak only of errors (a failing capture logs a traceback
    per op that raises; the raised error says it all). Nothing else of the process is touched."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch._export",
                                               "torch.export", "torch._dynamo", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # fake tensors log a traceback for each op that raises: the raised error is enough
        lg.setLevel(logging.CRITICAL if lg.name == "torch._subclasses.fake_tensor" else logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


@contextlib.contextmanager
def quiet_logger(name: str):
    """FakeTensorMode logs a traceback for every op that raises; the caller reports failures itself."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside autocastfx: the user's line that called it, however
    deep in the conversion the warning is found."""
    level, frame = 2, sys._getframe(1)  # stacklevel 1 is this function, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
