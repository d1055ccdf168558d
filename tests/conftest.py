"""The test process: the collector, heap walks, and under ``tests/parallel.py`` the files taken one at a time.

A memory account (bench/measure.py's, tests/test_hidden_copies.py's) walks every object the process holds
(``gc.collect()``, ``gc.get_objects()``) to find the tensors alive. Over pytest's process, torch and transformers
each walk took about 0.25 s, and seconds late in a full run, when the process holds the objects of hundreds of
tests. The tests in ``HEAP_WALKERS`` run with every object alive at their start frozen (``gc.freeze()``): the
walks go over what the test made. A test's account leaves out what was alive before it either way (it counts what
a conversion or a step adds), and every tensor made since is young, so ``gc.get_objects()`` still lists it
wherever it is held (what this saves: docs/testing.md).
"""
import gc
import json
import os

import pytest

HEAP_WALKERS = (
    "tests/test_memory.py::",
    "tests/test_hidden_copies.py::",
    "tests/test_bench.py::",
    "tests/test_recompute.py::test_checkpointing_cuts_saved_activation_bytes",
    "tests/test_process.py::test_the_modules_a_capture_watched_have_their_own_classes_after_it",
)


@pytest.fixture(autouse=True)
def _heap_of_this_test(request):
    """For the tests in ``HEAP_WALKERS``: the objects alive at its start frozen until its end."""
    if not request.node.nodeid.startswith(HEAP_WALKERS):
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pytest_configure(config):
    """The collector's thresholds for the test process: pytest's process holds torch, transformers and hundreds of
    tests' objects, and each conversion makes many short-lived graph objects; with the young generation collected
    every 50,000 allocations instead of 700, three rounds of converting a Llama, a GPT and a ResNet took 19.3-19.9 s
    against 23.7-24.8 s (2-core AMD EPYC, one thread). The process is the test run's: nothing of autocastfx sets
    this, and a test that counts what is alive still calls gc.collect() itself."""
    gc.set_threshold(50_000, 50, 100)
    # torch.compile collects the young generations after every compile (torch._dynamo.config.run_gc_after_compile):
    # about 23 ms a compile in pytest's process, for the few hundred compiles of the suite
    import torch._dynamo.config as dynamo_config
    if hasattr(dynamo_config, "run_gc_after_compile"):
        dynamo_config.run_gc_after_compile = False


# Under tests/parallel.py every process collects every file, and each runs the files it claims, one at a time: a
# claim is an exclusive create of the unit's name in the folder the processes share (AUTOCASTFX_CLAIMS), so each
# unit runs in exactly one process. The units are the files, in the order parallel.py offers them
# (AUTOCASTFX_ORDER). A process claims its next unit before the last test of the one it runs, so pytest knows the
# next test and keeps no fixture longer than a file.


def _units(items) -> list[tuple[str, list]]:
    """The items by file, in the order the files are offered."""
    with open(os.environ["AUTOCASTFX_ORDER"]) as f:
        rank = {name: i for i, name in enumerate(json.load(f))}
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    return [(k, units[k]) for k in sorted(units, key=lambda k: (rank.get(k, len(rank)), k))]


def _claimed(units):
    """The units this process claims, as it asks for each next one."""
    for key, items in units:
        path = os.path.join(os.environ["AUTOCASTFX_CLAIMS"], key.replace("/", "_").replace(":", "_"))
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another process runs it
        yield items


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if not os.environ.get("AUTOCASTFX_CLAIMS") or session.config.option.collectonly or session.testsfailed:
        return None  # pytest's own loop (which stops on collection errors)
    claimed = _claimed(_units(session.items))
    current = next(claimed, None)
    while current is not None:
        following = None
        for i, item in enumerate(current):
            if i + 1 < len(current):
                nextitem = current[i + 1]
            else:
                following = next(claimed, None)
                nextitem = following[0] if following else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    return True


# Seconds per test file, written where tests/parallel.py asks (AUTOCASTFX_FILE_SECONDS): what it orders the files
# by. Setup, call and teardown of every test of a file, summed.
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
