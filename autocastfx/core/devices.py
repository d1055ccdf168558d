"""Which low dtype pays on which device: ``convert(dtype="auto")``.

CUDA GPUs run float16 and bfloat16 on tensor cores (float16 by default: the seed documents' recipe, with loss
scaling). On a CPU only the dtypes its instruction set computes natively are fast: bfloat16 with AVX512-BF16 or
AMX-BF16, float16 with AVX512-FP16 or AMX-FP16. Elsewhere the kernels convert element by element and run far
slower than float32: on a 2-core AVX512-BF16 machine without float16 hardware, a 512x512 matmul ran 17.9
GFLOP/s in float32, 34.8 in bfloat16 and 2.7 in float16, and 2048x2048 ones under 1 GFLOP/s in float16 against
98 in float32 (docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import torch
from ..base.quiet import warn_user


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


def native_on_cpu(dtype: torch.dtype) -> bool | None:
    """Whether this CPU computes ``dtype`` natively (None: its flags cannot be read)."""
    flags = cpu_features()
    if not flags:
        return None
    want = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}[dtype]
    return any(f in flags for f in want)


def choose(device: torch.device) -> tuple[torch.dtype, str]:
    """``dtype="auto"``: the low dtype for ``device`` and why."""
    if device.type == "cuda":
        return torch.float16, "float16 on CUDA: tensor cores, the widest support (loss-scaled)"
    if device.type == "cpu":
        bf16 = native_on_cpu(torch.bfloat16)
        if bf16:
            return torch.bfloat16, "bfloat16 on this CPU: native (AVX512-BF16/AMX), about 2x float32's matmul speed"
        if native_on_cpu(torch.float16):
            return torch.float16, "float16 on this CPU: native (AVX512-FP16/AMX-FP16)"
        return torch.bfloat16, ("bfloat16 on this CPU: no native low-precision matmul here, and bfloat16's "
                                "converted kernels are the faster of the two; float32 may be faster still")
    return torch.bfloat16, f"bfloat16 on {device.type}"


def slow_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """What to say when ``dtype`` has no fast kernels on ``device``, else None."""
    if device.type != "cpu" or native_on_cpu(dtype) is not False:
        return None
    name = str(dtype).removeprefix("torch.")
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    better = "; bfloat16 is native here" if native_on_cpu(other) and other == torch.bfloat16 else ""
    return (f"{name} has no fast kernels on this CPU (no native {name} instructions): its matmuls and "
            f"convolutions run several to hundreds of times slower than float32's (a 2048x2048 matmul: under 1 "
            f"GFLOP/s against 98 on a 2-core AVX512 machine){better}. convert(dtype='auto') picks the dtype that "
            "pays on the model's device")


def resolve(dtype, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(the low dtype to convert to, what the report says of the choice). ``None`` is float16, the default;
    ``"auto"`` chooses by device; an explicit dtype with no fast kernels on the device is warned about."""
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or 'auto', got {dtype!r}")
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
