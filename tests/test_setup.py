"""run.sh's set-up decisions: which environment it installs into and which torch, on fake machines.

`./run.sh env` prints the decisions and changes nothing, so most checks run it against interpreters built
for the case: the real Python binary started with PYTHONHOME pointing at a copy of its standard library
(symlinks) that may carry PEP 668's EXTERNALLY-MANAGED marker or lack ensurepip, and a stand-in `torch`
package of a chosen version and build on its path. `nvidia-smi` is a script on PATH. One test makes a real
.venv and installs the package into it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
GPU_LISTED = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0b2f7a4e-0000-0000-0000-000000000000)"
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def checkout(tmp_path):
    """A directory holding only run.sh: enough for `./run.sh env`, and with no .venv of its own."""
    co = tmp_path / "checkout"
    co.mkdir()
    shutil.copy2(ROOT / "run.sh", co / "run.sh")
    return co


def stub_nvidia_smi(tmp_path, gpu):
    """nvidia-smi as on a machine with one GPU, or as on one whose driver does not answer."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    script = f"echo '{GPU_LISTED}'" if gpu else \
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"
    (stubs / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
    (stubs / "nvidia-smi").chmod(0o755)
    return stubs


def fake_torch(tmp_path, version, cuda=None):
    """A directory with a stand-in `torch` package: just the version and build that run.sh reads."""
    d = tmp_path / f"torch-{version}-{cuda or 'cpu'}"
    (d / "torch").mkdir(parents=True)
    (d / "torch" / "__init__.py").write_text(f"from . import version\n__version__ = {version!r}\n")
    (d / "torch" / "version.py").write_text(f"cuda = {cuda!r}\n")
    return d


def fake_python(tmp_path, *, managed, torch_dir=None, venv_module=True):
    """A wrapper that starts the real Python over a symlinked copy of its standard library, so the copy
    can carry the EXTERNALLY-MANAGED marker (or lose ensurepip/venv) and only `torch_dir` is on its path."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    home = tmp_path / "home"
    lib = home / "lib" / stdlib.name
    lib.mkdir(parents=True)
    skip = {"site-packages", "dist-packages", "EXTERNALLY-MANAGED"} | (set() if venv_module else {"venv", "ensurepip"})
    for entry in stdlib.iterdir():
        if entry.name not in skip:
            (lib / entry.name).symlink_to(entry)
    if managed:
        (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use apt\n")
    wrapper = tmp_path / "bin" / "python3"
    wrapper.parent.mkdir()
    path = f"PYTHONPATH={torch_dir} " if torch_dir else ""
    wrapper.write_text(f'#!/bin/sh\nPYTHONHOME={home} {path}exec {BASE_PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def run_sh(co, *args, stubs=None, **env):
    """Run ./run.sh with none of this session's environment choices leaking in."""
    clean = {k: v for k, v in os.environ.items()
             if k not in {"VIRTUAL_ENV", "PYTHON", "PYTHONHOME", "PYTHONPATH", "AUTOCASTFX_TORCH"}}
    clean["PATH"] = os.pathsep.join(([str(stubs)] if stubs else []) + ["/usr/bin", "/bin"])
    clean.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["./run.sh", *args], cwd=co, env=clean, capture_output=True, text=True, timeout=120)


def decisions(co, **kw):
    proc = run_sh(co, "env", **kw)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


def no_driver_gpus():
    return not (DRIVER_GPUS.is_dir() and any(DRIVER_GPUS.iterdir()))


def test_externally_managed_python_gets_an_isolated_venv(tmp_path):
    torch_dir = fake_torch(tmp_path, "2.13.0+cpu")
    co = checkout(tmp_path)
    managed = fake_python(tmp_path / "managed", managed=True, torch_dir=torch_dir)
    d = decisions(co, PYTHON=managed, stubs=stub_nvidia_smi(tmp_path, gpu=False))
    assert d["python_kind"] == "externally-managed"
    assert d["env"] == str(co / ".venv") and d["env_action"] == "create"
    assert d["system_site_packages"] == "no"      # its torch fits, but its packages are not shared
    assert d["torch_found"] == "none" and d["torch_action"] == "install"
    assert not (co / ".venv").exists()            # `env` changes nothing
    # The same interpreter without the marker: the marker alone is what keeps .venv isolated (where a CPU build
    # suits the machine: not where the kernel driver lists an NVIDIA GPU, which no stub hides)
    if not no_driver_gpus():
        return
    plain = fake_python(tmp_path / "plain", managed=False, torch_dir=torch_dir)
    d = decisions(co, PYTHON=plain, stubs=stub_nvidia_smi(tmp_path, gpu=False))
    assert d["python_kind"] == "plain" and d["env"] == str(co / ".venv")
    assert d["system_site_packages"] == "yes" and d["torch_action"] == "keep"


