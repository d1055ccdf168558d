"""Recurrent layers in low precision: nn.LSTM, nn.GRU and nn.RNN run whole in the low dtype, as autocast runs them.

torch.fx cannot trace through an RNN module (its forward branches on the input), so a model with one is captured
by torch.export, where the layer is one aten call (``aten.lstm.input``: input, [h0, c0], the flat weight list).
The policy classifies it ``low``: input, initial state and every weight and bias reach it in the low dtype (the
weights cast from their float32 parameters in the graph), the one-dtype call cuDNN needs (kernels.py, ``_cudnn_rnn``). A packed
sequence defeats the capture: the model is converted piecewise, and a layer called with a packed sequence becomes a
converted part whose graph is its one call on the packed data (``torch.lstm(data, batch_sizes, ...)``), low as well.
"""
import copy
import os
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.overrides import TorchFunctionMode

import autocastfx
from autocastfx.base import keys as K
from autocastfx.core import kernels
from autocastfx import master_parameters
from helpers import AtenRecorder, cpu_autocast, onednn_refusal

BF16 = torch.bfloat16
RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"}


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy sizes, one small op per time step: one thread is fastest, and waits on no other process's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Tagger(nn.Module):
    """embedding -> recurrent layer -> linear, per token."""

    def __init__(self, rnn: nn.RNNBase, vocab=50, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, rnn.input_size)
        self.rnn = rnn
        width = (rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1)
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        e = self.emb(x)
        if not self.rnn.batch_first:
            e = e.transpose(0, 1)
        y, _ = self.rnn(e)
        if not self.rnn.batch_first:
            y = y.transpose(0, 1)
        return self.out(y)


RNNS = {
    "lstm_2layer": lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True),
    "lstm_bidirectional": lambda: nn.LSTM(16, 32, bidirectional=True, batch_first=True),
    "lstm_proj": lambda: nn.LSTM(16, 32, proj_size=8, batch_first=True),
    "gru_seq_first_bi_2layer": lambda: nn.GRU(16, 32, num_layers=2, bidirectional=True),
    "gru_no_bias": lambda: nn.GRU(16, 32, bias=False, batch_first=True),
    "rnn_tanh_2layer": lambda: nn.RNN(16, 32, num_layers=2, batch_first=True),
    "rnn_relu": lambda: nn.RNN(16, 32, nonlinearity="relu", batch_first=True),
}


def _tokens(seed=0, batch=4, length=7):
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def _convert(model, inputs, dtype=BF16):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, inputs, dtype=dtype)
    return gm, [str(w.message) for w in caught]


class RnnCalls(fx.Interpreter):
    """Runs a converted graph and keeps, for each recurrent aten call, the dtypes of its float tensor arguments
    and what the CUDA contract says of them."""

    def __init__(self, gm):
        super().__init__(gm)
        self.calls: list[tuple[str, set]] = []
        self.violations: list[str] = []

    def call_function(self, target, args, kwargs):
        name = getattr(target, "_opname", None)
        if name in RNN_OPS:
            flat = torch.utils._pytree.tree_leaves(args)
            self.calls.append((name, {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()}))
            self.violations += kernels.violations(name, args, _dtype)
        return super().call_function(target, args, kwargs)


def _dtype(a):
    return a.dtype if isinstance(a, torch.Tensor) and a.is_floating_point() else None


def _autocast_errors(model, gm, inputs, dtype=BF16):
    """Max abs error against float32: (autocastfx, torch.autocast on the same model), eval mode. Where torch.autocast
    cannot run the model on this CPU (oneDNN's low LSTM needs AVX-512), the test is skipped here (helpers.py)."""
    model.eval(), gm.eval()
    with torch.no_grad():
        ref = model(*inputs)
        ours = gm(*inputs).float()
        auto = cpu_autocast(lambda: model(*inputs), dtype).float()
    return (ours - ref).abs().max().item(), (auto - ref).abs().max().item()


def _within_twice_autocast(model, gm, inputs):
    """Each output of ``gm`` within twice torch.autocast's error against float32 (plus a floor), same inputs; skipped
    as in ``_autocast_errors`` where torch.autocast cannot run."""
    with torch.no_grad():
        ref = model(*inputs)
        ours = gm(*inputs)
        auto = cpu_autocast(lambda: model(*inputs), BF16)
    for o, a, r in zip(ours, auto, ref):
        assert (o - r).abs().max() <= 2 * (a.float() - r).abs().max() + 2e-3


