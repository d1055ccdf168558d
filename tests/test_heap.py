"""autocastfx.keep_cpu_memory() keeps freed CPU memory for the next step (autocastfx.training.heap), and nothing
else does: checked by the effect, the page faults a process takes to allocate and fill 64 MiB again after freeing
it, the last two of six times. The cases that may change glibc's setting run in a fresh process of their own (it is
process-wide): the allocator left alone first, then after keep_cpu_memory()."""
import os
import subprocess
import sys

import pytest
import torch

import autocastfx

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")

SCRIPT = r"""
import resource, torch, torch.nn as nn, autocastfx
from autocastfx.training import heap
torch.manual_seed(0)
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))


def case():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    step = autocastfx.train_step(gm, nn.functional.cross_entropy, torch.optim.AdamW(gm.parameters()))
    step(x, y)
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(16 << 20)  # 64 MiB, over glibc's largest mmap threshold of its own choosing (32 MiB)
        t.fill_(1.0)
        del t
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(heap.kept(), max(faults[-2:]), step.code.splitlines()[0], sep="\n")


case()  # the allocator as the process found it: convert() and a step alone
autocastfx.keep_cpu_memory()
case()
"""


def _run(**env):
    """Both cases in one fresh process, the allocator left alone first: [(kept, faults, the step's first line)]."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_")) and k != "LD_PRELOAD"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-6:]
    return [(kept == "True", int(faults), doc) for kept, faults, doc in (lines[:3], lines[3:])]


@pytest.mark.skipif(torch.__config__.show().find("jemalloc") >= 0, reason="torch built with jemalloc")
def test_keep_cpu_memory_keeps_freed_memory_and_a_step_alone_leaves_the_allocator_be():
    (left, left_faults, left_doc), (kept, faults, doc) = _run()
    assert not left and "autocastfx.keep_cpu_memory() not called" in left_doc  # convert() and a step changed nothing
    if not _huge_pages_always():  # else 64 MiB of fresh memory is 32 faults of 2 MiB pages
        assert left_faults > 16_000 * 0.9, left_faults  # glibc's default: fresh pages every time, each faulted in

    assert kept and "freed CPU memory kept for the next step" in doc
    # 64 MiB again from the heap: no fresh page (16,384 of them otherwise) once the heap has room for it whole (a
    # small allocation may take a piece of a freed block, and the heap grows once or twice before it has)
    assert faults < 1000, faults


def _huge_pages_always():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def test_the_users_allocator_settings_stand(monkeypatch):
    """keep_cpu_memory() changes nothing where the environment already set glibc's malloc options (a step never
    touches the allocator: the test above). It reads them when called, so this runs in the test's own process: a
    refusal changes nothing, and the one setting that is not the allocator's is only asked about (``why_not``)."""
    from autocastfx.training import heap
    for name in [k for k in os.environ if k.startswith(("MALLOC_", "GLIBC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(heap, "_state", {"kept": False, "why": None, "mmap": None})  # this process's, put back after
    monkeypatch.setattr(heap, "_preloaded_allocator", lambda: None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert not autocastfx.keep_cpu_memory() and not heap.kept()
    assert "the environment sets MALLOC_TRIM_THRESHOLD_" in heap.status()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert not autocastfx.keep_cpu_memory()
    assert "glibc.malloc tunables in GLIBC_TUNABLES" in heap.status()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # not the allocator's: it would be kept
    assert heap.why_not() is None
