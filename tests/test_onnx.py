"""ONNX deployment: autocastfx.export(gm, "model.onnx") writes a file onnxruntime loads and runs, checked against the
converted module; the inference copy folds batch norms and keeps every weight low (about half the float32 bytes)."""
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("onnx", reason="ONNX export needs onnx and onnxscript: pip install 'autocastfx[onnx]'")
pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript: pip install 'autocastfx[onnx]'")
ort = pytest.importorskip("onnxruntime", reason="the check needs onnxruntime: pip install 'autocastfx[onnx]'")
import onnx  # noqa: E402

import autocastfx  # noqa: E402
from autocastfx.tools.export import ExportCheckError  # noqa: E402
from helpers import AtenRecorder  # noqa: E402
from small_models import ALL, example  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm()).item()


def _bytes(path) -> int:
    """The model's bytes on disk: the .onnx file and the external data file the exporter writes beside it."""
    data = Path(str(path) + ".data")
    return os.path.getsize(path) + (os.path.getsize(data) if data.exists() else 0)


def _weight_bytes(path) -> dict:
    m = onnx.load(str(path))
    out: dict = {}
    for t in m.graph.initializer:
        kind = onnx.TensorProto.DataType.Name(t.data_type)
        out[kind] = out.get(kind, 0) + (len(t.raw_data) or sum(1 for _ in t.float_data) * 4)
    return out


def _run(path, x):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def resnet():
    """The eval ResNet, its input and its conversion, made once: the tests that only read them share them."""
    model, (x,) = example("resnet")
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, x, autocastfx.convert(model, (x,))


@pytest.mark.parametrize("name", ALL)
def test_test_models_export_to_onnx_that_onnxruntime_runs(name, tmp_path, request):
    if name == "resnet":
        model, x, gm = request.getfixturevalue("resnet")
    else:
        model, (x,) = example(name)
        model.eval()
        gm = autocastfx.convert(model, (x,))
    autocastfx.export(gm, tmp_path / "m.onnx", (x,))  # checks the file in onnxruntime itself
    torch.onnx.export(model, (x,), tmp_path / "f32.onnx", dynamo=True, verbose=False)
    got = _run(tmp_path / "m.onnx", x)
    ref = model(x).detach()
    with torch.autocast("cpu", dtype=torch.float16):
        err_ac = _rel(model(x).detach().float(), ref)
    err = _rel(got, ref)
    assert err <= max(2 * err_ac, 2e-3), (err, err_ac)
    ours, theirs = _weight_bytes(tmp_path / "m.onnx"), _weight_bytes(tmp_path / "f32.onnx")
    ratio = sum(ours.values()) / sum(theirs.values())
    print(f"{name}: onnxruntime error {err:.2e} (autocast {err_ac:.2e}), weight bytes {ratio:.2f}x, "
          f"file bytes {_bytes(tmp_path / 'm.onnx') / _bytes(tmp_path / 'f32.onnx'):.2f}x")
    assert ratio <= 0.55, (ours, theirs)  # these models are so small that graph structure outweighs weights
    f32 = [t.name for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer
           if t.data_type == onnx.TensorProto.FLOAT and len(t.raw_data) > 64]
    assert all("running" in n for n in f32), f32  # float32 only for the statistics of unfolded batch norms


def test_a_real_transformer_exports_at_half_the_bytes(tmp_path):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # one layer: the embeddings (0.5M of its 0.7M weights) dominate the file as a real model's weights do
    cfg = tf.BertConfig(vocab_size=4000, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64)
    model = tf.BertModel(cfg).eval()
    ids = torch.randint(0, 4000, (2, 16))
    gm = autocastfx.convert(model, (ids,))
    autocastfx.export(gm, tmp_path / "bert.onnx", (ids,))
    torch.onnx.export(model, (ids,), tmp_path / "f32.onnx", dynamo=True, verbose=False)
    ref = model(ids).last_hidden_state.detach()
    with torch.autocast("cpu", dtype=torch.float16):
        err_ac = _rel(model(ids).last_hidden_state.float(), ref)
    err = _rel(_run(tmp_path / "bert.onnx", ids), ref)
    ratio = _bytes(tmp_path / "bert.onnx") / _bytes(tmp_path / "f32.onnx")
    print(f"BERT: onnxruntime error {err:.2e} (autocast {err_ac:.2e}), file bytes {ratio:.3f}x")
    assert ratio <= 0.55
    assert err <= max(2 * err_ac, 2e-3), (err, err_ac)


