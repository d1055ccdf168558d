"""The training step captured once as CUDA graphs and replayed, which works because a fused-optimizer step never
reads the device from the host; what a graph cannot do is refused up front (docs/cuda_graphs.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
from ..base.quiet import torch_internal_warnings_off
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from . import step as _step

#: Python values an input may hold beside tensors; a graph bakes them in, so they must not change.
CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)

_REPLAY_RULE = ("a CUDA graph replays fixed shapes, dtypes and devices: make a CudaGraphStep per shape, or pad "
                "batches to one shape, or call recapture() to capture again at the new shape")


# ----------------------------------------------------------------------------------- the optimizer
def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Make ``optimizer`` replayable inside a CUDA graph, in place (idempotent): ``capturable=True``, the lr a
    float32 tensor on ``device`` (fused kernels read it through a float pointer, so it is rounded to float32), and
    state tensors moved to their parameter's device."""
    device = torch.device(device)
    if "capturable" in optimizer.defaults:
        optimizer.defaults["capturable"] = True
    for group in optimizer.param_groups:
        if "capturable" in group or "capturable" in optimizer.defaults:
            group["capturable"] = True
        group["lr"] = _device_lr(group["lr"], device)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != p.device:
                    state[key] = value.to(p.device, dtype=torch.float32 if key == "step" else value.dtype)


def _device_lr(lr: Any, device: torch.device) -> torch.Tensor:
    if torch.is_tensor(lr) and lr.device == device and lr.dtype == torch.float32 and lr.dim() == 0:
        return lr
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError(f"a tensor learning rate must hold one value, got shape {tuple(lr.shape)}")
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def _fill(dst: torch.Tensor, value: Any) -> None:
    """Write a float or a one-element tensor into ``dst`` without replacing it (a graph holds its address)."""
    with torch.no_grad():
        if torch.is_tensor(value):
            dst.copy_(value.reshape(dst.shape))
        else:
            dst.fill_(float(value))


def baked_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer settings a capture freezes: every option of ``defaults`` that is not a tensor."""
    keys = set(optimizer.defaults) - {"params", "lr"}
    return [{k: v for k, v in g.items() if k in keys and not torch.is_tensor(v)} for g in optimizer.param_groups]


def follow_optimizer_settings(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor],
                              baked: list[dict[str, Any]]) -> None:
    """Before a replay: copy a replaced lr into the captured lr tensor, and refuse a changed baked-in setting."""
    groups = optimizer.param_groups
    if len(groups) != len(lrs):
        raise RuntimeError(f"the optimizer has {len(groups)} parameter groups, the graph was captured with "
                           f"{len(lrs)}: call recapture() after add_param_group()")
    for i, (group, lr, fixed) in enumerate(zip(groups, lrs, baked)):
        if group["lr"] is not lr:
            _fill(lr, group["lr"])
            group["lr"] = lr
        for key, value in fixed.items():
            if group.get(key) != value:
                raise RuntimeError(
                    f"param_groups[{i}][{key!r}] changed from {value!r} to {group.get(key)!r} after capture, and the "
                    "graph replays the value it captured (only the lr is a tensor it reads): call recapture() after "
                    "changing it, or keep it fixed (e.g. OneCycleLR(..., cycle_momentum=False))")


def check_modes(modules: list[torch.nn.Module], captured: list[bool]) -> None:
    """Before a replay: refuse a train()/eval() switch since capture (the graph replays the captured mode)."""
    for module, was in zip(modules, captured):
        if module.training != was:
            now, then = ("train", "eval") if module.training else ("eval", "train")
            raise RuntimeError(
                f"the model was switched to {now} mode after capture ({type(module).__name__}.training is now "
                f"{module.training}), and the graph replays the {then} mode it captured: switch it back "
                f"(gm.{then}()) before calling the graph step, or call recapture() to capture the {now} mode")


# ------------------------------------------------------------------------------ input signatures
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)} on {self.device}"


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a capture fixes about a call's arguments: their structure, each tensor's spec, each constant."""
    spec: Any                                   # the pytree structure of (inputs, targets)
    leaves: tuple[tuple[str, Any], ...]         # (name, TensorSpec or constant), in flattening order


