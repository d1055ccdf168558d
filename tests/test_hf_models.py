"""Real Hugging Face models that once went wrong after conversion, built from small configs (offline): Swin with
stochastic depth (its hand-written drop-path ran in eval mode: random eval outputs) and DeBERTa-v2 (its attention
mask filled with float32's smallest value, which float16 cannot hold). Each in eval and train mode, at the aten
level, against the float32 model and torch.autocast in the same run, and through autocastfx's step."""
import warnings

import pytest
import torch

tf = pytest.importorskip("transformers", reason="needs transformers: pip install 'autocastfx[hf]'")

import autocastfx  # noqa: E402
from helpers import AtenRecorder  # noqa: E402

RANDOM = {"bernoulli", "bernoulli_", "rand", "rand_like", "uniform_", "native_dropout"}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def swin():
    """Two stages with a patch merging between them, drop-path on the second stage's two blocks (rates 0.05 and
    0.1), one block in the first stage. The second stage's 4x4 resolution is its window, so its layers set
    ``shift_size`` to 0 at every call before reading it (as Swin-T's last stage does at 224x224)."""
    cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4,
                        drop_path_rate=0.1, num_labels=10)
    return tf.SwinForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def deberta():
    cfg = tf.DebertaV2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64, num_labels=3, relative_attention=True,
                             position_buckets=16, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                             share_att_key=True, position_biased_input=False)
    ids = torch.randint(0, 128, (2, 12))
    return tf.DebertaV2ForSequenceClassification(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("build", [swin, deberta])
def test_real_model_in_both_modes_and_training(build):
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    with warnings.catch_warnings():  # its conversion time is bench/'s (minutes where every size was left free)
        warnings.simplefilter("ignore")  # transformers' own deprecation notes
        gm = autocastfx.convert(model, example_kwargs=inputs)
    if build is swin:  # the stages converted blocks, the graph around them captured (the layers' own setting kept)
        units = {n for n, m in gm.named_modules() if n and "autocastfx" in getattr(m, "meta", {})}
        assert units == {"swin.encoder.layers.0", "swin.encoder.layers.1"}, units
    with torch.no_grad():
        ref = model(**inputs).logits  # the model's own call sets shift_size: not a change after convert()
        with torch.autocast("cpu", dtype=torch.float16):
            autocast_err = _rel(model(**inputs).logits, ref)
        with AtenRecorder() as rec:
            outs = [gm(**inputs).logits for _ in range(4)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])  # eval is deterministic
    assert not RANDOM & {c.name for c in rec.calls}
    err = _rel(outs[0], ref)
    assert err < max(2 * autocast_err, 2e-3), (err, autocast_err)
    mm = [c for c in rec.calls
          if c.name in ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")]
    assert mm and all(torch.float16 in c.in_dtypes and torch.float32 not in c.in_dtypes
                      for c in mm if c.name != "convolution"), [(c.name, c.in_dtypes) for c in mm][:5]
    gm.train()
    model.train()
    with torch.no_grad():  # drop-path keeps most samples at these rates: several calls, not two
        ours = [gm(**inputs).logits for _ in range(8)]
        theirs = [model(**inputs).logits for _ in range(8)]
    assert any(not torch.equal(ours[0], o) for o in ours[1:])
    assert any(not torch.equal(theirs[0], o) for o in theirs[1:])
    step = autocastfx.train_step(gm, lambda out, y: torch.nn.functional.cross_entropy(out.logits.float(), y),
                                 torch.optim.AdamW(gm.parameters(), lr=1e-3))
    y = torch.tensor([1, 2])
    losses = [float(step(inputs, y)) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(**inputs).logits, gm(**inputs).logits)


def test_deberta_with_labels_converts_piecewise_and_trains_on_its_own_loss():
    """DeBERTa-v2 called with labels= captures in no way (its loss branches on the labels' values: torch.export
    stops at a data-dependent guard): its encoder layers and the parts that capture are converted, the rest runs
    as the model's own Python, and it trains through autocastfx's step on its own out.loss."""
    torch.manual_seed(0)
    model, inputs = deberta()
    inputs = {**inputs, "labels": torch.tensor([1, 2])}
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, example_kwargs=inputs)
    assert any("piecewise" in str(w.message) for w in caught)
    units = {n for n, m in gm.named_modules() if n and "autocastfx" in getattr(m, "meta", {})}
    assert {"deberta.encoder.layer.0", "deberta.encoder.layer.1"} <= units, units
    r = autocastfx.report(gm)
    assert r.totals["capture"] == "piecewise" and r.totals["eager"]
    with torch.no_grad():
        ref = model(**inputs)
        with torch.autocast("cpu", dtype=torch.float16):
            ac = model(**inputs)
        with AtenRecorder() as rec:
            outs = [gm(**inputs) for _ in range(3)]
    assert all(torch.equal(outs[0].logits, o.logits) for o in outs[1:])
    err, autocast_err = _rel(outs[0].logits, ref.logits), _rel(ac.logits.float(), ref.logits)
    assert err < max(2 * autocast_err, 2e-3), (err, autocast_err)
    assert abs(float(outs[0].loss) - float(ref.loss)) < 1e-2
    mm = [c for c in rec.calls if c.name in ("mm", "addmm", "bmm")]
    low = [c for c in mm if torch.float16 in c.in_dtypes]
    assert len(low) >= len(mm) // 2 and all(torch.float32 not in c.in_dtypes for c in low)
    gm.train()
    step = autocastfx.train_step(gm, lambda out: out.loss, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    losses = [float(step(inputs)) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(**inputs).logits, gm(**inputs).logits)


def test_a_traced_module_returning_a_model_output_gives_it_back(tmp_path):
    """symbolic_trace writes a returned ModelOutput as a plain dict literal: the converted module gives the
    model's type back (out.loss, out.logits), through copies, the step and export too."""
    import copy

    from transformers.modeling_outputs import SequenceClassifierOutput

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x, labels=None):
            logits = self.fc(x)
            loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
            return SequenceClassifierOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    model, x, y = Head(), torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    gm = autocastfx.convert(model, (x,), example_kwargs={"labels": y})
    assert gm.meta["autocastfx"].capture == "symbolic_trace"
    out = gm(x, labels=y)
    assert type(out) is SequenceClassifierOutput and abs(float(out.loss) - float(model(x, labels=y).loss)) < 1e-2
    assert type(copy.deepcopy(gm)(x, labels=y)) is SequenceClassifierOutput
    step = autocastfx.train_step(gm, lambda o: o.loss, torch.optim.SGD(gm.parameters(), lr=0.1))
    assert torch.isfinite(step({"x": x, "labels": y}))
    ep = autocastfx.export(gm, tmp_path / "m.pt2", (x,), example_kwargs={"labels": y})
    assert torch.allclose(ep.module()(x, labels=y).logits, gm(x, labels=y).logits)


