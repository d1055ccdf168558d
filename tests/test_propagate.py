"""Shape propagation on fake tensors: the same facts as a real run, no real op, no memory, no side effects."""
import functools
import logging
import os
import random
import subprocess
import sys
import textwrap

import networkx as nx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import autocastfx
import types

from autocastfx.base.meta import TensorInfo
import helpers
from autocastfx.core import propagate as _prop

capture = types.SimpleNamespace(propagate=_prop.propagate, capture=helpers.capture, TensorInfo=TensorInfo,
                                propagate_counts=_prop.propagate_counts)
from autocastfx.core import padding
from autocastfx.core.mincut import FP32, LOW, Problem, Req, cast_cost, solve_min_cut
from autocastfx.core.policy import Policy
from autocastfx.core.weights import low_read_names
from small_models import ALL, TinyResNet, example
from test_core import NeedsExport, UserCasts
from test_padding import CASES as PAD_CASES
from test_padding import ConvBNChain


@pytest.fixture
def pad_always(monkeypatch):
    """Toy layers are memory-bound, so the padding gate would leave them alone; pad them to exercise the
    second propagation (padded shapes, channel-padded batch norm)."""
    if hasattr(padding, "DEFAULT_GATE"):
        monkeypatch.setattr(padding, "DEFAULT_GATE", "always")


def _zoo():
    cases = {name: functools.partial(example, name) for name in ALL}
    cases.update({f"pad_{k}": v for k, v in PAD_CASES.items()})
    cases["conv_bn_chain"] = lambda: (ConvBNChain(), (torch.randn(4, 3, 8, 8),))
    cases["user_casts"] = lambda: (UserCasts(), (torch.randn(3, 16),))
    cases["needs_export"] = lambda: (NeedsExport().eval(), (torch.randn(2, 5, 16),))
    return cases


ZOO = _zoo()


_PROPAGATE = _prop._propagate


def _real(gm, args, kwargs, mode="fake"):
    """propagate() as convert() calls it, always on the real values."""
    return _PROPAGATE(gm, args, kwargs, "real")


def _infos(gm):
    return {n.name: n.meta.get("autocastfx_info") for n in gm.graph.nodes}


def _plan_facts(gm):
    plan = gm.meta["autocastfx"].plan
    return (str(plan), {k: (v.op_class, v.label, v.reason, v.fp32_out) for k, v in plan.nodes.items()},
            plan.casts, low_read_names(gm), plan.before, plan.after)  # and the weights the graph casts low


# ------------------------------------------------------------------------------- same facts as the real run

@pytest.mark.usefixtures("pad_always")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_fake_and_real_propagation_give_the_same_graph_plan_and_report(name, monkeypatch):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    gm_fake = autocastfx.convert(model, inputs)
    assert gm_fake.meta["autocastfx_propagate"] == "fake"
    with monkeypatch.context() as m:
        m.setattr(_prop, "_propagate", _real)
        gm_real = autocastfx.convert(model, inputs)
    assert gm_real.meta["autocastfx_propagate"] == "real"
    assert _infos(gm_fake) == _infos(gm_real)
    assert gm_fake.code == gm_real.code
    assert _plan_facts(gm_fake) == _plan_facts(gm_real)
    fake, real = autocastfx.report(gm_fake).to_dict(), autocastfx.report(gm_real).to_dict()
    assert (fake["totals"].pop("shapes"), real["totals"].pop("shapes")) == ("fake", "real")  # how, not what
    assert fake == real


@pytest.mark.parametrize("name", ["resnet", "gpt"])
@pytest.mark.parametrize("training", [True, False])
def test_every_value_matches_the_real_run_in_train_and_eval(name, training):
    """Node by node, on a traced graph with batch-norm leaves and on torch.export's aten graph (in-place
    ``add_`` on the batch counter, guard calls)."""
    model, inputs = example(name)
    model.train(training)
    gm, _ = capture.capture(model, inputs, {}, Policy.default())
    capture.propagate(gm, inputs, {}, mode="real")
    real = _infos(gm)
    for n in gm.graph.nodes:
        n.meta.pop("autocastfx_info", None)
    capture.propagate(gm, inputs, {})
    assert gm.meta["autocastfx_propagate"] == "fake"
    assert _infos(gm) == real
    assert sum(isinstance(v, capture.TensorInfo) for v in real.values()) > 20


class Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *xs):
        return self.fc(xs[0]) + xs[1]


def test_varargs_and_lists_of_tensors_match_the_real_run():
    gm = torch.fx.symbolic_trace(Varargs())
    inputs = (torch.randn(2, 4), torch.randn(2, 4))
    capture.propagate(gm, inputs, {}, mode="real")
    real = _infos(gm)
    capture.propagate(gm, inputs, {})
    assert gm.meta["autocastfx_propagate"] == "fake"
    assert _infos(gm) == real
    assert real["_xs"] == (capture.TensorInfo(torch.float32, (2, 4)),) * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_fake_values_carry_the_cuda_device(name):
    model, inputs = example(name)
    model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    gm, _ = capture.capture(model, inputs, {}, Policy.default())
    capture.propagate(gm, inputs, {}, mode="real")
    real = _infos(gm)
    capture.propagate(gm, inputs, {})
    assert gm.meta["autocastfx_propagate"] == "fake"
    assert _infos(gm) == real
    assert "cuda" in {v.device for v in real.values() if isinstance(v, capture.TensorInfo)}


# ------------------------------------------------------------------------------- nothing real runs

class RealOps(TorchDispatchMode):
    """Records every aten op that reads or writes a real tensor (not fake, not on the meta device)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(not isinstance(t, torch._subclasses.FakeTensor) and not t.is_meta for t in tensors):
            self.ops.append(str(func))
        return out


def _bn_and_dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 4)).train(), (torch.randn(2, 3, 8, 8),)


@pytest.mark.parametrize("name", ["bn_dropout", "gpt"])
def test_no_real_tensor_op_during_fake_propagation(name):
    model, inputs = _bn_and_dropout_model() if name == "bn_dropout" else example("gpt")
    gm, _ = capture.capture(model, inputs, {}, Policy.default())
    with RealOps() as rec:
        capture.propagate(gm, inputs, {})
    assert gm.meta["autocastfx_propagate"] == "fake"
    assert rec.ops == []
    with RealOps() as rec:  # the recorder sees real work when there is some
        capture.propagate(gm, inputs, {}, mode="real")
    assert len(rec.ops) > 5


def test_parameters_buffers_and_random_state_untouched():
    model, inputs = _bn_and_dropout_model()
    gm, _ = capture.capture(model, inputs, {}, Policy.default())
    before = {k: (v, v.detach().clone(), v._version) for k, v in gm.state_dict(keep_vars=True).items()}
    rng = torch.get_rng_state()
    capture.propagate(gm, inputs, {})
    assert gm.meta["autocastfx_propagate"] == "fake"
    assert torch.equal(torch.get_rng_state(), rng)
    after = gm.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for k, (obj, value, version) in before.items():
        assert after[k] is obj, k                      # the very same tensor object
        assert type(obj) in (torch.Tensor, nn.Parameter), k
        assert obj._version == version, k              # never written, not even restored
        assert torch.equal(obj, value), k
    assert int(gm.get_submodule("1").num_batches_tracked) == 0


def test_memoised_blocks_are_not_run_again():
    """A stack of identical blocks costs about one block of fake ops, whatever its depth."""
    def fake_ops(depth):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(depth)])
        gm, _ = capture.capture(model, (torch.randn(2, 16),), {}, Policy.default())
        with Counting() as c:
            capture.propagate(gm, (torch.randn(2, 16),), {})
        return c.n

    assert fake_ops(40) == fake_ops(4) > 0


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------- fallback to the real run

class DataDependent(nn.Module):
    """Output shapes that depend on values: no fake kernel can know them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        picked = torch.masked_select(h, h > 0)              # length = number of positive entries
        rows = torch.nonzero(x[:, 0] > 0).flatten()         # which rows start positive
        return self.out(h[rows]), picked.sum()