def signature(inputs: Any, targets: tuple) -> tuple[Signature, list[Any]]:
    """The call's signature and flat leaves; TypeError for a leaf that is neither a tensor nor a plain constant."""
    flat, spec = tree_flatten_with_path((inputs, tuple(targets)))
    leaves, values = [], []
    for path, value in flat:
        name = ("inputs" if path[0].idx == 0 else "targets") + keystr(path[1:])
        if torch.is_tensor(value):
            desc: Any = TensorSpec(tuple(value.shape), value.dtype, value.device)
        elif isinstance(value, CONSTANT_TYPES):
            desc = value
        else:
            raise TypeError(f"{name} is a {type(value).__name__}: a CUDA graph step takes tensors (in tuples, lists "
                            "and dicts) and plain Python constants; pass the tensors it holds instead")
        leaves.append((name, desc))
        values.append(value)
    return Signature(spec, tuple(leaves)), values


def mismatch(captured: Signature, given: Signature) -> str | None:
    """Why ``given`` cannot replay a graph captured for ``captured``; None when it can."""
    if captured.spec != given.spec:
        return (f"the arguments' structure changed: captured {_names(captured)}, given {_names(given)}. "
                + _REPLAY_RULE)
    for (name, was), (_, now) in zip(captured.leaves, given.leaves):
        if isinstance(was, TensorSpec) != isinstance(now, TensorSpec):
            return f"{name}: captured {was!s}, given {now!s}. " + _REPLAY_RULE
        if isinstance(was, TensorSpec):
            if was != now:
                return f"{name}: captured {was}, given {now}. " + _REPLAY_RULE
        elif type(was) is not type(now) or was != now:
            return (f"{name}: captured the constant {was!r}, given {now!r}; a graph bakes Python values in. "
                    + _REPLAY_RULE)
    return None


def _names(sig: Signature) -> str:
    return "(" + ", ".join(name for name, _ in sig.leaves) + ")"


def check_devices(sig: Signature, device: torch.device) -> None:
    """Every tensor argument must already be on the model's CUDA device: a graph reads device memory only."""
    for name, desc in sig.leaves:
        if isinstance(desc, TensorSpec) and desc.device != device:
            raise ValueError(f"{name} is on {desc.device}, the model on {device}: a CUDA graph needs its inputs "
                             f"on the model's device; move them there first (x.to('{device}', non_blocking=True) "
                             "from pinned memory)")


# ---------------------------------------------------------------------------- capture schedule
def positions(accum_steps: int) -> list[tuple[str, int]]:
    """The graphs to capture, in order, with the micro-batch position each stands for: ``first`` writes fresh
    gradients, ``middle`` adds to them, ``update`` adds the last and steps the optimizer."""
    if accum_steps == 1:
        return [("update", 0)]
    return [("first", 0)] + ([("middle", 1)] if accum_steps > 2 else []) + [("update", accum_steps - 1)]


def kind_at(position: int, accum_steps: int) -> str:
    if position == accum_steps - 1:
        return "update"
    return "first" if position == 0 else "middle"


def ready_to_capture(calls: int, micro: int, warmup: int, accum_steps: int) -> bool:
    """Capture at a cycle's start, after ``warmup`` eager calls and at least one update (optimizer state created
    inside a capture would be re-created every replay)."""
    return calls >= max(warmup, accum_steps) and micro % accum_steps == 0


@contextlib.contextmanager
def _eager_capturable():
    """Capturable optimizers warn when stepped outside a graph; the warm-up calls do that on purpose."""
    with torch_internal_warnings_off():
        yield


