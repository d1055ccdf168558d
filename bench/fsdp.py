"""Sharded training on 2 processes (gloo, CPU): per-rank bytes, collective bytes, host syncs and time per step of
each recipe, on the Llama-style model of examples/fsdp_train.py. Every figure is counted while the steps run.

    python bench/fsdp.py [--hidden 128] [--layers 4] [--steps 12] [--markdown out.md]

Recipes (AdamW, dynamic loss scaling, clipping at 1.0, the same global batch of 2 x 4 sequences per update):

- one process: autocastfx.convert + train_step, the whole global batch (the 1/N reference)
- DDP: DistributedDataParallel around the converted module
- FSDP2 float32: ``convert`` + ``fully_shard`` (every parameter float32 in the module, gathered in float32, cast
  inside the graph): the plain recipe
- FSDP2 shard(): ``autocastfx.shard`` (float32 shards, the weights the graph reads low gathered in float16,
  gradients reduced in float32)
- FSDP2 + torch.autocast + GradScaler: the float32 model under ``fully_shard``, ``torch.autocast("cpu",
  float16)``, ``torch.amp.GradScaler``: the recipe users have today

Bytes per rank: parameters (local shards; float32: there are no master copies beside them, the column stays 0),
gradients alive when the optimizer runs, optimizer state. Collective bytes: buffers handed to FSDP2's all-gather and reduce-scatter, or DDP's all-reduce, in one step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autocastfx  # noqa: E402

RECIPES = ["one process", "DDP", "FSDP2 float32", "FSDP2 shard()", "FSDP2 + autocast + GradScaler"]
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}
WORLD = 2


class Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in SYNC_OPS:
            self.n += 1
        return func(*args, **(kwargs or {}))


# the collectives FSDP2 calls, by this torch's names: all_gather_single and reduce_scatter_single where torch has
# them, all_gather_into_tensor and reduce_scatter_tensor before (torch 2.11)
GATHER, SCATTER = (("all_gather_single", "reduce_scatter_single") if hasattr(dist, "all_gather_single")
                   else ("all_gather_into_tensor", "reduce_scatter_tensor"))


class Collectives:
    """Bytes given to the collectives FSDP2 (``GATHER``, ``SCATTER``) and DDP (allreduce through
    its comm hook: counted from the gradient buckets) make."""

    def __init__(self):
        self.all_gather = self.reduce_scatter = self.all_reduce = 0

    def __enter__(self):
        self._ag, self._rs = getattr(dist, GATHER), getattr(dist, SCATTER)

        def ag(output, input, *a, **k):
            self.all_gather += output.numel() * output.element_size()
            return self._ag(output, input, *a, **k)

        def rs(output, input, *a, **k):
            self.reduce_scatter += input.numel() * input.element_size()
            return self._rs(output, input, *a, **k)
        setattr(dist, GATHER, ag)
        setattr(dist, SCATTER, rs)
        return self

    def __exit__(self, *exc):
        setattr(dist, GATHER, self._ag)
        setattr(dist, SCATTER, self._rs)


def nbytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def args_model(args):
    import fsdp_train
    ns = argparse.Namespace(model="tiny", vocab=args.vocab, hidden=args.hidden, heads=4, layers=args.layers,
                            context=args.context, batch_size=args.batch)
    return fsdp_train, ns


def run_recipe(recipe: str, rank: int, world: int, args) -> dict:
    from torch.distributed.fsdp import fully_shard
    fsdp_train, ns = args_model(args)
    torch.manual_seed(0)
    model = fsdp_train.build_model(ns)
    one = recipe == "one process"
    rows = lambda i: fsdp_train.batch(i, 0, 1, argparse.Namespace(**{**vars(ns), "batch_size": ns.batch_size * world})) \
        if one else fsdp_train.batch(i, rank, world, ns)
    x0, _ = rows(0)
    grads_seen, ddp_bytes = [], []
    if recipe == "FSDP2 + autocast + GradScaler":
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = fsdp_train.loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grads_seen.append(sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        held = lambda: {"parameters": sum(nbytes(p) for p in model.parameters()), "masters": 0}
        opt_of = opt
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = autocastfx.convert(model, (x0,))
        wrapped = gm
        if recipe == "DDP":
            wrapped = torch.nn.parallel.DistributedDataParallel(gm)
            wrapped.register_comm_hook(None, lambda _, bucket: (
                ddp_bytes.append(nbytes(bucket.buffer())),
                dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future().then(
                    lambda f: f.value()[0]))[1])
        elif recipe == "FSDP2 float32":
            fully_shard(gm)
        elif recipe == "FSDP2 shard()":
            autocastfx.shard(gm)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-3, fused=True)
        ts = autocastfx.train_step(wrapped, fsdp_train.loss_fn, opt, clip_grad_norm=1.0, init_scale=2.0**10)
        inner = opt.step

        def recording(*a, **k):
            alive = {id(p): p.grad for p in gm.parameters() if p.grad is not None}
            grads_seen.append(sum(nbytes(g) for g in alive.values()))
            return inner(*a, **k)
        opt.step = recording
        step = ts
        held = lambda: {"parameters": sum(nbytes(p) for p in gm.parameters()), "masters": 0}
        opt_of = opt
    times, losses = [], []
    step(*rows(0))  # warm-up: first signature checked, optimizer state made
    syncs = Syncs()
    for i in range(1, args.steps):
        x, y = rows(i)
        ddp_bytes.clear()
        with Collectives() as comm:
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            with syncs:
                loss = step(x, y)
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out = held()
    out["optimizer"] = sum(nbytes(v) for st in opt_of.state.values() for v in st.values()
                           if torch.is_tensor(v) and v.dim() > 0)
    out["gradients"] = max(grads_seen)
    out["total"] = out["parameters"] + out["masters"] + out["optimizer"] + out["gradients"]
    out["all_gather"] = comm.all_gather
    out["reduce_scatter"] = comm.reduce_scatter
    if recipe.startswith("FSDP2") and not (comm.all_gather and comm.reduce_scatter):
        raise RuntimeError(f"{recipe}: no bytes counted through dist.{GATHER}/dist.{SCATTER}: this torch's FSDP2 "
                           "calls other collectives, and Collectives must wrap those")
    out["all_reduce"] = sum(ddp_bytes)
    out["syncs_per_step"] = syncs.n / (args.steps - 1)
    out["ms_per_step"] = 1000 * statistics.median(times)
    out["last_loss"] = losses[-1]
    return out


def _worker(rank, init_file, out_dir, args):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for recipe in RECIPES[1:]:
            try:
                results[recipe] = run_recipe(recipe, rank, WORLD, args)
            except Exception as e:  # noqa: BLE001 - a recipe that fails is reported as such
                results[recipe] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank leaves while its peer still talks to it (an abort at exit otherwise)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(os.path.join(d, "init"), d, args), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(d, f"rank{i}.pt"), weights_only=False) for i in range(WORLD)]
    # the one-process reference, in this process, on the whole global batch
    ones = run_recipe("one process", 0, WORLD, args)
    rows = [("one process", ones)] + [(r, ranks[0][r]) for r in RECIPES[1:]]
    for r in RECIPES[1:]:  # the global batch's loss: the mean of the ranks' (equal halves)
        if "error" not in ranks[0][r]:
            ranks[0][r]["last_loss"] = (ranks[0][r]["last_loss"] + ranks[1][r]["last_loss"]) / 2
    ref = ones["total"]
    lines = [f"torch {torch.__version__}, {WORLD} processes (gloo, CPU, 1 thread each), Llama-style model "
             f"d={args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.batch}x{args.context} tokens per "
             f"rank, AdamW; bytes per rank (rank 0; rank 1 within padding)", "",
             "| recipe | parameters | masters | gradients | optimizer | total | / one process | all-gather B/step "
             "| reduce-scatter B/step | all-reduce B/step | host syncs/step | ms/step | global loss after "
             f"{args.steps} steps |", "|" + "---|" * 13]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | fails: {r['error']} |" + " |" * 11)
            continue
        lines.append(f"| {name} | {r['parameters']:,} | {r['masters']:,} | {r['gradients']:,} | {r['optimizer']:,} "
                     f"| {r['total']:,} | {r['total'] / ref:.3f} | {r['all_gather']:,} | {r['reduce_scatter']:,} | "
                     f"{r['all_reduce']:,} | {r['syncs_per_step']:g} | {r['ms_per_step']:.1f} | {r['last_loss']:.4f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
