"""The GPU scoreboard: step time, memory and the first losses of float32, autocast+GradScaler and autocastfx
training, every recipe on the same models in one run on one device, with the project's targets beside them.

    python bench/gpu.py                         # CUDA: ResNet-50, ViT-B/16, GPT-2 124M, two overhead-bound models
    python bench/gpu.py --only resnet50,gpt2    # some workloads (keys: resnet50 vit gpt2 resnet18 lm4)
    python bench/gpu.py --quick                 # fewer steps per recipe
    python bench/gpu.py --markdown out.md       # the table as Markdown as well, with device, torch, CUDA and date
    python bench/gpu.py --dry-run               # the CPU: tiny models, every code path that needs no CUDA

Each recipe runs in a process of its own (``--isolate process``, the default on CUDA): its peak memory then
counts its own allocations only, and neither the caching allocator's pool nor compiled code of one recipe is
left behind for the next. A recipe first trains a few steps whose losses are checked against autocast's and
float32's, then warms up, then is timed: the median of per-step CUDA-event times over steps issued back to back
(no synchronisation between them, as in a training loop). Rows print as they complete, the cheap ones first and
the torch.compile rows last, so a run cut short still leaves results; ``--budget`` stops starting recipes in
time. A recipe the installed autocastfx cannot build (an option it does not have yet) reads ``n/a: <reason>``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autocastfx  # noqa: E402
from measure import INIT_SCALE, alive_storage_keys, step_memory, tensors_in  # noqa: E402
from models import GPT2, ResNet18, ResNet50, ViT, lm_loss  # noqa: E402

LR = 1e-4
LOSS_RTOL = 0.03  # the first losses of a mixed-precision recipe within 3% of autocast's and of float32's
GiB = 2**30

RECIPES = {  # key -> the row's label
    "fp32": "FP32",
    "tf32": "FP32+TF32",
    "autocast": "autocast+GradScaler",
    "autocast-cl": "autocast+GradScaler, channels_last by hand",
    "fx": "autocastfx",
    "fx-graph": "autocastfx CUDA graph",
    "autocast-compile": "autocast+GradScaler compile",
    "fx-compile": "autocastfx compile",
    "fx-block-compile": "autocastfx compile per block",
}
COMPILED = ("autocast-compile", "fx-compile", "fx-block-compile")
BIG = ("fp32", "tf32", "autocast", "fx", "fx-graph", "autocast-compile", "fx-compile")
OVERHEAD_BOUND = ("autocast", "fx", "fx-graph")
CONV_EXTRA = ("autocast-cl",)  # the layout autocastfx picks, done by hand for autocast: a reference row
PER_BLOCK = ("fx-block-compile",)  # a transformer's layers converted and compiled one by one (GPU rows only)


@dataclasses.dataclass(frozen=True)
class Target:
    """``recipe``'s row judged against ``against``'s: speed (``against`` ms / ``recipe`` ms >= ``at_least``)
    or memory (peak no higher)."""
    recipe: str
    against: str
    kind: str  # "speed" | "memory"
    at_least: float = 1.0

    def text(self) -> str:
        if self.kind == "memory":
            return f"peak <= {RECIPES[self.against]}"
        return f">= {self.at_least:g}x {RECIPES[self.against]}"


@dataclasses.dataclass(frozen=True)
class Workload:
    key: str
    name: str
    make: Callable[[], torch.nn.Module]
    shape: tuple        # (B, C, H, W) images or (B, T) token ids
    classes: int        # classes, or the vocabulary for token ids
    loss: Callable
    recipes: tuple
    overhead_bound: bool
    targets: tuple = ()


def _big_targets(speed, fp32=None):
    t = [Target("fx", "autocast", "speed", speed), Target("fx-graph", "autocast", "speed", speed)]
    if fp32:
        t.append(Target("fx", "fp32", "speed", fp32))
    t += [Target("fx-compile", "autocast-compile", "speed", 1.0), Target("fx", "autocast", "memory"),
          Target("fx-graph", "autocast", "memory"), Target("fx-compile", "autocast-compile", "memory")]
    return tuple(t)


SMALL_TARGETS = (Target("fx-graph", "autocast", "speed", 5.0), Target("fx", "autocast", "memory"),
                 Target("fx-graph", "autocast", "memory"))


def workloads(dry: bool) -> list[Workload]:
    """The scoreboard's models. A dry run keeps their code paths (convolutions with batch norm, attention,
    tied embeddings) at toy widths, so the script itself is checked in seconds on a CPU. The language models
    start from GPT-2's initialisation (std 0.02)."""
    ce = F.cross_entropy
    if dry:
        return [
            Workload("resnet50", "ResNet-50 (dry: width 8, 4x3x64x64)",
                     lambda: ResNet50(classes=10, layers=(1, 1, 1, 1), width=8), (4, 3, 64, 64), 10, ce,
                     BIG + CONV_EXTRA, False, _big_targets(1.6, 3.0)),
            Workload("vit", "ViT-B/16 (dry: d 32, 2x3x32x32)",
                     lambda: ViT(image=32, d=32, depth=1, heads=2, classes=10), (2, 3, 32, 32), 10, ce,
                     BIG, False, _big_targets(1.05)),
            Workload("gpt2", "GPT-2 (dry: d 32, 2x16 tokens)",
                     lambda: GPT2(vocab=101, ctx=16, d=32, depth=1, heads=2, init_std=0.02), (2, 16), 101, lm_loss,
                     BIG, False, _big_targets(1.3)),
            Workload("resnet18", "resnet18 (dry: width 8, 2x3x16x16)", lambda: ResNet18(classes=10, width=8),
                     (2, 3, 16, 16), 10, ce, OVERHEAD_BOUND + CONV_EXTRA, True, SMALL_TARGETS),
            Workload("lm4", "4-block LM (dry: d 32, 2x16 tokens)",
                     lambda: GPT2(vocab=64, ctx=16, d=32, depth=2, heads=2, init_std=0.02), (2, 16), 64, lm_loss,
                     OVERHEAD_BOUND, True, SMALL_TARGETS),
        ]
    return [
        Workload("resnet50", "ResNet-50 b128 224px", ResNet50, (128, 3, 224, 224), 1000, ce,
                 BIG + CONV_EXTRA, False, _big_targets(1.6, 3.0)),
        Workload("vit", "ViT-B/16 b64 224px", lambda: ViT(image=224), (64, 3, 224, 224), 1000, ce,
                 BIG + PER_BLOCK, False, _big_targets(1.05)),
        Workload("gpt2", "GPT-2 124M b8x1024", lambda: GPT2(init_std=0.02), (8, 1024), 50257, lm_loss,
                 BIG + PER_BLOCK, False, _big_targets(1.3)),
        Workload("resnet18", "resnet18 b8 64px", ResNet18, (8, 3, 64, 64), 1000, ce,
                 OVERHEAD_BOUND + CONV_EXTRA, True, SMALL_TARGETS),
        Workload("lm4", "4-block LM d256 b8x128",
                 lambda: GPT2(vocab=4096, ctx=128, d=256, depth=4, heads=4, init_std=0.02), (8, 128), 4096, lm_loss,
                 OVERHEAD_BOUND, True, SMALL_TARGETS),
    ]


