"""The benchmark's measuring code runs and counts what it claims to (tiny models, seconds)."""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import gpu  # noqa: E402
from measure import (Counter, MemoryTracker, Runner, alive_storage_keys, convert_scaling,  # noqa: E402
                     interleaved_step_times, live_tensor_bytes, median_step_time)
from models import GPT2, TinyMLP, lm_loss, transformer_stack  # noqa: E402


def test_step_costs_counted_for_every_recipe():
    torch.manual_seed(0)
    model, x, y = TinyMLP(d=16, depth=2), torch.randn(4, 16), torch.randint(0, 10, (4,))
    costs = {r: Runner(r, model, (x,), y, **({"pad_multiple": 1} if r == "autocastfx" else {})).cost()
             for r in ("fp32", "autocast", "autocastfx", "floor")}
    fp32, ac, fx = costs["fp32"], costs["autocast"], costs["autocastfx"]
    assert fp32.cast_bytes == 0 and fp32.master_bytes == 0
    assert ac.casts > 0 and fx.casts > 0
    assert fx.syncs == 0 and ac.syncs >= 1  # GradScaler over a non-fused AdamW reads found_inf on the host
    # the module's parameters are the float32 model's (the graph casts them): no master copies beside them
    assert fx.master_bytes == 0 and fx.param_bytes == fp32.param_bytes
    assert fp32.grad_bytes == fp32.param_bytes  # float32 gradients, one per parameter
    assert fx.grad_bytes == fp32.grad_bytes  # and so in autocastfx: every float32 gradient lands in backward
    assert fp32.live_bytes >= fp32.param_bytes + fp32.grad_bytes + fp32.optim_bytes
    assert all(c.saved_bytes > 0 and c.ops > 0 and not c.skipped for c in costs.values())


def test_counter_counts_foreach_copies_as_casts():
    a, b = [torch.zeros(10, dtype=torch.float16)], [torch.ones(10)]
    c = Counter()
    with c:
        torch._foreach_copy_(a, b)
        torch.ones(3).half()
        torch.ones(3).add_(1)
    assert c.casts == 2 and c.cast_bytes == 10 * 6 + 3 * 6 and c.syncs == 0
    with c:
        torch.ones(2).sum().item()
    assert c.syncs == 1


def test_live_tensor_bytes_sees_a_new_tensor():
    before = live_tensor_bytes()
    t = torch.zeros(1 << 16)
    assert live_tensor_bytes() - before >= t.nbytes


def test_timing_and_conversion_scaling_run():
    torch.manual_seed(0)
    r = Runner("autocastfx", TinyMLP(d=8, depth=1), (torch.randn(2, 8),), torch.tensor([0, 1]), pad_multiple=1)
    assert median_step_time(r, steps=3, warmup=1) > 0
    f = Runner("floor", TinyMLP(d=8, depth=1), (torch.randn(2, 8),), torch.tensor([0, 1]))
    times = interleaved_step_times({"fx": r, "floor": f}, rounds=2, steps=2, warmup=1)
    assert set(times) == {"fx", "floor"} and min(times.values()) > 0
    rows = convert_scaling([1], transformer_stack, lambda: torch.randn(1, 4, 16))  # one block: 25 nodes
    assert rows[0][0] > 10 and rows[0][3] > 0


def test_memory_tracker_counts_storages_once_and_frees():
    """Allocations counted when made and uncounted when the last tensor on the storage dies; views and in-place
    results add nothing; storages alive before (``ignore``) are never counted."""
    before = torch.zeros(256)
    tr = MemoryTracker(ignore=alive_storage_keys())
    with tr:
        a = torch.empty(1000)              # 4000 bytes
        v = a.view(10, 100)                # a view: same storage
        a.add_(1)                          # in place: same storage
        del a
        assert tr.now == 4000
        b = torch.empty(2000)              # 8000 more: peak 12000
        del v                              # the last tensor on the first storage: freed
        assert tr.now == 8000 and tr.peak == 12000
        w = before.view(16, 16)            # a view of a storage alive before: not the tracked thing's
        c = (b * 2).sum()                  # b, b * 2 and the 4-byte sum at once; then the sum remains
        del b
    assert w.shape == (16, 16) and c.numel() == 1
    assert tr.peak == 16004 and tr.now == 4


def test_alive_before_forgets_freed_storages():
    """A storage freed since the snapshot is not 'alive before', even if a new one is given its address."""
    a, kept = torch.empty(4096), torch.empty(16)
    before = alive_storage_keys()
    key = (a.device.type, a.untyped_storage().data_ptr())
    assert key in before and (kept.device.type, kept.untyped_storage().data_ptr()) in before
    del a
    b = torch.empty(4096)                      # often at the freed address: must count as new all the same
    assert (b.device.type, b.untyped_storage().data_ptr()) not in before and key not in before


