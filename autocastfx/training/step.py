"""The training step: generated Python source, compiled once, that carries out the whole mixed-precision recipe.

    forward with low-precision weights, the loss in float32
    backward of loss * scale
    low-precision gradients into the float32 masters' .grad, unscaled and checked for inf/NaN in one fused pass
    optional clipping by global norm; the optimizer steps the masters, skipped on the device on overflow
    masters copied back into the low-precision weights in one fused copy; the scale updated on the device

``print(step.code)`` shows exactly what runs: only the branches the options need are generated. The source is
written by autocastfx.training.source from the step's options alone; this module gathers what the step works on,
compiles that source and runs it. Around it, ``TrainStep.__call__`` does the host-side work: the first call with a
new input signature is checked and guarded (autocastfx.checks), and after every call a host copy of the "stuck at
min_scale" flag is read.

What depends on how the model is spread over processes, the step asks of a ``parallel`` object: :class:`Local`
here (one process); autocastfx.distributed answers for DistributedDataParallel and FSDP2, and builds steps through
``train_step()``. This module imports neither that one nor autocastfx.graphed: both import it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from ..core import calls as _calls
from ..core import weights as _weights
from .checks import InputChecker, StepError, check_grad_mode, check_loss, signature, unique_by_id
from .checks import watch_user_clipping
from . import heap as _heap
from .scaling import HISTORY, LossScaleError, ScalerConfig, ScaleState
from .source import SourceOptions, step_source


class _DynamicDefault(str):
    """The default ``loss_scale``: "dynamic" for float16, off for bfloat16 (whose range needs no scaling)."""


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
        """(scale used, overflowed) for the last steps, oldest first (at most 1024)."""
        n = int(self.steps)
        idx = [(i % HISTORY) for i in range(max(0, n - HISTORY), n)]
        scales, flows = self.scale_history.tolist(), self.overflow_history.tolist()
        return [(scales[i], bool(flows[i])) for i in idx]


class Forwarded:
    """The output of a forward its caller already ran (a trainer that calls the model in its own training code):
    the step takes it as the model's output instead of calling the model."""
    __slots__ = ("output",)

    def __init__(self, output: Any):
        self.output = output


class Local:
    """What the step asks of the data-parallel wrapper, answered for one process.

    ``master_pairs``: (qualified name, low-precision weight, float32 master) for every stored-low weight, in
    the module and its converted blocks. ``local``/``locals``: the tensor(s) the step's fused kernels work on (a
    sharded parameter's local shard; here the tensor itself). ``as_grad``: a master's gradient as the optimizer
    must see it. ``all_reduce_max``: one overflow decision for every process (emitted into the step only where
    ``distributed``). ``sync(last)``: the context a micro-batch's forward and backward run in (gradient sync on
    the last only). Clipping uses torch's ``clip_grad_norm_`` here and under DDP (whole gradients); a sharded
    wrapper adds ``grad_norm``, the norm over every shard."""
    kind = "local"
    distributed = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.gm = model

    def master_pairs(self, gm) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(qualified name, low weight, float32 master) over ``gm`` and its converted blocks."""
        return _weights.named_master_pairs(gm)

    def local(self, t):
        return t

    def locals(self, ts):
        return ts

    def as_grad(self, master, view):
        return view

    def all_reduce_max(self, t: torch.Tensor) -> None:
        pass

    def sync(self, last: bool):
        return contextlib.nullcontext()

    def drop_unsynced_grads(self) -> None:
        """Gradients held outside ``.grad`` by an unfinished accumulation cycle: none here."""

    def allows_fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's fused kernel (which skips an overflowing update on the device) runs here."""
        return True


