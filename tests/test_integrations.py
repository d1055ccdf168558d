"""Trainer integrations: autocastfx's step inside Hugging Face's Trainer and Lightning's Trainer, with
accumulation, clipping, a scheduler, evaluation, checkpoints and resume, against the same trainer in float32."""
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autocastfx

from helpers import AtenRecorder

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------------------ Hugging Face

def _hf_run(out, steps, resume=None, float32=False, record=False):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autocastfx.integrations.hf import Trainer

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(32)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    args = tf.TrainingArguments(str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                max_steps=steps, learning_rate=2e-3, max_grad_norm=1.0, lr_scheduler_type="linear",
                                warmup_steps=1, logging_steps=1, save_steps=2, eval_strategy="steps", eval_steps=2,
                                report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    cls = tf.Trainer if float32 else Trainer
    trainer = cls(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.model_accepts_loss_kwargs = False  # both: the mean over each micro-batch's tokens, as the model gives it
    if record:
        with AtenRecorder() as rec:
            trainer.train(resume_from_checkpoint=resume)
        return trainer, rec
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.fixture(scope="module")
def hf_whole(tmp_path_factory):
    """A whole 4-step run through autocastfx's Trainer, its aten calls recorded, and its output directory: what
    the float32 Trainer is compared with, and what an interrupted and resumed run must repeat."""
    out = tmp_path_factory.mktemp("hf") / "ours"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, rec = _hf_run(out, 4, record=True)
    return trainer, rec, out


def test_hugging_face_trainer_trains_through_the_generated_step(tmp_path, hf_whole):
    ours, rec, out = hf_whole
    ref = _hf_run(tmp_path / "ref", 4, float32=True)
    a, b = _losses(ours), _losses(ref)
    assert len(a) == len(b) == 4
    worst = max(abs(x - y) for x, y in zip(a, b))
    print(f"HF Trainer: losses {a} vs float32 {b}; largest difference {worst:.2e}")
    assert worst < 2e-2  # float16 noise on a loss near 4
    assert max(abs(x - y) for x, y in zip(_losses(ours, "eval_loss"), _losses(ref, "eval_loss"))) < 2e-2
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert all("loss_scale" in h and "skipped_steps" in h and math.isfinite(h["grad_norm"]) for h in logs)
    assert all(h["grad_norm"] >= 0 for h in logs)
    mms = [c for c in rec.calls if c.name in ("mm", "addmm", "bmm")]
    assert mms and sum(torch.float16 in c.in_dtypes for c in mms) > len(mms) // 2
    assert "autocastfx_step.pt" in os.listdir(out / "checkpoint-2")
    # clipped by the step at the arguments' max_grad_norm, which stay as given, in the run and in its checkpoints
    # (before: set to 0.0 on the caller's TrainingArguments, so a second Trainer built on them did not clip)
    assert ours.step.clip == ours.args.max_grad_norm == 1.0
    assert torch.load(out / "checkpoint-4" / "training_args.bin", weights_only=False).max_grad_norm == 1.0
    # the checkpoint's weights are the converted module's float32 parameters, unrounded, under the model's names
    from safetensors.torch import load_file
    saved = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    weights = ours.model.state_dict()
    assert all(p.dtype == torch.float32 for p in ours.model.parameters())
    assert saved and all(v.dtype == torch.float32 for v in saved.values())
    for k, v in saved.items():
        assert torch.equal(v, weights[k]), k
    assert any(not torch.equal(v, v.half().float()) for v in saved.values())  # not float16 values
    # a checkpoint from_pretrained takes, as the float32 Trainer's: its config beside the weights
    tf = pytest.importorskip("transformers")
    loaded = tf.GPT2LMHeadModel.from_pretrained(str(out / "checkpoint-4"))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_hugging_face_trainer_resumes_as_if_never_stopped(tmp_path, hf_whole):
    """A fresh Trainer resumed from the whole run's step-2 checkpoint (what a run stopped there leaves: the same
    schedule, the same state) repeats the whole run's last two steps bit for bit."""
    whole, _, out = hf_whole
    resumed = _hf_run(tmp_path / "resumed", 4, resume=str(out / "checkpoint-2"))
    a = [h for h in whole.state.log_history if "loss" in h][2:]
    b = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 2]
    assert [h["loss"] for h in a] == [h["loss"] for h in b]
    assert [h["loss_scale"] for h in a] == [h["loss_scale"] for h in b]
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_hugging_face_trainer_refuses_its_own_fp16_flag(tmp_path):
    tf = pytest.importorskip("transformers")
    from autocastfx.integrations.hf import Trainer

    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    args = tf.TrainingArguments(str(tmp_path), fp16=True, use_cpu=True, report_to=[])
    with pytest.raises((ValueError, TypeError)):
        Trainer(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=[])


def _padded_run(tmp_path, batch, accum):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autocastfx.integrations.hf import Trainer
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(24):
        ids = torch.randint(1, 64, (16,), generator=g)
        labels = ids.clone()
        labels[int(torch.randint(2, 16, (1,), generator=g)):] = -100  # label tokens per row vary
        rows.append({"input_ids": ids, "labels": labels})
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                             use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0))
    args = tf.TrainingArguments(str(tmp_path / f"{batch}x{accum}"), per_device_train_batch_size=batch,
                                gradient_accumulation_steps=accum, num_train_epochs=1, learning_rate=5e-3,
                                max_grad_norm=0, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
                                report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    Trainer(model=model, args=args, train_dataset=rows, dtype=torch.bfloat16).train()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def test_hugging_face_trainer_accumulates_as_one_batch_when_label_tokens_vary(tmp_path):
    """Each micro-batch's loss is weighted by its share of the window's label tokens, as transformers.Trainer
    does for a model that takes num_items_in_batch: 4 x 2 micro-batches update as one batch of 8 (before, the
    means of the micro-batches were averaged: 0.22 apart after the epoch's three updates, where bfloat16 noise is
    3e-3)."""
    big, accumulated = _padded_run(tmp_path, 8, 1), _padded_run(tmp_path, 4, 2)
    assert ((accumulated - big).norm() / big.norm()).item() < 1e-2


class _NoKwargs(torch.nn.Module):
    """A model whose forward takes no ``**kwargs``: the Trainer passes no token count, and scales by windows."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)

    def forward(self, x, labels):
        from transformers.modeling_outputs import SequenceClassifierOutput
        logits = self.fc2(torch.relu(self.fc1(x)))
        return SequenceClassifierOutput(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def test_hugging_face_trainer_averages_an_epochs_shorter_last_window_as_the_trainer_does(tmp_path):
    """Five batches an epoch, windows of 2, 2 and 1: transformers.Trainer divides by each window's own length;
    autocastfx's Trainer divided by 2 throughout, halving the last update (loss logged 0.58 for 1.17)."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autocastfx.integrations.hf import Trainer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=g)
    rows = [{"x": x[i], "labels": x[i, :3].argmax()} for i in range(40)]

    def run(cls, **kw):
        torch.manual_seed(0)
        model = _NoKwargs()
        args = tf.TrainingArguments(str(tmp_path / cls.__module__), per_device_train_batch_size=8,
                                    gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=0.5, optim="sgd",
                                    lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                                    use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, max_grad_norm=0,
                                    remove_unused_columns=False)
        trainer = cls(model=model, args=args, train_dataset=rows, **kw)
        trainer.train()
        return _losses(trainer), torch.cat([p.detach().flatten() for p in model.parameters()])

    (want, w32), (got, w) = run(tf.Trainer), run(Trainer, dtype=torch.bfloat16)
    assert len(got) == len(want) == 6
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.01, (got, want)
    assert ((w - w32).norm() / w32.norm()).item() < 0.03


def test_a_converted_causal_lm_keeps_its_class_name_for_the_trainers_label_shift(tmp_path):
    """transformers.Trainer shifts the labels of label smoothing for a causal LM, which it knows by
    ``model._get_name()``: the converted module answered "GraphModuleImpl", so a converted GPT-2 learnt to copy its
    input (compute_loss 3.81 where the model's is 4.16)."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    # converted for the call compute_loss makes: with label smoothing it takes the labels out of the batch
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids}, dtype=torch.bfloat16)
    assert gm._get_name() == "GPT2LMHeadModel"
    args = tf.TrainingArguments(str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    with torch.no_grad():
        want = tf.Trainer(model=model, args=args).compute_loss(model, dict(batch))
        got = tf.Trainer(model=gm, args=args).compute_loss(gm, dict(batch))
    assert abs(got.item() - want.item()) < 0.02 * want.item(), (got.item(), want.item())


def test_hugging_face_trainer_refuses_a_loss_it_would_not_train_on(tmp_path):
    """autocastfx's Trainer trains on the model's own loss: label smoothing and compute_loss_func were ignored in
    training without a word (the weights bit-identical to a run without them)."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autocastfx.integrations.hf import Trainer

    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, use_cache=False)
    ids = torch.randint(0, 64, (8, 16))
    rows = [{"input_ids": i, "labels": i.clone()} for i in ids]
    for kw in ({"label_smoothing_factor": 0.1}, {}):
        args = tf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                                    use_cpu=True, **kw)
        extra = {} if kw else {"compute_loss_func": lambda out, labels, num_items_in_batch=None: out.loss * 3}
        trainer = Trainer(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=rows, dtype=torch.bfloat16,
                          **extra)
        with pytest.raises(ValueError, match="trains on the model's own loss.*transformers.Trainer"):
            trainer.train()


def test_hugging_face_trainer_does_not_advance_the_schedule_over_a_skipped_update(tmp_path):
    """The Trainer steps its learning-rate schedule unless accelerate says the update was skipped, which it read
    from its own GradScaler: an update autocastfx's step skipped for an overflow advanced the schedule anyway, so
    every later step ran at a learning rate one step ahead of the float16 Trainer's. The Trainer is now told."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autocastfx.integrations.hf import Trainer

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(24)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    args = tf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
                                lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
                                use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=data, dtype=torch.float16,
                      step_kwargs={"init_scale": 2.0 ** 20})  # far too large: the first updates overflow
    trainer.train()
    skipped = int(trainer.step.state.skipped)
    assert 0 < skipped < 6, skipped
    assert trainer.state.global_step == 6
    assert trainer.lr_scheduler.last_epoch == 6 - skipped  # one schedule step per update applied
