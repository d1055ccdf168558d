"""Large models: conversion on the meta device, low-precision checkpoints, and a converted module's state dict
being the float32 model's (its own parameters, under the model's names), on every capture path."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from small_models import TinyGPT, TinyResNet, TinyViT
from test_blocks import DataDependentLoss, Stack, ids


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _llama(layers=2):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return lambda: tf.LlamaForCausalLM(cfg)


def _image():
    return (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


def _tokens():
    return (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)


def _llama_ids():
    return (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)


# name -> (model factory, example inputs, example kwargs, convert options, expected capture of the root)
PATHS = {
    "traced": (TinyResNet, _image, {}, {}),
    "traced-vit": (TinyViT, _image, {}, {}),
    "export": (TinyGPT, _tokens, {}, {}),  # symbolic_trace cannot take its mask: torch.export
    "blocks": (Stack, lambda: (ids(),), {}, {}),
    "hf-one-graph": (None, _llama_ids, {}, {"blocks": None}),
    "hf-blocks": (None, _llama_ids, {}, {}),  # blocks through torch.export (autocastfx/around.py)
    "piecewise": (DataDependentLoss, lambda: (ids(),), {"labels": ids(seed=3)}, {}),
}


def _factory(name):
    make = PATHS[name][0]
    return make if make is not None else _llama()


def _build(name, seed=0):
    torch.manual_seed(seed)
    return _factory(name)()


def _convert(model, name, **kw):
    _, inputs, kwargs, options = PATHS[name]
    return autocastfx.convert(model, inputs(), example_kwargs=dict(kwargs) or None, dtype=torch.bfloat16,
                              **{**options, **kw})


def _out(gm, name):
    _, inputs, kwargs, _ = PATHS[name]
    out = gm(*inputs(), **kwargs)
    return getattr(out, "logits", out)


@pytest.fixture(scope="module")
def seed0():
    """``seed0(name)``: the seed-0 model of a path and its conversion, made once in this file (a conversion costs
    seconds), and afresh for ``traced``, whose batch norms a forward in training mode moves. The tests given a
    shared pair read it, run forwards and switch its mode (a test that needs one sets it), none of which changes
    the weights or outputs of a model without batch norm (dropout 0 in all); a step may be built over it, never
    taken."""
    made = {}

    def get(name):
        if name == "traced":
            model = _build(name)
            return model, _convert(model, name)
        if name not in made:
            model = _build(name)
            made[name] = (model, _convert(model, name))
        return made[name]
    return get


@pytest.fixture(scope="module")
def on_meta():
    """``on_meta(name)``: the path's model built on the meta device and converted there, each call a deep copy of
    one such conversion for a Hugging Face Llama's paths (seconds each) and a conversion afresh for the others."""
    made = {}

    def convert_empty(name):
        with torch.device("meta"):
            empty = _factory(name)()
        return _convert(empty, name)

    def get(name):
        if not name.startswith("hf"):
            return convert_empty(name)
        if name not in made:
            made[name] = convert_empty(name)
        return copy.deepcopy(made[name])
    return get


def _units(gm):
    return [m for m in gm.modules() if isinstance(getattr(m, "meta", None), dict) and "autocastfx" in m.meta]


# ------------------------------------------------------------------ the float32 parameters and the state dict

@pytest.mark.parametrize("name", ["traced", "export", "blocks", "hf-blocks", "piecewise"])
def test_master_parameters_cover_every_block_and_are_the_models_parameters_the_step_updates(name, seed0):
    model, gm = seed0(name)
    own = {id(p) for p in gm.parameters()}
    assert own == {id(p) for p in model.parameters()}  # the model's own tensors, shared, not copied
    assert all(p.dtype == torch.float32 for p in gm.parameters())  # nothing stored low
    masters = autocastfx.master_parameters(gm)  # the float32 weights the graphs cast to bfloat16
    assert masters and len({id(m) for m in masters}) == len(masters) and {id(m) for m in masters} <= own
    nested = [u for u in _units(gm) if u is not gm]
    if name in ("blocks", "hf-blocks", "piecewise"):
        assert nested  # the weights this covers live in several converted units
    for unit in nested:  # every converted block's cast weights are among them
        assert {id(m) for m in autocastfx.master_parameters(unit)} <= {id(m) for m in masters}
        assert autocastfx.master_parameters(unit), unit
    step = autocastfx.train_step(gm, lambda o, t: o.float().pow(2).mean(), torch.optim.SGD(gm.parameters(), lr=0.1))
    assert {id(p) for p in step.all_params} == {id(p) for p in gm.parameters() if p.requires_grad}
    assert {id(m) for m in masters} <= {id(p) for p in step.all_params}  # the very tensors the step updates
    f32 = gm.state_dict()
    own_sd = model.state_dict()
    assert list(f32) == list(own_sd)  # in the model's order: what pairs them by position pairs them right
    assert [id(p) for p in gm.parameters()] == [id(p) for p in model.parameters()]
    for k, v in own_sd.items():  # the model's own float32 values, bit for bit
        assert f32[k].dtype == v.dtype and torch.equal(f32[k], v), k


