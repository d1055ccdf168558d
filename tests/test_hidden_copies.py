"""After ``gm = convert(model, ...)`` and ``del model``, the converted module holds no tensor but its own: its
parameters and buffers (the model's own float32 tensors, shared, not copied: its own and each converted block's)
and the constants its graphs read; nothing else in the process keeps a tensor alive, and no copy of the model's
tensors was made. Every way of capturing: symbolic tracing,
torch.export (a Hugging Face Llama, as one graph and with its decoder layers as blocks), blocks, piecewise."""
import collections
import gc
import sys
import time
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from small_models import TinyGPT, TinyResNet, TinyViT

ALLOWANCE = 0.01  # of the model's bytes: any other tensor storage together stays below this


# ------------------------------------------------------------------------------------------------ tensors

def _storage(t) -> tuple[int, int] | None:
    """(address, bytes) of a real tensor's storage; None for meta and fake tensors and empty storages."""
    if t.device.type == "meta" or isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        return None
    try:
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return None
    return (ptr, n) if ptr else None


def _is_tensor(o) -> bool:
    return issubclass(type(o), torch.Tensor)  # not isinstance: no attribute read on arbitrary objects


def _live(collect: bool = True) -> dict[int, int]:
    """Every real tensor storage the process holds through Python objects: address -> bytes (after a collection
    of what only cycles keep, with ``collect``)."""
    if collect:
        gc.collect()
    out = {}
    for o in gc.get_objects():
        if _is_tensor(o):
            s = _storage(o)
            if s is not None:
                out[s[0]] = s[1]
    return out


def _converted(gm: nn.Module):
    """gm and every converted block inside it (a module with ``meta["autocastfx"]``)."""
    return [m for m in gm.modules() if isinstance(getattr(m, "meta", None), dict) and m.meta.get("autocastfx")]


def _own(gm: nn.Module) -> dict[int, str]:
    """What gm holds by design, storage address -> a name: parameters, buffers (the model's), tensor attributes
    the graphs of every converted module read (constants)."""
    out: dict[int, str] = {}

    def add(t, name):
        s = _storage(t) if _is_tensor(t) else None
        if s is not None:
            out.setdefault(s[0], name)

    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        add(t, name)
    for unit in _converted(gm):
        programs = unit.meta.get("autocastfx_programs")
        graphs = [unit.graph] if isinstance(unit, torch.fx.GraphModule) else []  # a piecewise root: none
        graphs += [*programs.graphs.values(), programs.union] if programs else []
        for graph in graphs:
            for n in graph.nodes:
                if n.op == "get_attr":
                    obj = unit
                    for atom in str(n.target).split("."):
                        obj = getattr(obj, atom, None)
                    add(obj, f"constant {n.target}")
    return out


def _reachable(root) -> tuple[list, dict, dict]:
    """The tensors reachable from ``root`` by references (``gc.get_referents``, breadth first), with the parent
    of each object met for the path to it. Python modules, their globals and classes are not entered: they are
    the process's, not ``root``'s (what they keep alive is counted by the live check)."""
    shared = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    parent, objects = {id(root): None}, {id(root): root}
    queue, tensors = collections.deque([root]), []
    while queue:
        o = queue.popleft()
        if _is_tensor(o):
            tensors.append(o)
        if isinstance(o, (types.ModuleType, type)) or id(o) in shared:
            continue
        for r in gc.get_referents(o):
            if id(r) not in parent:
                parent[id(r)] = id(o)
                objects[id(r)] = r
                queue.append(r)
    return tensors, parent, objects


def _holders(storages: set[int], limit: int = 3) -> list[str]:
    """For a failure message: how the process reaches tensors on ``storages``, from the modules' globals."""
    roots = [(vars(m), name) for name, m in list(sys.modules.items()) if isinstance(m, types.ModuleType)]
    parent, objects, names = {}, {}, {}
    queue = collections.deque()
    for d, name in roots:
        if id(d) not in parent:
            parent[id(d)], objects[id(d)], names[id(d)] = None, d, f"module {name}"
            queue.append(d)
    found = []
    while queue and len(found) < limit:
        o = queue.popleft()
        if _is_tensor(o) and (_storage(o) or (None,))[0] in storages:
            found.append(_path(id(o), parent, objects, names))
            storages = storages - {_storage(o)[0]}
        for r in gc.get_referents(o):
            if id(r) not in parent:
                parent[id(r)], objects[id(r)] = id(o), r
                queue.append(r)
    return found


def _not_own(gm: nn.Module, own: dict[int, str]) -> dict[int, tuple[int, str]]:
    """The storages reachable from gm that are not its own: address -> (bytes, what and where)."""
    tensors, parent, objects = _reachable(gm)
    other: dict[int, tuple[int, str]] = {}
    for t in tensors:
        s = _storage(t)
        if s is not None and s[0] not in own and s[0] not in other:
            other[s[0]] = (s[1], f"{tuple(t.shape)} {t.dtype}: {_path(id(t), parent, objects)}")
    return other


def _path(i: int, parent: dict, objects: dict, names: dict | None = None) -> str:
    steps = []
    while i is not None and len(steps) < 30:
        o = objects[i]
        if names and i in names:
            steps.append(names[i])
        elif isinstance(o, dict):
            steps.append("dict{" + ", ".join(str(k)[:24] for k in list(o)[:4]) + "}")
        else:
            steps.append(type(o).__name__)
        i = parent[i]
    return " <- ".join(steps)


