"""What one training step costs, counted at the aten level: casts, ops, host syncs, saved activations, memory.
Every figure comes from running the step; nothing is estimated."""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
import statistics
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import autocastfx

INIT_SCALE = 2.0**10  # both scalers start where these models do not overflow: every measured step is a real update
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.casts = 0
        self.cast_bytes = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        name = func._opname
        if name in SYNC_OPS:
            self.syncs += 1
        if name == "_foreach_copy_":  # a copy between dtypes is a cast too
            for dst, src in zip(args[0], args[1]):
                if src.dtype != dst.dtype and src.is_floating_point() and dst.is_floating_point():
                    self.casts += 1
                    self.cast_bytes += src.numel() * src.element_size() + dst.numel() * dst.element_size()
        elif name in ("_to_copy", "copy_"):
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if name == "copy_" and len(ins) >= 2:
                dst, src = ins[0], ins[1]
            else:
                src, dst = ins[0], out
            if src.dtype != dst.dtype and src.is_floating_point() and dst.is_floating_point():
                self.casts += 1
                self.cast_bytes += src.numel() * src.element_size() + dst.numel() * dst.element_size()
        return out


@dataclasses.dataclass
class StepCost:
    cast_bytes: int
    casts: int
    ops: int
    syncs: int
    saved_bytes: int
    param_bytes: int
    grad_bytes: int      # peak over the step: every parameter's and master's .grad, sampled as each lands and after
    master_bytes: int
    optim_bytes: int
    live_bytes: int      # every tensor alive after the step (parameters, masters, gradients, optimizer and
                         # scaler state, the step's own buffers), deduplicated by storage
    skipped: bool = False  # the counted step overflowed and skipped its update (read outside the counted step)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage the Python heap holds right now (deduplicated by storage)."""
    return AliveBefore().bytes


def _bytes(ts) -> int:
    seen, total = set(), 0
    for t in ts:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _key(t: torch.Tensor):
    """A storage's identity while it lives: its address (the CPU and CUDA allocators never hand out one
    address twice at once). None for tensors that own no memory (meta, empty)."""
    if t.is_meta:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake and functional tensors (torch.compile's) own no memory
        return None
    return (t.device.type, ptr) if ptr else None


class AliveBefore:
    """The storages alive at one moment: what to leave out of a recipe's own count (the source model, the
    inputs). Each is remembered through weak references to the tensors on it, so a storage freed since no
    longer counts as alive before, even when a new one is given its address. ``key in alive`` asks."""

    def __init__(self):
        self.refs: dict = {}  # storage key -> weak references to the tensors on it
        self.bytes = 0
        gc.collect()
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor):  # type(), not isinstance(): some module objects warn when asked
                key = _key(o)
                if key is None:
                    continue
                if key not in self.refs:
                    self.refs[key] = []
                    self.bytes += o.untyped_storage().nbytes()
                self.refs[key].append(weakref.ref(o))

    def __contains__(self, key) -> bool:
        return any(t is not None and _key(t) == key for t in (r() for r in self.refs.get(key, ())))


def alive_storage_keys() -> AliveBefore:
    """The storages of every tensor the Python heap holds now (see :class:`AliveBefore`)."""
    return AliveBefore()


