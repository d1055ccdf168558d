"""Train and eval behaviour of real models whose mode-dependent code once went wrong after conversion.

Each model is built the way it is trained (stochastic depth on), converted with the defaults, and checked:
  eval   deterministic over repeated calls, no random op at the aten level, and within the parity bound of the
         float32 model (relative error at most twice torch.autocast's on the same input, or under 2e-3);
  train  as many random draws (dropout, drop-path) per training forward as the model's own, at the aten level;
  modes  eval -> train -> eval without a training forward gives the same eval output, and batch-norm statistics
         change only in a training forward;
  policy every matmul and convolution runs on float16 operands (aten level);
  step   three steps of the training step give finite losses.

    python tests/realmodels/check_modes.py [names...]     # torchvision/timm need their own environment
    (docs/realmodels.md); Hugging Face models need transformers only.
"""
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autocastfx

RANDOM = {"bernoulli", "bernoulli_", "rand", "rand_like", "uniform_", "native_dropout", "randn", "randn_like"}
GEMMS = {"mm", "addmm", "bmm", "convolution", "baddbmm"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names, self.gemm_dtypes = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        self.names.append(name)
        if name in GEMMS:
            self.gemm_dtypes |= {a.dtype for a in args[:3] if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def image(size=224):
    return lambda: ((torch.randn(2, 3, size, size),), {})


def timm_model(name, **kw):
    def make():  # imported when the model is built: the table is made without timm installed
        import timm
        return timm.create_model(name, pretrained=False, **kw)
    return make


def tv_model(name):
    def make():  # imported when the model is built: the table is made without torchvision installed
        import torchvision
        return getattr(torchvision.models, name)()
    return make


def hf_swin():
    import transformers as tf
    cfg = tf.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        drop_path_rate=0.1, num_labels=10)
    return tf.SwinForImageClassification(cfg)


def hf_deberta():
    import transformers as tf
    cfg = tf.DebertaV2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64, num_labels=3, relative_attention=True,
                             position_buckets=16, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                             share_att_key=True, position_biased_input=False)
    return tf.DebertaV2ForSequenceClassification(cfg)


def tokens():
    ids = torch.randint(0, 128, (2, 12))
    return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


MODELS = {
    "vit_tiny_patch16_224": (timm_model("vit_tiny_patch16_224", drop_path_rate=0.1), image()),
    "deit_tiny_patch16_224": (timm_model("deit_tiny_patch16_224", drop_path_rate=0.1), image()),
    "convnext_atto": (timm_model("convnext_atto", drop_path_rate=0.1), image()),
    "nfnet_f0": (timm_model("nfnet_f0"), image(192)),
    "swin_t": (tv_model("swin_t"), image()),
    "hf_swin": (hf_swin, image(64)),
    "hf_deberta_v2": (hf_deberta, tokens),
}


def logits(out):
    return getattr(out, "logits", out)


def check(name):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    args, kwargs = inputs()
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, args, example_kwargs=kwargs or None)
    seconds = time.perf_counter() - t
    with torch.no_grad():
        ref = logits(model(*args, **kwargs))
        with torch.autocast("cpu", dtype=torch.float16):
            err_ac = rel(logits(model(*args, **kwargs)), ref)
        with Ops() as ops:
            outs = [logits(gm(*args, **kwargs)) for _ in range(3)]
        err = rel(outs[0], ref)
        eval_ok = (all(torch.equal(outs[0], o) for o in outs[1:]) and not RANDOM & set(ops.names)
                   and err <= max(2 * err_ac, 2e-3))
        policy_ok = ops.gemm_dtypes == {torch.float16}
        stats = {k: v.clone() for k, v in gm.named_buffers() if "running" in k}
        gm.train()
        gm.eval()  # a round trip without a training forward changes nothing
        modes_ok = torch.equal(logits(gm(*args, **kwargs)), outs[0]) and all(
            torch.equal(v, dict(gm.named_buffers())[k]) for k, v in stats.items())
        gm.train()
        model.train()
        # the same random sites: as many draws (dropout, drop-path) per training forward as the model makes.
        # (Outputs alone can hide them: ConvNeXt's layer scale starts at 1e-6, so a dropped path moves its
        # float32 logits by 1e-7, under float16's resolution.)
        with Ops() as ours:
            gm(*args, **kwargs)
        with Ops() as theirs:
            model(*args, **kwargs)
        draws = sum(n in RANDOM for n in ours.names), sum(n in RANDOM for n in theirs.names)
        train_ok = draws[0] == draws[1]
        if stats:  # statistics move in a training forward
            modes_ok &= any(not torch.equal(v, dict(gm.named_buffers())[k]) for k, v in stats.items())
    n_classes = ref.shape[-1]
    y = torch.randint(0, n_classes, (ref.shape[0],))
    step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(logits(out).float(), y),
                                 torch.optim.SGD(gm.parameters(), lr=1e-3, momentum=0.9))
    losses = [float(step(args if args else kwargs, y)) for _ in range(3)]
    step_ok = all(torch.isfinite(torch.tensor(losses)))
    ok = eval_ok and train_ok and modes_ok and policy_ok and step_ok
    print(f"| {name} | {gm.meta['autocastfx'].capture} | {seconds:.1f} | {err:.2e} | {err_ac:.2e} | "
          f"{'yes' if eval_ok else 'NO'} | {draws[0]} vs {draws[1]} | {'yes' if modes_ok else 'NO'} | "
          f"{'yes' if policy_ok else 'NO ' + str(ops.gemm_dtypes)} | {'yes' if step_ok else 'NO'} |", flush=True)
    return ok


def main(names):
    print("| model | capture | convert s | eval error | autocast error | eval ok | random draws (ours vs model) | modes | "
          "fp16 GEMMs | step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name in names:
        try:
            ok &= check(name)
        except ImportError as e:
            print(f"| {name} | skipped: {e} |")
        except Exception as e:  # noqa: BLE001 - one row per model, the run goes on
            print(f"| {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]} |")
            ok = False
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:] or list(MODELS)) else 1)