@pytest.mark.parametrize("name", ["traced", "export", "blocks", "hf-blocks", "piecewise"])
def test_state_dict_is_the_float32_model_and_loads_both_ways(name, seed0):
    model, gm = seed0(name)
    sd = gm.state_dict()
    assert set(sd) == set(model.state_dict())
    fresh = _build(name, seed=5)
    fresh.load_state_dict(sd)  # into the unconverted model, strict
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    other = _convert(_build(name, seed=7), name)  # into a converted one: its float32 parameters
    other.load_state_dict(model.state_dict())
    for a, b in zip(autocastfx.master_parameters(other), autocastfx.master_parameters(gm)):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), gm.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(_out(other.eval(), name), _out(gm.eval(), name))


class _TableLayer(nn.Module):
    """A block with a non-persistent table (as a rotary embedding's ``inv_freq``)."""

    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("table", torch.linspace(0, 1, d), persistent=False)

    def forward(self, x):
        return x + self.fc(x) * self.table


class _TableStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_TableLayer() for _ in range(3))
        self.register_buffer("scale", torch.ones(32), persistent=False)

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("blocks", ["auto", None])
def test_non_persistent_buffers_stay_out_of_the_state_dict(blocks):
    model = _TableStack()
    gm = autocastfx.convert(model, (ids(),), dtype=torch.bfloat16, blocks=blocks)
    if blocks:
        assert sum("reused" in layer.meta["autocastfx_block"]["plan"] for layer in gm.layers) == 2
    for g in (gm, copy.deepcopy(gm)):
        assert set(g.state_dict()) == set(model.state_dict())
        g.load_state_dict(model.state_dict())  # strict


def test_a_bfloat16_checkpoint_loads_upcast_into_the_float32_parameters():
    model = _build("blocks")
    gm = _convert(model, "blocks")
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    gm.load_state_dict(low)
    f32 = gm.state_dict()
    for k, v in low.items():
        assert f32[k].dtype == torch.float32 and torch.equal(f32[k], v.float()), k
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    assert all(torch.equal(v, f32[k]) for k, v in model.state_dict().items())  # the model's tensors: loaded too


def test_assign_makes_the_given_float32_tensors_the_parameters():
    """``load_state_dict(sd, assign=True)``: the checkpoint's float32 tensors become the module's parameters (no
    copy: the way to load without a second float32 copy), the ones the graph casts low included."""
    model = _build("blocks")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        empty = Stack()
    gm = _convert(empty, "blocks")
    gm.load_state_dict(sd, assign=True)
    by_ptr = {v.data_ptr() for v in sd.values()}
    assert all(p.data_ptr() in by_ptr and p.dtype == torch.float32 for p in gm.parameters())
    assert not any(p.is_meta for p in gm.parameters())
    masters = autocastfx.master_parameters(gm)
    assert masters and all(m.data_ptr() in by_ptr for m in masters)
    ref = _convert(model, "blocks")
    assert torch.equal(_out(gm.eval(), "blocks"), _out(ref.eval(), "blocks"))


def test_torch_save_of_the_state_dict_resumes_exactly():
    """``torch.save(gm.state_dict())`` then ``load_state_dict``: the run goes on as if never stopped (the saved
    weights are the float32 parameters the step updates, not rounded copies)."""
    def run(gm, steps, start):
        opt = torch.optim.SGD(gm.parameters(), lr=0.05)
        step = autocastfx.train_step(gm, lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten()), opt,
                                     loss_scale=None)
        return [float(step((ids(seed=s),), ids(seed=s + 100))) for s in range(start, start + steps)]

    whole = run(_convert(_build("blocks"), "blocks"), 6, 0)  # gm trains its model: each run a model of its own
    gm = _convert(_build("blocks"), "blocks")
    first = run(gm, 3, 0)
    buf = io.BytesIO()
    torch.save(gm.state_dict(), buf)
    resumed = _convert(_build("blocks", seed=9), "blocks")
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    assert first + run(resumed, 3, 3) == whole


