"""The training step across processes: DistributedDataParallel and FSDP2, sharding, distributed checkpoints.

The generated step (autocastfx.step) asks three questions that only the data-parallel wrapper can answer, and
:class:`autocastfx.step.Local` answers them for one process:

- *what is a master here*: under DDP the full float32 masters of ``convert()``; under FSDP2 each master is
  sharded exactly like its low-precision weight (a DTensor with the weight's mesh and placements), so that no
  rank holds a full float32 copy; with :func:`shard` the sharded float32 parameter is its own master.
- *one skip decision*: ``found_inf`` is reduced (MAX) over the processes before the optimizer reads it, and so
  is the first update's gradient maximum that ``init_scale="auto"`` turns into a scale; every rank skips, or
  steps, together. Gradient norms for clipping are summed over the shards.
- *gradient sync on the last micro-batch only*: ``no_sync()`` under DDP, ``set_requires_gradient_sync(False)``
  under FSDP2, for every micro-batch of an accumulation cycle but the last.

Everything here is device-side: the reductions are collectives on device tensors, no value is read by the host.

:func:`shard` applies the policy that makes FSDP2 and mixed precision fit together: every parameter stays a
float32 shard (the master), FSDP2 casts the shard to the low dtype before the all-gather (half the bytes of a
float32 all-gather) and reduces gradients in float32; parameters the cast plan keeps in float32 (norms) are
gathered in float32 in a group of their own, so the kernels see what the plan promised. It shards a module
converted on the meta device too, before anything is allocated; the sharded module then loads the float32
model's full state dict, each rank copying its own slices (``autocastfx.materialize``: the large-model flow).

:func:`save_checkpoint` / :func:`load_checkpoint` write and read a step's whole state with
``torch.distributed.checkpoint``: float32 weights, buffers, optimizer state and scaler state keyed by the
model's parameter names, each rank writing its shards. The same checkpoint loads on any number of ranks, and into
one process.
"""
from __future__ import annotations


import torch.nn as nn

from .step import DYNAMIC, TrainStep, converted_units
from .parallel import parallel_for



# ------------------------------------------------------------------------------------------ the wrappers


# ------------------------------------------------------------------------------------------------ shard


# ----------------------------------------------------------------------------------------- checkpoints


# ------------------------------------------------------------------------------------------ the factory

def train_step(gm, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
               backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
               max_retries=8, accum_steps=1, clip_grad_norm=None, cuda_graph: bool = False,
               keep_cpu_memory: bool = True):
    """A generated, loss-scaled training step for a converted module (see autocastfx.step).

    The step owns backward, ``/ accum_steps``, unscaling, clipping, ``optimizer.step()`` on the float32 masters
    (the optimizer's groups are re-pointed at them, ``fused=True`` where it has a fused kernel) and freeing the
    gradients: the loop keeps the data, the learning rate (``group["lr"]`` or a scheduler on ``optimizer``),
    ``gm.eval()``/``gm.train()`` and checkpoints (``gm.state_dict()`` or ``step.state_dict()``); no
    ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()`` or ``zero_grad()`` of its own.
    ``torch.compile(gm)`` and ``gm.compile()`` are taken as ``gm``.

    ``gm``: the module ``convert()`` returned, DistributedDataParallel around it, or that module sharded with
    FSDP2 (``fully_shard`` on its blocks and then on it, or :func:`shard`).
    Call it as ``step(inputs, *targets)``: ``inputs`` is a tensor, a tuple of positional inputs or a dict of
    keyword inputs; the loss is ``loss_fn(output, *targets)``, with zero or more targets (a model that computes
    its own loss from ``labels=``: ``loss_fn=lambda out: out.loss`` and ``step({"input_ids": ids, "labels": y})``).
    ``loss_scale``: "dynamic" (default for float16), a number for a static scale, or None (off; the default
    for bfloat16). ``init_scale``: "auto" (default: the first update runs at scale 1, is applied, and the scale
    jumps to the largest power of two, at most 2^16, that keeps its gradients 8x under the float16 maximum, all
    on the device), or the first dynamic scale as a number (GradScaler's 2^16). Dynamic scaling grows by
    ``growth_factor`` after ``growth_interval`` clean steps and backs off by ``backoff_factor`` after
    ``hysteresis`` consecutive overflows; every overflowing step is skipped.
    ``on_overflow="retry"`` redoes the batch at the lowered scale up to ``max_retries`` times.
    ``accum_steps``: call the step once per micro-batch; the update happens on every ``accum_steps``-th call
    (under DDP and FSDP2 gradients are synchronised on that call only).
    ``clip_grad_norm``: clip by the global norm (over every shard of every rank).
    ``keep_cpu_memory``: on the CPU, glibc is told once per process to keep freed memory for the next step
    instead of handing it back and faulting it in again (``autocastfx.training.heap``: 5-10% of a ResNet-50 step
    here; the process's resident memory stays at its peak). False leaves the allocator alone; the step's docstring
    (``print(step.code)``) says which.
    ``cuda_graph=True``: the step captured and replayed as one CUDA graph (``autocastfx.graphed.CudaGraphStep``;
    one process: DDP and FSDP2 are refused before anything changes).
    """
    from . import graphed
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph and on_overflow == "retry":
        raise ValueError("cuda_graph=True cannot be combined with on_overflow='retry': retrying reads the overflow "
                         "flag on the host, which a replayed CUDA graph cannot do. Use on_overflow='skip' (the "
                         "default) with cuda_graph=True, or keep retry without the graph")
    if cuda_graph:
        graphed.refuse_before_building(gm, optimizer, on_overflow)  # before the optimizer is re-pointed and fused
    parallel = parallel_for(gm) if isinstance(gm, nn.Module) else None
    step = TrainStep(gm, loss_fn, optimizer, parallel=parallel, loss_scale=loss_scale, init_scale=init_scale,
                     growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
                     min_scale=min_scale, hysteresis=hysteresis, on_overflow=on_overflow, max_retries=max_retries,
                     accum_steps=accum_steps, clip_grad_norm=clip_grad_norm, keep_cpu_memory=keep_cpu_memory)
    return graphed.CudaGraphStep(step) if cuda_graph else step


__all__ = ["train_step", "parallel_for", "converted_units"]
