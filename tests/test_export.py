"""export(): a plain torch.export archive; save()/load(): no arbitrary unpickling, clear errors on bad files."""
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from autocastfx.tools.export import FormatError, export, load, model_explorer_overlay, save
from small_models import example

BLOCKER = "import sys; sys.modules['autocastfx'] = None\n"  # any `import autocastfx` now fails


def _convert(name):
    model, inputs = example(name)
    model.eval()
    return autocastfx.convert(model, inputs, pad_multiple=1), inputs


# The conversions, files and process below are shared by the tests that only read them: each is made once.
@pytest.fixture(scope="module")
def resnet():
    return _convert("resnet")


@pytest.fixture(scope="module")
def vit():
    return _convert("vit")


@pytest.fixture(scope="module")
def saved_resnet(resnet, tmp_path_factory):
    """The converted ResNet saved once: the file the loading and tampering tests start from (none writes to it)."""
    path = tmp_path_factory.mktemp("saved") / "good.acfx"
    save(resnet[0], path)
    return path


@pytest.fixture(scope="module")
def exported(resnet, vit, tmp_path_factory):
    """name -> (the .pt2 export() wrote, the program it returned, the converted module's inputs and output)."""
    folder = tmp_path_factory.mktemp("exported")
    out = {}
    for name, (gm, inputs) in (("resnet", resnet), ("vit", vit)):
        path, io_path = folder / f"{name}.pt2", folder / f"{name}.io.pt"
        ep = export(gm, path, inputs)
        torch.save({"x": inputs[0], "y": gm(*inputs)}, io_path)
        out[name] = (path, ep, io_path)
    return out


LOAD_ALONE = BLOCKER + (
    "import sys\n"
    "import torch\n"
    "try:\n    import autocastfx\n    raise SystemExit('autocastfx importable')\nexcept ImportError:\n    pass\n"
    "for name, path, io_path in zip(*[iter(sys.argv[1:])] * 3):\n"
    "    m = torch.export.load(path).module()\n"
    "    io = torch.load(io_path)\n"
    "    y = m(io['x'])\n"
    "    assert y.dtype == io['y'].dtype and torch.equal(y, io['y']), (name, (y - io['y']).abs().max())\n"
    "    print(name, 'identical')\n")


