"""What the generated code of a converted module calls at run time (its result type rebuilt), and the no-op
``recompile`` a conversion's passes run under."""
from __future__ import annotations
import contextvars
from typing import Any


def no_recompile() -> None:
    """Stands in for ``gm.recompile`` while a conversion's passes edit the graph."""
    return None


_OUTPUT_TYPES: dict[str, type] = {}


def rebuild_output(values: dict, cls: str) -> Any:
    """The model's own result type (a Hugging Face ModelOutput, named ``module:qualname``) from the dict a
    trace wrote in its place."""
    t = _OUTPUT_TYPES.get(cls)
    if t is None:
        import importlib
        module, _, qual = cls.partition(":")
        t = importlib.import_module(module)
        for part in qual.split("."):
            t = getattr(t, part)
        _OUTPUT_TYPES[cls] = t
    return t(**values)


def type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# True inside convert() (and a conversion made at call time), whose captures switch modules' modes to capture each
# mode, and while a converted module takes a mode set on the model: no converted module hands a mode on to the
# model's modules meanwhile (converted.state, converted.module)
KEEP_MODEL_MODES: contextvars.ContextVar = contextvars.ContextVar("autocastfx_keep_model_modes", default=False)
