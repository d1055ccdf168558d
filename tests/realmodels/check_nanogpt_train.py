"""nanoGPT's own train.py, run as its README runs it on a CPU, once as it is and once with the one line a user adds
(``model = autocastfx.convert(model, example_inputs=get_batch('train'))`` after ``model.to(device)``). Each run's
checkpoint is then loaded into nanoGPT's plain ``GPT`` class, as its sample.py loads one, and scored on the same
validation batches: the checkpoint must be the model the run trained.

    python tests/realmodels/check_nanogpt_train.py /path/to/nanoGPT [--iters 600]

The checkout is copied to a temporary directory. Its data step downloads Tiny Shakespeare; with no network, the
corpus is the Python standard library's ``*.py`` text (ASCII, about 1.1 MB), prepared by nanoGPT's own
``data/shakespeare_char/prepare.py``. Prints one line per run and exits 1 where a checkpoint scores more than 0.1
above the other run's, or its training loss is not within 0.1 of the float32 run's.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = "import autocastfx; model = autocastfx.convert(model, example_inputs=get_batch('train'))\n"

SCORE = r"""
import sys, numpy as np, torch
from model import GPT, GPTConfig
ck = torch.load('out-shakespeare-char/ckpt.pt', map_location='cpu')
sd = {k.removeprefix('_orig_mod.'): v for k, v in ck['model'].items()}
m = GPT(GPTConfig(**ck['model_args'])); m.load_state_dict(sd); m.eval()
data = np.memmap('data/shakespeare_char/val.bin', dtype=np.uint16, mode='r')
g, bs = torch.Generator().manual_seed(0), ck['model_args']['block_size']
with torch.no_grad():
    losses = []
    for _ in range(40):
        ix = torch.randint(len(data) - bs, (12,), generator=g)
        x = torch.stack([torch.from_numpy(data[i:i + bs].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + bs].astype(np.int64)) for i in ix])
        losses.append(m(x, y)[1].item())
print(ck['iter_num'], float(ck['best_val_loss']), float(np.mean(losses)))
"""


def _corpus(path: str) -> None:
    if os.path.exists(path):
        return
    parts, size = [], 0
    for name in sorted(os.listdir(sysconfig.get_paths()["stdlib"])):
        if name.endswith(".py") and size < 1_100_000:
            with open(os.path.join(sysconfig.get_paths()["stdlib"], name), errors="ignore") as f:
                text = "".join(c for c in f.read() if ord(c) < 128)
            parts.append(text)
            size += len(text)
    with open(path, "w") as f:
        f.write("".join(parts))


def _run(work: str, iters: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    args = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
            "--log_interval=100", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={iters // 3}",
            "--always_save_checkpoint=True"]
    out = subprocess.run([sys.executable, "train.py", *args], cwd=work, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    val = [float(v) for v in re.findall(r"val loss ([\d.]+)", out.stdout)]
    score = subprocess.run([sys.executable, "-c", SCORE], cwd=work, env=env, capture_output=True, text=True)
    if score.returncode:
        raise SystemExit(score.stderr[-3000:])
    it, best, scored = score.stdout.split()[-3:]
    return {"val": val, "iter": int(it), "best": float(best), "scored": float(scored)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nanogpt")
    parser.add_argument("--iters", type=int, default=600)
    a = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("float32", "autocastfx"):
            work = os.path.join(tmp, name)
            shutil.copytree(a.nanogpt, work, ignore=shutil.ignore_patterns(".git", "out-*"))
            data = os.path.join(work, "data", "shakespeare_char")
            _corpus(os.path.join(data, "input.txt"))
            # prepare.py imports requests for the download it skips where input.txt is there
            stub = os.path.join(tmp, "stub")
            os.makedirs(stub, exist_ok=True)
            open(os.path.join(stub, "requests.py"), "w").close()
            subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": stub})
            if name == "autocastfx":
                with open(os.path.join(work, "train.py")) as f:
                    src = f.read()
                assert src.count("model.to(device)\n") == 1, "train.py has changed: place the line by hand"
                with open(os.path.join(work, "train.py"), "w") as f:
                    f.write(src.replace("model.to(device)\n", "model.to(device)\n" + LINE))
            results[name] = r = _run(work, a.iters)
            print(f"{name}: val loss {' -> '.join(f'{v:.4f}' for v in r['val'])}; checkpoint at iter {r['iter']} "
                  f"(val {r['best']:.4f} in training) loaded into GPT scores {r['scored']:.4f}", flush=True)
    ref, ours = results["float32"], results["autocastfx"]
    ok = abs(ours["scored"] - ref["scored"]) <= 0.1 and abs(ours["val"][-1] - ref["val"][-1]) <= 0.1
    print("nanoGPT train.py: " + ("the checkpoint is the trained model" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
