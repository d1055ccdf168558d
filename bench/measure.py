"""What one training step costs, counted at the aten level: casts, ops, host syncs, saved activations, memory.
Every figure comes from running the step; nothing is estimated."""
from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time

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
        if name == "_foreach_copy_":  # the masters' copy-back and the gradients' copy are casts too
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
    gc.collect()
    # type(), not isinstance(): some module objects warn when their __class__ is read
    return _bytes(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and not o.is_meta)


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


class Runner:
    """One training-step recipe over one model: ``fp32``, ``autocast`` (+GradScaler), ``autocastfx``, ``floor``."""

    def __init__(self, recipe, model, inputs, target, loss_fn=F.cross_entropy, lr=1e-3, fused=None, **convert_kw):
        self.recipe, self.inputs, self.target, self.loss_fn = recipe, inputs, target, loss_fn
        self._baseline = live_tensor_bytes()  # what was alive before this recipe existed (the source model, inputs)
        model = copy.deepcopy(model)
        self.masters = []
        if recipe == "autocastfx":
            self.model = autocastfx.convert(model, inputs, **convert_kw)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)  # the step turns fused on itself
            self.step = autocastfx.train_step(self.model, loss_fn, self.opt, init_scale=INIT_SCALE)
            self.masters = autocastfx.master_parameters(self.model)
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
        with torch.autocast("cpu", dtype=torch.float16):
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


def convert_scaling(depths, make, example):
    """(nodes, symbolic_trace seconds, convert seconds) per depth."""
    rows = []
    for depth in depths:
        model = make(depth)
        x = example()
        t = time.perf_counter()
        g = torch.fx.symbolic_trace(model)
        t_trace = time.perf_counter() - t
        t = time.perf_counter()
        gm = autocastfx.convert(model, (x,), pad_multiple=1)
        t_conv = time.perf_counter() - t
        rows.append((len(g.graph.nodes), len(gm.graph.nodes), t_trace, t_conv))
    return rows


def accumulation_cast_bytes(model, inputs, target, loss_fn=F.cross_entropy, micro=4):
    """Cast bytes per optimizer update with ``micro`` micro-batches: autocast re-casts the weights on every
    micro-batch's forward and every backward; autocastfx copies the masters back once per update."""
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
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3), init_scale=INIT_SCALE,
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
