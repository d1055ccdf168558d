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
:func:`install` gives the converted module ``train(mode)``/``eval()`` methods that set the marked flags, stop
or restart the ``num_batches_tracked`` increment that export writes beside each batch norm, and recompile,
then switch the leaf modules as ``nn.Module.train`` does. PyTorch's own helpers for exported programs
(``move_exported_model_to_train/eval``) lived in ``torch.ao.quantization.pt2e`` and are gone from current
releases; the rewrite here is the same idea on flags, with no pattern matching.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import calls as _calls, weights as _weights
from ..base import keys as K
from ..base.meta import is_converted

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
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if isinstance(path, str):
            path = path.removeprefix("L['self'].").replace("L__self___", "")
            try:
                return model.get_submodule(path).training if path else model.training
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

    def mode_at_capture(node):
        return True if captured_training else _owner_training(node, model)

    marked = 0
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
            node.meta[K.MODE] = mark
            marked += 1
    # the modes the model has, module by module (a frozen batch norm in a training model stays frozen)
    for node in gm.graph.nodes:
        if K.MODE in node.meta:
            _set_node(node, node.meta[K.MODE], _owner_training(node, model))
    _copy_module_modes(gm, model)
    gm.recompile()
    return marked


def _copy_module_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    originals = dict(model.named_modules())
    for name, sub in gm.named_modules():
        if name in originals:
            sub.training = originals[name].training


def set_mode(gm: fx.GraphModule, mode: bool) -> fx.GraphModule:
    """Switch the marked flags and the leaf modules to ``mode``; recompile only when a flag changed."""
    if not isinstance(mode, bool):
        raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
    programs: Programs | None = gm.meta.get(K.PROGRAMS)
    if programs is not None:
        key = TRAIN if mode else EVAL
        if programs.current != key:
            _keep_wrapped_call(type(gm))
            programs.current = key
            _switch_graph(gm, programs, key)
        nn.Module.train(gm, mode)
        return gm
    changed = False
    for node in gm.graph.nodes:
        mark: ModeArg | None = node.meta.get(K.MODE)
        if mark is not None:
            changed |= _set_node(node, mark, mode)
    if changed:
        _keep_wrapped_call(type(gm))
        gm.recompile()
    nn.Module.train(gm, mode)  # leaf modules (call_module nodes) and every .training flag
    return gm


_CODE_FIELDS = ("_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec")


def _switch_graph(gm: fx.GraphModule, programs: Programs, key: str) -> None:
    """Run the program ``key``: its graph, and the ``forward`` written for it the first time it ran, kept per
    program. The same function object each time means torch.compile's cache (kept per code object) finds the
    code it compiled for that mode: switching ``gm.train()``/``gm.eval()`` under ``torch.compile(gm)`` compiles
    each mode once, not on every switch. Any other recompile (an edit of the graph) drops what was kept."""
    for k, g in programs.graphs.items():  # the program running now, kept as it is before it is left
        if g is gm._graph and k not in programs.code:
            programs.code[k] = _running_code(gm)
    graph = programs.graphs[key]
    kept = programs.code.get(key)
    if kept is not None and kept["graph"] is graph:
        gm._graph = graph
        graph.owning_module = gm
        for name in _CODE_FIELDS:
            if name in kept:
                setattr(gm, name, kept[name])
        type(gm).forward = kept["forward"]
        return
    programs.switching = True
    try:
        gm.graph = graph  # the setter recompiles
    finally:
        programs.switching = False
    programs.code[key] = _running_code(gm)


def _running_code(gm: fx.GraphModule) -> dict:
    return {"graph": gm._graph, "forward": type(gm).forward,
            **{n: getattr(gm, n) for n in _CODE_FIELDS if hasattr(gm, n)}}


def _keep_wrapped_call(cls: type) -> None:
    """Before a recompile on a class made over the converted module's (FSDP2's ``FSDP<name>``, made by
    ``fully_shard``): give it its base's call wrapper. GraphModule.recompile gives a class without one a wrapper
    that calls ``super().__call__``, which is the base's ``call_wrapped``, which calls the instance's wrapper
    again: endless recursion on the next call."""
    if "_wrapped_call" in vars(cls):
        return
    for base in cls.__mro__[1:]:
        if "_wrapped_call" in vars(base):
            cls._wrapped_call = base._wrapped_call
            return


def _set_node(node: fx.Node, mark: ModeArg, mode: bool) -> bool:
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