@dataclasses.dataclass(frozen=True)
class Counts:
    """Steps per recipe: ``check`` steps whose losses are compared (the first, from the same initial weights and
    batches in every recipe), then ``warmup`` more, then ``timed``."""
    check: int
    warmup: int
    timed: int


def counts(w: Workload, dry: bool, quick: bool, iters: int | None) -> Counts:
    if dry:
        return Counts(2, 1, iters or 2)
    if quick:
        return Counts(5, 5, iters or (50 if w.overhead_bound else 10))
    return Counts(10, 20 if w.overhead_bound else 5, iters or (200 if w.overhead_bound else 30))


def batch(shape, classes, device, seed):
    """(inputs, target): random images and labels, or random token ids whose target is the next token."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if len(shape) == 2:
        ids = torch.randint(0, classes, shape, generator=g)
        return (ids.to(device),), torch.roll(ids, -1, 1).to(device)
    return (torch.randn(shape, generator=g).to(device),), torch.randint(0, classes, (shape[0],), generator=g).to(device)


# ------------------------------------------------------------------------------------------------ recipes
class Unavailable(Exception):
    """A recipe the installed autocastfx (or this device) cannot run: its cell reads ``n/a: <reason>``."""


@dataclasses.dataclass
class Built:
    """A ready training step, ``step(inputs, target) -> loss``, and what it holds (for the memory account)."""
    step: Callable
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object = None
    masters: list = dataclasses.field(default_factory=list)
    note: str = ""

    def holders(self) -> dict:
        params = list(self.module.parameters()) + list(self.module.buffers())
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "masters": self.masters,
                "grads": [p.grad for p in params] + [m.grad for m in self.masters],
                "optimizer": state, "scaler": list(tensors_in(self.scaler)) if self.scaler is not None else []}


def set_tf32(on: bool) -> None:
    """TF32 only in the FP32+TF32 row (PyTorch's cuDNN default is on: every other row turns it off)."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def build(recipe: str, model: torch.nn.Module, loss_fn, example: tuple, device: str, dry: bool) -> Built:
    """One recipe over ``model`` (already on ``device``; autocastfx converts it and lets it go)."""
    set_tf32(recipe == "tf32")
    if recipe in ("fp32", "tf32"):
        return _plain(model, loss_fn)
    if recipe.startswith("autocast"):
        if recipe == "autocast-cl":
            model = model.to(memory_format=torch.channels_last)
        built = _autocast(model, loss_fn, device, channels_last=recipe == "autocast-cl")
        if recipe == "autocast-compile":
            built.note = _compile(model, dry)
        return built
    per_block = recipe == "fx-block-compile"
    gm, note = _convert(model, example, blocks=_transformer_blocks if per_block else None)
    del model  # the float32 source model is not part of the recipe
    built = _autocastfx(gm, loss_fn, graph=recipe == "fx-graph")
    built.note = note
    if recipe == "fx-compile":
        built.note = "; ".join(filter(None, [note, _compile(gm, dry)]))
    if per_block:
        built.note = "; ".join(filter(None, [note, _compile_blocks(gm, dry)]))
    return built


def _plain(model, loss_fn) -> Built:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(inputs, target):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        return loss.detach()
    return Built(step, model, opt)


def _autocast(model, loss_fn, device, channels_last=False) -> Built:
    """The standard recipe: torch.autocast around the forward, GradScaler, a fused AdamW (no host sync)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def step(inputs, target):
        opt.zero_grad(set_to_none=True)
        if channels_last:
            inputs = tuple(x.contiguous(memory_format=fmt) if x.dim() == 4 else x for x in inputs)
        with torch.autocast(device, dtype=torch.float16):
            out = model(*inputs)
        loss = loss_fn(out.float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()
    return Built(step, model, opt, scaler)


def _convert(model, example, blocks=None):
    """convert() with the layout chosen for the device ("auto": channels_last on CUDA where it pays); ``blocks``:
    convert()'s option, only where given (the other rows convert as they always have)."""
    kw = {} if blocks is None else {"blocks": blocks}
    try:
        return autocastfx.convert(model, example, memory_format="auto", **kw), ""
    except TypeError as e:
        if "memory_format" not in str(e):
            raise
        return autocastfx.convert(model, example, **kw), "memory_format n/a: convert() has no memory_format option"


def _transformer_blocks(name, module) -> bool:
    """The scoreboard's transformer layers (``models.Block``, in an nn.Sequential: ``blocks="auto"`` takes the
    children of ModuleLists only)."""
    return type(module).__name__ == "Block"


def _compile_blocks(gm, dry: bool) -> str:
    """Each converted block compiled on its own (``autocastfx.compile_blocks``: ``block.compile()``, as TorchTitan
    compiles each transformer layer); the model around the blocks, the optimizer and the scaler stay eager."""
    if not hasattr(autocastfx, "compile_blocks"):
        raise Unavailable("autocastfx has no compile_blocks() in this version")
    autocastfx.compile_blocks(gm, backend="aot_eager" if dry else "inductor")
    n = sum(1 for _, m in gm.named_modules() if getattr(m, "_compiled_call_impl", None) is not None)
    return f"{n} block{'s' * (n != 1)} compiled" + (", aot_eager backend (dry run)" if dry else "")


def _autocastfx(gm, loss_fn, graph: bool) -> Built:
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, fused=True)
    kw = {"cuda_graph": True} if graph else {}
    try:
        step = autocastfx.train_step(gm, loss_fn, opt, init_scale=INIT_SCALE, **kw)
    except TypeError as e:
        if graph and "cuda_graph" in str(e):
            raise Unavailable("train_step() has no cuda_graph option in this autocastfx") from e
        raise
    scale_state = getattr(getattr(step, "step", step), "state", None)  # a CUDA-graph step wraps the generated one
    return Built(step, gm, opt, scale_state)  # no float32 copies beside the parameters: no masters