@pytest.mark.parametrize("name", list(RNNS))
def test_recurrent_layer_runs_low_with_one_dtype(name):
    torch.manual_seed(0)
    model, x = Tagger(RNNS[name]()), _tokens(length=3)  # torch.export unrolls the layer per step: 3 steps suffice
    gm, warned = _convert(model, (x,))
    assert not [w for w in warned if "_flat_weights" in w or "no policy list" in w], warned
    # every weight and bias of the layer a float32 parameter of the module (the model's own), cast low in the graph
    rnn_params = {n: p for n, p in gm.named_parameters() if n.startswith("rnn.")}
    assert rnn_params and all(p.dtype == torch.float32 for p in rnn_params.values())
    assert all(p is q for p, q in zip(rnn_params.values(), model.rnn.parameters()))
    cast_low = {id(p) for p in master_parameters(gm)}
    assert all(id(p) in cast_low for p in rnn_params.values())
    # the graph's recurrent call: input, state and weights in one low dtype (the cuDNN contract)
    interp = RnnCalls(gm)
    interp.run(x)
    assert interp.calls and all(ds == {BF16} for _, ds in interp.calls), interp.calls
    assert interp.violations == []
    # what the CPU kernels see, forward and backward: every matmul in the low dtype
    with AtenRecorder() as rec:
        gm.train()
        gm(x).float().sum().backward()
    mats = [c for c in rec.calls if c.name in MATMULS]
    assert mats and all(set(d for d in c.in_dtypes if d.is_floating_point) == {BF16} for c in mats), \
        [(c.name, c.in_dtypes) for c in mats if set(c.in_dtypes) != {BF16}][:5]
    # as accurate as torch.autocast against float32
    ours, auto = _autocast_errors(model, gm, (x,))
    assert ours <= 2 * auto + 2e-3, (ours, auto)


def test_the_contract_check_flags_a_float32_bias_beside_low_weights():
    """The check can fail: a recurrent call with a float32 bias among bfloat16 weights breaks the rule."""
    b, f = torch.zeros(3, dtype=BF16), torch.zeros(3)
    assert kernels.violations("lstm", (b, [b, b], [b, b, f, f], True), _dtype)
    assert kernels.violations("gru", (b, b, [b, b, b, b], True), _dtype) == []
    assert kernels.rule_for("lstm").op == "_cudnn_rnn" and not kernels.rule_for(None, nn.GRU(2, 2)).accepts_mixed


def test_mkldnn_layer_sees_one_dtype_forward_and_backward():
    """On the CPU an LSTM layer is one oneDNN call: input, four weights and the state share the low dtype."""
    torch.manual_seed(0)
    model = Tagger(nn.LSTM(16, 32, num_layers=2, bidirectional=True, batch_first=True))
    x = _tokens(length=3)  # torch.export unrolls the layer per step: 3 steps suffice
    gm, _ = _convert(model, (x,))
    with AtenRecorder() as rec:
        gm(x).float().sum().backward()
    layers = rec.ops("mkldnn_rnn_layer", "mkldnn_rnn_layer_backward")
    if not layers:
        pytest.skip("this CPU build runs LSTM without oneDNN")
    for c in layers:
        assert {d for d in c.in_dtypes if d.is_floating_point} == {BF16}, (c.name, c.in_dtypes)


