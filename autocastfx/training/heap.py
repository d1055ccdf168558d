"""``autocastfx.keep_cpu_memory()``: glibc told to keep freed memory for the next step, an explicit, process-wide
setting that nothing in autocastfx makes by itself.

A CPU training step allocates and frees the same large buffers every step. glibc's malloc gives the free top of its
heap back to the system past its trim threshold and maps allocations above its mmap threshold afresh, so the next
step faults those pages in again (docs/benchmarks.md). The CUDA caching allocator keeps freed blocks for this reason,
and PyTorch's CPU launcher (``torch.backends.xeon.run_cpu``) preloads jemalloc or tcmalloc for it.

:func:`keep_freed_memory` raises both thresholds with ``mallopt``, once, and only where glibc is the allocator (no
jemalloc, tcmalloc or mimalloc preloaded) and the user set none of ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a ``glibc.malloc.*`` tunable in ``GLIBC_TUNABLES`` (their choice
stands). The same without code: ``MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_MMAP_THRESHOLD_=1073741824 python ...``.

Cost: resident memory stays at its peak instead of shrinking between steps (nothing new is allocated), in processes
forked after it too (DataLoader workers), and it cannot be undone. Threads other than the main one allocate from
arenas of at most 64 MiB, whose larger blocks are still mapped afresh.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2 ** 31 - 1  # mallopt takes a C int: the heap's free top is trimmed only once it passes 2 GiB
# an allocation over the mmap threshold gets pages of its own, given back when freed. glibc before 2.33 or so refuses
# a threshold over 32 MiB (HEAP_MAX_SIZE / 2 on 64 bits): the second value is what it takes there
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
        # the mmap threshold first: setting either one ends glibc's own moving of both, and a trim threshold alone
        # would leave every block over 128 KiB mapped afresh
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
    """The state in words, for the step's docstring and the docs."""
    if _state["kept"]:
        return (f"freed CPU memory kept for the next step (glibc's trim threshold raised, mmap threshold "
                f"{_state['mmap'] // 2 ** 20} MiB)")
    return f"CPU memory left to the allocator ({_state['why'] or 'autocastfx.keep_cpu_memory() not called'})"


def keep_cpu_memory() -> bool:
    """Tell glibc, once for this process, to keep freed memory for the next training step instead of handing it
    back to the system (see the module docstring: process-wide, irreversible, inherited by forked workers).

    Returns:
        True if freed memory is kept now; False where it is not (another allocator is preloaded, the environment
        sets glibc's malloc options, or the C library is not glibc): ``status()`` says why.
    """
    return keep_freed_memory()


__all__ = ["keep_cpu_memory", "keep_freed_memory", "kept", "why_not", "status"]
