"""autocastfx leaves the process as it found it: converting in one thread changes nothing another thread sees
(its modules' attribute reads, its prints), and after convert() and a training step torch's functions, nn.Module's
methods, the garbage collector and the user's optimizer are the objects they were, holding the tensors they held."""
import copy
import gc
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from small_models import TinyGPT


class _Flagged(nn.Module):
    """Reads its training flag in forward, so its capture watches attribute reads."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.a(x).relu()
        if self.training:
            h = h * 1.0
        return self.b(self.drop(h))


def test_a_conversion_in_one_thread_leaves_another_threads_reads_and_prints_alone(capsys):
    """While the main thread converts (its capture watches which training flags the model reads), a second thread
    reads attributes of its own module and prints: every read returns the module's own value, none is seen by
    the conversion, nothing of nn.Module or of the module's class changes, and every line it printed reaches
    sys.stdout. Only the capture's copy of the model is watched: the model's own modules keep their classes."""
    other = nn.Linear(3, 3)
    module_setattr = nn.Module.__dict__["__setattr__"]
    stop, reads, errors = threading.Event(), [0], []

    def worker():
        while not stop.is_set():
            try:
                assert other.in_features == 3 and other.training is True
                assert type(other) is nn.Linear and "__getattribute__" not in nn.Module.__dict__
                reads[0] += 1
                print(f"worker line {reads[0]}")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    seen = []
    from autocastfx.capture import watch
    original = watch.watch_reads

    def recording(modules, callback, *written):  # the conversion's watchers, wrapped to see what they are given
        return original(modules, lambda m, n: (seen.append(m), callback(m, n)), *written)

    watch.watch_reads = recording
    t = threading.Thread(target=worker)
    t.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _Flagged()
            gm = autocastfx.convert(model, (torch.randn(4, 8),), dtype=torch.bfloat16)
    finally:
        stop.set()
        t.join()
        watch.watch_reads = original
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("worker line")]
    assert not errors, errors
    assert reads[0] > 0 and len(printed) == reads[0]
    assert seen and not any(m is other for m in seen)
    assert not {id(m) for m in seen} & {id(m) for m in model.modules()}  # the capture's copy, not the model
    assert [type(m) for m in model.modules()] == [_Flagged, nn.Linear, nn.Linear, nn.Dropout]
    assert "__getattribute__" not in nn.Module.__dict__ and nn.Module.__dict__["__setattr__"] is module_setattr
    assert gm(torch.randn(2, 8)).shape == (2, 4)


_WAITS = {}  # the events of _Waits (a module global: the capture deep-copies the model, and events do not copy)


class _Waits(nn.Module):
    """Stops in the middle of its forward (while a capture traces it) until ``_WAITS["go"]`` is set."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if not _WAITS["started"].is_set():  # only the first trace waits
            _WAITS["started"].set()
            assert _WAITS["go"].wait(60)
        return self.b(h.relu())


def test_modules_another_thread_calls_while_a_conversion_traces_run_as_they_would():
    """While the main thread's conversion is inside its symbolic trace (torch.fx patches nn.Module.__call__ and
    __getattr__ for the whole process meanwhile), a second thread calls a converted module and a plain one and
    reads a parameter: each runs as it would with no trace, not into the trace ("module is not installed as a
    submodule"), and the conversion is the model's."""
    x = torch.randn(4, 8)
    ready = autocastfx.convert(_Flagged().eval(), (x,), dtype=torch.bfloat16)
    plain = nn.Linear(8, 3)
    want_ready, want_plain = ready(x), plain(x)
    started, go, seen, errors = threading.Event(), threading.Event(), [], []

    def worker():
        try:
            assert started.wait(60)
            seen.append((ready(x), plain(x), plain.weight))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            go.set()

    t = threading.Thread(target=worker)
    t.start()
    _WAITS.update(started=started, go=go)
    model = _Waits()
    try:
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    finally:
        go.set()
        t.join()
    assert not errors, errors
    (got_ready, got_plain, weight), = seen
    assert torch.equal(got_ready, want_ready) and torch.equal(got_plain, want_plain)
    assert weight is plain.weight and type(weight) is nn.Parameter
    assert torch.allclose(gm(x), model(x), atol=0.05, rtol=0.05)


