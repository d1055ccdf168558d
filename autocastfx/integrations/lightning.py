"""Lightning precision plugin, ``MixedPrecision``, that converts the LightningModule's network on its first call and
trains it through autocastfx's step; the LightningModule is written as for float32, with one optimizer.

    from autocastfx.integrations.lightning import MixedPrecision
    trainer = lightning.Trainer(plugins=[MixedPrecision()], accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(lit_module)
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..base.meta import is_converted
from ..api import convert
from ..training.factory import train_step
from ..training.step import TrainStep

pl = None
for _name in ("lightning.pytorch", "pytorch_lightning"):
    try:
        pl = importlib.import_module(_name)
        break
    except ImportError:
        continue
if pl is None:
    raise ImportError("autocastfx.integrations.lightning needs Lightning: pip install 'autocastfx[lightning]'")
Precision = pl.plugins.precision.Precision
SingleDeviceStrategy = pl.strategies.SingleDeviceStrategy
isolate_rng = importlib.import_module(pl.__name__ + ".utilities.seed").isolate_rng


class MixedPrecision(Precision):
    """Lightning precision plugin that converts the LightningModule's network and trains it through autocastfx's
    step (``self.step``); ``gradient_clip_val`` and ``accumulate_grad_batches`` become the step's.

    Args:
        attribute: the attribute that holds the network; default the one child module with parameters.
        convert_kwargs: more ``autocastfx.convert`` options (``step_kwargs``: ``autocastfx.train_step``'s).
        example_input: the network's inputs (a tensor, tuple, dict, or a callable taking the LightningModule), to
            convert at setup instead of on the first call.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, attribute: str | None = None,
                 convert_kwargs: dict | None = None, step_kwargs: dict | None = None, example_input: Any = None):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.precision = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
        self.attribute = attribute
        self.convert_kwargs = dict(convert_kwargs or {})
        self.step_kwargs = dict(step_kwargs or {})
        self.example_input = example_input
        self.step: TrainStep | None = None
        self.module = None      # the LightningModule
        self.name = None        # its attribute that holds the network
        self._optimizer = None  # the real optimizer, while fitting
        self._waiting = None    # the network, while its first call is to convert it
        self._pending = None    # a checkpoint's step state, until the step exists
        self._stepping = False  # inside optimizer_step: this batch ends an update

    def __repr__(self):
        return f"autocastfx.integrations.lightning.MixedPrecision(dtype={self.dtype})"

    # ------------------------------------------------------------------------------------ set-up
    def connect(self, model, optimizers, lr_schedulers):
        trainer = model.trainer
        fitting = trainer.state.fn == "fit"
        self._refuse(trainer, model, optimizers if fitting else None)
        self.module, self.name = model, self._network_name(model)
        self._optimizer = optimizers[0] if fitting else None
        net = getattr(model, self.name)
        if is_converted(net):
            if fitting:
                self._build_step(net)
        elif self.example_input is not None:
            inputs = self.example_input(model) if callable(self.example_input) else self.example_input
            inputs = tree_map(lambda t: t.to(model.device) if torch.is_tensor(t) else t, inputs)
            if isinstance(inputs, dict):
                self._convert(net, (), inputs)
            else:
                self._convert(net, inputs if isinstance(inputs, tuple) else (inputs,), {})
        else:
            def first_call(*args, **kwargs):
                del net.forward  # the class's own forward again
                self._waiting = None
                return self._convert(net, args, kwargs)(*args, **kwargs)
            net.forward, self._waiting = first_call, net
        return model, optimizers, lr_schedulers

    def _refuse(self, trainer, model, optimizers) -> None:
        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            raise NotImplementedError(
                f"autocastfx's Lightning plugin trains on one device, not with {type(trainer.strategy).__name__}: "
                "use Trainer(devices=1); for DDP or FSDP2 call autocastfx.train_step in a loop of your own "
                "(docs/distributed.md)")
        if not model.automatic_optimization:
            raise ValueError("autocastfx's Lightning plugin runs automatic optimization (autocastfx's step does "
                             "backward and the update): with manual optimization, build autocastfx.train_step(...) "
                             "yourself and call it in training_step, without the plugin")
        if optimizers is not None and len(optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers: autocastfx's step "
                             "updates through one; put the parameters in groups of one optimizer")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError("autocastfx's step clips by global norm, after unscaling: use "
                             "Trainer(gradient_clip_algorithm='norm'), or leave the algorithm unset")

    def _network_name(self, model) -> str:
        if self.attribute is not None:
            if not isinstance(getattr(model, self.attribute, None), nn.Module):
                raise ValueError(f"{type(model).__name__}.{self.attribute} is not a module: "
                                 "MixedPrecision(attribute=...) names the attribute that holds the network")
            return self.attribute
        names = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
        if len(names) != 1:
            raise ValueError(f"{type(model).__name__} holds {len(names)} modules with parameters ({names}): name "
                             "the one to convert with MixedPrecision(attribute='...')")
        return names[0]

    def _convert(self, net: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
        # the first call may come from the validation sanity check (inference mode), but the converted module and
        # the step's tensors must be ordinary ones; the conversion runs the model, so the random state is isolated
        with torch.inference_mode(False), torch.enable_grad(), isolate_rng():
            args, kwargs = tree_map(lambda t: t.clone() if torch.is_tensor(t) and t.is_inference() else t,
                                    (tuple(args), kwargs))
            gm = convert(net, args or None, example_kwargs=kwargs or None, dtype=self.dtype,
                                    **self.convert_kwargs)
            gm.train(net.training)
            setattr(self.module, self.name, gm)
            if self._optimizer is not None:
                self._build_step(gm)
        return gm

    def _build_step(self, gm: nn.Module) -> None:
        trainer = self.module.trainer
        accum = trainer.accumulate_grad_batches
        old = self.step
        # Lightning hands backward the training_step's loss divided by accumulate_grad_batches; the step divides
        # by accum_steps itself, so it takes the loss back as training_step returned it
        self.step = train_step(gm, (lambda loss: loss * accum) if accum > 1 else (lambda loss: loss),
                                          self._optimizer, accum_steps=accum,
                                          clip_grad_norm=trainer.gradient_clip_val or None, **self.step_kwargs)
        if self._pending is not None:
            self.step.load_state_dict(self._pending)
            self._pending = None
        elif old is not None:  # a later fit() of the same module: its loss scale goes on
            self.step.state.load_state_dict(old.state.state_dict())

    def teardown(self) -> None:
        if self._waiting is not None:  # never called: the network is left as it was given
            del self._waiting.forward
            self._waiting = None
        super().teardown()

    # ------------------------------------------------------------------------------------ training
    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        step = self.step
        if step is None:
            raise RuntimeError(f"training_step's loss did not come from {type(model).__name__}.{self.name}: the "
                               "plugin trains the network it converts; call it in training_step (or name the "
                               "right one with MixedPrecision(attribute='...'))")
        accum = model.trainer.accumulate_grad_batches
        if accum != step.accum_steps and step.micro % step.accum_steps == 0:  # a GradientAccumulationScheduler
            self._build_step(getattr(self.module, self.name))
            step = self.step
        if self._stepping:  # Lightning updates after this batch, so the step does (an epoch's last window is short)
            a = step.accum_steps
            step.micro = step.micro // a * a + a - 1
        step.after_forward(tensor)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs) -> Any:
        self._stepping = True
        try:
            result = closure()  # training_step, zero_grad, backward: the step's update included
        finally:
            self._stepping = False
        if result is None and self.step is not None:  # training_step skipped this batch: Lightning still updates
            self.step.finish_cycle()                  # from the window's batches so far
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks; clipping was the step's
        trainer = model.trainer
        if self.step is not None and trainer.loggers and trainer._logger_connector.should_update_logs:
            s = self.step.stats.summary()  # read here, at the Trainer's logging interval only
            logs = {"loss_scale": s["scale"], "skipped_steps": float(s["skipped"])}
            if s["grad_norm"] is not None:
                logs["grad_norm"] = s["grad_norm"]
            model.log_dict(logs, on_step=True, on_epoch=False)
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        if clip_val and clip_val > 0 and (self.step is None or self.step.clip != clip_val):
            raise ValueError(f"clipping at {clip_val} outside the step: the gradients are gone by then; set "
                             "Trainer(gradient_clip_val=...), which the step clips by, after unscaling")

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.step.state_dict() if self.step is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the random state belongs to this point of the run (the checkpoint's), not to when the step is built
        if state_dict.get("rng") is not None:
            torch.set_rng_state(state_dict["rng"])
        if state_dict.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda_rng"])
        state = {**state_dict, "rng": None, "cuda_rng": None}
        if self.step is not None:
            self.step.load_state_dict(state)
        else:
            self._pending = state
