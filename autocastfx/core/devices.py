"""Which dtype pays on which device (``convert(dtype="auto")``): float16 on CUDA; on a CPU, a low dtype only where
its instructions are native (read from the CPU flags and ``ONEDNN_MAX_CPU_ISA``, else timed), else float32.
"""
from __future__ import annotations

import functools
import os
import time

import torch
from ..base.quiet import warn_user

# the flags that make a low dtype native on a CPU (Linux's names)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
ACCEPTED = ("torch.float16 or torch.bfloat16 (None: float16, the default) or 'auto' (the dtype that pays on the "
            "model's device, float32 compute where no low dtype does)")
# oneDNN's instruction sets, lowest first, as ONEDNN_MAX_CPU_ISA names them, and the one that holds each low dtype's
# native instructions: a cap below it leaves the dtype emulated whatever the flags say
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
               "AVX10_2_512_AMX_2")
ONEDNN_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                  "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
NATIVE_ISA = {torch.bfloat16: "AVX512_CORE_BF16", torch.float16: "AVX10_1_512"}
PROBE_SIZE = 256   # the probe's square matmul: big enough for the kernels to show, quick when emulated
PROBE_GAIN = 1.25  # a low dtype measured at least this much faster than float32 is chosen


class SlowDtypeWarning(UserWarning):
    """The low dtype asked for has no fast kernels on the model's device."""


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows, else ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown"


def _onednn_variable() -> str:
    return "ONEDNN_MAX_CPU_ISA" if os.environ.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"


def onednn_cap() -> str | None:
    """The instruction set ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) caps oneDNN at; None where unset or set to
    a name oneDNN ignores (``ALL``, ``DEFAULT``, unknown)."""
    name = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    name = ONEDNN_ALIASES.get(name, name)
    return name if name in ONEDNN_ISAS else None


