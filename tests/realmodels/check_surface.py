"""The converted module is still your model: Hugging Face GPT-2 and the nanoGPT-style GPT of
examples/train_nanogpt.py, each converted with ``dtype=torch.bfloat16`` on both capture paths (``blocks="auto"``,
the default, and ``blocks=None``), checked in ``.train()`` and ``.eval()`` where the check applies:

  outputs     logits and loss within the float tolerance of the float32 model: relative error under 3x that of
              torch.autocast(bfloat16) on the same model and inputs, or under 1e-2 (train mode: the same seed
              before each call, so the three runs drop the same units);
  state dict  ``gm.state_dict()`` is the float32 model's right after
              conversion: the same keys (tied names too), every value ``torch.equal``;
  resume      3 steps of ``autocastfx.train_step``; ``torch.save`` of ``gm.state_dict()`` and ``step.state_dict()``;
              3 more steps; a model of another initialisation converted afresh, the checkpoint loaded into it
              (``gm.load_state_dict``, then ``step.load_state_dict``): its 3 steps' losses and its float32 weights
              after them are bit-identical to the uninterrupted run's;
  methods     nanoGPT: ``gm.generate`` (the training module, converted for ``(idx, targets)``: generate's call
              ``self(idx)`` is converted for on first use, on gm's weights), ``gm.get_num_params()``,
              ``gm.configure_optimizers(...)``; GPT-2: ``gm.config``, ``gm.generate`` (greedy, through the training
              module likewise), ``gm.save_pretrained`` read back
              by ``GPT2LMHeadModel.from_pretrained`` equal to gm's float32 weights bit for bit;
  assert      nanoGPT: a sequence longer than ``block_size`` raises the model's own AssertionError and message.

    python tests/realmodels/check_surface.py          # needs transformers; about a minute on 2 CPU cores
Exit status 0 only when every check passes.
"""
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

import autocastfx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_nanogpt import GPT, GPTConfig  # noqa: E402

DTYPE = torch.bfloat16
PATHS = ("auto", None)
RESULTS: list[bool] = []


def line(ok, model, blocks, mode, check, detail):
    RESULTS.append(bool(ok))
    where = f"{model} [blocks={blocks!s:4}]" + (f" {mode:5}" if mode else " " * 6)
    print(f"{'PASS' if ok else 'FAIL'}  {where}  {check}: {detail}", flush=True)


def note(model, blocks, detail):
    print(f"NOTE  {model} [blocks={blocks!s:4}]        {detail}", flush=True)


