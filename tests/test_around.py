"""Blocks stay modules when only torch.export captures the model around them (Hugging Face models): the model is
exported with its blocks' call signatures preserved, unflattened, and made one graph that calls the converted
blocks (autocastfx/around.py)."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder
from test_blocks import D, VOCAB, Layer, ids, rel


class SideLayer(Layer):
    """A decoder layer that also takes a float32 table the model computes once for all layers (as rotary
    position tables are), and returns a tuple (as Hugging Face layers of transformers 4 do)."""

    def __init__(self, p=0.0, idx=0):
        super().__init__(p=p)
        self.layer_idx = idx  # read by no code: layers that differ in it still share one plan

    def forward(self, x, table=None):
        return (super().forward(x + table),)


class ExportOnly(nn.Module):
    """A forward symbolic_trace cannot follow (it branches on an input's size, as Hugging Face models branch on
    their configuration and inputs); torch.export captures it."""

    def __init__(self, layers=4, p=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.table = nn.Parameter(torch.randn(64, D) * 0.1)
        self.layers = nn.ModuleList(SideLayer(p=p, idx=i) for i in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        if ids.shape[1] > 1:  # symbolic_trace: a Proxy has no truth value
            x = x * 2.0
        table = torch.sin(self.table[: ids.shape[1]])
        for layer in self.layers:
            x = layer(x, table=table)[0]
        return self.head(self.norm(x))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _units(gm):
    return {n for n, m in gm.named_modules() if n and "autocastfx" in getattr(m, "meta", {})}


def _casts(gm, *a, **k):
    with AtenRecorder() as rec:
        gm(*a, **k)
    return len(rec.float_casts())


def test_blocks_stay_modules_when_only_torch_export_captures_the_model():
    torch.manual_seed(0)
    model, x = ExportOnly(layers=3), ids()  # three blocks: two planned on the first one's plan
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    # the default policy keeps the residual stream float32 (autocast's widest-type rule): the hidden state and
    # the table cross every boundary float32
    default = autocastfx.convert(model, (x,))
    assert all(layer.meta["autocastfx_block"]["inputs"] == [torch.float32, torch.float32] for layer in default.layers)
    # the min-cut policy: what follows checks that it hands both on low, the table cast once in the root
    gm = autocastfx.convert(model, (x,), policy=autocastfx.Policy.default().override(widest=False))
    assert gm.meta["autocastfx"].capture == "torch.export"
    assert isinstance(gm.layers, nn.ModuleList) and len(gm.layers) == 3
    assert _units(gm) == {f"layers.{i}" for i in range(3)}
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == [f"layers.{i}" for i in range(3)]  # the root calls each block: none of its ops is inlined
    # one plan for the three (their layer_idx differs, but no code reads it)
    plans = [layer.meta["autocastfx_block"]["plan"] for layer in gm.layers]
    assert all("reused" in p for p in plans[1:]), plans
    # the hidden state and the table cross every boundary low: the table is cast once in the root
    assert all(layer.meta["autocastfx_block"]["inputs"] == [torch.float16, torch.float16] for layer in gm.layers)
    flat = autocastfx.convert(model, (x,), blocks=None, policy=autocastfx.Policy.default().override(widest=False))
    ref = model(x)
    with torch.autocast("cpu", dtype=torch.float16):
        err_ac = rel(model(x).float(), ref)
    print(f"error vs float32: blocks {rel(gm(x), ref):.2e}, one graph {rel(flat(x), ref):.2e}, autocast {err_ac:.2e}")
    assert rel(gm(x), ref) <= max(2 * err_ac, 2e-3)
    casts, flat_casts = _casts(gm, x), _casts(flat, x)
    print(f"float casts per forward (aten): blocks {casts}, one graph {flat_casts}")
    assert casts <= flat_casts + len(gm.layers) + 1
    with AtenRecorder() as rec:
        gm(x)
    table = (x.shape[1], D)  # the table each block reads: cast once by the root, not once per block
    assert sum(1 for c in rec.float_casts() if c.in_shapes[0] == table) == 1
    assert sum(1 for c in rec.float_casts() if c.in_shapes[0] == table and c.out_dtypes == [torch.float16]) == 1
    mm = rec.ops("addmm", "mm")
    assert mm and all(all(d == torch.float16 for d in c.in_dtypes) for c in mm)
    # other batch sizes and sequence lengths, as the one-graph conversion takes them
    for shape in ((3, 8), (2, 12)):
        z = torch.randint(0, VOCAB, shape)
        assert rel(gm(z), model(z)) <= max(2 * err_ac, 3e-3), shape


def test_an_export_only_tree_switches_modes_reports_exports_and_trains(tmp_path):
    torch.manual_seed(0)
    model, x = ExportOnly(layers=3, p=0.3), ids()
    gm = autocastfx.convert(model, (x,))
    assert _units(gm) == {"layers.0", "layers.1", "layers.2"}
    gm.train()
    assert not torch.equal(gm(x), gm(x))  # each block's dropout follows the tree's mode
    gm.eval()
    model.eval()
    a = gm(x)
    assert torch.equal(a, gm(x)) and rel(a, model(x)) < 5e-3
    r = autocastfx.report(gm)
    assert set(r.totals["blocks"]) == {"layers.0", "layers.1", "layers.2"} and "blocks:" in str(r)
    autocastfx.export(gm, tmp_path / "m.pt2", (x,))
    code = ("import torch,sys; ep=torch.export.load(sys.argv[1]); x=torch.load(sys.argv[2]);"
            "torch.save(ep.module()(x), sys.argv[3])")
    torch.save(x, tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt2"), str(tmp_path / "x.pt"),
                    str(tmp_path / "y.pt")], check=True, env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), a, rtol=0, atol=1e-6)

    def losses(blocks):
        torch.manual_seed(0)
        m = ExportOnly(layers=2)
        g = autocastfx.convert(m, (x,), blocks=blocks)
        step = autocastfx.train_step(g, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                     torch.optim.AdamW(g.parameters(), lr=1e-3))
        return [float(step(x, ids(seed=50))) for _ in range(4)]  # one batch: the loss falls
    tree, flat = losses("auto"), losses(None)
    print("4 steps, blocks vs one graph:", max(abs(p - q) for p, q in zip(tree, flat)))
    assert max(abs(p - q) for p, q in zip(tree, flat)) < 1e-3 and tree[-1] < tree[0]


class ReadsABlock(ExportOnly):
    """The model's code uses a block's weight outside the block's call: that block cannot be a module apart."""

    def forward(self, ids):
        return super().forward(ids) + self.layers[0].proj.bias[:1].sum()


