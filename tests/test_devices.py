"""dtype="auto": the dtype that pays on the model's device (float32 compute where no low dtype does), said in the
report; a slow one warned about."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import autocastfx
from autocastfx.core import devices
from small_models import Block, example

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})


def _convert(name="resnet", **kw):
    model, inputs = example(name)
    return autocastfx.convert(model, inputs, **kw)


def _flags(monkeypatch, flags, onednn=None):
    """The CPU's flags faked, and oneDNN's cap (ONEDNN_MAX_CPU_ISA) set or cleared."""
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset(flags))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if onednn is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)


@pytest.mark.parametrize("flags, want", [
    (AVX2, torch.float32),
    (AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}, torch.float32),
    (AVX2 | {"avx512f", "avx512_bf16"}, torch.bfloat16),
    (AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}, torch.bfloat16),
    (AVX2 | {"avx512f", "avx512_fp16"}, torch.float16),
], ids=["avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"])
def test_auto_picks_by_the_cpus_own_flags(monkeypatch, flags, want):
    _flags(monkeypatch, flags)
    assert devices.choose(torch.device("cpu"))[0] == want
    gm = _convert(dtype="auto")
    assert gm.meta["autocastfx"].dtype == want
    assert {p.dtype for p in gm.parameters()} == {torch.float32}  # the model's own parameters, whatever the dtype
    assert _cast_dtypes(gm) == (set() if want == torch.float32 else {want})


def _cast_dtypes(gm):
    """The low dtypes the graphs (the module's and its converted blocks') cast to."""
    from autocastfx.core.weights import converted_units
    return {n.meta["autocastfx"].dtype for _, u in converted_units(gm) for n in u.graph.nodes
            if getattr(n.meta.get("autocastfx"), "kind", None) == "cast"} - {torch.float32}


def test_auto_on_cuda_is_float16():
    assert devices.choose(torch.device("cuda"))[0] == torch.float16


def test_auto_says_why_in_the_report(monkeypatch):
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    assert "low dtype: auto: bfloat16 on this CPU: native" in str(autocastfx.report(_convert(dtype="auto")))
    _flags(monkeypatch, AVX2)
    text = str(autocastfx.report(_convert(dtype="auto")))
    assert "compute dtype float32 (auto: float32 on this CPU: AVX2 without AVX-512" in text
    assert "avx512_bf16, amx_bf16" in text and "emulated, tens of times slower than float32" in text
    assert "casts per forward: 0 (0 bytes)" in text and "parameters: float32, read as they are (no casts)" in text
    assert "all in float32" in text
    for nonsense in ("low dtype fp32", "low dtype:", "parameters stored low", "in low precision",
                     "float32 masters kept", "padding to"):
        assert nonsense not in text
    totals = autocastfx.report(_convert(dtype="auto")).totals
    assert totals["dtype"] == "fp32" and totals["low_flops"] == 0 and totals["low_parameters"] == 0


def test_unreadable_flags_are_settled_by_a_measured_matmul(monkeypatch):
    _flags(monkeypatch, ())
    monkeypatch.setattr(devices, "measured_rates",
                        lambda: {torch.float32: 60.0, torch.bfloat16: 1.3, torch.float16: 1.4})
    dtype, why = devices.choose(torch.device("cpu"))
    assert dtype == torch.float32 and "flags cannot be read" in why and "bfloat16 1.3" in why
    monkeypatch.setattr(devices, "measured_rates",
                        lambda: {torch.float32: 20.0, torch.bfloat16: 40.0, torch.float16: 3.0})
    assert devices.choose(torch.device("cpu"))[0] == torch.bfloat16


def test_the_measured_rates_are_real_cached_and_leave_the_random_state_alone():
    torch.manual_seed(3)
    want = torch.rand(4)
    devices.measured_rates.cache_clear()
    torch.manual_seed(3)
    rates = devices.measured_rates()
    assert torch.equal(torch.rand(4), want)
    assert set(rates) == {torch.float32, torch.bfloat16, torch.float16} and all(r > 0 for r in rates.values())
    assert devices.measured_rates() is rates


class _Seen(TorchDispatchMode):
    """The dtypes of every tensor each aten op took or gave."""

    def __init__(self):
        super().__init__()
        self.dtypes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.dtypes.setdefault(t.dtype, set()).add(str(func))
        return out


class _Stack(nn.Module):
    """Blocks in a ModuleList: converted as modules of their own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList([Block(32, 4, causal=True) for _ in range(2)])
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).log_softmax(-1)


