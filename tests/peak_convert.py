"""Run by tests/test_large_models.py in a fresh process: the peak resident memory convert() adds, as a multiple of
the model's float32 bytes, printed as JSON. ``python peak_convert.py hf|traced|hf-bf16``."""
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


def main():
    warnings.simplefilter("ignore")
    make = {"hf": hf, "traced": traced, "hf-bf16": hf}[sys.argv[1]]
    torch.manual_seed(0)
    autocastfx.convert(*make(128, 64, 2), dtype=torch.bfloat16)  # imports and first-use caches, not the model
    gc.collect()
    model, inputs = make(16000, 512, 2)
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    if sys.argv[1].endswith("bf16"):  # a bfloat16 checkpoint, as from_pretrained(..., torch_dtype=...) loads it
        model = model.to(torch.bfloat16)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) from here on
        f.write("5")
    gm = autocastfx.convert(model, inputs, dtype=torch.bfloat16)
    peak = _status("VmHWM")
    units = sum(1 for m in gm.modules() if isinstance(getattr(m, "meta", None), dict) and "autocastfx" in m.meta)
    print(json.dumps({"fp32": fp32, "extra": (peak - before) / fp32, "units": units}))


if __name__ == "__main__":
    main()