def test_the_autocast_baseline_is_skipped_only_where_the_cpu_lacks_what_onednn_needs(monkeypatch):
    """helpers.cpu_autocast skips a comparison only for oneDNN's refusal on a CPU without the features its low LSTM
    needs, or with oneDNN capped below them; where oneDNN may use them the refusal, and any other error anywhere,
    fails the test."""
    import helpers
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")  # this process's oneDNN read it when the process started
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    refusal = RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive. "
                           "Run workload with environment variable ONEDNN_VERBOSE=all to get additional diagnostic")

    def refused():
        raise refusal

    def broken():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    real = helpers.cpu_flags()
    monkeypatch.setattr(helpers, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    with pytest.raises(pytest.skip.Exception, match="bfloat16 LSTM primitive needs .* has no avx512f, avx512bw"):
        helpers.cpu_autocast(refused, BF16)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        helpers.cpu_autocast(broken, BF16)
    monkeypatch.setattr(helpers, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                                 "avx512dq", "avx512_bf16"}))
    with pytest.raises(RuntimeError, match="primitive descriptor"):
        helpers.cpu_autocast(refused, BF16)
    with pytest.raises(pytest.skip.Exception, match="float16 LSTM primitive needs .* has no avx512_fp16"):
        helpers.cpu_autocast(refused, torch.float16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an AVX-512 machine standing in for an AVX2 one
    with pytest.raises(pytest.skip.Exception, match="ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN below AVX512_CORE"):
        helpers.cpu_autocast(refused, BF16)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    # this CPU: torch.autocast runs a two-layer LSTM, or refuses it and the CPU lacks what oneDNN needs
    monkeypatch.setattr(helpers, "cpu_flags", lambda: real)
    lstm, x = nn.LSTM(4, 8, num_layers=2), torch.randn(3, 2, 4)
    try:
        out, _ = helpers.cpu_autocast(lambda: lstm(x), BF16)
    except pytest.skip.Exception as skipped:
        assert not set(helpers.ONEDNN_NEEDS[BF16]) <= real or cap, str(skipped)
    else:
        assert out.shape == (3, 2, 8) and torch.isfinite(out).all()


class WithState(nn.Module):
    """A language model step: the caller's state in and the new state out."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2)
        self.out = nn.Linear(32, 5)

    def forward(self, x, h0, c0):
        y, (h, c) = self.rnn(x, (h0, c0))
        return self.out(y), h, c


def test_state_in_and_out():
    """A float32 state given is cast to the layer's dtype; the outputs come back as the model's (float32)."""
    torch.manual_seed(0)
    model = WithState()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(7, 4, 16, generator=g), torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, 32, generator=g))
    gm, _ = _convert(model, inputs)
    interp = RnnCalls(gm)
    outs = interp.run(*inputs)
    assert interp.calls == [("lstm", {BF16})]
    assert [o.dtype for o in outs] == [torch.float32] * 3
    _within_twice_autocast(model, gm, inputs)


def test_eval_mode_turns_dropout_between_layers_off():
    torch.manual_seed(0)
    model = Tagger(nn.LSTM(16, 32, num_layers=2, dropout=0.5, batch_first=True))
    x = _tokens(length=3)  # torch.export unrolls the layer per step: 3 steps suffice
    gm, _ = _convert(model, (x,))
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(x), gm(x))
    ours, auto = _autocast_errors(model, gm, (x,))
    assert ours <= 2 * auto + 2e-3, (ours, auto)


def test_float16_on_a_tiny_layer():
    torch.manual_seed(0)
    model, x = Tagger(nn.GRU(8, 8, bidirectional=True, batch_first=True)), _tokens(batch=2, length=3)
    gm, _ = _convert(model, (x,), dtype=torch.float16)
    interp = RnnCalls(gm)
    interp.run(x)
    assert interp.calls == [("gru", {torch.float16})]
    ours, auto = _autocast_errors(model, gm, (x,), torch.float16)
    assert ours <= 2 * auto + 1e-3, (ours, auto)


def test_training_reaches_every_recurrent_weight():
    """train_step: the loss falls, the layers' parameters stay float32 and every one of them moves."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.lstm = nn.LSTM(16, 16, bidirectional=True, batch_first=True)
            self.gru = nn.GRU(32, 16, batch_first=True)
            self.out = nn.Linear(16, 5)

        def forward(self, x):
            y, _ = self.lstm(self.emb(x))
            y, _ = self.gru(y)
            return self.out(y)

    model, x = Two(), _tokens(batch=8, length=3)  # torch.export unrolls each layer per step: 3 steps suffice
    target = (x % 5)  # the class is a function of the token: learnable per position
    gm, _ = _convert(model, (x,))
    cast_low = {id(p) for p in master_parameters(gm)}
    rnn_masters = [p for n, p in gm.named_parameters() if n.startswith(("lstm.", "gru."))]
    assert len(rnn_masters) == 8 + 4 and all(id(p) in cast_low for p in rnn_masters)  # 2 x 4 tensors; GRU: 4
    before = [m.detach().clone() for m in rnn_masters]
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), opt)
    losses = [float(step((x,), target)) for _ in range(25)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(m.dtype == torch.float32 for m in rnn_masters)
    assert all(not torch.equal(b, m) for b, m in zip(before, rnn_masters))


class PackedTagger(nn.Module):
    """embedding -> pack_padded_sequence -> recurrent layer -> pad_packed_sequence -> linear, per token."""

    def __init__(self, rnn: nn.RNNBase, enforce_sorted: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, rnn.input_size)
        self.rnn = rnn
        self.enforce_sorted = enforce_sorted
        self.out = nn.Linear((rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1), 5)

    def forward(self, x, lengths):
        first = self.rnn.batch_first  # the model's code reads its layer's attributes
        e = self.emb(x)
        p = pack_padded_sequence(e if first else e.transpose(0, 1), lengths, batch_first=first,
                                 enforce_sorted=self.enforce_sorted)
        y, _ = self.rnn(p)
        y, _ = pad_packed_sequence(y, batch_first=first, total_length=x.shape[1])
        return self.out(y if first else y.transpose(0, 1))


PACKED = {  # (layer, enforce_sorted)
    "lstm_2layer": (lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True), False),
    "lstm_2layer_sorted": (lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True), True),
    "gru_bidirectional_seq_first": (lambda: nn.GRU(16, 32, bidirectional=True), False),
    "rnn_tanh": (lambda: nn.RNN(16, 32, batch_first=True), False),
}
LENGTHS, SORTED = torch.tensor([7, 3, 5, 2]), torch.tensor([7, 5, 3, 2])