# ------------------------------------------------------------------------------------------ capture
def _record_graphs(step, device: torch.device, static_inputs: Any,
                   static_targets: tuple) -> tuple[dict[str, torch.cuda.CUDAGraph], dict[str, torch.Tensor]]:
    """Record ``step`` on the static buffers, one graph per kind of micro-batch (:func:`positions`) in one memory
    pool; returns the graphs and their loss tensors by kind, with the step's host state put back.

    A later graph's tensors may lie in an earlier one's scratch memory (PyTorch, "Sharing memory across captures"),
    so the clipping norm ``stats.grad_norm`` reads lives outside the pool."""
    micro = step.micro
    for p in step.all_params:
        p.grad = None
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    current = torch.cuda.current_stream(device)
    try:
        with torch.cuda.device(device):
            for kind, position in positions(step.accum_steps):
                step.micro = micro + position
                graph = torch.cuda.CUDAGraph()
                # thread_local (as torch.compile's): a DataLoader pin-memory thread's CUDA calls do not break
                # the capture; a sync on the capturing stream (.item()) still fails
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    outputs[kind] = step._fn(static_inputs, *static_targets)
                graphs[kind] = graph
                if kind == "first":  # the gradients every replay inside a cycle accumulates into
                    outputs["grads"] = {n: p.grad for n, p in step.gm.named_parameters() if p.grad is not None}
    except Exception as e:
        # torch.cuda.graph.__exit__ ends the capture before restoring the stream; when ending raises (after any
        # error inside the capture), this thread would stay on the capture stream
        torch.cuda.set_stream(current)
        first = e.__context__ if e.__context__ is not None else e   # what broke the capture, before capture_end
        cause = f"{type(first).__name__}: {first}" + (
            f"; ending the capture then raised {type(e).__name__}: {e}" if first is not e else "")
        raise RuntimeError(
            f"capturing the training step in a CUDA graph failed: {cause}\nInside a graph "
            "nothing may read the device from the host or create CPU tensors: .item(), bool(tensor), a Python "
            "branch on a tensor, torch.tensor(...) in forward, BatchNorm(momentum=None). Remove it from the model "
            "or the loss, or train with the eager step (which has just run this batch).") from e
    finally:
        step.micro = micro
        for p in step.all_params:
            p.grad = None
    return graphs, outputs


