"""train() and eval() on every converted module: a captured graph bakes in the mode the model was in, so a converted
module holds one program per mode (:class:`Programs`), each planned on its own and swapped by ``gm.train()`` and
``gm.eval()``. A mode that is not captured is derived from a capture by setting the flags that came from the mode.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..base import keys as K
from ..base.quiet import deepcopy_quietly
from ..base.meta import issuer_path, module_path
from ..base.runtime import no_recompile

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ModeArg:
    """Where a node keeps its mode: an argument (by position or keyword), or its target."""
    kind: str                      # "flag" | "value" | "counter" | "swap"
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
_METHOD_FLAGS = {"dropout": (1, "training")}  # x.dropout(p, training)
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


def _marks(gm: fx.GraphModule, mode_at_capture) -> dict[fx.Node, ModeArg]:
    """The nodes whose training flag, dropout probability, batch-norm target or statistics counter matches
    ``mode_at_capture(node)``, the mode the node's module was captured in; a literal ``training=True`` cannot be told
    from ``self.training`` and is marked too."""
    marks: dict[fx.Node, ModeArg] = {}
    for node in gm.graph.nodes:
        mark = None
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


# ----------------------------------------------------------------------------------------------------------
# One program per mode: whatever differs between the captures is what depends on the mode.

TRAIN, EVAL, GIVEN = "train", "eval", "given"


@dataclasses.dataclass
class Programs:
    """What ``gm.meta[K.PROGRAMS]`` holds: a graph per mode, over the converted module's tensors."""
    graphs: dict[str, fx.Graph]
    current: str
    # each program's forward as written the first time it ran (converted.module), and whether a switch is
    # recompiling (any other recompile drops them)
    code: dict[str, dict] = dataclasses.field(default_factory=dict, repr=False)
    switching: bool = False
    # the modules that issued nodes which differ between programs, by name, and the mode each had at conversion
    # (its mode in the given program): the converted module checks their modes at each call
    owners: dict[str, bool] = dataclasses.field(default_factory=dict)


def mode_of(key: str, node: fx.Node, model: nn.Module) -> bool:
    """The mode ``node`` runs in within the program ``key``: the module's own (as ``model`` has it) for GIVEN."""
    return _owner_training(node, model) if key == GIVEN else key == TRAIN


def flag_marks(gm: fx.GraphModule, mode_at_capture=None, owners: set[str] | None = None) -> dict[fx.Node, ModeArg]:
    """The flags of ``gm`` that came from the mode (see :func:`_marks`; ``mode_at_capture`` defaults to training),
    only those issued by ``owners`` (module names) where given."""
    marks = _marks(gm, mode_at_capture or (lambda node: True))
    if owners is None:
        return marks
    return {n: m for n, m in marks.items() if issuer_path(n) in owners}


def derived(gm: fx.GraphModule, marks: dict[fx.Node, ModeArg], key: str, model: nn.Module,
            copy_graph: bool = True) -> fx.GraphModule:
    """The program ``key`` made from the capture ``gm`` by setting its marked flags for that mode: a new graph
    module over ``gm``'s modules and tensors, or ``gm`` itself, changed in place, where not ``copy_graph``."""
    if copy_graph:
        graph = deepcopy_quietly(gm.graph)
        twin = dict(zip(gm.graph.nodes, graph.nodes))
        out = fx.GraphModule.__new__(fx.GraphModule, gm, graph, type(gm).__name__)
        object.__setattr__(out, "recompile", no_recompile)  # no code until it runs, in the converted module
        out.__init__(gm, graph, type(gm).__name__)
        out.meta.update(gm.meta)
    else:
        out, twin = gm, {n: n for n in gm.graph.nodes}
    for node, mark in marks.items():
        mode = mode_of(key, node, model)
        if mark.kind == "counter" and not mode and not twin[node].users:  # no statistics kept: no count either
            out.graph.erase_node(twin[node])
        else:
            set_node(twin[node], mark, mode)
    return out


