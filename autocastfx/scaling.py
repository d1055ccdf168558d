"""Loss-scale state on the device: static or dynamic scaling, growth, back-off, hysteresis, history.

Every update is a tensor operation; nothing reads a value back to the host. ``check()`` is the one place that
does (on demand, or every ``check_every`` steps), to raise the "stuck at min_scale" error.
"""
from __future__ import annotations

import dataclasses

import torch

HISTORY = 1024  # steps of overflow and scale history kept on the device (a ring buffer)


class LossScaleError(FloatingPointError):
    """The loss scale reached its minimum and gradients still overflow."""


@dataclasses.dataclass
class ScalerConfig:
    mode: str                   # "dynamic" | "static" | "off"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    hysteresis: int = 1

    def __post_init__(self):
        if self.mode not in ("dynamic", "static", "off"):
            raise ValueError(f"loss scale mode {self.mode!r}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if self.mode == "dynamic":
            if not self.growth_factor > 1:
                raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
            if not 0 < self.backoff_factor < 1:
                raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
            if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
                raise ValueError(f"growth_interval must be a positive int, got {self.growth_interval!r}")
            if not (isinstance(self.hysteresis, int) and self.hysteresis >= 1):
                raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}")
            if not 0 < self.min_scale <= self.init_scale:
                raise ValueError(f"min_scale must be in (0, init_scale], got {self.min_scale}")


class ScaleState:
    """Device tensors: scale, growth tracker, hysteresis left, counters, ring-buffer history."""

    def __init__(self, cfg: ScalerConfig, device: torch.device):
        self.cfg = cfg
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.scale = torch.full((), cfg.init_scale if cfg.mode != "off" else 1.0, **f32)
        self.inv_scale = self.scale.double().reciprocal().float()
        self.growth_tracker = torch.zeros((), **i32)
        self.hysteresis_left = torch.full((), cfg.hysteresis, **i32)
        self.found_inf = torch.zeros((), **f32)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.stuck = torch.zeros((), dtype=torch.bool, device=device)
        self.overflow_history = torch.zeros(HISTORY, dtype=torch.bool, device=device)
        self.scale_history = torch.zeros(HISTORY, **f32)

    # --- the update, all on the device (a handful of tiny kernels: this runs every step)
    def record(self) -> None:
        """Count the step and write it to the history (after found_inf is final, before the scale moves)."""
        flag = self.found_inf > 0
        idx = self.steps % HISTORY
        self.overflow_history.index_put_((idx,), flag)
        self.scale_history.index_put_((idx,), self.scale)
        self.skipped.add_(flag)
        self.steps.add_(1)

    def update_dynamic(self) -> None:
        cfg = self.cfg
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

    # --- host reads, on demand only
    def check(self) -> None:
        """Stuck: some step in the history overflowed although its scale was already at min_scale."""
        if self.cfg.mode != "dynamic":
            return
        self.stuck.logical_or_((self.overflow_history & (self.scale_history <= self.cfg.min_scale)).any())
        if bool(self.stuck):
            raise LossScaleError(
                f"gradients still overflow with the loss scale at min_scale={self.cfg.min_scale}: the model "
                "produces inf/NaN that no scale can fix. Try: a lower learning rate or warm-up; gradient "
                "clipping (clip_grad_norm=1.0); autocastfx.calibrate() to move overflowing layers to float32; "
                "dtype=torch.bfloat16; or check the data and the loss for inf/NaN. Skipped updates left the "
                "weights untouched.")

    def state_dict(self) -> dict:
        return {k: getattr(self, k).clone() for k in ("scale", "growth_tracker", "hysteresis_left", "steps",
                                                       "skipped", "stuck", "overflow_history", "scale_history")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            getattr(self, k).copy_(v)
        self.inv_scale.copy_(self.scale.double().reciprocal().float())