def test_no_venv_module_names_the_fix(tmp_path):
    co = checkout(tmp_path)
    py = fake_python(tmp_path, managed=True, venv_module=False)
    proc = run_sh(co, "test", PYTHON=py)
    assert proc.returncode == 1
    assert "apt-get install python3-venv" in proc.stderr and "activate" in proc.stderr
    assert not (co / ".venv").exists()


@pytest.mark.parametrize("torch_version, cuda, gpu, override, site, want, action", [
    (None, None, False, "", "no", "cpu", "install"),                  # nothing to reuse
    ("2.13.0+cpu", None, False, "", "yes", "cpu", "keep"),            # reused: no download
    ("2.13.0", "13.0", False, "", "yes", "cpu", "keep"),              # a CUDA build runs on the CPU too
    ("2.5.1", None, False, "", "no", "cpu", "install"),               # outside >=2.11,<3
    ("2.13.0+cpu", None, True, "", "no", "cuda", "install"),          # a CPU build would waste the GPU
    ("2.11.0+cu130", "13.0", True, "", "yes", "cuda", "keep"),
    ("2.13.0+cpu", None, False, "torch==2.11.0", "no", "pip", "install"),
])
def test_plain_python_shares_only_a_torch_that_suits(tmp_path, torch_version, cuda, gpu, override, site, want,
                                                     action):
    if not gpu and not no_driver_gpus():
        pytest.skip("this machine's kernel driver lists an NVIDIA GPU")
    torch_dir = fake_torch(tmp_path, torch_version, cuda) if torch_version else None
    co = checkout(tmp_path)
    py = fake_python(tmp_path, managed=False, torch_dir=torch_dir)
    d = decisions(co, PYTHON=py, stubs=stub_nvidia_smi(tmp_path, gpu), AUTOCASTFX_TORCH=override)
    assert (d["python_kind"], d["env"], d["env_action"]) == ("plain", str(co / ".venv"), "create")
    assert (d["system_site_packages"], d["torch_want"], d["torch_action"]) == (site, want, action)
    assert d["torch_found"] == (torch_version if site == "yes" else "none")


