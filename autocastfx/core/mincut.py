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

    FP32 for every node that reaches the sink in the final residual network (source side = LOW), LOW for the rest,
    so a tie goes LOW. That set is the same for every maximum flow, so the answer does not depend on the solver.
    """
    labels = dict(p.fixed)
    if not p.free:
        return labels
    net = _cast_network(p)
    g = nx.DiGraph()
    g.add_nodes_from(net)
    g.add_edges_from((a, b, {} if c == _INF else {"capacity": c}) for a, nbrs in net.items() for b, c in nbrs.items())
    _, (low, _) = nx.minimum_cut(g, _SOURCE, _SINK, flow_func=_FLOW)
    for n in p.free:
        labels[n] = n in low
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