def test_memory_tracker_sees_what_only_autograd_holds():
    """Tensors saved for backward live in C++ only; they still count until backward frees them."""
    w = torch.randn(100, 100, requires_grad=True)
    tr = MemoryTracker(ignore=alive_storage_keys())
    with tr:
        x = torch.randn(50, 100)
        loss = ((x @ w).relu() ** 2).sum()
        del x
        saved = tr.now
        loss.backward()
        del loss
    assert saved >= 2 * 50 * 100 * 4          # the input of the matmul and the relu output, at least
    assert tr.now == w.grad.nbytes == 100 * 100 * 4


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))  # dims multiples of 8: nothing padded


def test_step_memory_by_hand_on_an_mlp():
    """Between-step bytes by holder, computed by hand from the parameter count P (808): float32 parameters and
    gradients 4 B each; AdamW's two moments 8 B plus one 4-byte step count per tensor; GradScaler's scale and
    growth tracker 4 B each; autocastfx's module parameters the float32 model's 4 B (no masters beside them),
    and its float32 gradients 4 B where the step keeps them from one step to the next (none where it frees
    them)."""
    model, x, y = _mlp(), torch.randn(4, 16), torch.randint(0, 8, (4,))
    P, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert P == 808
    acc = {}
    for r in ("fp32", "autocast", "autocastfx"):  # one at a time: a recipe's account leaves out what was alive before
        runner = Runner(r, model, (x,), y)
        acc[r] = runner.memory()
    adamw = 8 * P + 4 * tensors
    fp32, ac, fx = acc["fp32"], acc["autocast"], acc["autocastfx"]

    def heads(a):
        return a.params, a.masters, a.optimizer, a.other
    assert heads(fp32) == (4 * P, 0, adamw, 0) and fp32.grads == 4 * P and fp32.scaler == 0
    assert heads(ac) == (4 * P, 0, adamw, 0) and ac.grads == 4 * P and ac.scaler == 8
    assert heads(fx) == (4 * P, 0, adamw, 0)
    kept = [p for p in runner.model.parameters() if p.grad is not None]
    assert fx.grads == 4 * sum(p.numel() for p in kept) and fx.grads in (0, 4 * P)
    assert 0 < fx.scaler < 16 * 1024          # a few scalars and the on-device history
    for a in acc.values():
        assert a.tracked_after == a.between   # the running count and the census after the step agree
        assert a.peak > a.between
    # during the step both hold float16 copies of the weights (autocast's, and the casts in autocastfx's graph,
    # 2 B), and the float32 gradients (4 B) when the optimizer runs
    assert ac.peak >= ac.between + 2 * P
    assert fx.peak >= fx.between + 2 * P and fx.peak >= fx.between - fx.grads + 4 * P


# ------------------------------------------------------------------------------------------- bench/gpu.py
def test_gpu_dry_run_every_recipe(tmp_path):
    """The scoreboard's dry run on GPT-2's workload: every recipe measured (the CUDA graph's row says why not, on
    a CPU), the first losses of every recipe close to autocast's and FP32's, Markdown and JSON written."""
    md, js = tmp_path / "board.md", tmp_path / "board.json"
    assert gpu.main(["--dry-run", "--only", "gpt2", "--markdown", str(md), "--json", str(js)]) == 0
    rows = {(r["workload"], r["recipe"]): r for r in json.loads(js.read_text())["rows"]}
    assert set(rows) == {("gpt2", r) for r in gpu.BIG}
    for (w, r), row in rows.items():
        if r == "fx-graph":
            assert "ms" in row or "CUDA" in row["na"]
            continue
        assert "error" not in row and row["ms"] > 0 and row["peak"] >= row["live"] > 0, row
        assert row["account"]["tracked_after"] == row["live"]
        text, ok = gpu.loss_check(rows, gpu_workload(w), r)
        assert ok is not False, text
    assert rows[("gpt2", "fx-compile")]["note"].endswith("aot_eager backend (dry run)")
    assert abs(rows[("gpt2", "fp32")]["losses"][0] - math.log(101)) < 0.5  # GPT-2's initialisation: loss near log V
    # autocastfx's parameters are the float32 model's, as autocast's are: no master copies beside them
    fx, ac = rows[("gpt2", "fx")]["account"], rows[("gpt2", "autocast")]["account"]
    assert fx["masters"] == 0 == ac["masters"] and fx["params"] == ac["params"] > 0
    text = md.read_text()
    assert text.startswith("### CPU (dry run") and "| model | recipe | ms/step |" in text
    assert ">= 1.3x autocast+GradScaler" in text and "peak <= autocast+GradScaler" in text