def test_a_block_whose_weights_the_model_reads_outside_its_call_leaves_the_model_one_graph():
    torch.manual_seed(0)
    model, x = ReadsABlock(layers=2), ids()
    gm = autocastfx.convert(model, (x,))
    assert not _units(gm)  # converted as one graph, as before blocks
    assert rel(gm(x), model(x)) < 5e-3


class ScaledLayer(Layer):
    def __init__(self, scale, idx):
        super().__init__()
        self.scale, self.idx = scale, idx  # the forward reads scale, never idx

    def forward(self, x):
        return super().forward(x) * self.scale


class Scaled(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(ScaledLayer(s, i) for i, s in enumerate(scales))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_blocks_that_differ_in_an_attribute_their_code_reads_are_planned_apart():
    torch.manual_seed(0)
    model, x = Scaled([1.0, 1.0, 0.5, 1.0]), ids()
    gm = autocastfx.convert(model, (x,))
    plans = [layer.meta["autocastfx_block"]["plan"] for layer in gm.layers]
    assert "reused" in plans[1] and "reused" not in plans[2] and "layers.0" in plans[3], plans
    assert rel(gm(x), model(x)) < 5e-3


# --------------------------------------------------------------------------- Hugging Face models

def _llama(layers=2):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


class NoGradTable(ExportOnly):
    """The model's own code computes its table under ``torch.no_grad()`` (as transformers' rotary embeddings did up to
    version 5.17): torch.export writes that region as a higher-order op whose body is a submodule of the graph."""

    def forward(self, ids):
        x = self.embed(ids)
        if ids.shape[1] > 1:
            x = x * 2.0
        with torch.no_grad():
            table = torch.sin(self.table[: ids.shape[1]] * 2.0)
        for layer in self.layers:
            x = layer(x, table=table)[0]
        return self.head(self.norm(x))


def test_a_no_grad_region_of_the_models_own_code_runs_around_the_blocks():
    """The higher-order op's body stays a module of the converted root, called through a get_attr node, in both
    modes: the converted model runs (a body passed as an object prints as ``GraphModule()`` in the root's code, a
    NameError at the first call), matches the model, and trains the blocks and the table's consumers."""
    torch.manual_seed(0)
    model, x = NoGradTable(layers=2), ids()
    gm = autocastfx.convert(model, (x,))
    assert gm.meta["autocastfx"].capture == "torch.export" and _units(gm) == {"layers.0", "layers.1"}
    hops = [n for n in gm.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert hops and all(isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "get_attr" for n in hops)
    for mode in ("train", "eval"):
        getattr(gm, mode)()
        getattr(model, mode)()
        assert rel(gm(x), model(x)) < 0.05, mode
    gm.train()
    gm(x).float().square().mean().backward()
    assert all(p.grad is not None for p in gm.layers.parameters()) and gm.table.grad is None


def test_hugging_face_llama_keeps_its_decoder_layers_as_modules_by_default(tmp_path):
    model = _llama(layers=2)
    kw = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    gm = autocastfx.convert(model, example_kwargs=kw)
    assert gm.meta["autocastfx"].capture == "torch.export"
    assert isinstance(gm.model.layers, nn.ModuleList) and _units(gm) == {"model.layers.0", "model.layers.1"}
    flat = autocastfx.convert(model, example_kwargs=kw, blocks=None)
    ref = model(**kw).logits
    casts, flat_casts = _casts(gm, **kw), _casts(flat, **kw)
    err, flat_err = rel(gm(**kw).logits, ref), rel(flat(**kw).logits, ref)
    print(f"Llama 2 layers: casts per forward {casts} (one graph {flat_casts}), error {err:.2e} ({flat_err:.2e})")
    assert casts <= flat_casts + 2 + 1 and err <= max(2 * flat_err, 2e-3)
    for shape in ((3, 8), (2, 13)):  # other batch sizes and sequence lengths
        z = torch.randint(0, 128, shape)
        assert rel(gm(input_ids=z, use_cache=False).logits, model(input_ids=z, use_cache=False).logits) < 3e-3
    ep = autocastfx.export(gm, tmp_path / "llama.pt2", example_kwargs=kw)
    torch.testing.assert_close(ep.module()(**kw).logits, gm(**kw).logits, rtol=0, atol=1e-5)
