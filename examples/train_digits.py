"""Train a small CNN on scikit-learn's digits (1,797 real 8x8 images, shipped with scikit-learn: no download),
once in float32 and once converted by autocastfx with its generated training step.

    python examples/train_digits.py [--epochs 12] [--dtype auto|fp16|bf16] [--plot loss.png]

``--dtype auto`` (the default) takes the dtype that pays on this machine and prints why: bfloat16 on a CPU with
AVX512-BF16 or AMX, float16 on one with AVX512-FP16, float32 compute elsewhere (on an AVX2 CPU bfloat16 and
float16 run emulated, tens of times slower than float32); fp16 and bf16 force one.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autocastfx

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    def tqdm(it, **_):
        return it


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


def data(seed=0):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def batches(x, y, size, gen):
    order = torch.randperm(len(x), generator=gen)
    for i in range(0, len(x) - size + 1, size):
        idx = order[i:i + size]
        yield x[idx], y[idx]


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item() * 100
    model.train()
    return acc


def train(name, model, step_fn, x_tr, y_tr, epochs, batch):
    gen = torch.Generator().manual_seed(1)
    losses = []
    t0 = time.perf_counter()
    for _ in tqdm(range(epochs), desc=f"{name:>9}", unit="epoch"):
        for xb, yb in batches(x_tr, y_tr, batch, gen):
            losses.append(step_fn(xb, yb))
    return [float(v) for v in losses], time.perf_counter() - t0


def _speed_note(chosen):
    if chosen == torch.float32:
        return "float32 compute, as the baseline: no low dtype runs natively on this CPU"
    return (f"{str(chosen)[6:]}: fast with native instructions (AVX512-BF16/AMX for bfloat16, or a tensor-core "
            "GPU), tens of times slower than float32 where a CPU emulates it")


def print_scale(step, scaled):
    stats = step.stats.summary()
    history = step.stats.history()
    if not scaled:
        print(f"loss scaling: off, float16 gradients need it and these are not ({stats['steps']} steps, "
              f"{stats['skipped']} skipped)")
        return
    changes = [(i, s) for i, (s, _) in enumerate(history) if i == 0 or s != history[i - 1][0]]
    print(f"loss scale: {stats['scale']:g} after {stats['steps']} steps, {stats['skipped']} skipped; "
          "changes (step, scale): " + ", ".join(f"({i}, {s:g})" for i, s in changes)
          + ("  [init_scale='auto': the first update runs at scale 1, then the scale moves to the largest power "
             "of two its gradients allow]" if changes and changes[0][1] == 1 else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", choices=["auto", "fp16", "bf16"], default="auto")
    ap.add_argument("--plot", default="digits_loss.png", help="loss-curve PNG (needs matplotlib)")
    args = ap.parse_args()
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = data()
    print(f"digits: {len(x_tr)} training and {len(x_te)} test images of 8x8\n")

    # float32 baseline
    fp32 = DigitsCNN()
    mixed_source = DigitsCNN()
    mixed_source.load_state_dict(fp32.state_dict())  # the same initial weights for both runs
    opt = torch.optim.AdamW(fp32.parameters(), lr=3e-3, weight_decay=1e-4)

    def fp32_step(xb, yb):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fp32(xb), yb)
        loss.backward()
        opt.step()
        return loss.detach()

    fp32_losses, fp32_time = train("float32", fp32, fp32_step, x_tr, y_tr, args.epochs, args.batch)

    # mixed precision: one call to convert, one to train_step
    dtype = {"auto": "auto", "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gm = autocastfx.convert(mixed_source, (x_tr[: args.batch],), dtype=dtype)
    chosen = gm.meta["autocastfx"].dtype
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[chosen]
    print(f"autocastfx dtype: {str(chosen)[6:]} ({autocastfx.report(gm).totals.get('dtype_choice') or 'asked for'})\n")
    opt_mixed = torch.optim.AdamW(mixed_source.parameters(), lr=3e-3, weight_decay=1e-4, fused=True)
    # float16 gradients need loss scaling; bfloat16's range and float32's do not
    step = autocastfx.train_step(gm, F.cross_entropy, opt_mixed,
                                 loss_scale="dynamic" if chosen == torch.float16 else None)
    mixed_losses, mixed_time = train(f"{name} ({args.dtype})", gm, step, x_tr, y_tr, args.epochs, args.batch)

    acc32, accmp = accuracy(fp32, x_te, y_te), accuracy(gm, x_te, y_te)
    print(f"\ntest accuracy: float32 {acc32:.2f}%   autocastfx {name} {accmp:.2f}%   "
          f"(difference {accmp - acc32:+.2f} points)")
    print(f"train time on this machine: float32 {fp32_time:.1f}s, autocastfx {name} {mixed_time:.1f}s "
          f"({_speed_note(chosen)})\n")
    print(autocastfx.report(gm))
    print("\nthe training step:\n")
    print(step.code)
    print_scale(step, chosen == torch.float16)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(fp32_losses, label=f"float32 (test {acc32:.1f}%)", alpha=0.8)
    ax.plot(mixed_losses, label=f"autocastfx {name} (test {accmp:.1f}%)", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("digits CNN: float32 vs autocastfx mixed precision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"loss curves written to {args.plot}")


if __name__ == "__main__":
    main()
