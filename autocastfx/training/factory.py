"""``train_step()``: the training step for a converted module in one process, under DDP or FSDP2, or as CUDA
graphs."""
from __future__ import annotations

import torch.nn as nn

from .parallel import parallel_for
from .step import DYNAMIC, TrainStep


def train_step(gm, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
               backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
               max_retries=8, accum_steps=1, clip_grad_norm=None, cuda_graph: bool = False):
    """A loss-scaled training step for a converted module, which trains the same float32 parameters a plain loop
    would; it owns backward, unscaling, clipping, ``optimizer.step()`` and freeing gradients, and the loop keeps the
    data, the learning rate, ``gm.eval()``/``gm.train()`` and checkpoints. Call it as ``step(inputs, *targets)``,
    with ``inputs`` a tensor, a tuple or a dict, and the loss ``loss_fn(output, *targets)``.

    Args:
        gm: the module ``convert()`` returned, ``torch.compile``d or not, DistributedDataParallel around it, or it
            sharded with FSDP2 (``fully_shard`` on its blocks and then on it, or :func:`shard`).
        loss_scale: "dynamic" (the default for float16), a number for a static scale, or None (off; the default
            for bfloat16 and float32 compute).
        init_scale: "auto" (the first update probes at scale 1, then the scale jumps to the largest safe power of
            two), or the first dynamic scale as a number.
        hysteresis: consecutive overflows before the scale backs off; every overflowing step is skipped.
        on_overflow: "skip", or "retry" to redo the batch at the lowered scale up to ``max_retries`` times.
        accum_steps: micro-batches per update; gradients are synchronised on the last only.
        clip_grad_norm: clip by the global norm (over every shard of every rank).
        cuda_graph: capture and replay the step as CUDA graphs (``CudaGraphStep``).

    Example::

        step = autocastfx.train_step(gm, F.cross_entropy, torch.optim.AdamW(gm.parameters(), fused=True))
        loss = step(x, y)
    """
    from . import graphed
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph and on_overflow == "retry":
        raise ValueError("cuda_graph=True cannot be combined with on_overflow='retry': retrying reads the overflow "
                         "flag on the host, which a replayed CUDA graph cannot do. Use on_overflow='skip' (the "
                         "default) with cuda_graph=True, or keep retry without the graph")
    if cuda_graph:
        graphed.refuse_before_building(gm, optimizer, on_overflow)  # before anything is built
    parallel = parallel_for(gm) if isinstance(gm, nn.Module) else None
    step = TrainStep(gm, loss_fn, optimizer, parallel=parallel, loss_scale=loss_scale, init_scale=init_scale,
                     growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
                     min_scale=min_scale, hysteresis=hysteresis, on_overflow=on_overflow, max_retries=max_retries,
                     accum_steps=accum_steps, clip_grad_norm=clip_grad_norm)
    return graphed.CudaGraphStep(step) if cuda_graph else step


__all__ = ["train_step", "parallel_for"]