def compiled_module(model):
    """The module ``torch.compile(module)`` compiled (its ``_orig_mod``), or ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


converted_units = _weights.converted_units
all_masters = _weights.all_masters


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
        mode = "off" if info.dtype == torch.bfloat16 else "dynamic"
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


class TrainStep:
    """``step(inputs, *targets) -> loss``; see :func:`train_step`.

    The step owns the backward, the division by ``accum_steps``, unscaling, clipping (``clip_grad_norm``), the
    optimizer step on the float32 masters and the copy back, and frees every gradient after an update: a loop
    calls it once per micro-batch and writes no ``loss.backward()``, ``clip_grad_norm_`` (it would see no
    gradients), ``optimizer.step()`` or ``zero_grad()``. The learning rate (``group["lr"]`` or an LR scheduler on
    the same optimizer), ``eval()``/``train()`` and checkpoints (``gm.state_dict()``, the float32 model, or
    :meth:`state_dict`, everything) stay the loop's. docs/training.md shows the loop before and after."""

    def __init__(self, model, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
                 max_retries=8, accum_steps=1, clip_grad_norm=None, parallel: Local | None = None,
                 keep_cpu_memory: bool = True):
        parallel, info = _parallel_and_info(model, parallel)
        mode, init_scale = _checked_options(info, loss_fn, optimizer, loss_scale, init_scale, on_overflow,
                                            max_retries, accum_steps, clip_grad_norm)
        self.model, self.gm, self.loss_fn, self.optimizer = model, parallel.gm, loss_fn, optimizer
        self.parallel = P = parallel
        self.ddp = P.kind == "ddp"
        self.accum_steps, self.on_overflow = accum_steps, on_overflow
        self.clip, self.max_retries = clip_grad_norm, max_retries
        self.cfg = ScalerConfig(mode, init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis,
                                low_max=torch.finfo(info.dtype).max)
        if not isinstance(keep_cpu_memory, bool):
            raise ValueError(f"keep_cpu_memory must be True or False, got {keep_cpu_memory!r}")
        repointed, device = self._take_weights(info)
        self.state = ScaleState(self.cfg, device, reduce_max=P.all_reduce_max if P.distributed else None)
        _repoint_optimizer(self.optimizer, repointed)
        self.fused = _use_fused_skip(self.optimizer, P)
        # float32 master gradients live only inside an update (one buffer per bucket, allocated per update):
        # between steps the step holds no gradient at all, as autocast + GradScaler with zero_grad(set_to_none=True)
        local_masters = P.locals(self.masters)  # under FSDP2: this rank's shards
        limit = BUCKET_ELEMENTS if torch.device(device).type != "cpu" else CPU_BUCKET_ELEMENTS
        self._buckets = _buckets([m.numel() for m in local_masters], limit)
        self._grad_views = [spec for lo, hi in self._buckets  # each master's place and layout in its bucket
                            for spec in _view_specs(local_masters[lo:hi])]
        self._bucket_numel = [sum(m.numel() for m in local_masters[lo:hi]) for lo, hi in self._buckets]
        self.all_params = self.lows + self.fp32_params
        self.grad_holders = self.all_params + self.masters
        self.grad_norm = torch.zeros((), device=device) if clip_grad_norm is not None else None
        self.micro = 0
        self.checker = InputChecker(self.gm, device)  # host-side checks of each new input signature
        inner = compiled_module(self.model)  # torch.compile(gm): the sizes to mark before each call
        self._compiled_free = inner.meta["autocastfx"].free_dims if inner is not self.model \
            and "autocastfx" in getattr(inner, "meta", {}) else ()
        watch_user_clipping(self.grad_holders)  # a loop's own clip_grad_norm_ on them clips nothing: said so
        self.heap = _cpu_heap(keep_cpu_memory, device)  # last: a step that fails to build changes no process state
        self.code = self._generate()
        self._fn: Callable = self._compile(self.code)

    # ------------------------------------------------------------------------------------------- set-up
    def _take_weights(self, info) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], torch.device]:
        """Find the weights the step works on: (name, low weight, float32 master) for the stored-low ones and the
        float32 parameters that train as they are. Returns the optimizer's groups re-pointed at those (not yet
        applied) and the device the step's own tensors go on; masters not on their weight's device move there."""
        P, gm = self.parallel, self.gm
        repointed = _repointed_groups(gm, self.optimizer, info)  # raises before anything is changed
        name_of_master = {id(m): n for n, m in all_masters(gm).items()}
        triples = P.master_pairs(gm)  # FSDP2: each master cut to its weight's shard here
        pairs = [(lo, m) for _, lo, m in triples]
        self.names = [n for n, _, _ in triples]
        self.lows = [lo for lo, _ in pairs]
        self.masters = [m for _, m in pairs]
        low_ids = {id(p) for p in self.lows}
        self.fp32_params = [p for p in unique_by_id(gm.parameters()) if p.requires_grad and id(p) not in low_ids]
        device = (self.lows + self.fp32_params)[0].device if (self.lows or self.fp32_params) else torch.device("cpu")
        if P.kind == "fsdp":  # the masters were cut to shards: point the optimizer at those
            by_name = dict(zip(self.names, self.masters))
            repointed = [[(p, by_name.get(name_of_master.get(id(t)), t)) for p, t in group] for group in repointed]
        for lo, m in pairs:
            if m.device != lo.device:
                m.data = m.data.to(lo.device)
        return repointed, device

    # ------------------------------------------------------------------------------------- the source
    def _generate(self) -> str:
        """The step's source (autocastfx.training.source), for the options it was built with."""
        return step_source(SourceOptions(
            scaler=self.cfg, accum_steps=self.accum_steps, clip=self.clip, on_overflow=self.on_overflow,
            max_retries=self.max_retries, kind=self.parallel.kind, distributed=self.parallel.distributed,
            has_masters=bool(self.masters), fused=self.fused, heap=self.heap))

    def _compile(self, code: str) -> Callable:
        """``train_step`` compiled from ``code``, in a namespace that holds what the source names."""
        namespace = {"torch": torch, "contextlib": contextlib, "self": self, "model": self.model,
                     "loss_fn": self.loss_fn, "optimizer": self.optimizer, "S": self.state, "P": self.parallel,
                     "_call": self._forward, "check_loss": check_loss}
        exec(compile(code, "<autocastfx train_step>", "exec"), namespace)  # noqa: S102 - our own source
        return namespace["train_step"]

    def _forward(self, model: nn.Module, inputs: Any) -> Any:
        """The module's forward, as the step's source calls it (``_call``), counted for the input checks; over
        ``torch.compile(gm)``, its inputs' free sizes marked first (before the compiler runs)."""
        if self._compiled_free and not isinstance(inputs, Forwarded):
            args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs) \
                if isinstance(inputs, dict) else ((inputs,), {})
            _calls.mark_free_dims(self._compiled_free, args, kwargs)
        out = _call(model, inputs)
        self.checker.forwards += 1
        return out

    def _grads_to_masters(self) -> list[torch.Tensor]:
        """The low-precision gradients as float32, in views of one buffer per bucket allocated for this update
        (zero where the loss did not reach a parameter). The copy goes bucket by bucket and frees each bucket's low
        ``.grad`` as soon as it is copied, so at most one bucket is held in both precisions."""
        local = self.parallel.local
        device = self.masters[0].device
        views = []
        for (lo, hi), numel in zip(self._buckets, self._bucket_numel):
            flat = torch.empty(numel, dtype=torch.float32, device=device)
            views += [flat.as_strided(*spec) if spec is not None else torch.empty_like(local(m))
                      for spec, m in zip(self._grad_views[lo:hi], self.masters[lo:hi])]
        for lo, hi in self._buckets:
            have = [(v, local(p.grad)) for v, p in zip(views[lo:hi], self.lows[lo:hi]) if p.grad is not None]
            if have:
                torch._foreach_copy_([v for v, _ in have], [g for _, g in have])
            if len(have) != hi - lo:
                torch._foreach_zero_([v for v, p in zip(views[lo:hi], self.lows[lo:hi]) if p.grad is None])
            for p in self.lows[lo:hi]:
                p.grad = None
        return views

    @property
    def optimizer_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # ---------------------------------------------------------------------------------------- public
    def __call__(self, inputs, *targets):
        """``inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs; ``targets`` go to
        ``loss_fn(output, *targets)``. Returns the loss (a device tensor, not read)."""
        check_grad_mode()
        key = signature(inputs, targets)
        if key in self.checker.seen:
            loss = self._fn(inputs, *targets)
        else:  # a new signature: checked, and its first run guarded
            bound = self.checker.check(inputs, targets)
            with self.checker.guard(inputs, bound):
                loss = self._fn(inputs, *targets)
            self.checker.seen.add(key)
        self.state.poll()
        return loss

    def after_forward(self, output: Any, *targets) -> torch.Tensor:
        """The step for a forward the caller ran itself: ``loss_fn(output, *targets)``, then backward, and on the
        last micro-batch of an update the whole update, exactly as ``step(inputs, *targets)`` does after its
        forward. For trainers whose own code calls the model (Lightning's ``training_step``); the output must come
        from the converted module's forward in this grad-enabled region."""
        check_grad_mode()
        loss = self._fn(Forwarded(output), *targets)
        self.state.poll()
        return loss

    @property
    def stats(self) -> StepStats:
        S = self.state
        return StepStats(S.scale, S.steps, S.skipped, S.overflow_history, S.scale_history, self.grad_norm)

    def check(self) -> None:
        """Raise LossScaleError now if the scale is stuck at min_scale with gradients still overflowing (one host
        read; every call already raises it within two steps without one)."""
        self.state.check()

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume bit for bit: scale state, masters, the module, the optimizer, the RNG. This
        process's view (under FSDP2, its shards): ``autocastfx.save_checkpoint`` writes one checkpoint for all
        ranks that loads on any number of them."""
        return {
            "scaler": self.state.state_dict(),
            "masters": {n: m.detach().clone() for n, m in zip(self.names, self.masters)},
            "model": {k: v.clone() for k, v in self.gm.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "micro": self.micro,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        missing = {"scaler", "masters", "model", "optimizer"} - set(sd)
        if missing:
            raise KeyError(f"not a train_step state_dict: missing {sorted(missing)}")
        if set(sd["masters"]) != set(self.names):
            raise ValueError(f"the state_dict's masters {sorted(sd['masters'])[:5]} do not match this module's "
                             f"{self.names[:5]}: was it saved from a step over the same converted model?")
        self.gm.load_state_dict(sd["model"])
        with torch.no_grad():
            for n, m in zip(self.names, self.masters):
                m.copy_(sd["masters"][n])
            if self.masters:
                torch._foreach_copy_(self.parallel.locals(self.lows), self.parallel.locals(self.masters))
        _load_optimizer(self.optimizer, sd["optimizer"], self.fused)
        self.state.load_state_dict(sd["scaler"])
        self.micro = sd.get("micro", 0)
        for p in self.grad_holders:  # gradients of this run's micro-batches are not the checkpoint's
            p.grad = None
        self.parallel.drop_unsynced_grads()
        if sd.get("rng") is not None:
            torch.set_rng_state(sd["rng"])
        if sd.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda_rng"])


# ---------------------------------------------------------------------- the optimizer, pointed at the masters
def _repointed_groups(gm, optimizer: torch.optim.Optimizer, info) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """For each optimizer group, (tensor it holds, float32 master or module parameter to hold instead).
    Raises StepError for a tensor that belongs to neither model, before anything is changed."""
    gm_params, by_id = _weights.aliases(gm)
    canonical = {i: names[0] for i, names in by_id.items()}
    alias = {name: canonical[id(p)] for name, p in gm_params.items()}
    master_by_name = all_masters(gm)
    master_ids = {id(m) for m in master_by_name.values()}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        pairs = []
        for i, p in enumerate(group["params"]):
            if id(p) in master_ids:
                pairs.append((p, p))
                continue
            name = canonical.get(id(p)) or next(
                (n for n in info.source_params.get(id(p), ()) if n in alias), None)
            if name is None and id(p) in info.source_params:
                continue  # the model's, but the graph never reads it: no gradient, as in the model itself
            if name is None:
                raise StepError(
                    f"the optimizer holds a tensor of shape {tuple(p.shape)} (param group {g}, entry {i}) that is "
                    "neither a parameter of the converted module nor of the model it was converted from: build "
                    "the optimizer over gm.parameters() or over the original model's parameters, after convert() "
                    "(and after fully_shard() or autocastfx.shard(), which replace the module's parameters)")
            name = alias.get(name, name)
            pairs.append((p, master_by_name.get(name, gm_params.get(name))))
        groups.append(pairs)
    return groups


def _repoint_optimizer(optimizer: torch.optim.Optimizer, groups: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Point the optimizer's groups at the float32 masters (and the module's float32 parameters)."""
    for group, pairs in zip(optimizer.param_groups, groups):
        new = []
        for p, target in pairs:
            if target is not p and p in optimizer.state:
                optimizer.state[target] = optimizer.state.pop(p)
            if all(target is not q for q in new):
                new.append(target)
        group["params"] = new


