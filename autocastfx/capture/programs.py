"""The model captured in both modes: its training and its eval program, merged into one graph where they differ
(``merge``), which every pass sees once; ``capture`` is the entry, the rest the merge's node matching."""
from __future__ import annotations


from . import inline as _inline
from .context import CaptureContext
from .watch import own_classes, watch_reads, watchable
from ..base.meta import fetch, is_converted, original_class
import collections
import contextlib
import torch
import torch.fx as fx
import torch.nn as nn
from ..base.errors import one_line, CaptureError
from ..core.modes import SWAPS, BY_MODE, by_mode, EVAL, GIVEN, MEMBERS, MODE_ARGS, TRAIN, flags_as_programs
from ..base import keys as K
from .trace import capture_graph, copy_model
from ..core.propagate import propagate
from ..base.quiet import warn_user


class ProgramMismatch(Exception):
    """Two captures cannot be laid over one another (other inputs, another output structure)."""


_SWAP_CLASS = {t: "batch_norm_update" for t in SWAPS}


def _canon(a, env: dict | None = None):
    """A hashable form of an argument; nodes by identity (after ``env``, which maps the other program's nodes
    to the union's)."""
    if isinstance(a, fx.Node):
        return ("N", id(env[a] if env is not None else a))
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_canon(x, env) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _canon(v, env)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _canon(a.start, env), _canon(a.stop, env), _canon(a.step, env))
    if isinstance(a, torch.Tensor):
        return ("T", id(a))
    return ("L", type(a).__name__, repr(a))


def _flag_like(a) -> bool:
    """An argument that can differ between modes without changing any shape: a flag or a probability."""
    return isinstance(a, (bool, float)) and not isinstance(a, fx.Node)


