"""The autocastfx command line: ``python -m autocastfx`` through a subprocess once per outcome (a report, a one-line
error), every other case through ``cli.main`` in this process, which is what ``__main__`` calls."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autocastfx.tools import cli

TESTS = Path(__file__).parent


def run_process(*args, cwd=TESTS):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    return subprocess.run([sys.executable, "-m", "autocastfx", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.fixture
def run(capsys, monkeypatch):
    """``main(args)`` in this process, from the tests' folder, as a finished process: returncode, stdout, stderr."""
    monkeypatch.chdir(TESTS)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory puts the working folder on the path

    def call(*args):
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return call


def test_the_module_entry_point_exits_2_with_one_line():
    """``python -m autocastfx``: main()'s status is the process's, and a model that fails prints one line."""
    p = run_process("inspect", "small_models:TinyResNet", "--input", "1x5x16x16")
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("autocastfx: error:")


def test_inspect_text_and_json(run):
    p = run("inspect", "small_models:TinyResNet", "--input", "2x3x16x16")
    assert p.returncode == 0, p.stderr
    assert "casts per forward" in p.stdout and "conv2d" in p.stdout
    p = run("inspect", "small_models:TinyGPT", "--input", "2x16", "--input-dtype", "long", "--dtype", "bf16", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["totals"]["dtype"] == "bf16" and d["totals"]["capture"] == "torch.export"


def test_export_writes_loadable_pt2(run, tmp_path):
    out = tmp_path / "m.pt2"
    p = run("export", "small_models:TinyResNet", "--input", "1x3x16x16", "-o", str(out))
    assert p.returncode == 0, p.stderr
    m = torch.export.load(out).module()
    assert m(torch.randn(1, 3, 16, 16)).shape == (1, 10)


def test_export_to_an_unknown_format_is_a_one_line_error(run, tmp_path):
    p = run("export", "small_models:TinyResNet", "--input", "1x3x16x16", "-o", str(tmp_path / "m.bin"))
    assert p.returncode == 2 and ".pt2" in p.stderr and ".onnx" in p.stderr and "Traceback" not in p.stderr


def test_graph_dot_and_model_explorer(run, tmp_path):
    p = run("graph", "small_models:TinyResNet", "--input", "1x3x16x16", "-o", str(tmp_path / "g.dot"))
    assert p.returncode == 0, p.stderr
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and "blocks.0" in dot and "#e63946" in dot  # casts drawn
    p = run("graph", "small_models:TinyViT", "--input", "1x3x16x16", "-o", str(tmp_path / "v.svg"),
            "--model-explorer")
    assert p.returncode == 0, p.stderr
    node_data = json.loads((tmp_path / "v.node_data.json").read_text())
    names = {n.name for n in torch.export.load(tmp_path / "v.pt2").graph.nodes}
    assert set(node_data["main"]["results"]) <= names


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_svg_rendered(run, tmp_path):
    p = run("graph", "small_models:TinyDenseNet", "--input", "1x3x16x16", "-o", str(tmp_path / "g.svg"))
    assert p.returncode == 0, p.stderr
    assert "<svg" in (tmp_path / "g.svg").read_text()


@pytest.mark.parametrize("args, message", [
    (["inspect", "small_models", "--input", "1x3"], "module.path:factory"),
    (["inspect", "no_such_module:f", "--input", "1x3"], "cannot import"),
    (["inspect", "small_models:Nope", "--input", "1x3"], "no attribute"),
    (["inspect", "small_models:TinyResNet", "--input", "1xx3"], "bad --input shape"),
    (["inspect", "small_models:TinyResNet"], "--input"),
    (["inspect", "small_models:TinyResNet", "--input", "1x3x16x16", "--dtype", "fp8"], "bad --dtype"),
    (["inspect", "small_models:TinyResNet", "--input", "1x3x16x16", "--input-dtype", "complex"], "--input-dtype"),
    (["inspect", "small_models:ALL", "--input", "1x3"], "not callable"),
    (["inspect", "small_models:TinyResNet", "--input", "1x5x16x16"], "error"),
])
def test_user_errors_one_line_exit_2(run, args, message):
    p = run(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr and len(err.splitlines()) == 1 and message in err, err
