"""Checks of the training step's loss and inputs (against the conversion's example), on host metadata only.
The first call with a new input signature runs guarded, so a failure inside the forward is undone and reported in
terms of the user's inputs.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten
from ..base import keys as K
from ..base.errors import one_line


class StepError(ValueError):
    """The training step was given something it cannot train on; raised before the step changed anything."""


# ------------------------------------------------------------------------------------------------ the loss

def check_loss(loss: Any) -> torch.Tensor:
    """The loss, or StepError unless it is one floating-point number connected to the weights."""
    if not isinstance(loss, torch.Tensor):
        none = (" (None: a model that returns its loss only when given targets was converted without them: "
                "convert it with the targets in the example, autocastfx.convert(model, (x, y)))"
                if loss is None else "")
        raise StepError(f"loss_fn returned {type(loss).__name__}, not a tensor{none}: return the loss tensor itself "
                        "(for a model that computes its own loss, loss_fn=lambda out: out.loss, out['loss'], or "
                        "out[1] for a (logits, loss) tuple)")
    if not loss.is_floating_point():
        raise StepError(f"the loss is {loss.dtype}, not floating point, so it has no gradient: compute it from the "
                        "model's floating-point output (e.g. F.cross_entropy(out, y)), not from argmax, "
                        "comparisons or counts")
    if loss.numel() != 1:
        raise StepError(f"the loss has shape {tuple(loss.shape)}, but the step needs one number to scale and "
                        "differentiate: reduce it with .mean() (or reduction='mean' in the loss function)")
    if not loss.requires_grad or loss.grad_fn is None:
        raise StepError("the loss is not connected to the weights (requires_grad=False, no grad_fn): it was "
                        "computed under torch.no_grad(), from detached outputs (.detach(), .item(), .numpy()), "
                        "or from frozen parameters only. Compute it inside loss_fn from the model's output, "
                        "with gradients enabled")
    return loss


def check_grad_mode() -> None:
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        raise StepError("the training step was called with gradients disabled (inside torch.no_grad() or "
                        "torch.inference_mode()): call it outside those blocks; evaluate with gm(x) instead")


# -------------------------------------------------------------------------------------------- the inputs

def signature(inputs: Any, targets: tuple) -> Any:
    """A hashable summary of one call: every tensor's shape, dtype and device, small Python values as they are."""
    return _sig(inputs), _sig(targets)


def _sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.shape, v.dtype, v.device
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_sig(x) for x in v)
    if isinstance(v, dict):
        return dict, tuple((k, _sig(x)) for k, x in v.items())
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return type(v)