def _arg_list(n: fx.Node) -> list[tuple]:
    """(position or keyword, value) of each argument of ``n``: an aten op's by its schema, defaults written out (one
    capture writes ``sdpa(q, k, v, mask, 0.1)`` where another leaves ``dropout_p`` to its default)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return [*enumerate(n.args), *n.kwargs.items()]
    out = []
    for i, a in enumerate(schema.arguments):
        if a.name in n.kwargs:
            out.append((i, n.kwargs[a.name]))
        elif i < len(n.args) and not a.kwarg_only:
            out.append((i, n.args[i]))
        elif a.has_default_value():
            out.append((i, a.default_value))
    return out


def _flags(n: fx.Node) -> tuple:
    """The arguments of ``n`` that may differ between modes without changing a shape: flags and probabilities."""
    return tuple((p, a) for p, a in _arg_list(n) if isinstance(a, (bool, float)))


def _target_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _calls_by_place(graph: fx.Graph) -> tuple[dict[tuple, list[fx.Node]], dict[fx.Node, tuple]]:
    """The graph's calls by (issuing module, target), in order, and each node's name for comparing programs: its
    place and index there (an input or an attribute by its own name); the casts and layout changes passes made
    left out (they follow from the plan, not from the mode)."""
    places: dict[tuple, list[fx.Node]] = {}
    ids: dict[fx.Node, tuple] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            ids[n] = (n.op, str(n.target))
            continue
        if n.op == "output":
            continue
        decision = n.meta.get("autocastfx")
        if getattr(decision, "kind", None) == "cast" or K.LAYOUT in n.meta:
            ids[n] = ids.get(n.args[0], ("cast",)) if n.args and isinstance(n.args[0], fx.Node) else ("cast",)
            continue
        place = (module_path(n) or "", _target_name(n))
        ids[n] = (place, len(places.setdefault(place, [])))
        places[place].append(n)
    return places, ids


def _signature(n: fx.Node, ids: dict[fx.Node, tuple]) -> list:
    return [(p, fx.node.map_arg(a, lambda x: ids.get(x, ("?",))) if not isinstance(a, (bool, float)) else "flag")
            for p, a in _arg_list(n)]


def differing(graphs: dict[str, fx.Graph]) -> tuple[list[str], dict[str, set[fx.Node]]]:
    """Where the programs differ: one line per module and set of programs for the calls only those programs make,
    one per call whose flags or probabilities differ, one per call whose other arguments differ; and, per program,
    its nodes that differ."""
    keys = list(graphs)
    found = {k: _calls_by_place(g) for k, g in graphs.items()}
    nodes: dict[str, set[fx.Node]] = {k: set() for k in keys}
    groups: dict[tuple[str, frozenset], list[str]] = {}
    lines: list[str] = []
    first_key = keys[0]
    for place in dict.fromkeys(p for k in keys for p in found[k][0]):
        lists = {k: found[k][0].get(place, []) for k in keys}
        common = min(len(v) for v in lists.values())
        where = place[0] or "the model's own forward"
        for k, v in lists.items():  # the calls some programs make more of
            if len(v) > common:
                members = frozenset(j for j in keys if len(lists[j]) > common)
                if k == min(members, key=keys.index):
                    groups.setdefault((where, members), []).extend(n.name for n in v[common:])
                nodes[k].update(v[common:])
        for i in range(common):  # the calls all make: by their flags, then by their other arguments
            first = lists[first_key][i]
            base, base_sig = dict(_flags(first)), _signature(first, found[first_key][1])
            for k in keys[1:]:
                other = lists[k][i]
                theirs = dict(_flags(other))
                diff = {p: v for p, v in theirs.items()
                        if p not in base or base[p] != v or type(base[p]) is not type(v)}
                if diff:
                    args = ", ".join(f"{'argument ' + str(p) if isinstance(p, int) else p} {base.get(p)} in {first_key}, "
                                     f"{v} in {k}" for p, v in diff.items())
                    lines.append(f"{first.name} ({_target_name(first)}, in {where}): {args}")
                elif _signature(other, found[k][1]) != base_sig:
                    lines.append(f"{first.name} ({_target_name(first)}, in {where}): other inputs in {k}")
                else:
                    continue
                nodes[first_key].add(first)
                nodes[k].add(other)
    for (where, members), names in groups.items():
        shown = ", ".join(names[:16]) + (f" and {len(names) - 16} more" if len(names) > 16 else "")
        lines.append(f"in {where}, {' and '.join(sorted(members))} only: {shown}")
    return lines, nodes


def same_program(graphs: dict[str, fx.Graph]) -> bool:
    """Whether every program is the same code (then one graph serves every mode)."""
    codes = {g.python_code("self").src for g in graphs.values()}
    return len(codes) == 1


def owner_names(graphs: dict[str, fx.Graph]) -> set[str]:
    """The modules (not the root) that issued a node which differs between the programs."""
    _, nodes = differing(graphs)
    return {p for ns in nodes.values() for n in ns for p in (issuer_path(n),) if p}


def mode_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of the running program that another mode's program does not have, or has with other flags (for
    the report and tests)."""
    programs = gm.meta.get(K.PROGRAMS)
    if programs is None:
        return []
    running = next((k for k, g in programs.graphs.items() if g is gm.graph), programs.current)
    found = differing(programs.graphs)[1][running]
    return [n for n in gm.graph.nodes if n in found]


def describe(graphs: dict[str, fx.Graph], how: str) -> dict:
    """For the report: how the programs were found (``how``), and where they differ."""
    if len(graphs) == 1:
        return {"how": "one program for both modes: the model's code read no training flag while it was captured "
                       "(its dropout and batch norms, if any, are modules that switch by themselves)",
                "differences": []}
    keys = ", ".join(graphs)
    text = {"flags": f"one program per mode ({keys}) from one capture: only torch's dropout and batch-norm modules "
                     "read the mode, as their ops' flags",
            "captures": f"one program per mode ({keys}), each captured and planned on its own"}.get(
        how, f"one program per mode ({keys}), from one capture because {how}: the dropout and batch-norm flags "
             "it recognises follow the mode, and other mode-dependent code keeps the form it was captured in")
    return {"how": text, "differences": differing(graphs)[0]}