class RecurrentCalls(TorchFunctionMode):
    """The recurrent calls made inside (torch.lstm/gru/rnn_* on a packed sequence's data: aten.lstm.data and its
    kin, before the CPU decomposes them): the dtypes of each call's float tensors, lists flattened, and what the
    CUDA contract says of them."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list]] = []
        self.violations: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "_opname", None) or getattr(func, "__name__", None)  # aten.gru.input, or torch.gru
        if name in RNN_OPS:
            flat = torch.utils._pytree.tree_leaves(args)
            self.calls.append((name, [t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]))
            self.violations += kernels.violations(name, args, _dtype)
        return func(*args, **(kwargs or {}))


def _layer_matmuls(rec: AtenRecorder, rnn: nn.RNNBase) -> tuple[list, list]:
    """(every matmul the CPU ran, those that read one of the layer's weight matrices, by shape)."""
    mats = [c for c in rec.calls if c.name in ("mm", "addmm", "bmm", "matmul", "linear")]
    shapes = {s for n, p in rnn.named_parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    return mats, [c for c in mats if shapes & set(c.in_shapes)]


def _packed_errors(model, gm, inputs):
    """Max abs error against float32: (autocastfx, torch.autocast on the same model), eval mode."""
    model.eval(), gm.eval()
    with torch.no_grad():
        ref = model(*inputs)
        ours = gm(*inputs)
        auto = cpu_autocast(lambda: model(*inputs), BF16)
    return [(o.float() - ref).abs().max().item() for o in (ours, auto)]


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_sequence_runs_the_layer_low(name):
    """Packing defeats the capture, so the model is converted piecewise; the layer called with the packed sequence
    becomes a converted part of its own: one recurrent call on the packed data, its input, state and every weight
    in bfloat16, cast from the float32 parameters under the model's names."""
    torch.manual_seed(0)
    make, enforce_sorted = PACKED[name]
    model, x = PackedTagger(make(), enforce_sorted), _tokens()
    lengths = SORTED if enforce_sorted else LENGTHS
    gm, warned = _convert(model, (x, lengths))
    assert any("piecewise" in w and "rnn" in w for w in warned), warned
    assert "rnn: converted (symbolic_trace) as its call on the packed sequence" in str(autocastfx.report(gm))
    # the recurrent call: data, state and every weight and bias in bfloat16, one dtype (the cuDNN contract)
    n_weights = len(model.rnn._flat_weights_names)
    with RecurrentCalls() as calls:
        gm(x, lengths)
    ((op, dtypes),) = calls.calls
    assert op == model.rnn.mode.lower() and set(dtypes) == {BF16}, calls.calls
    states = 2 if op == "lstm" else 1
    assert len(dtypes) == 1 + states + n_weights and calls.violations == []
    # what the CPU kernels saw, forward and backward: every matmul bfloat16, the layer's weights among their inputs
    gm.train()
    with AtenRecorder() as rec:
        gm(x, lengths).sum().backward()
    mats, layer = _layer_matmuls(rec, model.rnn)
    assert layer and all(set(c.in_dtypes) == {BF16} for c in mats), [(c.name, c.in_dtypes) for c in mats][:5]
    gates = [c for c in rec.calls if c.name in ("sigmoid", "sigmoid_", "tanh", "tanh_", "tanh_backward")]
    assert gates and all(set(c.in_dtypes) == {BF16} for c in gates)
    # float32 parameters cast low in the part's graph, the float32 model's state dict
    rnn_params = {n: p for n, p in gm.named_parameters() if n.startswith("rnn.")}
    assert set(rnn_params) == {f"rnn.{n}" for n in model.rnn._flat_weights_names}
    assert all(p.dtype == torch.float32 for p in rnn_params.values())
    cast_low = {id(p) for p in master_parameters(gm)}
    assert all(id(p) in cast_low for p in rnn_params.values())
    state, ref_state = gm.state_dict(), model.state_dict()
    assert list(state) == list(ref_state)
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], ref_state[k]) for k in state)
    assert list(gm.state_dict()) == list(ref_state)
    # as accurate as torch.autocast against float32, and on other lengths and batch sizes too
    ours, auto = _packed_errors(model, gm, (x, lengths))
    assert ours <= 2 * auto + 2e-3, (ours, auto)
    other = (_tokens(seed=1, batch=3, length=9), torch.tensor([9, 6, 1]))
    ours, auto = _packed_errors(model, gm, other)
    assert ours <= 2 * auto + 2e-3, (ours, auto)


