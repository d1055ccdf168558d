"""Which kind of CPU runs the suite, from what it says of itself (``/proc/cpuinfo``): the standard library only, so
``tests/parallel.py`` reads it without importing torch.

The suite's time depends on two things of the CPU. torch's vector kernels are built for a capability (AVX2, AVX-512;
``ATEN_CPU_CAPABILITY`` lowers it), and the low dtypes' matmuls and convolutions either run in oneDNN on native
instructions (AVX512-BF16 or AMX for bfloat16) or, without AVX-512, in torch's own scalar loops: a 512x512 bfloat16
matmul runs about 50x slower than float32 on an AVX2-only CPU, and about as fast as float32 with AVX512-BF16. The
class names both: ``avx2``, ``avx512``, ``avx512_bf16``, ``avx512_amx`` (and ``avx2_bf16`` and the like where the
capability was lowered on a bfloat16 CPU; ``default`` below AVX2; the machine's name off x86). oneDNN's cap
``ONEDNN_MAX_CPU_ISA`` lowers the bfloat16 part as it lowers oneDNN: ``ATEN_CPU_CAPABILITY=avx2`` with
``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX machine is class ``avx2``, the machine it stands in for.
"""
from __future__ import annotations

import os
import platform

# The order of speed, slowest first: a class with no record of its own borrows the nearest one's.
ORDER = ("default", "avx2", "avx512")
BF16 = ("", "_bf16", "_amx")
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # torch's AVX512 capability, oneDNN's avx512_core
X86 = ("x86_64", "amd64", "i386", "i686")
# oneDNN's instruction sets in order, as ONEDNN_MAX_CPU_ISA names them (autocastfx.core.devices.ONEDNN_ISAS, less
# the newest): bfloat16 is native from AVX512_CORE_BF16 on, AMX from AVX10_1_512_AMX (AVX512_CORE_AMX) on
ONEDNN_ORDER = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX")


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), empty where the file is not there."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def capability(flags: frozenset[str], forced: str | None = None) -> str:
    """torch's CPU capability on x86 as ``torch.backends.cpu.get_cpu_capability()`` names it, lower case, from the
    flags; ``ATEN_CPU_CAPABILITY`` (``forced``) can only lower it, as in torch."""
    if set(AVX512_CORE) <= flags and "fma" in flags:
        found = "avx512"
    elif {"avx2", "fma"} <= flags:
        found = "avx2"
    else:
        found = "default"
    forced = (forced or "").lower()
    if forced in ORDER and ORDER.index(forced) < ORDER.index(found):
        return forced
    return found


def bf16_kind(flags: frozenset[str], onednn: str | None = None) -> str:
    """``_amx``, ``_bf16`` (AVX512-BF16) or ``""``: whether bfloat16 has native instructions that oneDNN may use
    (``onednn``: the value of ``ONEDNN_MAX_CPU_ISA``, or of its older name ``DNNL_MAX_CPU_ISA``, read from the
    environment where None)."""
    if onednn is None:
        onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    cap = onednn.strip().upper()
    cap = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX"}.get(cap, cap)
    allowed = ONEDNN_ORDER.index(cap) if cap in ONEDNN_ORDER else len(ONEDNN_ORDER)
    if "amx_bf16" in flags and allowed >= ONEDNN_ORDER.index("AVX10_1_512_AMX"):
        return "_amx"
    return "_bf16" if "avx512_bf16" in flags and allowed >= ONEDNN_ORDER.index("AVX512_CORE_BF16") else ""


def cpu_class(flags: frozenset[str] | None = None, machine: str | None = None, forced: str | None = None,
              onednn: str | None = None) -> str:
    """This CPU's class (the module's docstring), or the one ``flags``, ``machine``, ``forced`` (the value of
    ``ATEN_CPU_CAPABILITY``) and ``onednn`` (of ``ONEDNN_MAX_CPU_ISA``) describe."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    forced = os.environ.get("ATEN_CPU_CAPABILITY") if forced is None else forced
    if machine not in X86:
        return machine + ("_bf16" if "bf16" in flags else "")
    return capability(flags, forced) + bf16_kind(flags, onednn)


def rank(cls: str) -> int | None:
    """A class's place in the order of speed (capability first, then bfloat16), None off x86."""
    for i, cap in enumerate(ORDER):
        for j, kind in enumerate(BF16):
            if cls == cap + kind:
                return i * len(BF16) + j
    return None


def nearest(cls: str, known: list[str]) -> str | None:
    """Of the ``known`` classes, the one nearest to ``cls``: itself, else the nearest in the order of speed (the
    slower of two as near), else any of them (off x86)."""
    if cls in known:
        return cls
    if not known:
        return None
    mine = rank(cls)
    ranked = [(abs(rank(k) - mine), rank(k), k) for k in known if mine is not None and rank(k) is not None]
    if ranked:
        return min(ranked)[2]
    return sorted(known)[0]
