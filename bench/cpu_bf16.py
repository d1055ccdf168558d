"""The CPU bfloat16 scoreboard: training and inference step time of float32, torch.autocast(bfloat16) and
autocastfx (bfloat16), eager and torch.compile'd, on a ResNet-50 and a GPT-2-style transformer, every recipe
measured in this one process, interleaved, with the project's CPU targets beside them.

    python bench/cpu_bf16.py                        # training and inference, eager and compiled (a few minutes)
    python bench/cpu_bf16.py --only train           # training only (or: --only infer)
    python bench/cpu_bf16.py --no-compile           # leave out the torch.compile rows
    python bench/cpu_bf16.py --repeats 8            # rounds of the round-robin (default 5; 2 with --quick)
    python bench/cpu_bf16.py --models gpt           # some models only: resnet50, gpt
    python bench/cpu_bf16.py --markdown cpu.md      # the machine line, tables and targets as Markdown too
    python bench/cpu_bf16.py --quick                # tiny models, 2 rounds: a smoke run of every code path

Recipes (one model's weights, seed 0, copied into each):

- float32: the model as written; training: forward, loss, backward, AdamW (fused) step.
- torch.autocast: ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward and the loss; backward and
  the same AdamW step outside it (bfloat16 needs no GradScaler).
- autocastfx: ``gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)``; training:
  ``step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-4, fused=True))`` and ``step(x, y)``
  (the step switches AdamW to its fused kernel itself); inference: ``gm.eval()`` and ``gm(x)`` under no_grad.
- autocastfx, plain loop (training only): the same ``gm`` in the loop the float32 row runs (zero_grad, forward,
  loss, backward, fused AdamW over ``gm.parameters()``), with no ``train_step``: what a user's own loop gets.
- the heap (``--heap``): ``autocastfx.keep_cpu_memory()`` tells glibc once per process to keep freed memory for the
  next step. That setting is the process's, so every recipe of the board runs under it (``--heap keep``, the
  default), or none does (``--heap glibc``: glibc's defaults).
- each of the three compiled: ``torch.compile(model)`` (the autocast context around the compiled call) and
  ``torch.compile(gm)`` given to ``train_step``, or called in eval mode. The optimizer stays eager in every row.

How it measures: ``torch.set_num_threads(--threads)`` (2; 1 with ``--quick``, a smoke run that must not
oversubscribe a CPU busy with other work: two OpenMP threads on two busy cores wait on each other). Every recipe is
built, called once (for a compiled row that call compiles: its wall time is the "compile s" column, never part of
ms/step) and warmed up; then ``--repeats`` rounds go round-robin over the recipes, each running ``--steps`` timed
steps per round, the starting recipe rotating from round to round, so slow drifts of the machine (turbo, a
neighbour) fall on every recipe alike. ms/step is the median of every timed step. "x float32" and "x autocast"
divide the float32 or autocast row's ms/step by the row's; compiled rows are divided by the compiled float32 and
autocast rows. The machine line names the CPU (model, torch's capability string, avx2, avx512f, avx512_bf16,
avx512_fp16 and the amx flags); on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16) the board says that
its bfloat16 rows measure emulated kernels, for which the targets are not set. Every output is checked: a
non-finite loss or output fails the row, and a row that fails (building, compiling or running) reads ``failed:
<first line of the error>`` while the board goes on. Exit status 1 when an eager row failed (a compiled row may
fail on a CPU for reasons of its compiler's), 0 otherwise, PASS or MISS alike.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autocastfx  # noqa: E402
import autocastfx.training.heap  # noqa: E402
from autocastfx.core import devices  # noqa: E402
from models import GPT2, ResNet50, lm_loss  # noqa: E402

LR = 1e-4
BF16 = torch.bfloat16
RECIPES = {  # key -> label
    "fp32": "float32",
    "autocast": "torch.autocast bf16",
    "fx": "autocastfx bf16",
    "loop": "autocastfx bf16, plain loop",
    "fp32-compile": "float32 compile",
    "autocast-compile": "torch.autocast bf16 compile",
    "fx-compile": "autocastfx bf16 compile",
    "loop-compile": "autocastfx bf16, plain loop, compile",
}
EAGER = ("fp32", "autocast", "fx", "loop")
TRAIN_ONLY = ("loop",)  # in eval mode the plain loop's module is the train_step's: one inference row
# (mode, recipe, against, at least): the project's CPU bfloat16 targets, judged eager against eager and compiled
# against compiled
TARGETS = (("train", "fx", "autocast", 1.3), ("train", "fx", "fp32", 2.0), ("infer", "fx", "autocast", 1.3),
           ("train", "loop", "autocast", 1.0))
MODES = {"train": "training", "infer": "inference"}


@dataclasses.dataclass(frozen=True)
class Workload:
    key: str
    name: str
    make: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple]  # () -> (x, y), seeded
    loss: Callable


def workloads(quick: bool) -> list[Workload]:
    def images(b, hw, classes):
        def make():
            g = torch.Generator().manual_seed(1)
            return torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, classes, (b,), generator=g)
        return make

    def tokens(b, t, vocab):
        def make():
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, vocab, (b, t), generator=g)
            return ids, torch.roll(ids, -1, 1)
        return make

    if quick:
        return [
            Workload("resnet50", "ResNet-50 (quick: width 8, 1 block a stage, 4x3x32x32)",
                     lambda: ResNet50(classes=10, layers=(1, 1, 1, 1), width=8), images(4, 32, 10), F.cross_entropy),
            Workload("gpt", "GPT-2 style (quick: 1 layer d32, 2x16 tokens)",
                     lambda: GPT2(vocab=101, ctx=16, d=32, depth=1, heads=2, init_std=0.02), tokens(2, 16, 101),
                     lm_loss),
        ]
    return [
        Workload("resnet50", "ResNet-50 (16x3x96x96, 1000 classes)", lambda: ResNet50(classes=1000),
                 images(16, 96, 1000), F.cross_entropy),
        Workload("gpt", "GPT-2 style (6 layers d512, 8 heads, vocab 8192, 8x128 tokens)",
                 lambda: GPT2(vocab=8192, ctx=128, d=512, depth=6, heads=8, init_std=0.02), tokens(8, 128, 8192),
                 lm_loss),
    ]


# --------------------------------------------------------------------------------------------------- recipes
class Insane(RuntimeError):
    """A recipe's loss or output that is not finite."""


