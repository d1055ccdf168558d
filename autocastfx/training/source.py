"""The source text of the generated training step, built from plain data: the step's options, nothing it holds.

:func:`step_source` writes the Python function ``train_step(inputs, *targets)`` that :class:`TrainStep`
(autocastfx.training.step) compiles and runs; ``print(step.code)`` shows its result. Only the branches the options
need are written, and the comments number the parts that are. The text names what the step puts in the namespace
it runs the function in (``self``, ``model``, ``loss_fn``, ``optimizer``, ``S`` the scale state, ``P`` the
``parallel`` object, ``_call``, ``check_loss``): this module only writes it, and imports nothing that runs it.
"""
from __future__ import annotations

import dataclasses
import itertools
import textwrap
from typing import Callable, Iterator

from .scaling import ScalerConfig

_PARALLEL_NOTE = {"ddp": ", DistributedDataParallel", "fsdp": ", FSDP2"}


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """What the generated source depends on: the options the step was built with, and what it found.

    ``kind`` and ``distributed`` are the ``parallel`` object's (``"local"``, ``"ddp"`` or ``"fsdp"``); ``fused`` whether the optimizer
    skips an overflowing update on the device (else the step reads ``found_inf`` on the host); ``heap`` what the
    step did with the CPU allocator (autocastfx.training.heap), None off the CPU."""
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


def step_source(o: SourceOptions) -> str:
    """The source of ``train_step(inputs, *targets)`` for these options, ending in a newline.

    Its parts, each written only where the options need it: the micro-batch bookkeeping of accumulation, the
    retry loop, forward and backward, the fused unscale and overflow check, clipping, the optimizer step, the
    scale update."""
    lines: list[str] = []
    add = lines.append
    section = itertools.count(1)  # the comments number the parts the options emit
    add("def train_step(inputs, *targets):")
    add(f'    """One mixed-precision training step: {describe(o)}."""')
    ind = _accumulation_head(o, add)
    if o.retry:
        add(f"    for attempt in range({o.max_retries + 1}):")
        ind = "        "
    _forward_backward(o, add, ind, section)
    if o.accum_steps > 1:
        add("    self.micro += 1")
        add("    if not last:")
        add("        return loss.detach()")
        ind = "    "
    add(f"{ind}with torch.no_grad():")
    ind2 = ind + "    "
    _unscale_and_check(o, add, ind2, section)
    if o.retry:
        ind, ind2 = _retry_on_overflow(o, add, ind)
    _update(o, add, ind2, section)
    add(f"{ind}return loss.detach()")
    return textwrap.dedent("\n".join(lines)) + "\n"


def describe(o: SourceOptions) -> str:
    """The options in words, for the generated function's docstring."""
    cfg = o.scaler
    init = "auto" if cfg.auto else f"{cfg.init_scale:g}"
    return (f"loss scale {cfg.mode}" + (f" (init {init})" if o.scaled else "")
            + (f", hysteresis {cfg.hysteresis}" if o.dynamic and cfg.hysteresis > 1 else "")
            + (f", {o.accum_steps} micro-batches per update" if o.accum_steps > 1 else "")
            + (f", clip grad norm {o.clip:g}" if o.clip is not None else "")
            + (", retry on overflow" if o.retry else "")
            + _PARALLEL_NOTE.get(o.kind, "")
            + (f"; {o.heap}" if o.heap else ""))


# Each part below writes its lines through ``add`` at the indentation it is given; ``section`` numbers the parts.
def _accumulation_head(o: SourceOptions, add: Callable[[str], None]) -> str:
    """With accumulation, whether this micro-batch is the last of its update (and, across processes, gradient
    sync on that one only). Returns the indentation of the body that follows."""
    if o.accum_steps > 1:
        add(f"    last = self.micro % {o.accum_steps} == {o.accum_steps - 1}  # host counter: no device read")
        if o.distributed:
            add("    with P.sync(last):  # gradient all-reduce / reduce-scatter on the last micro-batch only")
            return "        "
    return "    "


def _forward_backward(o: SourceOptions, add: Callable[[str], None], ind: str, section: Iterator[int]) -> None:
    """The forward (the graph casts the weights), the loss in float32, and the backward of the scaled loss."""
    accum = o.accum_steps
    add(f"{ind}# {next(section)}. forward: the graph casts the float32 parameters; the loss in float32")
    add(f"{ind}out = _call(model, inputs)")
    add(f"{ind}loss = check_loss(loss_fn(out, *targets)).float()  # one float number connected to the weights")
    add(f"{ind}# {next(section)}. backward of loss * scale" + (f" / {accum}" if accum > 1 else ""))
    factor = "S.scale" if o.scaled else None
    if accum > 1:
        factor = f"(S.scale / {accum})" if o.scaled else f"(1.0 / {accum})"
    add(f"{ind}({'loss * ' + factor if factor else 'loss'}).backward()")