def test_profile_step_dry_run(capsys):
    """bench/profile_step.py on the dry GPT-2: one table per recipe, each naming the step's matmuls, and the time
    per step it prints is the profiled ops' own time (not their sum with their children's)."""
    import profile_step
    assert profile_step.main(["--dry-run", "--only", "gpt2", "--recipes", "autocast,fx", "--steps", "2",
                              "--warmup", "1", "--rows", "8"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("## ")]
    assert [h.split("): ")[1].split(" (")[0] for h in heads] == ["autocast+GradScaler", "autocastfx"]
    assert out.count("aten::mm") >= 2
    totals = [line.split(": ")[1] for line in out.splitlines() if line.startswith("Self CPU time total")]
    assert len(totals) == 2
    for h, total in zip(heads, totals):  # the heading's time per step is the table's own total over the steps
        per_step = float(h.split(", ")[-1].split(" ms")[0])
        ms = float(total[:-2]) if total.endswith("ms") else float(total[:-2]) / 1e3 if total.endswith("us") \
            else float(total[:-1]) * 1e3
        assert per_step > 0 and abs(per_step * 2 - ms) <= 0.01 * ms + 0.02, (h, total)


def gpu_workload(key):
    return next(w for w in gpu.workloads(True) if w.key == key)


def test_gpu_rows_in_their_own_processes(tmp_path):
    """--isolate process: the torch.compile row compiled first in a parallel process, then measured in a fresh
    one; its result comes back through JSON."""
    js = tmp_path / "board.json"
    assert gpu.main(["--dry-run", "--only", "lm4", "--recipes", "fx", "--isolate", "process",
                     "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    (row,) = data["rows"]
    assert row["recipe"] == "fx" and row["ms"] > 0 and len(row["losses"]) == 2 and "machine" not in row
    assert data["machine"]["device"].startswith("CPU")


def test_gpu_budget_and_bad_options(tmp_path, capsys):
    js = tmp_path / "board.json"
    assert gpu.main(["--dry-run", "--only", "lm4", "--budget", "0", "--json", str(js)]) == 0
    assert all("budget" in r["na"] for r in json.loads(js.read_text())["rows"])
    if not torch.cuda.is_available():  # the real scoreboard needs CUDA and says how to check the script without
        assert gpu.main([]) == 2 and "--dry-run" in capsys.readouterr().err
    for bad in (["--only", "resnet"], ["--recipes", "amp"]):
        try:
            gpu.main(["--dry-run", *bad])
        except SystemExit as e:
            assert e.code == 2
        assert "choose from" in capsys.readouterr().err


def test_gpu_targets_and_loss_check_judge():
    """PASS, MISS and n/a from hand-made rows; a recipe whose first losses drift is flagged."""
    w = gpu_workload("gpt2")
    rows = {("gpt2", "autocast"): {"ms": 10.0, "peak": 100, "live": 50, "losses": [5.0, 4.0]},
            ("gpt2", "fp32"): {"ms": 30.0, "peak": 150, "live": 50, "losses": [5.0, 4.02]},
            ("gpt2", "fx"): {"ms": 7.0, "peak": 120, "live": 60, "losses": [5.0, 4.01]},
            ("gpt2", "fx-graph"): {"ms": 8.0, "peak": 90, "live": 60, "losses": [5.0, 4.5]}}
    speed = gpu.Target("fx", "autocast", "speed", 1.3)
    assert gpu.judge(rows, w, speed) == ("1.43x", True)
    assert gpu.judge(rows, w, gpu.Target("fx-graph", "autocast", "speed", 1.3))[1] is False
    assert gpu.judge(rows, w, gpu.Target("fx", "autocast", "memory"))[1] is False
    assert gpu.judge(rows, w, gpu.Target("fx-graph", "autocast", "memory"))[1] is True
    assert gpu.judge(rows, w, gpu.Target("fx-compile", "autocast-compile", "speed")) == ("n/a", None)
    assert gpu.loss_check(rows, w, "fx")[1] is True
    cell, ok = gpu.loss_check(rows, w, "fx-graph")
    assert ok is False and "DIFFERS" in cell and "12.5% autocast" in cell
    assert gpu.loss_check(rows, w, "autocast")[1] is True   # against FP32
    rows[("gpt2", "fx")]["losses"] = [5.0, float("nan")]
    assert gpu.loss_check(rows, w, "fx")[1] is False
    cells = gpu.row_cells(rows, w, "fx", ("GiB", 2**30))
    assert cells[3] == "1.43x" and ">= 1.3x autocast+GradScaler: PASS" in cells[-1]


def test_gpu_reference_row_runs_channels_last():
    """The hand-made channels_last autocast row really runs its convolutions on channels_last weights and input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(
        memory_format=torch.channels_last)))
    built = gpu.build("autocast-cl", model, F.cross_entropy, None, "cpu", dry=True)
    loss = built.step((torch.randn(2, 3, 8, 8),), torch.tensor([0, 3]))
    assert torch.isfinite(loss) and seen == [True]
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------- bench/cpu_bf16.py
def test_cpu_bf16_quick_board_runs():
    """The CPU bfloat16 scoreboard's smoke run (tiny models, eager rows): every recipe measured and checked, no row
    failed, both tables and their targets printed."""
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..")
    proc = subprocess.run([sys.executable, os.path.join("bench", "cpu_bf16.py"), "--quick", "--no-compile"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("| model | recipe | ms/step | x float32 | x autocast |") == 2  # training and inference
    assert "#### training" in out and "#### inference" in out and "failed" not in out.lower()
    assert "avx512_bf16" in out and "autocastfx bf16 >= 1.3x torch.autocast bf16" in out
