"""The training step: the host-side work around training.recipe (input checks, the stuck-scale poll) on a
converted module, its loss function and the user's optimizer. What depends on how the model is spread over processes
is asked of a ``parallel`` object: :class:`Local` here, training.parallel and training.sharding for DDP and FSDP2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Any, Callable

import torch
import torch.nn as nn

from ..base import keys as K
from ..converted import calls as _calls
from .checks import InputChecker, StepError, check_grad_mode, signature, unique_by_id
from . import heap as _heap
from .scaling import HISTORY, LossScaleError, ScalerConfig, ScaleState
from . import recipe
from ..base.quiet import warn_user
from .recipe import StepOptions


class _DynamicDefault(str):
    """The default ``loss_scale``: "dynamic" for float16, off for bfloat16 and float32 compute (whose range needs
    no scaling)."""


DYNAMIC = _DynamicDefault("dynamic")


@dataclasses.dataclass
class StepStats:
    """Device tensors, read only when you ask (``summary()`` and ``history()`` copy them to the host)."""
    scale: torch.Tensor
    steps: torch.Tensor
    skipped: torch.Tensor
    overflow_history: torch.Tensor
    scale_history: torch.Tensor
    grad_norm: torch.Tensor | None

    def summary(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "steps": int(self.steps), "skipped": int(self.skipped),
                "grad_norm": None if self.grad_norm is None else float(self.grad_norm)}

    def history(self) -> list[tuple[float, bool]]:
        """(scale used, overflowed) for the last steps, oldest first (at most ``HISTORY``)."""
        n = int(self.steps)
        idx = [(i % HISTORY) for i in range(max(0, n - HISTORY), n)]
        scales, flows = self.scale_history.tolist(), self.overflow_history.tolist()
        return [(scales[i], bool(flows[i])) for i in idx]


class Forwarded:
    """The output of a forward the caller already ran (a trainer's own training code): the step takes it instead of
    calling the model."""
    __slots__ = ("output",)

    def __init__(self, output: Any):
        self.output = output


class Local:
    """What the step asks of the data-parallel wrapper, answered for one process.

    ``local``/``locals``: the tensors the fused kernels work on (a sharded parameter's local shard).
    ``all_reduce_max``: one overflow decision for every process (called only where ``distributed``).
    ``sync(last)``: the context a micro-batch runs in (gradient sync on the last only). A sharded wrapper adds
    ``grad_norm``, the norm over every shard."""
    kind = "local"
    distributed = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.gm = model

    def local(self, t):
        return t

    def locals(self, ts):
        return ts

    def all_reduce_max(self, t: torch.Tensor) -> None:
        pass

    def sync(self, last: bool):
        return contextlib.nullcontext()

    grads_in_params = True  # an unfinished accumulation cycle's gradients are the parameters' .grad

    def drop_unsynced_grads(self) -> None:
        """Gradients held outside ``.grad`` by an unfinished accumulation cycle: none here."""

    def allows_fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's fused kernel (which skips an overflowing update on the device) runs here."""
        return True


def compiled_module(model):
    """The module ``torch.compile(module)`` compiled (its ``_orig_mod``), or ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Forwarded):
        return inputs.output
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _parallel_and_info(model, parallel: Local | None):
    """The ``parallel`` object (:class:`Local` around ``model`` when none is given) and the conversion info of the
    module it holds; TypeError for a module autocastfx.convert() did not return."""
    if parallel is None:
        if isinstance(compiled_module(model), torch.nn.parallel.DistributedDataParallel):
            raise TypeError("a step over DistributedDataParallel is built by autocastfx.train_step(), which "
                            "knows how to reduce the overflow flag across processes")
        parallel = Local(compiled_module(model))
        parallel.model = model
    gm = parallel.gm
    info = getattr(gm, "meta", {}).get("autocastfx") if isinstance(getattr(gm, "meta", None), dict) else None
    if info is None:
        raise TypeError("train_step() needs the module autocastfx.convert() returned (or DistributedDataParallel "
                        f"around it, or it sharded with FSDP2), got {type(gm).__name__}: convert the model first")
    return parallel, info


def _checked_options(info, loss_fn, optimizer, loss_scale, init_scale, on_overflow, max_retries, accum_steps,
                     clip_grad_norm) -> tuple[str, Any]:
    """The step's options checked before anything is changed; returns the loss-scale mode ("dynamic", "static"
    or "off") and the initial scale (a static scale's own value)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(output, *targets)")
    if on_overflow not in ("skip", "retry"):
        raise ValueError(f"on_overflow must be 'skip' or 'retry', got {on_overflow!r}")
    if not (isinstance(accum_steps, int) and accum_steps >= 1):
        raise ValueError(f"accum_steps must be a positive int, got {accum_steps!r}")
    if not (isinstance(max_retries, int) and max_retries >= 0):
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    if on_overflow == "retry" and accum_steps > 1:
        raise ValueError("on_overflow='retry' re-runs one batch and cannot re-run earlier micro-batches: "
                         "use on_overflow='skip' with accum_steps > 1")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
    if isinstance(loss_scale, _DynamicDefault):
        mode = "dynamic" if info.dtype == torch.float16 else "off"
    elif loss_scale is None:
        mode = "off"
    elif loss_scale == "dynamic":
        mode = "dynamic"
    elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
        mode, init_scale = "static", float(loss_scale)
    else:
        raise ValueError(f"loss_scale must be 'dynamic', a positive number (static scale) or None, got {loss_scale!r}")
    if on_overflow == "retry" and mode != "dynamic":
        raise ValueError("on_overflow='retry' needs loss_scale='dynamic' (a fixed scale would overflow again)")
    if init_scale == "auto" and mode == "off":
        init_scale = 2.0**16  # no scaling: the value is never used
    return mode, init_scale


_DYNAMIC_ONLY = dict(init_scale=("auto", 2.0**16), growth_factor=(2.0,), backoff_factor=(0.5,),
                     growth_interval=(2000,), min_scale=(1.0,), hysteresis=(1,))


def _warn_unused_scaling(mode: str, scale: Any, given: dict[str, Any], dtype: torch.dtype) -> None:
    """A warning naming the dynamic-scaling options given where the scale is static or off, which use none."""
    if mode == "dynamic":
        return
    unused = [f"{k}={v!r}" for k, v in given.items() if v not in _DYNAMIC_ONLY[k]
              and not (k == "init_scale" and mode == "static")]
    if unused:
        why = f"the loss scale is static ({scale:g})" if mode == "static" else (
            "the loss is not scaled (loss_scale=None)" if dtype == torch.float16 else
            f"{str(dtype).removeprefix('torch.')} needs no loss scale")
        one = len(unused) == 1
        warn_user(f"autocastfx: {', '.join(unused)} appl{'ies' if one else 'y'} to dynamic loss scaling only, and "
                  f"{why}: {'it is' if one else 'they are'} not used. Drop {'it' if one else 'them'}, or pass "
                  "loss_scale='dynamic'")


class TrainStep:
    """``step(inputs, *targets) -> loss``; see :func:`train_step`.

    The step owns backward, unscaling, clipping, the optimizer step and freeing gradients, once per micro-batch; the
    learning rate, ``eval()``/``train()`` and checkpoints stay the loop's (docs/training.md)."""

    def __init__(self, model, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
                 max_retries=8, accum_steps=1, clip_grad_norm=None, parallel: Local | None = None):
        parallel, info = _parallel_and_info(model, parallel)
        if getattr(parallel.gm, "meta", {}).get(K.SAVED_MODE) == "eval":
            raise StepError("this module was loaded from a file saved after gm.eval(): its one program is the eval "
                            "program (no dropout, batch-norm statistics not updated), and a loaded module cannot "
                            "switch modes. Save it in training mode (gm.train(), then autocastfx.save) to train "
                            "it, or train the converted module itself")
        mode, init_scale = _checked_options(info, loss_fn, optimizer, loss_scale, init_scale, on_overflow,
                                            max_retries, accum_steps, clip_grad_norm)
        _warn_unused_scaling(mode, init_scale, dict(init_scale=init_scale, growth_factor=growth_factor,
                                                    backoff_factor=backoff_factor, growth_interval=growth_interval,
                                                    min_scale=min_scale, hysteresis=hysteresis), info.dtype)
        self.model, self.gm, self.loss_fn, self.optimizer = model, parallel.gm, loss_fn, optimizer
        self.parallel = P = parallel
        self.ddp = P.kind == "ddp"
        self.accum_steps, self.on_overflow = accum_steps, on_overflow
        self.clip, self.max_retries = clip_grad_norm, max_retries
        self.cfg = ScalerConfig(mode, init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis,
                                low_max=torch.finfo(info.dtype).max)
        self.module_params = list(unique_by_id(self.gm.parameters()))
        self.all_params = [p for p in self.module_params if p.requires_grad]
        self._union, self._union_key = [], None
        _check_optimizer(self.optimizer, self.gm, info)  # raises before anything is changed
        device = self.all_params[0].device if self.all_params else torch.device("cpu")
        self.state = ScaleState(self.cfg, device, reduce_max=P.all_reduce_max if P.distributed else None)
        self.fused = _use_fused_skip(self.optimizer, P)
        self.grad_norm = torch.zeros((), device=device) if clip_grad_norm is not None else None
        self.micro = 0
        self.checker = InputChecker(self.gm, device)
        inner = compiled_module(self.model)  # torch.compile(gm): the sizes to mark before each call
        self._compiled_free = inner.meta["autocastfx"].free_dims if inner is not self.model \
            and "autocastfx" in getattr(inner, "meta", {}) else ()
        self.heap = _heap.status() if torch.device(device).type == "cpu" else None
        self.options = StepOptions(
            scaler=self.cfg, accum_steps=self.accum_steps, clip=self.clip, on_overflow=self.on_overflow,
            max_retries=self.max_retries, kind=P.kind, distributed=P.distributed, fused=self.fused, heap=self.heap)
        self._fn: Callable = functools.partial(recipe.train_step, self)

    @property
    def code(self) -> str:
        """What runs: the options in words, then the step's functions as written (autocastfx.training.recipe)."""
        return recipe.code(self.options)

    def call_model(self, model: nn.Module, inputs: Any) -> Any:
        """The module's forward, counted for the input checks; over ``torch.compile(gm)``, the inputs' free sizes
        are marked dynamic first."""
        if self._compiled_free and not isinstance(inputs, Forwarded):
            args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs) \
                if isinstance(inputs, dict) else ((inputs,), {})
            _calls.mark_free_dims(self._compiled_free, args, kwargs)
        out = _call(model, inputs)
        self.checker.forwards += 1
        return out

    @property
    def optimizer_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def trained_params(self) -> list[torch.Tensor]:
        """The converted module's and the optimizer's parameters that require grad or hold a gradient now: a layer
        unfrozen, or a param group added, after the step was built has its gradient unscaled and freed too, and
        one frozen mid-accumulation has the gradient it holds unscaled and freed."""
        key = tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])
        if key != self._union_key:  # the optimizer's parameters changed: the union anew
            self._union = list(unique_by_id(itertools.chain(self.module_params, self.optimizer_params)))
            self._union_key = key
        return [p for p in self._union if p.requires_grad or p.grad is not None]

    def zero_new_momentum(self) -> bool:
        """A fused SGD's momentum buffers, for parameters with a gradient and none yet, started at zero (torch's
        first-step buffer where dampening is 0): a skipped first update would otherwise leave the uninitialised
        buffer that torch's fused kernel allocates (``torch.empty_like``) as the momentum. False where a group
        with dampening has such a parameter: no start value stands for its first update, which is then skipped
        from the host."""
        opt = self.optimizer
        if not isinstance(opt, torch.optim.SGD) or len(opt.state) == len(self._union_key or ()):
            return True  # every parameter has its state (its buffer) already
        new = [(group, p) for group in opt.param_groups if group["momentum"] for p in group["params"]
               if p.grad is not None and "momentum_buffer" not in opt.state.get(p, ())]
        if any(group["dampening"] for group, _ in new):
            return False
        for _, p in new:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return True

    def finish_cycle(self) -> None:
        """The update of an unfinished accumulation cycle's micro-batches, now, on one process (a trainer that
        updates after a batch it skipped); nothing at a cycle's end."""
        if self.micro % self.accum_steps == 0:
            return
        if self.parallel.distributed:
            raise RuntimeError("finish_cycle() updates from this process's gradients alone: under DDP or FSDP2 "
                               "every micro-batch of a cycle goes through the step")
        with torch.no_grad():
            recipe.update(self, *recipe.unscale_and_check(self))
        self.micro += self.accum_steps - self.micro % self.accum_steps

    # ---------------------------------------------------------------------------------------- public
    def __call__(self, inputs, *targets):
        """``inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs; ``targets`` go to
        ``loss_fn(output, *targets)``. Returns the loss (a device tensor, not read)."""
        check_grad_mode()
        key = signature(inputs, targets)
        if key in self.checker.seen:
            loss = self._fn(inputs, *targets)
        else:
            bound = self.checker.check(inputs, targets)
            with self.checker.guard(inputs, bound):
                loss = self._fn(inputs, *targets)
            self.checker.seen.add(key)
        self.state.poll()
        return loss

    def after_forward(self, output: Any, *targets) -> torch.Tensor:
        """``step(inputs, *targets)`` for a forward the caller ran itself (Lightning's ``training_step``), in this
        grad-enabled region."""
        check_grad_mode()
        loss = self._fn(Forwarded(output), *targets)
        self.state.poll()
        return loss

    @property
    def stats(self) -> StepStats:
        S = self.state
        return StepStats(S.scale, S.steps, S.skipped, S.overflow_history, S.scale_history, self.grad_norm)

    def check(self) -> None:
        """Raise LossScaleError now if the scale is stuck at min_scale (one host read)."""
        self.state.check()

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume bit for bit (scale state, module, optimizer, RNG), as this process sees it (under
        FSDP2, its shards)."""
        return {
            "scaler": self.state.state_dict(),
            "model": {k: v.clone() for k, v in self.gm.state_dict().items()},
            "optimizer": torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, self.optimizer.state_dict()),
            "micro": self.micro,
            "grads": self.pending_grads(),
            "outside": {n: p.detach().clone() for n, p in self.outside_params()},  # a parameter of the loss
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def pending_grads(self) -> dict[str, torch.Tensor]:
        """An unfinished accumulation cycle's gradients by parameter name (empty at a cycle's end); ValueError
        where FSDP2 holds them instead of ``.grad``."""
        if self.micro % self.accum_steps == 0:
            return {}
        if not self.parallel.grads_in_params:
            raise ValueError(
                f"this step is {self.micro % self.accum_steps} micro-batches into an accumulation cycle of "
                f"{self.accum_steps}, whose gradients FSDP2 holds in its own state: a checkpoint now would lose them. "
                "Save after the cycle's last micro-batch (when step.micro % accum_steps == 0)")
        return {n: p.grad.detach().clone() for n, p in [*self.gm.named_parameters(), *self.outside_params()]
                if p.grad is not None}

    def outside_params(self) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's tensors that are not ``gm``'s parameters (a parameter of the loss), each named by its
        place in the optimizer (``optimizer.param_groups.<group>.<index>``)."""
        own = {id(p) for p in self.gm.parameters()}
        return [(f"optimizer.param_groups.{g}.{i}", p) for g, group in enumerate(self.optimizer.param_groups)
                for i, p in enumerate(group["params"]) if id(p) not in own]

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        missing = {"scaler", "model", "optimizer"} - set(sd)
        if missing:
            raise KeyError(f"not a train_step state_dict: missing {sorted(missing)}")
        self.gm.load_state_dict(sd["model"])
        outside = dict(self.outside_params())
        with torch.no_grad():
            for name, value in sd.get("outside", {}).items():
                if name in outside:
                    outside[name].copy_(value)
        _load_optimizer(self.optimizer, sd["optimizer"])
        self.state.load_state_dict(sd["scaler"])
        self.micro = sd.get("micro", 0)
        for p in self.trained_params():  # gradients of this run's micro-batches are not the checkpoint's
            p.grad = None
        self.parallel.drop_unsynced_grads()
        params = {**dict(self.gm.named_parameters()), **dict(self.outside_params())}
        for name, g in sd.get("grads", {}).items():  # the checkpoint's unfinished cycle, continued
            params[name].grad = g.to(params[name].device).clone()
        if sd.get("rng") is not None:
            torch.set_rng_state(sd["rng"])
        if sd.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda_rng"])


