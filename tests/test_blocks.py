"""Blocks stay modules (convert(..., blocks="auto")), and piecewise conversion of a model that does not capture."""
import copy
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder, run_ranks

VOCAB, D = 64, 32


class Layer(nn.Module):
    def __init__(self, d=D, heads=4, p=0.0):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Stack(nn.Module):
    """A language model whose decoder layers are a ModuleList, as Hugging Face and TorchTitan write them."""

    def __init__(self, layers=6, p=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Layer(p=p) for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class DataDependentLoss(Stack):
    """A forward no graph capture takes: the loss depends on the labels' values (as DeBERTa-v2's does)."""

    def forward(self, ids, labels=None):
        logits = super().forward(ids)
        if labels is not None and bool((labels >= 0).all()):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return logits


def ids(batch=2, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, t), generator=g)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def converted(model, x, **kw):
    return autocastfx.convert(model, (x,), **kw)


@pytest.fixture(scope="module")
def stack():
    """A six-layer Stack, its input, and its conversions with blocks and as one graph: made once, for the tests that
    only read them (names, parameters, plans, and what they compute and cast)."""
    torch.manual_seed(0)
    model, x = Stack(), ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, x, converted(model, x), converted(model, x, blocks=None)


def test_blocks_stay_modules_at_their_names_in_their_container(stack):
    model, x, gm, flat = stack
    assert isinstance(gm.layers, nn.ModuleList) and len(gm.layers) == 6
    assert all("autocastfx" in layer.meta for layer in gm.layers)  # each a converted module of its own
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert [f"layers.{i}" for i in range(6)] == [c for c in calls if c.startswith("layers")]
    assert not isinstance(getattr(flat, "layers", None), nn.ModuleList)
    # the same parameter names and values as the one-graph conversion: both are the model's own tensors
    sd, sf = gm.state_dict(), flat.state_dict()
    assert set(sd) == set(sf)
    for k in sd:
        assert sd[k].dtype == sf[k].dtype == torch.float32 and torch.equal(sd[k], sf[k]), k
        assert sd[k].untyped_storage().data_ptr() == sf[k].untyped_storage().data_ptr(), k
    params = dict(model.named_parameters())
    assert all(p is params[n] for n, p in gm.named_parameters())
    masters = {id(p) for p in autocastfx.master_parameters(gm)}  # what the blocks' graphs cast low
    assert len(masters) >= 6 * 4 and masters <= {id(p) for p in params.values()}


def test_blocks_alike_are_planned_once_and_hold_their_own_weights(stack):
    model, _, gm, _ = stack
    plans = [layer.meta["autocastfx_block"]["plan"] for layer in gm.layers]
    assert sum("reused" in p for p in plans) >= 4, plans  # layer 0 takes float32 in, layer 1 float16: the rest reuse
    seen = set()
    for i, layer in enumerate(gm.layers):
        mine = dict(layer.named_parameters())
        theirs = dict(model.layers[i].named_parameters())
        assert mine.keys() == theirs.keys()
        for n, p in theirs.items():  # the model's block's own parameters, float32, none shared with another block
            assert mine[n] is p and p.dtype == torch.float32 and id(p) not in seen, (i, n)
            seen.add(id(p))
        low = autocastfx.master_parameters(layer)  # the weights its graph casts low: its linears'
        assert low and all(any(q is p for p in theirs.values()) for q in low), i
        assert {n for n, p in theirs.items() if any(q is p for q in low)} >= {"qkv.weight", "proj.weight"}


def test_tree_computes_what_the_one_graph_conversion_computes_with_no_more_casts(stack):
    model, x, gm, flat = stack
    ref = model(x)
    out, out_flat = gm(x), flat(x)
    with torch.autocast("cpu", dtype=torch.float16):
        err_ac = rel(model(x).float(), ref)
    assert out.dtype == torch.float32
    print(f"error vs float32: blocks {rel(out, ref):.2e}, one graph {rel(out_flat, ref):.2e}, autocast {err_ac:.2e}")
    # within the parity bound, as the one graph is (the blocks' plans may break ties between equal-cost
    # labellings of the residual stream otherwise than the one graph's plan)
    assert rel(out, ref) <= max(2 * err_ac, 2e-3) and rel(out_flat, ref) <= max(2 * err_ac, 2e-3)
    casts = []
    for m in (gm, flat):
        with AtenRecorder() as rec:
            m(x)
        casts.append(len(rec.float_casts()))
    print(f"float casts per forward (aten): blocks {casts[0]}, one graph {casts[1]}")
    assert casts[0] <= casts[1] + len(gm.layers) + 1  # at most one more per boundary; no round trip per block


