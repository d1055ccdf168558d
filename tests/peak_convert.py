"""Run by tests/test_large_models.py in a fresh process: the peak resident memory convert() adds, as a multiple of
the model's float32 bytes, printed as JSON, a line per path: ``python peak_convert.py PATH [PATH ...]`` with each PATH
``hf``, ``traced`` or ``hf-bf16``. Several paths share the process's imports; before each, freed memory goes back to
the system, so each conversion's peak counts the memory it faults in itself."""
import ctypes
import gc
import json
import sys
import warnings

import torch

import autocastfx


def hf(vocab, d, layers):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
    return tf.LlamaForCausalLM(cfg), (torch.randint(0, vocab, (1, 8)),)


def traced(vocab, d, layers):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_hidden_copies import Stack  # identical blocks in a ModuleList, the model around them traced
    return Stack(layers=layers, d=d, vocab=vocab), (torch.randint(0, vocab, (1, 8)),)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _release_free_memory() -> None:
    """What the collector frees, and glibc's free heap pages handed back to the system: a conversion measured after
    another must fault its memory in anew, as in a fresh process, or its peak would read low."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: each path is then measured in a process of its own
        if len(sys.argv) > 2:
            raise SystemExit("peak_convert.py: one path per process where glibc's malloc_trim is missing")


def measure(path: str) -> dict:
    make = {"hf": hf, "traced": traced, "hf-bf16": hf}[path]
    torch.manual_seed(0)
    model, inputs = make(16000, 512, 2)
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    if path.endswith("bf16"):  # a bfloat16 checkpoint, as from_pretrained(..., torch_dtype=...) loads it
        model = model.to(torch.bfloat16)
    _release_free_memory()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) from here on
        f.write("5")
    gm = autocastfx.convert(model, inputs, dtype=torch.bfloat16)
    peak = _status("VmHWM")
    units = sum(1 for m in gm.modules() if isinstance(getattr(m, "meta", None), dict) and "autocastfx" in m.meta)
    return {"path": path, "fp32": fp32, "extra": (peak - before) / fp32, "units": units}


def main():
    warnings.simplefilter("ignore")
    paths = sys.argv[1:]
    for make in {hf if p.startswith("hf") else traced for p in paths}:  # imports and first-use caches
        autocastfx.convert(*make(128, 64, 2), dtype=torch.bfloat16)
    for path in paths:
        print(json.dumps(measure(path)), flush=True)


if __name__ == "__main__":
    main()
