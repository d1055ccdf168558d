"""Step times (ms, median, interleaved in one process) of a torch.autocast bf16 loop, autocastfx's train_step and
the user's plain loop over the converted module, eager or compiled, for whichever autocastfx is importable: run it
once per version (``PYTHONPATH=<checkout> python bench/ab_step.py gpt eager 2``) to compare two versions, each
against its own autocast row. Prints one JSON line. Freed CPU memory is kept for every recipe alike."""
import sys, time, json, copy, statistics, warnings, os
import torch, torch.nn.functional as F
warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT2, ResNet50, lm_loss
import autocastfx, autocastfx.training.heap as heap
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
heap.keep_freed_memory()  # every recipe alike, whichever version
BF16 = torch.bfloat16
which = sys.argv[1]; compiled = sys.argv[2] == "compile"; steps = int(sys.argv[3])
def mk():
    g = torch.Generator().manual_seed(1)
    if which == "gpt":
        m = GPT2(vocab=512, ctx=64, d=128, depth=2, heads=4, init_std=0.02)
        ids = torch.randint(0, 512, (4, 64), generator=g); return m, ids, torch.roll(ids, -1, 1), lm_loss
    m = ResNet50(classes=10, layers=(1, 1, 1, 1), width=16)
    return m, torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g), F.cross_entropy
torch.manual_seed(0)
base, x, y, loss_fn = mk()
def fused(params): return torch.optim.AdamW(params, lr=1e-4, fused=True)
def recipe(name):
    m = copy.deepcopy(base)
    if name == "autocast":
        opt = fused(m.parameters()); f = torch.compile(m) if compiled else m
        def run():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=BF16):
                loss = loss_fn(f(x), y)
            loss.backward(); opt.step(); return loss
        return run
    gm = autocastfx.convert(m, (x,), dtype=BF16)
    f = torch.compile(gm) if compiled else gm
    if name == "fx-step":
        step = autocastfx.train_step(f, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-4, fused=True))
        return lambda: step(x, y)
    opt = fused(gm.parameters())
    def run():
        opt.zero_grad(set_to_none=True); loss = loss_fn(f(x), y); loss.backward(); opt.step(); return loss
    return run
names = ["autocast", "fx-step", "fx-loop"]
runs = {n: recipe(n) for n in names}
for n in names:
    for _ in range(3): runs[n]()
times = {n: [] for n in names}
for r in range(5):
    for n in names[r % 3:] + names[:r % 3]:
        for _ in range(steps):
            t = time.perf_counter(); runs[n](); times[n].append((time.perf_counter() - t) * 1e3)
print(json.dumps({"pkg": os.environ.get("PYTHONPATH"), "model": which, "compiled": compiled,
                  **{n: round(statistics.median(v), 2) for n, v in times.items()}}))
