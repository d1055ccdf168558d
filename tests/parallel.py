"""The test suite on every core: ``./run.sh test`` runs this, and CI runs that.

Most of the suite's time is one core's: converting, tracing and exporting are Python, and the 2-core machine the
suite must finish on in 8 minutes sat half idle under one pytest. This starts one pytest process per core (at most
4). Each collects every test file, and the processes take the files one at a time, as each finishes the last: a
file goes to the first process that claims it (``tests/conftest.py``, an exclusive file create in a folder they
share), so no process idles while the other has files left, whatever this CPU makes of the record. The files are
offered longest first, by the seconds each took in the last recorded run on this kind of CPU
(``tests/file_seconds.json``, one record per CPU class of ``tests/cpu_class.py``: the same file takes 10x longer
where bfloat16 has no native kernels). A class with no record borrows the nearest class's, scaled by the two
records' ratio on the files both have; a file in no record counts 10 s. The order only decides what is offered
first. Each process gets its share of the cores' threads (``OMP_NUM_THREADS``), so no two wait on each other's
spinning threads. A file's tests stay in one process, so the module-scoped fixtures are built once, as under a
plain pytest. The processes' lines are printed as they come, each after its process's number; the exit status is the
first failing process's, else 0.

    python tests/parallel.py               # the suite, on every core
    python tests/parallel.py --jobs 1      # one pytest, as before
    python tests/parallel.py --record      # and write this run's seconds per file, as this CPU class's record

Only pytest is needed. Anything after ``--`` goes to every pytest (``-- -x``, ``-- -m slow``: a process that ran
no selected test exits 5, which counts as a pass while another process ran tests). Not for test paths (every
process would run them: use ``./run.sh test PATH`` or pytest) nor ``--lf``/``--ff`` (the cache is off).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from cpu_class import cpu_class, nearest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECONDS = os.path.join(HERE, "file_seconds.json")
UNKNOWN_FILE_SECONDS = 10.0
MAX_JOBS = 4


def test_files() -> list[str]:
    return sorted(f"tests/{name}" for name in os.listdir(HERE) if name.startswith("test_") and name.endswith(".py"))


def load_record(path: str = SECONDS) -> dict[str, dict[str, float]]:
    """The recorded seconds per file, by CPU class; empty where there is no record."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def expected_seconds(record: dict[str, dict[str, float]], cls: str) -> tuple[dict[str, float], list[str]]:
    """Seconds per file on a CPU of class ``cls``, and the classes they come from: its own record first; a file it
    lacks (every file, where it has none) from the nearest class that has one, scaled by the two classes' ratio over
    the files both have (1 where they share none)."""
    seconds = dict(record.get(cls, {}))
    sources = [cls] if seconds else []
    others = [k for k in record if k != cls and record[k]]
    while others:
        other = nearest(cls, others)
        others.remove(other)
        theirs = record[other]
        missing = theirs.keys() - seconds.keys()
        if not missing:
            continue
        common = seconds.keys() & theirs.keys()
        base = sum(theirs[f] for f in common)
        scale = sum(seconds[f] for f in common) / base if common and base > 0 else 1.0
        seconds.update({f: theirs[f] * scale for f in missing})
        sources.append(other)
    return seconds, sources


def recorded(record: dict[str, dict[str, float]], cls: str, measured: dict[str, float],
             files: list[str]) -> dict[str, dict[str, float]]:
    """The record with this run's seconds as class ``cls``'s: a file none of whose tests ran keeps its last figure,
    a file no longer in the suite is dropped, the other classes' records stay as they were."""
    mine = {**record.get(cls, {}), **measured}
    return {**record, cls: {k: round(v, 1) for k, v in sorted(mine.items()) if k in files}}


def _sources(cls: str, sources: list[str]) -> str:
    if not sources:
        return f"no record, {UNKNOWN_FILE_SECONDS:.0f} s a file"
    borrowed = " and ".join(f"{s}'s" for s in sources if s != cls)
    if sources[0] != cls:
        return f"no record of its own, seconds per file from {borrowed}"
    return "seconds per file from its record" + (f", a file it lacks from {borrowed} (scaled)" if borrowed else "")


