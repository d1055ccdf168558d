"""The padding gate: whether padding a convolution's or linear's dims makes cuDNN or cuBLAS run a faster kernel,
judged by ``RULES`` (data with its evidence). ``gate="trial"`` instead times each candidate padding on the CUDA device,
keeping only the grouped and growth-cap rules.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable

import torch
import torch.fx
from ..base import keys as K


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A target GPU: dense FP16/BF16 tensor-core peak and DRAM bandwidth, and where the numbers come from."""
    name: str
    tflops: float
    dram_gbps: float
    source: str

    @property
    def balance(self) -> float:
        """FLOPs per byte at the roofline's ridge point."""
        return 1000.0 * self.tflops / self.dram_gbps


# by compute capability; the newest entry not above the device's capability is its profile
HARDWARE: dict[tuple[int, int], Hardware] = {
    (7, 0): Hardware("V100 (sm_70)", 125.0, 900.0, "NVIDIA V100 datasheet: 125 TFLOPS tensor, 900 GB/s HBM2"),
    (8, 0): Hardware("A100 (sm_80)", 312.0, 2039.0, "NVIDIA A100 datasheet: 312 TFLOPS dense FP16, 2039 GB/s"),
    (8, 6): Hardware("A10 (sm_86)", 125.0, 600.0, "NVIDIA A10 datasheet: 125 TFLOPS dense FP16, 600 GB/s"),
    (8, 9): Hardware("L4 (sm_89)", 121.0, 300.0, "NVIDIA L4 datasheet: 121 TFLOPS dense FP16, 300 GB/s"),
    (9, 0): Hardware("H100 SXM (sm_90)", 989.4, 3350.0, "NVIDIA H100 datasheet: 989 TFLOPS dense FP16, 3.35 TB/s"),
    (10, 0): Hardware("B200 (sm_100)", 2250.0, 8000.0, "NVIDIA B200 datasheet: 2.25 PFLOPS dense FP16, 8 TB/s"),
}
DEFAULT_CAPABILITY = (9, 0)  # a model converted on the CPU is judged for an H100, where the evidence was measured

# Tensor-core efficiency of a compute-bound FP16/BF16 GEMM or convolution whose channel/feature dims are all
# divisible by this many elements (and no higher power of two up to 8), relative to 16-byte alignment.
ALIGN_EFFICIENCY: dict[int, float] = {8: 1.0, 4: 0.75, 2: 0.5, 1: 0.2}
ALIGN_EVIDENCE = {
    8: "16-byte alignment: NVIDIA's GEMM and convolution guides ask for multiples of 8 FP16 elements",
    1: ("measured (H100, torch 2.11, GPT-2 124M b8x1024): autocast's vocab-50257 GEMMs run on align1 cutlass "
        "kernels for ~16 ms of a 73.5 ms step; padded to 50264 they vanish (1.9 TFLOP per step, ~3 ms aligned)"),
    4: "estimate between the measured ends (cuBLAS/CUTLASS pick kernels by the largest power of two dividing "
       "the leading dims); gate='trial' measures it",
    2: "estimate, as for 4",
}
MARGIN = 1.1  # pad only when modeled (or timed) at least this much faster: inductor's pad_mm asks the same 1.1x
COMPUTE_BOUND = 0.5  # compute-bound above this share of the machine balance: inductor's is_mm_compute_bound


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    says: str
    evidence: str


