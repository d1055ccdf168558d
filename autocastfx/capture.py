"""Capture: model -> GraphModule. torch.fx.symbolic_trace first, torch.export (training IR) second."""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import traceback
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .policy import LOW_OPS, Policy, op_name

_COUNTED = LOW_OPS  # FLOPs are counted where tensor cores could run them


class CaptureError(RuntimeError):
    """Neither symbolic tracing nor torch.export could capture the model."""


class _Tracer(fx.Tracer):
    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self.policy.is_leaf(m)

    def trace(self, root, concrete_args=None):
        self._param_names = {id(p): n for n, p in root.named_parameters()} if isinstance(root, nn.Module) else {}
        return super().trace(root, concrete_args)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # fx's own lookup scans every parameter on every access (quadratic in model size): use a dict
        name = self._param_names.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def capture(model: nn.Module, args: tuple, kwargs: dict, policy: Policy) -> tuple[fx.GraphModule, str]:
    """Return (graph module, how) where how is ``"symbolic_trace"`` or ``"torch.export"``.

    The model is deep-copied first: nothing the capture does reaches the caller's model. A traced graph
    must also run on the example inputs; one that does not goes to the torch.export fallback too.
    """
    model = copy.deepcopy(model)
    try:
        tracer = _Tracer(policy)
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
        if kwargs and not _accepts_kwargs(gm, kwargs):
            raise TypeError(f"traced forward does not take keyword inputs {sorted(kwargs)}")
        propagate(gm, args, kwargs)
        return gm, "symbolic_trace"
    except Exception as e:  # noqa: BLE001 - every tracing failure goes to the fallback
        trace_error = e
    return capture_export(model, args, kwargs, trace_error)


def capture_export(model: nn.Module, args: tuple, kwargs: dict, trace_error: BaseException | None = None
                   ) -> tuple[fx.GraphModule, str]:
    try:
        with _quiet():  # torch.export prints graphs and shape warnings while it fails; the error says it all
            ep = _export(model, tuple(args), dict(kwargs))
        gm = ep.module()
        _strip_export_asserts(gm)
        propagate(gm, args, kwargs)
        return gm, "torch.export"
    except Exception as e:  # noqa: BLE001
        export_error = e
    raise CaptureError(
        f"cannot capture {type(model).__name__} as a graph.\n"
        f"  torch.fx.symbolic_trace failed: {_one_line(trace_error) if trace_error else 'not tried'}\n"
        f"  torch.export.export(strict=False) failed: {_one_line(export_error)}\n"
        "Ways out: convert a submodule that traces (autocastfx.convert(model.backbone, ...)); mark the "
        "module that breaks tracing as a leaf (Policy.default().override(leaf_modules=(MyBlock,))); remove "
        "data-dependent Python control flow from forward (if x.sum() > 0: ...); or pass example_inputs "
        "that match forward's signature so the torch.export fallback can run."
    ) from export_error


def _export(model: nn.Module, args: tuple, kwargs: dict):
    """torch.export with every input dim free to vary where the model allows it (``Dim.AUTO``), so that a
    converted model takes other batch sizes and sequence lengths than the example's; a static export when the
    dynamic one fails (a model whose code needs concrete sizes)."""
    try:
        spec = _auto_dynamic_shapes(model, args, kwargs)
        return torch.export.export(model, args, kwargs, dynamic_shapes=spec, strict=False)
    except Exception:  # noqa: BLE001 - the static export below reports its own failure
        return torch.export.export(model, args, kwargs, strict=False)


def _auto_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    import inspect

    auto = torch.export.Dim.AUTO

    def spec(v):
        if isinstance(v, torch.Tensor):
            return {i: auto for i in range(v.dim())} if v.dim() else None
        if isinstance(v, (tuple, list)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(model.forward).parameters[name].kind
        out[name] = (tuple(spec(x) for x in value) if kind is inspect.Parameter.VAR_POSITIONAL
                     else {k: spec(x) for k, x in value.items()} if kind is inspect.Parameter.VAR_KEYWORD
                     else spec(value))
    return out


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch._export",
                                               "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _accepts_kwargs(gm: fx.GraphModule, kwargs: dict) -> bool:
    names = {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    return all(k in names for k in kwargs)


def _one_line(e: BaseException) -> str:
    lines = [ln for ln in "".join(traceback.format_exception_only(type(e), e)).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) < 300 else text[:297] + "..."


def _strip_export_asserts(gm: fx.GraphModule) -> None:
    """torch.export pins every dtype with ``_assert_tensor_metadata``; the rewrite changes dtypes on purpose."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
        ) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


# ----------------------------------------------------------------------------------------------------------
# Facts about every value: dtype, shape, bytes, FLOPs, from one run of the graph on fake tensors.

from dataclasses import dataclass  # noqa: E402

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str = "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _info(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorInfo(v.dtype, tuple(int(s) for s in v.shape), v.device.type)
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        return tuple(_info(x) for x in v)
    return None


class _Recorder(fx.Interpreter):
    """Runs the graph, storing a TensorInfo on every node."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["autocastfx_info"] = _info(out)
        return out


def propagate(gm: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
    """Run the graph once, in float32 and without gradients, on the example inputs, recording the dtype and
    shape of every value. Buffers (batch-norm statistics) and the random-number state are restored after,
    so the run leaves no trace. A real run costs one forward pass; per node it is far cheaper than running
    on meta or fake tensors, whose shape functions are Python."""
    flat_args = _flatten_inputs(gm, args, kwargs)
    saved = {k: v.detach().clone() for k, v in gm.state_dict(keep_vars=True).items()}
    devices = sorted({a.device.index or 0 for a in flat_args if isinstance(a, torch.Tensor) and a.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            return _Recorder(gm).run(*flat_args)
    finally:
        with torch.no_grad():
            for k, v in gm.state_dict(keep_vars=True).items():
                if k in saved and v.shape == saved[k].shape:
                    v.copy_(saved[k])


def node_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """FLOPs of one node (matmul/conv/attention, as torch.utils.flop_counter counts them), from the recorded
    shapes, on meta tensors. Computed on demand by the report and cached in ``node.meta``."""
    if "autocastfx_flops" in node.meta:
        return node.meta["autocastfx_flops"]
    flops = 0
    if node.op in ("call_function", "call_method") and op_name(node) in _COUNTED:
        def meta_of(a):
            if not isinstance(a, fx.Node):
                return a
            info = a.meta.get("autocastfx_info")
            if not isinstance(info, TensorInfo):
                raise ValueError(f"no recorded tensor for {a.name}")
            return torch.empty(info.shape, dtype=torch.float32 if info.is_float else info.dtype, device="meta")
        try:
            args = fx.node.map_aggregate(node.args, meta_of)
            kwargs = fx.node.map_aggregate(node.kwargs, meta_of)
            fn = node.target if node.op == "call_function" else getattr(type(args[0]), node.target)
            with FlopCounterMode(display=False) as fc:
                fn(*args, **kwargs)
            flops = int(fc.get_total_flops())
        except Exception:  # noqa: BLE001 - an op without a meta kernel counts as unknown (0)
            flops = 0
    node.meta["autocastfx_flops"] = flops
    return flops


def _flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """Positional values for the graph's placeholders, in order."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is not None:  # torch.export module: the graph takes the flattened (args, kwargs)
        flat, _ = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
        return flat
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for p in placeholders[len(values):]:
        if p.target in kwargs:
            values.append(kwargs[p.target])
        elif p.args:
            values.append(p.args[0])  # default value
        else:
            raise TypeError(f"no example value for input {p.target!r}: pass it in example_inputs/example_kwargs")
    return values
