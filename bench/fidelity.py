"""Fidelity where it counts: how far from float32 a low-precision residual stream and embeddings put a model,
against torch.autocast, and what keeping them float32 (``Policy.widest``) costs.

    python bench/fidelity.py [--steps 300] [--quick] [--markdown FILE]

Training: a nanoGPT-style GPT (examples/train_nanogpt.py's model: 4 layers, d128, character corpus), trained
``--steps`` steps from the same initialisation on the same batches by float32, torch.autocast (bfloat16) and
autocastfx (bfloat16) with the min-cut's choice (``widest=False``) and with autocast's widest-type rule
(``widest=True``); without dropout (the runs see identical data and no randomness) and with dropout 0.1 (each
recipe draws its own masks: the distance then includes dropout noise). The distance is the mean, over steps,
of |loss - float32's loss| at the same step.

Eval: the relative error of the output against float64 of the same weights, for each recipe: the trained GPT's
logits, a ViT (bench/models.py, 6 layers, d256) and a ResNet-style convnet (bench/models.py) on random inputs.

Costs (per forward of the converted module, from its report): casts and cast bytes, parameters stored low, and
the bytes of parameters + masters; plus the median training step time on this CPU.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "bench")]

import autocastfx  # noqa: E402
import models as bench_models  # noqa: E402
import train_nanogpt as nano  # noqa: E402

LOW = torch.bfloat16
RECIPES = ("float32", "autocast", "autocastfx", "autocastfx widest")


def _policy(widest: bool) -> autocastfx.Policy:
    return autocastfx.Policy.default().override(widest=widest)


def _gpt(dropout: float, n_layer: int, n_embd: int, vocab: int, block: int) -> nn.Module:
    torch.manual_seed(0)
    cfg = nano.GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=4, n_embd=n_embd,
                         dropout=dropout, bias=True)
    return nano.GPT(cfg)


def _batches(steps: int, block: int, batch: int):
    text = nano.corpus(400)
    tok = nano.Chars(text)
    data = tok.encode(text)
    g = torch.Generator().manual_seed(1)
    return len(tok.itos), [nano.get_batch(data, block, batch, g) for _ in range(steps)]


def train(recipe: str, model: nn.Module, batches: list, lr: float = 1e-3) -> tuple[list[float], float, nn.Module]:
    """Per-step losses, the median step time (ms) and the trained module."""
    model = copy.deepcopy(model).train()
    losses, times = [], []
    torch.manual_seed(2)  # the same dropout masks for recipes that draw them alike
    if recipe.startswith("autocastfx"):
        x0, y0 = batches[0]
        gm = autocastfx.convert(model, (x0, y0), dtype=LOW, policy=_policy(recipe.endswith("widest")))
        opt = torch.optim.AdamW(gm.parameters(), lr=lr, fused=True)
        step = autocastfx.train_step(gm, lambda out: out[1], opt)
        for x, y in batches:
            t = time.perf_counter()
            loss = step((x, y))
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
        return losses, 1e3 * statistics.median(times), gm
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    for x, y in batches:
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=LOW, enabled=recipe == "autocast"):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return losses, 1e3 * statistics.median(times), model


def _eval_errors(model: nn.Module, inputs: tuple, pick=lambda out: out) -> dict[str, float]:
    """Relative L2 error of each recipe's eval output against float64 of the same weights."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref = pick(copy.deepcopy(model).double()(*[i.double() if i.is_floating_point() else i for i in inputs]))
        out = {"float32": pick(model(*inputs))}
        with torch.autocast("cpu", dtype=LOW):
            out["autocast"] = pick(model(*inputs))
    for recipe in ("autocastfx", "autocastfx widest"):
        gm = autocastfx.convert(model, inputs, dtype=LOW, policy=_policy(recipe.endswith("widest"))).eval()
        with torch.no_grad():
            out[recipe] = pick(gm(*inputs))
    return {k: float((v.double() - ref).norm() / ref.norm()) for k, v in out.items()}


@dataclasses.dataclass
class Costs:
    casts: int
    cast_mb: float
    low_params: int
    weights_mb: float   # the parameters, as stored (float32: no master copies beside them)


