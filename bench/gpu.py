"""GPU benchmark: step time and peak memory, autocastfx vs torch.autocast + GradScaler vs float32.

    python bench/gpu.py                 # on a CUDA machine: ResNet-50, ViT-B/16, GPT-2 124M
    python bench/gpu.py --dry-run       # anywhere: tiny sizes, two steps each, checks the script itself
                                        # (torch.compile rows included: needs a C++ compiler; --no-compile)

Correctness first (the loss after 20 steps close to autocast's), then the median of CUDA-event timings after
warm-up, and peak memory. Prints a Markdown table for docs/benchmarks.md.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autocastfx  # noqa: E402
from models import GPT2, ResNet50, ViT, lm_loss  # noqa: E402


def workloads(dry):
    if dry:
        return [("ResNet-50", lambda: ResNet50(classes=10, layers=(1, 1, 1, 1)), (2, 3, 32, 32), 10, F.cross_entropy),
                ("GPT-2", lambda: GPT2(vocab=1001, ctx=64, d=64, depth=2, heads=4), (2, 16), 1001, lm_loss)]
    return [("ResNet-50 b256 224px", ResNet50, (256, 3, 224, 224), 1000, F.cross_entropy),
            ("ViT-B/16 b64 224px", lambda: ViT(image=224), (64, 3, 224, 224), 1000, F.cross_entropy),
            ("GPT-2 124M b8 seq1024", GPT2, (8, 1024), 50257, lm_loss)]


def batch(shape, classes, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if len(shape) == 2:  # token ids; the target is the next token
        ids = torch.randint(0, classes, shape, generator=g)
        return (ids.to(device),), torch.roll(ids, -1, 1).to(device)
    return (torch.randn(shape, generator=g).to(device),), torch.randint(0, classes, (shape[0],), generator=g).to(device)


def make_step(recipe, model, loss_fn, example, device):
    model = copy.deepcopy(model).to(device)
    if recipe.startswith("fp32"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = recipe == "fp32+tf32"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(*x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if recipe.startswith("autocast+"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
        scaler = torch.amp.GradScaler(device)
        if recipe.endswith("compile"):
            model.compile()

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.float16):
                out = model(*x)
            loss = loss_fn(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()
        return step
    gm = autocastfx.convert(model, example)  # padding to multiples of 8 on (the default)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-4))
    if recipe.endswith("compile"):
        gm.compile()  # nn.Module.compile(): the same module, its forward compiled in place; the step stays eager
    return step


def timed(step, data, device, warmup, iters):
    for i in range(warmup):
        step(*data[i % len(data)])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(iters):
        x, y = data[i % len(data)]
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(x, y)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", default=None, help="run the workloads whose name contains this")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    recipes = ["fp32", "fp32+tf32", "autocast+GradScaler", "autocast+GradScaler compile", "autocastfx",
               "autocastfx compile"]
    if args.no_compile:
        recipes = [r for r in recipes if not r.endswith("compile")]
    warmup, iters, check_steps = (1, 2, 3) if args.dry_run else (10, args.iters, 20)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    print(f"device: {name}, torch {torch.__version__}\n")
    print("| model | recipe | step ms | vs autocast | peak GiB | loss after check |")
    print("|---|---|---:|---:|---:|---:|")
    for wname, make, shape, classes, loss_fn in workloads(args.dry_run):
        if args.only and args.only not in wname:
            continue
        torch.manual_seed(0)
        model = make()
        data = [batch(shape, classes, device, s) for s in range(4)]
        losses, rows = {}, []
        for recipe in recipes:
            step = make_step(recipe, model, loss_fn, data[0][0], device)
            for i in range(check_steps):
                loss = step(*data[i % len(data)])
            losses[recipe] = float(loss)
            t, peak = timed(step, data, device, warmup, iters)
            rows.append((recipe, t, peak))
            del step
            torch._dynamo.reset()  # compiled code holds the module: let it go before the next recipe's peak
            if device == "cuda":
                torch.cuda.empty_cache()
        ref = {r: t for r, t, _ in rows}.get("autocast+GradScaler")
        for recipe, t, peak in rows:
            print(f"| {wname} | {recipe} | {t * 1e3:.1f} | {ref / t:.2f}x | {peak / 2**30:.2f} | {losses[recipe]:.4f} |")
        for recipe in close_to_autocast(losses, check_steps):
            print(f"| {wname} | CHECK FAILED | {recipe}: loss after {check_steps} steps {losses[recipe]:.4f}, "
                  f"autocast {losses['autocast+GradScaler']:.4f} | | | |")


def close_to_autocast(losses, steps, rtol=0.05):
    """The mixed-precision recipes whose loss after the check steps is not within ``rtol`` of autocast+GradScaler's
    (float32 rows are shown, not checked: they round differently by design)."""
    a = losses["autocast+GradScaler"]
    return [r for r, b in losses.items() if not r.startswith("fp32") and not abs(a - b) <= rtol * abs(a) + 1e-3]


if __name__ == "__main__":
    main()