def onednn_allows(isa: str) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` lets oneDNN use instruction set ``isa`` (one of ``ONEDNN_ISAS``)."""
    cap = onednn_cap()
    return cap is None or ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


def cpu_summary() -> str:
    """One line naming this CPU: model, torch capability, ``SHOWN_FLAGS`` present, low dtypes native or emulated."""
    flags = cpu_features()
    if flags:
        have = [f for f in SHOWN_FLAGS if f in flags]
        shown = f"flags {' '.join(have) or 'none of ' + ' '.join(SHOWN_FLAGS)}"
    else:
        shown = "flags unreadable"
    kinds = []
    for dtype in NATIVE_FLAGS:
        native = native_on_cpu(dtype)
        kinds.append(f"{_name(dtype)} {'unknown' if native is None else 'native' if native else 'emulated'}")
    cap = f"; oneDNN capped at {onednn_cap()} ({_onednn_variable()})" if onednn_cap() else ""
    return (f"CPU: {cpu_model()}; torch capability {torch.backends.cpu.get_cpu_capability()}; {shown}{cap}; "
            f"{', '.join(kinds)}")


def native_on_cpu(dtype: torch.dtype) -> bool | None:
    """Whether this CPU has ``dtype``'s native instructions and oneDNN may use them (None: flags unreadable)."""
    flags = cpu_features()
    if not flags:
        return None
    return any(f in flags for f in NATIVE_FLAGS[dtype]) and onednn_allows(NATIVE_ISA[dtype])


@functools.lru_cache(maxsize=1)
def measured_rates() -> dict[torch.dtype, float]:
    """GFLOP/s of a ``PROBE_SIZE`` square matmul in float32, bfloat16 and float16 (best of three), once per process."""
    n = PROBE_SIZE
    gen = torch.Generator().manual_seed(0)  # the caller's random state is left alone
    rates = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        torch.mm(a, b)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        rates[dtype] = 2 * n ** 3 / max(best, 1e-9) / 1e9
    return rates


def choose(device: torch.device) -> tuple[torch.dtype, str]:
    """``dtype="auto"``: the compute dtype for ``device`` (a low one, or float32 where none pays) and why."""
    if device.type == "cuda":
        return torch.float16, "float16 on CUDA: tensor cores, the widest support (loss-scaled)"
    if device.type != "cpu":
        return torch.bfloat16, f"bfloat16 on {device.type}"
    if not cpu_features():
        return _choose_by_probe()
    if native_on_cpu(torch.bfloat16):
        return torch.bfloat16, "bfloat16 on this CPU: native (AVX512-BF16/AMX), about 2x float32's matmul speed"
    if native_on_cpu(torch.float16):
        return torch.float16, "float16 on this CPU: native (AVX512-FP16/AMX-FP16)"
    have = "AVX-512 without BF16/FP16" if "avx512f" in cpu_features() else (
        "AVX2 without AVX-512" if "avx2" in cpu_features() else "no AVX2")
    why = f"{have}, no native bfloat16 (avx512_bf16, amx_bf16) nor float16 (avx512_fp16, amx_fp16) instructions"
    if any(f in cpu_features() for names in NATIVE_FLAGS.values() for f in names):
        why = (f"{_onednn_variable()}={onednn_cap()} keeps oneDNN off its native bfloat16/float16 instructions "
               f"(which need {NATIVE_ISA[torch.bfloat16]}/{NATIVE_ISA[torch.float16]}; unset it, or set it to "
               "one of those or higher, to use them)")
    return torch.float32, (
        f"float32 on this CPU: {why}, so bfloat16 and float16 matmuls and convolutions run emulated, tens of times "
        "slower than float32 (a 512x512 matmul on a 2-core AVX2 machine: 69 GFLOP/s in float32, about 1.3 in "
        "bfloat16 and float16); no casts, parameters kept float32, no padding")


def _choose_by_probe() -> tuple[torch.dtype, str]:
    """``choose`` on a CPU whose flags cannot be read: the fastest dtype of ``measured_rates``."""
    rates = measured_rates()
    low = max((torch.bfloat16, torch.float16), key=lambda d: rates[d])
    told = ", ".join(f"{_name(d)} {r:.1f}" for d, r in rates.items())
    measured = f"its flags cannot be read; a {PROBE_SIZE}x{PROBE_SIZE} matmul measured GFLOP/s: {told}"
    if rates[low] >= PROBE_GAIN * rates[torch.float32]:
        return low, f"{_name(low)} on this CPU: {measured}"
    return torch.float32, (f"float32 on this CPU: {measured}; no low dtype is faster, so no casts, parameters "
                           "kept float32, no padding")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slow_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """What to say when ``dtype`` has no fast kernels on ``device``, else None."""
    if device.type != "cpu" or native_on_cpu(dtype) is not False:
        return None
    name = _name(dtype)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    better = "; bfloat16 is native here" if native_on_cpu(other) and other == torch.bfloat16 else ""
    return (f"{name} has no fast kernels on this CPU (no native {name} instructions): its matmuls and "
            f"convolutions run several to hundreds of times slower than float32's (a 2048x2048 matmul: under 1 "
            f"GFLOP/s against 98 on a 2-core AVX512 machine){better}. convert(dtype='auto') picks the dtype that "
            "pays on the model's device")


def resolve(dtype, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(the dtype to convert to, what the report says of it). ``None`` is float16; ``"auto"`` chooses by device;
    an explicit dtype with no fast kernels on the device is warned about."""
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ValueError(f"dtype must be {ACCEPTED}, got {dtype!r}")
        chosen, why = choose(device)
        return chosen, f"auto: {why}"
    if dtype is None:
        note = slow_note(torch.float16, device)
        return torch.float16, (f"float16, the default; {note}" if note else None)
    if dtype not in (torch.float16, torch.bfloat16):
        return dtype, None  # refused by convert() with the dtypes it takes
    note = slow_note(dtype, device)
    if note:
        warn_user(f"autocastfx: {note}", SlowDtypeWarning)
    return dtype, note
