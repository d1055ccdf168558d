"""The cast plan's optimisation: two labels (LOW, FP32) for the free nodes that move the fewest bytes through
casts, as an s-t minimum cut (networkx max-flow), exact; the plan (plan.py) builds the Problem from a graph."""
from __future__ import annotations
import dataclasses
from typing import Iterable
import math

import networkx as nx


LOW, FP32 = True, False   # label values
_BIG = float(2**60)       # ties between a tuple value and its readers: never cut in practice
_FLOW = nx.algorithms.flow.boykov_kolmogorov  # fastest of networkx's max-flow solvers on these sparse graphs
_SOURCE, _SINK = ("source",), ("sink",)   # the cut's terminals (LOW, FP32): tuples, never a node's name
_INF = math.inf                            # an edge no cut may cross


@dataclasses.dataclass(frozen=True)
class Req:
    """What one consumer needs of one input value: the consumer's own label, or a fixed label, or nothing."""
    consumer: str
    kind: str               # "same" | "fixed" | "any"
    label: bool | None = None


@dataclasses.dataclass
class Problem:
    """Plain data the min-cut works on; tests write these by hand."""
    fixed: dict[str, bool]                    # node -> label, for fixed nodes
    free: list[str]                           # nodes whose label the plan chooses
    weight: dict[str, int]                    # castable value -> numel (cost of one cast)
    reqs: dict[str, list[Req]]                # value -> its consumers' requirements
    multi: set[str] = dataclasses.field(default_factory=set)   # tuple-valued nodes: cannot be cast
    tied: list[list[str]] = dataclasses.field(default_factory=list)  # groups that must share a label
    # (value, reader) pairs where the reader never rounds the value: value FP32 => reader FP32 (autocast's
    # widest-type rule, Policy.widest); the reader may still be FP32 with a LOW value where that casts less
    widen: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def cast_cost(p: Problem, labels: dict[str, bool]) -> tuple[int, int]:
    """(elements cast, number of casts) for a full labelling."""
    elements = casts = 0
    for u, reqs in p.reqs.items():
        if u in p.multi or u not in p.weight:
            continue
        lu = labels[u]
        need = {labels[r.consumer] if r.kind == "same" else r.label for r in reqs if r.kind != "any"}
        for d in need:
            if d != lu:
                elements += p.weight[u]
                casts += 1
    return elements, casts


def solve_min_cut(p: Problem) -> dict[str, bool]:
    """Labels for the free nodes that minimise cast_cost, fixed nodes kept.

    The network (source side = LOW) is built as plain dicts, most of its flow is pushed along short
    source-to-sink paths first, and networkx's max-flow finishes on the part where a path is left (none, on
    most graphs). The labels are networkx's partition: FP32 for every node that reaches the sink in the final
    residual network. That set is the same whatever max-flow found it, so the short paths change the time to
    the answer, never the answer, which is exact.
    """
    labels = dict(p.fixed)
    if not p.free:
        return labels
    res = _cast_network(p)
    _push_short_paths(res)
    busy = _on_source_sink_paths(res)  # what the flow found so far leaves open: networkx finishes it
    sink_side = {_SINK}
    if len(busy) > 2:
        g = nx.DiGraph()
        g.add_nodes_from(busy)
        g.add_edges_from((a, b, {} if c == _INF else {"capacity": c}) for a in busy
                         for b, c in res[a].items() if c > 0 and b in busy)
        _, (_, sink_side) = nx.minimum_cut(g, _SOURCE, _SINK, flow_func=_FLOW)
    sink_side = _extend_sink_side(res, set(sink_side), busy)
    for n in p.free:
        labels[n] = n not in sink_side
    return labels


