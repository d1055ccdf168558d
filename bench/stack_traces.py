"""Conversion time with and without the node stack traces torch.export records by default.

    python bench/stack_traces.py [rounds]

Converts each model ``rounds`` times (default 5) each way, the two recipes alternating in one process after a
warm-up conversion, and prints the median and the range of the process CPU seconds per conversion. "stacks" records
one source stack per traced op, as ``torch.export.export`` does by default; "none" is what ``convert()`` does
(``capture.torch_export.run_export``). Both give the same program: the script checks that the converted modules'
code is the same. The figures and the decision: docs/benchmarks.md, "torch.export without node stack traces".
"""
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import autocastfx  # noqa: E402
from autocastfx.capture import torch_export  # noqa: E402
from small_models import TinyGPT  # noqa: E402


def models():
    torch.manual_seed(0)
    out = [("TinyGPT (tests), torch.export", lambda: TinyGPT(), (torch.randint(0, 101, (4, 16)),), {})]
    try:
        import transformers as tf
        tf.logging.set_verbosity_error()
    except ImportError:
        return out
    gpt2 = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    llama = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    out.append(("HF GPT-2, 2 layers, d 32, blocks", lambda: tf.GPT2LMHeadModel(gpt2), (torch.randint(0, 64, (2, 8)),),
                {}))
    out.append(("HF Llama, 2 layers, d 64, one graph", lambda: tf.LlamaForCausalLM(llama),
                (torch.randint(0, 128, (2, 8)),), {"blocks": None}))
    out.append(("HF Llama, 2 layers, d 64, blocks", lambda: tf.LlamaForCausalLM(llama),
                (torch.randint(0, 128, (2, 8)),), {}))
    return out


@contextlib.contextmanager
def recorded():
    """``run_export`` keeping torch's default (a stack per node) for the duration."""
    plain = torch_export._no_stack_traces
    torch_export._no_stack_traces = contextlib.nullcontext
    try:
        yield
    finally:
        torch_export._no_stack_traces = plain


def convert(make, args, options):
    torch.manual_seed(0)
    model = make()
    t = time.process_time()
    gm = autocastfx.convert(model, args, **options)
    return time.process_time() - t, gm.code


def main(rounds: int = 5) -> None:
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'model':<40} {'stacks (s)':>22} {'none (s)':>22} {'speed-up':>9}")
    for name, make, args, options in models():
        convert(make, args, options)
        times = {"stacks": [], "none": []}
        codes = set()
        for _ in range(rounds):
            with recorded():
                t, code = convert(make, args, options)
            times["stacks"].append(t)
            codes.add(code)
            t, code = convert(make, args, options)
            times["none"].append(t)
            codes.add(code)
        assert len(codes) == 1, f"{name}: the two recipes gave different programs"
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in times.values()]
        ratio = statistics.median(times["stacks"]) / statistics.median(times["none"])
        print(f"{name:<40} {cells[0]:>22} {cells[1]:>22} {ratio:>8.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
