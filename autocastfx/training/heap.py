"""``autocastfx.keep_cpu_memory()``: glibc told to keep freed memory for the next step, an explicit, process-wide
deployment setting that nothing in autocastfx makes by itself.

A training step on the CPU allocates and frees the same few hundred megabytes every step (activations, the
gradients of both precisions). glibc's malloc gives a free block at the top of its heap back to the system once it
exceeds its trim threshold, and serves every allocation above its mmap threshold (32 MiB at most) with fresh pages:
the next step faults each of those pages in again, zeroed by the kernel: thousands of page faults a step, for
torch.autocast and autocastfx alike (docs/benchmarks.md has the measurements). The CUDA caching allocator keeps freed blocks for this reason, and PyTorch's CPU
launcher (``python -m torch.backends.xeon.run_cpu``) preloads jemalloc or tcmalloc for it.

:func:`keep_freed_memory` does the same in-process: ``mallopt(M_TRIM_THRESHOLD)`` and ``mallopt(M_MMAP_THRESHOLD)``
raised, so freed memory stays in the heap and the next step reuses it without a fault. It is process-wide (glibc has
one setting), so it is done once, and only where it means something: glibc is the allocator (no jemalloc, tcmalloc
or mimalloc preloaded) and the user set none of ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TOP_PAD_`` or a ``glibc.malloc.*`` tunable in ``GLIBC_TUNABLES`` (their choice stands). glibc before
2.33 or so takes an mmap threshold of 32 MiB at most: that is used there. The same effect without any code:
``MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_MMAP_THRESHOLD_=1073741824 python train.py`` (or preload jemalloc or
tcmalloc, as ``torch.backends.xeon.run_cpu`` does).

What it costs: the process's resident memory stays at its peak instead of shrinking between steps (nothing is
allocated that was not already used; a later step reuses it), in processes forked after it too (DataLoader
workers), and it cannot be undone. Threads other than the main one allocate from arenas of at most 64 MiB, whose
larger blocks are still mapped afresh. The training step's docstring says which state the process is in.
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
