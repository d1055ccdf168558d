"""ConvertOptions: what ``convert()`` was asked, checked once and frozen; every pass reads it, none writes it."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

LOW_DTYPES = (torch.float16, torch.bfloat16)
# the options a saved file records (autocastfx.save): the rest (dtype, policy) are written on their own
SAVED = ("pad_multiple", "keep_io_types", "memory_format")


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """The checked options of one ``convert()`` call (``info.options`` of a converted module).

    ``dtype``: the low dtype, resolved from ``"auto"``/``None`` (core.devices). ``pad_multiple``: 1 turns padding
    off. ``keep_io_types``: outputs in the model's dtypes. ``memory_format``: "auto", "channels_last" or "preserve"
    (core.layout). ``blocks``: "auto" or a list of names converts block by block (tree); None converts one graph."""
    dtype: torch.dtype = torch.float16
    policy: Any = None
    pad_multiple: int = 8
    keep_io_types: bool = True
    memory_format: str = "auto"
    blocks: Any = "auto"

    def replace(self, **changes) -> ConvertOptions:
        return dataclasses.replace(self, **changes)

    def saved(self) -> dict[str, Any]:
        """The options a saved file records (plain values)."""
        return {k: getattr(self, k) for k in SAVED}

    def __str__(self) -> str:
        blocks = (self.blocks if isinstance(self.blocks, (str, type(None), bool, list, tuple))
                  else getattr(self.blocks, "__name__", type(self.blocks).__name__))
        return (f"dtype={str(self.dtype).removeprefix('torch.')}, pad_multiple={self.pad_multiple}, "
                f"keep_io_types={self.keep_io_types}, "
                f"memory_format={self.memory_format}, blocks={blocks}")