def test_an_unpadded_example_leaves_later_padding_masks_read():
    """Before: converted from an example whose attention_mask was all ones, a Llama's decoder layers (blocks) were
    captured from Hugging Face's call with attention_mask=None (its shortcut for no padding), while the graph around
    them computes the mask from the input: every later left-padded call ran unmasked (0.32 off at the real tokens,
    autocast 4e-3). Such blocks are converted again for the call the graph around them makes, which reads the mask."""
    from test_large_models import _llama
    torch.manual_seed(0)
    model = _llama()().eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                            dtype=torch.bfloat16)
    for name in ("model.layers.0", "model.layers.1"):
        signature = dict(gm.get_submodule(name).meta["autocastfx"].call_signature)
        assert signature["attention_mask"] == "bool tensor", signature
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with torch.autocast("cpu", torch.bfloat16):
            theirs = model(input_ids=ids, attention_mask=mask).logits.float()
        got = gm(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert _rel(got[real], want[real]) < 3 * _rel(theirs[real], want[real]) + 1e-3


def test_a_config_value_the_model_sets_at_its_first_call_is_the_one_the_graph_holds():
    """A sequence classifier converted with labels: Hugging Face's forward sets ``config.problem_type`` from None
    at its first call, which the capture's copy did. The model's own first call afterwards (a float32 reference)
    sets the same value: the converted module goes on; another value on the model is refused."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=3)
    model = tf.BertForSequenceClassification(cfg).eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.tensor([0, 2])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, example_kwargs=inputs, dtype=torch.bfloat16)
    assert model.config.problem_type is None  # the capture ran on a copy
    with torch.no_grad():
        first = gm(**inputs).loss
        ref = model(**inputs).loss
        assert model.config.problem_type == "single_label_classification"
        assert torch.equal(gm(**inputs).loss, first) and abs(float(first) - float(ref)) < 2e-2
    model.config.problem_type = "multi_label_classification"
    with pytest.raises(ValueError, match=r"problem_type was set to 'multi_label_classification'"):
        gm(**inputs)


def test_a_dropout_switched_off_on_its_own_is_off():
    """Before: ``gm.train(); gm.transformer.drop.eval()`` left GPT-2's embedding dropout on (a torch.export capture
    holds a dropout, a module without tensors, as a stand-in whose mode no program checked): 0.76 off the model in
    the same modes, with nothing said. The call now runs a program for the modes its modules are in."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                        embd_pdrop=0.5, resid_pdrop=0.0, attn_pdrop=0.0)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    gm = autocastfx.convert(model, (ids,), dtype=torch.bfloat16)
    for m in (gm, model):
        m.train()
        m.get_submodule("transformer.drop").eval()
    with torch.no_grad():
        ref, got = model(ids).logits, gm(ids).logits
        assert torch.equal(got, gm(ids).logits)  # no dropout left on: deterministic
    assert _rel(got.float(), ref) < 2e-2


