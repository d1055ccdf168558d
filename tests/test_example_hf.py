"""The Hugging Face fine-tuning example (examples/finetune_gpt2.py) runs offline and does what it prints: the loss
falls, validation runs in eval mode, a resumed run repeats the uninterrupted one bit for bit, dropout (the
attention's too) follows train()/eval(), the GEMMs run in float16 and the loss in float32, and the fine-tuned
weights give the same validation loss in a plain float32 GPT2LMHeadModel."""
import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face example needs transformers: pip install 'autocastfx[hf]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import finetune_gpt2  # noqa: E402

from helpers import AtenRecorder, small_if_emulated  # noqa: E402

STEPS, SAVE_AT = 6, 3
# The example trains in float16: 8 sequences a batch, 4 where float16's matmuls run in torch's scalar loops (the
# training and evaluation were about half of the fixture's time on an AVX2-only CPU; the loss falls 3.7 -> 3.2
# either way)
BATCH = small_if_emulated(8, 4, torch.float16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report lists what the policy leaves unclassified
        res = finetune_gpt2.main(["--steps", str(STEPS), "--save-at", str(SAVE_AT), "--eval-every", "3",
                                  "--batch-size", str(BATCH), "--train-size", "256", "--val-size", "32",
                                  "--warmup", "0.2", "--check-resume", "--out", str(out), "--device", "cpu"])
    res["out"] = out
    return res


def _val_batch(res, n=8):
    return {k: v[:n] for k, v in res["val_data"].items()}


def test_loss_is_finite_and_falls(result):
    losses = result["losses"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(result["config"].vocab_size)) < 0.3  # starts near a uniform guess
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2
    assert result["val"][-1]["loss"] < result["before"]["loss"] - 0.3
    assert result["val"][-1]["accuracy"] > result["before"]["accuracy"]
    stats = result["stats"]
    assert stats["steps"] == STEPS and stats["skipped"] == 0 and math.isfinite(stats["grad_norm"])
    lrs = result["lrs"]  # the schedule warms up, then decays to zero at the last step
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[1] and result["run"].scheduler.get_last_lr()[0] == 0.0


def test_validation_runs_in_eval_mode_and_training_resumes_after(result):
    assert [v["step"] for v in result["val"]] == [3, 6]
    assert all(v["modes"] == (False, True) for v in result["val"] + [result["before"]])
    gm = result["run"].gm
    assert gm.training
    # independently of what evaluate() reports: dropout off means two passes give the same bits
    a = finetune_gpt2.evaluate(gm, result["val_data"], 16, CPU)
    b = finetune_gpt2.evaluate(gm, result["val_data"], 16, CPU)
    assert a["loss"] == b["loss"] and gm.training
    assert a["loss"] == pytest.approx(result["val"][-1]["loss"], rel=1e-3)  # batch size is free in the graph


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(result):
    res = result["resume"]
    assert len(res["losses"]) == STEPS - SAVE_AT
    assert res["identical"] and res["losses"] == result["losses"][SAVE_AT:]
    assert res["val_identical"] and [v["step"] for v in res["val"]] == [6]
    first, again = result["run"], res["run"]
    assert again.global_step == first.global_step == STEPS
    w1, w2 = first.gm.state_dict(), again.gm.state_dict()  # the float32 weights at the end, not only the losses
    assert sorted(w1) == sorted(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    s1, s2 = first.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    ckpt = torch.load(result["out"] / finetune_gpt2.CHECKPOINT, weights_only=True)
    assert ckpt["global_step"] == SAVE_AT and ckpt["batches"] == {"epoch": 0, "pos": SAVE_AT * BATCH}


def test_dropout_switches_with_train_and_eval(result):
    gm = result["run"].gm
    batch = _val_batch(result)
    with torch.no_grad():
        gm.eval()
        e1, e2 = gm(**batch).logits, gm(**batch).logits
        gm.train()
        t1, t2 = gm(**batch).logits, gm(**batch).logits
    assert torch.equal(e1, e2) and not torch.equal(t1, t2)


def test_attention_dropout_alone_switches_too():
    """Only the attention's dropout probability on: GPT-2 passes ``dropout=self.attn_dropout.p if self.training
    else 0.0`` to scaled_dot_product_attention, a value that the capture must keep switchable."""
    tok = finetune_gpt2.CharTokenizer()
    config = finetune_gpt2.gpt2_config(tok, 32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.5)
    args = finetune_gpt2.parse_args(["--steps", "4", "--device", "cpu"])
    batch = tok.batch(["12 plus 3 is 15.", "the sum of 4 and 5 is 9."], 32)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = finetune_gpt2.Run(config, args, batch, CPU)
    with torch.no_grad():
        run.gm.eval()
        e1, e2 = run.gm(**batch).logits, run.gm(**batch).logits
        ref = run.model.eval()(**batch).logits  # the float32 model, same weights
        with torch.autocast("cpu", dtype=torch.float16):
            autocast = run.model(**batch).logits.float()
        run.gm.train()
        t1, t2 = run.gm(**batch).logits, run.gm(**batch).logits
    assert torch.equal(e1, e2) and not torch.equal(t1, t2)
    err, autocast_err = (e1 - ref).abs().max(), (autocast - ref).abs().max()
    assert err <= 2 * autocast_err + 1e-4, (err, autocast_err)  # logits of size ~1: both about 4e-4 off


def test_gemms_run_low_and_the_loss_in_float32(result):
    gm = result["run"].gm
    batch = _val_batch(result)
    rec = AtenRecorder()
    with rec:  # training mode, forward and backward
        out = gm(**batch)
        out.loss.backward()
    for p in gm.parameters():
        p.grad = None
    gemms = rec.ops("mm", "addmm")  # the projections, the MLPs and the output layer, forward and backward
    assert len(gemms) >= 2 * (4 * 2 + 1)
    assert all(d == torch.float16 for c in gemms for d in c.in_dtypes if d.is_floating_point)
    norms = rec.ops("native_layer_norm")
    assert len(norms) == 5 and all(d == torch.float32 for c in norms for d in c.in_dtypes)
    losses = rec.ops("_log_softmax", "nll_loss_forward")
    assert losses and all(d == torch.float32 for c in losses for d in c.in_dtypes + c.out_dtypes if d.is_floating_point)
    assert out.loss.dtype == out.logits.dtype == torch.float32
    # the module stores the Hugging Face model's own float32 parameters (the graph casts them), nothing low
    run = result["run"]
    assert {id(p) for p in gm.parameters()} == {id(p) for p in run.model.parameters()}
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    # the optimizer, built over the Hugging Face model's parameters before the step, steps those same tensors
    assert {id(p) for g in run.optimizer.param_groups for p in g["params"]} == {id(p) for p in gm.parameters()}
    # attention: scaled_dot_product_attention is given float16. With dropout on, the CPU runs it through torch's
    # math fallback, which computes in float32 inside (plain torch does the same); in eval mode the fused CPU
    # kernel runs, in float16
    gm.eval()
    rec = AtenRecorder()
    with rec, torch.no_grad():
        gm(**batch)
    gm.train()
    attn = rec.ops("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")
    assert len(attn) == 2 and all(c.in_dtypes[0] == torch.float16 for c in attn)


def test_fine_tuned_weights_load_into_the_float32_model(result):
    c = result["float32_check"]
    assert c["fp32"] == pytest.approx(result["val"][-1]["loss"], rel=1e-3)  # the trained weights, not the initial
    err, autocast_err = abs(c["autocastfx"] - c["fp32"]), abs(c["autocast"] - c["fp32"])
    assert err <= max(2 * autocast_err, 1e-3 * c["fp32"]), c
    sd = finetune_gpt2.float32_state_dict(result["run"].gm)
    assert sd["lm_head.weight"].dtype == torch.float32
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])  # tied: both names, one tensor's values
    gm = result["run"].gm
    assert all(torch.equal(sd[k], v) and sd[k] is not v for k, v in gm.state_dict().items())  # a snapshot