@pytest.mark.parametrize("widest,hand_off", [(True, torch.float32), (False, torch.float16)],
                         ids=["widest", "mincut"])
def test_each_block_runs_its_matmuls_low_and_takes_the_previous_blocks_output_without_a_copy(widest, hand_off):
    # the default (widest): the residual stream stays float32 from block to block, as under torch.autocast;
    # the min-cut policy hands the previous block's low output on as it is
    torch.manual_seed(0)
    model, x = Stack(layers=3), ids()
    gm = converted(model, x, policy=autocastfx.Policy.default().override(widest=widest))
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)) for layer in gm.layers]
    with AtenRecorder() as rec:
        gm(x)
    for h in hooks:
        h.remove()
    assert seen[1:] == [hand_off] * 2  # block to block, no round trip
    mm = rec.ops("addmm", "mm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "linear")
    assert mm and all(all(d == torch.float16 for d in c.in_dtypes) for c in mm if c.name in ("addmm", "mm")), \
        [(c.name, c.in_dtypes) for c in mm]


def test_modes_and_report_and_export_work_with_blocks(tmp_path):
    torch.manual_seed(0)
    model, x = Stack(layers=3, p=0.3), ids()
    gm = converted(model, x)
    gm.train()
    assert not torch.equal(gm(x), gm(x))  # dropout inside each block follows the tree's mode
    gm.eval()
    model.eval()
    a, b = gm(x), gm(x)
    assert torch.equal(a, b) and all(not layer.training for layer in gm.layers)
    assert rel(a, model(x)) < 5e-3
    r = autocastfx.report(gm)
    assert set(r.totals["blocks"]) == {"layers.0", "layers.1", "layers.2"}
    assert "blocks:" in str(r) and "layers.2" in str(r)
    autocastfx.export(gm, tmp_path / "m.pt2", (x,))
    code = ("import torch,sys; ep=torch.export.load(sys.argv[1]); x=torch.load(sys.argv[2]);"
            "torch.save(ep.module()(x), sys.argv[3])")
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt2"), str(tmp_path / "x.pt"),
                    str(tmp_path / "y.pt")], check=True, env=env, cwd=tmp_path)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), a, rtol=0, atol=1e-6)


def test_the_step_trains_a_tree_as_it_trains_the_one_graph():
    def run(blocks):
        torch.manual_seed(0)
        model = Stack(layers=4)
        gm = converted(model, ids(), blocks=blocks)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
        step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), opt,
                                     clip_grad_norm=1.0)
        losses = [float(step(ids(seed=i), ids(seed=100 + i))) for i in range(8)]
        return losses, {n: p.detach().clone() for n, p in gm.named_parameters()}  # float32: the masters
    (la, wa), (lb, wb) = run("auto"), run(None)
    assert set(wa) == set(wb)
    # all weights as one vector (a key bias's gradient is rounding noise alone: softmax ignores it)
    va, vb = torch.cat([wa[n].flatten() for n in sorted(wa)]), torch.cat([wb[n].flatten() for n in sorted(wa)])
    drift = rel(va, vb)
    print(f"8 SGD steps, blocks vs one graph: largest loss difference {max(abs(a - b) for a, b in zip(la, lb)):.2e}, "
          f"weights apart by {drift:.2e} (relative)")
    assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-3 and drift < 3e-3


def test_block_choice_by_name_and_by_function_and_refusals():
    torch.manual_seed(0)
    model, x = Stack(layers=3), ids()
    gm = converted(model, x, blocks=["layers.1"])
    assert "autocastfx" in gm.get_submodule("layers.1").meta
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and str(n.target).count(".") == 1
            and str(n.target).startswith("layers")] == ["layers.1"]
    gm = converted(model, x, blocks=lambda name, m: isinstance(m, Layer) and name != "layers.0")
    blocks = {n for n, m in gm.named_modules() if "autocastfx_block" in getattr(m, "meta", {})}
    assert blocks == {"layers.1", "layers.2"}
    with pytest.raises(ValueError, match="ModuleLists"):
        converted(model, x, blocks=["layer.9"])
    with pytest.raises(ValueError, match=r"names a ModuleList, which holds blocks .* \('layers.0', \.\.\.\)"):
        converted(model, x, blocks=["layers"])  # was "TypeError: '_Stand' object is not iterable"
    with pytest.raises(TypeError, match="blocks must be"):
        converted(model, x, blocks=3)