@pytest.mark.parametrize("name", ["traced", "export", "blocks"])
def test_pickling_the_converted_module_is_refused_at_save_time_with_the_way_that_works(name, tmp_path):
    """``torch.save(gm)`` would write a file that loads, if at all, as a plain GraphModule running the program it
    was saved in whatever its mode: refused when saving, naming the state dict (not when loading it, after the run
    is over); the state dict loads into the model itself and into a module converted again."""
    model = _build(name)
    gm = _convert(model, name)
    for saving in (lambda: torch.save(gm, tmp_path / "gm.pt"), lambda: copy.copy(gm)):
        with pytest.raises(TypeError, match=r"does not pickle or copy.copy.*torch\.save\(gm\.state_dict\(\)\).*"
                                            r"torch\.save\(net, f\).*copy\.deepcopy\(gm\)"):
            saving()
    # the way the message gives to save the whole module: the model converted holds gm's trained tensors
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(0.25)
    torch.save(model, tmp_path / "model.pt")
    whole = torch.load(tmp_path / "model.pt", weights_only=False)
    for k, v in gm.state_dict().items():
        assert torch.equal(whole.state_dict()[k], v), k
    with torch.no_grad():
        for p in gm.parameters():
            p.sub_(0.25)
    torch.save(gm.state_dict(), tmp_path / "sd.pt")
    fresh = _build(name, seed=3)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    again = _convert(_build(name, seed=4), name)
    again.load_state_dict(torch.load(tmp_path / "sd.pt"))
    twin = copy.deepcopy(gm)
    for g in (gm, again, twin):
        g.eval()
    fresh.eval()
    assert torch.equal(_out(again, name), _out(gm, name)) and torch.equal(_out(twin, name), _out(gm, name))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_the_parameters_follow_the_module_to_a_device_and_an_optimizer_over_the_old_ones_is_refused():
    """gm.to(device) moves gm's own parameters, the weights its graph casts low among them, float32; where torch
    makes new Parameters for the move (another device type), gm no longer shares the model's tensors, and a step
    given an optimizer over the model's parameters says so and names the fix."""
    model = _build("traced")
    gm = _convert(model, "traced")
    masters = autocastfx.master_parameters(gm)
    gm.to(torch.device("meta"))
    moved = autocastfx.master_parameters(gm)
    assert len(moved) == len(masters) and all(m.is_meta and m.dtype == torch.float32 for m in moved)
    assert {id(m) for m in moved} <= {id(p) for p in gm.parameters()}  # still gm's own parameters
    gm.to_empty(device="cpu")
    gm.load_state_dict(model.state_dict())
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in autocastfx.master_parameters(gm))
    assert torch.equal(_out(gm.eval(), "traced"), _out(_convert(copy.deepcopy(model), "traced").eval(), "traced"))
    assert not {id(p) for p in gm.parameters()} & {id(p) for p in model.parameters()}
    with pytest.raises(autocastfx.StepError, match=r"which the converted module does not share .*moved with "
                                                   r"\.to\(\).*gm\.parameters\(\)"):
        autocastfx.train_step(gm, lambda o: o.float().pow(2).mean(), torch.optim.SGD(model.parameters(), lr=0.1))


# ------------------------------------------------------------------------------------------ the meta device