def test_inference_copy_folds_batch_norms_and_keeps_no_float32_weight(resnet):
    model, x, gm = resnet
    inf = autocastfx.for_inference(gm)
    done = inf.meta["autocastfx"].extra_totals["inference"]
    assert len(done["batch_norms_folded"]) == 5
    assert all(p.dtype == torch.float16 for p in inf.parameters())
    assert not autocastfx.master_parameters(inf)  # nothing float32 for its graph to cast: every weight stored low
    assert not {id(p) for p in inf.parameters()} & {id(p) for p in model.parameters()}  # copies, not the model's
    assert not any(isinstance(m, nn.BatchNorm2d) for m in inf.modules())
    with AtenRecorder() as rec:
        out = inf(x)
    assert not [c for c in rec.calls if "batch_norm" in c.name]
    convs = [c for c in rec.calls if c.name == "convolution"]
    assert convs and all(set(c.in_dtypes) == {torch.float16} for c in convs)
    torch.testing.assert_close(out.float(), model(x), rtol=1e-2, atol=1e-2)
    # the training module is left as it is: the model's own float32 parameters, the ones its graph casts included
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    assert all(p.dtype == torch.float32 for p in gm.parameters()) and autocastfx.master_parameters(gm)


def test_other_extensions_are_refused_with_the_formats(resnet, tmp_path):
    _, x, gm = resnet
    with pytest.raises(ValueError, match=r"\.pt2.*\.onnx"):
        autocastfx.export(gm, tmp_path / "model.onxx", (x,))
    assert not any(tmp_path.iterdir())


def test_a_file_that_does_not_match_is_an_error(resnet, tmp_path):
    """The check compares onnxruntime's outputs with the module's; held to bit equality, float16 kernels of two
    runtimes disagree, and the error says by how much."""
    from autocastfx.tools.export import export_onnx

    _, x, gm = resnet
    with pytest.raises(ExportCheckError, match="differs from the module's by"):
        export_onnx(gm, tmp_path / "m.onnx", (x,), rtol=0.0)


def test_deployment_example_runs(tmp_path, capsys):
    """examples/deploy_onnx.py, called as its command line calls it, into a folder it makes: the file onnxruntime
    runs is within float16 rounding of the float32 model, as torch.autocast is."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import deploy_onnx
    finally:
        sys.path.pop(0)
    out = tmp_path / "new" / "folder"
    err, err_ac = deploy_onnx.main(["--out", str(out)])
    printed = capsys.readouterr().out
    assert "onnxruntime" in printed and f"relative error against the float32 model {err:.2e}" in printed
    assert (out / "model.onnx").exists() and (out / "float32.onnx").exists()
    assert err < 1e-2 and err < 3 * err_ac + 1e-3, (err, err_ac)


class _Exported(nn.Module):
    """A forward symbolic tracing cannot run (it unpacks a traced shape): torch.export captures it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        b, *_ = x.shape  # noqa: F841
        return self.inner(x)


@pytest.mark.parametrize("path", ["symbolic_trace", "torch.export"])
def test_folded_batch_norms_use_their_own_statistics_on_either_capture(path):
    """Batch norms with statistics and affine parameters that all differ (a fresh batch norm's mean 0, var 1,
    weight 1, bias 0 hide a mixed-up argument order): the folded convolutions compute the float32 model's eval
    output, from F.batch_norm's arguments (symbolic tracing) and from aten.batch_norm's (torch.export)."""
    torch.manual_seed(0)
    model, (x,) = example("resnet")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    model = (model if path == "symbolic_trace" else _Exported(model)).eval()
    gm = autocastfx.convert(model, (x,))
    assert gm.meta["autocastfx"].capture == path
    inf = autocastfx.for_inference(gm)
    assert len(inf.meta["autocastfx"].extra_totals["inference"]["batch_norms_folded"]) == 5
    ref = model(x)
    bound = max(3 * _rel(gm(x).float(), ref), 1e-2)
    err = _rel(inf(x).float(), ref)
    assert err < bound, (err, bound)

class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return self.l(x) - 3 * y


def test_keyword_inputs_out_of_order_export_and_check_by_name(tmp_path):
    """The file's inputs follow forward's order and the check feeds them so (before, it paired them by position
    with the order given: 'differs from the module's by 1.33')."""
    torch.manual_seed(0)
    m = _TwoInputs()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    gm = autocastfx.convert(m, example_kwargs={"y": y, "x": x}, dtype=torch.float16)
    autocastfx.export(gm, tmp_path / "k.onnx", example_kwargs={"y": y, "x": x})
    session = ort.InferenceSession(str(tmp_path / "k.onnx"))
    assert [i.name for i in session.get_inputs()] == ["x", "y"]
    out = torch.from_numpy(session.run(None, {"x": x.numpy(), "y": y.numpy()})[0]).float()
    want = m(x, y)
    assert ((out - want).norm() / want.norm()).item() < 2e-2