def test_the_modules_a_capture_watched_have_their_own_classes_after_it():
    """The capture watches its copy of the model by swapping the copy's classes meanwhile: every module the
    converted module keeps has its own class again, no graph's node metadata keeps a subclass (nn_module_stack,
    source_fn_stack): traced, exported, and a model that reads its mode (a program per mode); every graph's
    metadata pickles. No watch subclass outlives its capture."""
    import io

    from autocastfx.base.meta import WATCHED_CLASS
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(2, 3, 8, 8)
    ids = torch.randint(0, 101, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for gm in (autocastfx.convert(model, (x,), dtype=torch.bfloat16),
                   autocastfx.convert(_Flagged(), (torch.randn(4, 8),), dtype=torch.bfloat16),
                   autocastfx.convert(TinyGPT(), (ids,), dtype=torch.bfloat16)):
            assert not [n for n, m in gm.named_modules() if WATCHED_CLASS in type(m).__dict__]
            graphs = [m.graph for m in gm.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)]
            programs = gm.meta.get("autocastfx_programs")
            graphs += [*programs.graphs.values()] if programs is not None else []
            kept = [c for g in graphs for n in g.nodes for v in n.meta.values() if isinstance(v, (dict, list, tuple))
                    for c in torch.utils._pytree.tree_leaves(v) if isinstance(c, type) and WATCHED_CLASS in vars(c)]
            assert not kept, kept
            if gm.meta["autocastfx"].capture == "symbolic_trace":
                torch.save([n.meta for g in graphs for n in g.nodes], io.BytesIO())
    assert not [m for m in model.modules() if WATCHED_CLASS in type(m).__dict__]
    gc.collect()  # the subclasses were made for the captures alone: none outlives them (the modules are alive)
    assert not [o for o in gc.get_objects() if isinstance(o, type) and WATCHED_CLASS in o.__dict__]


def test_conversions_in_several_threads_at_once_are_the_conversions_made_one_by_one():
    """Six threads convert at once (a traced model that reads its mode, TinyGPT through torch.export, a plain
    traced one, each twice): every conversion is what a conversion alone makes (the same capture, a program per
    mode where the model reads its mode, the same outputs). The captures are not thread-safe (torch.fx patches
    nn.Module for the whole process while it traces): without one conversion at a time they failed or fell back
    to another capture."""
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x).relu()

    cases = {"flagged": (_Flagged, torch.randn(4, 8)), "gpt": (TinyGPT, torch.randint(0, 101, (2, 16))),
             "plain": (Plain, torch.randn(4, 8))}

    models = {}
    for name, (make, x) in cases.items():  # built here: the random state is the process's, not a thread's
        torch.manual_seed(0)
        models[name] = make()

    def convert(name):
        return autocastfx.convert(copy.deepcopy(models[name]), (cases[name][1],), dtype=torch.bfloat16)

    def facts(name, gm):  # run after the threads: a module called while torch.fx traces in another thread is
        with torch.no_grad():  # taken for part of that trace (torch.fx patches nn.Module.__call__ meanwhile)
            out = gm.eval()(cases[name][1])
        return gm.meta["autocastfx"].capture, "autocastfx_programs" in gm.meta, out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = {name: facts(name, convert(name)) for name in cases}
        results, barrier = {}, threading.Barrier(2 * len(cases))

        def run(key, name):
            barrier.wait()
            try:
                results[key] = convert(name)
            except Exception as e:  # noqa: BLE001 - reported below
                results[key] = e

        threads = [threading.Thread(target=run, args=(f"{name}{i}", name)) for i in range(2) for name in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert alone["flagged"][:2] == ("symbolic_trace", True) and alone["gpt"][0] == "torch.export"
    for key, gm in results.items():
        assert not isinstance(gm, Exception), (key, gm)
        got, want = facts(key[:-1], gm), alone[key[:-1]]
        assert got[:2] == want[:2] and torch.equal(got[2], want[2]), (key, got[:2], want[:2])


def test_after_convert_and_a_step_torch_and_the_optimizer_are_as_they_were():
    """No patch is left behind: torch's clipping functions, nn.Module's attribute lookup, the garbage collector's
    state, sys.stdout/stderr and the optimizer (the same object, holding the same parameters, with the options its
    owner gave it: not switched to its fused kernel) are unchanged after convert() and a generated training
    step."""
    import torch.nn.utils as utils
    torch.manual_seed(0)
    model = _Flagged()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch wraps its class's step once, at the first one made
    before = {"clip_norm": utils.clip_grad_norm_, "clip_value": utils.clip_grad_value_,
              "getattribute": nn.Module.__dict__.get("__getattribute__"), "gc": gc.isenabled(),
              "stdout": sys.stdout, "stderr": sys.stderr, "adamw_step": torch.optim.AdamW.step}
    params = [list(g["params"]) for g in opt.param_groups]
    options = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    defaults = dict(opt.defaults)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    step = autocastfx.train_step(gm, F.cross_entropy, opt)
    step(x, y)
    after = {"clip_norm": utils.clip_grad_norm_, "clip_value": utils.clip_grad_value_,
             "getattribute": nn.Module.__dict__.get("__getattribute__"), "gc": gc.isenabled(),
             "stdout": sys.stdout, "stderr": sys.stderr, "adamw_step": torch.optim.AdamW.step}
    assert after == before
    assert step.optimizer is opt
    assert [list(g["params"]) for g in opt.param_groups] == params  # the same tensors: not re-pointed
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == options
    assert opt.defaults == defaults and not getattr(opt, "_step_supports_amp_scaling", False)
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}