RULES: tuple[Rule, ...] = (
    Rule("grouped", "grouped and depthwise convolutions keep their groups",
         "padding channels per group would change the grouping; depthwise convolutions are memory-bound "
         "(shared/prior-art/anchors-padding-style.md 1.4)"),
    Rule("thin_input_nchw", "a convolution with fewer than 8 input channels keeps them in NCHW",
         "measured (H100, torch 2.11, ResNet-50 b128 FP16): the stem padded 3 -> 8 makes cuDNN pick "
         "implicit_convolve_sgemm, 3.7 ms per step against ~1 ms unpadded; the step is 51.2 ms padded, 47.8 "
         "ms with pad_multiple=1 (autocast 48.6)"),
    Rule("thin_input_nhwc", "in channels_last, fewer than 4 input channels pad to 4, 5 to 7 pad to 8",
         "NVIDIA Convolutional Layers User's Guide, quick-start checklist: for a first layer on 3-channel "
         "images 'padding to 4 channels is sufficient if a stride of 2 is used'; XLA "
         "cudnn_pad_for_convolutions.cc pads 3 -> 4 input features (32 or 64 outputs) and the rest to 8; "
         "AITemplate pads C < 4 to 4 and 5 < C < 8 to 8"),
    Rule("memory_bound", "an op whose arithmetic intensity is under half the machine balance is not padded",
         "torch/_inductor/fx_passes/pad_mm.py is_mm_compute_bound: pads only when M*N*K/(M*K+N*K+M*N) "
         "exceeds 0.5 x TFLOPS/bandwidth; a memory-bound op's time is its bytes, which padding only grows "
         "(a 10-class head 10 -> 16: +60% FLOPs and output bytes, no faster kernel)"),
    Rule("compute_bound", f"a compute-bound op pads when modeled {MARGIN:g}x faster",
         "modeled time = FLOPs x growth / ALIGN_EFFICIENCY[alignment]; inductor's pad_mm pads only when the "
         f"original is {MARGIN:g}x slower; measured: GPT-2's vocab GEMM 50257 -> 50264 saves ~16 ms per step"),
    Rule("growth_cap", "no padding grows an op's FLOPs past Policy.pad_max_growth",
         "TVM's tensorcore_alter_op refuses extra-FLOPs ratios over 2; XLA refuses a 1.35x growth in bytes"),
)
RULE = {r.name: r for r in RULES}


def model_device(gm: torch.fx.GraphModule) -> torch.device | None:
    """The device the example inputs (as recorded on the graph's inputs), else the parameters, are on."""
    from ..base.meta import TensorInfo

    for n in gm.graph.nodes:
        info = n.meta.get(K.INFO) if n.op == "placeholder" else None
        if isinstance(info, TensorInfo):
            return torch.device(info.device)
    p = next(iter(gm.parameters()), None)
    return p.device if p is not None else None


def target(device: torch.device | str | None) -> tuple[Hardware, str]:
    """(the Hardware the gate judges for, why): the CUDA device the model is on, else the default."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        dev = torch.device(device)
        cap = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        return profile(cap), f"the model is on {name} (sm_{cap[0]}{cap[1]})"
    return profile(DEFAULT_CAPABILITY), "converted on the CPU: judged for the default target"


def profile(capability: tuple[int, int]) -> Hardware:
    known = [c for c in HARDWARE if c <= tuple(capability)]
    return HARDWARE[max(known)] if known else HARDWARE[min(HARDWARE)]


def alignment(*dims: int) -> int:
    """Largest power of two, up to 8 elements (16 bytes of FP16), that divides every dim."""
    a = 8
    for d in dims:
        while d % a:
            a //= 2
    return a


@dataclasses.dataclass(frozen=True)
class Site:
    """One convolution or linear as the gate sees it: true dims, layout and size (from the example)."""
    kind: str             # "conv" | "linear"
    out: int
    inp: int
    groups: int = 1
    layout: str = "contiguous"  # "contiguous" | "channels_last" (convolutions only)
    flops: int = 0        # of the op, unpadded, on the example inputs
    act_elements: int = 0  # input + output elements on the example inputs

    @property
    def intensity(self) -> float:
        """FLOPs per activation byte (2-byte elements): independent of the batch size."""
        return self.flops / (2.0 * self.act_elements) if self.act_elements else 0.0

    @property
    def thin_input(self) -> bool:
        return self.kind == "conv" and self.inp < 8


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the gate says for one op: the dims to use, the rules that spoke, and the reason in words."""
    out: int
    inp: int
    rules: tuple[str, ...]
    reason: str


def _up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def _change(site: Site, o: int, i: int) -> str:
    """``out 10 -> 16 in 3 -> 4``: the dims that differ from the op's true ones."""
    return " ".join(f"{w} {a} -> {b}" for w, a, b in (("out", site.out, o), ("in", site.inp, i)) if a != b)


def _growth(site: Site, o: int, i: int) -> float:
    return (o * i) / (site.out * site.inp)


def pct(x: float) -> str:
    return f"+{x:.2%}" if x < 0.01 else f"+{x:.0%}"