# ------------------------------------------------------------------------------- state dicts
def portable_state_dict(step, grads: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """``step.state_dict()`` with optimizer state cloned and tensor hyperparameters as floats, so it loads into an
    eager step as well as a graph step; inside a cycle, ``grads`` (the captured graphs' gradients by parameter name,
    which no ``.grad`` holds between replays) are its pending gradients."""
    sd = step.state_dict()
    if grads and step.micro % step.accum_steps != 0 and not sd["grads"]:
        sd["grads"] = {n: g.detach().clone() for n, g in grads.items()}
    opt = dict(sd["optimizer"])
    opt["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                    for k, s in opt["state"].items()}
    opt["param_groups"] = [{k: float(v) if torch.is_tensor(v) and v.numel() == 1 else v for k, v in g.items()}
                           for g in opt["param_groups"]]
    sd["optimizer"] = opt
    return sd


def load_keeping_tensors(step, sd: dict[str, Any]) -> bool:
    """``step.load_state_dict(sd)``, copying the optimizer state and lr into the tensors a captured graph holds;
    False when the loaded state does not fit them (the graphs must be captured again)."""
    opt = step.optimizer
    before = {p: dict(s) for p, s in opt.state.items()}
    lrs = [g["lr"] for g in opt.param_groups]
    if isinstance(sd.get("optimizer"), dict) and "state" in sd["optimizer"]:
        # Optimizer.load_state_dict keeps the given tensors where no cast is needed: load copies
        sd = dict(sd, optimizer=dict(sd["optimizer"], state={
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in sd["optimizer"]["state"].items()}))
    step.load_state_dict(sd)
    fits = set(opt.state) == set(before)
    with torch.no_grad():
        for p, old in before.items():
            new = opt.state.get(p)
            if new is None:
                continue
            fits &= set(new) == set(old)
            for key, value in old.items():
                loaded = new.get(key)
                if torch.is_tensor(value) and torch.is_tensor(loaded) and loaded.shape == value.shape:
                    value.copy_(loaded)
                    new[key] = value
                elif torch.is_tensor(value):
                    fits = False
    for group, lr in zip(opt.param_groups, lrs):
        if torch.is_tensor(lr):
            _fill(lr, group["lr"])
            group["lr"] = lr
    return fits


# ------------------------------------------------------------------------------------ the step
class CudaGraphStep:
    """``gstep(inputs, *targets) -> loss``: a :class:`TrainStep` replayed as CUDA graphs.

    The first ``warmup`` calls (at least ``accum_steps``) run the eager step on a side stream, and the last of them
    captures; later calls copy their tensors into :attr:`static_inputs` / :attr:`static_targets` and replay. A
    replay's loss tensor is overwritten by the next replay (``loss.clone()`` to keep it). The capture fixes the
    arguments' shapes, dtypes, devices and constants, every optimizer setting but the lr, and the train/eval mode:
    a change raises (``recapture()`` captures again).
    """

    def __init__(self, step, *, warmup: int = 3):
        if not isinstance(step, _step.TrainStep):
            raise TypeError(f"CudaGraphStep wraps the step autocastfx.train_step() returns, got {type(step).__name__}")
        if not (isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 1):
            raise ValueError(f"warmup must be an int >= 1 (eager calls before capture: the optimizer's state must "
                             f"exist before it is captured), got {warmup!r}")
        _refuse_what_cannot_be_captured(step)
        self.step = step
        self.warmup = warmup
        self.device = step.state.scale.device
        make_capturable(step.optimizer, self.device)
        self._side = torch.cuda.Stream(device=self.device)
        self.replays = 0
        self.captures = 0
        self._calls = 0        # eager calls since the warm-up last (re)started
        self._drop()

    # ----------------------------------------------------------------------------- public surface
    @property
    def graphs(self) -> dict[str, torch.cuda.CUDAGraph]:
        """The captured graphs by kind: ``update``; with accumulation also ``first`` and ``middle``."""
        return dict(self._graphs or {})

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph that updates the weights; None before capture."""
        return (self._graphs or {}).get("update")

    @property
    def stats(self):
        return self.step.stats

    @property
    def code(self) -> str:
        return self.step.code

    def check(self) -> None:
        """Raise LossScaleError now if the scale is stuck at min_scale (a host read)."""
        self.step.check()

    def recapture(self) -> None:
        """Drop the graphs: the next call runs eagerly and captures again, for its arguments' shapes."""
        n = self.step.accum_steps
        if self._graphs is not None and self.step.micro % n != 0:
            raise RuntimeError(
                f"recapture() inside an accumulation cycle (micro-batch {self.step.micro % n} of {n}) would drop "
                "the gradients the graphs have accumulated so far: call it after the update, every "
                "accum_steps calls")
        self._drop()

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the step's state that loads into this step, a new CudaGraphStep or an eager step, and
        resumes bit for bit."""
        replaying = self._graphs is not None and not self._eager_to_cycle_start
        return portable_state_dict(self.step, self._outputs.get("grads") if replaying else None)

    def reloaded(self) -> None:
        """Drop the graphs after ``autocastfx.load_checkpoint`` (they may read tensors the optimizer has
        replaced), to capture again after the warm-up."""
        self._drop()
        self._calls = 0
        self._eager_to_cycle_start = self.step.micro % self.step.accum_steps != 0

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load into the tensors the graphs read (their addresses must not change); a state that does not fit
        them or a changed setting means capturing again, and a mid-cycle position eager calls to the cycle's end."""
        fits = load_keeping_tensors(self.step, sd)
        make_capturable(self.step.optimizer, self.device)
        if not fits:
            self._drop()
            self._calls = 0
        elif self._graphs is not None and (baked_settings(self.step.optimizer) != self._baked
                                           or self.step.state.auto_pending):
            self._drop()
        if self._graphs is not None:  # loaded into the tensors the graphs read: their new holders are theirs
            opt = self.step.optimizer
            self._opt_state, self._opt_entries = opt.state, [(p, opt.state.get(p)) for p in self._params]
        self._eager_to_cycle_start = self.step.micro % self.step.accum_steps != 0

    def __call__(self, inputs, *targets):
        sig, leaves = signature(inputs, targets)
        check_devices(sig, self.device)
        n = self.step.accum_steps
        position = self.step.micro % n
        if self._eager_to_cycle_start and position == 0:
            self._eager_to_cycle_start = False
        if self._graphs is not None and not self._eager_to_cycle_start and self._tensors_changed(position):
            self._drop()  # at a cycle's start: eager calls, then a capture of the tensors as they are now
            self._calls = 0
        if self._graphs is not None and not self._eager_to_cycle_start:
            why = mismatch(self._sig, sig)
            if why is not None:
                raise ValueError(why)
            check_modes(self._modules, self._modes)
            follow_optimizer_settings(self.step.optimizer, self._lrs, self._baked)
            return self._replay(leaves, position)
        loss = self._eager(inputs, targets)
        # init_scale="auto" picks the scale on a host branch at the first update: capture after it, or every
        # replay would jump the scale again
        if (self._graphs is None and not self.step.state.auto_pending
                and ready_to_capture(self._calls, self.step.micro, self.warmup, n)):
            self._capture(sig, leaves)
        return loss

    # ---------------------------------------------------------------------------------- internals
    def _drop(self) -> None:
        self._graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self._outputs: dict[str, torch.Tensor] = {}
        self._sig: Signature | None = None
        self._statics: list[torch.Tensor] = []
        self.static_inputs: Any = None
        self.static_targets: tuple | None = None
        self._baked: list[dict[str, Any]] = []
        self._lrs: list[torch.Tensor] = []
        self._modules: list[torch.nn.Module] = []
        self._modes: list[bool] = []
        self._params: list[torch.Tensor] = []  # what the graphs read, as captured (_tensors_changed)
        self._trains: list[bool] = []
        self._opt_state: Any = None
        self._opt_entries: list[tuple] = []
        self._eager_to_cycle_start = False

    def _eager(self, inputs, targets):
        """One eager step on the side stream (PyTorch's warm-up recipe for capture)."""
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(self._side), _eager_capturable():
            loss = self.step(inputs, *targets)
        current.wait_stream(self._side)
        self._calls += 1
        return loss

    def _capture(self, sig: Signature, leaves: list[Any]) -> None:
        """Capture for these arguments' shapes into new static buffers, and note what the graphs bake in."""
        step = self.step
        with torch.no_grad():
            statics = [x.detach().clone() if torch.is_tensor(x) else x for x in leaves]
        static_inputs, static_targets = tree_unflatten(statics, sig.spec)
        graphs, outputs = _record_graphs(step, self.device, static_inputs, static_targets)
        self._graphs, self._outputs, self._sig = graphs, outputs, sig
        self._statics = [s for s in statics if torch.is_tensor(s)]
        self.static_inputs, self.static_targets = static_inputs, static_targets
        self._baked = baked_settings(step.optimizer)
        self._lrs = [g["lr"] for g in step.optimizer.param_groups]
        self._modules = list(step.gm.modules())
        self._modes = [m.training for m in self._modules]
        self._params = list(step.gm.parameters())
        self._trains = [p.requires_grad for p in self._params]
        self._opt_state = step.optimizer.state
        self._opt_entries = [(p, step.optimizer.state.get(p)) for p in self._params]
        self.captures += 1

    def _tensors_changed(self, position: int) -> bool:
        """Whether the tensors the graphs read were replaced or their ``requires_grad`` flipped since capture (a
        layer frozen or a head swapped in, ``optimizer.load_state_dict``); RuntimeError where that happened inside
        an accumulation cycle, whose gradients only the graphs hold."""
        params = list(self.step.gm.parameters())
        opt = self.step.optimizer
        same = (len(params) == len(self._params) and all(p is q for p, q in zip(params, self._params))
                and [p.requires_grad for p in params] == self._trains and opt.state is self._opt_state
                and all(opt.state.get(p) is s for p, s in self._opt_entries))
        if same:
            return False
        if position != 0:
            raise RuntimeError(
                "the model's parameters or the optimizer's state changed inside an accumulation cycle (a layer "
                "frozen or replaced, optimizer.load_state_dict): the captured graphs read the old ones, and the "
                "cycle's gradients are theirs. Make such changes after the cycle's last micro-batch (when "
                "step.micro % accum_steps == 0): the graph step then captures again")
        return True

    def _replay(self, leaves: list[Any], position: int) -> torch.Tensor:
        kind = kind_at(position, self.step.accum_steps)
        pairs = [(s, x) for s, x in zip(self._statics, (v for v in leaves if torch.is_tensor(v))) if s is not x]
        with torch.cuda.device(self.device):
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([s for s, _ in pairs], [x for _, x in pairs], non_blocking=True)
            self._graphs[kind].replay()
            if self.step.accum_steps > 1:
                self.step.micro += 1   # as the eager call would
            self.replays += 1
            self.step.optimizer._opt_called = True   # it did step, inside the graph: LR schedulers check this flag
            self.step.state.poll()     # the stuck-scale flag the graph copied to the host: raises within two calls
        return self._outputs[kind]


def refuse_before_building(model, optimizer, on_overflow: str) -> None:
    """:func:`_refuse_what_cannot_be_captured` for ``train_step(..., cuda_graph=True)``, before the step is built."""
    import types

    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    gm = model.module if ddp else model
    params = list(gm.parameters()) if isinstance(gm, torch.nn.Module) else []
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    device = params[0].device if params else torch.device("cpu")
    kind = "ddp" if ddp else "fsdp" if _is_fsdp(gm) else "local"
    _refuse_what_cannot_be_captured(types.SimpleNamespace(
        parallel=types.SimpleNamespace(kind=kind), on_overflow=on_overflow, fused=fused, optimizer=optimizer,
        all_params=params, gm=gm, state=types.SimpleNamespace(scale=torch.empty(0, device=device))))


def _is_fsdp(module) -> bool:
    from .parallel import is_fsdp
    return isinstance(module, torch.nn.Module) and any(is_fsdp(m) for m in module.modules())


def _refuse_what_cannot_be_captured(step) -> None:
    """Every reason a step cannot be a graph, checked before anything is changed."""
    if step.parallel.kind == "fsdp":
        raise ValueError(
            "CudaGraphStep does not support FSDP2 (fully_shard): FSDP2 all-gathers and reduce-scatters from Python "
            "hooks that allocate and free their buffers each step and reshard between forward and backward, which "
            "a replayed graph cannot follow. Train a sharded module with the eager step (cuda_graph=False): it has "
            "no per-step host sync either; or graph the forward of each block with torch.compile.")
    if step.parallel.kind == "ddp":
        raise ValueError(
            "CudaGraphStep does not support DistributedDataParallel: capturing DDP needs its own recipe (the "
            "reducer's bucket all-reduces captured with NCCL, DDP built and warmed up on a side stream, "
            "NCCL_ASYNC_ERROR_HANDLING=0), which this wrapper does not provide. Train with the eager step under "
            "DDP: it has no per-step host sync either.")
    if step.on_overflow == "retry":
        raise ValueError(
            "on_overflow='retry' cannot be captured in a CUDA graph: deciding to redo the batch reads found_inf on "
            "the host after every attempt. Use on_overflow='skip' (the default) with CudaGraphStep.")
    if not step.fused:
        name = type(step.optimizer).__name__
        raise ValueError(
            f"{name} cannot run inside a CUDA graph here: it is not a fused optimizer, which takes found_inf, so the "
            "step reads found_inf on the host to skip an overflowing update, and a replay cannot. Build Adam, AdamW "
            "or SGD with fused=True (the graph makes them capturable), or use the eager step.")
    tensors = step.all_params + list(step.gm.buffers())
    devices = {t.device for t in tensors} | {step.state.scale.device}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"the model is on {where}: a CUDA graph needs every parameter, buffer and input on one CUDA device. "
            "Move the model there before convert() (model.cuda()), build the optimizer and train_step() after, "
            "and pass CUDA inputs.")


__all__ = ["CudaGraphStep", "refuse_before_building", "make_capturable", "signature", "mismatch", "check_devices",
           "Signature", "TensorSpec", "follow_optimizer_settings", "baked_settings", "check_modes", "positions",
           "kind_at", "ready_to_capture", "portable_state_dict", "load_keeping_tensors"]
