"""convert() warns about real unclassified ops, once per op, and never about output-structure builders."""
import copy
import collections
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import autocastfx

Pair = collections.namedtuple("Pair", "logits total")


@dataclasses.dataclass
class DataOut:
    logits: torch.Tensor
    total: torch.Tensor


class Packs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = nn.Linear(8, 8), kind

    def forward(self, x):
        y = self.fc(x)
        if self.kind == "namedtuple":
            return Pair(y, y.sum())
        if self.kind == "dataclass":
            return DataOut(y, y.sum())
        if self.kind == "dict":
            return dict(logits=y, total=y.sum())
        if self.kind == "tuple":
            return tuple([y, y.sum()])
        return torch.special.erfcx(y) + torch.special.erfcx(2 * y) + torch.special.i0e(y)


def _convert(kind):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(Packs(kind), (torch.randn(2, 8),))
    return gm, [str(w.message) for w in caught if "autocastfx" in str(w.message)]


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "dict", "tuple"])
def test_output_structure_builders_are_not_warned_about(kind):
    gm, messages = _convert(kind)
    assert messages == []
    out = gm(torch.randn(2, 8))
    expected = {"namedtuple": Pair, "dataclass": DataOut, "dict": dict, "tuple": tuple}[kind]
    assert type(out) is expected
    rows = [r for r in autocastfx.report(gm).rows if "output structure" in r.reason]
    assert kind in ("tuple", "dict") or rows  # dict()/tuple() calls may be folded into the output by tracing


def test_a_real_unclassified_op_is_warned_once_per_op():
    gm, messages = _convert("ops")
    assert len(messages) == 1
    msg = messages[0]
    assert "special_erfcx (2 nodes)" in msg and "special_i0e" in msg and msg.count("erfcx") == 1
    assert "Policy.default().override" in msg
    assert gm.meta["autocastfx"].plan.unclassified  # and the report still lists every node


def _caught(convert):
    """(the converted module, autocastfx's warnings, every other warning but the model library's own)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = convert()
    ours = [str(w.message) for w in caught if str(w.message).startswith("autocastfx")]
    others = [f"{w.category.__name__} at {w.filename}:{w.lineno}: {str(w.message)[:150]}" for w in caught
              if not str(w.message).startswith("autocastfx") and "/transformers/" not in w.filename]
    return gm, ours, others


def test_torch_warnings_about_its_own_internals_do_not_reach_the_caller():
    """torch.export, unflatten and copies of their pytree specs warn about torch's own code while convert()
    drives them (a get_attr per submodule unflattened, a deprecated class per spec leaf copied): none of it is
    passed on, and autocastfx's own warnings still are."""
    tf = pytest.importorskip("transformers")
    # two layers: the second reuses the first one's plan, which copies the specs
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(cfg).eval()
    kw = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    gm, ours, others = _caught(lambda: autocastfx.convert(llama, example_kwargs=kw))  # blocks="auto"
    assert gm.meta["autocastfx"].capture == "torch.export"
    assert all("autocastfx" in layer.meta for layer in gm.model.layers)  # unflattened, and blocks reused
    assert "reused" in gm.model.layers[1].meta["autocastfx_block"]["plan"]
    assert ours == [] and others == [], others
    gm, ours, others = _caught(lambda: autocastfx.convert(Packs("ops"), (torch.randn(2, 8),)))  # traced
    assert gm.meta["autocastfx"].capture == "symbolic_trace"
    assert len(ours) == 1 and "special_erfcx" in ours[0] and others == [], others


class _BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        y = self.stem(x)
        if y.sum() > -1e9:  # a branch on a value: neither symbolic_trace nor torch.export captures it
            y = y.relu()
        return self.head(y)


