"""timm's own ``train.py``, run on a CPU three ways on the same data and seed: as it is, with its ``--amp
--amp-dtype bfloat16`` (torch.autocast and its loss scaler), and with the line a user adds after the model is moved
to its device::

    import autocastfx; model = autocastfx.convert(model, example_inputs=(torch.zeros(2, *data_config['input_size'], device=device),))

with EMA (``--model-ema``) and timm's CheckpointSaver on. Each run's ``last.pth.tar`` (model and EMA) is loaded into
a fresh ``timm.create_model`` and scored on the validation split with train.py's own eval transforms: it must score
what train.py reported for the model it trained. The converted run is then resumed (``--resume``) for two epochs.

    python tests/realmodels/check_timm_train.py /path/to/pytorch-image-models [--model resnet10t]

The dataset is made here: an ImageFolder of 4 classes of 32x32 images (24 train and 8 validation images a class),
told apart by colour and a gradient. timm itself must be importable (the installed timm runs the repository's
train.py). Exits 1 where a checkpoint scores more than 1e-3 from what its run reported, or the converted run's last
validation loss is more than 0.1 from the float32 run's.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AFTER = "    if args.channels_last:\n        model.to(memory_format=torch.channels_last)\n"
LINE = ("    import autocastfx; model = autocastfx.convert(model, example_inputs=(torch.zeros(2, "
        "*data_config['input_size'], device=device),))\n")
TEST = re.compile(r"^Test( \(EMA\))?: \[\s*(\d+)/(\d+)\].*Loss:\s*[\d.]+\s*\(\s*([\d.]+)\)", re.M)

SCORE = r"""
import sys, torch, timm
from timm.data import create_dataset, create_loader, resolve_data_config
model, path = sys.argv[1], sys.argv[2]
ck = torch.load(path, map_location='cpu', weights_only=False)
for key in ('state_dict', 'state_dict_ema'):
    m = timm.create_model(model, num_classes=4); m.load_state_dict(ck[key]); m.eval()
    cfg = resolve_data_config({'input_size': (3, 32, 32)}, model=m)
    ds = create_dataset('', root='data', split='validation', is_training=False, batch_size=16)
    ld = create_loader(ds, input_size=cfg['input_size'], batch_size=16, is_training=False, use_prefetcher=False,
                       interpolation=cfg['interpolation'], mean=cfg['mean'], std=cfg['std'], num_workers=0,
                       crop_pct=cfg['crop_pct'], device=torch.device('cpu'))
    total = n = 0
    with torch.no_grad():
        for x, y in ld:
            total += torch.nn.functional.cross_entropy(m(x), y).item() * len(y); n += len(y)
    print(total / n)
"""


def _images(root: str) -> None:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("validation", 8)):
        for c in range(4):
            d = os.path.join(root, split, f"class{c}")
            os.makedirs(d, exist_ok=True)
            for i in range(n):
                base = np.zeros((32, 32, 3))
                base[..., c % 3] = 120 + 60 * (c // 3)
                img = base + rng.normal(0, 40, base.shape) + (2 * c * np.arange(32))[None, :, None]
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(d, f"{i}.png"))


def _reported(log: str) -> tuple[float, float]:
    """The last epoch's validation loss of the model and of its EMA, as train.py printed them."""
    last = {}
    for ema, i, total, loss in TEST.findall(log):
        if int(i) == int(total):
            last[bool(ema)] = float(loss)
    return last[False], last[True]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timm_repo")
    parser.add_argument("--model", default="resnet10t")
    parser.add_argument("--epochs", type=int, default=4)
    a = parser.parse_args()
    common = ["--data-dir", "data", "--model", a.model, "--num-classes", "4", "--input-size", "3", "32", "32",
              "-b", "16", "--workers", "0", "--lr", "0.05", "--warmup-epochs", "0", "--sched", "cosine", "--device",
              "cpu", "--seed", "0", "--model-ema", "--model-ema-decay", "0.9", "--log-interval", "2",
              "--no-prefetcher", "--checkpoint-hist", "1", "--output", "out"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    ok, results = True, {}
    with tempfile.TemporaryDirectory() as work:
        _images(os.path.join(work, "data"))
        with open(os.path.join(a.timm_repo, "train.py")) as f:
            src = f.read()
        assert src.count(AFTER) == 1, "train.py has changed: place the line by hand"
        shutil.copy(os.path.join(a.timm_repo, "train.py"), os.path.join(work, "train.py"))
        with open(os.path.join(work, "train_line.py"), "w") as f:
            f.write(src.replace(AFTER, AFTER + LINE))
        runs = {"float32": ("train.py", []), "autocast": ("train.py", ["--amp", "--amp-dtype", "bfloat16"]),
                "autocastfx": ("train_line.py", [])}
        for name, (script, extra) in runs.items():
            out = subprocess.run([sys.executable, script, *common, "--epochs", str(a.epochs), "--experiment", name,
                                  *extra], cwd=work, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            model, ema = _reported(out.stdout + out.stderr)
            score = subprocess.run([sys.executable, "-c", SCORE, a.model, f"out/{name}/last.pth.tar"], cwd=work,
                                   env=env, capture_output=True, text=True)
            if score.returncode:
                raise SystemExit(score.stderr[-3000:])
            s_model, s_ema = map(float, score.stdout.split()[-2:])
            results[name] = model
            ok = ok and abs(s_model - model) <= 1e-3 and abs(s_ema - ema) <= 1e-3
            print(f"{name}: validation loss {model:.3f} (EMA {ema:.3f}) as train.py reported it; its last.pth.tar "
                  f"loaded into a fresh {a.model} scores {s_model:.3f} (EMA {s_ema:.3f})", flush=True)
        out = subprocess.run([sys.executable, "train_line.py", *common, "--epochs", str(a.epochs + 2),
                              "--experiment", "resumed", "--resume", "out/autocastfx/last.pth.tar"], cwd=work,
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        epochs = sorted({int(e) for e in re.findall(r"Train: (\d+) \[", out.stdout + out.stderr)})
        model, ema = _reported(out.stdout + out.stderr)
        resumed = epochs == list(range(a.epochs, a.epochs + 2))
        ok = ok and resumed
        print(f"autocastfx resumed: epochs {epochs}, validation loss {model:.3f} (EMA {ema:.3f})")
    ok = ok and abs(results["autocastfx"] - results["float32"]) <= 0.1
    print("timm train.py: " + ("the checkpoints are the trained models" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
