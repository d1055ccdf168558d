"""The benchmark's measuring code runs and counts what it claims to (tiny models, seconds)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import gpu  # noqa: E402
from measure import (Counter, Runner, convert_scaling, interleaved_step_times, live_tensor_bytes,  # noqa: E402
                     median_step_time)
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
    # float16 weights in the module, their float32 masters beside it, the rest (layer norms) float32
    assert 0 < fx.master_bytes < fp32.param_bytes
    assert fx.param_bytes == fx.master_bytes // 2 + (fp32.param_bytes - fx.master_bytes)
    assert fp32.grad_bytes == fp32.param_bytes  # float32 gradients, one per parameter
    assert fx.grad_bytes > fx.master_bytes      # low-precision gradients and the masters' exist together
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
    rows = convert_scaling([2], transformer_stack, lambda: torch.randn(1, 4, 16))
    assert rows[0][0] > 10 and rows[0][3] > 0


def test_gpu_script_steps_on_cpu():
    """bench/gpu.py's recipes (eager) build and train a tiny GPT-2 on the CPU; the correctness check flags a
    diverging recipe."""
    torch.manual_seed(0)
    model = GPT2(vocab=67, ctx=16, d=16, depth=1, heads=2)
    data = [gpu.batch((2, 8), 67, "cpu", s) for s in range(2)]
    losses = {}
    for recipe in ("fp32", "autocast+GradScaler", "autocastfx"):
        step = gpu.make_step(recipe, model, lm_loss, data[0][0], "cpu")
        for i in range(3):
            loss = step(*data[i % 2])
        losses[recipe] = float(loss)
        t, peak = gpu.timed(step, data, "cpu", warmup=1, iters=2)
        assert t > 0 and peak == 0
    assert gpu.close_to_autocast(losses, 3) == []
    assert gpu.close_to_autocast({**losses, "autocastfx": losses["autocastfx"] * 2}, 3) == ["autocastfx"]
