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
The converted module's ``train(mode)``/``eval()`` (``converted.module.set_mode``) set the marked flags
(:func:`set_node`), stop or restart the ``num_batches_tracked`` increment that export writes beside each batch
norm, and recompile, then switch the leaf modules as ``nn.Module.train`` does. PyTorch's own helpers for
exported programs (``move_exported_model_to_train/eval``, now in ``torchao.quantization.pt2e``) are the same idea
on patterns; here it is on flags.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..base import keys as K
from ..base.meta import issuer_path, module_path

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
        _aten.dropout_.default: (2, "train"),
        _aten.feature_dropout_.default: (2, "train"),
        _aten.alpha_dropout_.default: (2, "train"),
        _aten.feature_alpha_dropout_.default: (2, "train"),
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
SWAPS = {}
if hasattr(_aten, "_batch_norm_with_update") and hasattr(_aten, "_batch_norm_no_update"):
    SWAPS = {_aten._batch_norm_with_update.default: (_aten._batch_norm_with_update.default,
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
    path = issuer_path(node)
    if path:
        try:
            return model.get_submodule(path).training
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
    if gm.meta.get(K.PROGRAM_KEYS):  # one program per mode: nothing to mark, modules take the model's
        _copy_module_modes(gm, model)
        return 0
    captured_training = gm.meta.pop(K.CAPTURED_TRAINING, None)
    marks = _marks(gm, lambda node: True if captured_training else _owner_training(node, model))
    for node, mark in marks.items():
        node.meta[K.MODE] = mark
    # the modes the model has, module by module (a frozen batch norm in a training model stays frozen)
    for node in gm.graph.nodes:
        if K.MODE in node.meta:
            set_node(node, node.meta[K.MODE], _owner_training(node, model))
    _copy_module_modes(gm, model)
    gm.recompile()
    return len(marks)


def _marks(gm: fx.GraphModule, mode_at_capture) -> dict[fx.Node, ModeArg]:
    """The nodes whose training flag, dropout probability, batch-norm target or statistics counter came from the
    mode (``mode_at_capture(node)``: the mode the node's module was captured in), not yet marked."""
    marks: dict[fx.Node, ModeArg] = {}
    for node in gm.graph.nodes:
        mark = None
        if K.MODE in node.meta:  # marked at an earlier capture (a converted module converted again)
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
        elif node.op == "call_function" and node.target in SWAPS:
            train_t, eval_t = SWAPS[node.target]
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
            marks[node] = mark
    return marks


def flags_as_programs(gm: fx.GraphModule, model: nn.Module, keys: tuple[str, ...], owners: set[str],
                      check: bool = False) -> int:
    """Make a training capture whose only mode-dependent nodes are the flags the modules ``owners`` (names in
    ``model``) issued themselves (see :func:`_marks`) the union of the programs ``keys``, as
    ``capture.programs.merge`` would have made it from a capture per mode: each flag's value noted per program,
    the statistics counter in the programs that update statistics only. ``GIVEN``: each node in the mode
    ``model``'s module that issued it is in. Returns how many nodes differ; ``check``: only whether every owner
    issued one (0 where one did not), changing nothing."""
    marks = {n: m for n, m in _marks(gm, lambda node: True).items() if issuer_path(n) in owners}
    if check:
        return len(marks) if {issuer_path(n) for n in marks} == set(owners) else 0
    every = frozenset(keys)
    for node in gm.graph.nodes:
        node.meta[MEMBERS] = every
    for node, mark in marks.items():
        off = [k for k in keys if k == EVAL or (k == GIVEN and not _owner_training(node, model))]
        if mark.kind == "counter":
            node.meta[MEMBERS] = every - set(off)
            continue
        if mark.kind == "swap":
            diff = {"target": mark.eval_target}
        else:
            value = False if mark.kind == "flag" else mark.eval_value
            where = mark.keyword if mark.keyword in node.kwargs or mark.index >= len(node.args) else mark.index
            diff = {where: value}
        if off:
            node.meta[MODE_ARGS] = {k: dict(diff) for k in off}
    gm.meta[K.PROGRAM_KEYS] = tuple(keys)
    return len(marks)


def _copy_module_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    originals = dict(model.named_modules())
    for name, sub in gm.named_modules():
        if name in originals:
            sub.training = originals[name].training


def set_node(node: fx.Node, mark: ModeArg, mode: bool) -> bool:
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


def mode_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of the running graph whose behaviour follows ``gm.training`` (for the report and tests): those
    that belong to some programs only or whose arguments differ between them, or the marked flags of a module
    converted from one capture."""
    keys = gm.meta.get(K.PROGRAM_KEYS)
    if not keys:
        return [n for n in gm.graph.nodes if K.MODE in n.meta]
    every = frozenset(keys)
    return [n for n in gm.graph.nodes if n.op != "output"
            and ((n.meta.get(MEMBERS) is not None and n.meta[MEMBERS] != every) or MODE_ARGS in n.meta)]


# ----------------------------------------------------------------------------------------------------------
# Modes by behaviour: one program per mode, planned together.
#
# The model is captured once in training mode and once in eval mode (and once more as it is, when its modules
# are in mixed modes). Whatever differs between those captures is what depends on the mode, whatever wrote it:
# a ``training=`` flag, a wrapped function's argument, a hand-written drop-path (``if not self.training:
# return x``), an ``if self.training`` branch. What is the same in both (weight standardisation's
# ``batch_norm(weight, None, None, training=True)``) is not mode-dependent, however it is spelled.
#
# :func:`merge` lays the programs over one another in one graph, the union: a node of the second program that
# computes what a node of the first computes (same op, same inputs) is that node; one whose only difference is
# a flag or a probability (a bool or float argument, a batch norm that updates its statistics or not) is that
# node with its argument noted per mode; anything else is added, marked as belonging to its program alone.
# Outputs that differ are joined by a ``by_mode`` node. Every pass of the conversion (padding, layout, the cast
# plan, the weights) runs once on the union, so both programs share one plan, one set of parameters and
# buffers. ``converted.module.install`` then cuts the union into one graph per mode, and
# ``gm.train()``/``gm.eval()`` swap graphs.

TRAIN, EVAL, GIVEN = "train", "eval", "given"
MEMBERS = K.MEMBERS
MODE_ARGS = K.MODE_ARGS
BY_MODE = K.BY_MODE


def by_mode(*values):
    """Stands, in the union of the programs, for a value that differs between them (see :func:`merge`); the
    per-mode graphs never contain it. As a function it gives the first program's value."""
    return values[0]


@dataclasses.dataclass
class Programs:
    """What ``gm.meta[K.PROGRAMS]`` holds: the union the passes ran on, and a graph per mode."""
    union: fx.Graph
    graphs: dict[str, fx.Graph]
    current: str
    # each program's forward as written the first time it ran (see _switch_graph), and whether a switch is
    # recompiling (a recompile of anyone else drops them)
    code: dict[str, dict] = dataclasses.field(default_factory=dict, repr=False)
    switching: bool = False
    # the modules that issued nodes which differ between programs, by name, and the mode each had at conversion
    # (its mode in the given program): the converted module checks their modes at each call
    owners: dict[str, bool] = dataclasses.field(default_factory=dict)


def owner_names(graph: fx.Graph, keys: tuple[str, ...]) -> set[str]:
    """The names of the modules (not the root) that issued a node which differs between the programs ``keys``."""
    every = frozenset(keys)
    return {p for n in graph.nodes if n.op != "output"
            and ((n.meta.get(MEMBERS) is not None and n.meta[MEMBERS] != every) or MODE_ARGS in n.meta)
            for p in (issuer_path(n),) if p}


def split(graph: fx.Graph, key: str) -> fx.Graph:
    """The graph of one program: the union's nodes that belong to it, and the nodes passes made that it reads;
    its arguments as that program wrote them; ``by_mode`` nodes resolved."""
    nodes = list(graph.nodes)
    keep: set[fx.Node] = set()

    def reads(user: fx.Node, n: fx.Node) -> bool:
        if user.target is by_mode and BY_MODE in user.meta:
            return user.args[user.meta[BY_MODE].get(key, 0)] is n
        return True

    for n in reversed(nodes):
        members = n.meta.get(MEMBERS)
        if n.op == "output" or (members is not None and key in members):
            keep.add(n)
        elif members is None and (any(u in keep and reads(u, n) for u in n.users)
                                  or (not n.users and n.op != "placeholder" and n.is_impure())):
            keep.add(n)
    g = fx.Graph(tracer_cls=graph._tracer_cls)
    g._codegen = copy.copy(graph._codegen)  # its pytree specs are read, never written
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n not in keep:
            continue
        if n.target is by_mode and BY_MODE in n.meta:
            env[n] = env[n.args[n.meta[BY_MODE].get(key, 0)]]
            continue
        new = g.node_copy(n, lambda a: env[a])
        for pos, value in n.meta.get(MODE_ARGS, {}).get(key, {}).items():
            if pos == "target":
                new.target = value
            elif isinstance(pos, int):
                new.args = new.args[:pos] + (value,) + new.args[pos + 1:]
            else:
                new.kwargs = {**new.kwargs, pos: value}
        env[n] = new
    g.lint()
    return g


def differences(graph: fx.Graph, keys: tuple[str, ...]) -> list[str]:
    """Where the programs differ, one line per module and program (the nodes it wrote that only some programs
    have), and one per node whose flag or probability differs."""
    lines: list[str] = []
    groups: dict[tuple[str, frozenset], list[str]] = {}
    every = frozenset(keys)
    for n in graph.nodes:
        if n.op == "output" or (n.target is by_mode and BY_MODE in n.meta):
            continue
        members = n.meta.get(MEMBERS)
        where = module_path(n) or "the model's own forward"
        if members is not None and members != every:
            groups.setdefault((where, members), []).append(n.name)
        for key, diff in n.meta.get(MODE_ARGS, {}).items():
            what = getattr(n.target, "__name__", str(n.target))
            args = ", ".join(f"{'argument ' + str(p) if isinstance(p, int) else p} "
                             f"{_arg(n, p)} in {keys[0]}, {getattr(v, '__name__', v)} in {key}"
                             for p, v in diff.items())
            lines.append(f"{n.name} ({what}, in {where}): {args}")
    for (where, members), names in groups.items():
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        lines.append(f"in {where}, {' and '.join(sorted(members))} only: {shown}")
    return lines


def _arg(n: fx.Node, pos):
    if pos == "target":
        return getattr(n.target, "__name__", n.target)
    return n.args[pos] if isinstance(pos, int) else n.kwargs.get(pos)


def restore_union(gm: fx.GraphModule) -> None:
    """Put the union back in place of the per-mode graph (to convert a converted module again)."""
    programs = gm.meta.pop(K.PROGRAMS, None)
    if programs is not None:
        gm.meta[K.CURRENT_PROGRAM] = programs.current
        gm.graph = programs.union


def describe(gm: fx.GraphModule) -> dict:
    """For the report: how train and eval differ in this converted module, node by node."""
    keys = gm.meta.get(K.PROGRAM_KEYS)
    if keys and gm.meta.get(K.MODES_READ) is False:
        return {"how": "one program for both modes: the model's code read no training flag while it was "
                       "captured (its dropout and batch norms are modules that switch by themselves)",
                "differences": []}
    if keys and gm.meta.get(K.MODES_READ) == "flags":
        return {"how": f"one program per mode ({', '.join(keys)}) from one capture: only torch's dropout and "
                       "batch-norm modules read the mode, as their ops' flags",
                "differences": differences(gm.graph, tuple(keys))}
    if keys:
        return {"how": f"one program per mode ({', '.join(keys)}), captured and planned together",
                "differences": differences(gm.graph, tuple(keys))}
    return {"how": "one program; these flags follow gm.train()/gm.eval()",
            "differences": [f"{n.name} ({getattr(n.target, '__name__', n.target)}): {n.meta['autocastfx_mode'].kind}"
                            for n in mode_nodes(gm)]}