def _compile(module, dry: bool) -> str:
    """Compile the module's forward (and so its backward) in place; the optimizer and the scaler stay eager, the
    same split for both recipes. A dry run uses the aot_eager backend: Dynamo and AOTAutograd without Inductor's
    C++ code generation, which takes over a minute on a small CPU."""
    module.compile(backend="aot_eager" if dry else "inductor")
    return "aot_eager backend (dry run)" if dry else ""


# ------------------------------------------------------------------------------------------------ measuring
def time_steps(step, data, device, c: Counts) -> list[float]:
    """Seconds per step. On CUDA: events recorded between steps issued back to back, one synchronisation at the
    end, so the host's launch time overlaps the device's work as in a training loop."""
    for i in range(c.warmup):
        step(*data[i % len(data)])
    if device != "cuda":
        times = []
        for i in range(c.timed):
            t = time.perf_counter()
            step(*data[i % len(data)])
            times.append(time.perf_counter() - t)
        return times
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(c.timed + 1)]
    events[0].record()
    for i in range(c.timed):
        step(*data[i % len(data)])
        events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def prepare(w: Workload, recipe: str, device: str, dry: bool):
    """(row, data, built, ignore): the same two batches and initial weights for every recipe (seed 0)."""
    row = {"workload": w.key, "recipe": recipe}
    torch.manual_seed(0)
    data = [batch(w.shape, w.classes, device, seed) for seed in range(2)]
    row["data_bytes"] = sum(t.nbytes for inputs, target in data for t in (*inputs, target))
    ignore = alive_storage_keys() if device != "cuda" else frozenset()  # the CPU account leaves the data out
    try:
        built = build(recipe, w.make().to(device), w.loss, data[0][0], device, dry)
    except Unavailable as e:
        return {**row, "na": str(e)}, data, None, ignore
    except Exception as e:  # noqa: BLE001 - on a CPU the CUDA-graph row says why it cannot run
        if recipe == "fx-graph" and device != "cuda":
            return {**row, "na": f"needs CUDA ({_first_line(e)})"}, data, None, ignore
        raise
    row["note"] = built.note
    return row, data, built, ignore