def _normalized(target, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An aten op's arguments with the defaults written out: one capture writes ``sdpa(q, k, v, mask, 0.1)``
    where the other leaves ``dropout_p`` to its default."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return tuple(args), dict(kwargs)
    full, named = [], {}
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only:
            if a.name in kwargs or a.has_default_value():
                named[a.name] = kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        elif i < len(args):
            full.append(args[i])
        elif a.name in kwargs:
            full.append(kwargs[a.name])
        elif a.has_default_value():
            full.append(a.default_value)
        else:
            return tuple(args), dict(kwargs)  # not a call of this schema: leave it as written
    return tuple(full), named


def _exact_key(op, target, args, kwargs, env=None):
    args, kwargs = _normalized(target, args, kwargs)
    return (op, target, _canon(args, env), _canon(kwargs, env))


def _loose_key(op, target, args, kwargs, env=None):
    args, kwargs = _normalized(target, args, kwargs)
    top = lambda a: ("flag",) if _flag_like(a) else _canon(a, env)  # noqa: E731
    return (op, _SWAP_CLASS.get(target, target), tuple(top(a) for a in args),
            tuple((k, top(v)) for k, v in kwargs.items()))


def merge(programs: dict[str, fx.GraphModule]) -> fx.GraphModule:
    """Lay the programs over the first one, in its graph module; returns it (see the comment above). Raises
    :class:`ProgramMismatch` where the programs cannot be laid over one another."""
    keys = list(programs)
    gm = programs[keys[0]]
    for n in gm.graph.nodes:
        n.meta[MEMBERS] = {keys[0]}
    for key in keys[1:]:
        _merge_into(gm, programs[key], key)
    for n in gm.graph.nodes:
        if MEMBERS in n.meta:
            n.meta[MEMBERS] = frozenset(n.meta[MEMBERS])
    gm.meta[K.PROGRAM_KEYS] = tuple(keys)
    gm.graph.lint()
    return gm


def _merge_into(gm: fx.GraphModule, other: fx.GraphModule, key: str) -> None:
    """Lay the program ``other`` (captured as ``key``) over ``gm``'s graph: each of its nodes is the union's node
    it matches (the same call on the same inputs, else one that differs only by flags, see :func:`_loose_key`),
    or a node of its own added after its inputs; the outputs are joined last (:func:`_merge_output`)."""
    union = _Union(gm.graph, key)
    env: dict[fx.Node, fx.Node] = {}  # the other program's nodes -> the union's
    out_other = None
    for m in other.graph.nodes:
        if m.op == "placeholder":
            env[m] = union.placeholder(m)
            continue
        if m.op == "output":
            out_other = m
            continue
        args = fx.node.map_arg(m.args, lambda a: env[a])
        kwargs = fx.node.map_arg(m.kwargs, lambda a: env[a])
        if m.op == "get_attr":
            env[m] = _merge_attr(gm, other, m, key, union.attrs, union.add)
            union.place(env[m])
            continue
        env[m] = union.call(m.op, _call_target(gm, other, m), args, kwargs, m)
    _merge_output(gm.graph, out_other, env, key)


class _Union:
    """The graph the programs are laid over, while one more program is laid over it: its inputs, constants and
    calls indexed by what they match by, and a cursor after which the next node of the other program goes (it
    only moves forward, so every added node comes after its inputs)."""

    def __init__(self, graph: fx.Graph, key: str):
        self.graph, self.key = graph, key
        self.order = {n: (i, 0) for i, n in enumerate(graph.nodes)}
        self.exact: dict = collections.defaultdict(collections.deque)
        self.loose: dict = collections.defaultdict(collections.deque)
        self.placeholders: dict = {}
        self.attrs: dict = {}
        self.cursor: fx.Node | None = None
        for n in graph.nodes:
            if n.op == "placeholder":
                self.placeholders[n.target] = n
                self.cursor = n
            elif n.op == "get_attr":
                self.attrs.setdefault(n.target, n)
            elif n.op in ("call_function", "call_method", "call_module"):
                self.exact[_exact_key(n.op, n.target, n.args, n.kwargs)].append(n)
                self.loose[_loose_key(n.op, n.target, n.args, n.kwargs)].append(n)
        self.matched: set = set()

    def placeholder(self, m: fx.Node) -> fx.Node:
        """The union's input of the other program's input ``m``; there is one for every input of every program."""
        u = self.placeholders.get(m.target)
        if u is None:
            raise ProgramMismatch(f"input {m.target} appears in the {self.key} capture only")
        u.meta[MEMBERS].add(self.key)
        self.place(u)
        return u

    def call(self, op: str, target, args, kwargs, like: fx.Node) -> fx.Node:
        """The union's node for the other program's call ``like`` (its arguments already the union's nodes): one
        not matched yet that makes the same call, else one whose flags differ (noted per program), else a new
        one."""
        u = self.take(self.exact.get(_exact_key(op, target, args, kwargs), ()))
        if u is None:
            u = self.take(self.loose.get(_loose_key(op, target, args, kwargs), ()))
            if u is not None:
                _note_mode_args(u, self.key, target, args, kwargs)
        if u is None:
            return self.add(op, target, args, kwargs, like)
        self.matched.add(u)
        u.meta[MEMBERS].add(self.key)
        self.place(u)
        return u

    def take(self, queue) -> fx.Node | None:
        while queue:
            u = queue.popleft()
            if u not in self.matched:
                return u
        return None

    def place(self, u: fx.Node) -> None:
        if self.cursor is None or self.order[u] > self.order[self.cursor]:
            self.cursor = u

    def add(self, op, target, args, kwargs, like: fx.Node) -> fx.Node:
        graph = self.graph
        fx.node.map_arg((args, kwargs), self.place)  # after every input (the cursor only moves forward)
        ctx = graph.inserting_after(self.cursor) if self.cursor is not None else \
            graph.inserting_before(next(iter(graph.nodes)))
        with ctx:
            u = graph.create_node(op, target, args, kwargs, name=like.name)
        u.meta = {k: v for k, v in like.meta.items() if k not in (MEMBERS, MODE_ARGS)}
        u.meta[MEMBERS] = {self.key}
        base = self.order[self.cursor] if self.cursor is not None else (-1, 0)
        self.order[u] = (base[0], base[1] + 1)
        self.cursor = u
        return u


def _call_target(gm: fx.GraphModule, other: fx.GraphModule, m: fx.Node):
    """The target of the other program's call ``m`` in the union: a submodule of the other capture's own that
    differs from the one ``gm`` holds under that name is added to ``gm`` under a name of its own."""
    target = m.target
    if m.op == "call_module":
        theirs, mine = fetch(other, target, None), fetch(gm, target, None)
        if mine is not theirs and not _same_program(mine, theirs):
            target = _unique_attr(gm, str(target))
            gm.add_submodule(target, theirs)
    return target


def _merge_attr(gm, other, m, key, attrs, add):
    theirs, mine = fetch(other, m.target, None), fetch(gm, m.target, None)
    same = mine is theirs or (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                              and mine.shape == theirs.shape and mine.dtype == theirs.dtype
                              and mine.device == theirs.device
                              # on the meta device there are no values: the same name in both captures of
                              # one model is the same tensor
                              and (mine.is_meta or torch.equal(mine, theirs)))
    if same and m.target in attrs:
        u = attrs[m.target]
        u.meta[MEMBERS].add(key)
        return u
    target = m.target
    if not same:  # a constant of the other capture's own under a name the first one uses for something else
        target = _unique_attr(gm, str(m.target))
        if isinstance(theirs, nn.Parameter):
            gm.register_parameter(target, theirs)
        elif isinstance(theirs, torch.Tensor):
            gm.register_buffer(target, theirs, persistent=False)
        elif isinstance(theirs, nn.Module):
            gm.add_submodule(target, theirs)
        else:
            setattr(gm, target, theirs)
    u = add("get_attr", target, (), {}, m)
    attrs[target] = u
    return u


def _same_program(a, b) -> bool:
    """Two graph modules that run the same code on no state of their own (torch.export's ``_guards_fn``)."""
    return (isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule) and a.code == b.code
            and not list(a.parameters()) and not list(a.buffers()) and not list(b.parameters())
            and not list(b.buffers()))


