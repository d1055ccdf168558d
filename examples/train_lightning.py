"""Train an MLP on scikit-learn's digits (shipped with scikit-learn: no download) with Lightning, the mixed
precision coming from autocastfx's precision plugin: the LightningModule is the one you would write for float32.

    python examples/train_lightning.py [--epochs 6] [--dtype fp16|bf16] [--out lightning_out] [--float32]

Accumulation, clipping, a per-update schedule and validation every epoch are on; the last checkpoint is
resumed at the end (--resume-check) and must give the same weights. The logs (CSV) hold loss_scale,
skipped_steps and grad_norm at each logging interval.
"""
import argparse
import csv
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
except ImportError as e:
    raise SystemExit("this example needs Lightning: pip install 'autocastfx[lightning]'") from e

from autocastfx.integrations.lightning import MixedPrecision


class Digits(L.LightningModule):
    def __init__(self, lr=3e-3, total_steps=100):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                                   nn.Linear(64, 10))
        self.lr, self.total_steps = lr, total_steps
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.detach())  # read after training: no host sync a step
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders(batch_size):
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    tr, va = order[:1400], order[1400:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return (DataLoader(TensorDataset(x[tr], y[tr]), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(1)),
            DataLoader(TensorDataset(x[va], y[va]), batch_size=256))


def fit(args, epochs, ckpt_path=None, float32=False):
    torch.manual_seed(0)
    train, val = loaders(args.batch_size)
    batches = min(len(train), args.limit_batches or len(train))
    steps = -(-batches // args.accumulate) * args.epochs
    module = Digits(total_steps=steps)
    plugins = None if float32 else [MixedPrecision(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float16)]
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=plugins,
                        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, log_every_n_steps=5,
                        logger=CSVLogger(args.out, name="float32" if float32 else "autocastfx"),
                        callbacks=[ModelCheckpoint(dirpath=f"{args.out}/checkpoints", save_last=True)],
                        limit_train_batches=args.limit_batches, default_root_dir=args.out,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (by norm, after unscaling)")
    ap.add_argument("--limit-batches", type=int, default=None, help="training batches an epoch (all by default)")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--out", default="lightning_out")
    ap.add_argument("--float32", action="store_true", help="also train the same Trainer in float32 and compare")
    ap.add_argument("--resume-check", action="store_true",
                    help="train to the last epoch but one, resume from its checkpoint and compare with the whole run")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's advice on dataloader workers, on a 2-CPU laptop

    module, trainer = fit(args, args.epochs)
    losses = torch.stack(module.losses).tolist()
    per_epoch = len(losses) // args.epochs
    print("train loss by epoch:", " ".join(f"{sum(losses[i:i + per_epoch]) / per_epoch:.3f}"
                                           for i in range(0, per_epoch * args.epochs, per_epoch)))
    metrics = trainer.callback_metrics
    print(f"val loss {float(metrics['val_loss']):.3f}, val accuracy {float(metrics['val_acc']) * 100:.1f}%")
    s = trainer.precision_plugin.step.stats.summary()
    print(f"loss scale {s['scale']:g}, {s['steps']} updates, {s['skipped']} skipped, "
          f"last grad norm {s['grad_norm']:.3f}")
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        scales = [(r["step"], r["loss_scale"]) for r in csv.DictReader(f) if r.get("loss_scale")]
    print(f"loss_scale in the CSV log at {len(scales)} steps ({scales[0][0]} to {scales[-1][0]}): "
          f"{' '.join(f'{v:g}' for v in sorted({float(v) for _, v in scales}))}")
    result = {"losses": losses, "val_loss": float(metrics["val_loss"]), "val_acc": float(metrics["val_acc"]),
              "scale_log": scales}

    if args.float32:
        ref, _ = fit(args, args.epochs, float32=True)
        ref_losses = torch.stack(ref.losses).tolist()
        worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(f"float32 run of the same Trainer: largest per-step loss difference {worst:.2e}")
        result["float32_diff"] = worst
    if args.resume_check and args.epochs > 1:
        fit(args, args.epochs - 1)
        resumed, _ = fit(args, args.epochs, ckpt_path=f"{args.out}/checkpoints/last.ckpt")
        same = all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(),
                                                     resumed.model.state_dict().values()))
        print(f"resumed from epoch {args.epochs - 1}'s checkpoint: weights {'identical' if same else 'DIFFER'}")
        result["resume_identical"] = same
    return result


if __name__ == "__main__":
    main()
