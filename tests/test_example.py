"""The README's demo runs end to end (one epoch here) and reports both accuracies."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_train_digits_runs(tmp_path):
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "1",
                           "--plot", str(tmp_path / "loss.png")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "test accuracy: float32" in out and "autocastfx fp16" in out
    assert "def train_step(inputs, *targets):" in out and "casts per forward" in out
    acc = [float(tok.rstrip("%")) for tok in out.split("test accuracy:")[1].split("\n")[0].split() if tok.endswith("%")]
    assert len(acc) == 2 and acc[1] > 80.0  # one epoch already learns the digits
