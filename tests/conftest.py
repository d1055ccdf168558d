"""Test order: the memory accounts first.

A memory account (bench/measure.py's, tests/test_hidden_copies.py's) walks every object the process holds
(``gc.collect()``, ``gc.get_objects()``) to find the tensors alive. Late in a full run pytest's process holds the
objects of hundreds of tests, and each walk costs seconds: the five between-steps accounts took 10-12 s each
there against 1.6-2.8 s alone. They run first, while the process is small; every other test keeps its order.
"""
import gc
import json
import os

WALK_THE_HEAP = (
    "tests/test_memory.py::",
    "tests/test_hidden_copies.py::",
    "tests/test_recompute.py::test_checkpointing_cuts_saved_activation_bytes",
    "tests/test_bench.py::test_step_memory",
    "tests/test_bench.py::test_gpu_dry_run_every_recipe",
    "tests/test_process.py::test_the_modules_a_capture_watched_have_their_own_classes_after_it",
)


def pytest_configure(config):
    """The collector's thresholds for the test process: pytest's process holds torch, transformers and hundreds of
    tests' objects, and each conversion makes many short-lived graph objects; with the young generation collected
    every 50,000 allocations instead of 700, three rounds of converting a Llama, a GPT and a ResNet took 19.3-19.9 s
    against 23.7-24.8 s (2-core AMD EPYC, one thread). The process is the test run's: nothing of autocastfx sets
    this, and a test that counts what is alive still calls gc.collect() itself."""
    gc.set_threshold(50_000, 50, 100)


def pytest_collection_modifyitems(session, config, items):
    first = [i for i in items if i.nodeid.startswith(WALK_THE_HEAP)]
    if first:
        rest = [i for i in items if not i.nodeid.startswith(WALK_THE_HEAP)]
        items[:] = first + rest


# Seconds per test file, written where tests/parallel.py asks (AUTOCASTFX_FILE_SECONDS): what it balances its
# processes by. Setup, call and teardown of every test of a file, summed.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("AUTOCASTFX_FILE_SECONDS"):
        name = report.nodeid.split("::", 1)[0]
        _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("AUTOCASTFX_FILE_SECONDS")
    if path:
        with open(path, "w") as f:
            json.dump(_FILE_SECONDS, f)
