"""Train a small character-level GPT with its own training loop, the mixed precision coming from autocastfx.

The model is written the way nanoGPT-style projects write one: a ``GPTConfig`` dataclass, causal self-attention,
an MLP, a weight-tied head, ``forward(idx, targets=None) -> (logits, loss)``, ``configure_optimizers`` and
``generate``. The loop is the usual one (cosine learning rate with warm-up, gradient accumulation, clipping,
periodic evaluation, a checkpoint, sampling), with the work autocastfx's step owns taken out of it. The corpus
is built by the script (sentences from a small grammar, a few KB): nothing is downloaded.

    python examples/train_nanogpt.py [--iters 200] [--accum 2] [--out nanogpt_out] [--resume-check]

``--resume-check`` builds a fresh model from the checkpoint written half-way, trains it to the end and compares
its losses with the uninterrupted run's, bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx


# ----------------------------------------------------------------------------------------------- the model
@dataclasses.dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    bias: bool = False  # no biases in the linears and layer norms: a little faster, as good


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: one tensor under two names
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections scaled down by depth (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Parameters counted once (the tied head is the token embedding); without the position table by default."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} tokens, block size {self.config.block_size}"
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # sampling: the last position's logits only
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW with weight decay on the matrices (matmul weights, embeddings) and none on gains and biases."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens, the context cropped to the block size."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ----------------------------------------------------------------------------------------------- the data
def corpus(n_sentences=250, seed=0) -> str:
    """Sentences from a small grammar: regular enough for a two-layer model to learn in a few dozen steps."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the king", "a small bird", "the farmer"]
    verbs = ["sees", "finds", "follows", "paints", "calls", "keeps", "loves"]
    objects = ["the river", "a red apple", "the moon", "an open door", "the green hill", "a letter"]
    tails = ["at night", "every morning", "in the rain", "near the sea", "without a word", ""]
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(subjects), rng.choice(verbs), rng.choice(objects), rng.choice(tails)]
        lines.append(" ".join(w for w in words if w) + rng.choice([".", ".", "!", "?"]))
    return "\n".join(lines) + "\n"


class Chars:
    """Character-level tokenizer over the corpus's characters."""

    def __init__(self, text: str):
        self.itos = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids)


def get_batch(data: torch.Tensor, block_size: int, batch_size: int, gen: torch.Generator):
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


# ----------------------------------------------------------------------------------------------- training
def get_lr(it, args):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    ratio = min(1.0, (it - args.warmup) / max(1, args.iters - args.warmup))
    return args.lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


@torch.no_grad()
def estimate_loss(gm, splits, args):
    """Mean loss over ``eval_iters`` batches of each split, in eval mode (no dropout); the same batches each time."""
    gm.eval()
    out = {}
    for name, data in splits.items():
        gen = torch.Generator().manual_seed(1234)
        losses = [float(gm(*get_batch(data, args.block_size, args.batch_size, gen))[1]) for _ in range(args.eval_iters)]
        out[name] = sum(losses) / len(losses)
    gm.train()
    return out


def build(cfg: GPTConfig, args, example, state=None):
    """The model, converted once, its own optimizer, and autocastfx's step. ``state``: a checkpoint to resume."""
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    if state is not None:
        model.load_state_dict(state["model"])  # the float32 model: it loads into the model as written
    # the example carries targets, so the branch of forward() that computes the loss is the one converted; from
    # (idx,) alone it would be the sampling branch, forward(idx), and the step would refuse (idx, targets)
    gm = autocastfx.convert(model, example, dtype=torch.bfloat16)
    opt = gm.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95))  # the model's own method, on gm
    step = autocastfx.train_step(gm, lambda out: out[1], opt,  # the model returns its loss: out = (logits, loss)
                                 accum_steps=args.accum, clip_grad_norm=args.clip)
    # the optimizer holds gm's parameters, the model's own float32 tensors (the graph casts them to bfloat16)
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    if state is not None:
        step.load_state_dict(state["step"])  # optimizer moments, loss-scale state, RNG: bit for bit
    return model, gm, opt, step