def offered(files: list[str], seconds: dict[str, float]) -> list[str]:
    """The order the files are offered in: longest expected first (by name where equal)."""
    return sorted(files, key=lambda f: (-seconds.get(f, UNKNOWN_FILE_SECONDS), f))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        try:
            sys.stdout.write(text)
        except UnicodeEncodeError:  # a terminal that is not UTF-8
            sys.stdout.write(text.encode("ascii", "replace").decode())
        sys.stdout.flush()


def _pump(number: int, stream, lock: threading.Lock) -> None:
    """The process's lines, each after its number, until it closes its output: a pump that stopped early would
    leave the process blocked on a full pipe."""
    for line in iter(stream.readline, ""):
        _say(lock, f"[{number}] {line}")


def run(jobs: int, pytest_args: list[str], record: bool) -> int:
    records, cls = load_record(), cpu_class()
    seconds, sources = expected_seconds(records, cls)
    files = test_files()
    jobs = max(1, min(jobs, len(files)))
    threads = max(1, _usable_cores() // jobs)
    lock = threading.Lock()
    procs, pumps, outs = [], [], []
    claims = tempfile.mkdtemp(prefix="autocastfx_claims_")
    order = os.path.join(claims, "order.json")
    with open(order, "w") as f:
        json.dump(offered(files, seconds), f)
    _say(lock, f"CPU class {cls}: {_sources(cls, sources)}; {len(files)} files, about "
               f"{sum(seconds.get(f, UNKNOWN_FILE_SECONDS) for f in files):.0f} s, taken by {jobs} process(es) "
               "one at a time, longest first\n")
    start = time.monotonic()
    for number in range(1, jobs + 1):
        out = tempfile.NamedTemporaryFile(prefix="file_seconds_", suffix=".json", delete=False)
        out.close()
        outs.append(out.name)
        env = dict(os.environ, AUTOCASTFX_FILE_SECONDS=out.name, PYTHONUNBUFFERED="1")
        if jobs > 1:
            env.update(OMP_NUM_THREADS=str(threads), AUTOCASTFX_CLAIMS=claims, AUTOCASTFX_ORDER=order)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
                                 *files], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, encoding="utf-8", errors="replace", bufsize=1)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(number, proc.stdout, lock), daemon=True)
        pump.start()
        pumps.append(pump)
    codes = []
    try:
        for number, (proc, pump) in enumerate(zip(procs, pumps), 1):
            codes.append(proc.wait())
            pump.join()
            _say(lock, f"[{number}] exit {codes[-1]} after {time.monotonic() - start:.0f} s\n")
    finally:  # stopped (Ctrl-C, a SIGTERM): the pytest processes stop too, rather than run on alone
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
    shutil.rmtree(claims, ignore_errors=True)
    measured: dict[str, float] = {}
    for name in outs:
        try:
            with open(name) as f:
                measured.update(json.load(f))
        except (OSError, ValueError):
            pass  # a process that died before its session ended wrote nothing
        finally:
            os.unlink(name)
    print(f"the suite: {time.monotonic() - start:.0f} s in {jobs} processes of {threads} thread(s)",
          flush=True)
    code = _status(codes)
    if record and code == 0 and not pytest_args:
        with open(SECONDS, "w") as f:
            json.dump(recorded(records, cls, measured, test_files()), f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"seconds per file written to {os.path.relpath(SECONDS, ROOT)} as {cls}'s record")
    elif record:
        print("seconds per file not written: only a whole, passing run without pytest arguments is recorded")
    return code


def _status(codes: list[int]) -> int:
    """One exit status for the processes: the first failure's; 5 (no tests collected: ``-- -m slow`` selects the
    tests of one file) only where every process collected none."""
    failing = [c for c in codes if c not in (0, 5)]
    if failing:
        return failing[0]
    return 5 if codes and all(c == 5 for c in codes) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(MAX_JOBS, _usable_cores()),
                        help="pytest processes (default: one per usable core, at most 4)")
    parser.add_argument("--record", action="store_true",
                        help="write this run's seconds per file as this CPU class's record")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run(args.jobs, extra, args.record)


if __name__ == "__main__":
    sys.exit(main())