def _unique_attr(gm: nn.Module, name: str) -> str:
    base = name.replace(".", "_") + "_eval"
    name, i = base, 0
    while fetch(gm, name, None) is not None:
        i += 1
        name = f"{base}{i}"
    return name


def _note_mode_args(u: fx.Node, key: str, target, args, kwargs) -> None:
    diff = {}
    if target is not u.target:
        diff["target"] = target
    mine, mine_kw = _normalized(u.target, u.args, u.kwargs)
    theirs, theirs_kw = _normalized(target, args, kwargs)
    schema = getattr(u.target, "_schema", None)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if _flag_like(b) and (a != b or type(a) is not type(b)):
            # where the union's node writes it: by position, or by name where it left it to its default
            diff[i if i < len(u.args) or schema is None else schema.arguments[i].name] = b
    for k, b in theirs_kw.items():
        a = mine_kw.get(k)
        if _flag_like(b) and (a != b or type(a) is not type(b)):
            diff[k] = b
    if diff:
        u.meta.setdefault(MODE_ARGS, {})[key] = diff


def _merge_output(graph: fx.Graph, out_other: fx.Node, env: dict, key: str) -> None:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    out.meta[MEMBERS].add(key)
    theirs = fx.node.map_arg(out_other.args, lambda a: env[a])

    def join(mine, their):
        if isinstance(mine, fx.Node) or isinstance(their, fx.Node):
            if mine is their:
                return mine
            if not (isinstance(mine, fx.Node) and isinstance(their, fx.Node)):
                raise ProgramMismatch("an output is a tensor in one capture and a constant in the other")
            if mine.target is by_mode and BY_MODE in mine.meta:
                mine.args = mine.args + (their,)
                mine.meta[BY_MODE][key] = len(mine.args) - 1
                mine.meta[MEMBERS].add(key)
                return mine
            with graph.inserting_before(out):
                sel = graph.call_function(by_mode, (mine, their))
            sel.meta[BY_MODE] = {key: 1}  # every other program: index 0
            sel.meta[MEMBERS] = set(out.meta[MEMBERS])
            return sel
        if isinstance(mine, (tuple, list)) and type(mine) is type(their) and len(mine) == len(their):
            return type(mine)(join(a, b) for a, b in zip(mine, their))
        if isinstance(mine, dict) and isinstance(their, dict) and list(mine) == list(their):
            return {k: join(mine[k], their[k]) for k in mine}
        if type(mine) is type(their) and mine == their:
            return mine
        raise ProgramMismatch(f"the outputs differ in structure between captures ({type(mine).__name__} and "
                              f"{type(their).__name__})")

    out.args = join(out.args, theirs)


