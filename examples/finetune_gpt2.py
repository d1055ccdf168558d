"""Fine-tune a small GPT-2 (Hugging Face transformers) with autocastfx, entirely offline: the model is built from
a config (no download), the text is generated here, and the tokenizer is a character table written below.

    python examples/finetune_gpt2.py [--steps 100] [--batch-size 16] [--dtype fp16|bf16] [--device cpu|cuda]
                                     [--out DIR] [--resume] [--check-resume]

It is an ordinary Hugging Face training loop (AdamW without decay on biases and LayerNorms, a linear warm-up and
decay schedule, gradient clipping, a validation pass every few steps, a checkpoint mid-run) in which one call,
``autocastfx.convert``, turns the model into an explicit mixed-precision program and ``autocastfx.train_step``
runs the loss-scaled update. The model computes its own loss from ``labels=``, so the step takes no target:
``step(batch)`` with ``loss_fn=lambda out: out.loss``.

``--check-resume`` trains once without a break, then builds everything afresh (model, conversion, optimizer,
schedule, step), loads the mid-run checkpoint and trains to the end again: the losses must be the same bits.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

import autocastfx

try:
    import transformers
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("this example needs Hugging Face transformers: pip install 'autocastfx[hf]' (or transformers>=4.45)")

CHECKPOINT = "checkpoint.pt"


# ----------------------------------------------------------------------------------------------- the data



def gpt2(config, device: torch.device):
    """A GPT2LMHeadModel from ``config``, with its loss named (transformers otherwise warns, on every run, that
    the config's ``loss_type=None`` is unrecognised before using this same causal-LM loss)."""
    model = transformers.GPT2LMHeadModel(config).to(device)
    model.loss_type = "ForCausalLM"
    return model

class MissingCheckpoint(FileNotFoundError):
    """--resume without a checkpoint in --out."""


class CheckpointMismatch(ValueError):
    """--resume with other settings than the run that wrote the checkpoint."""

class CharTokenizer:
    """One token per character, plus padding, beginning and end of sentence: enough for generated text, and
    nothing to download."""

    PAD, BOS, EOS = 0, 1, 2
    CHARS = " .0123456789abcdefghijklmnopqrstuvwxyz"

    def __init__(self):
        self.index = {c: i + 3 for i, c in enumerate(self.CHARS)}

    def __len__(self) -> int:
        return 3 + len(self.CHARS)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer's table {self.CHARS!r}")
        return [self.BOS] + [self.index[c] for c in text] + [self.EOS]

    def decode(self, ids) -> str:
        return "".join(self.CHARS[i - 3] for i in ids if i >= 3)

    def batch(self, texts: list[str], seq_len: int) -> dict[str, torch.Tensor]:
        """Right-padded to ``seq_len``: ``attention_mask`` 0 and ``labels`` -100 on the padding, so that neither
        attention nor the loss sees it (GPT-2 shifts the labels itself)."""
        ids = torch.full((len(texts), seq_len), self.PAD, dtype=torch.long)
        mask = torch.zeros((len(texts), seq_len), dtype=torch.long)
        for row, text in enumerate(texts):
            tokens = self.encode(text)
            if len(tokens) > seq_len:
                raise ValueError(f"{text!r} is {len(tokens)} tokens with BOS and EOS, longer than --seq-len {seq_len}")
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sentence(gen: torch.Generator) -> str:
    """A short statement of arithmetic in words: its lengths vary, and its answers can be learnt."""
    def number(hi):
        return int(torch.randint(0, hi, (), generator=gen))

    kind = number(4)
    a, b = number(1000), number(1000)
    if kind == 0:
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} minus {b} is {a - b}."
    if kind == 2:
        a, b = a % 13, b % 13
        return f"{a} times {b} is {a * b}."
    a, b = a % 100, b % 100
    return f"the sum of {a} and {b} is {a + b}."


