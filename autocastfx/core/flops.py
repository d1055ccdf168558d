"""FLOPs of the low-precision candidates (matmuls, convolutions), per node, counted by torch's own
``FlopCounterMode`` on the node's recorded shapes: what the report's low-precision share is made of."""
from __future__ import annotations
import torch
import torch.fx as fx
from .policy import LOW_OPS, op_name
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from ..base import keys as K
from ..base.meta import TensorInfo


_COUNTED = LOW_OPS  # FLOPs are counted where tensor cores could run them


def node_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """FLOPs of one node (matmul/conv/attention, as torch.utils.flop_counter counts them), from the recorded
    shapes, on meta tensors. Computed on demand by the report and cached in ``node.meta``."""
    if K.FLOPS in node.meta:
        return node.meta[K.FLOPS]
    flops = 0
    if node.op in ("call_function", "call_method") and op_name(node) in _COUNTED:
        def meta_of(a):
            if not isinstance(a, fx.Node):
                return a
            info = a.meta.get(K.INFO)
            if not isinstance(info, TensorInfo):
                raise ValueError(f"no recorded tensor for {a.name}")
            return torch.empty(info.shape, dtype=torch.float32 if info.is_float else info.dtype, device="meta")
        try:
            args = fx.node.map_aggregate(node.args, meta_of)
            kwargs = fx.node.map_aggregate(node.kwargs, meta_of)
            fn = node.target if node.op == "call_function" else getattr(type(args[0]), node.target)
            with FlopCounterMode(display=False) as fc:
                fn(*args, **kwargs)
            flops = int(fc.get_total_flops())
        except Exception:  # noqa: BLE001 - an op without a meta kernel counts as unknown (0)
            flops = 0
    node.meta[K.FLOPS] = flops
    return flops
