"""Independent checks: what dtypes each aten op really saw, and how many bytes casts moved."""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CAST_OPS = {"_to_copy", "to", "copy_"}


@dataclasses.dataclass
class OpCall:
    name: str                     # aten op name without namespace/overload, e.g. "convolution"
    overload: str                 # full name, e.g. "aten.convolution.default"
    in_dtypes: list[torch.dtype]  # dtypes of the tensor inputs, in order
    out_dtypes: list[torch.dtype]
    in_shapes: list[tuple]
    out_numel: int
    in_numel: int


class AtenRecorder(TorchDispatchMode):
    """Records every aten op dispatched inside the block (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self.calls.append(OpCall(func._opname, str(func), [t.dtype for t in ins], [t.dtype for t in outs],
                                 [tuple(t.shape) for t in ins], sum(o.numel() for o in outs),
                                 sum(t.numel() for t in ins)))
        return out

    def ops(self, *names: str) -> list[OpCall]:
        return [c for c in self.calls if c.name in names]

    def float_casts(self) -> list[OpCall]:
        """Dtype-changing copies between floating dtypes."""
        res = []
        for c in self.calls:
            if c.name not in CAST_OPS or not c.in_dtypes or not c.out_dtypes:
                continue
            src, dst = c.in_dtypes[0], c.out_dtypes[0]
            if c.name == "copy_" and len(c.in_dtypes) >= 2:
                dst, src = c.in_dtypes[0], c.in_dtypes[1]
            if src != dst and src.is_floating_point and dst.is_floating_point:
                res.append(c)
        return res

    def cast_bytes(self) -> int:
        total = 0
        for c in self.float_casts():
            src, dst = (c.in_dtypes[1], c.in_dtypes[0]) if c.name == "copy_" else (c.in_dtypes[0], c.out_dtypes[0])
            n = c.out_numel if c.name != "copy_" else c.in_numel // 2
            total += n * (src.itemsize + dst.itemsize)
        return total