def make_splits(tok: CharTokenizer, n_train: int, n_val: int, seq_len: int, seed: int):
    """A training and a validation split of generated sentences, tokenized and padded (tensors on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    texts = [sentence(gen) for _ in range(n_train + n_val)]
    return tok.batch(texts[:n_train], seq_len), tok.batch(texts[n_train:], seq_len), texts[n_train:]


class Batches:
    """Shuffled batches, epoch after epoch, with a position that a checkpoint saves: a resumed run sees exactly
    the batches the uninterrupted run would have seen."""

    def __init__(self, data: dict[str, torch.Tensor], batch_size: int, seed: int, device: torch.device):
        self.data, self.batch_size, self.seed, self.device = data, batch_size, seed, device
        self.n = len(data["input_ids"])
        if batch_size > self.n:
            raise ValueError(f"--batch-size {batch_size} is larger than the {self.n} training examples")
        self.epoch, self.pos = 0, 0

    def next(self) -> dict[str, torch.Tensor]:
        if self.pos + self.batch_size > self.n:  # the rest is dropped: every batch has the same shape
            self.epoch, self.pos = self.epoch + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        idx = order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return {k: v[idx].to(self.device) for k, v in self.data.items()}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def settings(args) -> dict:
    """The options that define a run: a checkpoint only continues a run with the same ones."""
    keys = ("steps", "batch_size", "seq_len", "dtype", "lr", "warmup", "weight_decay", "clip", "train_size", "seed")
    return {k: getattr(args, k) for k in keys}


# ----------------------------------------------------------------------------------------- the model, once

def gpt2_config(tok: CharTokenizer, seq_len: int, **overrides) -> "transformers.GPT2Config":
    """A tiny GPT-2. ``use_cache=False``: with a cache the model returns a DynamicCache object, which
    torch.export cannot capture as an output (and training needs no cache)."""
    kw = dict(vocab_size=len(tok), n_positions=seq_len, n_embd=64, n_layer=2, n_head=4, use_cache=False,
              pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS)
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


class Run:
    """Everything a fine-tuning run holds: the Hugging Face model, its converted module, optimizer, schedule
    and step. Built the same way for a fresh start and for a resume."""

    def __init__(self, config, args, example: dict[str, torch.Tensor], device: torch.device):
        self.model = gpt2(config, device)
        dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
        # the one autocastfx line: captured through torch.export (Hugging Face models do not trace symbolically)
        self.gm = autocastfx.convert(self.model, example_kwargs=example, dtype=dtype)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, args.weight_decay), lr=args.lr, fused=True)
        warmup = max(1, round(args.warmup * args.steps))
        self.scheduler = transformers.get_linear_schedule_with_warmup(self.optimizer, warmup, args.steps)
        # the model computes its own loss from labels=: the step takes the batch dict and no target
        self.step = autocastfx.train_step(self.gm, lambda out: out.loss, self.optimizer,
                                          clip_grad_norm=args.clip)
        self.global_step = 0

    def save(self, path: Path, batches: Batches, args) -> None:
        torch.save({"train_step": self.step.state_dict(),       # float32 weights, optimizer, loss scale, RNG
                    "scheduler": self.scheduler.state_dict(),
                    "global_step": self.global_step,
                    "batches": batches.state_dict(),
                    "settings": settings(args)}, path)

    def load(self, path: Path, batches: Batches, args) -> None:
        if not path.is_file():
            raise MissingCheckpoint(f"no checkpoint at {path}: train first (it is written after step --save-at), "
                                    "or point --out at the directory that holds it")
        # on the CPU: the random-number states inside must stay CPU tensors; load_state_dict copies every
        # other tensor into the module's and the optimizer's own, on their device
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        changed = {k: (v, ckpt["settings"][k]) for k, v in settings(args).items() if ckpt["settings"].get(k) != v}
        if changed:
            raise CheckpointMismatch("the checkpoint was written by a run with other settings, so resuming would not "
                             "continue that run: " + ", ".join(f"--{k.replace('_', '-')} {old!r} there, {new!r} now"
                                                             for k, (new, old) in changed.items())
                             + ". Pass the checkpoint's settings")
        self.step.load_state_dict(ckpt["train_step"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.global_step = ckpt["global_step"]
        batches.load_state_dict(ckpt["batches"])


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The usual Hugging Face split: no weight decay on biases and LayerNorm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------------------- train, evaluate

def evaluate(gm: torch.nn.Module, val: dict[str, torch.Tensor], batch_size: int, device: torch.device) -> dict:
    """Mean validation loss per token and next-token accuracy, in eval mode (no dropout) and without
    gradients; the module is put back in training mode afterwards. ``modes`` records gm.training during and
    after the pass, so that a caller can check the switch."""
    gm.eval()
    during = gm.training
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for i in range(0, len(val["input_ids"]), batch_size):
            batch = {k: v[i:i + batch_size].to(device) for k, v in val.items()}
            out = gm(**batch)
            targets = batch["labels"][:, 1:]
            real = targets != -100
            n = real.sum()
            loss_sum += out.loss.float() * n   # out.loss is the mean over this batch's real tokens
            correct += ((out.logits[:, :-1].argmax(-1) == targets) & real).sum()
            count += n
    gm.train()
    return {"loss": float(loss_sum / count), "accuracy": float(correct / count), "modes": (during, gm.training)}


def train(run: Run, batches: Batches, val, args, device, *, save_at: int | None, out_dir: Path | None) -> dict:
    """Steps ``run.global_step + 1 .. args.steps``: one ``step(batch)`` and one ``scheduler.step()`` each, a
    validation pass every ``--eval-every`` steps, the checkpoint after step ``save_at``."""
    losses, lrs, vals = {}, {}, []
    t0, eval_seconds = time.perf_counter(), 0.0
    while run.global_step < args.steps:
        batch = batches.next()
        lrs[run.global_step + 1] = run.optimizer.param_groups[0]["lr"]
        loss = run.step(batch)          # forward, loss * scale, backward, unscale + check, clip, AdamW, copy back
        run.scheduler.step()
        run.global_step += 1
        losses[run.global_step] = loss  # a device tensor: read when printed, not here (no sync per step)
        k = run.global_step
        if k % args.eval_every == 0 or k == args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()  # the steps so far count as training time, not as validation
            t_eval = time.perf_counter()
            v = evaluate(run.gm, val, args.eval_batch_size, device)
            eval_seconds += time.perf_counter() - t_eval
            vals.append({"step": k, **v})
            scale = (f"loss scale {run.step.stats.summary()['scale']:g}" if run.step.cfg.mode != "off"
                     else "no loss scaling")
            since = max(min(losses), k - args.eval_every + 1)  # a resumed run has no losses before its start
            recent = [float(losses[j]) for j in range(since, k + 1)]
            print(f"step {k:5d}  train loss {sum(recent) / len(recent):.4f} (steps {since}-{k})  "
                  f"val loss {v['loss']:.4f}  "
                  f"val token accuracy {v['accuracy']:.1%}  lr {lrs[k]:.2e}  {scale}  "
                  f"({(time.perf_counter() - t0 - eval_seconds) / len(losses):.2f} s per training step)")
        if save_at is not None and k == save_at and out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            run.save(out_dir / CHECKPOINT, batches, args)
            print(f"checkpoint after step {k} written to {out_dir / CHECKPOINT}")
    return {"losses": [float(losses[k]) for k in sorted(losses)], "first_step": min(losses, default=None),
            "lrs": [lrs[k] for k in sorted(lrs)], "val": vals,
            "train_seconds": time.perf_counter() - t0 - eval_seconds}


# --------------------------------------------------------------------------------- back to Hugging Face

def float32_state_dict(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fine-tuned weights as the Hugging Face model's float32 state dict, a snapshot: the converted module's
    parameters are the model's float32 tensors, and its state dict has the model's keys (GPT-2 ties the
    embedding and the output layer: both names)."""
    return {k: v.detach().clone() for k, v in gm.state_dict().items()}