def _gpt2_collecting(collect: bool = True):
    """A GPT-2 whose config asks for every hidden state (``collect``): Hugging Face collects them through forward
    hooks it puts on the decoder blocks at the model's first call. Its weights scaled up: less flat, so a shift of
    its positions changes the tokens it generates."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                        output_hidden_states=collect, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    return model


def _hooks(model):
    return {n: len(m._forward_hooks) for n, m in model.named_modules() if m._forward_hooks}


def test_hidden_states_collected_through_hooks_are_returned_and_the_model_and_its_config_are_its_own():
    """Before, with blocks (the default): the converted module returned no hidden state, as the graph around the
    blocks held the empty list they are collected in; the conversion's run left Hugging Face's hooks on the model's
    own blocks, so the model, called afterwards, hooked them again and returned 5 hidden states where it returns 3;
    and ``gm.config`` was a copy, a change to which did nothing. Now the structure the graph around the blocks
    returns is compared with the model's own call (one graph where they differ), the model's blocks keep the hooks
    they had, and ``gm.config`` is the model's."""
    model, twin = _gpt2_collecting(), _gpt2_collecting()
    ids = torch.randint(3, 64, (2, 8))
    gm = autocastfx.convert(model, (ids,), dtype=torch.bfloat16).eval()
    assert _hooks(model) == {}  # the model has not been called: Hugging Face has not hooked it yet
    got, ref, own = gm(ids).hidden_states, twin(ids).hidden_states, model(ids).hidden_states
    assert len(got) == len(ref) == len(own) == 3
    assert all(torch.equal(a, b) for a, b in zip(own, ref))
    assert max(_rel(a.float(), b) for a, b in zip(got, ref)) < 2e-2
    assert gm.config is model.config


def test_a_copy_of_the_converted_module_keeps_the_models_signature_and_generates_as_it_does():
    """Before: ``copy.deepcopy(gm)`` and ``AveragedModel(gm).module`` (an EMA) showed the example's inputs as their
    forward's signature, so Hugging Face's generate() passed them no position ids: on a left-padded row GPT-2's
    positions were off by the padding, and the copy generated other tokens than the model."""
    import copy
    import inspect
    from torch.optim.swa_utils import AveragedModel
    model = _gpt2_collecting(collect=False)
    ids = torch.randint(3, 64, (2, 8))
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                            dtype=torch.bfloat16, blocks=None).eval()
    copies = [copy.deepcopy(gm), AveragedModel(gm).module]
    for c in copies:
        assert inspect.signature(c.forward) == inspect.signature(gm.forward)
        assert "position_ids" in inspect.signature(c.forward).parameters
    prompt = torch.tensor([[0, 0, 0, 5, 9, 17], [4, 8, 15, 16, 23, 42]])
    kw = dict(attention_mask=(prompt != 0).long(), max_new_tokens=6, do_sample=False, use_cache=False)
    with torch.no_grad():  # the deep copy converts for generate's call on its own (a copy shares no conversion)
        assert torch.equal(copies[0].eval().generate(prompt, **kw), gm.generate(prompt, **kw))

def test_hidden_states_the_model_collects_through_hooks_are_returned_piecewise():
    """``blocks=True`` keeps the blocks where the model around them runs as its own Python. Before: the hooks
    Hugging Face put on the model's blocks during the conversion's run were on no converted block, and the
    converted module returned no hidden state. Now the hooks the model's code put on a block as it ran are the
    converted block's."""
    model, twin = _gpt2_collecting(), _gpt2_collecting()
    ids = torch.randint(1, 64, (2, 8))
    gm = autocastfx.convert(model, (ids,), dtype=torch.bfloat16, blocks=True)
    got, ref = gm(ids).hidden_states, twin(ids).hidden_states
    assert len(got) == len(ref) == 3 and len(model(ids).hidden_states) == 3
    assert max(_rel(a.float(), b) for a, b in zip(got, ref)) < 2e-2
