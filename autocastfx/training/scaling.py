"""Loss-scale state kept on the device: static or dynamic scaling, growth, back-off, hysteresis and history.
``poll()`` reads a host copy of the "stuck at min_scale" flag one step late, so ``LossScaleError`` comes without a
device sync.
"""
from __future__ import annotations

import dataclasses
import math

import torch

HISTORY = 1024  # steps of overflow and scale history kept on the device (a ring buffer)
# init_scale="auto" keeps the first update's largest gradient AUTO_MARGIN times under the low dtype's maximum, and
# starts no higher than AUTO_MAX_SCALE (dynamic scaling grows above it).
AUTO_MARGIN = 2.0**3
AUTO_MAX_SCALE = 2.0**16


class LossScaleError(FloatingPointError):
    """The loss scale reached its minimum and gradients still overflow."""


@dataclasses.dataclass
class ScalerConfig:
    mode: str                   # "dynamic" | "static" | "off"
    init_scale: float | str = 2.0**16   # a number, or "auto" (dynamic only)
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    hysteresis: int = 1
    low_max: float = 65504.0    # the low dtype's largest finite value: what "auto" keeps gradients under

    def __post_init__(self):
        if self.mode not in ("dynamic", "static", "off"):
            raise ValueError(f"loss scale mode {self.mode!r}")
        if isinstance(self.init_scale, str):
            if self.init_scale != "auto":
                raise ValueError(f"init_scale must be a positive number or 'auto', got {self.init_scale!r}")
            if self.mode == "static":
                raise ValueError("init_scale='auto' goes with loss_scale='dynamic'; a static scale is the number "
                                 "given as loss_scale")
        elif isinstance(self.init_scale, bool) or not isinstance(self.init_scale, (int, float)) \
                or not self.init_scale > 0 or not math.isfinite(self.init_scale):
            raise ValueError(f"init_scale must be a positive number or 'auto', got {self.init_scale!r}")
        if self.mode == "dynamic":
            if not self.growth_factor > 1:
                raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
            if not 0 < self.backoff_factor < 1:
                raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
            if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
                raise ValueError(f"growth_interval must be a positive int, got {self.growth_interval!r}")
            if not (isinstance(self.hysteresis, int) and self.hysteresis >= 1):
                raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}")
            if not 0 < self.min_scale <= (AUTO_MAX_SCALE if self.auto else self.init_scale):
                raise ValueError(f"min_scale must be in (0, init_scale], got {self.min_scale}")

    @property
    def auto(self) -> bool:
        return self.init_scale == "auto"

    @property
    def first_scale(self) -> float:
        """The scale of the first step; "auto" probes at 1 (or min_scale if higher)."""
        if self.mode == "off":
            return 1.0
        return max(1.0, self.min_scale) if self.auto else float(self.init_scale)