def guarded(model, blocks, mode, check):
    """Run a check; an exception is that check's failure, printed with where it came from."""
    def wrap(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one line per check, the run goes on
            tb = traceback.extract_tb(e.__traceback__)[-1]
            line(False, model, blocks, mode, check,
                 f"{type(e).__name__}: {str(e).splitlines()[0][:300]} (at {Path(tb.filename).name}:{tb.lineno})")
        return fn
    return wrap


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def parity(out, ref, ac):
    """(ok, text) for pairs (name, ours, float32, autocast)."""
    ok, parts = True, []
    for name, o, r, a in zip(("logits", "loss"), out, ref, ac):
        err, err_ac = rel(o, r), rel(a, r)
        bound = max(3 * err_ac, 1e-2)
        ok &= math.isfinite(err) and err < bound
        parts.append(f"{name} {err:.2e} (autocast {err_ac:.2e}, bound {bound:.1e})")
    return ok, ", ".join(parts)


def same_state(got, want):
    """(ok, text): same keys, each value torch.equal."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    differ = [k for k in want if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    ok = not missing and not extra and not differ
    text = f"{len(got)} keys vs {len(want)}, {len(want) - len(differ) - len(missing)} bit-equal"
    if missing or extra or differ:
        text += f"; missing {missing[:4]} extra {extra[:4]} differ {differ[:4]}"
    return ok, text


def check_state_dicts(name, blocks, gm, model, tied):
    want = model.state_dict()
    for mode in ("train", "eval"):
        getattr(gm, mode)()
        ok, t = same_state(gm.state_dict(), want)
        have_tied = all(k in gm.state_dict() for k in tied)
        line(ok and have_tied, name, blocks, mode, "state dict",
             f"gm.state_dict {t}; tied {' = '.join(tied)} {'present' if have_tied else 'MISSING'}")
    gm.train()


def resume(name, blocks, build, convert, make_opt, loss_fn, batches):
    """Three steps, a checkpoint, three more; a fresh conversion of a model of another initialisation resumes from
    the checkpoint: the same losses and float32 weights, bit for bit. Returns the uninterrupted run's module."""
    model = build(seed=0)
    gm = convert(model).train()
    opt = make_opt(gm)
    step = autocastfx.train_step(gm, loss_fn, opt)
    params_f32 = all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    first = [step(b) for b in batches[:3]]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt.pt"
        torch.save({"model": gm.state_dict(), "step": step.state_dict()}, path)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    went_on = [step(b) for b in batches[3:]]

    fresh = build(seed=1)
    gm2 = convert(fresh).train()
    missing = gm2.load_state_dict(ckpt["model"])
    loaded_ok, loaded = same_state(gm2.state_dict(), ckpt["model"])
    opt2 = make_opt(gm2)
    step2 = autocastfx.train_step(gm2, loss_fn, opt2)
    step2.load_state_dict(ckpt["step"])
    resumed = [step2(b) for b in batches[3:]]
    same_losses = all(torch.equal(a, b) for a, b in zip(went_on, resumed))
    after_ok, after = same_state(gm2.state_dict(), gm.state_dict())
    finite = all(torch.isfinite(x).item() for x in first + went_on)
    ok = params_f32 and loaded_ok and not missing.missing_keys and same_losses and after_ok and finite
    line(ok, name, blocks, "train", "resume",
         f"losses {' '.join(f'{float(x):.6f}' for x in first)} | saved | continued "
         f"{' '.join(f'{float(x):.6f}' for x in went_on)} | resumed {' '.join(f'{float(x):.6f}' for x in resumed)}: "
         f"{'bit-identical' if same_losses else 'DIFFER'}; checkpoint into the fresh conversion: {loaded}; "
         f"weights after: {'bit-identical' if after_ok else after}; optimizer on float32 parameters: {params_f32}")
    return gm, opt


# ---------------------------------------------------------------------------------------------------- nanoGPT
def nanogpt(blocks):
    name = "nanogpt"
    cfg = GPTConfig(block_size=64, vocab_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (4, 64), generator=g), torch.randint(0, 64, (4, 64), generator=g)

    def build(seed):
        torch.manual_seed(seed)
        return GPT(cfg)

    def convert(model, example=(x, y)):
        return autocastfx.convert(model, example, dtype=DTYPE, blocks=blocks)

    model = build(seed=0)
    t = time.perf_counter()
    gm = convert(model)
    note(name, blocks, f"converted from (idx, targets) in {time.perf_counter() - t:.1f} s")

    check_state_dicts(name, blocks, gm, model, ("wte.weight", "lm_head.weight"))

    for mode in ("train", "eval"):
        @guarded(name, blocks, mode, "outputs")
        def _():
            getattr(model, mode)()
            getattr(gm, mode)()
            with torch.no_grad():
                torch.manual_seed(5)
                ref = model(x, y)
                torch.manual_seed(5)
                with torch.autocast("cpu", dtype=DTYPE):
                    ac = model(x, y)
                torch.manual_seed(5)
                out = gm(x, y)
            ok, text = parity(out, ref, ac)
            line(ok, name, blocks, mode, "outputs", text)
    model.train()
    gm.train()

    @guarded(name, blocks, None, "get_num_params")
    def _():
        got = (gm.get_num_params(), gm.get_num_params(non_embedding=False))
        want = (model.get_num_params(), model.get_num_params(non_embedding=False))
        line(got == want, name, blocks, None, "get_num_params", f"{got} (model {want})")

    @guarded(name, blocks, None, "configure_optimizers")
    def _():
        def shape(opt):
            return [(sum(p.numel() for p in grp["params"]), len(grp["params"]), grp["weight_decay"], grp["lr"],
                     grp["betas"]) for grp in opt.param_groups]
        got = shape(gm.configure_optimizers(0.1, 1e-3, (0.9, 0.95)))
        want = shape(model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)))
        line(got == want, name, blocks, None, "configure_optimizers",
             f"groups (numel, tensors, decay, lr, betas) {got}" + ("" if got == want else f" (model {want})"))

    batches = [tuple(torch.randint(0, 64, (4, 64), generator=g) for _ in range(2)) for _ in range(6)]

    @guarded(name, blocks, "train", "resume")
    def _():
        resume(name, blocks, build, convert, lambda m: m.configure_optimizers(0.1, 1e-3, (0.9, 0.95)),
               lambda out: out[1], batches)

    made = {}

    @guarded(name, blocks, "eval", "generate")
    def _():
        # the training module itself (converted for (idx, targets)): generate() calls self(idx), a call of another
        # structure, which gm converts for on first use, on its own weights
        sampler = made["sampler"] = gm.eval()
        model.eval()
        start = x[:2, :8]
        torch.manual_seed(7)
        out = sampler.generate(start, max_new_tokens=5)
        torch.manual_seed(7)
        by_hand = start
        with torch.no_grad():  # generate()'s loop, through the converted forward
            for _ in range(5):
                logits, _ = sampler(by_hand[:, -cfg.block_size:])
                nxt = torch.multinomial(torch.softmax(logits[:, -1, :], dim=-1), num_samples=1)
                by_hand = torch.cat((by_hand, nxt), dim=1)
        torch.manual_seed(7)
        theirs = model.generate(start, max_new_tokens=5)
        model.train()
        gm.train()
        ok = out.shape == (2, 13) and torch.equal(out[:, :8], start) and torch.equal(out, by_hand)
        agree = int((out[:, 8:] == theirs[:, 8:]).sum())
        line(ok, name, blocks, "eval", "generate",
             f"shape {tuple(out.shape)}, prompt kept, tokens {out[:, 8:].tolist()} = the converted forward's own "
             f"sampling loop: {torch.equal(out, by_hand)}; float32 model's generate, same seed: {agree} of 10 "
             f"tokens the same")

    for mode in ("train", "eval"):
        @guarded(name, blocks, mode, "assert")
        def _():
            long = torch.randint(0, 64, (2, 65))
            calls = [("(idx, targets)", gm, (long, long))]
            if "sampler" in made:
                calls.append(("(idx,)", made["sampler"], (long,)))
            msgs = []
            for who, module, args in calls:
                getattr(module, mode)()
                try:
                    module(*args)
                    msgs.append(f"{who}: no error")
                except AssertionError as e:
                    msgs.append(f"{who}: AssertionError({str(e)!r})")
                except Exception as e:  # noqa: BLE001
                    msgs.append(f"{who}: {type(e).__name__}({str(e).splitlines()[0][:120]!r})")
            want = "AssertionError('sequence of 65 tokens, block size 64')"
            line(all(m.endswith(want) for m in msgs), name, blocks, mode, "assert", "; ".join(msgs))
    gm.train()

    @guarded(name, blocks, None, "targets module refuses gm(idx)")
    def _():
        try:
            gm(x)
            note(name, blocks, "gm(idx) on the module converted from (idx, targets) ran")
        except TypeError as e:
            note(name, blocks, f"gm(idx) on the module converted from (idx, targets): TypeError, as documented "
                               f"({str(e)[:90]}...)")