def measure(w: Workload, recipe: str, device: str, c: Counts, dry: bool) -> dict:
    """One recipe on one workload: first losses, step times, peak and between-step memory. On CUDA the memory is
    the caching allocator's count of bytes in tensors: ``max_memory_allocated`` from just before the first step
    (so compilation and CUDA-graph capture count) and ``memory_allocated`` after the timed steps; both include
    the two input batches (``data_bytes``). On a CPU it is ``measure.step_memory``'s account of one step, the
    batches left out."""
    t0 = time.perf_counter()
    row, data, built, ignore = prepare(w, recipe, device, dry)
    if built is None:
        return row
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    row["losses"] = [float(built.step(*data[i % 2])) for i in range(c.check)]
    times = time_steps(built.step, data, device, c)
    row["ms"] = statistics.median(times) * 1e3
    row["mean_ms"] = statistics.fmean(times) * 1e3
    row["timed"] = len(times)
    if device == "cuda":
        torch.cuda.synchronize()
        row["peak"] = torch.cuda.max_memory_allocated()
        row["live"] = torch.cuda.memory_allocated()
        row["reserved"] = torch.cuda.max_memory_reserved()
    else:
        acc = step_memory(lambda: built.step(*data[0]), built.holders, ignore)
        row["peak"], row["live"] = acc.peak, acc.between
        row["account"] = dataclasses.asdict(acc)
    row["wall_s"] = time.perf_counter() - t0
    return row


