"""Train a Llama-style language model sharded across processes with FSDP2 and autocastfx, entirely offline.

    torchrun --nproc_per_node 2 examples/fsdp_train.py                        # 2 processes: gloo on CPUs
    torchrun --nproc_per_node 8 examples/fsdp_train.py --model hf --dtype bf16  # 8 GPUs: NCCL
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d \\
             --rdzv_endpoint HOST:29500 examples/fsdp_train.py --model hf       # each of 2 machines

The model is a Hugging Face ``LlamaForCausalLM`` built from a config (``--model hf``: no download) or the small
Llama-style model written below (``--model tiny``, the default: it converts in a second). The text is a stream of
synthetic token patterns that a small model learns within a hundred steps.

What runs, on every rank: the flow for a model larger than one process's memory. No rank ever holds the whole
model: it is built and converted with shapes alone, sharded before anything is allocated, and each rank allocates
its own shards and reads its slices of the weights.

    with torch.device("meta"):
        model = build_model(args)                      # shapes only: nothing allocated
    gm = autocastfx.convert(model, (ids,))             # planned for the device of ids
    autocastfx.shard(gm)                               # FSDP2 units, still on meta
    weights = torch.load(path, mmap=True)              # the float32 model's state dict, memory-mapped
    autocastfx.materialize(gm, device, weights, buffers=...)   # each rank: its shards, its slices; rotary tables
    optimizer = torch.optim.AdamW(gm.parameters(), lr=..., fused=True)
    step = autocastfx.train_step(gm, loss_fn, optimizer, clip_grad_norm=1.0, accum_steps=...)
    loss = step(ids, targets)                          # each rank its own slice of the global batch
    autocastfx.save_checkpoint(step, dir)              # each rank writes its shards

``--weights PATH`` is the state dict to start from (``torch.save`` of the unconverted model's ``state_dict()``);
without it rank 0 writes the model's own initialisation (seed 0) to a temporary file first, standing in for a
pretrained checkpoint. ``--sharding fully_shard`` uses FSDP2's own ``fully_shard`` (every parameter gathered in
float32; the graph casts the weights it reads low) and ``--sharding ddp`` DistributedDataParallel, for comparison.
``--checkpoint DIR`` writes a distributed checkpoint (``autocastfx.save_checkpoint``) at the end, and
``--resume`` reads it in place of the weights; it loads on any number of processes.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autocastfx


# ---------------------------------------------------------------------------------------------- the model
class Layer(nn.Module):
    """A Llama decoder layer: RMSNorm, causal attention, RMSNorm, SwiGLU MLP, two residual additions."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.RMSNorm(d, eps=1e-6)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=1e-6)
        self.gate_proj = nn.Linear(d, 4 * d, bias=False)
        self.up_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, context: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def hf_config(args):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.context, use_cache=False, attn_implementation="sdpa")


def build_model(args):
    if args.model == "tiny":
        return TinyLlama(args.vocab, args.hidden, args.heads, args.layers, args.context)
    import transformers
    return transformers.LlamaForCausalLM(hf_config(args))


def tables(args) -> dict[str, torch.Tensor]:
    """The values of the model's non-persistent buffers, which no checkpoint holds (a Hugging Face Llama's
    rotary frequencies): small, computed on the CPU."""
    if args.model == "tiny":
        return {}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return {f"model.rotary_emb.{n}": b for n, b in LlamaRotaryEmbedding(config=hf_config(args)).named_buffers()}


def initial_weights(args, rank: int) -> str:
    """The file of float32 weights to start from: ``--weights``, or the model's own initialisation (seed 0)
    written by rank 0 to a temporary file, standing in for a pretrained checkpoint (with several machines, give
    ``--weights`` on a file system every rank reads)."""
    if args.weights:
        return args.weights
    shape = f"{args.model}-{args.vocab}-{args.hidden}-{args.heads}-{args.layers}-{args.context}"
    path = os.path.join(tempfile.gettempdir(), f"autocastfx-fsdp-train-{shape}.pt")
    if rank == 0:
        torch.manual_seed(0)
        tmp = f"{path}.{os.getpid()}"
        torch.save(build_model(args).state_dict(), tmp)
        os.replace(tmp, path)
    dist.barrier()
    return path


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def loss_fn(out, targets):
    logits = logits_of(out)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ----------------------------------------------------------------------------------------------- the data