# ------------------------------------------------------------------------------------------- the optimizer
def _check_optimizer(optimizer: torch.optim.Optimizer, gm: nn.Module, info) -> None:
    """StepError for an optimizer entry that is not a parameter of the converted module (one converted on meta or
    from a low-precision checkpoint has its own parameters, not the model's), unless it is none of the model's and
    the optimizer holds the module's own too (a parameter of the loss)."""
    own = {id(p) for p in gm.parameters()}
    names = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    holds_own = any(id(p) in own for group in optimizer.param_groups for p in group["params"])
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in own:
                continue
            if id(p) in info.source_params and not names.intersection(info.source_params[id(p)]):
                continue  # the model's, but the graph never reads it: no gradient, as in the model itself
            if id(p) not in info.source_params and holds_own:
                continue  # beside the module's own: a parameter of the loss (a learned weighting), trained as is
            whose = ("a parameter of the model it was converted from, which the converted module does not share "
                     "(converted on the meta device or from a low-precision checkpoint, or moved with .to())"
                     if id(p) in info.source_params else "not a parameter of the converted module")
            raise StepError(
                f"the optimizer holds a tensor of shape {tuple(p.shape)} (param group {g}, entry {i}) that is "
                f"{whose}: build the optimizer over gm.parameters() (after fully_shard() or autocastfx.shard(), "
                "which replace the module's parameters)")
    upcast = getattr(info, "upcast", frozenset())
    for p, state in optimizer.state.items() if upcast else ():
        stale = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype != p.dtype
                       and v.shape == p.shape and v.is_floating_point()) if id(p) in upcast else ()
        if stale:
            raise StepError(
                f"the optimizer's state {', '.join(stale)} of a {str(p.dtype).replace('torch.', '')} parameter of "
                f"shape {tuple(p.shape)} is {str(state[stale[0]].dtype).replace('torch.', '')}: it was built before "
                "convert() upcast the low-precision model in place. Reload it, which casts the state to its "
                "parameters' dtype: optimizer.load_state_dict(optimizer.state_dict()); or, for an optimizer that "
                "keeps low-precision state by design, build it anew over gm.parameters()")
    if upcast:  # state made from here on is the optimizer's own choice of dtype (AnyPrecisionAdamW's bfloat16)
        info.upcast = frozenset()


def _use_fused_skip(opt: torch.optim.Optimizer, parallel: Local) -> bool:
    """Whether the optimizer skips an overflowed update on the device (a ``fused=True`` kernel takes
    ``found_inf``) rather than after a host read."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and parallel.allows_fused(opt)


def _load_optimizer(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state, copied (training on would write into the checkpoint's tensors), keeping
    this optimizer's ``fused``/``foreach``/``capturable`` (a plain loop's ``fused=False`` would leave ``found_inf``
    unread)."""
    opt_sd = dict(sd)
    opt_sd["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
                       for k, st in sd["state"].items()}
    own = [{k: g[k] for k in ("capturable", "fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(opt_sd)
    for group, keep in zip(optimizer.param_groups, own):
        group.update(keep)
        if not (group.get("capturable") or group.get("fused")):
            for p in group["params"]:  # where torch keeps `step` for a plain loop: on the CPU
                st = optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")) and st["step"].device.type != "cpu":
                    st["step"] = st["step"].to("cpu", torch.float32)


__all__ = ["TrainStep", "Local", "StepStats", "LossScaleError", "StepError", "DYNAMIC"]
