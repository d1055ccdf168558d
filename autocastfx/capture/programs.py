"""The model captured in each mode it runs in: a program per mode, each a graph module of its own over the model's
tensors, its opaque calls opened up and every value propagated; ``capture`` is the entry. The passes then plan each
program on its own, and the converted module runs the one of its mode (``core.modes``)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import inline as _inline
from .context import CaptureContext
from .trace import capture_graph, copy_model
from .watch import StateUse, fingerprint, note_changes, plain_object, state_name, own_classes, switching, watch_reads, \
    watch_state, watchable
from ..base.errors import CaptureError, one_line
from ..base.meta import fetch, is_converted, issuer_path, original_class
from ..base.quiet import warn_user
from ..core.modes import EVAL, GIVEN, TRAIN, derived, flag_marks, mode_of
from ..core.propagate import propagate


@dataclasses.dataclass
class Captured:
    """What :func:`capture` found: a program per mode (one, where the code read no mode), the key of the program of
    the model's modes now, how it was captured, the opaque calls opened up, and how the programs were found
    (``"captures"``, ``"flags"``, or why there is one capture: ``core.modes.describe``)."""
    programs: dict[str, fx.GraphModule]
    current: str
    how: str
    decisions: list
    found: str = "captures"
    state: StateUse | None = None
    readers: frozenset = frozenset()  # the modules (not the root) whose training flag the model's code read


def capture(model: nn.Module, args: tuple, kwargs: dict, policy, ctx: CaptureContext, *,
            share_tensors: bool = False) -> Captured:
    """Capture ``model`` in training mode and in eval mode (and as it is, when its modules are in mixed modes).

    One deep copy serves every capture, so the programs share the leaf modules and the model's tensors. Where the
    code read no mode one capture serves both; where only torch's dropout and batch-norm modules read it, or a mode
    cannot be captured (with a warning), the other programs are derived from one capture."""
    work = copy_model(model, share_tensors)
    switches = _switches_itself(work)
    reads: list = []
    with watch_reads(watchable(work), ctx.watch) if ctx.watch is not None else contextlib.nullcontext(), \
            watch_state(work) as state:
        out = _capture(model, work, args, kwargs, policy, ctx, lambda: copy_model(model, share_tensors), state,
                       switches, reads)
    out.state = state
    out.readers = frozenset(name for name, m in work.named_modules() if name and any(m is r for r, _ in reads))
    for p in out.programs.values():  # a leaf module runs its own forward at each call: all its settings count
        for n in p.graph.nodes:
            m = fetch(work, n.target, None) if n.op == "call_module" else None
            if isinstance(m, nn.Module) and not is_converted(m):
                state.read |= {(n.target, k) for k in vars(m) if state_name(m, k)}
                state.leaves.add(n.target)
    for p in out.programs.values():
        own_classes(p)  # the watched copy's classes, where the capture's node metadata noted its subclasses
    return out


def _capture(model: nn.Module, work: nn.Module, args: tuple, kwargs: dict, policy, ctx: CaptureContext,
             fresh, state: StateUse, switches: bool, reads: list) -> Captured:
    given = {name: m.training for name, m in work.named_modules()}
    mixed = len(set(given.values())) > 1
    current = GIVEN if mixed else (TRAIN if model.training else EVAL)
    keys = (TRAIN, EVAL, GIVEN) if mixed else (TRAIN, EVAL)
    try:
        try:
            with _switch(work, state, True):
                work.train()
            with note_changes(work, state):  # what the model's code changes as it runs (a counter it moves)
                gm, how = capture_graph(work, args, kwargs, policy, ctx, compile_code=False, reads=reads)
        except CaptureError as e:
            if model.training:
                raise
            _restore(work, given)
            gm, how = capture_graph(work, args, kwargs, policy, ctx, compile_code=False)
            decisions = _open_up(gm, args, kwargs, ctx)
            why = f"it cannot be captured in training mode ({one_line(e)})"
            return _derive_all(model, work, gm, how, decisions, keys, current, why)
        decisions = _open_up(gm, args, kwargs, ctx)
        _restore(work, given)
        if not reads and not switches:  # nothing read the mode: one program for both
            return Captured({TRAIN: gm}, TRAIN, how, decisions)
        if not switches and all(flag_only(m, code) for m, code in reads):
            owners = {name for name, m in work.named_modules() if any(m is r for r, _ in reads)}
            marks = flag_marks(gm, owners=owners)
            if owners <= {issuer_path(n) for n in marks}:  # every reader's flag found
                programs = {k: gm if k == TRAIN else derived(gm, marks, k, work) for k in keys}
                return Captured(programs, current, how, decisions, found="flags")
        programs = {TRAIN: gm}
        for key in keys[1:]:
            with _switch(work, state, key != EVAL):
                work.eval() if key == EVAL else _restore(work, given)
            # a module's own train() may set more than its flag: the modes as given are those of a fresh copy
            as_is = fresh() if key == GIVEN and switches else work
            try:
                p = capture_graph(as_is, args, kwargs, policy, ctx, compile_code=False, method=how, check=False)[0]
                decisions += _open_up(p, args, kwargs, ctx, propagated=False)
            except Exception as e:  # noqa: BLE001 - told below, and the modes derive from the training capture
                _restore(work, given)
                why = f"it cannot be captured in {key} mode ({one_line(e)})"
                return _derive_all(model, work, gm, how, decisions, keys, current, why, captured_training=True)
            programs[key] = p
        return Captured(programs, current, how, list({str(d): d for d in decisions}.values()))
    finally:
        _restore(work, given)


def _open_up(gm: fx.GraphModule, args: tuple, kwargs: dict, ctx: CaptureContext, propagated: bool = True) -> list:
    """Open up the program's opaque calls (torch.fx.wrap'd functions, traced by torch.export and inlined), and
    propagate it where it was not, or where a call was opened up; returns the decisions."""
    if not propagated and any(_inline.is_opaque(n) for n in gm.graph.nodes):
        propagate(gm, args, kwargs, meta_device=ctx.meta_device)  # inlining reads the shapes of the calls' arguments
        propagated = True
    found = _inline.inline_opaque_calls(gm)
    if any(d.inlined for d in found) or not propagated:
        propagate(gm, args, kwargs, meta_device=ctx.meta_device)
    return found


def _derive_all(model: nn.Module, work: nn.Module, gm: fx.GraphModule, how: str, decisions: list, keys: tuple,
                current: str, why: str, captured_training: bool = False) -> Captured:
    """Every mode's program derived from the one capture ``gm`` (:func:`core.modes.derived`), with a warning that
    says why."""
    marks = flag_marks(gm, None if captured_training else (lambda node: _owner_mode(node, work)))
    programs = {k: derived(gm, marks, k, work, copy_graph=k != current) for k in keys}
    off = "" if captured_training else (" (an attention's dropout probability, written as 'p if self.training "
                                         "else 0.0', was captured as 0.0 and stays off in training; code that runs "
                                         "in training only, such as a LayerDrop, is not in the program: convert the "
                                         "model in training mode, model.train(), to keep it)")
    warn_user(f"autocastfx: {type(model).__name__} is converted from one capture because {why}: gm.train()/gm.eval() "
              "switch the dropout and batch-norm flags they recognise, and other mode-dependent code keeps the form "
              f"it was captured in{off}")
    return Captured(programs, current, how, decisions, found=why)


def _owner_mode(node: fx.Node, model: nn.Module) -> bool:
    return mode_of(GIVEN, node, model)


def derive_from_graph(gm: fx.GraphModule) -> tuple[dict[str, fx.GraphModule], str]:
    """The programs of a graph module given to convert() as it is (captured elsewhere): its flags that came from
    the mode, each compared with its own module's mode, set for each mode; and the key of its own modes."""
    flags = {m.training for m in gm.modules()}
    mixed = len(flags) > 1
    current = GIVEN if mixed else (TRAIN if gm.training else EVAL)
    keys = (TRAIN, EVAL, GIVEN) if mixed else (TRAIN, EVAL)
    marks = flag_marks(gm, lambda node: _owner_mode(node, gm))
    if not marks:
        return {current: gm}, current
    return {k: derived(gm, marks, k, gm, copy_graph=k != current) for k in keys}, current


