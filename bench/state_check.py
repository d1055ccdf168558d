"""What the converted module's check of the model's plain attributes (converted.state) costs a call.

    python bench/state_check.py

For each test model (one graph, and blocks="auto" where it has blocks): the number of watched modules and
attributes, the check alone (best of five runs of 2,000 checks), and the module's eval call with and without it
(best of five runs of 200 calls, alternated). The figures: docs/benchmarks.md, "The model's plain attributes".
"""
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import autocastfx  # noqa: E402
from small_models import example  # noqa: E402


def _best(fn, n, runs=5):
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - start) / n * 1e6)
    return min(out)


def _guards(gm):
    return [u.meta["autocastfx"].state for u in gm.modules()
            if isinstance(getattr(u, "meta", None), dict) and getattr(u.meta.get("autocastfx"), "state", None)]


def main():
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'model':<16}{'modules':>8}{'attrs':>7}{'check us':>10}{'call us':>10}{'unchecked':>11}")
    for name in ("resnet", "mobilenet", "densenet", "vit", "gpt"):
        for blocks in (None, "auto"):
            torch.manual_seed(0)
            model, args = example(name)
            gm = autocastfx.convert(model.eval(), args, dtype=torch.bfloat16, blocks=blocks)
            guards = _guards(gm)
            mods = sum(len(g.modules) for g in guards)
            attrs = sum(len(e[4]) for g in guards for e in g.modules)
            check = _best(lambda: [g.check() for g in guards], 2000)
            infos = [u.meta["autocastfx"] for u in gm.modules() if isinstance(getattr(u, "meta", None), dict)
                     and getattr(u.meta.get("autocastfx"), "state", None)]
            with torch.no_grad():
                calls = []
                for on in (True, False, True, False):
                    for info, g in zip(infos, guards):
                        info.state = g if on else None
                    calls.append(_best(lambda: gm(*args), 200, runs=2))
            print(f"{name + ('/blocks' if blocks else ''):<16}{mods:>8}{attrs:>7}{check:>10.1f}"
                  f"{min(calls[0], calls[2]):>10.0f}{min(calls[1], calls[3]):>11.0f}")


if __name__ == "__main__":
    main()