def capture(model: nn.Module, args: tuple, kwargs: dict, policy, ctx: CaptureContext, *,
            share_tensors: bool = False) -> tuple[fx.GraphModule, str, list]:
    """Capture ``model`` in training mode and in eval mode (and as it is, when its modules are in mixed modes),
    open up each program's opaque calls, and merge the programs; returns (union, how, inline decisions).

    One deep copy serves every capture, its modes switched between them: the programs share the leaf modules
    and the model's tensors. A model that cannot be captured in training mode (batch norm on a batch of one)
    or in eval mode is captured in the mode it can be, as one program whose known flags follow the mode
    (:func:`record`), and a warning says so."""
    work = copy_model(model, share_tensors)
    with watch_reads(watchable(work), ctx.watch) if ctx.watch is not None else contextlib.nullcontext():
        out = _capture(model, work, args, kwargs, policy, ctx)
    own_classes(out[0])  # the watched copy's classes, where the capture's node metadata noted its subclasses
    return out


def _capture(model: nn.Module, work: nn.Module, args: tuple, kwargs: dict, policy,
             ctx: CaptureContext) -> tuple[fx.GraphModule, str, list]:
    given = {name: m.training for name, m in work.named_modules()}
    mixed = len(set(given.values())) > 1
    current = GIVEN if mixed else (TRAIN if model.training else EVAL)
    # a program per mode (or the one that captures, and why the others do not); where the code read no mode, one
    # graph for both, finished there
    programs, how, why, done = _capture_programs(model, work, given, mixed, current, args, kwargs, policy, ctx)
    if done is not None:
        return done
    # each program's opaque calls opened up, then the programs laid over one another
    decisions = _inline_programs(programs, args, kwargs, ctx)
    return _merged(programs, why, current, model, args, kwargs, decisions, how, ctx)


def _restore(work: nn.Module, given: dict[str, bool]) -> None:
    """The copy's modules back in the modes the model's modules have."""
    for name, m in work.named_modules():
        m.training = given[name]


