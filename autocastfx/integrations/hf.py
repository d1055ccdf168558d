"""Hugging Face ``Trainer`` trained through autocastfx's step, in place of ``transformers.Trainer``; the step's state
is saved beside each checkpoint's optimizer as ``autocastfx_step.pt``.

    from autocastfx.integrations.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...)
    trainer.train()
"""
from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from ..api import convert
from ..training.factory import train_step
from ..training.step import TrainStep


STEP_FILE = "autocastfx_step.pt"


class _Applied(torch.optim.Optimizer):
    """What the Trainer holds as its optimizer: the real one's groups and state, with ``step()`` and
    ``zero_grad()`` left to autocastfx's step."""

    def __init__(self, real: torch.optim.Optimizer):  # noqa: D107 - no super().__init__: nothing of its own
        self.real = real
        self.defaults = real.defaults

    @property
    def param_groups(self):
        return self.real.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.real.param_groups = value

    @property
    def state(self):
        return self.real.state

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    def state_dict(self):
        return self.real.state_dict()

    def load_state_dict(self, state_dict):
        self.real.load_state_dict(state_dict)

    def __repr__(self):
        return f"applied by autocastfx's step: {self.real!r}"


def _loss(out: Any) -> torch.Tensor:
    """The model's own loss, from its output as ``transformers.Trainer`` reads it: a ``ModelOutput`` or dict's
    ``"loss"``, else the first element."""
    return out["loss"] if isinstance(out, dict) else out[0]


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose training runs through autocastfx's step; ``convert_kwargs`` / ``step_kwargs``
    go to ``autocastfx.convert`` / ``autocastfx.train_step``. Leave ``TrainingArguments(fp16=..., bf16=...)`` off."""

    def __init__(self, *args, dtype: torch.dtype = torch.float16, convert_kwargs: dict | None = None,
                 step_kwargs: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.args.bf16:
            raise ValueError("autocastfx.integrations.hf.Trainer runs the converted module's own mixed precision: "
                             "leave TrainingArguments(fp16=False, bf16=False) and pick the low dtype with "
                             "Trainer(dtype=torch.float16 or torch.bfloat16)")
        self.dtype = dtype
        self.convert_kwargs = dict(convert_kwargs or {})
        self.step_kwargs = dict(step_kwargs or {})
        self.step: TrainStep | None = None
        self.clip = None
        self.tokens_per_window = False  # each micro-batch's loss weighted by its share of the window's label tokens
        self.shifts_labels = False  # a causal LM's loss averages over labels[..., 1:]
        self._skipped_seen = 0  # the step's count of updates skipped for an overflow, as last read

    # ------------------------------------------------------------------------------------ conversion
    def train(self, *args, **kwargs):
        self._refuse_other_losses()
        # converted first, so a checkpoint to resume from loads into the converted module
        if "autocastfx" not in getattr(self.model, "meta", {}):
            self.model = self.model_wrapped = self._convert(self.model)
        # the converted forward takes the inputs it was converted with: the window's token count is applied here
        self.tokens_per_window = self.tokens_per_window or self.model_accepts_loss_kwargs
        self.model_accepts_loss_kwargs = False
        max_norm = self.args.max_grad_norm  # clipped by the step, after unscaling; the caller's args kept as given
        self.clip = max_norm if max_norm and max_norm > 0 else None
        if hasattr(transformers.Trainer, "_clip_grad_norm"):  # the Trainer's own clipping goes through it (below)
            return super().train(*args, **kwargs)
        self.args.max_grad_norm = 0.0  # an older Trainer clips inline: off for this run, put back after it
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.max_grad_norm = max_norm

    def _clip_grad_norm(self, model):
        """None: the step clipped the unscaled gradients before its update; the Trainer then measures the norm
        without clipping (the logged norm is the step's, :meth:`log`)."""
        return None

    def _refuse_other_losses(self) -> None:
        """ValueError where the Trainer would compute a loss other than the model's own ``out.loss``, which the step
        trains on: label smoothing, ``compute_loss_func``, an overridden ``compute_loss``."""
        other = [what for what, on in (
            (f"label_smoothing_factor={self.args.label_smoothing_factor}", getattr(self, "label_smoother", None)),
            ("compute_loss_func", getattr(self, "compute_loss_func", None)),
            (f"{type(self).__name__}.compute_loss", type(self).compute_loss is not transformers.Trainer.compute_loss),
        ) if on]
        if other:
            raise ValueError(
                f"autocastfx.integrations.hf.Trainer trains on the model's own loss (out.loss), and {', '.join(other)} "
                "asks for another: convert the model (autocastfx.convert(model, example_kwargs=batch)) and train it "
                "with transformers.Trainer, which applies it, or compute that loss in the model's forward")

    def _convert(self, model):
        # the first examples read without the sampler, so the data order stays a float32 run's
        n = min(self.args.per_device_train_batch_size, len(self.train_dataset))
        batch = self.data_collator([self.train_dataset[i] for i in range(n)])
        batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if "labels" not in batch:
            raise ValueError("the training batches have no 'labels': autocastfx.integrations.hf.Trainer trains "
                             "with the model's own loss (out.loss), which it computes from labels=")
        model.to(self.args.device)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        self.shifts_labels = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() \
            and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        return convert(model, example_kwargs=batch, dtype=self.dtype, **self.convert_kwargs)

    # ---------------------------------------------------------------------------------- optimisation
    def create_optimizer(self, model=None):
        if self.step is None:
            real = super().create_optimizer(model)
            self.step = train_step(
                self.model, lambda out, weight=None: _loss(out) if weight is None else _loss(out) * weight, real,
                accum_steps=self.args.gradient_accumulation_steps,
                clip_grad_norm=self.clip, **self.step_kwargs)
            self.real_optimizer = real
            self.optimizer = _Applied(real)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # the schedule drives the real optimizer, whose groups autocastfx's step steps
        return super().create_scheduler(num_training_steps, optimizer=self.real_optimizer)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        step = self.step
        if self.accelerator.gradient_state.sync_gradients and step.accum_steps > 1:
            # the Trainer ends an epoch's last, shorter window early: this batch completes an update
            step.micro = (step.micro // step.accum_steps) * step.accum_steps + step.accum_steps - 1
        weight = self._token_weight(inputs, num_items_in_batch)
        window = getattr(self, "current_gradient_accumulation_steps", step.accum_steps)
        if weight is None and window != step.accum_steps:  # a shorter last window: its mean, as the Trainer's
            weight = torch.tensor(step.accum_steps / window, device=self.args.device)
        loss = step(inputs) if weight is None else step(inputs, weight)
        if step.options.scaled and step.micro % step.accum_steps == 0:
            self._say_skipped(step)
        return loss.detach() / step.accum_steps

    def _say_skipped(self, step) -> None:
        """Tell the Trainer whether this update was skipped for an overflow, as accelerate's GradScaler does, so
        the learning-rate schedule does not advance over it (one host read per update, where the loss is scaled)."""
        skipped = int(step.state.skipped)
        if hasattr(self.optimizer, "_is_overflow"):  # the AcceleratedOptimizer the Trainer asks
            self.optimizer._is_overflow = skipped > self._skipped_seen
        self._skipped_seen = skipped

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The window's label tokens, counted as the model's loss averages them (shifted for a causal LM)."""
        if not self.tokens_per_window or not batch_samples or "labels" not in batch_samples[0]:
            return None
        count = sum(self._label_tokens(b) for b in batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    def _label_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch["labels"][..., 1:] if self.shifts_labels else batch["labels"]
        return labels.ne(-100).sum()

    def _token_weight(self, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor | None:
        """The micro-batch's label tokens over the window's, times the step's divisor and the processes averaged
        over: the model's mean loss made the window's token mean (None where the window's tokens are not
        counted)."""
        if not self.tokens_per_window or num_items_in_batch is None:
            return None
        mine = self._label_tokens(inputs)
        weight = torch.as_tensor(mine, dtype=torch.float32, device=self.args.device) * self.step.accum_steps
        weight = weight / torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.args.device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            weight = weight * self.args.world_size  # the window counted over every process; DDP averages
        return weight

    # ------------------------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.step is not None and self.args.should_save:
            torch.save(self.step.state_dict(), os.path.join(output_dir, STEP_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.step is not None:
            path = os.path.join(checkpoint, STEP_FILE)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{checkpoint} has no {STEP_FILE}: it was not written by "
                                        "autocastfx.integrations.hf.Trainer, so its loss scale state is "
                                        "missing")
            self.step.load_state_dict(torch.load(path, weights_only=False))
            self._skipped_seen = int(self.step.state.skipped)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and "autocastfx" in getattr(self.model, "meta", {}):
            # safetensors refuses tied tensors (GPT-2's embedding and head): each name gets its own copy
            state_dict = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        for name in ("config", "generation_config"):  # what from_pretrained(checkpoint) reads beside the weights
            part = getattr(self.model, name, None)
            if self.args.should_save and hasattr(part, "save_pretrained"):
                part.save_pretrained(output_dir)

    # ---------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.step is not None and "loss" in logs:
            s = self.step.stats.summary()  # read here, at the Trainer's logging interval only
            logs = {**logs, "loss_scale": s["scale"], "skipped_steps": s["skipped"]}
            if s["grad_norm"] is not None:
                logs["grad_norm"] = s["grad_norm"]
        super().log(logs, *args, **kwargs)
