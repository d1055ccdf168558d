"""Large models: conversion time and peak resident memory against model size.

    python bench/large.py [--quick]

Each row runs in a fresh process (peak resident size is per process: ``ru_maxrss``), on Llama-shaped Hugging Face
models (``transformers.LlamaForCausalLM``, random weights; nothing is downloaded):

- materialised float32: ``convert(model)``; the model's own bytes beside the peak;
- a bfloat16 checkpoint as ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads it: ``convert(model)``
  (its float32 parameters upcast from it, no float32 copy of the model first);
- on the meta device: build with ``torch.device("meta")`` and ``convert``; time and peak for Llama-3-8B and
  Llama-3-70B shapes, whose float32 weights (32 GB, 282 GB) this machine could not hold.

The baseline a user of torch.autocast has is the model itself (autocast converts nothing): its float32 bytes are
printed beside every row. Peak figures include the Python interpreter, torch and transformers (about 0.5 GB).
"""
import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    # name: (layers, hidden, intermediate, heads, kv heads, vocabulary)
    "125M": (12, 768, 2048, 12, 12, 32000),
    "1.1B": (22, 2048, 5632, 32, 4, 32000),  # TinyLlama-1.1B's shape
    "Llama-3-8B": (32, 4096, 14336, 32, 8, 128256),
    "Llama-3-70B": (80, 8192, 28672, 64, 8, 128256),
}


def child(name: str, how: str) -> dict:
    import resource
    import warnings

    import torch
    import transformers as tf

    import autocastfx

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    layers, hidden, inter, heads, kv, vocab = CONFIGS[name]
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                         use_cache=False)
    t = time.perf_counter()
    if how == "meta":
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(cfg)
    else:
        model = tf.LlamaForCausalLM(cfg)
        if how == "bf16":
            model = model.to(torch.bfloat16)
    build = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = torch.randint(0, vocab, (1, 16))
    t = time.perf_counter()
    gm = autocastfx.convert(model, (ids,), dtype=torch.bfloat16)
    took = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del model
    import gc
    gc.collect()
    units = sum(1 for m in gm.modules() if isinstance(getattr(m, "meta", None), dict) and "autocastfx" in m.meta)
    return {"model": name, "how": how, "params": params, "fp32_bytes": 4 * params, "build_s": build,
            "convert_s": took, "peak_before": base, "peak": peak, "units": units}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 125M rows and Llama-3-8B on meta only")
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    rows = [("125M", "fp32"), ("125M", "bf16"), ("125M", "meta"), ("Llama-3-8B", "meta")]
    if not a.quick:
        rows[3:3] = [("1.1B", "fp32"), ("1.1B", "bf16"), ("1.1B", "meta")]
        rows.append(("Llama-3-70B", "meta"))
    print(f"{'model':<12} {'weights':<6} {'params':>8} {'fp32 GB':>8} {'convert s':>9} {'peak GB':>8} "
          f"{'peak/fp32':>9} {'units':>5}")
    for name, how in rows:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, how],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{name:<12} {how:<6} failed: {out.stderr.strip().splitlines()[-1] if out.stderr else '?'}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gb = 1e9
        print(f"{name:<12} {how:<6} {r['params'] / 1e6:>7.0f}M {r['fp32_bytes'] / gb:>8.2f} {r['convert_s']:>9.1f} "
              f"{r['peak'] / gb:>8.2f} {r['peak'] / r['fp32_bytes']:>9.2f} {r['units']:>5}", flush=True)


if __name__ == "__main__":
    main()