@pytest.mark.parametrize("name", ["traced", "traced-vit", "export", "blocks", "hf-one-graph", "hf-blocks"])
def test_converted_on_meta_then_loaded_is_the_materialised_conversion(name, seed0, on_meta):
    model, ref = seed0(name)
    gm = on_meta(name)
    assert all(t.is_meta and t.dtype == torch.float32 for t in gm.parameters())
    assert len(_units(gm)) == len(_units(ref))  # the same blocks, each converted from shapes alone
    buffers = {n: b for n, b in model.named_buffers()}  # rotary tables: in no state dict
    autocastfx.materialize(gm, "cpu", model.state_dict(), buffers=buffers)
    assert {k: v.dtype for k, v in gm.state_dict().items()} == {k: v.dtype for k, v in ref.state_dict().items()}
    for k, v in ref.state_dict().items():
        assert torch.equal(gm.state_dict()[k], v), k
    same = {n: p for n, p in ref.named_parameters()}
    for n, p in gm.named_parameters():
        assert p.dtype == same[n].dtype == torch.float32 and torch.equal(p, same[n]), n
    for mode in ("train", "eval"):
        getattr(gm, mode)()
        getattr(ref, mode)()
        torch.manual_seed(3)
        a = _out(gm, name)
        torch.manual_seed(3)
        b = _out(ref, name)
        assert torch.equal(a, b), (name, mode)