class Shared(nn.Module):
    """One layer applied twice (weights shared between calls): not a block."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        x = self.layers[0](x)
        x = self.layers[0](x)
        return self.head(self.layers[1](x))


def test_a_layer_called_twice_is_not_made_a_block():
    torch.manual_seed(0)
    model, x = Shared(), ids()
    gm = converted(model, x)
    assert "autocastfx_block" not in getattr(gm.get_submodule("layers.0"), "meta", {})
    assert rel(gm(x), model(x)) < 5e-3


def test_a_model_that_does_not_capture_is_converted_piecewise():
    torch.manual_seed(0)
    model, x, y = DataDependentLoss(layers=3), ids(), ids(seed=7)
    with pytest.raises(autocastfx.CaptureError):
        autocastfx.convert(model, (x,), example_kwargs={"labels": y}, blocks=None)  # as one graph: refused
    with pytest.warns(UserWarning, match="piecewise"):
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, (x,), example_kwargs={"labels": y})
    assert type(gm) is DataDependentLoss  # the model's own Python around the converted parts
    units = {n for n, m in gm.named_modules() if n and "autocastfx" in getattr(m, "meta", {})}
    assert {"layers.0", "layers.1", "layers.2", "head"} <= units, units
    r = autocastfx.report(gm)
    assert r.totals["capture"] == "piecewise" and "" in r.totals["eager"]
    assert "stays eager" in str(r) or "eager" in str(r)
    # outputs: the model's, in float32, within the parity bound; loss through the model's own branch
    ref = model(x)
    with torch.autocast("cpu", dtype=torch.float16):
        err_ac = rel(model(x).float(), ref)
    out = gm(x)
    assert out.dtype == torch.float32 and rel(out, ref) <= max(2 * err_ac, 2e-3)
    assert abs(float(gm(x, labels=y)) - float(model(x, labels=y))) < 1e-2
    with AtenRecorder() as rec:
        gm(x)
    assert all(all(d == torch.float16 for d in c.in_dtypes) for c in rec.ops("addmm", "mm"))
    # and it trains through autocastfx's step with the model's own loss
    step = autocastfx.train_step(gm, lambda loss: loss, torch.optim.SGD(gm.parameters(), lr=0.1))
    losses = [float(step({"ids": x, "labels": y})) for _ in range(5)]
    assert losses[-1] < losses[0]
    gm.eval()
    assert torch.equal(gm(x), gm(x))


def test_export_of_a_piecewise_model_works_without_the_branch_or_names_what_stops_it(tmp_path):
    torch.manual_seed(0)
    model, x, y = DataDependentLoss(layers=2), ids(), ids(seed=7)
    gm = autocastfx.convert(model, (x,), example_kwargs={"labels": y})
    from autocastfx.tools.export import ExportError
    with pytest.raises(ExportError, match="piecewise.*DataDependentLoss: torch.fx.symbolic_trace failed"):
        autocastfx.export(gm, tmp_path / "m.pt2", (x,), example_kwargs={"labels": y})
    ep = autocastfx.export(gm, tmp_path / "m.pt2", (x,))  # without labels the model's code is a graph
    torch.testing.assert_close(ep.module()(x), gm.eval()(x), rtol=0, atol=1e-6)


class Branchy(nn.Module):
    """No ModuleList, and a forward that no capture takes: its children are converted on their own."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, 10)

    def forward(self, x, y=None):
        h = self.body(x)
        if y is not None and bool((y >= 0).all()):
            return F.cross_entropy(self.head(h), y)
        return self.head(h)


def test_a_model_without_blocks_that_does_not_capture_is_converted_piecewise_too():
    torch.manual_seed(0)
    model, x, y = Branchy(), torch.randn(4, D), torch.tensor([1, 2, 3, 4])
    with pytest.warns(UserWarning, match="piecewise"):
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, (x,), example_kwargs={"y": y})
    assert {"body", "head"} <= {n for n, m in gm.named_modules() if n and "autocastfx" in getattr(m, "meta", {})}
    assert rel(gm(x), model(x)) < 5e-3 and abs(float(gm(x, y)) - float(model(x, y))) < 1e-2
    with pytest.raises(autocastfx.CaptureError):
        autocastfx.convert(model, (x,), example_kwargs={"y": y}, blocks=None)  # None: one graph or nothing