def _run(module, inputs, mode):
    module.train(mode == "train")
    torch.manual_seed(1)
    out = module(*inputs)
    out.float().square().sum().backward()
    return out.detach(), [p.grad for p in module.parameters()]


@pytest.mark.parametrize("name", ["resnet", "vit", "gpt", "stack"])
def test_float32_compute_is_the_float32_model_exactly(monkeypatch, name):
    _flags(monkeypatch, AVX2)
    model, inputs = (_Stack(), (torch.randn(2, 6, 8),)) if name == "stack" else example(name)
    gm = autocastfx.convert(model, inputs, dtype="auto")
    units = [m for m in gm.modules() if "autocastfx" in getattr(m, "meta", {})]
    assert gm.meta["autocastfx"].dtype == torch.float32 and len(units) == (3 if name == "stack" else 1)
    decisions = [n.meta["autocastfx"] for u in units for n in u.graph.nodes if "autocastfx" in n.meta]
    assert decisions and not [d for d in decisions if d.kind == "cast" or d.added_dtype_kwarg]
    if name != "stack":  # a converted block takes its input as x.to(the dtype it was made for): no copy here
        assert ".to(" not in gm.code
    assert {p.dtype for p in gm.parameters()} == {torch.float32} and not autocastfx.master_parameters(gm)
    for mode in ("eval", "train"):
        ref = copy.deepcopy(model)
        want, want_grads = _run(ref, inputs, mode)
        with _Seen() as seen:
            got, got_grads = _run(gm, inputs, mode)
        assert set(seen.dtypes) == {torch.float32}, {d: sorted(ops)[:5] for d, ops in seen.dtypes.items()}
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
        gm.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def test_a_float32_module_trains_with_the_generated_step(monkeypatch):
    _flags(monkeypatch, AVX2)
    model, (x,) = example("resnet", batch=4)
    gm = autocastfx.convert(model, (x,), dtype="auto")
    step = autocastfx.train_step(gm, torch.nn.functional.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.1))
    y = torch.tensor([1, 2, 3, 4])
    losses = [float(step(x, y)) for _ in range(4)]
    assert losses[-1] < losses[0] and step.stats.summary()["skipped"] == 0


def test_an_explicit_low_dtype_still_converts_on_a_cpu_without_it(monkeypatch):
    _flags(monkeypatch, AVX2)
    with pytest.warns(autocastfx.SlowDtypeWarning, match="bfloat16 has no fast kernels"):
        gm = _convert(dtype=torch.bfloat16)
    assert gm.meta["autocastfx"].dtype == torch.bfloat16
    assert torch.bfloat16 in _cast_dtypes(gm) and autocastfx.master_parameters(gm)


def test_an_explicit_slow_dtype_is_warned_about_once_the_default_only_in_the_report(monkeypatch):
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = _convert(dtype=torch.float16)
        default = _convert()
        fine = _convert(dtype=torch.bfloat16)
    slow = [w for w in caught if issubclass(w.category, autocastfx.SlowDtypeWarning)]
    assert len(slow) == 1 and "convert(dtype='auto')" in str(slow[0].message)
    assert slow[0].filename == __file__  # pointed at the caller's line
    assert default.meta["autocastfx"].dtype == torch.float16
    assert "float16, the default; float16 has no fast kernels" in str(autocastfx.report(default))
    assert "low dtype:" not in str(autocastfx.report(fine))
    assert "low dtype: float16 has no fast kernels" in str(autocastfx.report(gm))