def _adamw(params):
    try:
        return torch.optim.AdamW(params, lr=LR, fused=True)
    except (RuntimeError, ValueError):  # no fused CPU kernel in this torch: the foreach one
        return torch.optim.AdamW(params, lr=LR)


def _context(base: str):
    return (lambda: torch.autocast("cpu", dtype=BF16)) if base == "autocast" else contextlib.nullcontext


def build(mode: str, recipe: str, model: torch.nn.Module, x, y, loss_fn, backend: str) -> Callable[[], torch.Tensor]:
    """A no-argument callable running one step of ``recipe`` on ``model`` (the recipe's own copy) and returning the
    loss (training) or the output (inference)."""
    compiled = recipe.endswith("-compile")
    base = recipe.removesuffix("-compile")
    if base == "fx":
        gm = autocastfx.convert(model, (x,), dtype=BF16)
        del model
        target = torch.compile(gm, backend=backend) if compiled else gm
        if mode == "train":
            step = autocastfx.train_step(target, loss_fn, torch.optim.AdamW(gm.parameters(), lr=LR, fused=True))
            return lambda: step(x, y)
        gm.eval()

        def infer():
            with torch.no_grad():
                return target(x)
        return infer

    if base == "loop":  # the user's own loop over the converted module: no train_step
        gm = autocastfx.convert(model, (x,), dtype=BF16)
        del model
        opt = _adamw(gm.parameters())
        fwd = torch.compile(gm, backend=backend) if compiled else gm

        def loop():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return loop
    ctx = _context(base)
    if mode == "train":
        opt = _adamw(model.parameters())
        fwd = torch.compile(model, backend=backend) if compiled else model

        def train():
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return train
    model.eval()
    fwd = torch.compile(model, backend=backend) if compiled else model

    def infer():
        with torch.no_grad(), ctx():
            return fwd(x)
    return infer


def checked(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not torch.is_tensor(out):
        raise Insane(f"returned {type(out).__name__}, not a tensor")
    if not bool(torch.isfinite(out).all()):
        raise Insane("non-finite " + ("loss" if out.numel() == 1 else "output") + f" ({out.dtype})")
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:200]


@dataclasses.dataclass
class Row:
    recipe: str
    run: Callable | None = None
    setup_s: float = 0.0
    first_s: float = 0.0
    times: list = dataclasses.field(default_factory=list)
    first: float | None = None      # the first call's loss (training)
    last: float | None = None       # the last timed step's loss (training)
    rel_err: float | None = None    # ||out - float32 eager's|| / ||float32 eager's|| (inference)
    error: str | None = None

    @property
    def ms(self) -> float | None:
        return statistics.median(self.times) * 1e3 if self.times and not self.error else None


def _call(row: Row, mode: str, ref) -> float:
    """One call of the row's step, its output checked; the seconds it took."""
    t = time.perf_counter()
    out = row.run()
    dt = time.perf_counter() - t
    out = checked(out)
    if mode == "train":
        loss = float(out)
        row.first = loss if row.first is None else row.first
        row.last = loss
    elif ref is not None and row.rel_err is None:
        row.rel_err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return dt