class LastToken(nn.Module):
    """A model whose code makes a tensor from a Python value: ``x[:, [-1], :]``'s index (nanoGPT's inference
    path). Exported on meta that index is a meta constant, which no loading fills, and a real tensor indexed by a
    meta one gives garbage with no error."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        b, t = idx.size()
        assert t <= 16, "sequence too long"  # as nanoGPT checks: symbolic_trace cannot, torch.export captures it
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x[:, [-1], :])


@pytest.mark.parametrize("blocks", ["auto", None])
def test_constants_the_models_code_makes_have_their_values_after_a_meta_conversion(blocks):
    torch.manual_seed(0)
    model, idx = LastToken(), torch.randint(0, 32, (3, 8))
    ref = autocastfx.convert(copy.deepcopy(model), (idx,), dtype=torch.bfloat16, blocks=blocks)
    with torch.device("meta"):
        empty = LastToken()
    gm = autocastfx.convert(empty, (idx,), dtype=torch.bfloat16, blocks=blocks)
    assert gm.meta["autocastfx"].capture == "torch.export"  # the path that lifts the index as a constant
    autocastfx.materialize(gm, "cpu", model.state_dict())
    constants = [v for m in gm.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    assert constants and not any(t.is_meta for t in constants)
    assert torch.equal(gm(idx), ref(idx))


def test_meta_example_inputs_are_taken_too():
    with torch.device("meta"):
        empty = TinyResNet()
    gm = autocastfx.convert(empty, (torch.empty(2, 3, 16, 16, device="meta"),), dtype=torch.bfloat16)
    assert all(p.is_meta for p in gm.parameters())
    ref = autocastfx.convert(_build("traced"), _image(), dtype=torch.bfloat16)
    assert gm.code == ref.code


def test_materialize_names_buffers_no_checkpoint_fills(on_meta):
    model = _llama()()
    gm = on_meta("hf-one-graph")
    assert all(t.is_meta for t in gm.parameters())
    with pytest.raises(ValueError, match=r"rotary_emb\.inv_freq.*buffers="):
        autocastfx.materialize(gm, "cpu", model.state_dict())
    with pytest.raises(ValueError, match="does not have"):
        autocastfx.materialize(gm, "cpu", model.state_dict(), buffers={"no.such.buffer": torch.zeros(1)})


def test_initialised_by_parameter_name_the_weights_are_unrounded():
    """An initialisation by parameter name (as TorchTitan's and GPT-2's are written) run on the converted
    module writes the float32 parameters themselves; the graph casts them to bfloat16 at each forward. The
    context such code once ran in is gone, with an error that says so."""
    with torch.device("meta"):
        empty = Stack()
    gm = _convert(empty, "blocks")
    gm.to_empty(device="cpu")
    torch.manual_seed(0)
    for n, p in gm.named_parameters():
        assert p.dtype == torch.float32, n  # the initialisation sees the float32 weights
        if n.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=0.02)
    for gone, fix in (("float32_weights", "initialise gm.named_parameters"), ("float32_state_dict", "gm.state_dict")):
        with pytest.raises(AttributeError, match=f"autocastfx.{gone} is gone: .*{fix}"):
            getattr(autocastfx, gone)
    weights = dict(gm.state_dict())
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in weights.values())  # not rounded
    for n, p in gm.named_parameters():
        assert torch.isfinite(p).all(), n
        assert p.dtype == torch.float32 and torch.equal(p, weights[n]), n
    masters = autocastfx.master_parameters(gm)
    assert masters and any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    # the forward is the one a model holding these float32 weights converts to
    model = Stack()
    model.load_state_dict(weights)
    assert torch.equal(_out(gm.eval(), "blocks"), _out(_convert(model, "blocks").eval(), "blocks"))


def test_meta_conversion_refuses_a_model_whose_shapes_need_values():
    class Nonzero(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x[x.sum(-1) > 0])

    with torch.device("meta"):
        empty = Nonzero()
    with pytest.raises(autocastfx.CaptureError, match="meta device"):
        autocastfx.convert(empty, (torch.randn(4, 8),), blocks=None)


# ------------------------------------------------------------------------------- low-precision checkpoints

@pytest.mark.parametrize("name,low", [("traced", torch.bfloat16), ("export", torch.float16),
                                      ("blocks", torch.float16), ("hf-one-graph", torch.bfloat16)])
def test_a_low_precision_model_converts_as_its_float32_form_would(name, low):
    """Its tensors are made float32 in place (the same objects, as ``model.float()`` does) and shared: an optimizer
    built over ``model.parameters()`` before convert() trains what the converted module runs. Before, the converted
    module had new float32 tensors, and such an optimizer trained nothing it read, silently."""
    model = _build(name).to(low)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = [*model.parameters(), *model.buffers()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=f"{str(low).removeprefix('torch.')} parameters and buffers .* are now "
                                         "float32, upcast exactly in place"):
        gm = _convert(model, name)
    ref = _convert(copy.deepcopy(model), name)
    for k, v in ref.state_dict().items():  # the float32 parameters: the exact upcast values
        assert gm.state_dict()[k].dtype == v.dtype and torch.equal(gm.state_dict()[k], v), k
        assert torch.equal(v, before[k].float() if before[k].is_floating_point() else before[k]), k
    assert torch.equal(_out(gm.eval(), name), _out(ref.eval(), name))
    assert "upcast exactly in place into float32" in str(autocastfx.report(gm))
    assert [id(t) for t in [*model.parameters(), *model.buffers()]] == [id(t) for t in objects]  # the same objects
    assert {id(t) for t in [*gm.parameters(), *gm.buffers()]} <= {id(t) for t in objects}  # shared
    gm.train()
    out = _out(gm, name)
    out.float().pow(2).mean().backward()
    opt.step()  # the optimizer built before convert(), over the model's parameters
    assert any(not torch.equal(p, ref_p) for p, ref_p in zip(gm.parameters(), ref.parameters()))


def test_one_low_precision_buffer_leaves_the_float32_parameters_shared():
    """Before: one bfloat16 buffer in a float32 model gave the converted module new copies of every tensor, so the
    optimizer built before convert() trained nothing it ran (the loss did not move in 10 steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model[1].running_var = model[1].running_var.bfloat16()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with pytest.warns(UserWarning, match="are now float32"):
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    assert [id(p) for p in gm.parameters()] == [id(p) for p in params]
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(gm(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.9 * losses[0]


# ------------------------------------------------------------------------------------------ peak memory

@pytest.fixture(scope="module")
def peaks():
    """tests/peak_convert.py in one fresh process for every path: {path: its result}."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    paths = ["traced"] + (["hf", "hf-bf16"] if importlib.util.find_spec("transformers") is not None else [])
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_convert.py")
    out = subprocess.run([sys.executable, script, *paths], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["path"]: r for r in rows}


@pytest.mark.parametrize("path", ["hf", "traced", "hf-bf16"])
def test_converting_copies_no_weight_of_a_float32_model_and_upcasts_a_bfloat16_one_once(path, peaks):
    """Peak resident memory convert() adds to a process holding a float32 model (blocks on, the default: a
    Hugging Face Llama exported around its blocks, a traced stack) or a bfloat16 one, as a multiple of the
    float32 model's bytes: nothing for the weights of a float32 model (the converted module shares its tensors;
    a low copy of them would be 0.5x more), a bfloat16 one's tensors made float32 in place (1x, less the 0.5x
    freed), with a margin for the graph and the example's activations (about 0.2x here). torch.export's unflatten cloned every weight of
    each export (two per conversion); a bfloat16 model was upcast whole before loading. The three paths share one
    process, each measured from the memory it faults in itself (peak_convert.py)."""
    if path.startswith("hf"):
        pytest.importorskip("transformers")
    r = peaks[path]
    assert r["units"] > 1  # the blocks path
    assert r["extra"] <= (1.0 if path.endswith("bf16") else 0.0) + 0.35, r