def warm(w: Workload, recipe: str, device: str, dry: bool) -> None:
    """Build the recipe and run two steps: compiles it into Inductor's on-disk caches, nothing measured."""
    _, data, built, _ = prepare(w, recipe, device, dry)
    if built is not None:
        for i in range(2):
            built.step(*data[i])


def _first_line(e: BaseException) -> str:
    """The exception's first sentence: enough for a table cell."""
    text = (str(e).strip().splitlines() or [""])[0]
    end = text.find(". ")
    return f"{type(e).__name__}: {text[:end + 1] if 0 < end < 200 else text[:200]}"


def machine(device: str) -> dict:
    if device == "cuda":
        name, cudnn = torch.cuda.get_device_name(), torch.backends.cudnn.version()
    else:
        name, cudnn = "CPU (dry run: not a measurement)", None
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "python": sys.version.split()[0], "date": datetime.date.today().isoformat()}


# ------------------------------------------------------------------------------------------------ running
RANK = {"autocast": 0, "fp32": 1, "tf32": 2, "fx": 3, "fx-graph": 4, "autocast-cl": 5, "autocast-compile": 6,
        "fx-compile": 7, "fx-block-compile": 8}


def order(ws: list[Workload], recipes) -> list[tuple[Workload, str]]:
    """Cheap rows first, torch.compile rows last; within a workload autocast first, the row others compare to."""
    first, last = [], []
    for w in ws:
        for r in sorted(w.recipes, key=RANK.__getitem__):
            if r in recipes:
                (last if r in COMPILED else first).append((w, r))
    return first + last


def _child_cmd(w: Workload, recipe: str, args, *extra) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{w.key}:{recipe}", *extra]
    cmd += ["--dry-run"] * args.dry_run + ["--quick"] * args.quick + ["--no-cudnn-benchmark"] * args.no_cudnn_benchmark
    return cmd + (["--iters", str(args.iters)] if args.iters else [])


def _start(cmd: list[str], env=None, capture=False) -> subprocess.Popen:
    """A child in a session of its own, so that stopping it stops its compile workers too."""
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=out, text=True, start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.communicate()