def measure(w: Workload, mode: str, recipes: list[str], args, log) -> dict[str, Row]:
    """Build and warm every recipe, then the interleaved rounds; a recipe that fails anywhere keeps its error."""
    torch.manual_seed(0)
    base = w.make()
    x, y = w.batch()
    ref = None
    if mode == "infer":
        with torch.no_grad():
            ref = copy.deepcopy(base).eval()(x).float()
    rows = {r: Row(r) for r in recipes}
    for r, row in rows.items():
        try:
            t = time.perf_counter()
            row.run = build(mode, r, copy.deepcopy(base), x, y, w.loss, args.backend)
            row.setup_s = time.perf_counter() - t
            row.first_s = _call(row, mode, ref)
            for _ in range(args.warmup):
                _call(row, mode, ref)
            log(f"  {w.key} {mode} {r}: setup {row.setup_s:.1f} s, first call {row.first_s:.1f} s")
        except Exception as e:  # noqa: BLE001 - the board reports it and goes on
            row.error, row.run = first_line(e), None
            log(f"  {w.key} {mode} {r}: failed: {row.error}")
    live = [r for r in recipes if rows[r].error is None]
    for rnd in range(args.repeats):
        k = rnd % len(live) if live else 0
        for r in live[k:] + live[:k]:
            row = rows[r]
            if row.error:
                continue
            if not args.quick:  # the same heap state before every timed run; a smoke run measures nothing
                gc.collect()
            try:
                for _ in range(args.steps):
                    row.times.append(_call(row, mode, ref))
            except Exception as e:  # noqa: BLE001
                row.error, row.run = first_line(e), None
                log(f"  {w.key} {mode} {r}: failed while timed: {row.error}")
    for row in rows.values():
        row.run = None
    del base
    gc.collect()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # compiled code holds its module: let it go before the next board
    return rows


# --------------------------------------------------------------------------------------------------- report
def _against(recipe: str, base: str) -> str:
    return base + "-compile" if recipe.endswith("-compile") else base


def ratio(rows: dict[str, Row], recipe: str, base: str) -> float | None:
    a, b = rows.get(_against(recipe, base)), rows.get(recipe)
    if a is None or b is None or a.ms is None or b.ms is None:
        return None
    return a.ms / b.ms


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def check_cell(mode: str, row: Row) -> str:
    if row.error:
        return f"failed: {row.error}"
    if mode == "train":
        return f"loss {row.first:.4g} -> {row.last:.4g}"
    return "output finite" + ("" if row.rel_err is None else f", {row.rel_err:.2%} from float32")


def table(mode: str, boards: dict) -> str:
    head = ["model", "recipe", "ms/step", "x float32", "x autocast", "setup s", "compile s", "check"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * 5 + "---|"]
    for w, rows in boards.items():
        for r, row in rows.items():
            ms = "n/a" if row.ms is None else f"{row.ms:.1f}"
            comp = f"{row.first_s:.1f}" if r.endswith("-compile") and not row.error else "-"
            setup = "-" if row.error else f"{row.setup_s:.2f}"
            lines.append("| " + " | ".join([w.name, RECIPES[r], ms, _x(ratio(rows, r, "fp32")),
                                             _x(ratio(rows, r, "autocast")), setup, comp,
                                             check_cell(mode, row)]) + " |")
    return "\n".join(lines)


def targets(mode: str, boards: dict) -> tuple[list[str], int]:
    lines, misses = [], 0
    for w, rows in boards.items():
        for m, recipe, against, at_least in TARGETS:
            if m != mode:
                continue
            for suffix in ("", "-compile"):
                r, a = recipe + suffix, against + suffix
                if r not in rows or a not in rows:
                    continue
                v = ratio(rows, r, against)
                verdict = "n/a (a row failed)" if v is None else f"{v:.2f}x " + ("PASS" if v >= at_least else "MISS")
                misses += verdict.endswith("MISS")
                lines.append(f"- {w.name}, {MODES[mode]}: {RECIPES[r]} >= {at_least:g}x {RECIPES[a]}: {verdict}")
    return lines, misses