def _read_mode(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook of a compiled converted module: its mode, read where the compiler traces."""
    if module.training:
        pass


def _run_as(module: nn.Module, other: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module``'s call (its hooks, its compiled call) running ``other``'s forward: the conversion for a call of
    another structure, whose tensors are ``module``'s own."""
    saved = module.__dict__.get("forward", _NONE)
    module.__dict__["forward"] = other.forward
    hooks = module._forward_pre_hooks
    kept = list(hooks.items())
    for k, h in kept:  # torch.export's check of the inputs against the captured call's: not this call's
        if getattr(getattr(h, "func", h), "__module__", "").startswith("torch.export"):
            del hooks[k]
    try:
        return nn.Module.__call__(module, *args, **kwargs)
    finally:
        hooks.clear()
        hooks.update(kept)
        if saved is _NONE:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = saved


_NONE = object()
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _without_autocast():
    """An ``autocast(enabled=False)`` region for each device type whose autocast the caller left on, else a null
    context: the converted module already says the dtype of every op, and an ambient autocast would cast its
    plan over again (a module converted to bfloat16 run in float16). The caller's own code around the module,
    the loss among it, still autocasts."""
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for d in on:
        stack.enter_context(torch.autocast(d, enabled=False))
    return stack


class _Switchable:
    """Mixed into the converted module's class, so that copies keep working modes: ``copy.deepcopy`` of a
    GraphModule builds a fresh class over the first base whose qualified name does not end in
    ``GraphModuleImpl``, which is the one made here."""

    def train(self, mode: bool = True):
        return set_mode(self, mode)

    def compile(self, *args, **kwargs):
        """``nn.Module.compile``, with a forward pre-hook that reads the mode first: torch.compile traces hooks
        with the call it compiles, so it guards on the mode and runs each mode's program (see ``__call__``)."""
        if not getattr(self, "_autocastfx_mode_hook", False):
            self.register_forward_pre_hook(_read_mode)
            self._autocastfx_mode_hook = True
        return super().compile(*args, **kwargs)

    def recompile(self):
        programs = self.__dict__.get("meta", {}).get(K.PROGRAMS)
        if programs is not None and not programs.switching:  # the graph was edited: the kept code is stale
            programs.code.clear()
        return super().recompile()

    def eval(self):
        return set_mode(self, False)

    def __call__(self, *args, **kwargs):
        if "_autocastfx_fsdp_checked" not in self.__dict__ and hasattr(self, "_get_fsdp_state"):
            _check_fsdp_param_dtype(self)  # once, at the first call after fully_shard
        # the mode, read where torch.compile traces: it guards on it, so that a compiled module runs the program
        # of the mode it is in (the programs' code holds the mode as constants, which nothing else guards on)
        if self.training:
            pass
        info = self.__dict__.get("meta", {}).get("autocastfx")
        if info is not None and info.call_signature and \
                _calls.raw_key(args, kwargs) != _calls.captured_key(info.call_signature):
            other = _calls.other_call(self, info, args, kwargs)  # a call of another structure: its own conversion
            if isinstance(other, tuple):  # the captured call, spelled another way
                args, kwargs = other
            elif other is not None:
                try:
                    return _run_as(self, other, args, kwargs)
                except Exception as e:  # noqa: BLE001 - the model's own checks on this call, else as it came
                    _calls.model_check(info.checks, args, kwargs, e, self.training)
                    raise
        if info is not None and self.__dict__.get("_compiled_call_impl") is not None:
            _calls.mark_free_dims(info.free_dims, args, kwargs)  # gm.compile(): sizes free to vary left free
        try:
            with _without_autocast():  # the program gm.code shows, whatever autocast the caller has on
                return super().__call__(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised below unless a clearer error says what went wrong
            if info is not None and isinstance(e, (TypeError, RuntimeError, ValueError)):
                _calls.check(info.call_signature, args, kwargs, e)  # a call of another shape: said so
            if info is not None:
                _calls.model_check(info.checks, args, kwargs, e, self.training)  # the model's own checks
            raise

    # the model's own names for its tied weights in the state dict (see weights.py)
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        _weights.model_names_into_state_dict(self, out, prefix)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _weights.model_names_from_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __deepcopy__(self, memo):
        """GraphModule's copy registers every buffer persistent: the copy keeps which ones are not (a rotary
        table stays out of the state dict, as in the model)."""
        out = super().__deepcopy__(memo)
        add_model_surface(out)  # the copy's class is made anew
        copies = dict(out.named_modules(remove_duplicate=False))
        for name, m in self.named_modules(remove_duplicate=False):
            c = copies.get(name)
            if c is not None and m._non_persistent_buffers_set:
                c._non_persistent_buffers_set = {b for b in m._non_persistent_buffers_set if b in c._buffers}
        return out

    def _apply(self, fn, recurse=True):
        tied = [names for names in _weights.aliases(self)[1].values() if len(names) > 1]
        out = super()._apply(fn, recurse)
        _weights.retie(self, tied)  # to_empty from meta makes a new Parameter per module: tied weights stay tied
        return out


def _check_fsdp_param_dtype(unit: nn.Module) -> None:
    """ValueError where FSDP2 would hand this unit's graph a low-precision copy of a parameter the plan reads in
    float32 (``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))`` over a group that holds a norm's
    weight): the graph casts the weights it reads low itself, and a float32 reader would get rounded values."""
    low_read = set(_weights.low_read_names(unit))
    nested = [m for name, m in unit.named_modules() if name and is_converted(m)]
    inner = {id(p) for m in nested for p in m.parameters()}
    names = {id(p): n for n, p in unit.named_parameters(remove_duplicate=False)}
    for m in unit.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None or any(m is x for x in nested):
            continue
        policy = getattr(get(), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        if dtype is None or dtype == torch.float32:
            continue
        fsdp_children = [c for c in m.modules() if c is not m and hasattr(c, "_get_fsdp_state")]
        theirs = {id(p) for c in fsdp_children for p in c.parameters()}
        for p in m.parameters():
            name = names.get(id(p))
            if id(p) in inner or id(p) in theirs or name is None or name in low_read:
                continue
            raise ValueError(
                f"fully_shard gathers {name!r} as {str(dtype).removeprefix('torch.')} (its MixedPrecisionPolicy's "
                "param_dtype), but the converted graph reads it in float32: it would compute with a rounded copy. "
                "The graph already casts each weight it reads low, so shard with "
                "MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32) (or no policy), or use "
                "autocastfx.shard(gm), which gathers only the weights the graph reads low in the low dtype")
    unit.__dict__["_autocastfx_fsdp_checked"] = True


_BASES: dict[type, type] = {}


def add_model_surface(gm: nn.Module) -> None:
    """Put on the converted module's own class (one per module) what the model answered and the converted module
    does not: the model's methods, properties and class attributes (``gm.generate()``, also for code that reads
    them from ``type(self)``, as Hugging Face's ``generate`` finds its decoding loop), its plain attributes
    (``gm.config``), and ``dtype``, which is the float32 model's (its state dict's). On the class, not through a
    ``__getattr__``: the generated forward's attribute reads stay as fast as a GraphModule's."""
    info = gm.meta.get("autocastfx")
    cls = getattr(info, "model_class", None)
    if cls is None:
        return
    own = type(gm)
    base = own.__mro__[1]
    for klass in reversed(cls.__mro__):
        if klass in (nn.Module, object) or klass in base.__mro__:
            continue
        for name, value in vars(klass).items():
            if not (name.startswith("__") or name == "dtype" or hasattr(base, name)):
                setattr(own, name, value)
    for name, value in info.model_attrs.items():
        if not hasattr(base, name) and name not in gm.__dict__:
            setattr(own, name, staticmethod(value) if inspect.isfunction(value) else value)
    if hasattr(cls, "dtype") and not hasattr(base, "dtype"):
        own.dtype = property(lambda self: torch.float32)


def install(gm: fx.GraphModule) -> None:
    """Give ``gm`` working ``train()``/``eval()``, replacing torch.export's methods that raise."""
    base = next(c for c in type(gm).__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    if not issubclass(base, _Switchable):
        if base not in _BASES:
            _BASES[base] = type(f"Converted{base.__name__.lstrip('_')}", (_Switchable, base), {})
        base = _BASES[base]
    gm.__dict__.pop("train", None)  # ep.module() sets instance attributes that raise NotImplementedError
    gm.__dict__.pop("eval", None)
    gm.__class__ = type("GraphModuleImpl", (base,), {})  # GraphModule keeps forward on a class of its own
    add_model_surface(gm)
    keys = gm.meta.get(K.PROGRAM_KEYS)
    current = gm.meta.pop(K.CURRENT_PROGRAM, None)
    if keys and _programs_differ(gm.graph, keys):  # one graph per mode; run the one of the model's mode
        union = gm.graph
        graphs = {k: split(union, k) for k in keys}
        gm.meta[K.PROGRAMS] = Programs(union, graphs, current)
        gm.graph = graphs[current]
    gm.recompile()


def _programs_differ(graph: fx.Graph, keys) -> bool:
    """Whether any node belongs to some programs only or has arguments of its own per program: where none does
    (every mode-dependent op is a leaf module that switches by itself), the union is the one graph to run."""
    every = frozenset(keys)
    return any(n.meta.get(MEMBERS, every) != every or MODE_ARGS in n.meta for n in graph.nodes)


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
# buffers. :func:`install` then cuts the union into one graph per mode, and
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
    from .plan import module_path

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
    if keys:
        return {"how": f"one program per mode ({', '.join(keys)}), captured and planned together",
                "differences": differences(gm.graph, tuple(keys))}
    return {"how": "one program; these flags follow gm.train()/gm.eval()",
            "differences": [f"{n.name} ({getattr(n.target, '__name__', n.target)}): {n.meta['autocastfx_mode'].kind}"
                            for n in mode_nodes(gm)]}