def _cpu_heap(keep: bool, device) -> str | None:
    """On the CPU: glibc told to keep freed memory (unless ``keep`` is False), and the state in words for the
    step's docstring; None on other devices, whose allocators cache already."""
    if torch.device(device).type != "cpu":
        return None
    if keep:
        _heap.keep_freed_memory()
    elif not _heap.kept():  # another step of this process may have asked already: the setting is process-wide
        return "CPU memory left to the allocator (keep_cpu_memory=False)"
    return _heap.status()


def _use_fused_skip(opt: torch.optim.Optimizer, parallel: Local) -> bool:
    """Fused optimizers take ``found_inf`` and skip the update on the device; turn it on where it exists."""
    if getattr(opt, "_step_supports_amp_scaling", False):
        return True
    if "fused" not in opt.defaults or not parallel.allows_fused(opt):
        return False
    for group in opt.param_groups:
        group["fused"] = True
        if "foreach" in group:
            group["foreach"] = False
        if group.get("differentiable"):
            return False
    opt.defaults["fused"] = True
    opt._step_supports_amp_scaling = True
    if isinstance(opt, torch.optim.SGD):
        # a skipped first step would leave fused SGD's momentum buffers uninitialised: start them at zero
        # (equal to PyTorch's first-step buffer when dampening == 0)
        for group in opt.param_groups:
            if group["momentum"] and not group["dampening"]:
                for p in group["params"]:
                    opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    return True