def tensors_in(obj, depth: int = 3):
    """Tensors held by ``obj``'s attributes, or inside its lists, tuples and dicts, ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0:
        if isinstance(obj, dict):
            items = obj.values()
        elif isinstance(obj, (list, tuple)):
            items = obj
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
            items = vars(obj).values()
        else:
            return
        for v in items:
            yield from tensors_in(v, depth - 1)


class MemoryTracker(TorchDispatchMode):
    """Bytes of tensor storage alive while active, and the most at once.

    Every tensor an aten op returns is watched, and so is every tensor given to ``watch()``. A storage counts
    from the first time it is seen until the last watched tensor on it is freed (a weakref finalizer: PyTorch
    keeps a tensor's Python object alive as long as the C++ tensor, so tensors that only autograd holds still
    count). Views and in-place results share their storage and are not counted twice. Storages in ``ignore``
    (alive before the thing measured existed: the input batch, the source model) are never counted. Memory a
    kernel uses without returning it as a tensor (workspaces) is not seen."""

    def __init__(self, ignore=frozenset()):
        super().__init__()
        self.ignore = ignore  # storage keys, or an AliveBefore
        self.refs: dict = {}   # storage key -> [watched tensors alive, bytes]
        self.now = 0
        self.peak = 0
        self.op = ""           # the aten op running now
        self.peak_op = ""      # the op whose output made the peak

    def watch(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = _key(t)
        if key is None or key in self.ignore:
            return
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, t.untyped_storage().nbytes()]
            self.now += entry[1]
            if self.now > self.peak:
                self.peak, self.peak_op = self.now, self.op
        entry[0] += 1
        weakref.finalize(t, self._freed, key)

    def _freed(self, key) -> None:
        entry = self.refs.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.refs[key]
                self.now -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.op = func._opname
        for t in tree_flatten(out)[0]:
            self.watch(t)
        self.op = ""
        return out


@dataclasses.dataclass
class MemoryAccount:
    """Bytes of tensor storage a training recipe holds between steps, by what holds them, and its peak during
    a step. Each storage is counted once, under the first heading that claims it (in this order)."""
    params: int      # the module's parameters and buffers (low-precision weights included)
    masters: int     # float32 master weights kept beside low-precision ones (none in autocastfx's recipe now)
    grads: int       # gradients alive between steps: .grad of parameters and masters
    optimizer: int   # optimizer state (moments, step counts)
    scaler: int      # loss-scale state (GradScaler's, or autocastfx's step's)
    other: int       # every other tensor alive that the recipe created (the step's own buffers)
    peak: int        # the most bytes alive at once during one step, what is alive between steps included
    tracked_after: int  # the tracker's running count after the step: equals between() when nothing was missed
    peak_op: str = ""   # the aten op whose output made the peak

    HEADINGS = ("params", "masters", "grads", "optimizer", "scaler")

    @property
    def between(self) -> int:
        return self.params + self.masters + self.grads + self.optimizer + self.scaler + self.other


def _census(holders: dict, ignore) -> tuple[dict, list]:
    """Bytes per heading, each storage under the first heading that holds it; then every other tensor the gc
    finds that is not in ``ignore`` (collect garbage first where cycles matter). Returns the bytes and the
    tensors counted."""
    seen, out, counted = set(), {}, []
    for heading in MemoryAccount.HEADINGS:
        out[heading] = 0
        for t in holders.get(heading, ()):
            key = None if t is None else _key(t)
            if key is not None and key not in seen and key not in ignore:
                seen.add(key)
                out[heading] += t.untyped_storage().nbytes()
                counted.append(t)
            elif t is not None:
                counted.append(t)  # watched too: its storage may outlive the tensor that claimed it
    out["other"] = 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor):
            key = _key(o)
            if key is not None and key not in seen and key not in ignore:
                seen.add(key)
                out["other"] += o.untyped_storage().nbytes()
                counted.append(o)
    return out, counted


def step_memory(run, holders=dict, ignore=frozenset()) -> MemoryAccount:
    """Run one training step (``run()``) under a :class:`MemoryTracker` and account its memory.

    ``holders()`` returns ``{heading: tensors}`` for the headings of :class:`MemoryAccount` (parameters, masters,
    gradients, optimizer and scaler state); it is called before the step, so that everything alive then is
    watched from the start, and after it, for the between-step census. ``ignore``: storages that are not the
    recipe's (``alive_storage_keys()`` taken before the recipe was built). Call it after a few warm-up steps,
    so that optimizer state exists and the step is a steady one."""
    tracker = MemoryTracker(ignore)
    gc.collect()
    _, alive = _census(holders(), ignore)
    for t in alive:
        tracker.watch(t)
    del alive
    tracker.peak, tracker.peak_op = tracker.now, "(before the step)"
    with tracker:
        out = run()
    del out
    gc.collect()
    counts, _ = _census(holders(), ignore)
    return MemoryAccount(**counts, peak=tracker.peak, tracked_after=tracker.now, peak_op=tracker.peak_op)


class Runner:
    """One training-step recipe over one model: ``fp32``, ``autocast`` (+GradScaler), ``autocastfx``, ``floor``."""

    def __init__(self, recipe, model, inputs, target, loss_fn=F.cross_entropy, lr=1e-3, fused=None,
                 dtype=torch.float16, **convert_kw):
        self.recipe, self.inputs, self.target, self.loss_fn = recipe, inputs, target, loss_fn
        self.dtype = dtype  # the low dtype of autocast and of autocastfx
        self._before = AliveBefore()  # what was alive before this recipe existed (the source model, the inputs)
        self._baseline = self._before.bytes
        model = copy.deepcopy(model)
        self.masters = []
        if recipe == "autocastfx":
            self.model = autocastfx.convert(model, inputs, dtype=dtype, **convert_kw)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)
            self.step = autocastfx.train_step(self.model, loss_fn, self.opt, init_scale=INIT_SCALE)
            # its parameters are the float32 model's, cast in the graph: no master copies beside them
        elif recipe == "autocast":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
            self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            self.step = self._autocast_step
        elif recipe == "fp32":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
            self.step = self._fp32_step
        elif recipe == "floor":  # the model halved by hand: no casts in the model, no scaler, no masters
            self.model = model.half()
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=fused)
            self.inputs = tuple(x.half() if x.is_floating_point() else x for x in inputs)
            self.step = self._floor_step
        else:
            raise ValueError(recipe)

    def _fp32_step(self, inputs, target):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*inputs), target)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def _autocast_step(self, inputs, target):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.model(*inputs)
        loss = self.loss_fn(out.float(), target)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    def _floor_step(self, inputs, target):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*inputs).float(), target)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def run(self):
        return self.step(self.inputs, self.target)

    def cost(self) -> StepCost:
        for _ in range(3):  # warm-up: optimizer state exists, GradScaler has left its first overflows behind
            self.run()
        c = Counter()
        saved = []
        params = list({id(p): p for p in self.model.parameters()}.values())

        def grads_now():
            return _bytes([p.grad for p in params] + [m.grad for m in self.masters])
        peak = [0]

        def landed(_):  # a parameter's gradient is accumulated: sample every gradient alive now
            peak[0] = max(peak[0], grads_now())

        def pack(t):
            saved.append(t)
            return t
        hooks = [p.register_post_accumulate_grad_hook(landed) for p in params if p.requires_grad]
        scale_before = self.scaler.get_scale() if self.recipe == "autocast" else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), c:
                loss = self.run()
        finally:
            for h in hooks:
                h.remove()
        peak[0] = max(peak[0], grads_now())
        if self.recipe == "autocast":
            skipped = self.scaler.get_scale() < scale_before  # GradScaler backs off only on an overflow
        elif self.recipe == "autocastfx":
            skipped = self.step.stats.history()[-1][1]
        else:
            skipped = False
        saved_bytes = _bytes(saved)
        saved.clear()
        del loss
        state = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return StepCost(c.cast_bytes, c.casts, c.ops, c.syncs, saved_bytes, _bytes(params), peak[0],
                        _bytes(self.masters), _bytes(state), live_tensor_bytes() - self._baseline, skipped)

    def memory(self, warmup: int = 3) -> MemoryAccount:
        """Bytes alive between steps, by holder, and the peak during one step (see :func:`step_memory`)."""
        for _ in range(warmup):
            self.run()
        return step_memory(self.run, self._holders, self._before)

    def _holders(self) -> dict:
        params = list(self.model.parameters()) + list(self.model.buffers())
        if self.recipe == "autocast":
            scaler = list(tensors_in(self.scaler))
        elif self.recipe == "autocastfx":
            scaler = list(tensors_in(self.step.state))
        else:
            scaler = []
        state = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "masters": self.masters,
                "grads": [p.grad for p in params] + [m.grad for m in self.masters],
                "optimizer": state, "scaler": scaler}


def interleaved_step_times(runners: dict, rounds: int = 10, steps: int = 30, warmup: int = 20) -> dict:
    """Median step time of each runner, the runners taking turns (``rounds`` blocks of ``steps`` each) so that
    a slow spell of a shared machine falls on all of them alike."""
    for r in runners.values():
        for _ in range(warmup):
            r.run()
    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k, r in runners.items():
            for _ in range(steps):
                t = time.perf_counter()
                r.run()
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def median_step_time(runner: Runner, steps: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        runner.run()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed(fn, *args, repeats: int = 3, **kwargs):
    """``fn(*args, **kwargs)``'s last result and its median time over ``repeats`` calls, each started with no
    garbage left by the one before (so that no call pays for collecting another's objects)."""
    times = []
    for _ in range(repeats):
        out = None
        gc.collect()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append(time.perf_counter() - t)
    return out, sorted(times)[len(times) // 2]


def convert_scaling(depths, make, example):
    """(nodes, symbolic_trace seconds, convert seconds) per depth, after one untimed conversion of the first
    depth: a process's first conversion also pays for one-time set-up (imports, the fake-tensor machinery)."""
    autocastfx.convert(make(depths[0]), (example(),), pad_multiple=1)
    rows = []
    for depth in depths:
        model, x = make(depth), example()
        g, t_trace = _timed(torch.fx.symbolic_trace, model)
        gm, t_conv = _timed(autocastfx.convert, model, (x,), pad_multiple=1)
        rows.append((len(g.graph.nodes), len(gm.graph.nodes), t_trace, t_conv))
    return rows


def convert_blocks_scaling(depths, make, example):
    """(depth, symbolic_trace s, convert(blocks=None) s, convert(blocks="auto") s) per depth."""
    autocastfx.convert(make(depths[0]), (example(),), pad_multiple=1)
    rows = []
    for depth in depths:
        model, x = make(depth), example()
        _, t_trace = _timed(torch.fx.symbolic_trace, model)
        _, t_flat = _timed(autocastfx.convert, model, (x,), pad_multiple=1, blocks=None)
        gm, t_blocks = _timed(autocastfx.convert, model, (x,), pad_multiple=1)
        assert isinstance(gm.layers, torch.nn.ModuleList) and "autocastfx" in gm.layers[0].meta
        rows.append((depth, t_trace, t_flat, t_blocks))
    return rows


def convert_hf_scaling(depths, repeats: int = 1):
    """(depth, torch.export s, convert(blocks=None) s, convert(blocks="auto") s, casts per forward one graph,
    casts with blocks) per depth, for a Hugging Face Llama built from a config (its forward only torch.export
    captures). Each time a single call unless ``repeats`` says otherwise (a call takes seconds)."""
    import transformers

    rows = []
    for depth in depths:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=128)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        kw = {"input_ids": torch.randint(0, 256, (2, 16)), "use_cache": False}
        _, t_export = _timed(torch.export.export, model, (), kw, strict=False, repeats=repeats)
        flat, t_flat = _timed(autocastfx.convert, model, example_kwargs=kw, blocks=None, repeats=repeats)
        tree, t_blocks = _timed(autocastfx.convert, model, example_kwargs=kw, repeats=repeats)
        assert isinstance(tree.model.layers, torch.nn.ModuleList) and "autocastfx" in tree.model.layers[0].meta
        rows.append((depth, t_export, t_flat, t_blocks, _float_casts(flat, kw), _float_casts(tree, kw)))
    return rows


def _float_casts(gm, kwargs) -> int:
    """Dtype-changing copies between float dtypes in one forward, counted at the aten level."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._opname in ("_to_copy", "to") and isinstance(args[0], torch.Tensor) \
                    and isinstance(out, torch.Tensor) and args[0].dtype != out.dtype \
                    and args[0].is_floating_point() and out.is_floating_point():
                Count.n += 1
            return out

    with torch.no_grad(), Count():
        gm(**kwargs)
    return Count.n


def accumulation_cast_bytes(model, inputs, target, loss_fn=F.cross_entropy, micro=4):
    """Cast bytes per optimizer update with ``micro`` micro-batches: autocast re-casts the weights on every
    micro-batch's forward and every backward; autocastfx's graph casts each weight once per forward."""
    out = {}
    m1 = copy.deepcopy(model)
    opt = torch.optim.AdamW(m1.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

    def autocast_update():
        opt.zero_grad(set_to_none=True)
        for _ in range(micro):
            with torch.autocast("cpu", dtype=torch.float16):
                o = m1(*inputs)
            scaler.scale(loss_fn(o.float(), target) / micro).backward()
        scaler.step(opt)
        scaler.update()

    gm = autocastfx.convert(copy.deepcopy(model), inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3, fused=True), init_scale=INIT_SCALE,
                                 accum_steps=micro)

    def autocastfx_update():
        for _ in range(micro):
            step(inputs, target)

    for name, fn in (("autocast+GradScaler", autocast_update), ("autocastfx", autocastfx_update)):
        fn()
        c = Counter()
        with c:
            fn()
        out[name] = (c.cast_bytes, c.casts)
    return out


def memory_table(workloads, recipes=("autocast", "autocastfx")) -> str:
    """Between-step bytes by holder and the peak during a step, per recipe, on the CPU (``Runner.memory``).
    ``workloads``: (name, model, inputs, target, loss_fn)."""
    head = (f"{'model':10} {'recipe':11} {'params':>8} {'masters':>8} {'grads':>8} {'optim':>8} {'scaler':>7} "
            f"{'other':>6} {'between':>8} {'peak':>8}  peak made by")
    lines = ["Bytes of tensor storage, by holder, alive between two steps, and the most alive at once during one.",
             head, "-" * len(head)]
    ratios = []
    for name, model, inputs, target, loss_fn in workloads:
        acc = {}
        for recipe in recipes:
            a = acc[recipe] = Runner(recipe, model, inputs, target, loss_fn).memory()
            lines.append(f"{name:10} {recipe:11} {a.params:8d} {a.masters:8d} {a.grads:8d} {a.optimizer:8d} "
                         f"{a.scaler:7d} {a.other:6d} {a.between:8d} {a.peak:8d}  {a.peak_op}")
        if "autocast" in acc and "autocastfx" in acc:
            ac, fx = acc["autocast"], acc["autocastfx"]
            ratios.append(f"{name}: autocastfx/autocast between steps {fx.between / ac.between:.2f}, "
                          f"peak {fx.peak / ac.peak:.2f}")
    return "\n".join(lines + [""] + ratios)


def small_model_workloads():
    """tests/small_models.py's models with their example batches and a target each."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import small_models

    out = []
    for name in small_models.ALL:
        model, inputs = small_models.example(name, batch=4)
        if name == "gpt":
            target = torch.roll(inputs[0], -1, 1)
            out.append((name, model, inputs, target, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())))
        else:
            out.append((name, model, inputs, torch.arange(4) % 10, F.cross_entropy))
    return out


if __name__ == "__main__":  # python bench/measure.py: the memory account of the test suite's small models
    print(f"torch {torch.__version__}, AdamW, both scalers from {INIT_SCALE:g}, autocastfx with its defaults")
    print(memory_table(small_model_workloads()))
