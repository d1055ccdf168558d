"""The training step's recipe, as plain Python over the step's frozen options; ``print(step.code)`` shows these
functions as written. Only ``on_overflow="retry"`` and a non-fused optimizer's skip read the device from the host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch

from .checks import check_loss
from .scaling import ScalerConfig

_PARALLEL_NOTE = {"ddp": ", DistributedDataParallel", "fsdp": ", FSDP2"}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The options the step was built with, and what it found: ``kind`` and ``distributed`` are the ``parallel``
    object's; ``fused`` whether the optimizer skips an overflowing update on the device; ``heap`` what the step
    did with the CPU allocator (training.heap), None off the CPU."""
    scaler: ScalerConfig
    accum_steps: int
    clip: float | None
    on_overflow: str
    max_retries: int
    kind: str
    distributed: bool
    fused: bool
    heap: str | None = None

    @property
    def dynamic(self) -> bool:
        return self.scaler.mode == "dynamic"

    @property
    def scaled(self) -> bool:
        return self.scaler.mode != "off"

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp"

    @property
    def retry(self) -> bool:
        return self.on_overflow == "retry"


def describe(o: StepOptions) -> str:
    """The options in words: the first line of ``step.code``."""
    cfg = o.scaler
    init = "auto" if cfg.auto else f"{cfg.init_scale:g}"
    return (f"loss scale {cfg.mode}" + (f" (init {init})" if o.scaled else "")
            + (f", hysteresis {cfg.hysteresis}" if o.dynamic and cfg.hysteresis > 1 else "")
            + (f", {o.accum_steps} micro-batches per update" if o.accum_steps > 1 else "")
            + (f", clip grad norm {o.clip:g}" if o.clip is not None else "")
            + (", retry on overflow" if o.retry else "")
            + (", fused optimizer (skips on the device)" if o.fused else ", optimizer skipped after one host read")
            + _PARALLEL_NOTE.get(o.kind, "")
            + (f"; {o.heap}" if o.heap else ""))


def train_step(step, inputs, *targets) -> torch.Tensor:
    """One mixed-precision training step on ``inputs``; returns the loss (a device tensor, not read)."""
    o, S = step.options, step.state
    if o.accum_steps > 1:
        last = step.micro % o.accum_steps == o.accum_steps - 1  # host counter: no device read
        sync = step.parallel.sync(last) if o.distributed else contextlib.nullcontext()
        with sync:  # gradient all-reduce / reduce-scatter on the last micro-batch only
            loss = forward_backward(step, inputs, targets)
        step.micro += 1
        if not last:
            return loss.detach()
        with torch.no_grad():
            update(step, *unscale_and_check(step))
        return loss.detach()
    buffers = [(b, b.clone()) for b in step.gm.buffers()] if o.retry else []
    for attempt in range(o.max_retries + 1 if o.retry else 1):
        loss = forward_backward(step, inputs, targets)
        with torch.no_grad():
            params, grads = unscale_and_check(step)
            if not o.retry or attempt == o.max_retries or not bool(S.found_inf):  # retry: one host read
                break
            S.record()  # redo the batch at the lowered scale, from the buffers it started with
            S.back_off()
            for p in params:
                p.grad = None
            for b, kept in buffers:
                b.copy_(kept)
    with torch.no_grad():
        update(step, params, grads)
    return loss.detach()


def forward_backward(step, inputs, targets: tuple) -> torch.Tensor:
    """The forward (the graph casts the float32 parameters), the loss in float32 (one number connected to the
    weights), and the backward of ``loss * scale / accum_steps``."""
    o, S = step.options, step.state
    out = step.call_model(step.model, inputs)
    loss = check_loss(step.loss_fn(out, *targets)).float()
    if o.scaled:
        (loss * (S.scale if o.accum_steps == 1 else S.scale / o.accum_steps)).backward()
    elif o.accum_steps > 1:
        (loss * (1.0 / o.accum_steps)).backward()
    else:
        loss.backward()
    return loss


def _values(grad: torch.Tensor) -> torch.Tensor:
    """What a gradient holds: a sparse one's values (an ``nn.Embedding(sparse=True)``'s, coalesced first so that
    a repeated index is one value, as GradScaler does), a dense one itself."""
    if not grad.is_sparse:
        return grad
    if not grad.is_coalesced():
        grad.data = grad.coalesce()
    return grad._values()


def unscale_and_check(step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The float32 gradients unscaled and checked for inf/NaN in one fused pass, into ``S.found_inf``; one skip
    decision on every process where there are several. Returns the trained parameters as they are now (a layer
    unfrozen or a param group added since the step was built included) and their gradients (under FSDP2, the
    local shards)."""
    o, S, P = step.options, step.state, step.parallel
    params = step.trained_params()
    grads = [p.grad for p in params if p.grad is not None]
    if o.sharded:
        grads = P.locals(grads)  # the shards' local tensors: the kernels below take plain ones
    S.found_inf.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_([_values(g) for g in grads], S.found_inf, S.inv_scale)
    if o.distributed:
        P.all_reduce_max(S.found_inf)
    return params, grads


def update(step, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Clipping, the optimizer step (skipped on overflow), every gradient freed, and the scale update."""
    o, S, P, optimizer = step.options, step.state, step.parallel, step.optimizer
    auto = o.dynamic and o.scaler.auto and S.auto_pending
    amax = S.amax(grads) if auto else None  # the gradients as they are, before clipping
    if o.clip is not None:  # by global norm, after unscaling, into the step's own norm tensor (no host read)
        if o.sharded:
            step.grad_norm.copy_(P.grad_norm(grads))  # over every shard of every rank
            torch._foreach_mul_(grads, torch.clamp(o.clip / (step.grad_norm + 1e-6), max=1.0))
        else:
            step.grad_norm.copy_(torch.nn.utils.clip_grad_norm_(params, o.clip, foreach=True))
    if o.fused and step.zero_new_momentum():  # the fused kernel skips on the device, as under GradScaler
        optimizer.grad_scale, optimizer.found_inf = None, S.found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not bool(S.found_inf):  # no fused kernel, or a damped SGD's first update: one host read to skip
        optimizer.step()
    for p in params:  # gradients freed: the next backward writes, not adds
        p.grad = None
    S.record()
    if auto:  # the largest safe power of two for these gradients
        S.update_auto(amax)
    elif o.dynamic:
        S.update_dynamic()


def code(o: StepOptions) -> str:
    """What ``step.code`` shows: the options in words, then the functions that run, as written."""
    parts = (train_step, forward_backward, unscale_and_check, update)
    return f"# train_step: {describe(o)}\n\n" + "\n\n".join(inspect.getsource(f) for f in parts)
