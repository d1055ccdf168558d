"""train() and eval() on every converted module, whatever captured it.

A captured graph bakes the mode the model was in: ``torch.export`` writes ``aten.dropout(x, p, True)`` and
``aten.batch_norm(..., True, ...)`` with literal flags (and its ``ep.module()`` refuses ``.train()``/``.eval()``
outright), and symbolic tracing writes ``F.dropout(x, p, training=True)`` for a ``training=self.training``
argument. Leaf modules (nn.Dropout, nn.BatchNorm2d as ``call_module`` nodes) switch by themselves.

The model is captured from a copy in training mode (``capture.capture``), so every flag that comes from
``self.training`` reads True in the graph and an attention's ``dropout_p=p if self.training else 0.0`` shows
its ``p``. :func:`record` marks those nodes (a literal ``training=False`` is left alone; a literal
``training=True`` cannot be told from ``self.training`` and follows the mode too), then gives each one the mode
of the module that issued it (``nn_module_stack``), so a frozen batch norm in a training model stays frozen.
:func:`install` gives the converted module ``train(mode)``/``eval()`` methods that set the marked flags, stop
or restart the ``num_batches_tracked`` increment that export writes beside each batch norm, and recompile,
then switch the leaf modules as ``nn.Module.train`` does. PyTorch's own helpers for exported programs
(``move_exported_model_to_train/eval``) lived in ``torch.ao.quantization.pt2e`` and are gone from current
releases; the rewrite here is the same idea on flags, with no pattern matching.
"""
from __future__ import annotations

import dataclasses
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ModeArg:
    """Where a node keeps its training flag: a positional index or a keyword, or a target swap."""
    kind: str                      # "flag" | "counter" | "swap"
    index: int | None = None
    keyword: str | None = None
    train_target: object = None    # for "swap": the target in training mode ...
    eval_target: object = None     # ... and in eval mode
    train_value: object = None     # for "value": the argument in training mode (a dropout probability) ...
    eval_value: object = None      # ... and in eval mode (0.0)


def _flag_positions() -> dict:
    """Callable -> (positional index, keyword) of its training flag."""
    table = {
        _aten.dropout.default: (2, "train"),
        _aten.feature_dropout.default: (2, "train"),
        _aten.alpha_dropout.default: (2, "train"),
        _aten.feature_alpha_dropout.default: (2, "train"),
        _aten.batch_norm.default: (5, "training"),
        _aten.native_batch_norm.default: (5, "training"),
        _aten._native_batch_norm_legit.default: (5, "training"),
        F.dropout: (2, "training"), F.dropout1d: (2, "training"), F.dropout2d: (2, "training"),
        F.dropout3d: (2, "training"), F.alpha_dropout: (2, "training"), F.feature_alpha_dropout: (2, "training"),
        F.batch_norm: (5, "training"),
        torch.dropout: (2, "train"), torch.batch_norm: (5, "training"),
    }
    return table


_FLAGS = _flag_positions()
# batch norm ops whose mode is their target, not an argument (same signature both ways)
_SWAPS = {}
if hasattr(_aten, "_batch_norm_with_update") and hasattr(_aten, "_batch_norm_no_update"):
    _SWAPS = {_aten._batch_norm_with_update.default: (_aten._batch_norm_with_update.default,
                                                       _aten._batch_norm_no_update.default),
              _aten._batch_norm_no_update.default: (_aten._batch_norm_with_update.default,
                                                     _aten._batch_norm_no_update.default)}
_METHOD_FLAGS = {"dropout": (1, "training")}  # x.dropout(p, training) is rare; kept for completeness
if hasattr(F, "multi_head_attention_forward"):
    _FLAGS[F.multi_head_attention_forward] = (13, "training")
# attention whose dropout probability modules write as ``p if self.training else 0.0`` (Hugging Face, timm)
_DROPOUT_P = {_aten.scaled_dot_product_attention.default: (4, "dropout_p"),
              F.scaled_dot_product_attention: (4, "dropout_p")}