def precompile(jobs: list, args, timeout: float) -> str:
    """Compile every torch.compile row's model in parallel processes, each with a share of the CPU's compile
    workers, before anything is timed: Inductor's compiled kernels land in its on-disk caches, and the timed
    rows later load them instead of compiling one after another. Nothing from these processes is measured; a
    failure here only means the timed row compiles for itself."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 1) // max(1, len(jobs)))))
    t0 = time.perf_counter()
    procs = [_start(_child_cmd(w, r, args, "--warm-only"), env=env) for w, r in jobs]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0))))
        except subprocess.TimeoutExpired:
            _stop(p)
            codes.append(None)
    return f"{len(jobs)} compiled in parallel in {time.perf_counter() - t0:.0f} s, {codes.count(0)} succeeded"


def run_isolated(w: Workload, recipe: str, args, timeout: float) -> dict:
    """The recipe in a fresh Python process; its result comes back as one JSON line."""
    p = _start(_child_cmd(w, recipe, args), capture=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        return {"workload": w.key, "recipe": recipe, "na": f"stopped after {timeout:.0f} s (time budget)"}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return {"workload": w.key, "recipe": recipe, "error": f"process exited {p.returncode}: {tail[:200]}"}


def run_here(w: Workload, recipe: str, device: str, c: Counts, dry: bool) -> dict:
    try:
        return measure(w, recipe, device, c, dry)
    except Exception as e:  # noqa: BLE001 - the row says what failed; the other rows go on
        return {"workload": w.key, "recipe": recipe, "error": _first_line(e)}
    finally:
        torch._dynamo.reset()  # compiled code holds its module: let it go before the next recipe
        if device == "cuda":
            torch.cuda.empty_cache()


def child(args) -> None:
    wkey, recipe = args.child.split(":")
    device = "cpu" if args.dry_run else "cuda"
    w = next(w for w in workloads(args.dry_run) if w.key == wkey)
    if args.dry_run:
        # the CPU account's heap walks (and the collector) go over what the recipe makes, not over torch's import:
        # every tensor alive now is left out of the account either way, and every one made later is still listed
        gc.freeze()
    if args.warm_only:
        warm(w, recipe, device, args.dry_run)
        return
    row = run_here(w, recipe, device, counts(w, args.dry_run, args.quick, args.iters), args.dry_run)
    row["machine"] = machine(device)
    print("RESULT " + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------------ judging
def loss_check(rows: dict, w: Workload, recipe: str) -> tuple[str, bool | None]:
    """(cell, passed): the largest relative gap between this row's first losses and autocast's and FP32's (FP32
    rows against FP32 only). ``passed`` is None when there is nothing to compare with."""
    mine = rows.get((w.key, recipe), {}).get("losses")
    if not mine:
        return "", None
    gaps = []
    for ref in (["fp32"] if recipe in ("fp32", "tf32") else ["autocast", "fp32"]):
        theirs = rows.get((w.key, ref), {}).get("losses")
        if theirs and ref != recipe:
            gaps.append((ref, max(_gap(a, b) for a, b in zip(mine, theirs))))
    cell = f"{mine[0]:.4f} -> {mine[-1]:.4f}"
    if not gaps:
        return cell, None
    ok = all(g <= LOSS_RTOL for _, g in gaps)
    return cell + (" ok " if ok else " DIFFERS ") + ", ".join(f"{g:.1%} {ref}" for ref, g in gaps), ok


def _gap(a: float, b: float) -> float:
    """Relative gap; infinite when either loss is not finite (max() over NaN would depend on the order)."""
    gap = abs(a - b) / max(abs(b), 1e-12)
    return gap if math.isfinite(gap) else math.inf


def judge(rows: dict, w: Workload, t: Target, unit=("GiB", GiB)) -> tuple[str, bool | None]:
    """(measured, passed) for one target; passed is None when a row is missing."""
    a, b = rows.get((w.key, t.recipe), {}), rows.get((w.key, t.against), {})
    key = "ms" if t.kind == "speed" else "peak"
    if a.get(key) is None or b.get(key) is None:
        return "n/a", None
    if t.kind == "speed":
        ratio = b["ms"] / a["ms"]
        return f"{ratio:.2f}x", ratio >= t.at_least
    return f"{a['peak'] / unit[1]:.2f} vs {b['peak'] / unit[1]:.2f} {unit[0]}", a["peak"] <= b["peak"]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def row_cells(rows: dict, w: Workload, recipe: str, unit) -> list[str]:
    r = rows.get((w.key, recipe), {})
    label = RECIPES[recipe] + (f" ({r['note']})" if r.get("note") else "")
    if "ms" not in r:
        reason = f"n/a: {r['na']}" if "na" in r else f"error: {r.get('error', 'not run')}"
        return [w.name, label, reason, "", "", "", "", ""]
    ref = rows.get((w.key, "autocast"), {}).get("ms")
    targets = [f"{t.text()}: {_verdict(judge(rows, w, t)[1])}" for t in w.targets if t.recipe == recipe]
    return [w.name, label, f"{r['ms']:.2f}", f"{ref / r['ms']:.2f}x" if ref else "",
            f"{r['peak'] / unit[1]:.2f}", f"{r['live'] / unit[1]:.2f}", loss_check(rows, w, recipe)[0],
            "; ".join(targets)]


def _workloads_in(plan) -> list[Workload]:
    return list(dict.fromkeys(w for w, _ in plan))


def table(rows: dict, plan: list, unit) -> str:
    head = ["model", "recipe", "ms/step", "vs autocast", f"peak {unit[0]}", f"live {unit[0]}",
            "first losses (largest gap)", "targets"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * 4 + "---|" * 2]
    planned = {(w.key, r) for w, r in plan}
    for w in _workloads_in(plan):
        lines += ["| " + " | ".join(row_cells(rows, w, r, unit)) + " |" for r in w.recipes if (w.key, r) in planned]
    return "\n".join(lines)


def summary(rows: dict, plan: list, unit) -> str:
    """Every target whose rows are in this run, and every loss check that failed."""
    lines = ["| model | row | target | measured | result |", "|---|---|---|---:|---|"]
    planned = {(w.key, r) for w, r in plan}
    for w in _workloads_in(plan):
        for t in w.targets:
            if (w.key, t.recipe) in planned and (w.key, t.against) in planned:
                measured, ok = judge(rows, w, t, unit)
                lines.append(f"| {w.name} | {RECIPES[t.recipe]} | {t.text()} | {measured} | {_verdict(ok)} |")
        for r in w.recipes:
            cell, ok = loss_check(rows, w, r)
            if ok is False:
                lines.append(f"| {w.name} | {RECIPES[r]} | first losses within {LOSS_RTOL:.0%} | {cell} | MISS |")
    return "\n".join(lines)


def report(rows: dict, plan: list, info: dict, args, seconds: float, notes: list[str]) -> str:
    """The run as Markdown, ready for docs/benchmarks.md."""
    unit = ("MiB", 2**20) if args.dry_run else ("GiB", GiB)
    steps = "; ".join(f"{w.key} {c.check} checked, {c.warmup} warm-up, {c.timed} timed" for w in _workloads_in(plan)
                      for c in [counts(w, args.dry_run, args.quick, args.iters)])
    return "\n".join([
        f"### {info.get('device', '?')}, torch {info.get('torch', '?')}, CUDA {info.get('cuda')}, "
        f"cuDNN {info.get('cudnn')}, {info.get('date', '?')}",
        "",
        f"`python bench/gpu.py{''.join(' ' + a for a in args.argv)}`, {seconds:.0f} s. " + " ".join(notes),
        f"Steps per recipe: {steps}. AdamW lr {LR:g}; both loss scalers start at {INIT_SCALE:g}; TF32 off except "
        f"in FP32+TF32; cuDNN benchmark {'off' if args.no_cudnn_benchmark else 'on'}. ms/step: median of "
        "per-step times; vs autocast: autocast+GradScaler eager's ms over the row's; first losses: the checked "
        f"steps' first and last loss and the largest relative gap to autocast's and FP32's (within {LOSS_RTOL:.0%}).",
        "",
        table(rows, plan, unit),
        "",
        summary(rows, plan, unit),
        "",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="workload keys, comma-separated: resnet50,vit,gpt2,resnet18,lm4")
    ap.add_argument("--recipes", default=None, help="recipe keys, comma-separated: " + ",".join(RECIPES))
    ap.add_argument("--quick", action="store_true", help="fewer checked, warm-up and timed steps")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per recipe")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny models on the CPU: checks the script, not a measurement")
    ap.add_argument("--isolate", choices=("process", "none"), default=None,
                    help="one process per recipe (the default on CUDA) or all in this one (the default in a dry run)")
    ap.add_argument("--no-precompile", action="store_true", help="compile each torch.compile row only when it runs")
    ap.add_argument("--budget", type=float, default=510.0, help="seconds; no recipe starts once they are spent")
    ap.add_argument("--no-cudnn-benchmark", action="store_true")
    ap.add_argument("--markdown", default=None, help="write the results as Markdown to this file (after every row)")
    ap.add_argument("--json", default=None, help="write every row's raw figures to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    if args.dry_run:
        torch.set_num_threads(1)  # toy models: one thread is fastest, and never waits on a busy machine's cores
    try:
        if args.child:
            child(args)
            return 0
        return _main(ap, args)
    finally:  # main() is called from the tests too: leave the process as it was
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _main(ap, args) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: `python bench/gpu.py --dry-run` checks the script on the CPU", file=sys.stderr)
        return 2
    ws = workloads(args.dry_run)
    if args.only:
        keys = args.only.split(",")
        if set(keys) - {w.key for w in ws}:
            ap.error(f"--only: unknown workload(s) {sorted(set(keys) - {w.key for w in ws})}; "
                     f"choose from {[w.key for w in ws]}")
        ws = [w for w in ws if w.key in keys]
    recipes = set(args.recipes.split(",")) if args.recipes else set(RECIPES)
    if recipes - set(RECIPES):
        ap.error(f"--recipes: unknown recipe(s) {sorted(recipes - set(RECIPES))}; choose from {list(RECIPES)}")
    if args.no_compile:
        recipes -= set(COMPILED)
    return run(args, order(ws, recipes))


def run(args, plan: list) -> int:
    device = "cpu" if args.dry_run else "cuda"
    isolate = args.isolate or ("process" if device == "cuda" else "none")
    unit = ("MiB", 2**20) if args.dry_run else ("GiB", GiB)
    notes = ["One process per recipe: peak memory is the recipe's own." if isolate == "process" else
             "All recipes in one process, one after another."]
    info = machine(device) if isolate == "none" else {}
    t0 = time.perf_counter()
    print(f"scoreboard: {len(plan)} rows; {notes[0]}", flush=True)
    compiled = [(w, r) for w, r in plan if r in COMPILED]
    if compiled and isolate == "process" and not args.no_precompile:
        notes.append("torch.compile rows: " + precompile(compiled, args, timeout=args.budget / 2) +
                     ", before anything was timed.")
        print(notes[-1], flush=True)
    rows: dict = {}
    for w, recipe in plan:
        left = args.budget - (time.perf_counter() - t0)
        if left < 5:
            row = {"workload": w.key, "recipe": recipe, "na": f"not started: the {args.budget:.0f} s budget is spent"}
        elif isolate == "process":
            row = run_isolated(w, recipe, args, timeout=left)
            info = info or row.get("machine", {})
        else:
            row = run_here(w, recipe, device, counts(w, args.dry_run, args.quick, args.iters), args.dry_run)
        row.pop("machine", None)
        rows[(w.key, recipe)] = row
        print(f"[{time.perf_counter() - t0:5.0f} s] " + " | ".join(c for c in row_cells(rows, w, recipe, unit) if c),
              flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(report(rows, plan, info, args, time.perf_counter() - t0, notes))
    text = report(rows, plan, info, args, time.perf_counter() - t0, notes)
    print("\n" + text, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "argv": args.argv, "rows": list(rows.values())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
