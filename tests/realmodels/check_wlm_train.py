"""pytorch/examples' word language model (``word_language_model/main.py``), run as its README runs it on a CPU:
as it is, under ``torch.autocast`` (its two model calls wrapped, for comparison only), and with the line a user adds
after the model is built::

    model = autocastfx.convert(model, (train_data[:args.bptt],))                                   # Transformer
    model = autocastfx.convert(model, (train_data[:args.bptt], model.init_hidden(args.batch_size))) # LSTM

main.py saves the whole module (``torch.save(model, f)``), which a converted module refuses, naming
``torch.save(model.state_dict(), f)``: the run with the line alone must stop there with that message, and the run
with the line and that change (save and load of the state dict) must train as the float32 run does. Each run's
saved state is then loaded into main.py's plain model class and scored on the test split.

    python tests/realmodels/check_wlm_train.py /path/to/examples/word_language_model [--model Transformer|LSTM]

The folder is copied to a temporary directory. Where its ``data/wikitext-2/train.txt`` is absent, the runs train on
wikitext-2's validation text and validate and test on the two halves of its test text. Exits 1 where the converted
run's test loss is more than 0.1 from the float32 run's, or its checkpoint scores other than the run reported.
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
BUILT = {"Transformer": "model = TransformerModel(", "LSTM": "model = RNNModel("}
LINE = {"Transformer": "import autocastfx; model = autocastfx.convert(model, (train_data[:args.bptt],))\n",
        "LSTM": "import autocastfx; model = autocastfx.convert(model, (train_data[:args.bptt], "
                "model.init_hidden(args.batch_size)))\n"}
SAVE = ("                torch.save(model, f)\n", "                torch.save(model.state_dict(), f)\n")
LOAD = ("        model = torch.load(f)\n", "        model.load_state_dict(torch.load(f))\n")

SCORE = r"""
import math, sys, torch, torch.nn as nn
import data
from model import RNNModel, TransformerModel
kind, emsize, nhid, layers, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
corpus = data.Corpus('./data/run')
n = len(corpus.dictionary)
m = TransformerModel(n, emsize, 2, nhid, layers) if kind == 'Transformer' else RNNModel(kind, n, emsize, nhid, layers)
saved = torch.load(path, weights_only=False)  # the float32 run's main.py saves the whole module
m.load_state_dict(saved.state_dict() if isinstance(saved, nn.Module) else saved); m.eval()
test = corpus.test[:corpus.test.size(0) // 10 * 10].view(10, -1).t().contiguous()
total, hidden = 0.0, None if kind == 'Transformer' else m.init_hidden(10)
with torch.no_grad():
    for i in range(0, test.size(0) - 1, 35):
        seq = min(35, len(test) - 1 - i)
        x, y = test[i:i + seq], test[i + 1:i + 1 + seq].reshape(-1)
        if hidden is None:
            out = m(x)
        else:
            out, hidden = m(x, hidden)
        total += seq * nn.NLLLoss()(out.view(-1, n), y).item()
print(total / (len(test) - 1))
"""


def _data(work: str) -> None:
    src, dst = os.path.join(work, "data", "wikitext-2"), os.path.join(work, "data", "run")
    os.makedirs(dst, exist_ok=True)
    if os.path.exists(os.path.join(src, "train.txt")):
        for name in ("train.txt", "valid.txt", "test.txt"):
            shutil.copy(os.path.join(src, name), dst)
        return
    shutil.copy(os.path.join(src, "valid.txt"), os.path.join(dst, "train.txt"))
    with open(os.path.join(src, "test.txt")) as f:
        lines = f.readlines()
    half = len(lines) // 2
    for name, part in (("valid.txt", lines[:half]), ("test.txt", lines[half:])):
        with open(os.path.join(dst, name), "w") as f:
            f.writelines(part)


def _edit(work: str, kind: str, how: str) -> None:
    path = os.path.join(work, "main.py")
    with open(path) as f:
        src = f.read()
    if how in ("line", "line+state"):
        at = src.index(BUILT[kind])
        end = src.index("\n", at) + 1
        src = src[:end] + " " * 4 + LINE[kind] + src[end:]
    if how == "line+state":
        for old, new in (SAVE, LOAD):
            assert src.count(old) == 1, "main.py has changed: make the change by hand"
            src = src.replace(old, new)
        src = src.replace("    with torch.serialization.safe_globals(safe_globals):\n" + LOAD[1],
                          "    if True:\n" + LOAD[1])
    if how == "autocast":  # for comparison only: the model's two calls in training, and the one in evaluation
        src = src.replace("output = model(data)", "with torch.autocast('cpu', torch.bfloat16): output = model(data)")
        src = src.replace("output, hidden = model(data, hidden)",
                          "with torch.autocast('cpu', torch.bfloat16): output, hidden = model(data, hidden)")
        for old, new in (SAVE, LOAD):
            src = src.replace(old, new)
        src = src.replace("    with torch.serialization.safe_globals(safe_globals):\n" + LOAD[1],
                          "    if True:\n" + LOAD[1])
    with open(path, "w") as f:
        f.write(src)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wlm")
    parser.add_argument("--model", default="Transformer", choices=sorted(BUILT))
    parser.add_argument("--epochs", type=int, default=3)
    a = parser.parse_args()
    size = ["--emsize", "64", "--nhid", "128", "--nlayers", "2"]
    args = ["--data", "./data/run", "--model", a.model, "--lr", "5" if a.model == "Transformer" else "20", *size]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("line", "float32", "autocast", "line+state"):
            work = os.path.join(tmp, how)
            shutil.copytree(a.wlm, work)
            _data(work)
            _edit(work, a.model, how)
            epochs = ["--epochs", "1", "--dry-run"] if how == "line" else ["--epochs", str(a.epochs)]
            out = subprocess.run([sys.executable, "main.py", *args, *epochs, "--save", "model.pt"], cwd=work,
                                 env=env, capture_output=True, text=True)
            if how == "line":
                refused = out.returncode != 0 and "torch.save(gm.state_dict())" in out.stderr
                print(f"the line alone: torch.save(model, f) {'refused, naming torch.save(gm.state_dict())' if refused else 'NOT REFUSED AS EXPECTED'}")
                ok = ok and refused
                continue
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            val = [float(v) for v in re.findall(r"valid loss\s+([\d.]+)", out.stdout)]
            test = float(re.findall(r"test loss\s+([\d.]+)", out.stdout)[-1])
            score = subprocess.run([sys.executable, "-c", SCORE, a.model, "64", "128", "2", "model.pt"], cwd=work,
                                   env=env, capture_output=True, text=True)
            if score.returncode:
                raise SystemExit(score.stderr[-3000:])
            scored = float(score.stdout.split()[-1])
            results[how] = (val, test, scored)
            print(f"{how}: valid loss {' -> '.join(f'{v:.2f}' for v in val)}; test loss {test:.2f}; its checkpoint "
                  f"loaded into the plain model scores {scored:.3f}", flush=True)
    ref, ours = results["float32"], results["line+state"]
    ok = ok and abs(ours[1] - ref[1]) <= 0.1 and abs(ours[2] - ours[1]) <= 0.01
    print("word_language_model main.py: " + ("the checkpoint is the trained model" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