def test_a_model_that_branches_on_values_converts_without_torch_printing_its_partial_graph(capfd):
    """torch.export prints the graph traced so far to stderr when the model's code branches on a tensor's value
    (pytorch/pytorch#146298); convert() then captures the model piecewise, so nothing reaches the caller's stderr
    or stdout, and where nothing else captures either, the error still names the data dependence."""
    torch.manual_seed(0)
    model, x = _BranchesOnValues(), torch.randn(3, 8)
    with pytest.warns(UserWarning, match="converted piecewise.*data-dependent expression"):
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    out, err = capfd.readouterr()
    assert "def forward" not in err + out and out == "" and err == "", err[:500]
    assert torch.allclose(gm(x), model(x), atol=0.05)
    with pytest.raises(autocastfx.CaptureError, match="data-dependent expression"):
        autocastfx.convert(model, (x,), dtype=torch.bfloat16, blocks=None)
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[:500]


class _Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x, mask=None, bias=None):
        y = self.l(x)
        if mask is not None:
            y = y * mask
        if bias is not None:
            y = y + bias
        return y


def test_conversions_for_other_calls_in_two_threads_leave_the_warning_filters_as_they_were():
    """Two threads converting for calls of another structure at once: before, the filter list one saved held the
    other's "ignore everything", put back for good (every later warning swallowed)."""
    import threading
    x = torch.randn(4, 16)
    gm = autocastfx.convert(_Optional(), (x,), dtype=torch.bfloat16)
    before = list(warnings.filters)
    barrier = threading.Barrier(2)
    returned, failed = [], []

    def call(name):
        barrier.wait()
        try:
            returned.append(gm(x, **{name: torch.ones(4, 16)}).shape)
        except Exception as e:  # noqa: BLE001 - asserted below, in the test's thread
            failed.append(f"{name}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=call, args=(k,)) for k in ("mask", "bias")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed and len(returned) == 2, failed  # both calls converted for and ran
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("still shown")
    assert len(seen) == 1


def test_a_filter_of_the_callers_equal_to_one_of_torchs_internal_ones_stays():
    message = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        mine = warnings.filters[0]

        class Noisy(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(8, 8)

            def forward(self, x):
                return self.l(x) + torch.randn(8)  # goes to torch.export
        autocastfx.convert(Noisy(), (torch.randn(4, 8),), dtype=torch.bfloat16)
        assert any(f is mine for f in warnings.filters)


def test_a_logger_level_set_while_torchs_loggers_are_quiet_stays():
    """Another thread setting a quiet logger's level meanwhile keeps its setting when the last one out leaves."""
    import logging
    from autocastfx.base.quiet import quiet_torch_logs
    logger = logging.getLogger("torch._dynamo")
    kept = logger.level
    try:
        with quiet_torch_logs():
            logger.setLevel(logging.DEBUG)
        assert logger.level == logging.DEBUG
        logger.setLevel(logging.WARNING)
        with quiet_torch_logs():
            assert logger.level == logging.ERROR
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(kept)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + nn.functional.dropout(self.fc(x), 0.1, self.training)


class _DropsOut(nn.Module):
    """A nanoGPT-shaped call: (idx, targets) in, (logits, loss) out, repeated layers, dropout in training only."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos, self.drop, self.head = nn.Embedding(32, 16), nn.Embedding(8, 16), nn.Dropout(0.1), \
            nn.Linear(16, 32)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, idx, targets):
        b, t = idx.size()
        assert t <= 8, "longer than the position table"  # symbolic tracing stops here: torch.export captures
        x = self.drop(self.emb(idx) + self.pos(torch.arange(t, device=idx.device)))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("blocks", ["auto", None])
def test_a_model_whose_programs_differ_by_mode_converts_without_torch_warnings(blocks):
    """The eval program, made from the training capture by setting its dropout flags, copies the capture's graph,
    whose code generator holds pytree specs: copying them set off torch's FutureWarning about its own deprecated
    leaf class, once per process (nanoGPT's train.py with convert() added)."""
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    gm, ours, others = _caught(lambda: autocastfx.convert(_DropsOut(), (idx, idx), dtype=torch.bfloat16,
                                                          blocks=blocks))
    assert all(len(m.meta["autocastfx_programs"].graphs) == 2 for m in (gm.layers if blocks else [gm]))
    ours = [w for w in ours if "has no fast kernels on this CPU" not in w]  # bfloat16 emulated: said once, rightly
    assert ours == [] and others == [], others
    _, ours, others = _caught(lambda: copy.deepcopy(gm))  # an EMA copy
    assert ours == [] and others == [], others
