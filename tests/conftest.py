"""Test order: the memory accounts first; under ``tests/parallel.py``, files taken one at a time.

A memory account (bench/measure.py's, tests/test_hidden_copies.py's) walks every object the process holds
(``gc.collect()``, ``gc.get_objects()``) to find the tensors alive. Late in a full run pytest's process holds the
objects of hundreds of tests, and each walk costs seconds: the five between-steps accounts took 10-12 s each
there against 1.6-2.8 s alone. They run first, while the process is small; every other test keeps its order.
"""
import gc
import json
import os

import pytest

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


# Under tests/parallel.py every process collects every file, and each runs the files it claims, one at a time: a
# claim is an exclusive create of the unit's name in the folder the processes share (AUTOCASTFX_CLAIMS), so each
# unit runs in exactly one process. The units are the files, in the order parallel.py offers them
# (AUTOCASTFX_ORDER), after the heap walkers of each file as a unit of their own. A process claims its next unit
# before the last test of the one it runs, so pytest knows the next test and keeps no fixture longer than a file.


def _units(items) -> list[tuple[str, list]]:
    with open(os.environ["AUTOCASTFX_ORDER"]) as f:
        rank = {name: i for i, name in enumerate(json.load(f))}
    units: dict[str, list] = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        units.setdefault(name + "::heap" if item.nodeid.startswith(WALK_THE_HEAP) else name, []).append(item)
    heap = [k for k in units if k.endswith("::heap")]
    rest = sorted((k for k in units if not k.endswith("::heap")), key=lambda k: (rank.get(k, len(rank)), k))
    return [(k, units[k]) for k in heap + rest]


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