class _FLayer(Layer):  # functional dropout: each block's graph differs between the modes
    def forward(self, x):
        x = x + F.dropout(self.proj(self.ln1(x)), 0.1, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.1, self.training)


class _FStack(Stack):
    def __init__(self):
        super().__init__(layers=2)
        self.layers = nn.ModuleList(_FLayer() for _ in range(2))


def _switch_under_fsdp(rank, init_file):
    import torch.distributed as dist
    from autocastfx.core.modes import mode_nodes
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        gm = autocastfx.convert(_FStack(), (ids(),))
        assert mode_nodes(gm.layers[0])
        autocastfx.shard(gm)
        gm.train()
        gm(ids())
        gm.eval()
        assert torch.equal(gm(ids()), gm(ids()))
        gm.train()
        assert not torch.equal(gm(ids()), gm(ids()))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_blocks_switch_modes_after_fsdp2_made_their_class(tmp_path):
    """fully_shard() gives each block a class of its own; a block whose graph changes with the mode is recompiled
    on that class, which once sent every later call into endless recursion. One gloo rank in a process of its
    own."""
    run_ranks(_switch_under_fsdp, (str(tmp_path / "init"),), 1)


class OddStack(nn.Module):
    """Feature widths no tensor core likes (36, 4 x 36): padding happens inside each block."""

    def __init__(self, d=36, layers=3):
        super().__init__()
        self.inp = nn.Linear(20, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


class ConvStages(nn.Module):
    def __init__(self, c=16, n=3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stages = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
                                    for _ in range(n))
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for s in self.stages:
            x = x + s(x)
        return self.head(x.mean((2, 3)))


def test_padding_and_layout_work_inside_blocks():
    torch.manual_seed(0)
    model, x = OddStack().eval(), torch.randn(8, 20)
    gm = converted(model, x, policy=autocastfx.Policy.default().override(pad_gate="always"))
    assert all("autocastfx" in layer.meta for layer in gm.layers)
    pads = [autocastfx.report(layer).totals.get("padding") for layer in gm.layers]
    assert all(p and p["misaligned_before"] > p["misaligned_after"] for p in pads), pads
    with AtenRecorder() as rec:
        out = gm(x)
    assert rel(out, model(x)) < 5e-3
    inner = [c for c in rec.ops("addmm", "mm") if c.in_shapes[-1][-1] in (4 * 36, 4 * 36 + 4)]
    assert inner and all(all(s % 8 == 0 for s in c.in_shapes[-1]) for c in inner), [c.in_shapes for c in inner]
    torch.manual_seed(0)
    cnn, img = ConvStages().eval(), torch.randn(2, 3, 8, 8)
    gm = converted(cnn, img, memory_format="channels_last")
    assert all(autocastfx.report(s).totals["layout"]["memory_format"] == "channels_last" for s in gm.stages)
    with AtenRecorder() as rec:
        out = gm(img)
    convs = rec.ops("convolution")
    assert convs and all(torch.float16 in c.in_dtypes for c in convs)
    assert rel(out, cnn(img)) < 5e-3


def test_onnx_deployment_of_a_tree(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model, x = Stack(layers=2).eval(), ids()  # two blocks: a tree, the second block on the first one's plan
    gm = converted(model, x)
    autocastfx.export(gm, tmp_path / "m.onnx", (x,))  # checked in onnxruntime by the export itself
    m = onnx.load(str(tmp_path / "m.onnx"))
    assert not [t.name for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.raw_data) > 64]
    s = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    assert rel(got, model(x)) < 5e-3


from test_graphed import fake_cuda  # noqa: E402,F401 - a fixture: CUDA graphs emulated on the CPU


def test_a_tree_trains_as_a_cuda_graph_as_it_trains_eagerly(fake_cuda):  # noqa: F811
    """train_step(..., cuda_graph=True) over a module with blocks: one capture, replays after, the same bits as
    the eager step (CUDA graphs emulated on the CPU: no host read in the captured step)."""
    steps = []
    for graph in (False, True):
        torch.manual_seed(0)
        gm = converted(Stack(layers=3), ids(batch=4))
        steps.append(autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                           torch.optim.AdamW(gm.parameters(), lr=2.0 ** -9, fused=True),
                                           cuda_graph=graph))
    eager, gstep = steps
    x, y = ids(batch=4), ids(batch=4, seed=5)
    losses = [(eager(x, y).clone(), gstep(x, y).clone()) for _ in range(8)]
    assert gstep.captures == 1 and gstep.replays == 5
    le, lg = (torch.stack(v) for v in zip(*losses))
    assert torch.equal(lg, le) and lg[-1] < lg[0]