def _owner_training(node: fx.Node, model: nn.Module) -> bool:
    """The training flag of the module that issued ``node`` (the root when the graph does not say)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if isinstance(path, str):
            path = path.removeprefix("L['self'].").replace("L__self___", "")
            try:
                return model.get_submodule(path).training if path else model.training
            except AttributeError:
                pass
    return model.training


def _get(node: fx.Node, index: int, keyword: str):
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    if index < len(node.args):
        return node.args[index]
    return None


def record(gm: fx.GraphModule, model: nn.Module) -> int:
    """Mark the mode-dependent nodes of a freshly captured graph, then give the graph the modes ``model`` has
    (module by module); returns how many nodes were marked.

    A graph captured from a training-mode copy (``capture`` does that where it can) has every flag that came
    from ``self.training`` set to True; otherwise each flag is compared with its own module's mode."""
    captured_training = gm.meta.pop("autocastfx_captured_training", None)

    def mode_at_capture(node):
        return True if captured_training else _owner_training(node, model)

    marked = 0
    for node in gm.graph.nodes:
        mark = None
        if "autocastfx_mode" in node.meta:  # marked at an earlier capture (a converted module converted again)
            continue
        if node.op == "call_function" and node.target in _FLAGS:
            index, keyword = _FLAGS[node.target]
            value = _get(node, index, keyword)
            if isinstance(value, bool) and value == mode_at_capture(node):
                mark = ModeArg("flag", index, keyword)
        elif node.op == "call_function" and node.target in _DROPOUT_P:
            index, keyword = _DROPOUT_P[node.target]
            value = _get(node, index, keyword)
            if isinstance(value, float) and value > 0 and mode_at_capture(node):
                mark = ModeArg("value", index, keyword, train_value=value, eval_value=0.0)
        elif node.op == "call_function" and node.target in _SWAPS:
            train_t, eval_t = _SWAPS[node.target]
            if (node.target is train_t) == mode_at_capture(node):
                mark = ModeArg("swap", train_target=train_t, eval_target=eval_t)
        elif (node.op == "call_function" and node.target is _aten.add_.Tensor and node.args
              and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
              and str(node.args[0].target).endswith("num_batches_tracked") and node.args[1] == 1
              and mode_at_capture(node)):
            mark = ModeArg("counter", 1, "other")
        elif node.op == "call_method" and node.target in _METHOD_FLAGS:
            index, keyword = _METHOD_FLAGS[node.target]
            value = _get(node, index, keyword)
            if isinstance(value, bool) and value == mode_at_capture(node):
                mark = ModeArg("flag", index, keyword)
        if mark is not None:
            node.meta["autocastfx_mode"] = mark
            marked += 1
    # the modes the model has, module by module (a frozen batch norm in a training model stays frozen)
    for node in gm.graph.nodes:
        if "autocastfx_mode" in node.meta:
            _set_node(node, node.meta["autocastfx_mode"], _owner_training(node, model))
    originals = dict(model.named_modules())
    for name, sub in gm.named_modules():
        if name in originals:
            sub.training = originals[name].training
    gm.recompile()
    return marked


def set_mode(gm: fx.GraphModule, mode: bool) -> fx.GraphModule:
    """Switch the marked flags and the leaf modules to ``mode``; recompile only when a flag changed."""
    if not isinstance(mode, bool):
        raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
    changed = False
    for node in gm.graph.nodes:
        mark: ModeArg | None = node.meta.get("autocastfx_mode")
        if mark is not None:
            changed |= _set_node(node, mark, mode)
    if changed:
        gm.recompile()
    nn.Module.train(gm, mode)  # leaf modules (call_module nodes) and every .training flag
    return gm


def _set_node(node: fx.Node, mark: ModeArg, mode: bool) -> bool:
    """Write one node's mode; True if it changed."""
    if mark.kind == "swap":
        target = mark.train_target if mode else mark.eval_target
        if node.target is target:
            return False
        node.target = target
        return True
    value = {"counter": 1 if mode else 0, "value": mark.train_value if mode else mark.eval_value}.get(mark.kind, mode)
    if mark.keyword in node.kwargs:
        old = node.kwargs[mark.keyword]
        if old == value and type(old) is type(value):
            return False
        node.kwargs = {**node.kwargs, mark.keyword: value}
        return True
    if mark.index < len(node.args):
        old = node.args[mark.index]
        if old == value and type(old) is type(value):
            return False
        args = list(node.args)
        args[mark.index] = value
        node.args = tuple(args)
        return True
    node.kwargs = {**node.kwargs, mark.keyword: value}
    return True


class _Switchable:
    """Mixed into the converted module's class, so that copies keep working modes: ``copy.deepcopy`` of a
    GraphModule builds a fresh class over the first base whose qualified name does not end in
    ``GraphModuleImpl``, which is the one made here."""

    def train(self, mode: bool = True):
        return set_mode(self, mode)

    def eval(self):
        return set_mode(self, False)


_BASES: dict[type, type] = {}


def install(gm: fx.GraphModule) -> None:
    """Give ``gm`` working ``train()``/``eval()``, replacing torch.export's methods that raise."""
    base = next(c for c in type(gm).__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    if not issubclass(base, _Switchable):
        if base not in _BASES:
            _BASES[base] = type(f"Converted{base.__name__.lstrip('_')}", (_Switchable, base), {})
        base = _BASES[base]
    gm.__dict__.pop("train", None)  # ep.module() sets instance attributes that raise NotImplementedError
    gm.__dict__.pop("eval", None)
    gm.__class__ = type("GraphModuleImpl", (base,), {})  # GraphModule keeps forward on a class of its own
    gm.recompile()


def mode_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose behaviour follows ``gm.training`` (for the report and tests)."""
    return [n for n in gm.graph.nodes if "autocastfx_mode" in n.meta]