def _capture_programs(model: nn.Module, work: nn.Module, given: dict[str, bool], mixed: bool, current: str,
                      args: tuple, kwargs: dict, policy,
                      ctx: CaptureContext) -> tuple[dict, str, str | None, tuple | None]:
    """The captures of ``work`` (the model's copy) in training mode, in eval mode and, with ``mixed`` modes, as
    given: (programs by mode, how, why there is only one, None). Where the code read no mode, the one graph for
    both, finished, comes last: (programs, how, None, (graph, how, inline decisions)). A model in eval mode that
    does not capture in training mode: its capture as it is, and why."""
    programs: dict[str, fx.GraphModule] = {}
    why = None
    reads: list = []
    try:
        gm, how = capture_graph(work.train(), args, kwargs, policy, ctx, compile_code=False, reads=reads)
        programs[TRAIN] = gm
        if not _switches_itself(work) and all(flag_only(m, code) for m, code in reads):
            # nothing read the mode, or only the forwards of torch's dropout and batch norms, which write it as one
            # op's flag: one capture, whose flags (if any) follow the mode
            keys = ((TRAIN, EVAL, GIVEN) if mixed else (TRAIN, EVAL)) if reads else None
            owners = {name for name, m in work.named_modules() if any(m is r for r, _ in reads)}
            done = _one_for_both(gm, how, work, given, args, kwargs, ctx, keys, current, owners)
            if done is not None:
                return programs, how, why, done
        for key in (EVAL, GIVEN) if mixed else (EVAL,):
            work.eval() if key == EVAL else _restore(work, given)
            try:
                programs[key] = capture_graph(work, args, kwargs, policy, ctx, compile_code=False, method=how,
                                         check=False)[0]  # the union is propagated (_merged)
            except Exception as e:  # noqa: BLE001 - told below, and the one program still works
                why = f"it cannot be captured in {key} mode ({one_line(e)})"
                break
    except CaptureError as e:
        if model.training:
            raise
        why = f"it cannot be captured in training mode ({one_line(e)})"
        _restore(work, given)
        gm, how = capture_graph(work, args, kwargs, policy, ctx, compile_code=False)
        programs = {current: gm}
    finally:
        _restore(work, given)
    return programs, how, why, None


def _one_for_both(gm: fx.GraphModule, how: str, work: nn.Module, given: dict[str, bool], args: tuple,
                  kwargs: dict, ctx: CaptureContext, flag_keys: tuple | None = None, current: str = TRAIN,
                  owners: set | None = None) -> tuple[fx.GraphModule, str, list] | None:
    """The training capture of a model whose code read no mode, as the program of both modes, its opaque calls
    opened up. With ``flag_keys``, the code read it only as the flags of :func:`flag_only` modules (``owners``,
    by name): the capture is made the union of those programs (``core.modes.flags_as_programs``), one graph per
    mode as from a capture per mode; None, the capture left as it was, where a module that read it issued no
    flag that could be found (the eval capture then tells what differs)."""
    _restore(work, given)
    if flag_keys and not flags_as_programs(gm, work, flag_keys, owners, check=True):
        return None
    decisions = _inline.inline_opaque_calls(gm)
    if any(d.inlined for d in decisions):
        propagate(gm, args, kwargs, meta_device=ctx.meta_device)
    if flag_keys:
        flags_as_programs(gm, work, flag_keys, owners)
        gm.meta[K.MODES_READ] = "flags"
    else:
        for n in gm.graph.nodes:
            n.meta[MEMBERS] = frozenset((TRAIN, EVAL))
        gm.meta[K.PROGRAM_KEYS] = (TRAIN, EVAL)
        gm.meta[K.MODES_READ] = False
    gm.meta[K.CURRENT_PROGRAM] = current if flag_keys else TRAIN
    return gm, how, decisions


def _inline_programs(programs: dict[str, fx.GraphModule], args: tuple, kwargs: dict, ctx: CaptureContext) -> list:
    """Open up the opaque calls of each program (sharing the traces of the calls they share); returns the
    decisions of all of them."""
    decisions, traces = [], {}
    for key, p in programs.items():
        if key != TRAIN and any(_inline.is_opaque(n) for n in p.graph.nodes):
            propagate(p, args, kwargs, meta_device=ctx.meta_device)  # inlining reads the shapes of the calls' arguments
        found = _inline.inline_opaque_calls(p, traces)
        decisions += found
        if any(d.inlined for d in found):
            propagate(p, args, kwargs, meta_device=ctx.meta_device)
    return decisions