def test_quieting_torch_in_two_threads_interleaved_leaves_nothing_behind():
    """Two conversions in two threads quiet torch's internal warnings and logs; entering in one order and leaving
    in the other (where save-and-restore would leave the first one's filters and levels for good), the process's
    warning filters and logger levels end as they began, and inside, only torch's internal warnings are hidden."""
    import logging
    import threading
    from autocastfx.base import quiet
    names = ["torch._dynamo", "torch.export", "torch._subclasses.fake_tensor"]
    levels = {n: logging.getLogger(n).level for n in names}
    filters = list(warnings.filters)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def a():
        try:
            with quiet.torch_internal_warnings_off(), quiet.quiet_torch_logs():
                a_in.set()
                b_in.wait(10)
            a_out.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def b():
        try:
            a_in.wait(10)
            with quiet.torch_internal_warnings_off(), quiet.quiet_torch_logs():
                b_in.set()
                a_out.wait(10)  # A has left; B is still inside: still quiet
                seen["level"] = logging.getLogger("torch._dynamo").level
                with warnings.catch_warnings(record=True) as caught:  # the filters as they are: recorded, not shown
                    warnings.warn("Attempted to insert a get_attr Node with no underlying reference in the owning "
                                  "GraphModule! (torch's own, hidden)", UserWarning)
                    warnings.warn("the model's own warning, shown", UserWarning)
                seen["own"] = [str(w.message) for w in caught]
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen["level"] == logging.ERROR and seen["own"] == ["the model's own warning, shown"]
    assert {n: logging.getLogger(n).level for n in names} == levels
    assert warnings.filters == filters


SEEN_CACHE_FLAG = []  # what ShapeBranch's code read: a module-level list (the capture runs on a copy of the model)
SEEN_STACK_FLAG = []