# ---------------------------------------------------------------------------------------------------- GPT-2
def gpt2(blocks):
    import transformers as tf
    name = "gpt2"
    cfg = tf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 16), generator=g)

    def build(seed):
        torch.manual_seed(seed)
        return tf.GPT2LMHeadModel(cfg).train()

    def convert(model, kwargs=None):
        return autocastfx.convert(model, example_kwargs=kwargs or {"input_ids": ids, "labels": ids}, dtype=DTYPE,
                                  blocks=blocks)

    model = build(seed=0)
    t = time.perf_counter()
    gm = convert(model)
    note(name, blocks, f"converted from input_ids and labels in {time.perf_counter() - t:.1f} s")

    check_state_dicts(name, blocks, gm, model, ("transformer.wte.weight", "lm_head.weight"))

    for mode in ("train", "eval"):
        @guarded(name, blocks, mode, "outputs")
        def _():
            getattr(model, mode)()
            getattr(gm, mode)()
            with torch.no_grad():
                torch.manual_seed(5)
                ref = model(input_ids=ids, labels=ids)
                torch.manual_seed(5)
                with torch.autocast("cpu", dtype=DTYPE):
                    ac = model(input_ids=ids, labels=ids)
                torch.manual_seed(5)
                out = gm(input_ids=ids, labels=ids)
            ok, text = parity((out.logits, out.loss), (ref.logits, ref.loss), (ac.logits, ac.loss))
            ok &= type(out) is type(ref)
            line(ok, name, blocks, mode, "outputs", f"{type(out).__name__}, {text}")
    model.train()
    gm.train()

    @guarded(name, blocks, None, "config")
    def _():
        same = gm.config.to_dict() == model.config.to_dict()
        line(same and gm.config.use_cache is False, name, blocks, None, "config",
             f"gm.config equals the model's: {same} (the same object: {gm.config is model.config}); "
             f"n_embd {gm.config.n_embd}, n_layer {gm.config.n_layer}")

    batches = []
    for _ in range(6):
        b = torch.randint(0, 1000, (2, 16), generator=g)
        batches.append({"input_ids": b, "labels": b})
    trained = {}

    @guarded(name, blocks, "train", "resume")
    def _():
        trained["gm"], _ = resume(name, blocks, build, convert, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                                  lambda out: out.loss, batches)

    @guarded(name, blocks, None, "save_pretrained")
    def _():
        src = trained.get("gm", gm)  # after training: the float32 weights differ from every bfloat16 value
        weights = {k: v.clone() for k, v in src.state_dict().items()}
        with tempfile.TemporaryDirectory() as d:
            src.save_pretrained(d)
            loaded = tf.GPT2LMHeadModel.from_pretrained(d)
        ok, text = same_state(loaded.state_dict(), weights)
        line(ok, name, blocks, None, "save_pretrained",
             f"from_pretrained vs float32 weights{' after 6 steps' if 'gm' in trained else ''}: {text}")

    @guarded(name, blocks, "eval", "generate")
    def _():
        model.eval()
        # the training module itself (converted for input_ids and labels): generate's call (input_ids,
        # use_cache=False, return_dict=True, ...) is converted for on first use, on gm's own weights
        gen = gm.eval()
        out = gen.generate(ids, max_new_tokens=5, do_sample=False)
        by_hand = ids
        with torch.no_grad():
            for _ in range(5):
                logits = gen(input_ids=by_hand, use_cache=False, return_dict=True).logits
                by_hand = torch.cat((by_hand, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        theirs = model.generate(ids, max_new_tokens=5, do_sample=False)
        ok = out.shape == (2, 21) and torch.equal(out[:, :16], ids) and torch.equal(out, by_hand)
        agree = int((out[:, 16:] == theirs[:, 16:]).sum())
        line(ok, name, blocks, "eval", "generate",
             f"shape {tuple(out.shape)}, prompt kept, greedy tokens {out[:, 16:].tolist()} = the converted "
             f"forward's argmax loop: {torch.equal(out, by_hand)}; float32 model's generate: {agree} of 10 the same")
        model.train()
        gm.train()


def main():
    warnings.filterwarnings("ignore")
    try:
        import transformers as tf
        tf.logging.set_verbosity_error()
        tf.utils.logging.disable_progress_bar()
        have_hf = True
    except ImportError:
        have_hf = False
        print("transformers missing: GPT-2 skipped")
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, transformers {tf.__version__ if have_hf else '-'}, dtype bfloat16")
    for blocks in PATHS:
        for fn in ([nanogpt, gpt2] if have_hf else [nanogpt]):
            try:
                fn(blocks)
            except Exception as e:  # noqa: BLE001 - a failure outside a check (conversion) is a failure too
                tb = traceback.extract_tb(e.__traceback__)[-1]
                line(False, fn.__name__, blocks, None, "run",
                     f"{type(e).__name__}: {str(e).splitlines()[0][:300]} (at {Path(tb.filename).name}:{tb.lineno})")
    passed = sum(RESULTS)
    print(f"surface: {passed} of {len(RESULTS)} checks pass ({'nanogpt and gpt2' if have_hf else 'nanogpt'}, "
          f"blocks auto and None, {time.perf_counter() - t0:.0f} s)")
    return bool(RESULTS) and all(RESULTS)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