def batch(step: int, rank: int, world: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of global batch ``step``: sequences that repeat a short random pattern, so the next token
    is predictable after one period. Every rank draws the same global batch and keeps its own rows."""
    g = torch.Generator().manual_seed(10_000 + step)
    rows = args.batch_size * world
    period = torch.randint(2, 6, (rows,), generator=g)
    pattern = torch.randint(0, args.vocab, (rows, 6), generator=g)
    idx = torch.arange(args.context + 1) % period[:, None]
    seq = pattern.gather(1, idx)
    mine = seq[rank * args.batch_size:(rank + 1) * args.batch_size]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------------ the run
def per_rank_bytes(step) -> dict[str, int]:
    """Bytes this process holds for the float32 parameters and the optimizer state (local shards only)."""
    def nbytes(t):
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()
    opt = sum(nbytes(v) for st in step.optimizer.state.values() for v in st.values()
              if torch.is_tensor(v) and v.dim() > 0)
    return {"parameters": sum(nbytes(p) for p in step.gm.parameters()), "optimizer": opt}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny", "hf"], default="tiny")
    p.add_argument("--sharding", choices=["shard", "fully_shard", "ddp"], default="shard")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process and micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per update")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--weights", default=None, help="float32 state dict to start from (torch.save of the model's "
                   "state_dict()); default: the model's initialisation, written to a temporary file by rank 0")
    p.add_argument("--checkpoint", default=None, help="directory for a distributed checkpoint, written at the end")
    p.add_argument("--resume", action="store_true", help="read --checkpoint before training")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        train(args, rank, world, device, cuda)
        # Every rank leaves together, and only after everything holding the process group (the sharded module,
        # the step, the optimizer) is gone: a rank that tears its connections down while its peer still holds
        # them can abort the peer at exit.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(args, rank, world, device, cuda):
    say = print if rank == 0 else (lambda *a, **k: None)
    ids, _ = batch(0, rank, world, args)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    path = None if args.resume else initial_weights(args, rank)  # resuming: the checkpoint has the weights
    with torch.device("meta"):
        model = build_model(args)  # shapes only, whatever the model's size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, (ids.to(device),), dtype=dtype)
    del model
    # memory-mapped: a rank reads the pages of its own slices, never a whole weight
    weights = torch.load(path, mmap=True, weights_only=True) if path else None
    if args.sharding == "shard":
        autocastfx.shard(gm)  # on meta: FSDP2's units made, nothing allocated
        autocastfx.materialize(gm, device, weights, buffers=tables(args))  # each rank: its shards, its slices
        wrapped = gm
    elif args.sharding == "fully_shard":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard
        for block in [m for n, m in gm.named_modules() if n and isinstance(getattr(m, "meta", None), dict)
                      and "autocastfx" in m.meta]:
            fully_shard(block)
        wrapped = fully_shard(gm)
        autocastfx.materialize(gm, device, buffers=tables(args))
        if weights is not None:  # torch's loader for FSDP2 modules: each rank keeps its slices
            set_model_state_dict(gm, dict(weights), options=StateDictOptions(full_state_dict=True))
    else:
        autocastfx.materialize(gm, device, weights, buffers=tables(args))  # every rank the whole model
        wrapped = nn.parallel.DistributedDataParallel(gm)
    optimizer = torch.optim.AdamW(gm.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    step = autocastfx.train_step(wrapped, loss_fn, optimizer, clip_grad_norm=1.0, accum_steps=args.accum)
    start = 0
    if args.resume:
        autocastfx.load_checkpoint(step, args.checkpoint)
        start = int(step.stats.steps) * args.accum
        say(f"resumed from {args.checkpoint} at update {int(step.stats.steps)}")
    say(f"{world} process(es), {'NCCL on CUDA' if cuda else 'gloo on CPU'}, {args.model} model, "
        f"{sum(p.numel() for p in gm.parameters()):,} parameters "
        f"({args.sharding}, {args.dtype})")
    t0, total = time.perf_counter(), args.steps * args.accum
    for i in range(start, total):
        x, y = batch(i, rank, world, args)
        loss = step(x.to(device), y.to(device))
        if (i + 1) % (args.log_every * args.accum) == 0 or i + 1 == total:
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global batch's loss, for the log
            s = step.stats.summary()
            say(f"update {(i + 1) // args.accum:4d}  loss {float(mean) / world:.4f}  scale {s['scale']:g}  "
                f"skipped {s['skipped']}  grad norm {s['grad_norm']:.3f}")
    elapsed = time.perf_counter() - t0
    held = per_rank_bytes(step)
    say(f"{(total - start) / max(elapsed, 1e-9):.1f} micro-batches/s; per rank: "
        + ", ".join(f"{k} {v:,} B" for k, v in held.items()))
    if args.checkpoint and not args.resume:
        autocastfx.save_checkpoint(step, args.checkpoint)
        say(f"checkpoint written to {args.checkpoint}")
    say(f"final loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