def model_gate(site: Site, multiple: int, max_growth: float, hw: Hardware) -> Verdict:
    """The cost model's decision for one op: ``RULES``, in order."""
    if site.kind == "conv" and site.groups != 1:
        return Verdict(site.out, site.inp, ("grouped",),
                       f"skip: grouped convolution (groups={site.groups}) keeps its group structure")
    notes: list[tuple[str, str]] = []
    in_now = site.inp
    if site.thin_input and (site.inp % multiple or site.layout == "channels_last" and site.inp < 4):
        in_now, rule, why = _thin_input(site, multiple)
        notes.append((rule, why))
    o_to, i_to = _up(site.out, multiple), in_now if site.thin_input else _up(site.inp, multiple)
    if (o_to, i_to) == (site.out, in_now):  # nothing left to decide
        return _finish(site, site.out, in_now, notes, max_growth)
    left = " ".join([f"out {site.out} -> {o_to}"] * (o_to != site.out)
                    + [f"in {in_now} -> {i_to}"] * (i_to != in_now))
    if site.intensity < COMPUTE_BOUND * hw.balance:
        grown = _growth(site, o_to, i_to) / _growth(site, site.out, in_now)
        notes.append(("memory_bound", f"{left} left ({pct(grown - 1)} FLOPs): memory-bound ({site.intensity:.0f} "
                      f"FLOP/B < {COMPUTE_BOUND * hw.balance:.0f}), padding adds bytes and no faster kernel"))
        return _finish(site, site.out, in_now, notes, max_growth)
    (o, i), note = _compute_bound(site, in_now, o_to, i_to, left, hw)
    notes.append(("compute_bound", note))
    return _finish(site, o, i, notes, max_growth)


def _compute_bound(site: Site, in_now: int, o_to: int, i_to: int, left: str, hw: Hardware
                   ) -> tuple[tuple[int, int], str]:
    """The dims with the lowest modeled time, if MARGIN times faster than now, and the reason."""
    def align(o: int, i: int) -> int:
        return alignment(o) if site.thin_input else alignment(o, i)  # a thin input is the thin_input rules' business

    def modeled(o: int, i: int) -> float:
        return _growth(site, o, i) / ALIGN_EFFICIENCY[align(o, i)]

    options = [(o, i) for o in dict.fromkeys((site.out, o_to)) for i in dict.fromkeys((in_now, i_to))]
    best = min(options, key=lambda d: modeled(*d))
    gain = modeled(site.out, in_now) / modeled(*best)
    bound = f"compute-bound ({site.intensity:.0f} FLOP/B >= {COMPUTE_BOUND * hw.balance:.0f})"
    if best == (site.out, in_now) or gain < MARGIN:
        return (site.out, in_now), (f"{left} left: {bound}, but padding is modeled only {gain:.2f}x faster "
                                    f"(< {MARGIN:g}x)")
    o, i = best
    padded = " ".join([f"out {site.out} -> {o}"] * (o != site.out) + [f"in {in_now} -> {i}"] * (i != in_now))
    return best, (f"{padded}: {bound}, alignment {align(site.out, in_now)} -> {align(o, i)} elements, modeled "
                  f"{gain:.2f}x faster")


def _thin_input(site: Site, multiple: int) -> tuple[int, str, str]:
    """(input channels to use, rule, reason) for a convolution with fewer than 8 input channels."""
    if site.layout != "channels_last":
        return site.inp, "thin_input_nchw", (
            f"in {site.inp} kept: thin-input convolution in NCHW (padded to 8, cuDNN picks "
            "implicit_convolve_sgemm: 3.7 ms vs ~1 ms per ResNet-50 step on an H100)")
    to = 4 if site.inp <= 4 else _up(site.inp, multiple)
    verb = f"in {site.inp} -> {to}" if to != site.inp else f"in {site.inp} kept"
    return to, "thin_input_nhwc", (f"{verb}: thin-input convolution in channels_last (cuDNN's NHWC kernels "
                                   "take C = 4 or a multiple of 8: NVIDIA's convolution guide, XLA, AITemplate)")


def _finish(site: Site, o: int, i: int, notes: list[tuple[str, str]], max_growth: float) -> Verdict:
    rules = tuple(r for r, _ in notes)
    growth = _growth(site, o, i)
    if growth > max_growth:
        return Verdict(site.out, site.inp, rules + ("growth_cap",),
                       f"skip {_change(site, o, i)}: {pct(growth - 1)} FLOPs over the {max_growth:g}x limit")
    why = "; ".join(n for _, n in notes)
    if (o, i) == (site.out, site.inp):
        return Verdict(o, i, rules, f"skip: {why}")
    return Verdict(o, i, rules, f"pad ({pct(growth - 1)} FLOPs): {why}")


