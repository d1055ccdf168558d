"""Train a small GPT-2 with the Hugging Face Trainer, the mixed precision coming from autocastfx:
``autocastfx.integrations.hf.Trainer`` in place of ``transformers.Trainer``, nothing else changed. Offline: the
model is built from a GPT2Config, and the text and the character tokenizer are those of
examples/finetune_gpt2.py (generated statements of arithmetic such as '860 plus 531 is 1391.').

    python examples/train_hf_trainer.py [--steps 60] [--dtype fp16|bf16] [--out hf_trainer_out] [--float32]

Accumulation, clipping, a warm-up and linear decay, evaluation and checkpoints are the Trainer's own settings;
its logs hold loss_scale, skipped_steps and grad_norm at each logging step.
"""
import argparse
import warnings

import torch

try:
    import transformers
except ImportError as e:
    raise SystemExit("this example needs transformers: pip install 'autocastfx[hf]'") from e

from autocastfx.integrations.hf import Trainer
from finetune_gpt2 import CharTokenizer, gpt2, gpt2_config, make_splits


def rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def train(args, float32=False):
    tok = CharTokenizer()
    train_set, val_set, _ = make_splits(tok, args.train_size, 64, 32, seed=0)
    torch.manual_seed(0)
    model = gpt2(gpt2_config(tok, 32), torch.device("cpu"))
    targs = transformers.TrainingArguments(
        f"{args.out}/{'float32' if float32 else 'autocastfx'}", max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=max(1, args.steps // 10),
        max_grad_norm=args.clip, logging_steps=args.log_every, eval_strategy="steps",
        eval_steps=max(1, args.steps // 2), save_steps=max(1, args.steps // 2), per_device_eval_batch_size=64,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    cls = transformers.Trainer if float32 else Trainer
    kw = {} if float32 else {"dtype": torch.bfloat16 if args.dtype == "bf16" else torch.float16}
    trainer = cls(model=model, args=targs, train_dataset=rows(train_set), eval_dataset=rows(val_set), **kw)
    trainer.model_accepts_loss_kwargs = False  # both: the mean over each micro-batch's tokens, as the model gives it
    trainer.train()
    return trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (clipped by the step, after unscaling)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--train-size", type=int, default=2048)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--out", default="hf_trainer_out")
    ap.add_argument("--float32", action="store_true", help="also train with transformers.Trainer in float32")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # the conversion report's notes on what runs in float32

    trainer = train(args)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:4d}  loss {h['loss']:.4f}  loss_scale {h['loss_scale']:g}  "
              f"skipped {h['skipped_steps']}  grad_norm {h.get('grad_norm', float('nan')):.3f}")
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    print(f"eval loss {evals[-1]:.4f}")
    result = {"losses": [h["loss"] for h in logs], "scales": [h["loss_scale"] for h in logs], "eval_loss": evals[-1]}
    if args.float32:
        ref = [h["loss"] for h in train(args, float32=True).state.log_history if "loss" in h]
        worst = max(abs(a - b) for a, b in zip(result["losses"], ref))
        print(f"transformers.Trainer in float32: largest logged-loss difference {worst:.2e}")
        result["float32_diff"] = worst
    return result


if __name__ == "__main__":
    main()
