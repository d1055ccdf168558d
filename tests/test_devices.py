"""dtype="auto": the low dtype that pays on the model's device, said in the report; a slow one warned about."""
import warnings

import pytest
import torch

import autocastfx
from autocastfx.core import devices
from small_models import example


def _convert(**kw):
    model, inputs = example("resnet")
    return autocastfx.convert(model, inputs, **kw)


def test_auto_picks_by_the_cpus_own_flags_and_says_why(monkeypatch):
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset({"avx512f", "avx512_bf16"}))
    gm = _convert(dtype="auto")
    assert gm.meta["autocastfx"].dtype == torch.bfloat16
    assert "low dtype: auto: bfloat16 on this CPU: native" in str(autocastfx.report(gm))
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset({"avx512f", "avx512_fp16"}))
    assert devices.choose(torch.device("cpu"))[0] == torch.float16
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset({"avx2"}))
    dtype, why = devices.choose(torch.device("cpu"))
    assert dtype == torch.bfloat16 and "no native" in why
    assert devices.choose(torch.device("cuda"))[0] == torch.float16


def test_an_explicit_slow_dtype_is_warned_about_once_the_default_only_in_the_report(monkeypatch):
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset({"avx512f", "avx512_bf16"}))
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
    monkeypatch.setattr(devices, "cpu_features", lambda: frozenset())
    with warnings.catch_warnings():
        warnings.simplefilter("error", autocastfx.SlowDtypeWarning)
        _convert(dtype=torch.float16)


def test_a_bad_dtype_string_is_refused():
    with pytest.raises(ValueError, match="'auto'"):
        _convert(dtype="fastest")
