"""``autocastfx.keep_cpu_memory()``: glibc's malloc told (with ``mallopt``, once, process-wide) to keep freed memory
for the next CPU training step instead of faulting the same pages in again; nothing in autocastfx calls it by itself.
It stands aside where another allocator is preloaded or the user set glibc's malloc options.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2 ** 31 - 1  # the largest C int, which mallopt takes
# older glibc refuses an mmap threshold over HEAP_MAX_SIZE / 2: the second value is what it takes there
MMAP_BYTES = (2 ** 30, 32 * 2 ** 20)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_state: dict[str, object] = {"kept": False, "why": None, "mmap": None}


def _libc():
    if not sys.platform.startswith("linux"):
        return None, "not Linux: the platform's allocator is left as it is"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own: musl and bionic have none
    except (OSError, AttributeError):
        return None, "the C library is not glibc"
    return libc, None


def _preloaded_allocator() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in _OTHER_ALLOCATORS if f"lib{name}" in maps), None)


def why_not() -> str | None:
    """Why :func:`keep_freed_memory` would leave the allocator alone in this process, or None if it would not."""
    libc, why = _libc()
    if libc is None:
        return why
    other = _preloaded_allocator()
    if other:
        return f"{other} is the allocator (it keeps freed memory itself)"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("glibc.malloc tunables in GLIBC_TUNABLES")
    if user:
        return f"the environment sets {', '.join(user)}: the user's allocator settings stand"
    return None


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory for reuse (once per process). True if it is kept now, by this call or an
    earlier one; False where :func:`why_not` says why not (:func:`status` tells it later)."""
    if _state["kept"]:
        return True
    why = why_not()
    if why is None:
        libc, _ = _libc()
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        # both thresholds: setting either ends glibc's own moving of both, and the default mmap threshold would leave
        # large blocks mapped afresh
        mmap = next((v for v in MMAP_BYTES if mallopt(M_MMAP_THRESHOLD, v) == 1), None)
        if mmap is not None and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1:
            _state["kept"], _state["mmap"] = True, mmap
        else:
            why = "glibc refused mallopt"
    _state["why"] = why
    return bool(_state["kept"])


def kept() -> bool:
    """Whether this process's glibc keeps freed memory, as asked by :func:`keep_freed_memory`."""
    return bool(_state["kept"])


def status() -> str:
    """The state in words, for the first line of ``step.code``."""
    if _state["kept"]:
        return (f"freed CPU memory kept for the next step (glibc's trim threshold raised, mmap threshold "
                f"{_state['mmap'] // 2 ** 20} MiB)")
    return f"CPU memory left to the allocator ({_state['why'] or 'autocastfx.keep_cpu_memory() not called'})"


def keep_cpu_memory() -> bool:
    """Tell glibc to keep freed memory for the next training step instead of handing it back to the system:
    process-wide, irreversible, inherited by forked workers, and resident memory stays at its peak.

    Returns:
        True if freed memory is kept now; False where it is not (``status()`` says why).
    """
    return keep_freed_memory()


__all__ = ["keep_cpu_memory", "keep_freed_memory", "kept", "why_not", "status"]