class ShapeBranch(nn.Module):
    """A Python branch on a size: symbolic_trace cannot take it, so the capture is torch.export's. Notes what
    torch's fake-tensor cache flag reads while the model's code runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if isinstance(x, torch._subclasses.FakeTensor):  # torch.export's run (not symbolic_trace's first try)
            SEEN_CACHE_FLAG.append(torch._dynamo.config.fake_tensor_cache_enabled)
            SEEN_STACK_FLAG.append(getattr(torch.fx.config, "do_not_emit_stack_traces", True))
        return self.lin(x) if x.shape[0] > 1 else self.lin(x).relu()


@pytest.mark.parametrize("before", [True, False])
def test_exports_run_without_the_fake_tensor_cache_and_leave_the_flag_as_it_was(before, tmp_path):
    """torch's fake-tensor cache is off while autocastfx exports with free sizes (pytorch/pytorch#191500: it makes
    such an export slower), and after the conversion and a (static) export of the result the flag is the caller's,
    either way."""
    config, x = torch._dynamo.config, torch.randn(4, 8)
    saved = config.fake_tensor_cache_enabled
    config.fake_tensor_cache_enabled = before  # not monkeypatch: its undo deletes the entry from torch's config
    try:
        SEEN_CACHE_FLAG.clear()
        gm = autocastfx.convert(ShapeBranch(), (x,), dtype=torch.bfloat16)
        assert gm.meta["autocastfx"].capture == "torch.export"
        assert SEEN_CACHE_FLAG and not any(SEEN_CACHE_FLAG), SEEN_CACHE_FLAG  # every capture ran without it
        assert config.fake_tensor_cache_enabled is before
        autocastfx.export(gm, tmp_path / "m.pt2")
        assert config.fake_tensor_cache_enabled is before
        assert torch.equal(torch.export.load(tmp_path / "m.pt2").module()(x), gm(x))
    finally:
        config.fake_tensor_cache_enabled = saved


@pytest.mark.parametrize("before", [False, True])
def test_exports_record_no_stack_traces_and_leave_the_flag_as_it_was(before, tmp_path):
    """Every export records no source stack per node (nothing reads them; docs/benchmarks.md, "torch.export without
    node stack traces"), and after a conversion and an export of its result torch's flag is the caller's."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        pytest.skip("this torch records stack traces with no flag to turn them off")
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = before
    try:
        SEEN_STACK_FLAG.clear()
        x = torch.randn(4, 8)
        gm = autocastfx.convert(ShapeBranch(), (x,), dtype=torch.bfloat16)
        assert SEEN_STACK_FLAG and all(SEEN_STACK_FLAG), SEEN_STACK_FLAG
        assert config.do_not_emit_stack_traces is before
        assert not any(n.stack_trace for n in gm.graph.nodes)
        autocastfx.export(gm, tmp_path / "m.pt2")
        assert config.do_not_emit_stack_traces is before
        assert torch.equal(torch.export.load(tmp_path / "m.pt2").module()(x), gm(x))
    finally:
        config.do_not_emit_stack_traces = saved


def test_conversions_in_two_threads_at_once_each_export_without_the_cache_and_leave_the_flag_alone():
    """Two threads converting at once: every capture in each ran without the cache, and the flag is the caller's
    after both (a save-and-restore that two threads interleave would leave it off for good)."""
    before, errors = torch._dynamo.config.fake_tensor_cache_enabled, []
    SEEN_CACHE_FLAG.clear()

    def convert():
        try:
            autocastfx.convert(ShapeBranch(), (torch.randn(4, 8),), dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(SEEN_CACHE_FLAG) >= 2 and not any(SEEN_CACHE_FLAG), SEEN_CACHE_FLAG
    assert torch._dynamo.config.fake_tensor_cache_enabled is before


def test_exports_in_two_threads_interleaved_leave_the_stack_trace_flag_as_it_was():
    """Two exports that overlap (A starts, B starts, A ends, B ends): each runs without stack traces, and the flag
    is the caller's after both; a save-and-restore of its own per export would leave it on for good."""
    from autocastfx.capture.torch_export import _no_stack_traces
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        pytest.skip("this torch records stack traces with no flag to turn them off")
    before, seen = config.do_not_emit_stack_traces, []
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with _no_stack_traces():
            a_in.set()
            b_in.wait(10)
            seen.append(config.do_not_emit_stack_traces)
        a_out.set()

    def b():
        a_in.wait(10)
        with _no_stack_traces():
            b_in.set()
            a_out.wait(10)
            seen.append(config.do_not_emit_stack_traces)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [True, True]
    assert config.do_not_emit_stack_traces is before