def _model_bytes(model: nn.Module) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = _storage(t)
        if s is not None:
            seen[s[0]] = s[1]
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------- models

class Layer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    """Identical blocks in a ModuleList: converted as blocks, the model around them traced."""

    def __init__(self, layers=3, d=32, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ValueBranch(Stack):
    """A forward that branches on a tensor's values: no capture takes it whole, so it is converted piecewise."""

    def forward(self, ids, labels=None):
        logits = super().forward(ids)
        if labels is not None and bool((labels >= 0).all()):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return logits


def _ids(shape=(2, 8), vocab=64, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _llama():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg).eval()


# name -> () -> (model, args, kwargs, convert options, the capture gm reports)
CASES = {
    "convnet": lambda: (TinyResNet(), (torch.randn(2, 3, 16, 16),), {}, {}, "symbolic_trace"),
    "vit": lambda: (TinyViT(), (torch.randn(2, 3, 16, 16),), {}, {}, "symbolic_trace"),
    "gpt": lambda: (TinyGPT(), (_ids((2, 16), 101),), {}, {}, "torch.export"),
    "blocks": lambda: (Stack(), (_ids(),), {}, {}, "symbolic_trace"),
    "piecewise": lambda: (ValueBranch(), (_ids(),), {"labels": _ids(seed=1)}, {}, "piecewise"),
    "llama": lambda: (_llama(), (), {"input_ids": _ids((2, 8), 128), "use_cache": False}, {"blocks": None},
                      "torch.export"),
    "llama-blocks": lambda: (_llama(), (), {"input_ids": _ids((2, 8), 128), "use_cache": False}, {},
                             "torch.export"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_converted_module_holds_no_tensor_but_its_own(case):
    start = time.perf_counter()
    before = _live(collect=False)  # what was there: none of it is gm's doing
    torch.manual_seed(0)
    model, args, kwargs, options, capture = CASES[case]()
    model_bytes = _model_bytes(model)
    theirs = {s[0] for t in [*model.parameters(), *model.buffers()] for s in [_storage(t)] if s is not None}
    inputs = {s[0] for t in torch.utils._pytree.tree_leaves((args, kwargs)) if _is_tensor(t)
              for s in [_storage(t)] if s is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # piecewise says so; warnings are tested in test_warnings.py
        gm = autocastfx.convert(model, args, example_kwargs=kwargs, **options)
    del model
    live = _live()
    assert gm.meta["autocastfx"].capture == capture
    if case in ("blocks", "llama-blocks", "piecewise"):
        assert len(_converted(gm)) > 2  # the blocks are converted modules of their own
    own = _own(gm)

    # what is reachable from gm
    other = _not_own(gm, own)
    extra = sum(n for n, _ in other.values())
    assert extra < ALLOWANCE * model_bytes, (
        f"{case}: gm reaches {extra} bytes of tensors that are not its own (model: {model_bytes} bytes):\n"
        + "\n".join(f"  {n} bytes {where}" for n, where in sorted(other.values(), reverse=True)[:10]))

    # what the process holds: gm's own tensors, and nothing else new
    new = {p: n for p, n in live.items() if p not in before and p not in inputs}
    outside = {p: n for p, n in new.items() if p not in own}
    own_bytes = sum(live.get(p, 0) for p in own)
    assert sum(outside.values()) < ALLOWANCE * model_bytes, (
        f"{case}: {sum(outside.values())} bytes in {len(outside)} storages stay alive beside gm's own "
        f"{own_bytes} (model: {model_bytes} bytes); sizes {sorted(outside.values(), reverse=True)[:10]}; held by:\n"
        + "\n".join(f"  {p}" for p in _holders(set(outside))))
    assert sum(new.values()) <= own_bytes + ALLOWANCE * model_bytes  # the process's new tensors: gm's own
    # gm's own are the model's tensors, not copies of them: no more bytes than the model's, every one of its
    # storages among them
    assert theirs <= set(own), f"{case}: {len(theirs - set(own))} of the model's storages are not gm's"
    assert own_bytes <= (1 + ALLOWANCE) * model_bytes, (case, own_bytes, model_bytes)
    print(f"{case}: model {model_bytes} bytes, gm's own {own_bytes}, other reachable {extra}, other live "
          f"{sum(outside.values())} ({time.perf_counter() - start:.2f} s)")


def test_the_check_sees_a_copy_held_in_a_node_meta_or_a_closure():
    """The walk from gm finds a tensor kept where no state dict shows it (and so would have found the model's
    weights kept on a node's meta or in a function's closure)."""
    torch.manual_seed(0)
    model = TinyResNet()
    gm = autocastfx.convert(model, (torch.randn(2, 3, 16, 16),))
    own = _own(gm)
    assert _not_own(gm, own) == {}
    weight = model.fc.weight.detach().clone()
    stash = torch.randn(16)
    next(iter(gm.graph.nodes)).meta["kept"] = {"w": weight}
    gm.meta["fn"] = lambda: stash
    found = _not_own(gm, own)
    assert set(found) == {_storage(weight)[0], _storage(stash)[0]}
    assert "Node" in found[_storage(weight)[0]][1] and "cell" in found[_storage(stash)[0]][1]
