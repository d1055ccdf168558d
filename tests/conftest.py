"""Test order: the memory accounts first.

A memory account (bench/measure.py's, tests/test_hidden_copies.py's) walks every object the process holds
(``gc.collect()``, ``gc.get_objects()``) to find the tensors alive. Late in a full run pytest's process holds the
objects of hundreds of tests, and each walk costs seconds: the five between-steps accounts took 10-12 s each
there against 1.6-2.8 s alone. They run first, while the process is small; every other test keeps its order.
"""

WALK_THE_HEAP = (
    "tests/test_memory.py::",
    "tests/test_hidden_copies.py::",
    "tests/test_recompute.py::test_checkpointing_cuts_saved_activation_bytes",
    "tests/test_bench.py::test_step_memory",
)


def pytest_collection_modifyitems(session, config, items):
    first = [i for i in items if i.nodeid.startswith(WALK_THE_HEAP)]
    if first:
        rest = [i for i in items if not i.nodeid.startswith(WALK_THE_HEAP)]
        items[:] = first + rest