class PackedWithState(nn.Module):
    """The caller's state in, the final state out, around a packed sequence (sorted inside by its lengths)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, proj_size=8, bias=False, bidirectional=True)
        self.out = nn.Linear(16, 5)

    def forward(self, x, lengths, h0, c0):
        y, (h, c) = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False), (h0, c0))
        y, _ = pad_packed_sequence(y, total_length=x.shape[0])
        return self.out(y), h, c


def test_packed_sequence_with_state_projections_and_no_bias():
    """A given state is put in the sequence's sorted order and cast to the layer's dtype, the final state is put
    back in the caller's order; projections and no biases: every weight in the call, in bfloat16."""
    torch.manual_seed(0)
    model = PackedWithState()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(7, 4, 16, generator=g), LENGTHS, torch.randn(4, 4, 8, generator=g),
              torch.randn(4, 4, 32, generator=g))
    gm, _ = _convert(model, inputs)
    with RecurrentCalls() as calls:
        outs = gm(*inputs)
    ((op, dtypes),) = calls.calls
    assert op == "lstm" and set(dtypes) == {BF16} and len(dtypes) == 1 + 2 + 12, calls.calls
    assert [o.dtype for o in outs] == [torch.float32] * 3
    model.eval(), gm.eval()
    _within_twice_autocast(model, gm, inputs)


def test_packed_layer_trains_and_switches_modes():
    """train()/eval() reach the packed call's train flag (dropout between layers on, then off); train_step lowers
    the loss and moves every float32 parameter of the layer."""
    torch.manual_seed(0)
    model, x = PackedTagger(nn.LSTM(16, 32, num_layers=2, dropout=0.3, batch_first=True)), _tokens(batch=8, length=6)
    lengths = torch.tensor([6, 2, 5, 3, 6, 1, 4, 6])
    gm, _ = _convert(model, (x, lengths))
    gm.eval()
    with torch.no_grad():
        assert not gm.rnn.training and torch.equal(gm(x, lengths), gm(x, lengths))
        gm.train()
        assert gm.rnn.training and not torch.equal(gm(x, lengths), gm(x, lengths))
    with pytest.raises(TypeError, match="PackedSequence"):
        gm.rnn(torch.zeros(6, 8, 16))
    masters = {n: p for n, p in gm.named_parameters() if n.startswith("rnn.")}
    assert len(masters) == 8
    before = {n: m.detach().clone() for n, m in masters.items()}
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), opt)
    losses = [float(step((x, lengths), x % 5)) for _ in range(8)]
    assert losses[-1] < 0.95 * losses[0], losses
    assert all(m.dtype == torch.float32 and not torch.equal(before[n], m) for n, m in masters.items())


class OwnLSTM(nn.LSTM):
    """A layer with a forward of its own: its packed call is not the one the converted part makes."""

    def forward(self, input, hx=None):
        out, state = super().forward(input, hx)
        return out, state