def _merged(programs: dict[str, fx.GraphModule], why: str | None, current: str, model: nn.Module, args: tuple,
            kwargs: dict, decisions: list, how: str, ctx: CaptureContext) -> tuple[fx.GraphModule, str, list]:
    """The programs laid over one another and propagated as the union; the first program alone (see
    :func:`_single`) where there is only one (``why``), where they cannot be laid over one another, or where
    the union does not run on the example inputs."""
    if why is None:
        before = list(programs[TRAIN].graph.nodes)
        outputs = before[-1].args  # the merge joins outputs that differ by a by_mode node: put back on a fallback
        try:
            gm = merge(programs)
        except ProgramMismatch as e:
            why = f"its {TRAIN} and {EVAL} captures cannot be laid over one another ({e})"
            _erase_added(programs[TRAIN].graph, before, outputs)
    if why is not None:
        gm = programs[TRAIN] if TRAIN in programs else next(iter(programs.values()))
        return _single(gm, why, model, args, kwargs, decisions, how, ctx)
    gm.meta[K.CURRENT_PROGRAM] = current
    try:
        propagate(gm, args, kwargs, meta_device=ctx.meta_device)
    except Exception as e:  # noqa: BLE001 - the other capture does not run on the inputs: the first alone
        why = f"its {EVAL} capture does not run on the example inputs ({one_line(e)})"
        _erase_added(gm.graph, before, outputs)
        return _single(gm, why, model, args, kwargs, decisions, how, ctx)
    return gm, how, list({str(d): d for d in decisions}.values())  # the programs share most calls


def _erase_added(graph: fx.Graph, before: list[fx.Node], outputs: tuple) -> None:
    """Erase the nodes a merge added to ``graph`` (its nodes then were ``before``, its output's arguments
    ``outputs``), last first, after giving the output back the first program's values."""
    before[-1].args = outputs
    kept = set(before)
    for n in reversed(list(graph.nodes)):
        if n not in kept:
            graph.erase_node(n)


_FLAG_ONLY = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
              nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def flag_only(module: nn.Module, code) -> bool:
    """Whether a read of ``module``'s mode by ``code`` is one whose only use is the training flag of the one op
    the module's forward calls: ``code`` is the forward of one of torch's dropout modules, or of its batch norms
    where they keep running statistics with a momentum (a hook or another module reading the flag is not). Its
    eval capture would be the training capture with that flag off. Exact classes only: a subclass may read the
    mode in code of its own."""
    cls = original_class(module)
    if cls not in _FLAG_ONLY or code is not cls.forward.__code__:
        return False
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return bool(module.track_running_stats) and module.running_mean is not None and \
            isinstance(module.momentum, float)
    return True


def _switches_itself(model: nn.Module) -> bool:
    """Whether a module of the model has its own ``train()``/``eval()``, which may set state other than the
    ``training`` flags (then only a capture in each mode tells what differs)."""
    units = [m for name, m in model.named_modules() if name and is_converted(m)]  # converted blocks switch as leaves do
    inside = {id(s) for u in units for s in u.modules()}
    return any((type(m).train is not nn.Module.train or type(m).eval is not nn.Module.eval) and id(m) not in inside
               for m in model.modules())


def _single(gm: fx.GraphModule, why: str, model: nn.Module, args, kwargs, decisions, how: str, ctx: CaptureContext):
    """The one program there is, its known flags marked by :func:`record`, and a warning that says why."""
    gm.meta.pop(K.PROGRAM_KEYS, None)
    gm.meta.pop(K.CURRENT_PROGRAM, None)
    for n in gm.graph.nodes:
        n.meta.pop(MEMBERS, None)
        n.meta.pop(MODE_ARGS, None)
    if why.startswith("it cannot be captured in training mode"):
        gm.meta.pop(K.CAPTURED_TRAINING, None)
    else:
        gm.meta[K.CAPTURED_TRAINING] = True
        propagate(gm, args, kwargs, meta_device=ctx.meta_device)
    warn_user(f"autocastfx: {type(model).__name__} is converted from one capture because {why}: "
                  "gm.train()/gm.eval() switch the dropout and batch-norm flags they recognise, and other "
                  "mode-dependent code keeps the form it was captured in")
    return gm, how, decisions