def machine(threads: int) -> str:
    """The machine line: the CPU's model, its capability string and features (autocastfx.core.devices), torch,
    the threads and the date."""
    flags = devices.cpu_features()
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in devices.SHOWN_FLAGS) if flags else \
        "CPU flags unreadable"
    cap = torch.backends.cpu.get_cpu_capability()
    return (f"CPU: {devices.cpu_model()} ({os.cpu_count()} logical CPUs); {have}; torch {torch.__version__} (CPU "
            f"capability {cap}, oneDNN {'yes' if torch.backends.mkldnn.is_available() else 'no'}); "
            f"{threads} thread{'s' * (threads != 1)}; "
            f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")


def emulated_note() -> str | None:
    """What to say of the bfloat16 rows on a CPU without native bfloat16 (None where it has it, or its flags
    cannot be read)."""
    if devices.native_on_cpu(BF16) is not False:
        return None
    return ("bfloat16 is not native on this CPU (no avx512_bf16 or amx_bf16): its bfloat16 rows measure emulated "
            "kernels, tens of times slower than float32's, and the targets (set for native bfloat16) do not "
            "apply; convert(dtype='auto') computes in float32 here")


def report(args, mline: str, boards: dict, seconds: float) -> tuple[str, int]:
    note = emulated_note()
    out, misses = [f"### CPU bfloat16 scoreboard{' (quick: tiny models, not a measurement)' if args.quick else ''}",
                   "", mline, "", *([f"**{note}.**", ""] if note else []),
                   f"`python bench/cpu_bf16.py{''.join(' ' + a for a in args.argv)}`, {seconds:.0f} s. "
                   f"{args.repeats} rounds x {args.steps} timed steps a recipe, round-robin, after the first call and "
                   f"{args.warmup} warm-up step{'s' * (args.warmup != 1)}; ms/step: the median; compiled rows' "
                   f"ratios against the compiled float32 and "
                   f"autocast rows; compile s: the first call's wall time (backend {args.backend}).", ""], 0
    for mode in ("train", "infer"):
        if not boards.get(mode):
            continue
        lines, m = targets(mode, boards[mode])
        misses += m
        out += [f"#### {MODES[mode]}", "", table(mode, boards[mode]), "", "Targets:", "", *lines, ""]
    return "\n".join(out), misses


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 rounds: a smoke run")
    ap.add_argument("--only", choices=("train", "infer"), default=None, help="training or inference only")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    ap.add_argument("--repeats", type=int, default=None, help="round-robin rounds (default 5; 2 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per recipe per round (default 3; 2 quick)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps after the first call (default 2; 1 quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default 2; 1 with --quick, which is no measurement and must not "
                         "oversubscribe a CPU busy with other work)")
    ap.add_argument("--models", default=None, help="comma-separated: resnet50,gpt (default both)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    ap.add_argument("--heap", choices=("keep", "glibc"), default="keep",
                    help="keep: freed memory kept for the next step, for every recipe (what the autocastfx step does "
                         "on the CPU, process-wide: autocastfx.training.heap); glibc: glibc's defaults for every "
                         "recipe")
    ap.add_argument("--markdown", default=None, help="write the result as Markdown to this file")
    args = ap.parse_args(argv)
    args.argv = argv
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 3)
    args.warmup = (1 if args.quick else 2) if args.warmup is None else args.warmup
    args.threads = args.threads or (1 if args.quick else 2)
    ws = workloads(args.quick)
    if args.models:
        keys = args.models.split(",")
        unknown = [k for k in keys if k not in {w.key for w in ws}]
        if unknown:
            ap.error(f"unknown model {unknown[0]!r}: choose from " + ", ".join(w.key for w in ws))
        ws = [w for w in ws if w.key in keys]

    torch.set_num_threads(args.threads)
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64)):
        if hasattr(torch._dynamo.config, name):  # every compiled row is alive at once: no recompile limit hit
            setattr(torch._dynamo.config, name, value)
    recipes = list(EAGER) + ([] if args.no_compile else [r + "-compile" for r in EAGER])
    if args.heap == "keep":  # process-wide: before any recipe runs, so every recipe runs under it
        autocastfx.keep_cpu_memory()
    mline = machine(args.threads) + "; " + (autocastfx.training.heap.status() if args.heap == "keep" else
                                            "glibc's malloc at its defaults") + ", every recipe alike"

    def log(s):
        print(s, file=sys.stderr, flush=True)
    log(mline)
    if emulated_note():
        log(f"note: {emulated_note()}")

    if args.quick:  # a smoke run measures nothing: no collector passes over torch's import in its conversions
        gc.freeze()
    t0 = time.perf_counter()
    boards: dict[str, dict] = {}
    for mode in ("train", "infer"):
        if args.only not in (None, mode):
            continue
        boards[mode] = {}
        for w in ws:
            log(f"{w.name}, {MODES[mode]}:")
            boards[mode][w] = measure(w, mode, [r for r in recipes if mode == "train"
                                                or r.removesuffix("-compile") not in TRAIN_ONLY], args, log)
    text, misses = report(args, mline, boards, time.perf_counter() - t0)
    print("\n" + text, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    failed = [(MODES[m], w.name, r, row.error) for m, b in boards.items() for w, rows in b.items()
              for r, row in rows.items() if row.error]
    if failed:
        print("Failed:\n" + "\n".join(f"- {m}, {w}, {RECIPES[r]}: {e}" for m, w, r, e in failed))
    print(f"{misses} target(s) missed" if misses else "every target met")
    return 1 if any(r in EAGER for _, _, r, _ in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
