"""Convert Hugging Face BERT, GPT-2 and Llama (built from small configs, no download) and compare outputs."""
import sys
import time
import warnings

import torch
import transformers as tf

import autocastfx


def build(name):
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64)
        return tf.BertModel(cfg)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)
        return tf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                             use_cache=False)
        return tf.LlamaForCausalLM(cfg)
    raise KeyError(name)


def main(names):
    torch.manual_seed(0)
    ok = True
    for name in names:
        m = build(name).eval()
        ids = torch.randint(0, 1000, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            gm = autocastfx.convert(m, (ids,), example_kwargs={"attention_mask": mask})
        dt = time.perf_counter() - t
        ref = m(ids, attention_mask=mask)
        out = gm(ids, attention_mask=mask)
        key = "logits" if hasattr(ref, "logits") else "last_hidden_state"
        a, b = ref[key], out[key]
        with torch.autocast("cpu", dtype=torch.float16):
            ac = m(ids, attention_mask=mask)[key].float()
        err = ((b.float() - a).norm() / a.norm()).item()
        err_ac = ((ac - a).norm() / a.norm()).item()
        rep = autocastfx.report(gm)
        print(f"{name}: captured by {rep.totals['capture']} in {dt:.1f}s, output {type(out).__name__} "
              f"(ref {type(ref).__name__}), rel err {err:.2e} (autocast {err_ac:.2e}), "
              f"casts {rep.totals['casts']} (naive {rep.totals['casts_naive']}), "
              f"unclassified {rep.totals['unclassified']}, warnings {[str(x.message)[:80] for x in w if 'autocastfx' in str(x.message)]}")
        ok &= type(out) is type(ref) and err < max(2 * err_ac, 1e-3) and not rep.totals["unclassified"]
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:] or ["bert", "gpt2", "llama"]) else 1)