class ScaleState:
    """Device tensors: scale, growth tracker, hysteresis left, counters, ring-buffer history."""

    def __init__(self, cfg: ScalerConfig, device: torch.device, reduce_max=None):
        self.cfg = cfg
        self.reduce_max = reduce_max  # across processes: every rank must pick the same "auto" scale
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.scale = torch.full((), cfg.first_scale, **f32)
        self.inv_scale = self.scale.double().reciprocal().float()
        self.growth_tracker = torch.zeros((), **i32)
        self.hysteresis_left = torch.full((), cfg.hysteresis, **i32)
        self.found_inf = torch.zeros((), **f32)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.stuck = torch.zeros((), dtype=torch.bool, device=device)
        self.overflow_history = torch.zeros(HISTORY, dtype=torch.bool, device=device)
        self.scale_history = torch.zeros(HISTORY, **f32)
        self.auto_pending = cfg.auto and cfg.mode == "dynamic"  # host flag: the first update sets the scale
        # the host's view of `stuck`: the flag itself on the CPU, else a pinned copy each update refreshes
        self.stuck_host = None if device.type == "cpu" else torch.zeros(
            (), dtype=torch.bool, pin_memory=device.type == "cuda")
        self._stuck_view = (self.stuck if self.stuck_host is None else self.stuck_host).numpy()
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if device.type == "cuda" else None
        self._recorded = [False, False]
        self._turn = 0

    # --- the update, all on the device (runs every step)
    def record(self) -> None:
        """Count the step and write it to the history (after found_inf is final, before the scale moves)."""
        flag = self.found_inf > 0
        idx = self.steps % HISTORY
        self.overflow_history.index_put_((idx,), flag)
        self.scale_history.index_put_((idx,), self.scale)
        self.skipped.add_(flag)
        self.steps.add_(1)

    def _note_stuck(self) -> None:
        # stuck: an overflow although the scale already is at its minimum (sticky; poll() and check() read it)
        self.stuck.logical_or_((self.found_inf > 0).logical_and_(self.scale <= self.cfg.min_scale))
        if self.stuck_host is not None:
            self.stuck_host.copy_(self.stuck, non_blocking=self._events is not None)

    def back_off(self) -> None:
        """The scale lowered now, whatever the hysteresis: a batch that overflowed is redone at it
        (``on_overflow="retry"``)."""
        cfg = self.cfg
        self._note_stuck()
        self.scale.mul_(cfg.backoff_factor).clamp_(min=cfg.min_scale)
        self.growth_tracker.zero_()
        self.hysteresis_left.fill_(cfg.hysteresis)
        torch.reciprocal(self.scale, out=self.inv_scale)

    def update_dynamic(self) -> None:
        cfg = self.cfg
        self._note_stuck()
        if cfg.hysteresis == 1:
            torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, cfg.growth_factor,
                                     cfg.backoff_factor, cfg.growth_interval)
        else:
            overflow = self.found_inf > 0
            left = torch.where(overflow, self.hysteresis_left - 1, torch.full_like(self.hysteresis_left, cfg.hysteresis))
            back_off = overflow & (left <= 0)
            tracker = torch.where(overflow, torch.zeros_like(self.growth_tracker), self.growth_tracker + 1)
            grow = tracker >= cfg.growth_interval
            new_scale = torch.where(back_off, self.scale * cfg.backoff_factor,
                                    torch.where(grow, self.scale * cfg.growth_factor, self.scale))
            self.scale.copy_(new_scale)
            self.growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
            self.hysteresis_left.copy_(torch.where(back_off, torch.full_like(left, cfg.hysteresis), left))
        self.scale.clamp_(min=cfg.min_scale)
        torch.reciprocal(self.scale, out=self.inv_scale)  # exact: scales are powers of two

    def amax(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The largest gradient magnitude over ``grads`` (and over every process where there are several)."""
        if grads:
            dense = [g._values() if g.is_sparse else g for g in grads]  # a sparse gradient: its values
            amax = torch.stack(torch._foreach_norm(dense, float("inf"))).max().float()
        else:
            amax = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        if self.reduce_max is not None:
            self.reduce_max(amax)
        return amax

    def update_auto(self, amax: torch.Tensor) -> None:
        """The first update of init_scale="auto": the usual update, then (unless it overflowed) a jump to the
        largest power of two keeping gradients of magnitude ``amax`` AUTO_MARGIN times under the low dtype's
        maximum."""
        self.update_dynamic()
        cfg = self.cfg
        safe = torch.exp2(torch.floor(torch.log2(cfg.low_max / (amax * AUTO_MARGIN))))
        safe = safe.clamp_(min=cfg.min_scale, max=AUTO_MAX_SCALE)
        self.scale.copy_(torch.where(self.found_inf > 0, self.scale, safe))
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.auto_pending = False

    # --- host reads
    def poll(self) -> None:
        """Raise LossScaleError if a finished step found the scale stuck; on CUDA it waits for the previous step
        only."""
        if self.cfg.mode != "dynamic":
            return
        if self._events is not None:
            now, before = self._turn, self._turn ^ 1
            self._events[now].record(torch.cuda.current_stream(self.scale.device))
            self._recorded[now] = True
            self._turn = before
            if not self._recorded[before]:
                return
            self._events[before].synchronize()
        if bool(self._stuck_view):
            self._raise()

    def check(self) -> None:
        """Read the device flag now (one host sync) and raise LossScaleError if the scale is stuck."""
        if self.cfg.mode == "dynamic" and bool(self.stuck):
            self._raise()

    def _raise(self) -> None:
        raise LossScaleError(
            f"gradients still overflow with the loss scale at min_scale={self.cfg.min_scale}: the model "
            "produces inf/NaN that no scale can fix. Try: a lower learning rate or warm-up; gradient "
            "clipping (clip_grad_norm=1.0); autocastfx.calibrate() to move overflowing layers to float32; "
            "dtype=torch.bfloat16; or check the data and the loss for inf/NaN. Skipped updates left the "
            "weights untouched.")

    def state_dict(self) -> dict:
        sd = {k: getattr(self, k).clone() for k in ("scale", "growth_tracker", "hysteresis_left", "steps",
                                                     "skipped", "stuck", "overflow_history", "scale_history")}
        sd["auto_pending"] = self.auto_pending
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            if k != "auto_pending":
                getattr(self, k).copy_(v)
        self.auto_pending = bool(sd.get("auto_pending", False))
        self.inv_scale.copy_(self.scale.double().reciprocal().float())
        if self.stuck_host is not None:
            self.stuck_host.copy_(self.stuck)