def test_unknown_cpu_flags_warn_about_nothing(monkeypatch):
    _flags(monkeypatch, ())
    with warnings.catch_warnings():
        warnings.simplefilter("error", autocastfx.SlowDtypeWarning)
        _convert(dtype=torch.float16)


def test_cpu_summary_names_the_machine(monkeypatch):
    _flags(monkeypatch, AVX2)
    line = devices.cpu_summary()
    assert line.startswith("CPU: ") and "torch capability" in line and "flags avx2;" in line
    assert line.endswith("bfloat16 emulated, float16 emulated")
    _flags(monkeypatch, AVX2 | {"avx512f", "amx_tile", "amx_bf16"})
    assert "flags avx2 avx512f amx_tile amx_bf16;" in devices.cpu_summary()
    assert "bfloat16 native, float16 emulated" in devices.cpu_summary()


AMX = AVX2 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16", "amx_fp16"}


@pytest.mark.parametrize("onednn, want", [
    ("AVX2", torch.float32),               # an AMX machine standing in for an AVX2 one: emulated, whatever it has
    ("AVX512_CORE", torch.float32),        # AVX-512 without its BF16 instructions
    ("avx512_core_bf16", torch.bfloat16),  # the case oneDNN ignores
    ("AVX512_CORE_AMX", torch.bfloat16),   # the older name of AVX10_1_512_AMX
    ("DEFAULT", torch.bfloat16),           # no cap
    ("no-such-isa", torch.bfloat16),       # a name oneDNN does not know: it ignores it
], ids=["avx2", "avx512_core", "bf16", "amx", "default", "unknown"])
def test_auto_follows_onednns_cap_on_the_cpu(monkeypatch, onednn, want):
    """oneDNN runs the low dtypes' matmuls and convolutions: below a dtype's instructions (ONEDNN_MAX_CPU_ISA)
    it is emulated there as on a CPU without them, so "auto" keeps float32, says why, and an explicit bfloat16
    is warned about."""
    _flags(monkeypatch, AMX, onednn)
    dtype, why = devices.choose(torch.device("cpu"))
    assert dtype == want
    if want == torch.float32:
        assert why.startswith(f"float32 on this CPU: ONEDNN_MAX_CPU_ISA={onednn} keeps oneDNN off its native "
                              "bfloat16/float16 instructions (which need AVX512_CORE_BF16/AVX10_1_512; unset it, "
                              "or set it to one of those or higher, to use them)"), why
        assert f"oneDNN capped at {onednn} (ONEDNN_MAX_CPU_ISA); bfloat16 emulated" in devices.cpu_summary()
        with pytest.warns(autocastfx.SlowDtypeWarning, match="bfloat16 has no fast kernels"):
            devices.resolve(torch.bfloat16, torch.device("cpu"))
    else:
        assert "native" in why and "bfloat16 native" in devices.cpu_summary()


def test_the_older_name_of_onednns_cap_is_read_and_named(monkeypatch):
    _flags(monkeypatch, AMX)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", " avx2 ")
    dtype, why = devices.choose(torch.device("cpu"))
    assert dtype == torch.float32 and why.startswith("float32 on this CPU: DNNL_MAX_CPU_ISA=AVX2 keeps oneDNN"), why
    assert "oneDNN capped at AVX2 (DNNL_MAX_CPU_ISA)" in devices.cpu_summary()


@pytest.mark.parametrize("dtype", ["fastest", torch.float32, torch.float64, 16])
def test_a_dtype_auto_did_not_choose_is_refused_naming_what_is_accepted(dtype):
    with pytest.raises(ValueError, match=r"torch\.float16 or torch\.bfloat16 \(None: float16.* or 'auto'"):
        _convert(dtype=dtype)
