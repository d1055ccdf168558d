"""``train_step()``: autocastfx's step for a converted module in one process, under DistributedDataParallel,
or sharded with FSDP2 (training.parallel answers what depends on the wrapper), optionally as a CUDA graph."""
from __future__ import annotations

import torch.nn as nn

from .parallel import parallel_for
from .step import DYNAMIC, TrainStep


def train_step(gm, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
               backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
               max_retries=8, accum_steps=1, clip_grad_norm=None, cuda_graph: bool = False):
    """A loss-scaled training step for a converted module: the optional faster path beside a plain loop, which
    trains the same float32 parameters.

    The step owns backward, ``/ accum_steps``, unscaling, clipping, ``optimizer.step()`` on the float32 parameters
    and freeing the gradients; the loop keeps the data, the learning rate (``group["lr"]`` or a scheduler),
    ``gm.eval()``/``gm.train()`` and checkpoints (``gm.state_dict()`` or ``step.state_dict()``), and writes no
    ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()`` or ``zero_grad()``. An optimizer built with
    ``fused=True`` skips an overflowing update on the device, any other with one host read per update (as under
    ``GradScaler``); the optimizer's options stay the caller's. ``torch.compile(gm)`` and ``gm.compile()`` are
    taken as ``gm``.

    ``gm``: the module ``convert()`` returned, DistributedDataParallel around it, or that module sharded with
    FSDP2 (``fully_shard`` on its blocks and then on it, or :func:`shard`).
    Call it as ``step(inputs, *targets)``: ``inputs`` is a tensor, a tuple of positional inputs or a dict of
    keyword inputs; the loss is ``loss_fn(output, *targets)``, with zero or more targets (a model that computes
    its own loss from ``labels=``: ``loss_fn=lambda out: out.loss`` and ``step({"input_ids": ids, "labels": y})``).
    ``loss_scale``: "dynamic" (default for float16), a number for a static scale, or None (off; the default
    for bfloat16). ``init_scale``: "auto" (default: the first update runs at scale 1, is applied, and the scale
    jumps, on the device, to the largest power of two, at most 2^16, that keeps its gradients 8x under the float16
    maximum), or the first dynamic scale as a number (GradScaler's 2^16). Dynamic scaling grows by
    ``growth_factor`` after ``growth_interval`` clean steps and backs off by ``backoff_factor`` after
    ``hysteresis`` consecutive overflows; every overflowing step is skipped.
    ``on_overflow="retry"`` redoes the batch at the lowered scale up to ``max_retries`` times.
    ``accum_steps``: call the step once per micro-batch; the update happens on every ``accum_steps``-th call
    (under DDP and FSDP2 gradients are synchronised on that call only).
    ``clip_grad_norm``: clip by the global norm (over every shard of every rank).
    ``cuda_graph=True``: the step captured and replayed as a CUDA graph (``training.graphed.CudaGraphStep``; DDP and
    FSDP2 are refused before anything changes).
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