class InputChecker:
    """Compares a call's inputs with the example ``convert()`` recorded, and guards a new signature's first run."""

    def __init__(self, gm: fx.GraphModule, device: torch.device):
        self.gm, self.device = gm, device
        self.forwards = 0  # counted by TrainStep.call_model
        self.forward_sig = _forward_signature(gm)
        self.example = _example_infos(gm, self.forward_sig)
        self.seen: set = set()

    # --- before the run: what host metadata alone can tell
    def check(self, inputs: Any, targets: tuple) -> dict[str, Any]:
        """The bound inputs by name; StepError for inputs that do not fit the forward, sit on another device, or
        change a floating input's dtype (the cast plan assumes the example's)."""
        bound = self._bind(inputs)
        self._check_devices(inputs, bound, targets)
        self._check_dtypes(inputs, bound)
        return bound

    def _check_devices(self, inputs: Any, bound: dict[str, Any], targets: tuple) -> None:
        for label, t in self._all_tensors(inputs, bound, targets):
            if t.device != self.device and not (t.dim() == 0 and t.device.type == "cpu"):  # CPU scalars mix
                raise StepError(f"{label} is on {t.device} but the converted module is on {self.device}: move it "
                                f"there first (.to('{self.device}')), the device of the module's weights")

    def _check_dtypes(self, inputs: Any, bound: dict[str, Any]) -> None:
        for name, value in bound.items():
            info = self.example.get(name)
            if not isinstance(value, torch.Tensor) or not _is_info(info):
                continue
            label, want, got = self._label(name, inputs), _dtype(info.dtype), _dtype(value.dtype)
            example = f"the module was converted with a {want} {name} of shape {_shape(info.shape)}"
            if info.dtype.is_floating_point and value.dtype != info.dtype:
                fix = f"pass {name}.to({want})" if value.is_floating_point() else f"pass a {want} tensor"
                raise StepError(f"{label} is {got}, but {example} and its cast plan assumes {want}: {fix}, or "
                                f"convert again with a {got} example")
            if value.is_floating_point() and not info.dtype.is_floating_point:
                raise StepError(f"{label} is {got}, but {example}: pass {name}.to({want})")

    def _bind(self, inputs: Any) -> dict[str, Any]:
        if self.forward_sig is None:
            return {}
        try:
            if isinstance(inputs, tuple):
                ba = self.forward_sig.bind(*inputs)
            elif isinstance(inputs, dict):
                ba = self.forward_sig.bind(**inputs)
            else:
                ba = self.forward_sig.bind(inputs)
        except TypeError as e:
            raise StepError(f"the inputs do not fit the module's forward{self.forward_sig}: {e}. Pass one tensor, "
                            "a tuple of positional inputs, or a dict of keyword inputs; the targets follow as "
                            "separate arguments: step(inputs, *targets)") from None
        return dict(ba.arguments)

    # --- the guarded first run of a new signature
    @contextlib.contextmanager
    def guard(self, inputs: Any, bound: dict[str, Any]) -> Iterator[None]:
        """Restore buffers and the RNG state on a failure, and explain one inside the forward by the inputs that
        differ from the example."""
        buffers = [(b, b.detach().clone()) for b in unique_by_id(self.gm.buffers())]
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        # counted by TrainStep.call_model, not a forward hook: adding a hook would make torch.compile recompile
        forwards = self.forwards
        try:
            yield
        except Exception as e:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            differing = self._differing(inputs, bound)
            if self.forwards != forwards or not differing or isinstance(e, (StepError, torch.OutOfMemoryError)) \
                    or not isinstance(e, (RuntimeError, TypeError, ValueError, IndexError)):
                raise  # the loss function's own error, or one the inputs do not explain: as it came
            raise StepError(
                "the converted module does not run on these inputs: " + "; ".join(differing) + ". Pass inputs "
                "shaped like the example (a size that the model accepts, such as the batch, may differ), or "
                f"convert again with an example of the new shape. Inside the module: {one_line(e)}") from e

    def _differing(self, inputs: Any, bound: dict[str, Any]) -> list[str]:
        out = []
        for name, value in bound.items():
            info = self.example.get(name)
            if isinstance(value, torch.Tensor) and _is_info(info) and \
                    (tuple(value.shape) != tuple(info.shape) or value.dtype != info.dtype):
                out.append(f"{self._label(name, inputs)} has shape {_shape(value.shape)} {_dtype(value.dtype)}, "
                           f"the module was converted with {_shape(info.shape)} {_dtype(info.dtype)}")
        return out

    def _all_tensors(self, inputs: Any, bound: dict[str, Any], targets: tuple):
        if bound:
            named = [(self._label(name, inputs), v) for name, v in bound.items()]
        else:
            named = [(f"input {i}", v) for i, v in enumerate(inputs if isinstance(inputs, tuple) else (inputs,))]
        named += [(f"target {i}", v) for i, v in enumerate(targets)]
        for label, v in named:
            for t in _leaves(v):
                yield label, t

    def _label(self, name: str, inputs: Any) -> str:
        if isinstance(inputs, dict):
            return f"keyword input {name!r}"
        names = list(self.forward_sig.parameters) if self.forward_sig else []
        return f"input {name!r} (position {names.index(name)})" if name in names else f"input {name!r}"


def _forward_signature(gm) -> inspect.Signature | None:
    try:
        return inspect.signature(gm.forward)
    except (TypeError, ValueError):
        return None


def _example_infos(gm: fx.GraphModule, sig: inspect.Signature | None) -> dict[str, Any]:
    """Forward parameter name -> the TensorInfo convert() recorded for it (shapes before any padding)."""
    if not hasattr(gm, "graph"):  # converted piecewise: its parts check their own inputs
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    infos = [n.meta.get(K.INFO) for n in placeholders]
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return {n.target.lstrip("*"): info for n, info in zip(placeholders, infos)}
    try:  # a torch.export module: placeholders are the flattened (args, kwargs) of the example
        args, kwargs = tree_unflatten(infos, in_spec)
    except Exception:  # noqa: BLE001 - an input structure we cannot map: no example to compare with
        return {}
    names = list(sig.parameters) if sig is not None else []
    return {**dict(zip(names, args)), **kwargs}


def _leaves(v: Any):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _leaves(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _leaves(x)


def unique_by_id(tensors):
    """Each object once (parameters tied under several names), in order."""
    seen = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _is_info(info: Any) -> bool:
    return hasattr(info, "shape") and hasattr(info, "dtype")


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)
