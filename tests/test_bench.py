"""The benchmark's measuring code runs and counts what it claims to (tiny model, seconds)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from measure import Counter, Runner, convert_scaling, median_step_time  # noqa: E402
from models import TinyMLP, transformer_stack  # noqa: E402


def test_step_costs_counted_for_every_recipe():
    torch.manual_seed(0)
    model, x, y = TinyMLP(d=16, depth=2), torch.randn(4, 16), torch.randint(0, 10, (4,))
    costs = {r: Runner(r, model, (x,), y, **({"pad_multiple": 1} if r == "autocastfx" else {})).cost()
             for r in ("fp32", "autocast", "autocastfx", "floor")}
    assert costs["fp32"].cast_bytes == 0 and costs["fp32"].master_bytes == 0
    assert costs["autocast"].casts > 0 and costs["autocastfx"].casts > 0
    assert costs["autocastfx"].syncs == 0
    assert costs["autocastfx"].master_bytes > 0 and costs["autocastfx"].param_bytes < costs["fp32"].param_bytes
    assert all(c.saved_bytes > 0 and c.ops > 0 for c in costs.values())


def test_counter_counts_foreach_copies_as_casts():
    a, b = [torch.zeros(10, dtype=torch.float16)], [torch.ones(10)]
    c = Counter()
    with c:
        torch._foreach_copy_(a, b)
        torch.ones(3).half()
    assert c.casts == 2 and c.cast_bytes == 10 * 6 + 3 * 6


def test_timing_and_conversion_scaling_run():
    torch.manual_seed(0)
    r = Runner("autocastfx", TinyMLP(d=8, depth=1), (torch.randn(2, 8),), torch.tensor([0, 1]), pad_multiple=1)
    assert median_step_time(r, steps=3, warmup=1) > 0
    rows = convert_scaling([2], transformer_stack, lambda: torch.randn(1, 4, 16))
    assert rows[0][0] > 10 and rows[0][3] > 0