@dataclasses.dataclass(frozen=True)
class TrialCase:
    """One timed configuration (an op at the example's shapes, padded to (out, inp), on one device), and the key of
    ``TRIAL_CACHE``."""
    kind: str                   # "conv" | "linear"
    x_shape: tuple[int, ...]    # true input shape
    w_shape: tuple[int, ...]    # true weight shape
    out: int
    inp: int
    conv_args: tuple = ()       # (stride, padding, dilation) as the graph passes them
    bias: bool = False
    dtype: torch.dtype = torch.float16
    layout: str = "contiguous"
    device: str = "cuda"        # "cuda:0 (NVIDIA H100 80GB HBM3)": the key names the GPU
    input_grad: bool = True     # the step computes the input's gradient (every layer but the first)


TRIAL_CACHE: dict[TrialCase, float] = {}


def candidates(site: Site, multiple: int, max_growth: float) -> list[tuple[int, int]]:
    """Every padding worth timing: each dim true or rounded up (a thin input also to 4), within the cap."""
    outs = dict.fromkeys((site.out, _up(site.out, multiple)))
    ins = dict.fromkeys((site.inp, _up(site.inp, multiple)) + ((4,) if site.kind == "conv" and site.inp < 4 else ()))
    return [(o, i) for o in outs for i in ins
            if (o, i) != (site.out, site.inp) and _growth(site, o, i) <= max_growth]


def trial_gate(site: Site, case_of: Callable[[int, int], TrialCase], multiple: int, max_growth: float,
               timer: Callable[[TrialCase], float], cache: dict | None = None) -> Verdict:
    """Time the unpadded op and each candidate (``timer(case)`` seconds, cached); pad to the fastest if ``MARGIN``
    times faster."""
    if site.kind == "conv" and site.groups != 1:
        return model_gate(site, multiple, max_growth, profile(DEFAULT_CAPABILITY))
    cache = TRIAL_CACHE if cache is None else cache
    options = candidates(site, multiple, max_growth)
    if not options:
        return Verdict(site.out, site.inp, ("trial", "growth_cap"),
                       f"skip: every padding grows FLOPs over the {max_growth:g}x limit")
    times = {}
    for o, i in [(site.out, site.inp)] + options:
        case = case_of(o, i)
        if case not in cache:
            cache[case] = float(timer(case))
        times[(o, i)] = cache[case]
    t0 = times[(site.out, site.inp)]
    best = min(options, key=lambda d: times[d])
    gain = t0 / times[best] if times[best] > 0 else float("inf")
    timed = (f"timed on {case_of(*best).device}: unpadded {t0 * 1e3:.3g} ms, {_change(site, *best)} "
             f"{times[best] * 1e3:.3g} ms ({gain:.2f}x)")
    if gain >= MARGIN:
        return Verdict(best[0], best[1], ("trial",), f"pad ({pct(_growth(site, *best) - 1)} FLOPs): {timed}")
    return Verdict(site.out, site.inp, ("trial",), f"skip: {timed}, not {MARGIN:g}x faster")


def time_on_device(case: TrialCase, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of the case's forward and backward (pad, op, slice), timed with CUDA events."""
    import torch.nn.functional as F

    dev = torch.device(case.device.split()[0])
    conv = case.kind == "conv"
    c_out, c_in = case.w_shape[0], case.w_shape[1]
    fmt = torch.channels_last if conv and case.layout == "channels_last" and len(case.x_shape) == 4 \
        else torch.contiguous_format
    x = torch.randn(case.x_shape, device=dev, dtype=case.dtype).contiguous(memory_format=fmt)
    w = torch.randn(case.w_shape, device=dev, dtype=case.dtype).contiguous(memory_format=fmt)
    b = torch.randn(c_out, device=dev, dtype=case.dtype) if case.bias else None
    x.requires_grad_(case.input_grad)
    w.requires_grad_(True)
    ch = 1 if conv else -1
    op = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(case.w_shape)] if conv else F.linear

    def pad(t, dim, extra):
        if not extra:
            return t
        spec = [0, 0] * (t.dim() - dim % t.dim())
        spec[-1] = extra
        return F.pad(t, spec)

    def forward():
        wi = pad(pad(w, 1, case.inp - c_in), 0, case.out - c_out)
        bi = pad(b, 0, case.out - c_out) if b is not None else None
        xi = pad(x, ch, case.inp - c_in)
        y = op(xi, wi, bi, *case.conv_args) if conv else op(xi, wi, bi)
        return y.narrow(ch, 0, c_out) if case.out != c_out else y

    with torch.no_grad():
        grad = torch.randn_like(forward())

    def step():
        x.grad = w.grad = None
        forward().backward(grad)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