def _cast_network(p: Problem) -> dict:
    """{a: {b: capacity}}: a cut edge is a cast paid; math.inf marks edges no cut may cross. A value read by
    one consumer in a direction needs no auxiliary node: its cast is the plain edge to that consumer."""
    net: dict = {_SOURCE: {}, _SINK: {}}
    free = set(p.free)
    big = int(_BIG)  # integers: flows pushed along these edges stay exact (a float 2**60 + 5 is 2**60)

    def x(n):
        if n in free:
            return n
        return _SOURCE if p.fixed[n] == LOW else _SINK

    def add(a, b, c):
        if a == b or (a == _SOURCE and b == _SINK) or (a == _SINK and b == _SOURCE):
            return  # a cast between two fixed labels is paid by every labelling
        nbrs = net.setdefault(a, {})
        nbrs[b] = nbrs.get(b, 0) + c
        net.setdefault(b, {})

    for u, reqs in p.reqs.items():
        xu = x(u)
        if u in p.multi:
            for r in reqs:  # a tuple cannot be cast: its readers share its label
                other = (x(r.consumer) if r.kind == "same" else
                         (_SOURCE if r.label == LOW else _SINK) if r.kind == "fixed" else None)
                if other is not None:
                    add(xu, other, big)
                    add(other, xu, big)
            continue
        w = p.weight.get(u)
        if w is None:
            continue
        same = [x(r.consumer) for r in reqs if r.kind == "same"]
        want_low = any(r.kind == "fixed" and r.label == LOW for r in reqs)
        want_f32 = any(r.kind == "fixed" and r.label == FP32 for r in reqs)
        if xu != _SINK:  # u LOW and some reader FP32: one cast up
            up = list(dict.fromkeys([c for c in same if c != _SOURCE] + ([_SINK] if want_f32 else [])))
            up = [c for c in up if c != xu]
            if len(up) == 1:
                add(xu, up[0], w)
            elif up:
                a = ("up", u)
                add(xu, a, w)
                for c in up:
                    add(a, c, _INF)
        if xu != _SOURCE:  # u FP32 and some reader LOW: one cast down
            down = list(dict.fromkeys([c for c in same if c != _SINK] + ([_SOURCE] if want_low else [])))
            down = [c for c in down if c != xu]
            if len(down) == 1:
                add(down[0], xu, w)
            elif down:
                b = ("down", u)
                add(b, xu, w)
                for c in down:
                    add(c, b, _INF)
    for group in p.tied:
        for a, b in zip(group, group[1:]):
            add(x(a), x(b), big)
            add(x(b), x(a), big)
    for u, reader in p.widen:  # no cut may put u on the FP32 side and its reader on the LOW side
        add(x(reader), x(u), _INF)
    for n in p.free:
        net.setdefault(n, {})
    return net


def _on_source_sink_paths(net: dict) -> set:
    """Nodes reachable from the source that reach the sink: no other node can carry more flow."""
    ahead = _reach_from(net, _SOURCE)
    back: dict = {}
    for a, nbrs in net.items():
        if a in ahead:
            for b, c in nbrs.items():
                if c > 0:
                    back.setdefault(b, []).append(a)
    behind = {_SINK}
    todo = [_SINK]
    while todo:
        for a in back.get(todo.pop(), ()):
            if a not in behind:
                behind.add(a)
                todo.append(a)
    return ahead & behind | {_SOURCE, _SINK}


def _reach_from(net: dict, start) -> set:
    seen = {start}
    todo = [start]
    while todo:
        for b, c in net[todo.pop()].items():
            if c > 0 and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def _push_short_paths(res: dict, depth: int = 6, budget: int = 256) -> None:
    """Saturate source-to-sink paths of at most ``depth`` edges, found depth-first looking at no more than
    ``budget`` edges per path, in the residual network ``res`` (changed in place). Most of the flow of a cast
    network runs on such paths, around one op; networkx finds the rest."""
    src = res[_SOURCE]
    for first in list(src):
        while src.get(first, 0) > 0:
            path = _short_path(res, first, depth - 1, budget)
            if path is None:
                break
            path = [_SOURCE] + path
            f = min(res[a][b] for a, b in zip(path, path[1:]))
            if f == _INF:
                return  # an uncuttable path: the cut is infinite; networkx reports it as such
            for a, b in zip(path, path[1:]):
                res[a][b] -= f
                back = res[b]
                back[a] = back.get(a, 0) + f


def _short_path(res: dict, start, depth: int, budget: int):
    stack = [(start, iter(res[start].items()))]
    path = [start]
    seen = {start, _SOURCE}  # simple paths only
    while stack:
        node, it = stack[-1]
        for b, c in it:
            budget -= 1
            if budget < 0:
                return None
            if c <= 0 or b in seen:
                continue
            if b == _SINK:
                return path + [b]
            if len(path) < depth:
                stack.append((b, iter(res[b].items())))
                path.append(b)
                seen.add(b)
                break
        else:
            stack.pop()
            path.pop()
    return None


def _extend_sink_side(net: dict, sink_side: set, keep: set) -> set:
    """The sink side of the whole network from that of the part networkx saw (``keep``): a node outside it
    is on the sink side when its residual edges lead there."""
    back: dict = {}
    for a, nbrs in net.items():
        if a not in keep:
            for b, c in nbrs.items():
                if c > 0:
                    back.setdefault(b, []).append(a)
    todo = [n for n in sink_side if n in back]
    while todo:
        for a in back.get(todo.pop(), ()):
            if a not in sink_side:
                sink_side.add(a)
                todo.append(a)
    return sink_side


def naive_labels(p: Problem, order: Iterable[str], inputs: dict[str, list[str]], promote: set[str]) -> dict[str, bool]:
    """What a plain rule gives without optimisation: FOLLOW takes its first input's dtype, PROMOTE the widest."""
    labels = dict(p.fixed)
    free = set(p.free)
    for n in order:
        if n not in free:
            continue
        ins = [labels[i] for i in inputs.get(n, []) if i in labels]
        if not ins:
            labels[n] = FP32
        elif n in promote:
            labels[n] = LOW if all(ins) else FP32
        else:
            labels[n] = ins[0]
    for group in p.tied:  # groups are parameters: keep them as stored
        for m in group:
            labels[m] = labels.get(group[0], FP32)
    return labels