def _load_optimizer(optimizer: torch.optim.Optimizer, sd: dict[str, Any], fused: bool) -> None:
    """Load a checkpoint's optimizer state into the step's optimizer, keeping what the step set up on it.

    The optimizer keeps the checkpoint's tensors where no cast is needed: they are copied, so that training on does
    not write into the caller's checkpoint. Then the fused, on-device skip again where the step uses it (a
    checkpoint from a plain optimizer carries fused=False in its groups)."""
    opt_sd = dict(sd)
    opt_sd["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
                       for k, st in sd["state"].items()}
    own = [{k: g[k] for k in ("capturable",) if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(opt_sd)
    for group, keep in zip(optimizer.param_groups, own):  # a CUDA-graph step's checkpoint says
        group.update(keep)                                # capturable=True: this step's own flag stays
        if not (group.get("capturable") or group.get("fused")):
            for p in group["params"]:  # where torch keeps `step` for a plain loop: on the CPU
                st = optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")) and st["step"].device.type != "cpu":
                    st["step"] = st["step"].to("cpu", torch.float32)
    if fused and "fused" in optimizer.defaults:
        for group in optimizer.param_groups:
            group["fused"] = True
            if "foreach" in group:
                group["foreach"] = False


BUCKET_ELEMENTS = 1 << 24  # 16M elements (32 MiB of float16 gradients): one fused copy per bucket
# On the CPU a bucket's float32 buffer stays under glibc's largest mmap threshold (32 MiB): a larger allocation is
# a fresh mmap every update, whose first touch page-faults and zeroes it (ResNet-50, batch 16, 2 cores: one 100 MB
# buffer per update cost 37 ms a step, 12% of the step); smaller ones are reused from the heap. CUDA's caching
# allocator reuses any size.
CPU_BUCKET_ELEMENTS = 1 << 22  # 4M elements: 16 MiB of float32 gradients


def _view_specs(masters: list[torch.Tensor]) -> list[tuple | None]:
    """(shape, stride, offset) of each master's gradient in one flat buffer: the master's own shape and strides,
    because an optimizer's fused and foreach kernels walk a parameter and its gradient as flat memory, and a
    gradient laid out unlike its parameter (an NCHW gradient for a channels_last weight) would pair the wrong
    elements. None for a master that is not dense (never made by autocastfx, but possible after a user's own
    surgery): its gradient gets a tensor of its own."""
    specs, offset = [], 0
    for m in masters:
        specs.append((tuple(m.shape), m.stride(), offset) if _dense(m) else None)
        offset += m.numel()
    return specs


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``t.numel()`` elements of memory with no overlap, in some order of its dims."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _buckets(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose sizes add up to at most ``limit`` (a larger tensor alone)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            out.append((start, i))
            start, total = i, 0
        total += n
    if sizes:
        out.append((start, len(sizes)))
    return out


__all__ = ["TrainStep", "Local", "StepStats", "LossScaleError", "StepError", "DYNAMIC"]