def make_venv(path, torch_dir=None):
    """A real virtual environment (without pip: fast), optionally holding a stand-in torch."""
    subprocess.run([str(BASE_PYTHON), "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    if torch_dir:
        site = next(path.glob("lib/python3*/site-packages"))
        shutil.copytree(torch_dir / "torch", site / "torch")
    return path


def test_active_venv_is_used_as_is(tmp_path):
    co = checkout(tmp_path)
    venv = make_venv(tmp_path / "active", fake_torch(tmp_path, "2.12.0+cpu"))
    stubs = stub_nvidia_smi(tmp_path, gpu=False)
    by_activation = decisions(co, VIRTUAL_ENV=venv, stubs=stubs)
    by_python = decisions(co, PYTHON=venv / "bin" / "python", stubs=stubs)
    for d in by_activation, by_python:
        assert (d["python_kind"], d["env"], d["env_action"]) == ("venv", str(venv), "use-active")
        assert (d["torch_found"], d["torch_action"]) == ("2.12.0+cpu", "keep")
    assert not (co / ".venv").exists()


def test_active_venv_without_torch_gets_one(tmp_path):
    co = checkout(tmp_path)
    venv = make_venv(tmp_path / "active")
    d = decisions(co, VIRTUAL_ENV=venv, stubs=stub_nvidia_smi(tmp_path, gpu=True))
    assert (d["env"], d["torch_found"], d["torch_action"], d["torch_want"]) == (str(venv), "none", "install", "cuda")


def test_stale_virtual_env_variable_is_named(tmp_path):
    proc = run_sh(checkout(tmp_path), "test", VIRTUAL_ENV=tmp_path / "gone")
    assert proc.returncode == 1
    assert f"VIRTUAL_ENV={tmp_path / 'gone'} has no bin/python" in proc.stderr and "deactivate" in proc.stderr


@pytest.mark.parametrize("gpu, override, want", [
    (True, "", "cuda"),
    (False, "", "cpu"),
    (True, "cpu", "cpu"),
    (False, "cuda", "cuda"),
])
def test_gpu_decides_the_torch_build(tmp_path, gpu, override, want):
    if not gpu and not no_driver_gpus():
        pytest.skip("this machine's kernel driver lists an NVIDIA GPU")
    co = checkout(tmp_path)
    venv = make_venv(tmp_path / "active")
    d = decisions(co, VIRTUAL_ENV=venv, stubs=stub_nvidia_smi(tmp_path, gpu), AUTOCASTFX_TORCH=override)
    assert (d["nvidia_gpu"], d["torch_want"], d["torch_action"]) == ("yes" if gpu else "no", want, "install")


@pytest.mark.parametrize("torch_version, cuda, gpu, override, action", [
    ("2.13.0+cpu", None, True, "", "keep"),         # an installed torch is not replaced unasked...
    ("2.13.0+cpu", None, True, "cuda", "replace"),  # ...but is when the other build is asked for
    ("2.13.0", "13.0", False, "cpu", "replace"),
    ("2.13.0", "13.0", False, "cuda", "keep"),
])
def test_installed_torch_replaced_only_when_asked(tmp_path, torch_version, cuda, gpu, override, action):
    if not gpu and not no_driver_gpus():
        pytest.skip("this machine's kernel driver lists an NVIDIA GPU")
    co = checkout(tmp_path)
    venv = make_venv(tmp_path / "active", fake_torch(tmp_path, torch_version, cuda))
    d = decisions(co, VIRTUAL_ENV=venv, stubs=stub_nvidia_smi(tmp_path, gpu), AUTOCASTFX_TORCH=override)
    assert d["torch_action"] == action
    if gpu and not override:
        assert "AUTOCASTFX_TORCH=cuda" in d["torch_why"]  # says how to get a build that uses the GPU


def test_readme_and_ci_name_the_same_commands(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./run.sh demo", "./run.sh test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == "./run.sh test"
    assert os.access(ROOT / "run.sh", os.X_OK) and os.access(ROOT / ".ci" / "run", os.X_OK)
    proc = run_sh(checkout(tmp_path), "nonsense")
    assert proc.returncode == 2 and "usage: ./run.sh demo|test|bench" in proc.stderr


def base_torch_that_suits():
    """The base interpreter, when run.sh would make a .venv over it that reuses its torch."""
    probe = subprocess.run([str(BASE_PYTHON), "-c",
                            "import os, sysconfig, torch; print(torch.__version__, torch.__file__,"
                            " os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return None, None
    version, torch_file, managed = probe.stdout.split()
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    suits = managed == "False" and (2, 11) <= (major, minor) < (3, 0)
    return (version, Path(torch_file)) if suits else (None, None)


def test_setup_makes_a_venv_that_reuses_the_base_torch(tmp_path):
    """For real: ./run.sh setup in a copy of the checkout, over the base interpreter."""
    version, torch_in_base = base_torch_that_suits()
    if version is None:
        pytest.skip(f"{BASE_PYTHON} has no torch to reuse, or is externally managed")
    if not no_driver_gpus():
        pytest.skip("on a GPU machine only a CUDA torch is reused")
    co = tmp_path / "checkout"
    co.mkdir()
    for name in ("run.sh", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, co / name)
    shutil.copytree(ROOT / "autocastfx", co / "autocastfx", ignore=shutil.ignore_patterns("__pycache__"))
    base_site = Path(subprocess.run([str(BASE_PYTHON), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    before = {p.name for p in base_site.iterdir()}

    proc = run_sh(co, "setup", PYTHON=BASE_PYTHON, stubs=stub_nvidia_smi(tmp_path, gpu=False))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "include-system-site-packages = true" in (co / ".venv" / "pyvenv.cfg").read_text()
    check = subprocess.run([str(co / ".venv" / "bin" / "python"), "-c",
                            "import autocastfx, torch; print(autocastfx.__file__); print(torch.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    package_file, torch_file = check.stdout.split()
    assert Path(package_file).is_relative_to(co)
    assert Path(torch_file) == torch_in_base          # reused, not downloaded again
    venv_site = next((co / ".venv").glob("lib/python3*/site-packages"))
    installed = {p.name for p in venv_site.iterdir()}
    assert "autocastfx-0.1.0.dist-info" in installed  # pip wrote into .venv...
    assert not (set(p.name for p in base_site.iterdir()) - before) & installed  # ...and nothing into the base
    d = decisions(co, PYTHON=BASE_PYTHON, stubs=stub_nvidia_smi(tmp_path, gpu=False))
    assert (d["env_action"], d["torch_found"], d["torch_action"]) == ("reuse", version, "keep")


def test_the_suite_is_taken_by_processes_file_by_file_longest_first(tmp_path, monkeypatch):
    """parallel.py offers the files longest first; processes claiming from one folder (conftest.py) each take a
    file whole, every file exactly once."""
    import types
    parallel, conftest = _tests_module("parallel"), _tests_module("conftest")
    files = parallel.test_files()
    assert "tests/test_setup.py" in files and all(f.startswith("tests/test_") for f in files)
    seconds = {f: float(i % 7 + 1) for i, f in enumerate(files)}
    order = parallel.offered(files, seconds)
    assert sorted(order) == files and [seconds[f] for f in order] == sorted(seconds.values(), reverse=True)
    (tmp_path / "order.json").write_text(json.dumps(order))
    (tmp_path / "claims").mkdir()
    monkeypatch.setenv("AUTOCASTFX_ORDER", str(tmp_path / "order.json"))
    monkeypatch.setenv("AUTOCASTFX_CLAIMS", str(tmp_path / "claims"))
    names = [f"{f}::test_{k}" for f in sorted(files[:6]) for k in "ab"]
    units = conftest._units([types.SimpleNamespace(nodeid=n) for n in names])
    assert [k for k, _ in units] == [f for f in order if f in files[:6]]
    first, second = conftest._claimed(units), conftest._claimed(units)
    taken: list[list[str]] = [[], []]
    for turn in range(2 * len(units)):  # the two processes ask in turns
        got = next((first, second)[turn % 2], None)
        if got is not None:
            taken[turn % 2].append([i.nodeid for i in got])
    assert taken[0] and taken[1]
    run = [n for process in taken for unit in process for n in unit]
    assert sorted(run) == sorted(names)  # every test once
    assert all(len({n.split("::")[0] for n in unit}) == 1 for process in taken for unit in process)  # whole files
    assert next(conftest._claimed(units), None) is None  # a late process finds every unit taken
    assert "tests/parallel.py" in (ROOT / "run.sh").read_text()  # the test command runs it
    # one exit status: a failure wins; a process that collected nothing (5) passes beside one that ran tests
    assert parallel._status([0, 5]) == 0 and parallel._status([5, 5]) == 5
    assert parallel._status([5, 1]) == 1 and parallel._status([0, -11]) == -11 and parallel._status([0, 0]) == 0


def _tests_module(name):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "tests"))


AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


AMX = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags, machine, forced, onednn, cls", [
    (AVX2, "x86_64", "", "", "avx2"),                                      # the 50x slower bfloat16 matmuls
    (AVX2 - {"avx2"}, "x86_64", "", "", "default"),
    (AVX512, "x86_64", "", "", "avx512"),                                  # bfloat16 emulated in oneDNN
    (AVX512 - {"avx512vl"}, "x86_64", "", "", "avx2"),                     # not torch's AVX512 capability
    (AVX512 | {"avx512_bf16"}, "x86_64", "", "", "avx512_bf16"),
    (AMX, "x86_64", "", "", "avx512_amx"),
    (AVX512 | {"avx512_bf16"}, "x86_64", "avx2", "", "avx2_bf16"),         # ATEN_CPU_CAPABILITY lowers it...
    (AVX2, "x86_64", "avx512", "", "avx2"),                                # ...and never raises it
    (AMX, "x86_64", "avx2", "AVX2", "avx2"),                               # oneDNN capped too: an AVX2 machine
    (AMX, "x86_64", "", "avx512_core_bf16", "avx512_bf16"),                # AMX off, AVX512-BF16 on
    (AMX, "x86_64", "", "AVX512_CORE_AMX", "avx512_amx"),                  # oneDNN's older name for AVX10_1_512_AMX
    (AMX, "x86_64", "", "ALL", "avx512_amx"),                              # no cap
    (AMX, "x86_64", "avx2", " avx2 ", "avx2"),                             # as oneDNN reads it
    (frozenset({"fp", "asimd", "bf16"}), "aarch64", "", "", "aarch64_bf16"),
])
def test_cpu_class_from_the_cpus_flags(flags, machine, forced, onednn, cls):
    cpu_class = _tests_module("cpu_class")
    assert cpu_class.cpu_class(frozenset(flags), machine, forced, onednn) == cls


def test_cpu_class_capability_is_torchs():
    """On this machine the capability read from /proc/cpuinfo is the one torch chose."""
    import platform
    import torch
    cpu_class = _tests_module("cpu_class")
    if platform.machine().lower() not in cpu_class.X86:
        pytest.skip("x86 only")
    mine = cpu_class.capability(cpu_class.cpu_flags(), os.environ.get("ATEN_CPU_CAPABILITY"))
    assert mine == torch.backends.cpu.get_cpu_capability().lower()
    assert cpu_class.cpu_class().startswith(mine)


def test_seconds_per_file_come_from_this_cpu_class_or_the_nearest(tmp_path):
    parallel = _tests_module("parallel")
    a, b, c = "tests/test_a.py", "tests/test_b.py", "tests/test_c.py"
    record = {"avx512_bf16": {a: 10.0, b: 20.0, c: 5.0}, "avx2": {a: 40.0, b: 80.0}, "aarch64": {a: 1.0}}
    seconds, sources = parallel.expected_seconds(record, "avx2")
    # its own figures; c from the nearest class that has it, scaled by avx2/avx512_bf16 on a and b (4x)
    assert seconds == {a: 40.0, b: 80.0, c: 20.0} and sources == ["avx2", "avx512_bf16"]
    seconds, sources = parallel.expected_seconds(record, "avx512_amx")  # no record: avx512_bf16's, the nearest
    assert seconds == record["avx512_bf16"] and sources == ["avx512_bf16"]
    assert parallel.expected_seconds(record, "avx512")[1][0] == "avx512_bf16"
    assert parallel.expected_seconds(record, "default")[1][0] == "avx2"
    assert parallel.expected_seconds({}, "avx2") == ({}, [])
    # --record writes this class's figures, keeps a file none of whose tests ran, drops a file gone, leaves the rest
    new = parallel.recorded(record, "avx2", {a: 41.04, "tests/test_gone.py": 3.0}, [a, b, c])
    assert new["avx2"] == {a: 41.0, b: 80.0} and new["avx512_bf16"] == record["avx512_bf16"]
    assert parallel.recorded({}, "avx512", {a: 2.0}, [a]) == {"avx512": {a: 2.0}}


def test_the_recorded_seconds_are_per_cpu_class():
    """tests/file_seconds.json: a record per class of tests/cpu_class.py, seconds by test file."""
    parallel, cpu_class = _tests_module("parallel"), _tests_module("cpu_class")
    record = parallel.load_record()
    assert record and all(cpu_class.rank(cls) is not None for cls in record), list(record)
    for cls, seconds in record.items():
        assert seconds and all(f.startswith("tests/test_") and s >= 0 for f, s in seconds.items()), cls
    assert "avx512_bf16" in record  # the record the suite's 8 minutes were first measured by


def test_the_low_dtype_shapes_follow_the_cpus_bfloat16(monkeypatch):
    """helpers.small_if_emulated keeps the suite's shapes wherever torch runs bfloat16 in oneDNN, and always on a
    CPU with AVX512-BF16 or AMX; it shrinks them only where bfloat16 falls back to torch's scalar loops, or oneDNN is
    capped below AVX-512 (ONEDNN_MAX_CPU_ISA, as when the suite stands in for an AVX2 machine)."""
    import torch
    helpers, cpu_class = _tests_module("helpers"), _tests_module("cpu_class")
    flags = cpu_class.cpu_flags()
    assert helpers.FAST_LOW_DTYPE == helpers.native_low_dtype()  # this process's, under its environment
    capped = not helpers.devices.onednn_allows("AVX512_CORE")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN read its cap when the process started
    assert helpers.small_if_emulated(16, 4) == (16 if onednn else 4)
    if {"avx512_bf16", "amx_bf16"} & flags and not capped:
        assert onednn and helpers.small_if_emulated(16, 4) == 16
    if flags and not {"avx512f", "avx_ne_convert"} & flags:  # no AVX-512, no AVX-NE-CONVERT: torch's own loops
        assert not onednn and helpers.small_if_emulated(16, 4) == 4
    for cap in ("AVX2", "avx2_vnni_2", "SSE41"):  # below AVX-512: scalar loops, whatever the CPU has
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert helpers.small_if_emulated(16, 4) == 4 and helpers.native_low_dtype() is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert helpers.small_if_emulated(16, 4) == (16 if onednn else 4)