def test_bad_options_text_and_checkpoints_fail_clearly(result, tmp_path):
    with pytest.raises(SystemExit):
        finetune_gpt2.parse_args(["--steps", "4", "--save-at", "4", "--check-resume"])
    run, args = result["run"], copy.copy(result["args"])
    batches = finetune_gpt2.Batches(result["val_data"], 8, 0, CPU)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        run.load(tmp_path / "missing.pt", batches, args)
    args.steps, args.lr = 7, 1e-3
    before = [p.clone() for p in run.gm.parameters()]
    with pytest.raises(ValueError, match=r"--steps 6 there, 7 now, --lr 0.003 there, 0.001 now"):
        run.load(result["out"] / finetune_gpt2.CHECKPOINT, batches, args)
    assert all(torch.equal(a, b) for a, b in zip(before, run.gm.parameters())) and batches.state_dict()["pos"] == 0
    with pytest.raises(ValueError, match="not in the tokenizer"):
        finetune_gpt2.CharTokenizer().encode("2 + 2 = 4")
    with pytest.raises(ValueError, match="longer than --seq-len"):
        finetune_gpt2.CharTokenizer().batch(["the sum of 10 and 20 is 30."], 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_example_trains_and_resumes_on_the_device(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = finetune_gpt2.main(["--steps", "8", "--eval-every", "4", "--batch-size", "8", "--train-size", "256",
                                  "--val-size", "64", "--warmup", "0.2", "--check-resume", "--out", str(tmp_path),
                                  "--device", "cuda"])
    losses = res["losses"]
    assert all(math.isfinite(v) for v in losses) and sum(losses[-2:]) < sum(losses[:2]) - 0.4
    assert res["val"][-1]["loss"] < res["before"]["loss"] - 0.3 and res["stats"]["skipped"] == 0
    assert res["run"].gm.training and all(v["modes"] == (False, True) for v in res["val"])
    # deterministic algorithms are on for the check; the tolerance only covers a cuBLAS workspace setting that
    # comes too late in a process whose CUDA context already exists
    torch.testing.assert_close(res["resume"]["losses"], res["resume"]["expected"], rtol=1e-3, atol=0)
    c = res["float32_check"]
    assert abs(c["autocastfx"] - c["fp32"]) <= max(2 * abs(c["autocast"] - c["fp32"]), 1e-3 * c["fp32"]), c
