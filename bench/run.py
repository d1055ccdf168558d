"""CPU benchmark: autocastfx vs torch.autocast + GradScaler vs float32, counted per training step.

    python bench/run.py [--quick]      (./run.sh bench)

Prints one table per section and the machine it ran on. Figures that depend on speed are only the
overhead-bound step time (one thread, a model whose kernels cost almost nothing) and conversion time.
"""
import argparse
import datetime
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import (Runner, accumulation_cast_bytes, convert_blocks_scaling, convert_hf_scaling, convert_scaling,
                     interleaved_step_times)  # noqa: E402
from autocastfx.core import devices  # noqa: E402
from models import GPT2, Bottleneck, ResNet50, TinyMLP, ViT, ListStack, lm_loss, transformer_stack  # noqa: E402


def machine() -> str:
    """The machine line: the CPU (autocastfx.core.devices.cpu_summary: model, capability, features, whether its
    bfloat16 and float16 are native), cores, torch and the date."""
    return f"{devices.cpu_summary()}; {os.cpu_count()} cores, torch {torch.__version__}, {datetime.date.today()}"


def workloads(quick):
    torch.manual_seed(0)
    if quick:
        return [("ResNet-50 (2x3x32x32)", ResNet50(classes=10, layers=(1, 1, 1, 1)), (torch.randn(2, 3, 32, 32),),
                 torch.tensor([1, 2]), F.cross_entropy)]
    return [
        ("ResNet-50 (2x3x64x64)", ResNet50(), (torch.randn(2, 3, 64, 64),), torch.tensor([1, 2]), F.cross_entropy),
        ("ViT-B/16 (2x3x64x64)", ViT(), (torch.randn(2, 3, 64, 64),), torch.tensor([1, 2]), F.cross_entropy),
        ("GPT-2 124M (2x32 tokens)", GPT2(), (torch.randint(0, 50257, (2, 32)),),
         torch.randint(0, 50257, (2, 32)), lm_loss),
    ]


RECIPES = [("fp32", "float32", {}), ("autocast", "autocast+GradScaler", {}),
           ("autocast", "autocast+GS fused AdamW", {"fused": True}),
           ("autocastfx", "autocastfx", {"pad_multiple": 1}),  # float32 parameters, cast in the graph
           ("autocastfx", "autocastfx pad8", {"pad_multiple": 8})]


def mb(n):
    return f"{n / 2**20:9.2f}"


