"""The README's demo runs end to end (one epoch here), says which dtype it chose and why, and reports both
accuracies."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autocastfx.core import devices

ROOT = Path(__file__).resolve().parent.parent


def test_train_digits_runs(tmp_path):
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "1",
                           "--plot", str(tmp_path / "loss.png")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # dtype="auto": what it chose on this CPU and why (float32 compute where no low dtype is native)
    chosen = out.split("autocastfx dtype: ", 1)[1].split()[0]
    assert chosen in ("float32", "bfloat16", "float16")
    assert f"autocastfx dtype: {chosen} (auto: {chosen} on this CPU: " in out
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[chosen]
    assert "test accuracy: float32" in out and f"autocastfx {short}" in out
    if devices.cpu_features():
        assert chosen == str(devices.choose(torch.device("cpu"))[0]).removeprefix("torch.")
    assert "def train_step(step, inputs, *targets)" in out and "casts per forward" in out
    acc = [float(tok.rstrip("%")) for tok in out.split("test accuracy:")[1].split("\n")[0].split() if tok.endswith("%")]
    assert len(acc) == 2 and acc[1] > 80.0  # one epoch already learns the digits


# the trainer examples, small: each is a function call with tiny settings

def _example(name):
    import importlib
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_train_lightning_runs(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("lightning")
    res = _example("train_lightning").main(["--epochs", "3", "--limit-batches", "8", "--resume-check", "--out", str(tmp_path)])
    assert res["losses"][-1] < res["losses"][0] and res["val_acc"] > 0.3  # chance: 0.1
    assert res["scale_log"] and res["resume_identical"]


def test_train_hf_trainer_runs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    res = _example("train_hf_trainer").main(["--steps", "4", "--train-size", "64", "--log-every", "2",
                                             "--out", str(tmp_path)])
    assert len(res["losses"]) == 2 and res["losses"][1] < res["losses"][0]
    assert all(s >= 1 for s in res["scales"]) and res["eval_loss"] < 4