def _unscale_and_check(o: SourceOptions, add: Callable[[str], None], ind2: str, section: Iterator[int]) -> None:
    """The float32 gradients unscaled and checked for inf/NaN in one fused pass; one decision for every process where there are several; with retry, the host read that decides on a retry."""
    add(f"{ind2}# {next(section)}. float32 gradients" + (" unscaled and" if o.scaled else "")
        + " checked for inf/NaN in one fused pass")
    grads = "[p.grad for p in self.all_params if p.grad is not None]"
    if o.sharded:
        grads = f"P.locals({grads})"  # the shards' local tensors: the kernels below take plain ones
    add(f"{ind2}grads = {grads}")
    add(f"{ind2}S.found_inf.zero_()")
    add(f"{ind2}torch._amp_foreach_non_finite_check_and_unscale_(grads, S.found_inf, S.inv_scale)")
    if o.distributed:
        add(f"{ind2}P.all_reduce_max(S.found_inf)  # one skip decision on every rank")
    if o.retry:
        add(f"{ind2}overflow = bool(S.found_inf)  # retry needs this one host read per attempt")


def _retry_on_overflow(o: SourceOptions, add: Callable[[str], None], ind: str) -> tuple[str, str]:
    """The end of a retry attempt: out of the loop unless it overflowed (and attempts are left), else the scale
    lowered and the gradients dropped for the next attempt. Returns the indentations of the update that follows."""
    add(f"{ind}if not overflow or attempt == {o.max_retries}:")
    add(f"{ind}    break")
    add(f"{ind}with torch.no_grad():  # redo the batch at the lowered scale")
    add(f"{ind}    S.record()")
    add(f"{ind}    S.update_dynamic()")
    add(f"{ind}    for p in self.all_params:")
    add(f"{ind}        p.grad = None")
    ind, ind2 = "    ", "        "
    add(f"{ind}with torch.no_grad():")
    return ind, ind2


def _update(o: SourceOptions, add: Callable[[str], None], ind2: str, section: Iterator[int]) -> None:
    """The update: clipping, the optimizer step (skipped on overflow), the gradients freed, and the scale
    update."""
    if o.clip is not None:
        _clip(o, add, ind2, section)
    _optimizer_step(o, add, ind2, section)
    _scale_update(o, add, ind2, section)


def _clip(o: SourceOptions, add: Callable[[str], None], ind2: str, section: Iterator[int]) -> None:
    """Clipping by global norm, after unscaling, into the step's own norm tensor (no host read)."""
    add(f"{ind2}# {next(section)}. clip by global norm, after unscaling (no host read)")
    if o.sharded:
        add(f"{ind2}self.grad_norm.copy_(P.grad_norm(grads))  # over every shard of every rank")
        add(f"{ind2}torch._foreach_mul_(grads, torch.clamp({o.clip!r} / (self.grad_norm + 1e-6), max=1.0))")
    else:
        add(f"{ind2}self.grad_norm.copy_(torch.nn.utils.clip_grad_norm_(self.optimizer_params, {o.clip!r}, "
            "foreach=True))  # one tensor for the step's life: stats and a CUDA graph keep reading it")


def _optimizer_step(o: SourceOptions, add: Callable[[str], None], ind2: str, section: Iterator[int]) -> None:
    """The optimizer step, skipped on overflow (on the device where the kernel is fused), and every gradient
    freed."""
    add(f"{ind2}# {next(section)}. optimizer step on the float32 parameters, skipped on overflow")
    if o.fused:
        add(f"{ind2}optimizer.grad_scale, optimizer.found_inf = None, S.found_inf  # fused kernel skips on the device")
        add(f"{ind2}optimizer.step()")
    else:
        add(f"{ind2}if not bool(S.found_inf):  # this optimizer has no fused kernel: one host read to skip")
        add(f"{ind2}    optimizer.step()")
    add(f"{ind2}for p in self.all_params:  # gradients freed: the next backward writes, not adds")
    add(f"{ind2}    p.grad = None")


def _scale_update(o: SourceOptions, add: Callable[[str], None], ind2: str, section: Iterator[int]) -> None:
    """The scale update on the device; with ``init_scale="auto"``, the first update picks the scale."""
    add(f"{ind2}# {next(section)}. scale update on the device" + ("; the stuck-at-min_scale flag too, read later by "
                                                                 "the host without a sync" if o.dynamic else ""))
    add(f"{ind2}S.record()")
    if o.dynamic and o.scaler.auto:
        add(f"{ind2}if S.auto_pending:  # first update: the largest safe power of two for these gradients")
        add(f"{ind2}    S.update_auto(grads)")
        add(f"{ind2}else:")
        add(f"{ind2}    S.update_dynamic()")
    elif o.dynamic:
        add(f"{ind2}S.update_dynamic()")


__all__ = ["SourceOptions", "step_source", "describe"]