@pytest.mark.parametrize("why", ["own_forward", "policy_fp32"])
def test_a_packed_layer_that_does_not_convert_stays_float32(why):
    """A layer with a forward of its own, or one the policy keeps whole in float32, is not the packed call: it
    runs as the model's own float32 code, and the warning and the report name it."""
    torch.manual_seed(0)
    own = why == "own_forward"
    model, x = PackedTagger((OwnLSTM if own else nn.LSTM)(16, 32, batch_first=True)), _tokens()
    policy = None if own else autocastfx.Policy.default().override(module_types={nn.LSTM: "fp32"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = autocastfx.convert(model, (x, LENGTHS), dtype=BF16, policy=policy)
    warned = [str(w.message) for w in caught]
    assert any("piecewise" in w and "rnn:" in w for w in warned), warned
    assert "rnn:" in str(autocastfx.report(gm)).split("stay eager")[1].split("blocks:")[0]
    with RecurrentCalls() as calls, torch.no_grad():
        got = gm(x, LENGTHS)
        ref = model(x, LENGTHS)
    assert [set(d) for _, d in calls.calls] == [{torch.float32}] * 2
    assert all(p.dtype == torch.float32 for n, p in gm.named_parameters() if n.startswith("rnn."))
    assert master_parameters(gm.out) and (got.float() - ref).abs().max() < 2e-2


class Branchy(nn.Module):
    """A branch on values: no way of capturing takes the model as one graph."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.out = nn.Linear(32, 5)

    def forward(self, x):
        if (x < 0).any():
            x = x.clamp(min=0)
        y, _ = self.rnn(self.emb(x))
        return self.out(y)


def test_a_layer_on_a_padded_tensor_in_a_piecewise_model_is_a_part():
    """Recurrent layers are parts of a piecewise model too: one called with a tensor is captured on its own
    (torch.export, aten.gru.input) and runs low."""
    torch.manual_seed(0)
    model, x = Branchy(), _tokens()
    gm, warned = _convert(model, (x,))
    assert any("piecewise" in w and "rnn" in w for w in warned), warned
    with RecurrentCalls() as calls:
        gm(x)
    assert [(n, set(d)) for n, d in calls.calls] == [("gru", {BF16})] and calls.violations == []
    rnn = [p for n, p in gm.named_parameters() if n.startswith("rnn.")]
    cast_low = {id(p) for p in master_parameters(gm)}
    assert rnn and all(p.dtype == torch.float32 and id(p) in cast_low for p in rnn)
    ours, auto = _packed_errors(model, gm, (x,))
    assert ours <= 2 * auto + 2e-3, (ours, auto)


def test_a_leaf_rnn_module_asked_low_runs_in_float32():
    """As a leaf the module's parameters live inside it, beyond the plan's casts: a low input with float32
    weights is no legal call, so the plan keeps the float32 form and the report says why."""
    torch.manual_seed(0)
    model, x = Tagger(nn.LSTM(16, 32, batch_first=True)), _tokens()
    policy = autocastfx.Policy.default().override(module_types={nn.LSTM: "low"})
    gm = autocastfx.convert(model, (x,), policy=policy)
    (row,) = [r for r in autocastfx.report(gm).rows if r.target == "rnn"]
    assert row.dtype == "fp32" and "_cudnn_rnn" in row.reason
    assert all(p.dtype == torch.float32 for n, p in gm.named_parameters() if n.startswith("rnn."))
    assert torch.allclose(gm(x).float(), model(x), atol=5e-2)


class _LastStep(nn.Module):
    """An LSTM over float features: torch.export fixes its sequence length (only the batch of a float input is
    left free)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.fc(y[:, -1])


def test_a_size_the_capture_fixed_is_converted_for_on_first_use():
    """torch.export fixes an LSTM's sequence length and batch at the example's (as plain torch.export does): a call of
    other sizes (the shorter last chunk of an epoch, an evaluation batch) gets a conversion of its own on first use,
    over the same parameters, as a call of another structure does."""
    torch.manual_seed(0)
    model, x = _LastStep(), torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    for shape in ((3, 5, 8), (2, 7, 8), (4, 3, 8), (2, 7, 8)):
        xi = torch.randn(*shape)
        ref = model(xi)
        try:
            with torch.autocast("cpu", torch.bfloat16):
                ac_err = ((model(xi) - ref).norm() / ref.norm()).item()
        except RuntimeError as e:  # torch's bfloat16 LSTM needs AVX-512 (helpers.onednn_refusal): the bound where
            if onednn_refusal(e, torch.bfloat16) is None:  # it runs, 1.3e-3 to 3.6e-3 at these sizes (AMX Xeon)
                raise
            ac_err = 4e-3
        with AtenRecorder() as rec:
            out = gm(xi)
        assert out.shape == ref.shape
        assert any(torch.bfloat16 in c.in_dtypes for c in rec.ops("addmm", "mm", "linear"))
        assert (out - ref).norm() / ref.norm() <= 3 * ac_err + 1e-3
    sizes = gm.meta[K.OTHER_CALLS].sized
    assert (2, 7, 8) in {s[0] for s in sizes} and len(sizes) <= 3  # each new size converted once
    gm.zero_grad()
    gm(torch.randn(2, 7, 8)).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())  # the model's own parameters train


class _FixedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.pos = nn.LSTM(8, 16, batch_first=True), nn.Parameter(torch.zeros(3, 16))

    def forward(self, x):
        y, _ = self.rnn(x)
        return y + self.pos  # a table of the example's length: the model itself runs no other


def test_a_size_the_model_cannot_take_either_is_named_with_the_fix():
    """A length the model's own table does not take either: refused at every call, the sizes and the fix named.
    Short sequences: each such call tries a conversion for its length, which costs more the longer it is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(_FixedPositions(), (torch.randn(2, 3, 8),), dtype=torch.bfloat16)
    named = r"\[\(2, 4, 8\)\].*size\(\)\[1\] == 3.*Convert with example inputs of this size"
    for _ in range(2):  # refused alike at every such call
        with pytest.raises(ValueError, match=named):
            gm(torch.randn(2, 4, 8))


class _TokenLSTM(nn.Module):
    def __init__(self, vocab=48, width=32):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, width), nn.LSTM(width, width, batch_first=True), \
            nn.Linear(width, vocab)

    def forward(self, idx):
        return self.head(self.rnn(self.emb(idx))[0])


@pytest.mark.parametrize("how", ["torch.compile(gm)", "gm.compile()"])
def test_a_compiled_call_at_sizes_the_capture_fixed_is_converted_for_as_an_eager_one(how):
    """Under torch.compile, a call whose sizes differ from those torch.export fixed (a length after a batch size
    changed, when the compiler leaves both free) gets the conversion an eager call gets, through one graph break:
    the eager module's outputs, where the compiled trace stopped at torch.export's guard."""
    torch.manual_seed(0)
    model = _TokenLSTM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, eager = (autocastfx.convert(model, (torch.randint(0, 48, (4, 12)),), dtype=torch.bfloat16)
                     for _ in range(2))
    if how == "gm.compile()":
        gm.compile(backend="eager")
        run = gm
    else:
        run = torch.compile(gm, backend="eager")
    for shape in ((4, 12), (3, 12), (4, 8)):  # the length after the batch: the compiler leaves both free
        idx = torch.randint(0, 48, shape)
        out, expected = run(idx).detach(), eager(idx).detach()
        assert out.shape == (*shape, 48)
        assert (out - expected).abs().max() <= 1e-5 * expected.abs().max(), shape


class _WordModel(nn.Module):
    """pytorch/examples' word language model in small: main.py calls ``model.rnn.flatten_parameters()`` after
    loading its checkpoint."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(50, 16), nn.LSTM(16, 16, 2), nn.Linear(16, 50)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.emb(x), hidden)
        return F.log_softmax(self.dec(out), dim=-1), hidden


def test_a_converted_recurrent_layer_keeps_flatten_parameters_and_its_settings():
    torch.manual_seed(0)
    model, x = _WordModel(), torch.randint(0, 50, (7, 4))
    hidden = (torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(copy.deepcopy(model), (x, hidden), dtype=torch.bfloat16)
    assert gm.rnn.hidden_size == 16 and gm.rnn.num_layers == 2 and gm.rnn.mode == "LSTM"
    gm.rnn.flatten_parameters()  # nothing to lay out: the graph reads each weight by name
    gm.load_state_dict(copy.deepcopy(gm.state_dict()))
    gm.rnn.flatten_parameters()
    out, _ = gm(x, hidden)
    ref, _ = model(x, hidden)
    assert (out - ref).norm() / ref.norm() < 0.02
    out.sum().backward()
    assert gm.rnn.weight_hh_l1.grad is not None