def _restore(work: nn.Module, given: dict[str, bool]) -> None:
    """The copy's modules back in the modes the model's modules have."""
    for name, m in work.named_modules():
        m.training = given[name]


_FLAG_ONLY = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
              nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def flag_only(module: nn.Module, code) -> bool:
    """Whether ``code``'s read of ``module``'s mode only sets the training flag of the one op its forward calls:
    ``code`` is the forward of one of torch's dropout modules, or of its batch norms where they keep running
    statistics with a momentum. Exact classes only: a subclass may read the mode in code of its own."""
    cls = original_class(module)
    if cls not in _FLAG_ONLY or code is not cls.forward.__code__:
        return False
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return bool(module.track_running_stats) and module.running_mean is not None and \
            isinstance(module.momentum, float)
    return True


# The train()/eval() overrides known to pass the mode on and do nothing else where their own check holds: Hugging
# Face's PreTrainedModel re-applies hub kernels on a mode change only where they are in use (``use_kernels``). Any
# other override may set what no check of the copy sees (a global, a closure, a torch setting, a hook), so a model
# with one is captured in each mode.
_PASS_THROUGH = {("transformers.modeling_utils", "PreTrainedModel.train"),
                 ("transformers.modeling_utils", "PreTrainedModel.eval")}


def _switches_itself(model: nn.Module) -> bool:
    """Whether a module of the model has its own ``train()``/``eval()`` that may do more than ``nn.Module.train``
    (then only a capture in each mode tells what differs). Only the overrides of ``_PASS_THROUGH`` may not, and only
    where switching a copy of the model (its tensors on the meta device, its converted blocks stand-ins) with
    ``train()`` and ``eval()`` sets every module's flag to the mode asked and changes no attribute, setting of a
    held config, submodule, parameter, buffer or hook. An override that writes into tensors on a switch (loralib
    merges its low-rank update into the weight on ``eval()``) is refused: the capture's switches would write into
    the model's own weights, and no program repeats such a write."""
    own = _own_modules(model)
    overriding = [m for m in own if type(m).train is not nn.Module.train or type(m).eval is not nn.Module.eval]
    if not overriding:
        return False
    names = sorted({type(m).__name__ for m in overriding})
    try:
        twin = _meta_copy(model)
        own = _own_modules(twin)
        before = _layout(own)
        switches = False
        for mode in (True, False):
            with _TensorWrites() as writes:
                twin.train() if mode else twin.eval()
            if writes.ops:
                raise _writes_error(names, writes.ops, mode)
            switches = switches or any(m.training != mode for m in own) or _layout(own) != before
    except ModeWritesError:
        raise
    except Exception:  # noqa: BLE001 - a copy or a train() that fails here: captured in each mode, as it is asked
        return True
    plain = all((getattr(f, "__module__", None), getattr(f, "__qualname__", None)) in _PASS_THROUGH
                or f is getattr(nn.Module, name) for m in overriding
                for name, f in (("train", type(m).train), ("eval", type(m).eval))) \
        and not any(getattr(m, "use_kernels", False) for m in overriding)
    return switches or not plain