def costs(gm: nn.Module) -> Costs:
    t = autocastfx.report(gm).totals
    casts = t.get("casts", 0)
    cast_bytes = t.get("cast_bytes", 0)
    low = t.get("low_parameters", 0)
    for name, b in (t.get("blocks") or {}).items():  # converted blocks: each its own plan
        unit = autocastfx.report(gm.get_submodule(name)).totals
        casts, cast_bytes, low = casts + unit["casts"], cast_bytes + unit["cast_bytes"], low + unit["low_parameters"]
    weights = {id(p): p.numel() * p.element_size() for p in gm.parameters()}
    return Costs(casts, cast_bytes / 2**20, low, sum(weights.values()) / 2**20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="20 steps, a 2-layer d64 GPT: a smoke run")
    ap.add_argument("--markdown", help="write the tables as markdown to this file")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 20 if args.quick else args.steps
    n_layer, n_embd, block, batch = (2, 64, 32, 8) if args.quick else (4, 128, 64, 16)
    vocab, batches = _batches(steps, block, batch)
    lines = [f"fidelity: torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{datetime.date.today()}, {steps} steps, GPT {n_layer} layers d{n_embd}, batch {batch}x{block}"]

    train_rows = []
    trained = None
    for dropout in (0.0, 0.1):
        model = _gpt(dropout, n_layer, n_embd, vocab, block)
        runs = {r: train(r, model, batches) for r in RECIPES}
        ref = runs["float32"][0]
        for r in RECIPES:
            losses, ms, mod = runs[r]
            dist = [abs(a - b) for a, b in zip(losses, ref)]
            c = costs(mod) if r.startswith("autocastfx") else None
            train_rows.append((f"GPT dropout {dropout}", r, statistics.fmean(dist), max(dist), losses[-1], ms, c))
        if dropout == 0.0:
            trained = runs["float32"][2]

    eval_rows = []
    x_tok = batches[0][0]
    eval_rows.append(("GPT (trained, logits)", _eval_errors(trained, (x_tok, batches[0][1]), lambda o: o[0])))
    torch.manual_seed(0)
    vit = bench_models.ViT(image=32, patch=8, d=256, depth=6, heads=8, classes=100) if not args.quick else \
        bench_models.ViT(image=32, patch=8, d=64, depth=2, heads=4, classes=10)
    eval_rows.append(("ViT", _eval_errors(vit, (torch.randn(8, 3, 32, 32),))))
    torch.manual_seed(0)
    cnn = bench_models.ResNet50(classes=100) if not args.quick else bench_models.ResNet18(classes=10, width=16)
    eval_rows.append(("ResNet-50", _eval_errors(cnn, (torch.randn(4, 3, 64, 64),))))

    out = lines + ["", "Training: distance of the per-step loss from float32's (same init, same batches)",
                   "| model | recipe | mean |loss - fp32| | max | final loss | ms/step | casts/fwd | cast MB/fwd "
                   "| params stored low | weights MB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r, mean, mx, last, ms, c in train_rows:
        cost = (f"{c.casts} | {c.cast_mb:.2f} | {c.low_params} | {c.weights_mb:.2f}" if c else "- | - | - | -")
        out.append(f"| {name} | {r} | {mean:.5f} | {mx:.5f} | {last:.4f} | {ms:.1f} | {cost} |")
    for name in sorted({row[0] for row in train_rows}):
        d = {row[1]: row[2] for row in train_rows if row[0] == name}
        out.append(f"\n{name}: distance against autocast's: min-cut {d['autocastfx'] / d['autocast']:.2f}x, "
                   f"widest {d['autocastfx widest'] / d['autocast']:.2f}x (target: at most 1.5x)")
    out += ["", "Eval: relative error of the output against float64", "| model | " + " | ".join(RECIPES) +
            " | min-cut / autocast | widest / autocast |", "|---|" + "---:|" * (len(RECIPES) + 2)]
    for name, e in eval_rows:
        out.append(f"| {name} | " + " | ".join(f"{e[r]:.2e}" for r in RECIPES)
                   + f" | {e['autocastfx'] / e['autocast']:.2f}x | {e['autocastfx widest'] / e['autocast']:.2f}x |")
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