class ValueBranchLayer(Layer):
    """A layer no capture takes on its own (it branches on its input's values): it stays the model's module."""

    def forward(self, x):
        return super().forward(x) if bool(x.sum() > -1e9) else x


@pytest.mark.parametrize("piecewise", [False, True])
def test_converting_with_blocks_leaves_the_model_as_it_was(piecewise):
    torch.manual_seed(0)
    model, x = (DataDependentLoss if piecewise else Stack)(layers=3), ids()
    model.layers[2] = ValueBranchLayer()
    model.train()
    model.layers[1].eval()
    before = {n: (m, m.training) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if piecewise:  # the loss branches on the labels' values: the model's own Python around its blocks
        gm = autocastfx.convert(model, (x,), example_kwargs={"labels": ids(seed=7)})
        assert type(gm) is DataDependentLoss
    else:
        gm = converted(model, x)
    assert "autocastfx" in gm.layers[0].meta and "autocastfx" in gm.layers[1].meta
    assert type(gm.layers[2]) is ValueBranchLayer  # not converted: a copy of the model's layer in its place
    # the model: the same modules in the same modes, the same values, no hooks left on it
    assert {n: (m, m.training) for n, m in model.named_modules()} == before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())
    # the converted module shares no module with it, and holds its tensors, not copies of them
    assert not {id(m) for m in model.modules()} & {id(m) for m in gm.modules()}
    theirs = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert theirs == {t.untyped_storage().data_ptr() for t in gm.state_dict().values()}
    assert all(p is model.get_parameter(n) for n, p in gm.named_parameters())
    # and the modes it was converted in are the model's
    assert gm.training and not gm.layers[1].training and gm.layers[2].training
    gm.eval()
    model.eval()
    assert rel(gm(x), model(x)) < 5e-3


def test_a_block_the_model_also_holds_under_another_name_is_not_shared_with_the_model():
    torch.manual_seed(0)
    model, x = DataDependentLoss(layers=3), ids()
    model.first = model.layers[0]  # the same module at a second name, which the forward never calls
    gm = autocastfx.convert(model, (x,), example_kwargs={"labels": ids(seed=7)})  # piecewise: the tree is kept
    assert type(gm) is DataDependentLoss
    assert not {id(m) for m in model.modules()} & {id(m) for m in gm.modules()}
    gm.eval()
    model.eval()
    assert rel(gm(x), model(x)) < 5e-3


