"""Independent checks: what dtypes each aten op really saw, and how many bytes casts moved; and what the CPU running
the suite does fast (``FAST_LOW_DTYPE``, ``small_if_emulated``) or not at all (``cpu_autocast``)."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autocastfx.core import devices
from cpu_class import cpu_flags

CAST_OPS = {"_to_copy", "to", "copy_"}


@dataclasses.dataclass
class OpCall:
    name: str                     # aten op name without namespace/overload, e.g. "convolution"
    overload: str                 # full name, e.g. "aten.convolution.default"
    in_dtypes: list[torch.dtype]  # dtypes of the tensor inputs, in order
    out_dtypes: list[torch.dtype]
    in_shapes: list[tuple]
    out_numel: int
    in_numel: int


class AtenRecorder(TorchDispatchMode):
    """Records every aten op dispatched inside the block (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self.calls.append(OpCall(func._opname, str(func), [t.dtype for t in ins], [t.dtype for t in outs],
                                 [tuple(t.shape) for t in ins], sum(o.numel() for o in outs),
                                 sum(t.numel() for t in ins)))
        return out

    def ops(self, *names: str) -> list[OpCall]:
        return [c for c in self.calls if c.name in names]

    def float_casts(self) -> list[OpCall]:
        """Dtype-changing copies between floating dtypes."""
        res = []
        for c in self.calls:
            if c.name not in CAST_OPS or not c.in_dtypes or not c.out_dtypes:
                continue
            src, dst = c.in_dtypes[0], c.out_dtypes[0]
            if c.name == "copy_" and len(c.in_dtypes) >= 2:
                dst, src = c.in_dtypes[0], c.in_dtypes[1]
            if src != dst and src.is_floating_point and dst.is_floating_point:
                res.append(c)
        return res

    def cast_bytes(self) -> int:
        total = 0
        for c in self.float_casts():
            src, dst = (c.in_dtypes[1], c.in_dtypes[0]) if c.name == "copy_" else (c.in_dtypes[0], c.out_dtypes[0])
            n = c.out_numel if c.name != "copy_" else c.in_numel // 2
            total += n * (src.itemsize + dst.itemsize)
        return total


# ------------------------------------------------------------------------------ what this CPU runs fast

def native_low_dtype() -> torch.dtype | None:
    """The low dtype whose matmuls and convolutions torch runs in oneDNN on this CPU (bfloat16 first): bfloat16 with
    AVX-512 (native with AVX512-BF16 or AMX), float16 with AVX512-FP16 or AMX-FP16. None where both fall back to
    torch's own scalar loops (an AVX2-only CPU: a 512x512 matmul 50x slower than float32, or a CPU whose oneDNN
    ``ONEDNN_MAX_CPU_ISA`` caps below AVX-512)."""
    for dtype in (torch.bfloat16, torch.float16):
        if _fast(dtype):
            return dtype
    return None


# the instruction set oneDNN runs each low dtype's kernels from (emulated below AVX512-BF16, but in oneDNN)
ONEDNN_ISA_NEEDED = {torch.bfloat16: "AVX512_CORE", torch.float16: devices.NATIVE_ISA[torch.float16]}


def _fast(dtype: torch.dtype) -> bool:
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}[dtype]()
    return supported and devices.onednn_allows(ONEDNN_ISA_NEEDED[dtype])


FAST_LOW_DTYPE = native_low_dtype()


def small_if_emulated(n: int, small: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """``n`` (a batch, a length, a width) where ``dtype`` has fast kernels on this CPU, ``small`` where its matmuls
    run in torch's scalar loops: the same check on fewer values. The shapes the suite was sized by stay wherever
    bfloat16 runs in oneDNN (AVX-512, AVX512-BF16, AMX)."""
    return n if _fast(dtype) else small


# ------------------------------------------------------------------------------ what this CPU does not run

# oneDNN's recurrent primitives in a low dtype and the CPU features they need (x86 /proc/cpuinfo flags): bfloat16
# LSTM on avx512_core (emulated there, native with AVX512-BF16), float16 on avx512_core_fp16. torch runs nn.LSTM
# under CPU autocast as oneDNN's primitive, so without them torch.autocast itself fails on an LSTM:
# "could not create a primitive descriptor for the LSTM forward propagation primitive".
ONEDNN_NEEDS = {torch.bfloat16: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                torch.float16: ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_fp16")}
_REFUSED = re.compile(r"could not create a primitive descriptor for the (.+?) (forward|backward) propagation primitive")


def onednn_refusal(error: BaseException, dtype: torch.dtype) -> str | None:
    """Why torch's own kernel cannot run here, where ``error`` is oneDNN refusing a ``dtype`` primitive on a CPU that
    lacks the features it needs, or with oneDNN capped below them (``ONEDNN_MAX_CPU_ISA``): the reason names them;
    None for any other error, and where oneDNN may use them (there the refusal is a failure of its own)."""
    found = _REFUSED.search(str(error))
    if not isinstance(error, RuntimeError) or not found or dtype not in ONEDNN_NEEDS:
        return None
    flags = cpu_flags()
    missing = [f for f in ONEDNN_NEEDS[dtype] if f not in flags]
    isa = ONEDNN_ISA_NEEDED[dtype]
    if missing:
        lacks = f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no {', '.join(missing)}"
    elif not devices.onednn_allows(isa):
        lacks = f"ONEDNN_MAX_CPU_ISA={devices.onednn_cap()} keeps oneDNN below {isa}"
    else:
        return None
    return (f"torch.autocast('cpu', {dtype}) cannot run here: oneDNN's {str(dtype).split('.')[-1]} {found.group(1)} "
            f"primitive needs {', '.join(ONEDNN_NEEDS[dtype])}, and {lacks}")


def cpu_autocast(fn, dtype: torch.dtype):
    """``fn()`` under ``torch.autocast("cpu", dtype)``, the baseline a test compares with. Where torch's own kernel
    does not exist on this CPU (``onednn_refusal``) the test is skipped, with the reason, at the comparison: what the
    test checked before it stands; any other error is raised."""
    try:
        with torch.autocast("cpu", dtype):
            return fn()
    except RuntimeError as e:
        reason = onednn_refusal(e, dtype)
        if reason is None:
            raise
        pytest.skip(reason)


@contextlib.contextmanager
def one_thread_quiet():
    """Toy sizes: one thread is fastest and waits on no other process's cores; warnings (the CPU's slow-bfloat16
    one among them) are expected. Used as an autouse fixture's body."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)


def capture(model, args: tuple, kwargs: dict, policy):
    """(graph module, how) of ``model`` captured as convert() captures it: a copy of the model, in training mode,
    its graph propagated on ``args``/``kwargs``."""
    from autocastfx.capture import trace
    from autocastfx.capture.context import CaptureContext
    return trace.capture_graph(trace.copy_model(model, share_tensors=False).train(), args, kwargs, policy,
                               CaptureContext())


def _one_thread(rank, fn, *args):
    torch.set_num_threads(1)  # the ranks share the cores; no OpenMP team is carried over a fork
    fn(rank, *args)


def run_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from this one, as ``torch.multiprocessing.spawn`` runs it,
    raising what a rank raised. Forked, the ranks start with this process's imports (torch, autocastfx, the test
    module) instead of importing them again: seconds per rank. Each rank runs one thread."""
    import torch.multiprocessing as mp
    mp.start_processes(_one_thread, args=(fn, *args), nprocs=nprocs, join=True, start_method="fork")
