"""Where a training step's device time goes: torch.profiler over a few steps of one scoreboard workload, one table
per recipe, kernels sorted by their own device time.

    python bench/profile_step.py                          # GPT-2 124M, autocast+GradScaler and autocastfx
    python bench/profile_step.py --only resnet50 --recipes autocast,fx --steps 5 --rows 15
    python bench/profile_step.py --dry-run                # the CPU: tiny models, the script's own code paths

The workloads, recipes, batches and initial weights are bench/gpu.py's, so a row of the scoreboard and its
profile describe the same step.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # noqa: E402


def profile_recipe(w, recipe: str, device: str, steps: int, warmup: int, dry: bool):
    """(the profiler's key averages, the steps' summed device time in ms): ``warmup`` steps, then ``steps``
    profiled ones issued back to back and synchronised once."""
    _, data, built, _ = gpu.prepare(w, recipe, device, dry)
    if built is None:
        return None, 0.0
    for i in range(warmup):
        built.step(*data[i % 2])
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            built.step(*data[i % 2])
        if device == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    if device == "cuda":  # the kernels' own rows: an aten op's row repeats its kernels' time
        total_ms = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e3
    else:
        total_ms = sum(e.self_cpu_time_total for e in averages) / 1e3
    return averages, total_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gpt2", help="workload keys, comma-separated: resnet50,vit,gpt2,resnet18,lm4")
    ap.add_argument("--recipes", default="autocast,fx", help="recipe keys, comma-separated: " + ",".join(gpu.RECIPES))
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per recipe")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rows", type=int, default=20, help="rows of each table")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    keys = args.only.split(",")
    for w in [w for w in gpu.workloads(args.dry_run) if w.key in keys]:
        for recipe in args.recipes.split(","):
            averages, total = profile_recipe(w, recipe, device, args.steps, args.warmup, args.dry_run)
            print(f"\n## {w.name}: {gpu.RECIPES[recipe]} ({args.steps} steps, "
                  f"{total / args.steps:.2f} ms of {'device' if device == 'cuda' else 'CPU'} time per step)")
            if averages is None:
                print("n/a")
                continue
            print(averages.table(sort_by=sort, row_limit=args.rows, max_name_column_width=70))
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