def train(gm, opt, step, data, args, start=0, gen=None, ckpt=None, log=print):
    """Iterations ``start .. args.iters - 1``; returns each iteration's mean micro-batch loss and the evals.
    The step does the backward, the division by ``accum``, unscaling, clipping, ``opt.step()`` and freeing the
    gradients; the loop keeps the schedule, the data and the evaluation."""
    losses, evals = [], []
    for it in range(start, args.iters):
        lr = get_lr(it, args)
        for group in opt.param_groups:
            group["lr"] = lr
        if it % args.eval_interval == 0 or it == args.iters - 1:
            ev = estimate_loss(gm, data, args)
            evals.append((it, ev))
            log(f"iter {it:4d}  train {ev['train']:.4f}  val {ev['val']:.4f}")
        if ckpt is not None and it == args.ckpt_at:
            torch.save({"model": gm.state_dict(), "step": step.state_dict(), "iter": it,
                        "data_rng": gen.get_state(), "config": dataclasses.asdict(gm.config)}, ckpt)
            log(f"iter {it:4d}  checkpoint {ckpt}")
        micro = []
        for _ in range(args.accum):  # accum_steps=args.accum: the update runs on the last of these calls
            x, y = get_batch(data["train"], args.block_size, args.batch_size, gen)
            micro.append(step((x, y)))  # inputs (idx, targets); the loss is the model's own
        losses.append(float(sum(micro)) / args.accum)
        if it % args.log_interval == 0:
            log(f"iter {it:4d}  loss {losses[-1]:.4f}  lr {lr:.2e}  grad norm {float(step.stats.grad_norm):.3f}")
    return losses, evals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="optimizer updates")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per update (accum_steps)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm (by the step, after unscaling)")
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=4)
    ap.add_argument("--log-interval", type=int, default=50)
    ap.add_argument("--ckpt-at", type=int, default=None, help="iteration to checkpoint (default: half-way)")
    ap.add_argument("--resume-check", action="store_true", help="resume from the checkpoint and compare the losses")
    ap.add_argument("--sample-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (toy sizes: one is fastest)")
    ap.add_argument("--out", default="nanogpt_out")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.ckpt_at is None:
        args.ckpt_at = args.iters // 2
    log = (lambda *_: None) if args.quiet else print
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="autocastfx")  # the conversion's notes on what runs in float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt.pt"

    text = corpus()
    chars = Chars(text)
    ids = chars.encode(text)
    n = int(0.9 * len(ids))
    data = {"train": ids[:n], "val": ids[n:]}
    cfg = GPTConfig(block_size=args.block_size, vocab_size=len(chars.itos), n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    gen = torch.Generator().manual_seed(args.seed)
    example = get_batch(data["train"], args.block_size, args.batch_size, torch.Generator().manual_seed(0))

    t0 = time.perf_counter()
    model, gm, opt, step = build(cfg, args, example)
    t_convert = time.perf_counter() - t0
    log(f"{len(text)} characters, vocabulary {len(chars.itos)}; {gm.get_num_params() / 1e3:.1f}k parameters; "
        f"converted in {t_convert:.2f} s")
    t0 = time.perf_counter()
    losses, evals = train(gm, opt, step, data, args, gen=gen, ckpt=ckpt, log=log)
    t_train = time.perf_counter() - t0
    log(f"{args.iters} updates in {t_train:.2f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
        f"{step.stats.summary()}")

    result = {"losses": losses, "evals": evals, "gm": gm, "model": model, "step": step, "optimizer": opt,
              "config": cfg, "chars": chars, "ckpt": ckpt, "example": example,
              "times": {"convert": t_convert, "train": t_train}}

    if args.resume_check:
        state = torch.load(ckpt, weights_only=True)
        _, gm2, opt2, step2 = build(GPTConfig(**state["config"]), args, example, state=state)
        gen2 = torch.Generator()
        gen2.set_state(state["data_rng"])
        resumed, _ = train(gm2, opt2, step2, data, args, start=state["iter"], gen=gen2,
                           log=lambda *_: None)
        same = resumed == losses[state["iter"]:]
        log(f"resumed at iteration {state['iter']}: {len(resumed)} losses {'identical' if same else 'DIFFER'}")
        result.update(resumed=resumed, resume_identical=same)

    # sampling, through the model's own generate(). gm was converted for the call (idx, targets): the loss branch.
    # generate() calls self(idx), the targets=None branch: gm converts itself for that call on its first use and
    # runs it on the same weights (the trained ones: no copy, nothing to load)
    t0 = time.perf_counter()
    sampler = gm
    sampler.eval()
    torch.manual_seed(args.seed)
    start = chars.encode("the ").unsqueeze(0)
    sample = sampler.generate(start, args.sample_tokens, temperature=0.8, top_k=10)
    result["times"]["sample"] = time.perf_counter() - t0
    gm.train()  # the loop's module back in training mode
    result.update(sampler=sampler, sample=sample)
    log("sample:\n" + chars.decode(sample[0].tolist()))
    return result


if __name__ == "__main__":
    main()