SECTIONS = ("counts", "accumulation", "overhead", "convert")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small model only (seconds)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        ap.error(f"--only takes {', '.join(SECTIONS)}; got {', '.join(sorted(only - set(SECTIONS)))}")
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"machine: {machine()}\n")
    if "counts" in only:
        print("Per training step (forward, backward, AdamW), counted at the aten level. MB = 2^20 bytes.")
        head = (f"{'model':26} {'recipe':24} {'cast MB':>9} {'casts':>6} {'aten ops':>8} {'syncs':>5} "
                f"{'saved MB':>9} {'params MB':>9} {'grads MB':>9} {'masters MB':>10} {'optim MB':>9} {'live MB':>9}")
        print(head)
        print("-" * len(head))
        results = {}
        for name, model, inputs, target, loss in workloads(args.quick):
            for recipe, label, kw in RECIPES:
                c = Runner(recipe, model, inputs, target, loss, **kw).cost()
                results[(name, label)] = c
                print(f"{name:26} {label:24} {mb(c.cast_bytes)} {c.casts:6d} {c.ops:8d} {c.syncs:5d} "
                      f"{mb(c.saved_bytes)} {mb(c.param_bytes)} {mb(c.grad_bytes)} {mb(c.master_bytes):>10} "
                      f"{mb(c.optim_bytes)} {mb(c.live_bytes)}", flush=True)
        skipped = [k for k, c in results.items() if c.skipped]
        print("every counted step was a real update (no overflow)" if not skipped else
              "counted steps that overflowed and skipped the update: " + ", ".join(" / ".join(k) for k in skipped))
        print()
        for name, *_ in workloads(args.quick):
            ac, fx = results[(name, "autocast+GradScaler")], results[(name, "autocastfx")]
            print(f"{name}: cast bytes autocastfx/autocast = {fx.cast_bytes / max(ac.cast_bytes, 1):.2f}; "
                  f"saved-for-backward autocastfx/autocast = {fx.saved_bytes / max(ac.saved_bytes, 1):.2f}; "
                  f"host syncs {fx.syncs} vs {ac.syncs}")

    if "accumulation" in only:
        print("\nCast bytes per optimizer update with 4 micro-batches (gradient accumulation):")
        name, model, inputs, target, loss = workloads(args.quick)[0]
        acc = accumulation_cast_bytes(model, inputs, target, loss, micro=4)
        a, b = acc["autocast+GradScaler"], acc["autocastfx"]
        print(f"  {name}: autocast+GradScaler {mb(a[0])} MB in {a[1]} casts; autocastfx {mb(b[0])} MB in {b[1]} casts; "
              f"ratio {b[0] / max(a[0], 1):.2f}")

    if "overhead" in only:
        rounds, steps = (4, 25) if args.quick else (12, 50)
        print(f"\nOverhead-bound step (8 x [Linear 64, LayerNorm, GELU], batch 8, one thread, fused AdamW everywhere): "
              f"median of {rounds * steps} steps each, the recipes taking turns in {rounds} rounds:")
        torch.set_num_threads(1)
        torch.manual_seed(0)
        tiny, x, y = TinyMLP(), torch.randn(8, 64), torch.randint(0, 10, (8,))
        labels = {"floor": "hand-halved floor", "autocastfx": "autocastfx step", "autocast": "autocast+GradScaler",
                  "fp32": "float32 (reference)"}
        runners = {k: Runner(k, tiny, (x,), y, **({"pad_multiple": 1} if k == "autocastfx" else {"fused": True}))
                   for k in labels}
        counts = {k: r.cost() for k, r in runners.items()}
        times = interleaved_step_times(runners, rounds=rounds, steps=steps)
        print(f"  {'recipe':22} {'median us':>10} {'x floor':>8} {'+us vs floor':>12} {'aten ops':>8} {'casts':>6}")
        for k, label in labels.items():
            print(f"  {label:22} {times[k] * 1e6:10.1f} {times[k] / times['floor']:8.3f} "
                  f"{(times[k] - times['floor']) * 1e6:12.1f} {counts[k].ops:8d} {counts[k].casts:6d}")

    if "convert" in only:
        print("\nConversion cost: a stack of transformer blocks, convert() against torch.fx.symbolic_trace:")
        depths = [40, 160] if args.quick else [40, 160, 640, 1850]
        rows = convert_scaling(depths, transformer_stack, lambda: torch.randn(1, 4, 16))
        print(f"  {'traced nodes':>12} {'converted nodes':>15} {'trace s':>8} {'convert s':>9} {'us/node':>8} {'ratio':>6}")
        for n_trace, n_conv, t_trace, t_conv in rows:
            print(f"  {n_trace:12d} {n_conv:15d} {t_trace:8.2f} {t_conv:9.2f} {t_conv / n_trace * 1e6:8.0f} "
                  f"{t_conv / t_trace:6.1f}")
        print("\nConversion cost with blocks: a ModuleList of transformer blocks, convert(blocks='auto') (each block a "
              "module of its own, blocks alike planned once) and convert(blocks=None) (one graph) against "
              "torch.fx.symbolic_trace:")
        depths = [25, 100] if args.quick else [25, 100, 300]
        print(f"  {'blocks':>6} {'trace s':>8} {'one graph s':>11} {'ratio':>6} {'blocks s':>9} {'ratio':>6}")
        for depth, t_trace, t_flat, t_blocks in convert_blocks_scaling(depths, ListStack,
                                                                       lambda: torch.randn(1, 4, 16)):
            print(f"  {depth:6d} {t_trace:8.2f} {t_flat:11.2f} {t_flat / t_trace:6.1f} {t_blocks:9.2f} "
                  f"{t_blocks / t_trace:6.1f}")
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("\n(Hugging Face rows left out: transformers is not installed)")
        else:
            print("\nConversion cost with blocks through torch.export: a Hugging Face Llama from a config (d 64, "
                  "input 2x16; its forward only torch.export captures), convert() against torch.export.export "
                  "(one call each):")
            depths = [4, 12] if args.quick else [4, 12, 24]
            print(f"  {'layers':>6} {'export s':>8} {'one graph s':>11} {'ratio':>6} {'blocks s':>9} {'ratio':>6} "
                  f"{'casts one graph':>15} {'casts blocks':>12}")
            for depth, t_exp, t_flat, t_blocks, c_flat, c_blocks in convert_hf_scaling(depths):
                print(f"  {depth:6d} {t_exp:8.2f} {t_flat:11.2f} {t_flat / t_exp:6.1f} {t_blocks:9.2f} "
                      f"{t_blocks / t_exp:6.1f} {c_flat:15d} {c_blocks:12d}")
        print("\nConversion cost: a ResNet-style CNN of bottleneck blocks in four stages (input 2x3x32x32), "
              "convert() against torch.fx.symbolic_trace:")
        depths = [8, 32] if args.quick else [16, 64, 256, 1024]
        rows = convert_scaling(depths, cnn_stack, lambda: torch.randn(2, 3, 32, 32))
        print(f"  {'traced nodes':>12} {'converted nodes':>15} {'trace s':>8} {'convert s':>9} {'us/node':>8} {'ratio':>6}")
        for n_trace, n_conv, t_trace, t_conv in rows:
            print(f"  {n_trace:12d} {n_conv:15d} {t_trace:8.2f} {t_conv:9.2f} {t_conv / n_trace * 1e6:8.0f} "
                  f"{t_conv / t_trace:6.1f}")
    print(f"\nwhole run: {time.perf_counter() - t0:.0f} s")


def cnn_stack(depth, width=16):
    """``depth`` bottleneck blocks (ResNet's, 4 x ``width`` channels) in four stages, each of which halves the
    resolution: shapes differ from stage to stage, and the weights stay small so the graph is what is
    measured, not the casting of weights."""
    layers = [nn.Conv2d(3, 4 * width, 3, padding=1, bias=False), nn.BatchNorm2d(4 * width), nn.ReLU()]
    for stage in range(4):
        for i in range(max(1, depth // 4)):
            layers.append(Bottleneck(4 * width, width, 2 if (i == 0 and stage > 0) else 1))
    return nn.Sequential(*layers)


if __name__ == "__main__":
    main()