class ModeWritesError(ValueError):
    """A module's own ``train()``/``eval()`` writes into tensors: refused (:func:`_switches_itself`)."""


def _writes_error(names: list[str], ops: list[str], mode: bool) -> ModeWritesError:
    return ModeWritesError(
        f"{', '.join(names)} {'has its own' if len(names) == 1 else 'have their own'} train()/eval(), which writes "
        f"into tensors when the mode changes ({', '.join(ops[:3])} in {'train()' if mode else 'eval()'}), as "
        "loralib's merge of its low-rank update into the weight does: converting would write into the model's "
        "weights, and the converted module's programs would not repeat the write at gm.train()/gm.eval(). Leave the "
        "weights alone when the mode changes (loralib: merge_weights=False), or merge the update into the weights "
        "once and convert the merged model")


class _TensorWrites(TorchDispatchMode):
    """Meanwhile notes each op that writes into a tensor it is given; given ``refuse`` (the names of the classes
    whose switch runs), raises a :class:`ModeWritesError` before the first such op runs."""

    def __init__(self, refuse: list[str] | None = None, mode: bool = True):
        super().__init__()
        self.ops: list[str] = []
        self.refuse, self.mode = refuse, mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:
            self.ops.append(str(func))
            if self.refuse is not None:
                raise _writes_error(self.refuse, self.ops, self.mode)
        return func(*args, **(kwargs or {}))


def no_tensor_writes(model: nn.Module, mode: bool):
    """Around a switch of a copy of ``model`` whose tensors are the model's: a ``train()``/``eval()`` of the model's
    that writes into them raises a :class:`ModeWritesError` before it writes (where the check on a meta copy could
    not run it, as for a ``train()`` that reads a buffer's value)."""
    names = sorted({type(m).__name__ for m in _own_modules(model)
                    if type(m).train is not nn.Module.train or type(m).eval is not nn.Module.eval})
    return _TensorWrites(refuse=names, mode=mode) if names else contextlib.nullcontext()


@contextlib.contextmanager
def _switch(work: nn.Module, state: StateUse, mode: bool):
    with switching(state), no_tensor_writes(work, mode):
        yield


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with its tensors (parameters, buffers, tensors in its attributes) as meta tensors and
    its converted blocks as empty modules: its structure and code without its memory or its blocks' programs."""
    memo: dict[int, object] = {}
    for name, m in model.named_modules():
        if name and is_converted(m):
            memo[id(m)] = nn.Module()
    values = [v for m in model.modules() for v in vars(m).values()]
    values += [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())]
    for t in torch.utils._pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor) and id(t) not in memo:
            shell = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(shell, t.requires_grad) if isinstance(t, nn.Parameter) else shell
    return copy.deepcopy(model, memo)


def _own_modules(model: nn.Module) -> list[nn.Module]:
    """The model's modules but those inside its converted blocks (which switch as leaves do)."""
    units = [m for name, m in model.named_modules() if name and is_converted(m)]
    inside = {id(s) for u in units for s in u.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def _layout(modules: list[nn.Module]) -> list:
    """What a ``train()`` may change of each module besides its flag: its attributes (plain values by value, others
    by identity; a plain object it holds, such as a config, by its attributes), its submodules, parameters, buffers
    and hooks by identity, and the attributes of its classes that are not torch's."""
    def value(v):
        if isinstance(v, dict):
            return "dict", tuple((key, id(x)) for key, x in v.items())
        if plain_object(v):
            return "object", id(v), tuple((k, fingerprint(x)) for k, x in vars(v).items())
        return fingerprint(v)

    classes = {c for m in modules for c in type(m).__mro__ if not c.__module__.startswith(("torch.", "builtins"))}
    return [{k: value(v) for k, v in vars(m).items() if k != "training"} for m in modules] + \
        [{k: fingerprint(v) for k, v in vars(c).items()} for c in sorted(classes, key=id)]