def test_a_piecewise_part_is_an_instance_of_the_class_it_stands_in_for():
    """Before: a part converted in place of the model's nn.Linear was a GraphModule only, so freezing by
    ``isinstance(m, nn.Linear)`` missed it and its weight went on training (0.18 in three steps)."""
    import copy

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.body(x))
            if h.sum() > 0:  # a branch on values: the model is converted piecewise
                h = h * 2
            return self.head(h)

    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4, 8)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    body = gm.get_submodule("body")
    assert isinstance(body, nn.Linear) and isinstance(body, torch.fx.GraphModule)
    assert "in_features=8" in repr(body) and body.in_features == 8
    with pytest.raises(ValueError, match="a constant of the converted graph"):
        body.in_features = 9
    for m in gm.modules():
        if isinstance(m, nn.Linear) and m is body:
            m.requires_grad_(False)
    before = model.body.weight.detach().clone()
    opt = torch.optim.SGD([p for p in gm.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        gm(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.body.weight, before)
    twin = copy.deepcopy(gm)
    assert isinstance(twin.get_submodule("body"), nn.Linear) and twin.get_submodule("body").in_features == 8
    torch.testing.assert_close(twin(x), gm(x))
    assert list(gm.state_dict()) == list(model.state_dict())


class _PyLayerDrop(nn.Module):
    """LayerDrop drawn from Python's random module (fairseq's and older Hugging Face models' way)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(4))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            if self.training and random.random() < 0.5:
                continue
            x = x + layer(x)
        return self.head(x)


def test_a_draw_from_pythons_random_is_not_fixed_into_the_graph():
    """The capture ran random.random() once and the graph kept that draw: the layers skipped then were skipped at
    every call, the others never (0.5-0.7 off float32, autocast 0.006). Now such a root runs as the model's own
    Python around converted blocks, and one graph of it is refused, naming the fix."""
    torch.manual_seed(0)
    model = _PyLayerDrop().train()
    x = torch.randn(4, 8)
    state = random.getstate()
    gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    assert random.getstate() == state  # the caller's random stream as it was
    for seed in range(4):
        random.seed(seed)
        want = model(x)
        random.seed(seed)
        got = gm(x).float()
        assert ((got - want).norm() / want.norm()).item() < 0.03, seed
    with pytest.raises(autocastfx.CaptureError, match=r"Python's random module.*torch.rand"):
        autocastfx.convert(model, (x,), dtype=torch.bfloat16, blocks=None)


class _Stages(nn.Module):
    """Stages of blocks: a ModuleList of ModuleLists, iterated by the model's own loops."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
                                    for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for stage in self.stages:
            for block in stage:
                x = x + block(x)
        return self.head(x)


def test_auto_takes_the_blocks_of_nested_module_lists():
    """blocks='auto' took the inner ModuleLists themselves as blocks, and the model's ``for b in stage`` failed
    with "'_Stand' object is not iterable"."""
    torch.manual_seed(0)
    model, x = _Stages(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    names = list(autocastfx.report(gm).totals.get("blocks", {}))
    assert names == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"], names
    torch.testing.assert_close(gm(x).float(), model(x), rtol=3e-2, atol=3e-2)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(self.q(x), 0.1, training=self.training)  # the mode read in Python, as HF attention does


class _DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.ff = _Attn(), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.ff(self.attn(x))


class _TorchLayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers, self.head = nn.ModuleList(_DropBlock() for _ in range(2)), nn.Linear(16, 2)

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.3:  # LayerDrop, as Hugging Face's BART draws it
                continue
            x = layer(x)
        return self.head(x)


def test_a_piecewise_model_converted_in_training_mode_keeps_its_blocks_modules_in_its_mode():
    """The piecewise conversion's one run set the blocks' own modules to eval while the blocks stayed in training:
    convert() raised "modules of this converted module are in another mode than the program it runs"."""
    torch.manual_seed(0)
    model, x = _TorchLayerDrop().train(), torch.randn(4, 16)
    gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    for seed in range(3):
        torch.manual_seed(seed)
        want = model(x)
        torch.manual_seed(seed)
        got = gm(x).float()
        assert ((got - want).norm() / want.norm()).item() < 0.03, seed


class _Collects(nn.Module):
    """A block that appends to a list its caller gives it (auxiliary losses, as mixture-of-experts layers do)."""

    def __init__(self, d=32, scale=1.0):
        super().__init__()
        self.ln, self.ff, self.scale = nn.LayerNorm(d), nn.Linear(d, d), scale

    def forward(self, x, step=0, store=None):
        h = self.ff(self.ln(x)) * self.scale
        if store is not None:
            store.append(h.mean())
        return x + h * (1 + 0.01 * step)


class _Plain(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, step=0, store=None):
        return x + self.b(F.silu(self.a(x)))


class _AuxModel(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([_Collects(d, 1.0), _Plain(d), _Collects(d, 0.5), _Plain(d), _Collects(d, 2.0)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x, store = self.inp(x), []
        for i, layer in enumerate(self.layers):
            x = layer(x, step=i, store=store)
        return self.head(x) + torch.stack(store).sum()


@pytest.mark.parametrize("blocks", [["layers.0"], "auto", True])
def test_a_block_that_appends_to_a_list_its_caller_gives_keeps_the_append(blocks):
    """A graph around the blocks would hold the list as it was before the block's call (the append lost, and with
    it that block's share of the output and of the gradient): such a model runs its own Python around the blocks."""
    torch.manual_seed(0)
    model, x = _AuxModel(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16, blocks=blocks)
    for xi in (x, torch.randn(4, 8)):
        ref = model(xi)
        with torch.autocast("cpu", torch.bfloat16):
            ac = model(xi)
        with AtenRecorder() as rec:
            out = gm(xi)
        assert any(c.name == "addmm" and torch.bfloat16 in c.in_dtypes for c in rec.calls)  # it still runs low
        bound = 3 * (ac - ref).norm() / ref.norm() + 1e-3
        assert (out - ref).norm() / ref.norm() <= bound
    first = dict(gm.named_parameters())["layers.0.ff.bias"]
    g32 = torch.autograd.grad(model(x).sum(), model.layers[0].ff.bias)[0]
    g = torch.autograd.grad(gm(x).sum(), first)[0]
    assert (g - g32).norm() / g32.norm() < 0.02


class _TorchEncoder(nn.Module):
    """torch's own TransformerEncoder called with a causal mask, as pytorch/examples' word language model does: its
    mask check reads values, so the model around the blocks runs as its own Python, and that Python reads settings
    of each layer's attention (``layers[0].self_attn.batch_first``)."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.dec = nn.Linear(d, vocab)

    def forward(self, src):
        mask = torch.log(torch.tril(torch.ones(len(src), len(src))))
        return F.log_softmax(self.dec(self.enc(self.emb(src), mask=mask)), dim=-1)


def test_the_model_around_blocks_reads_the_settings_of_a_converted_layers_submodules():
    torch.manual_seed(0)
    model, src = _TorchEncoder(), torch.randint(0, 50, (12, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(copy.deepcopy(model), (src,), dtype=torch.bfloat16)
    attn = gm.enc.layers[0].self_attn
    assert attn.batch_first is False and attn.num_heads == 2
    with pytest.raises((ValueError, AttributeError)):
        attn.batch_first = True  # held: the graph holds what it was at conversion
    for mode in ("train", "eval"):
        model.train(mode == "train")
        gm.train(mode == "train")
        for s in (src, torch.randint(0, 50, (7, 2))):
            ref = model(s)
            with torch.autocast("cpu", torch.bfloat16):
                ac = model(s)
            with AtenRecorder() as rec:
                out = gm(s)
            assert any(c.name == "addmm" and torch.bfloat16 in c.in_dtypes for c in rec.calls)
            assert (out - ref).norm() / ref.norm() <= 3 * (ac - ref).norm() / ref.norm() + 1e-3


def test_a_block_added_or_removed_on_gm_is_refused_and_one_replaced_is_followed():
    """The graph around the blocks calls them by index: an appended block would never run (its gradient None,
    0.7 off float32 on the example), a removed one would still be called."""
    torch.manual_seed(0)
    model, x = Stack(layers=3), ids(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    assert isinstance(gm.layers, nn.ModuleList)
    for change in (lambda: gm.layers.append(copy.deepcopy(gm.layers[-1])),
                   lambda: gm.layers.insert(0, copy.deepcopy(gm.layers[0])),
                   lambda: gm.layers.extend([copy.deepcopy(gm.layers[0])]),
                   lambda: gm.layers.__delitem__(2), lambda: gm.layers.pop(1)):
        with pytest.raises(ValueError, match=r"calls its 3 entries by name.*convert it again"):
            change()
    assert len(gm.layers) == 3
    with torch.no_grad():
        before = gm(x)
        gm.layers[1] = copy.deepcopy(gm.layers[2])  # the same class and shapes: followed
        model.layers[1] = copy.deepcopy(model.layers[2])
        after, want = gm(x), model(x)
    assert not torch.equal(before, after)
    assert (after - want).norm() / want.norm() < 0.05


class _PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                         enable_nested_tensor=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x, mask):
        return self.head(self.enc(x, src_key_padding_mask=mask))


def test_an_encoder_whose_fast_path_hands_its_layers_nested_tensors_converts_as_one_graph():
    """Before: ``NestedTensorImpl doesn't support sizes``, from the blocks' run (eval, no gradients), where
    nn.TransformerEncoder's fast path hands its layers nested tensors; ``blocks="auto"`` now converts one graph."""
    torch.manual_seed(0)
    model, x = _PaddedEncoder(), torch.randn(3, 7, 32)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 5:] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, (x, mask), dtype=torch.bfloat16)
    out, ref = gm(x, mask), model(x, mask)
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
    with pytest.raises(Exception, match="nested tensor"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autocastfx.convert(model, (x, mask), dtype=torch.bfloat16, blocks=True)
