"""Values changed in place: which ops change a value or a view of it, and the groups of values that share one
tensor's memory. A cast is a copy, so every member of such a group runs in its root's dtype and each reader gets its
own cast, made where it reads (``core.plan``, ``core.rewrite``)."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.fx as fx

from ..base.meta import fetch

# ops whose result may share its first argument's memory (over-approximated: a copy taken for a view only costs a
# cast more, a view taken for a copy would lose a change)
VIEWS = frozenset({"slice", "select", "view", "as_strided", "transpose", "permute", "unsqueeze", "squeeze", "expand",
                   "t", "alias", "diagonal", "narrow", "unfold", "getitem", "unbind", "split", "chunk", "view_as",
                   "flatten", "unflatten", "movedim", "swapaxes", "reshape", "reshape_as", "contiguous", "detach",
                   "expand_as", "_reshape_alias", "_unsafe_view", "ravel", "split_with_sizes", "tensor_split",
                   "view_as_real", "view_as_complex", "squeeze_", "unsqueeze_", "transpose_", "t_"})
_ALIAS_ATTRIBUTES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def _name(t) -> str:
    return t if isinstance(t, str) else getattr(getattr(t, "overloadpacket", t), "__name__", "")


@functools.lru_cache(maxsize=1024)
def _inplace_position(target) -> int | None:
    """The position of a function's ``inplace`` parameter, None where it has none."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _inplace_argument(node: fx.Node) -> bool:
    """A function called with ``inplace=True`` (``F.relu(h, inplace=True)``, ``F.dropout(h, p, True, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or isinstance(node.target, torch._ops.OpOverload):
        return False
    try:
        at = _inplace_position(node.target)
    except TypeError:  # not hashable
        return False
    return at is not None and len(node.args) > at and node.args[at] is True


def changes(user: fx.Node, value: fx.Node, gm: fx.GraphModule | None = None) -> bool:
    """Whether ``user`` changes ``value`` in place: ``h.mul_(2)``, ``h[:, :4] = 0``, a mutable aten op,
    ``F.relu(h, inplace=True)``, a leaf module built with ``inplace=True`` (``nn.ReLU(inplace=True)``)."""
    if isinstance(user.target, torch._ops.HigherOrderOperator):
        return _changed_inside(user, value, gm)
    if not user.args or user.args[0] is not value:
        return False
    t = user.target
    name = _name(t)
    if (name.endswith("_") and not name.endswith("__")) or name == "setitem" \
            or (isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable):
        return name not in VIEWS  # squeeze_ and the like change the shape only
    if user.op == "call_module":
        module = gm.get_submodule(str(t)) if gm is not None else None
        return getattr(module, "inplace", False) is True
    return user.op == "call_function" and _inplace_argument(user)


def _changed_inside(user: fx.Node, value: fx.Node, gm: fx.GraphModule | None) -> bool:
    """Whether a higher-order op (torch.export's ``wrap_with_set_grad_enabled`` for a ``torch.no_grad()`` region)
    changes ``value``, an operand, in its subgraph: the subgraph's input for it, or a view of that, changed in
    place. True where the subgraph cannot be read."""
    operands = [a for a in user.args if isinstance(a, fx.Node)]
    if value not in operands:
        return False
    subs = [a for a in operands if a.op == "get_attr"]
    sub = None
    if gm is not None and subs:
        try:
            sub = gm.get_submodule(str(subs[0].target))
        except AttributeError:
            sub = None
    if not isinstance(sub, fx.GraphModule):
        return True
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    rest = [a for a in operands if a is not subs[0]]
    if len(inputs) != len(rest):
        return True
    reached = {inputs[rest.index(value)]}
    for node in sub.graph.nodes:
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if base in reached and changes(node, base, sub):
            return True
        if base in reached and _is_alias(node, base):
            reached.add(node)
        if isinstance(node.target, torch._ops.HigherOrderOperator) and any(
                changes(node, r, sub) for r in reached if r in node.args):
            return True
    return False


def _is_alias(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user``'s result may share ``value``'s memory (a view, or the result of a change in place)."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[1] in _ALIAS_ATTRIBUTES
    return _name(user.target) in VIEWS


def _is_subgraph(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "get_attr" and isinstance(fetch(gm, str(node.target), None), fx.GraphModule)


def alias_groups(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Every member of a group of values sharing one tensor's memory that some op changes in place, to the group's
    root (the value the others are views of or changes to); members of unchanged groups are left out."""
    root: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if base is not None and (_is_alias(node, base) or changes(node, base, gm)):
            root[node] = root.get(base, base)
    members: dict[fx.Node, list[fx.Node]] = {}
    for node, r in root.items():
        members.setdefault(r, [r]).append(node)
    inside = set()  # roots changed in a higher-order op's subgraph
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            inside.update(root.get(v, v) for v in node.args
                          if isinstance(v, fx.Node) and not _is_subgraph(v, gm) and changes(node, v, gm))
    for r in inside:
        members.setdefault(r, [r])
    out: dict[fx.Node, fx.Node] = {}
    for r, group in members.items():
        if r in inside or any(changes(m, m.args[0], gm) for m in group if m is not r) or any(
                changes(u, m, gm) for m in group for u in m.users):
            out.update({m: r for m in group})
    return out
