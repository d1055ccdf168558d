"""Shape propagation: autocastfx.core.propagate against torch.fx's FakeTensorProp on the same captured graphs.

    python bench/propagate.py

Both run a graph on fake tensors and leave every node's dtype, shape and device (ours as ``TensorInfo`` in
``node.meta``, FakeTensorProp as ``meta["val"]``). The graphs are what convert() propagates: a model captured by
torch.export (``ep.module()``, the model's tensors as attributes) and a symbolically traced stack whose repeated
blocks are leaf modules. Prints, per graph, the best of five runs of each (and each one's first run, after the other graphs' runs), and checks that both give the same
shapes and dtypes. The figures and the decision they support: docs/benchmarks.md, "Shape propagation".
"""
import os
import sys
import time
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from autocastfx.base import keys as K  # noqa: E402
from autocastfx.core import devices  # noqa: E402
from autocastfx.core.propagate import propagate  # noqa: E402
from small_models import TinyGPT  # noqa: E402


class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class LeafBlocks(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Block) or super().is_leaf_module(m, qualname)


def graphs():
    torch.manual_seed(0)
    out = []
    ids = torch.randint(0, 101, (4, 32))
    out.append(("TinyGPT, torch.export", torch.export.export(TinyGPT(), (ids,)).module(), (ids,)))
    try:
        import transformers as tf
        cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, use_cache=False)
        ids = torch.randint(0, 1000, (2, 64))
        out.append(("Llama 4 layers d256, torch.export",
                    torch.export.export(tf.LlamaForCausalLM(cfg), (ids,), strict=False).module(), (ids,)))
    except ImportError:
        pass
    stack = nn.Sequential(*[Block() for _ in range(24)])
    x = torch.randn(8, 64, 256)
    out.append(("24 leaf blocks d256, symbolic_trace", fx.GraphModule(stack, LeafBlocks().trace(stack)), (x,)))
    return out


def ours(gm, args):
    propagate(gm, args, {})
    return {n.name: n.meta.get(K.INFO) for n in gm.graph.nodes}


def fx_fake(gm, args):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a) for a in args])
    return {n.name: n.meta.get("val") for n in gm.graph.nodes}


def same(a, b) -> bool:
    """The same shape and dtype at every node both describe as one tensor."""
    for name, info in a.items():
        val = b.get(name)
        if isinstance(val, torch.Tensor) and info is not None and hasattr(info, "shape"):
            if tuple(info.shape) != tuple(val.shape) or info.dtype != val.dtype:
                return False
    return True


def best(fn, *args, runs=5):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    warnings.simplefilter("ignore")
    print(f"{devices.cpu_summary()}; {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'graph':40} {'nodes':>6} {'autocastfx ms':>14} {'FakeTensorProp ms':>18} {'ratio':>6} same  "
          "(first runs, ms)")
    for name, gm, args in graphs():
        t = time.perf_counter()
        a = ours(gm, args)
        first_ours = time.perf_counter() - t
        t = time.perf_counter()
        b = fx_fake(gm, args)
        first_fx = time.perf_counter() - t
        t_ours, t_fx = best(ours, gm, args), best(fx_fake, gm, args)
        print(f"{name:40} {len(gm.graph.nodes):6d} {t_ours * 1e3:14.1f} {t_fx * 1e3:18.1f} {t_fx / t_ours:6.2f} "
              f"{str(same(a, b)):5} ({first_ours * 1e3:.0f}, {first_fx * 1e3:.0f})")


if __name__ == "__main__":
    main()