def test_data_dependent_op_falls_back_to_the_real_run_visibly(caplog):
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(6, 8)
    fallbacks = capture.propagate_counts["fallback"]
    with caplog.at_level(logging.INFO, logger="autocastfx.propagate"):
        gm = autocastfx.convert(model, (x,), pad_multiple=1)
    assert gm.meta["autocastfx"].capture == "symbolic_trace"
    assert gm.meta["autocastfx_propagate"].startswith("real (fake run failed")
    assert capture.propagate_counts["fallback"] > fallbacks
    assert any("fake propagation" in r.getMessage() for r in caplog.records)
    rep = autocastfx.report(gm)
    assert rep.totals["shapes"].startswith("real (fake run failed")
    assert "shapes and dtypes learnt from a real (fake run failed" in str(rep)
    # the recorded shapes are the true ones, counted independently
    with torch.no_grad():
        h = model.fc(x)
    shapes = {n.target: n.meta["autocastfx_info"].shape for n in gm.graph.nodes
              if n.op == "call_function" and n.target in (torch.masked_select, torch.nonzero)}
    assert shapes[torch.masked_select] == (int((h > 0).sum()),)
    assert shapes[torch.nonzero] == (int((x[:, 0] > 0).sum()), 1)
    out, total = gm(x)
    ref_out, ref_total = model(x)
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(total.float(), ref_total, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------- clear errors

def test_meta_device_example_input_is_a_clear_error():
    with pytest.raises(ValueError, match="meta device.*real tensor"):
        autocastfx.convert(TinyResNet(), (torch.empty(1, 3, 8, 8, device="meta"),))
    gm, _ = capture.capture(TinyResNet(), (torch.randn(1, 3, 8, 8),), {}, Policy.default())
    with pytest.raises(ValueError, match="meta device"):
        capture.propagate(gm, (torch.empty(1, 3, 8, 8, device="meta"),), {})


def test_inputs_that_do_not_fit_the_graph_are_clear_errors():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(autocastfx.CaptureError, match=r"shapes cannot be multiplied \(2x5 and 4x8\)"):
        autocastfx.convert(model, (torch.randn(2, 5),))
    with pytest.raises(autocastfx.CaptureError, match="2 example inputs given, but the graph takes 1"):
        autocastfx.convert(model, (torch.randn(2, 4), torch.randn(3)))
    gm, _ = capture.capture(model, (torch.randn(2, 4),), {}, Policy.default())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        capture.propagate(gm, (torch.randn(2, 5),), {})
    with pytest.raises(ValueError, match="'fake' or 'real'"):
        capture.propagate(gm, (torch.randn(2, 4),), {}, mode="meta")


# ------------------------------------------------------------------------------- memory

_MEMORY_SCRIPT = textwrap.dedent("""
    import resource, torch, torch.nn as nn, autocastfx
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10))
    autocastfx.convert(model, (torch.randn(1, 3, 16, 16),))    # imports and first-use set-up
    x = torch.randn(1, 3, 1024, 1024)                          # 12 MiB; each activation is 256 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gm = autocastfx.convert(model, (x,))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = [n.meta["autocastfx_info"] for n in gm.graph.nodes if n.op == "call_function"][0]
    print(gm.meta["autocastfx_propagate"], (after - before) // 1024, info.shape)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_converting_needs_no_activation_memory():
    """A fresh process converts a conv net whose activations at the example input are 256 MiB each: its
    peak resident memory grows by far less than one of them (a real forward would add several)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    mode, grown_mib, shape = out.stdout.split(maxsplit=2)
    assert mode == "fake"
    assert "1024, 1024" in shape
    assert int(grown_mib) < 64, f"peak memory grew by {grown_mib} MiB"


# ------------------------------------------------------------------------------- the min-cut

def _reference_min_cut(p: Problem) -> dict:
    """The plain construction: one auxiliary node per value and direction, networkx's max-flow on all of it."""
    labels = dict(p.fixed)
    g = nx.DiGraph()
    g.add_nodes_from(["S", "T"] + list(p.free))
    free = set(p.free)

    def x(n):
        return n if n in free else ("S" if p.fixed[n] == LOW else "T")

    def cap(a, b, c):
        if a != b:
            g.add_edge(a, b, capacity=g.get_edge_data(a, b, {"capacity": 0}).get("capacity", 0) + c)

    for u, reqs in p.reqs.items():
        if u in p.multi:
            for r in reqs:
                other = x(r.consumer) if r.kind == "same" else ("S" if r.label else "T") if r.kind == "fixed" else None
                if other is not None:
                    cap(x(u), other, 2**60)
                    cap(other, x(u), 2**60)
            continue
        w = p.weight.get(u)
        if w is None:
            continue
        same = [x(r.consumer) for r in reqs if r.kind == "same"]
        fixed = {r.label for r in reqs if r.kind == "fixed"}
        up = [c for c in same if c != "S"] + (["T"] if FP32 in fixed else [])
        down = [c for c in same if c != "T"] + (["S"] if LOW in fixed else [])
        if x(u) != "T" and up:
            cap(x(u), ("up", u), w)
            g.add_edges_from((("up", u), c) for c in up)
        if x(u) != "S" and down:
            cap(("down", u), x(u), w)
            g.add_edges_from((c, ("down", u)) for c in down)
    for group in p.tied:
        for a, b in zip(group, group[1:]):
            cap(x(a), x(b), 2**60)
            cap(x(b), x(a), 2**60)
    _, (s_side, _) = nx.minimum_cut(g, "S", "T")
    labels.update({n: n in s_side for n in p.free})
    return labels


def _random_problem(rng, n):
    names = [f"n{i}" for i in range(n)]
    fixed = {m: rng.random() < 0.5 for i, m in enumerate(names) if i == 0 or rng.random() < 0.35}
    free = [m for m in names if m not in fixed]
    reqs = {}
    for i, m in enumerate(names[1:], 1):
        for src in rng.sample(names[:i], k=min(i, rng.randint(1, 3))):
            r = rng.random()
            req = (Req(m, "same") if m in free and r < 0.6 else
                   Req(m, "fixed", rng.random() < 0.5) if r < 0.9 else Req(m, "any"))
            reqs.setdefault(src, []).append(req)
    multi = {rng.choice(names)} if rng.random() < 0.3 else set()
    tied = [rng.sample(free, 2)] if len(free) > 2 and rng.random() < 0.3 else []
    return Problem(fixed, free, {m: rng.randint(1, 9) for m in names}, reqs, multi, tied)


def test_min_cut_gives_the_labels_of_the_plain_construction():
    """One-reader values without auxiliary nodes: the labels are exactly those of networkx on the plain network
    (its partition, ties included)."""
    rng = random.Random(7)
    for _ in range(400):
        p = _random_problem(rng, rng.randint(2, 40))
        labels, reference = solve_min_cut(p), _reference_min_cut(p)
        assert labels == reference
        assert cast_cost(p, labels) == cast_cost(p, reference)


def test_min_cut_of_a_deep_stack_is_the_plain_constructions():
    """A chain of 300 blocks (a transformer's residual stream), each matmul fixed low beside a float32 norm: one
    cast per block, the labels the plain construction's."""
    def stack(depth):
        fixed, free, weight, reqs = {"x": FP32}, [], {"x": 64}, {}
        prev = "x"
        for i in range(depth):
            mm, act, add = f"mm{i}", f"act{i}", f"add{i}"
            fixed[mm] = LOW
            free.extend([act, add])
            weight.update({mm: 64, act: 64, add: 64})
            reqs.setdefault(prev, []).extend([Req(mm, "fixed", LOW), Req(add, "same"), Req(f"ln{i}", "fixed", FP32)])
            reqs[mm] = [Req(act, "same")]
            reqs[act] = [Req(add, "same")]
            prev = add
        return Problem(fixed, free, weight, reqs)

    p = stack(300)
    expected = _reference_min_cut(p)
    assert solve_min_cut(p) == expected
    assert cast_cost(p, expected) == (300 * 64, 300)