@pytest.fixture(scope="module")
def loaded_alone(exported):
    """Every exported file loaded and run in one fresh process in which autocastfx cannot be imported (one process
    for both models: starting one costs seconds)."""
    args = [str(a) for name, (path, _, io_path) in exported.items() for a in (name, path, io_path)]
    return subprocess.run([sys.executable, "-c", LOAD_ALONE, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_export_loads_without_autocastfx_bit_identical(name, loaded_alone):
    proc = loaded_alone
    assert proc.returncode == 0 and f"{name} identical" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_save_load_round_trip_and_resume_training(tmp_path):
    gm, inputs = _convert("resnet")
    gm.train()  # a module to train is saved in training mode: a loaded one runs the program it was saved in
    path = tmp_path / "m.acfx"
    save(gm, path)
    with zipfile.ZipFile(path) as z:  # version 2: the program holds the float32 parameters, nothing beside it
        assert sorted(z.namelist()) == ["meta.json", "program.pt2"]
        meta = json.loads(z.read("meta.json"))
    assert meta["version"] == 2 and "masters" not in meta
    g2 = load(path)
    assert torch.equal(g2(*inputs), gm(*inputs))
    # the float32 weights, by the model's names, exactly (the ones the graph casts low included)
    saved, own = g2.state_dict(), gm.state_dict()
    assert sorted(saved) == sorted(own) and all(torch.equal(saved[k], own[k]) for k in own)
    assert all(p.dtype == torch.float32 for p in g2.parameters())
    assert autocastfx.master_parameters(gm) and all(p.dtype == torch.float32 for p in autocastfx.master_parameters(gm))
    assert str(autocastfx.report(g2)) == str(autocastfx.report(gm))
    assert g2.meta["autocastfx"].policy.op_table == gm.meta["autocastfx"].policy.op_table
    # the loaded module trains with autocastfx's step
    step = autocastfx.train_step(g2, F.cross_entropy, torch.optim.SGD(g2.parameters(), lr=0.1))
    x = torch.randn(2, 3, 16, 16)
    w0 = {n: p.clone() for n, p in g2.named_parameters()}
    step((x,), torch.tensor([1, 2]))
    moved = [n for n, p in g2.named_parameters() if not torch.equal(w0[n], p)]
    assert "stem.weight" in moved and "fc.weight" in moved
    assert g2.training and meta["training"] is True
    # saved after gm.eval(): the loaded module says so, and its eval program is refused for training
    gm.eval()
    save(gm, tmp_path / "eval.acfx")
    g3 = load(tmp_path / "eval.acfx")
    assert not any(m.training for m in g3.modules())
    assert torch.equal(g3(*inputs), gm(*inputs))
    with pytest.raises(autocastfx.StepError, match="saved after gm.eval"):
        autocastfx.train_step(g3, F.cross_entropy, torch.optim.SGD(g3.parameters(), lr=0.1))


def test_master_parameters_of_a_loaded_module_are_the_weights_its_program_casts_low(resnet, saved_resnet):
    """A loaded program carries no node annotations: its casts are read as torch.export wrote them."""
    gm, _ = resnet
    g2 = load(saved_resnet)
    names = {id(p): n for n, p in g2.named_parameters()}
    own = {id(p): n for n, p in gm.named_parameters()}
    assert [names.get(id(p)) for p in autocastfx.master_parameters(g2)] == \
        [own[id(p)] for p in autocastfx.master_parameters(gm)]


def _rewrite_member(src, dst, member, data):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for n in zin.namelist():
            zout.writestr(n, data if n == member else zin.read(n))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EVIL_MARK', '/tmp/autocastfx_evil')}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the tampered file is written so
def test_tampered_pickle_is_refused_without_running_code(saved_resnet, tmp_path, monkeypatch):
    good, bad = saved_resnet, tmp_path / "bad.acfx"
    mark = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    buf = io.BytesIO()
    pickle.dump({"stem.weight": _Evil()}, buf)
    _rewrite_member(good, bad, "program.pt2", buf.getvalue())  # the program replaced by a pickle
    with pytest.raises(FormatError, match="program.pt2 does not load"):
        load(bad)
    assert not mark.exists()
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:  # a pickle beside the program
        for n in zin.namelist():
            zout.writestr(n, zin.read(n))
        zout.writestr("masters.pt", buf.getvalue())
    with pytest.raises(FormatError, match=r"unexpected members \['masters.pt', 'meta.json', 'program.pt2'\]"):
        load(bad)
    assert not mark.exists()


def test_tampered_meta_and_truncated_files(saved_resnet, tmp_path):
    good = saved_resnet
    data = good.read_bytes()
    trunc = tmp_path / "trunc.acfx"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated|not a readable"):
        load(trunc)
    with zipfile.ZipFile(good) as z:
        meta = json.loads(z.read("meta.json"))
    bad = tmp_path / "bad.acfx"
    for key, value, says in [("version", 1, "format version 1, expected 2"),  # a file with float32 masters beside
                             ("dtype", "float64", "dtype 'float64'"),
                             ("report", None, "field 'report' missing")]:
        _rewrite_member(good, bad, "meta.json", json.dumps({**meta, key: value}).encode())
        with pytest.raises(FormatError, match=says):
            load(bad)
    meta["format"] = "something else"
    _rewrite_member(good, bad, "meta.json", json.dumps(meta).encode())
    with pytest.raises(FormatError, match="format tag"):
        load(bad)
    _rewrite_member(good, bad, "meta.json", b"{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load(bad)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.acfx")


def test_model_explorer_overlay_ids_match_exported_graph(vit, exported):
    gm, _ = vit
    path, ep, _ = exported["vit"]
    overlay = model_explorer_overlay(gm, ep)
    results = overlay["node_data"]["main"]["results"]
    names = {n.name for n in torch.export.load(path).graph.nodes}
    assert results and set(results) <= names
    lows = [k for k, v in results.items() if v["value"] == 1.0 and overlay["notes"][k]["kind"] == "op"]
    assert any("linear" in k or "conv" in k for k in lows)
    assert all(overlay["notes"][k]["reason"] for k in results)


def test_onnx_export_optional(resnet, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    gm, inputs = resnet
    torch.onnx.export(gm, inputs, str(tmp_path / "m.onnx"), dynamo=True)
    assert (tmp_path / "m.onnx").stat().st_size > 0


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, a, b):
        return self.l(a) - 3 * b


def test_keyword_inputs_given_out_of_order_are_bound_by_name(tmp_path):
    """torch.export of a GraphModule binds keyword inputs given out of the signature's order to the wrong
    parameters (pytorch/pytorch#143732): the .pt2 and the saved module took b for a (1.56 off)."""
    torch.manual_seed(0)
    m = _TwoInputs()
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    kw = {"b": b, "a": a}
    gm = autocastfx.convert(m, example_kwargs=kw, dtype=torch.bfloat16)
    want = m(a=a, b=b)
    autocastfx.export(gm, tmp_path / "k.pt2", example_kwargs=kw)
    autocastfx.save(gm, tmp_path / "k.acfx", example_kwargs=kw)
    for got in (torch.export.load(tmp_path / "k.pt2").module()(**kw), autocastfx.load(tmp_path / "k.acfx")(**kw)):
        assert ((got - want).norm() / want.norm()).item() < 2e-2