def check_against_float32(run: Run, config, val, args, device) -> dict:
    """The fine-tuned weights loaded into a plain float32 GPT2LMHeadModel: its validation loss, float32 and
    under torch.autocast, next to the converted module's."""
    model = gpt2(config, device)
    model.load_state_dict(float32_state_dict(run.gm))
    res = {"fp32": evaluate(model, val, args.eval_batch_size, device)["loss"],
           "autocastfx": evaluate(run.gm, val, args.eval_batch_size, device)["loss"]}
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype):
        res["autocast"] = evaluate(model, val, args.eval_batch_size, device)["loss"]
    return res


# ------------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps in all")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32, help="every sequence is padded to this many tokens")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the steps spent warming up the LR")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradients' global norm to this")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batch-size", type=int, default=64,
                    help="validation batch size: batch size and sequence length stay free in the captured graph")
    ap.add_argument("--train-size", type=int, default=4096)
    ap.add_argument("--val-size", type=int, default=256)
    ap.add_argument("--save-at", type=int, default=None, help="checkpoint after this step (default: half way)")
    ap.add_argument("--out", default="gpt2_finetune_out", help="directory for the checkpoint")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    ap.add_argument("--check-resume", action="store_true",
                    help="train without a break, then again from the mid-run checkpoint: the losses must agree")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device: use --device cpu")
    if args.steps < 1 or args.eval_every < 1:
        ap.error("--steps and --eval-every must be at least 1")
    if args.check_resume and args.steps < 2:
        ap.error("--check-resume needs --steps 2 or more: it resumes from a checkpoint before the last step")
    if args.save_at is None:
        args.save_at = max(1, args.steps // 2)
    if not 1 <= args.save_at < args.steps + (0 if args.check_resume else 1):
        ap.error(f"--save-at must lie in 1..{args.steps - (1 if args.check_resume else 0)} "
                 "(the resume check needs steps after the checkpoint)")
    if args.resume and args.check_resume:
        ap.error("--resume continues a run, --check-resume runs its own pair of runs: choose one")
    return args


def main(argv=None) -> dict:
    """Run the example; returns what it printed as data (losses, validation results, the resume comparison)
    and the objects of the uninterrupted run (``result["run"].gm``, ``.step``...; the resumed run's are in
    ``result["resume"]["run"]``) for inspection."""
    args = parse_args(argv)
    device = torch.device(args.device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if device.type == "cuda" and args.check_resume:
        # bit-identical reruns on CUDA need deterministic kernels (the embedding's backward adds with atomics)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return run_example(args, device)
    except (MissingCheckpoint, CheckpointMismatch) as e:  # a user's mistake, said in one line, not a traceback
        sys.exit(f"finetune_gpt2.py: {e}")
    finally:
        torch.use_deterministic_algorithms(deterministic)


def run_example(args, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    tok = CharTokenizer()
    train_data, val, val_texts = make_splits(tok, args.train_size, args.val_size, args.seq_len, args.seed)
    lengths = train_data["attention_mask"].sum(1)
    print(f"data: {args.train_size} training and {args.val_size} validation sentences, {int(lengths.min())} to "
          f"{int(lengths.max())} tokens padded to {args.seq_len}; e.g. {val_texts[0]!r}, {val_texts[1]!r}")
    config = gpt2_config(tok, args.seq_len)
    batches = Batches(train_data, args.batch_size, args.seed, device)
    example = {k: v[:args.batch_size].to(device) for k, v in train_data.items()}
    out_dir = Path(args.out)

    run = Run(config, args, example, device)
    n_params = sum(p.numel() for p in run.model.parameters())
    print(f"model: GPT2LMHeadModel, {n_params:,} parameters, {config.n_layer} layers, n_embd {config.n_embd}, "
          f"vocab {config.vocab_size}; {args.dtype} on {device}")
    report = str(autocastfx.report(run.gm))
    print(report.split("\n\n", 1)[1] if "\n\n" in report else report)  # the totals, not the node-by-node table

    if args.resume:
        run.load(out_dir / CHECKPOINT, batches, args)
        print(f"resumed from {out_dir / CHECKPOINT} after step {run.global_step}")
    before = evaluate(run.gm, val, args.eval_batch_size, device)
    print(f"validation {'at the start' if args.resume else 'before training'}: loss {before['loss']:.4f}, "
          f"token accuracy {before['accuracy']:.1%} "
          f"(a uniform guess: loss {math.log(config.vocab_size):.4f})")
    result = train(run, batches, val, args, device, save_at=args.save_at, out_dir=out_dir)
    result.update(before=before, args=args, run=run, config=config, val_data=val, tokenizer=tok)

    print("loss curve (steps: mean training loss): " + loss_curve(result["losses"], result["first_step"]))
    after = result["val"][-1] if result["val"] else before
    print(f"validation loss {before['loss']:.4f} -> {after['loss']:.4f}, token accuracy {before['accuracy']:.1%} "
          f"-> {after['accuracy']:.1%}")
    stats = run.step.stats.summary()
    scaling = (f"loss scale {stats['scale']:g}" if run.step.cfg.mode != "off"
               else "no loss scaling (bfloat16 has float32's range)")
    print(f"{scaling} after {stats['steps']} steps, {stats['skipped']} skipped; last gradient norm "
          f"{stats['grad_norm']:.3f}")
    result["stats"] = stats
    result["float32_check"] = check_against_float32(run, config, val, args, device)
    c = result["float32_check"]
    print(f"the fine-tuned weights in a float32 GPT2LMHeadModel: validation loss {c['fp32']:.5f} (float32), "
          f"{c['autocast']:.5f} (torch.autocast {args.dtype}), {c['autocastfx']:.5f} (autocastfx {args.dtype})")

    if args.check_resume:
        result["resume"] = check_resume(config, args, example, train_data, val, device, out_dir, result)
    return result


def loss_curve(losses: list[float], first_step: int | None, points: int = 10) -> str:
    """The training loss averaged over ``points`` equal stretches of the run: single steps are noisy."""
    if not losses:
        return "no steps run"
    size = math.ceil(len(losses) / points)
    parts = []
    for i in range(0, len(losses), size):
        chunk = losses[i:i + size]
        first, last = first_step + i, first_step + i + len(chunk) - 1
        parts.append(f"{first}{f'-{last}' if last > first else ''}: {sum(chunk) / len(chunk):.3f}")
    return ", ".join(parts)


def check_resume(config, args, example, train_data, val, device, out_dir: Path, first: dict) -> dict:
    """Build everything again, load the mid-run checkpoint, train to the end and compare with the run that had
    no break. Equal bits are expected: the checkpoint carries the float32 weights, AdamW's moments
    and step counts, the loss scale and its counters, the schedule, the data position and the RNG state that
    dropout draws from, and every kernel here is deterministic (on CUDA once deterministic algorithms are on)."""
    print(f"\nresume check: a fresh model, conversion, optimizer, schedule and step from {out_dir / CHECKPOINT}")
    torch.manual_seed(args.seed + 1)  # a different initialisation: the checkpoint must overwrite all of it
    run = Run(config, args, example, device)
    batches = Batches(train_data, args.batch_size, args.seed, device)
    run.load(out_dir / CHECKPOINT, batches, args)
    resumed = train(run, batches, val, args, device, save_at=None, out_dir=None)
    expected = first["losses"][args.save_at:]
    got = resumed["losses"]
    diff = max((abs(a - b) for a, b in zip(got, expected)), default=0.0)
    identical = len(got) == len(expected) and got == expected
    vals_equal = [v["loss"] for v in resumed["val"]] == [v["loss"] for v in first["val"] if v["step"] > args.save_at]
    print(f"resume check: steps {args.save_at + 1}..{args.steps}: "
          + ("losses bit-identical to the uninterrupted run" if identical
             else f"losses differ from the uninterrupted run by up to {diff:.3g}")
          + ("; validation losses identical too" if vals_equal else "; validation losses differ"))
    return {"losses": got, "expected": expected, "identical": identical, "max_diff": diff,
            "val": resumed["val"], "val_identical": vals_equal, "run": run}


if __name__ == "__main__":
    main()
