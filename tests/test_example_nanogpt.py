"""examples/train_nanogpt.py, small: a model with its own loss, configure_optimizers and generate, trained by its own
loop through autocastfx's step; checkpointed, resumed, sampled from, and loaded back into the model as written."""
import math
import sys
from pathlib import Path

import pytest
import torch

import autocastfx

from helpers import small_if_emulated

ROOT = Path(__file__).resolve().parent.parent


def _example():
    import importlib
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module("train_nanogpt")
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    threads = torch.get_num_threads()
    # The example trains in bfloat16: 16 sequences a micro-batch, 4 where bfloat16's matmuls run in torch's scalar
    # loops (on an AVX2-only CPU they were 14 s of the fixture's 33 s; the loss falls 3.3 -> 2.0 either way)
    batch = small_if_emulated(16, 4)
    try:
        return _example().main(["--iters", "24", "--accum", "2", "--eval-interval", "12", "--eval-iters", "2",
                                "--sample-tokens", "12", "--resume-check", "--quiet", "--batch-size", str(batch),
                                "--out", str(tmp_path_factory.mktemp("nanogpt"))])
    finally:
        torch.set_num_threads(threads)  # the example sets one thread


def test_the_loss_falls_and_evaluation_is_finite(run):
    losses = run["losses"]
    assert len(losses) == 24 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5  # 3.3 (uniform over the characters) -> about 2.2
    (_, first), (_, last) = run["evals"][0], run["evals"][-1]
    assert all(math.isfinite(v) for v in (*first.values(), *last.values()))
    assert last["val"] < first["val"]
    assert run["gm"].training  # estimate_loss() put it back in training mode
    assert int(run["step"].stats.steps) == 24 and int(run["step"].stats.skipped) == 0


def test_the_optimizer_of_configure_optimizers_steps_the_models_float32_parameters(run):
    gm, opt, model = run["gm"], run["optimizer"], run["model"]
    own = [p for p in gm.parameters()]
    assert all(p.dtype == torch.float32 for p in own)  # nothing stored low: the graph casts to bfloat16
    assert {id(p) for p in own} == {id(p) for p in model.parameters()}  # the model's own tensors, trained in place
    masters = {id(m) for m in autocastfx.master_parameters(gm)}  # the weights the graph reads only as bfloat16
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # the groups configure_optimizers made over gm's parameters, as they are (nothing re-pointed): every matrix in
    # decay, the bfloat16-read ones and the embedding tables, which the plan reads in float32 (the embedding's
    # output starts the float32 residual stream, as under autocast)
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(id(p) for p in own)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert masters and masters <= {id(p) for p in decay["params"]}
    rest = [p for p in decay["params"] if id(p) not in masters]
    assert {id(p) for p in rest} == {id(model.wte.weight), id(model.wpe.weight)}  # wte (tied to the head), wpe
    assert all(id(p) not in masters for p in no_decay["params"])  # layer-norm gains
    assert decay["fused"] and no_decay["fused"]
    assert all(p.grad is None for p in gm.parameters())  # freed after each update


def test_a_resumed_run_gives_the_same_losses_bit_for_bit(run):
    state = torch.load(run["ckpt"], weights_only=True)
    assert state["iter"] == 12 and run["resume_identical"]
    assert run["resumed"] == run["losses"][12:]


def test_the_state_dict_is_the_float32_model_and_loads_into_it(run):
    example = _example()
    gm = run["gm"]
    sd = gm.state_dict()
    model = example.GPT(run["config"])
    result = model.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert set(sd) == set(model.state_dict())  # tied weights under both names
    own = model.state_dict()
    for name, p in gm.named_parameters():
        assert own[name].dtype == p.dtype == torch.float32 and torch.equal(own[name], p)
    assert model.lm_head.weight is model.wte.weight
    ckpt = torch.load(run["ckpt"], weights_only=True)["model"]  # the one written half-way loads the same way
    assert all(v.dtype == torch.float32 for v in ckpt.values())
    assert not example.GPT(run["config"]).load_state_dict(ckpt).missing_keys


def test_generate_samples_through_a_converted_forward(run):
    sampler, sample, cfg = run["sampler"], run["sample"], run["config"]
    assert sample.shape == (1, 4 + 12) and run["chars"].decode(sample[0, :4].tolist()) == "the "
    calls = []
    handle = sampler.register_forward_hook(lambda *a: calls.append(a[2][0].shape))
    try:
        start = torch.zeros(2, cfg.block_size + 3, dtype=torch.long)  # longer than the block: cropped
        out = sampler.generate(start, 5, top_k=3)
    finally:
        handle.remove()
    assert out.shape == (2, cfg.block_size + 8) and torch.equal(out[:, :cfg.block_size + 3], start)
    assert calls == [(2, 1, cfg.vocab_size)] * 5  # self(idx_cond) ran the converted module: last position only


def test_the_training_module_samples_through_its_conversion_for_the_sampling_call(run):
    """gm was converted for (idx, targets); generate() calls self(idx), a call of another structure: gm converted
    itself for it on first use, on its own weights (the same Parameter objects, so what the step trained), in
    its mode, and the logits are those of a conversion made for that call from the trained float32 weights."""
    from autocastfx.base import keys as K
    gm, cfg = run["gm"], run["config"]
    assert run["sampler"] is gm
    made = [other for other, _ in gm.meta[K.OTHER_CALLS].by_key.values()]  # one per mode it was called in
    own = {id(p) for p in gm.parameters()}
    masters = {id(m) for m in autocastfx.master_parameters(gm)}
    for other in made:
        assert all(id(p) in own for p in other.parameters())
        assert all(id(m) in masters for m in autocastfx.master_parameters(other))
    other, = [other for other in made if not other.training]  # the example samples in eval mode
    model = _example().GPT(cfg)
    model.load_state_dict(gm.state_dict())
    fresh = autocastfx.convert(model, (torch.zeros(2, cfg.block_size, dtype=torch.long),), dtype=torch.bfloat16)
    fresh.eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    gm.eval()
    try:
        logits, loss = gm(idx)
        assert not other.training  # the conversion for the call follows gm's mode
    finally:
        gm.train()
    assert loss is None and torch.equal(logits, fresh(idx)[0])
