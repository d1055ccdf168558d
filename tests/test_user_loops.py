"""Training loops as users write them, changed only by the line that converts the model.

Each loop below is a known public recipe (nanoGPT's train.py, timm's train.py with NativeScaler and an EMA,
pytorch/examples' word language model, Hugging Face accelerate, Lightning's automatic optimization, a
``torch.compile`` loop). Each is run three ways on the same initial weights and the same data:

* on ``autocastfx.convert(model, ..., dtype=torch.bfloat16)`` (the converted module);
* on an unconverted copy under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (what the user had before);
* on an unconverted copy in float32.

Two things are asserted for each loop:

(a) the checkpoint is the trained model: ``gm.state_dict()``, saved and loaded into a fresh instance of the
    unconverted class, gives float32 outputs that match the converted module's within bfloat16's tolerance, and
    much closer than the untrained model's outputs do;
(b) the losses follow the autocast run within a tolerance ``tol``; the same ``tol`` holds autocast against
    float32 (so ``tol`` is bfloat16's own footprint on that loop, not a looser band), and the losses move by many
    times ``tol`` over the run (so a loop that left the converted module untrained, or trained tensors other
    than the ones its forward reads, falls outside it).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import one_thread_quiet

BF16 = torch.bfloat16


def same_model(factory):
    """The state of one fresh ``factory()``, and a function that builds the model again with exactly that state:
    the converted run and each reference run start from the same weights."""
    init = factory().state_dict()

    def make():
        m = factory()
        m.load_state_dict(init)
        return m
    return init, make


@pytest.fixture(autouse=True)
def _one_thread_quiet():
    with one_thread_quiet():
        yield


# ---------------------------------------------------------------------------------------------------------------
# shared checks


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def assert_checkpoint_is_the_trained_model(gm, make_model, init_state, inputs, state=None, rel=2e-2):
    """(a): the float32 weights saved from ``gm`` (or ``state``, a state dict saved the user's way) reproduce gm's
    outputs in a fresh unconverted model, within bfloat16's tolerance, and far closer than the untrained model."""
    buf = io.BytesIO()
    torch.save(gm.state_dict() if state is None else state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    floats = {k: v for k, v in loaded.items() if v.is_floating_point()}
    assert floats and all(v.dtype == torch.float32 for v in floats.values()), {k: v.dtype for k, v in floats.items()}
    fresh, untrained = make_model(), make_model()
    fresh.load_state_dict(loaded)
    untrained.load_state_dict(init_state)
    was_training = gm.training
    for m in (gm, fresh, untrained):
        m.eval()
    try:
        with torch.no_grad():
            out = _first(gm(*inputs))
            want = _first(fresh(*inputs))
            before = _first(untrained(*inputs))
    finally:
        gm.train(was_training)
    assert out.dtype == want.dtype == torch.float32
    scale = want.abs().max()
    err = float((out - want).abs().max() / scale)
    untrained_err = float((out - before).abs().max() / scale)
    assert err <= rel, f"the checkpoint's float32 model is {err:.3g} away from gm (relative)"
    assert untrained_err >= 10 * err and untrained_err > 5 * rel, (err, untrained_err)
    return err, untrained_err


def assert_losses_track_autocast(losses, autocast_losses, float32_losses, tol):
    """(b): the converted module's losses within ``tol`` of the autocast run's; autocast within ``tol`` of float32
    (``tol`` is the size of bfloat16's effect on the loop); the losses fall by at least 20 ``tol``."""
    got, ac, f32 = (torch.tensor(v, dtype=torch.float64) for v in (losses, autocast_losses, float32_losses))
    assert got.shape == ac.shape == f32.shape and len(got) >= 3
    assert torch.isfinite(got).all()
    bf16_effect = float((ac - f32).abs().max())
    diff = float((got - ac).abs().max())
    assert bf16_effect <= tol, f"autocast against float32: {bf16_effect:.3g} > tol {tol}"
    assert diff <= tol, f"converted against autocast: {diff:.3g} > tol {tol}\n{got.tolist()}\n{ac.tolist()}"
    fall = float(f32[0] - f32[1:].min())
    assert fall >= 20 * tol, f"training moves the loss too little for tol {tol}: {f32.tolist()}"
    return diff, bf16_effect


def _autocast(enabled):
    return torch.autocast("cpu", dtype=BF16, enabled=enabled)


# ---------------------------------------------------------------------------------------------------------------
# nanoGPT


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's model at toy size: token and position embeddings, 2 pre-norm blocks, a final LayerNorm and an lm
    head tied to the token embedding; weights initialised as nanoGPT does (normal, std 0.02)."""
    vocab, block_size, d, heads = 32, 16, 16, 2

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(self.vocab, self.d)
        self.wpe = nn.Embedding(self.block_size, self.d)
        self.h = nn.ModuleList([GPTBlock(self.d, self.heads) for _ in range(2)])
        self.ln_f = nn.LayerNorm(self.d)
        self.lm_head = nn.Linear(self.d, self.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def configure_optimizers(named_parameters, weight_decay=0.1, lr=1e-2):
    """nanoGPT's: weight decay on every parameter of 2 or more dimensions (matmul weights, embeddings), none on
    biases and LayerNorm weights."""
    param_dict = {pn: p for pn, p in named_parameters if p.requires_grad}
    decay = [p for p in param_dict.values() if p.dim() >= 2]
    nodecay = [p for p in param_dict.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def get_batch(micro_index, batch=4):
    """A learnable stream: each row counts up by one from a random start (mod the vocabulary); the target is the
    next token. Fixed by the micro-batch's global index, so a resumed run sees the data the original would."""
    g = torch.Generator().manual_seed(1000 + micro_index)
    start = torch.randint(0, TinyGPT.vocab, (batch, 1), generator=g)
    seq = (start + torch.arange(TinyGPT.block_size + 1)) % TinyGPT.vocab
    return seq[:, :-1], seq[:, 1:]


GPT_EXAMPLE = (torch.zeros(4, TinyGPT.block_size, dtype=torch.long),)


def nanogpt_train(model, optimizer, scaler, first_iter, iters, amp=True, accum=2):
    """nanoGPT's training loop body: gradient accumulation, a GradScaler, clipping after unscale_, and the loss
    logged as ``loss.item() * gradient_accumulation_steps``."""
    ctx = _autocast(amp)
    losses = []
    for it in range(first_iter, first_iter + iters):
        for micro_step in range(accum):
            X, Y = get_batch(it * accum + micro_step)
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.reshape(-1), ignore_index=-1)
                loss = loss / accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * accum)
    return losses


def _gpt_init():
    torch.manual_seed(0)
    return TinyGPT().state_dict()


def _gpt(state):
    model = TinyGPT()
    model.load_state_dict(state)
    return model


def test_nanogpt_loop_trains_the_checkpointed_weights():
    """nanoGPT's loop (AdamW groups split by ``p.dim() >= 2`` over ``gm.named_parameters()``, accumulation of 2,
    an enabled GradScaler, ``clip_grad_norm_`` on ``gm.parameters()``, ``zero_grad(set_to_none=True)``) on the
    converted tiny GPT, still inside the loop's own ``torch.autocast``: the losses are the autocast run's, and
    the saved ``gm.state_dict()`` is the trained float32 model (tied head included). If the optimizer trained
    low-precision copies, the checkpoint would hold the untrained weights."""
    init = _gpt_init()

    def run(convert, amp):
        model = _gpt(init)
        if convert:
            model = autocastfx.convert(model, GPT_EXAMPLE, dtype=BF16)
        opt = configure_optimizers(model.named_parameters())
        scaler = torch.amp.GradScaler("cpu", enabled=True)
        return model, opt, nanogpt_train(model, opt, scaler, 0, 5, amp=amp)

    gm, opt, losses = run(True, True)
    _, _, ac = run(False, True)
    _, _, f32 = run(False, False)
    # measured: converted == autocast to the last bit, autocast vs float32 1.6e-3, the loss falls by 0.41
    assert_losses_track_autocast(losses, ac, f32, tol=0.01)
    x, _ = get_batch(999)
    assert_checkpoint_is_the_trained_model(gm, TinyGPT, init, (x,))
    # the groups hold gm's float32 parameters: 2-D weights (the tied embedding once) decayed, the rest not
    decay, nodecay = (g["params"] for g in opt.param_groups)
    assert len(decay) + len(nodecay) == len(list(gm.parameters())) == len(list(_gpt(init).parameters()))
    assert all(p.dtype == torch.float32 for p in decay + nodecay)
    wte = gm.get_parameter("wte.weight")
    assert any(p is wte for p in decay)
    state = gm.state_dict()
    assert torch.equal(state["lm_head.weight"], state["wte.weight"]) and state["wte.weight"].dtype == torch.float32


def test_nanogpt_checkpoint_resume_continues_the_run():
    """nanoGPT's checkpoint and resume: ``{"model": gm.state_dict(), "optimizer": opt.state_dict()}`` saved after
    2 iterations; a fresh TinyGPT loads the model's state, is converted again, and a new optimizer built the same
    way loads the optimizer's state; 2 more iterations give the losses and weights that continuing the original
    run gives (both are the same deterministic CPU computation)."""
    init = _gpt_init()
    gm = autocastfx.convert(_gpt(init), GPT_EXAMPLE, dtype=BF16)
    opt = configure_optimizers(gm.named_parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    first = nanogpt_train(gm, opt, scaler, 0, 2)
    buf = io.BytesIO()
    torch.save({"model": gm.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                "iter_num": 2}, buf)
    cont = nanogpt_train(gm, opt, scaler, 2, 2)

    buf.seek(0)
    checkpoint = torch.load(buf)
    model = TinyGPT()
    model.load_state_dict(checkpoint["model"])
    gm2 = autocastfx.convert(model, GPT_EXAMPLE, dtype=BF16)
    opt2 = configure_optimizers(gm2.named_parameters())
    opt2.load_state_dict(checkpoint["optimizer"])
    scaler2 = torch.amp.GradScaler("cpu", enabled=True)
    scaler2.load_state_dict(checkpoint["scaler"])
    resumed = nanogpt_train(gm2, opt2, scaler2, checkpoint["iter_num"], 2)

    assert resumed == pytest.approx(cont, rel=1e-6, abs=1e-6)
    assert first[0] - cont[-1] > 0.1  # the run trains: resuming from untrained weights would not match
    for (name, a), (_, b) in zip(gm.state_dict().items(), gm2.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(gm.state_dict()["wte.weight"], init["wte.weight"])


# ---------------------------------------------------------------------------------------------------------------
# timm


class NativeScaler:
    """timm.utils.NativeScaler: backward of the scaled loss, then (on an update) unscale, clip, step, update."""
    state_dict_key = "amp_scaler"

    def __init__(self, device="cpu"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class TinyConvNet(nn.Module):
    """A timm-like classifier at toy size: conv stem with BatchNorm, a stride-2 conv block, pooling, a head."""

    def __init__(self, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                   nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def _image_batches(n, batch=8, seed=3):
    """Images whose class is which colour channel has the brightest mean: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        y = torch.randint(0, 3, (batch,), generator=g)
        x = torch.randn(batch, 3, 8, 8, generator=g) * 0.5
        x[torch.arange(batch), y] += 1.0
        out.append((x, y))
    return out


def test_timm_loop_with_native_scaler_and_model_ema():
    """timm's train_one_epoch: forward and loss under ``amp_autocast``, ``optimizer.zero_grad()``, the
    NativeScaler (scaled backward, unscale, clip at 1.0, step, update) and ``AveragedModel(gm, multi_avg_fn=
    get_ema_multi_avg_fn(0.9))`` updated after every step. The EMA copy's parameters are float32 and equal an
    EMA computed by hand from gm's float32 parameters after each step; the EMA copy runs as a converted module
    of its own weights (not gm's); and (a), (b) as for every loop."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    init, make = same_model(TinyConvNet)
    data = _image_batches(6)
    decay = 0.9

    def run(convert, amp, track_ema=False):
        model = make()
        if convert:
            model = autocastfx.convert(model, (data[0][0],), dtype=BF16)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        loss_scaler = NativeScaler("cpu")
        model_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay)) if track_ema else None
        hand = None
        losses = []
        for x, y in data:
            with _autocast(amp):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss_scaler(loss, opt, clip_grad=1.0, parameters=model.parameters())
            losses.append(loss.item())
            if model_ema is not None:
                model_ema.update_parameters(model)
                now = {n: p.detach().clone() for n, p in model.named_parameters()}
                hand = now if hand is None else {n: torch.lerp(hand[n], now[n], 1 - decay) for n in now}
                ema_params = dict(model_ema.module.named_parameters())
                assert ema_params.keys() == hand.keys()
                for n, v in hand.items():
                    assert ema_params[n].dtype == torch.float32
                    torch.testing.assert_close(ema_params[n], v, rtol=1e-6, atol=1e-7, msg=n)
        return model, model_ema, losses

    gm, ema, losses = run(True, True, track_ema=True)
    _, _, ac = run(False, True)
    _, _, f32 = run(False, False)
    # measured: converted == autocast to the last bit, autocast vs float32 7e-4, the loss falls by 0.9
    assert_losses_track_autocast(losses, ac, f32, tol=0.01)

    x = data[0][0]
    assert_checkpoint_is_the_trained_model(gm, make, init, (x,))
    gm_params = {id(p) for p in gm.parameters()}
    assert not any(id(p) in gm_params for p in ema.parameters())
    # the EMA copy is a converted module of its own averaged weights: timm saves it as state_dict_ema
    ema_state = ema.module.state_dict()
    assert_checkpoint_is_the_trained_model(ema.module, make, init, (x,), state=ema_state)
    gm.eval()
    ema.eval()
    with torch.no_grad():
        assert not torch.allclose(ema(x), gm(x), rtol=1e-2, atol=1e-2)  # the EMA lags the trained weights


# ---------------------------------------------------------------------------------------------------------------
# pytorch/examples word_language_model


class RNNModel(nn.Module):
    """word_language_model's RNNModel (its GRU flavour: a CPU autocast of the LSTM flavour needs oneDNN's bfloat16
    LSTM, which this kind of CPU lacks) at toy size: encoder, 2-layer GRU, decoder, log-softmax."""
    ntoken, ninp, nhid, nlayers = 24, 16, 16, 2

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(self.ntoken, self.ninp)
        self.rnn = nn.GRU(self.ninp, self.nhid, self.nlayers)
        self.decoder = nn.Linear(self.nhid, self.ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


BPTT, LM_BATCH = 8, 4


def _lm_data():
    """batchify()'d corpus: a repeating pattern, so the model can learn it in a few updates."""
    g = torch.Generator().manual_seed(5)
    pattern = torch.randint(0, RNNModel.ntoken, (12,), generator=g)
    corpus = pattern.repeat(30)[: LM_BATCH * (BPTT * 8 + 1)]
    return corpus.view(LM_BATCH, -1).t().contiguous()


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def word_lm_train(model, data, lr, optimizer=None, amp=False, clip=0.25):
    """word_language_model's train(): zero_grad, repackaged hidden state, NLL loss, clip_grad_norm_, then the
    manual SGD update ``p.data.add_(p.grad, alpha=-lr)`` (or the optimizer's step, when one is given)."""
    model.train()
    criterion = nn.NLLLoss()
    hidden = model.init_hidden(LM_BATCH)
    losses = []
    for i in range(0, data.size(0) - 1, BPTT):
        seq_len = min(BPTT, len(data) - 1 - i)
        x, targets = data[i:i + seq_len], data[i + 1:i + 1 + seq_len].reshape(-1)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        with _autocast(amp):
            output, hidden = model(x, hidden)
            loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if optimizer is None:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        else:
            optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("update", ["p.data.add_", "optimizer built before convert"])
def test_word_language_model_manual_sgd(update):
    """pytorch/examples' word language model: a float32 loop with no autocast, whose update is either the
    example's own ``p.data.add_(p.grad, alpha=-lr)`` over ``gm.parameters()``, or ``opt.step()`` of an SGD built
    over ``model.parameters()`` BEFORE the conversion (the parameters are shared, so it trains gm rather than
    silently training tensors gm never reads). Reference: the same loop under autocast on the unconverted model."""
    torch.manual_seed(0)
    init, make = same_model(RNNModel)
    data = _lm_data()
    lr = 5.0

    def run(convert, amp):
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=lr) if update != "p.data.add_" else None
        if convert:
            model = autocastfx.convert(model, (data[:BPTT], model.init_hidden(LM_BATCH)), dtype=BF16)
        return model, word_lm_train(model, data, lr, optimizer=opt, amp=amp)

    gm, losses = run(True, False)
    _, ac = run(False, True)
    _, f32 = run(False, False)
    # measured: converted vs autocast 5.6e-3 (the two round the recurrent layer's steps differently), autocast
    # vs float32 3.5e-3, the loss falls by 0.73
    assert_losses_track_autocast(losses, ac, f32, tol=0.02)
    x = data[:BPTT]
    hidden = RNNModel().init_hidden(LM_BATCH)
    assert_checkpoint_is_the_trained_model(gm, make, init, (x, hidden))


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face accelerate


def _mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _mlp_data(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4] * torch.tensor([2.0, -1.0, 1.5, -0.5])).argmax(1)  # learnable labels
    return torch.utils.data.TensorDataset(x, y)


def test_accelerate_loop():
    """Hugging Face accelerate's loop on the CPU: ``Accelerator(cpu=True, mixed_precision=...)``,
    ``prepare(model, optimizer, dataloader)``, ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``,
    ``opt.step()``; the checkpoint is ``unwrap_model(model).state_dict()`` saved with ``accelerator.save``.
    With ``mixed_precision="bf16"`` (which accelerate supports on the CPU) accelerate wraps the converted module's
    forward in a CPU autocast, which runs inside its program (a warning says so): this MLP's plan has every matmul
    in bfloat16 already, so the losses are those of the default "no". Compared with the same loop on the unconverted
    model under "bf16" (the autocast run) and "no" (float32)."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    init, make = same_model(_mlp)

    def run(convert, mixed_precision):
        model = make()
        if convert:
            model = autocastfx.convert(model, (torch.randn(8, 8),), dtype=BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        dl = DataLoader(_mlp_data(), batch_size=8, shuffle=False)
        AcceleratorState._reset_state(True)  # another test's Trainer may have set the process's state
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
        try:
            model, opt, dl = accelerator.prepare(model, opt, dl)
            losses = []
            for _ in range(2):
                for x, y in dl:
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                    accelerator.backward(loss)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            unwrapped = accelerator.unwrap_model(model)
            buf = io.BytesIO()
            accelerator.save(unwrapped.state_dict(), buf)
            buf.seek(0)
            return unwrapped, torch.load(buf), losses
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()

    gm, saved, losses = run(True, "bf16")
    _, _, losses_no_amp = run(True, "no")
    _, _, ac = run(False, "bf16")
    _, _, f32 = run(False, "no")
    assert isinstance(gm, torch.fx.GraphModule)
    assert losses_no_amp == pytest.approx(losses, rel=1e-6, abs=1e-6)  # accelerate's autocast does not reach inside
    # measured: converted vs autocast 1.5e-3, autocast vs float32 1.0e-3, the loss falls by 1.0
    assert_losses_track_autocast(losses, ac, f32, tol=0.01)
    assert_checkpoint_is_the_trained_model(gm, make, init, (torch.randn(16, 8),), state=saved)


class _FunctionalDropout(nn.Module):
    """Its dropout's mode is a value in the graph (``F.dropout(training=self.training)``): each mode a program."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.b(F.dropout(F.gelu(self.a(x)), 0.5, training=self.training))


def _wrap_forward_as_accelerate_does(gm):
    """``gm.forward = MethodType(torch.autocast(...)(gm.forward.__func__), gm)``, as accelerate's mixed precision
    sets it on the instance."""
    import types
    gm.forward = types.MethodType(torch.autocast("cpu", dtype=BF16)(gm.forward.__func__), gm)
    return gm


@pytest.mark.parametrize("wrap", ["accelerate bf16", "wrapped forward"])
@pytest.mark.parametrize("first", ["train", "eval"])
def test_a_forward_wrapped_on_the_instance_follows_train_and_eval(wrap, first):
    """A wrapper that took ``gm.forward.__func__`` and set itself on the instance (accelerate's
    ``mixed_precision="bf16"`` does, in ``prepare``) runs the program of the mode ``gm`` is in after each
    ``train()``/``eval()``, not the one it was in when wrapped: evaluation is deterministic and training drops out,
    each as the float32 model does in that mode with the same seed (measured: 2.6e-3 apart in both). The autocast
    such a wrapper enables runs inside the converted program and recasts its plan: the first call says so, once."""
    torch.manual_seed(0)
    model, x = _FunctionalDropout(), torch.randn(8, 16)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    gm.train(first == "train")
    if wrap == "accelerate bf16":
        pytest.importorskip("accelerate")
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        try:
            run = Accelerator(cpu=True, mixed_precision="bf16").prepare(gm)
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    else:
        run = _wrap_forward_as_accelerate_does(gm)
    assert "forward" in gm.__dict__
    ref = _FunctionalDropout()
    ref.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            run(x)
            run(x)
    said = [w for w in caught if "wrapped in torch.autocast" in str(w.message)]
    assert len(said) == 1 and "mixed_precision='no'" in str(said[0].message), [str(w.message) for w in caught]
    for mode in (first != "train", first == "train", first != "train"):
        run.train(mode)
        ref.train(mode)
        outs = []
        with torch.no_grad():
            for seed in (0, 1):
                torch.manual_seed(seed)
                outs.append(run(x).float())
            torch.manual_seed(0)
            expected = ref(x)
        assert torch.equal(outs[0], outs[1]) is (not mode), mode  # eval deterministic, training drops out
        assert (outs[0] - expected).abs().max() < 2e-2, (mode, (outs[0] - expected).abs().max())


# ---------------------------------------------------------------------------------------------------------------
# Lightning


def test_lightning_automatic_optimization_without_a_plugin(tmp_path):
    """A LightningModule that converts its network in ``__init__`` and trains it with Lightning's automatic
    optimization (AdamW over ``self.parameters()``, ``gradient_clip_val=1.0``), no autocastfx plugin, under
    ``precision="bf16-mixed"`` (Lightning's CPU autocast around training_step). Against the same module without the
    convert line (bf16-mixed: the autocast run; "32-true": float32). ``trainer.save_checkpoint`` writes the
    trained float32 network: its state dict, the ``net.`` prefix removed, loads into a fresh unconverted net."""
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    init, make = same_model(_mlp)

    class Lit(L.LightningModule):
        def __init__(self, convert):
            super().__init__()
            net = make()
            self.net = autocastfx.convert(net, (torch.randn(8, 8),), dtype=BF16) if convert else net
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-2)

    def run(convert, precision):
        lit = Lit(convert)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, precision=precision,
                            gradient_clip_val=1.0, enable_checkpointing=False, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path))
        trainer.fit(lit, DataLoader(_mlp_data(), batch_size=8, shuffle=False))
        return lit, trainer

    lit, trainer = run(True, "bf16-mixed")
    ac, _ = run(False, "bf16-mixed")
    f32, _ = run(False, "32-true")
    assert isinstance(lit.net, torch.fx.GraphModule)
    # measured: converted vs autocast 1.5e-3, autocast vs float32 1.0e-3, the loss falls by 0.45
    assert_losses_track_autocast(lit.losses, ac.losses, f32.losses, tol=0.01)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    state = {k.removeprefix("net."): v for k, v in ckpt["state_dict"].items()}
    assert_checkpoint_is_the_trained_model(lit.net, make, init, (torch.randn(16, 8),), state=state)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_inside_the_loop():
    """A plain loop over ``torch.compile(gm, backend="aot_eager")`` (Dynamo and AOTAutograd without code
    generation: fast on this CPU): forward, ``loss.backward()``, ``opt.step()`` of an AdamW over
    ``gm.parameters()``. Compiling captures the weights as the float32 parameters the optimizer updates, so each
    step sees the last one's update. Against the same compiled loop on the unconverted model under autocast,
    and in float32."""
    torch.manual_seed(0)
    init, make = same_model(_mlp)
    ds = _mlp_data()
    batches = [(ds.tensors[0][i:i + 8], ds.tensors[1][i:i + 8]) for i in range(0, 48, 8)]

    def run(convert, amp):
        torch._dynamo.reset()
        model = make()
        if convert:
            model = autocastfx.convert(model, (batches[0][0],), dtype=BF16)
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        losses = []
        for x, y in batches:
            with _autocast(amp):
                loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return model, losses

    try:
        gm, losses = run(True, False)
        _, ac = run(False, True)
        _, f32 = run(False, False)
    finally:
        torch._dynamo.reset()
    # measured: converted vs autocast 2.1e-3, autocast vs float32 7.8e-4, the loss falls by 0.45
    assert_losses_track_autocast(losses, ac, f32, tol=0.01)
    assert_checkpoint_is_the_trained_model(gm, make, init, (torch.randn(16, 8),))


# ---------------------------------------------------------------------------------------------------------------
# a loop that finds the model's modules by class (detectron2-style frozen batch norms, a freeze by layer type)

class _FrozenBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(self.bn(self.stem(x)).relu()).mean((2, 3)))


class _FrozenBNExportOnly(_FrozenBNNet):
    def forward(self, x):
        assert x.shape[1] == 3, "three colour channels"  # symbolic_trace cannot; torch.export captures it
        return super().forward(x)


@pytest.mark.parametrize("cls", [_FrozenBNNet, _FrozenBNExportOnly], ids=["symbolic_trace", "torch.export"])
def test_a_loop_that_finds_modules_by_class_finds_them_in_the_converted_module(cls):
    """``isinstance(m, nn.BatchNorm2d)`` over ``gm.modules()`` finds the modules the model had at those names, on
    either capture: where the graph reads a module's parameters (a convolution or linear traced through, every
    module of an export), the module at that name has the model's torch.nn class and settings and holds the same
    parameters. A freeze by class then freezes (the frozen weights stay as they were, the others train, as in the
    float32 model with the same freeze); a batch norm set to eval on its own after ``gm.train()`` is followed where
    the graph calls the module (symbolic_trace) and is a clear error where the graph holds its mode as a flag, never
    a silent run of the training program."""
    torch.manual_seed(0)
    init, make = same_model(cls)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    gm = autocastfx.convert(make(), (x,), dtype=BF16)
    assert gm.meta["autocastfx"].capture == ("torch.export" if cls is _FrozenBNExportOnly else "symbolic_trace")
    kinds = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)
    ref = make()
    assert [(n, type(m).__name__) for n, m in gm.named_modules() if isinstance(m, kinds)] == \
        [(n, type(m).__name__) for n, m in ref.named_modules() if isinstance(m, kinds)]
    assert gm.stem.kernel_size == (3, 3) and gm.bn.eps == ref.bn.eps and "BatchNorm2d(8" in str(gm)
    assert not any(isinstance(v, torch.Tensor) for m in gm.modules() for v in vars(m).values())  # no tensor aside
    # the freeze by class, in the converted module and in the float32 model
    for model in (gm, ref):
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.Linear)):
                m.weight.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in gm.named_parameters() if not p.requires_grad}
    assert set(frozen) == {"bn.weight", "head.weight"}
    opt = torch.optim.SGD([p for p in gm.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for model, o in ((gm, opt), (ref, ref_opt)):
        model.train()
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            o.step()
            o.zero_grad()
    params = dict(gm.named_parameters())
    assert all(torch.equal(params[n], before) for n, before in frozen.items())
    assert not torch.equal(params["conv.weight"], init["conv.weight"])
    for n, p in ref.named_parameters():  # the converted run trained what the float32 one did, about as far (the
        # stem's bias, which the batch norm after it cancels, moves by rounding alone)
        moved, ref_moved = float((params[n] - init[n]).norm()), float((p - init[n]).norm())
        assert abs(moved - ref_moved) <= 0.1 * ref_moved + 1e-4 and (moved == 0) == (ref_moved == 0), n
    # a batch norm set to eval on its own, after each gm.train(): followed where the graph calls the module
    # (symbolic_trace); where the graph holds its mode as a flag (torch.export), the call is converted for the
    # mixture at its first call, never a silent run of the training program
    ref.load_state_dict(gm.state_dict())
    for epoch in range(2):
        for model in (gm, ref):
            model.train()
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        stats = gm.bn.running_mean.clone()
        out, ref_out = gm(x), ref(x)
        assert torch.equal(gm.bn.running_mean, stats) and torch.equal(gm.bn.running_mean, ref.bn.running_mean)
        assert _rel(out, ref_out) < 2e-2
        F.cross_entropy(out, y).backward()
        F.cross_entropy(ref_out, y).backward()
        assert _rel(gm.conv.weight.grad, ref.conv.weight.grad) < 5e-2
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        held = gm.meta.get("autocastfx_other_calls")
        assert (held is None) == (cls is _FrozenBNNet)  # one conversion for the mixture, kept for the next epoch
        assert held is None or len(held.by_key) == 1
        for model in (gm, ref):
            model.eval()
        with torch.no_grad():  # gm.eval() runs gm's own eval program again
            assert _rel(gm(x), ref(x)) < 2e-2
    ref.load_state_dict(gm.state_dict())  # the checkpoint is still the model's
    # SWA's statistics pass sets each batch norm's momentum: followed where the graph calls the module, refused
    # (never silently unread) where the graph holds it as a constant
    swa = torch.optim.swa_utils.AveragedModel(gm)
    if cls is _FrozenBNNet:
        torch.optim.swa_utils.update_bn([x, x.flip(0)], swa)
        ref_swa = torch.optim.swa_utils.AveragedModel(ref)
        torch.optim.swa_utils.update_bn([x, x.flip(0)], ref_swa)
        assert torch.allclose(swa.module.bn.running_mean, ref_swa.module.bn.running_mean, atol=0.05)
    else:
        with pytest.raises(ValueError, match=r"BatchNorm2d.momentum is a constant.*run update_bn there"):
            torch.optim.swa_utils.update_bn([x], swa)
    # SyncBatchNorm: a module the graph calls is replaced and called; one whose ops it holds is refused
    if cls is _FrozenBNNet:
        assert isinstance(nn.SyncBatchNorm.convert_sync_batchnorm(gm).bn, nn.SyncBatchNorm)
        assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["bn"]
    else:
        with pytest.raises(ValueError, match=r"'bn' is a BatchNorm2d whose ops.*SyncBatchNorm"):
            nn.SyncBatchNorm.convert_sync_batchnorm(gm)
        assert type(gm.bn).__name__ == "BatchNorm2d"


class _ScaleNorm(nn.Module):
    """A model's own norm class, a leaf: its weight and a setting."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _OwnNormNet(nn.Module):
    def __init__(self, export_only=False):
        super().__init__()
        self.fc, self.norm, self.head, self.export_only = nn.Linear(8, 8), _ScaleNorm(8), nn.Linear(8, 4), export_only

    def forward(self, x):
        if self.export_only:
            assert x.shape[1] == 8, "eight features"
        return self.head(self.norm(self.fc(x)))


@pytest.mark.parametrize("export_only", [False, True], ids=["symbolic_trace", "torch.export"])
def test_the_models_own_layer_classes_settings_and_hooks_after_convert(export_only):
    """A model's own layer class is found by ``isinstance`` too (a weight-decay group without norms); a setting of
    a module whose ops the graph holds is read-only with an error that says what to do (``update_bn`` sets a batch
    norm's momentum), never silently unread; a hook on such a module, which the graph never calls, is warned
    about."""
    torch.manual_seed(0)
    model, x = _OwnNormNet(export_only), torch.randn(4, 8)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert gm.meta["autocastfx"].capture == ("torch.export" if export_only else "symbolic_trace")
    norms = [m for m in gm.modules() if isinstance(m, _ScaleNorm)]
    assert [n for n, m in gm.named_modules() if isinstance(m, _ScaleNorm)] == ["norm"] and norms[0].eps == 1e-6
    no_decay = {id(p) for m in norms for p in m.parameters()}
    assert no_decay == {id(model.norm.weight)}  # the model's own parameter: the group an optimizer is built from
    with pytest.raises(ValueError, match=r"_ScaleNorm.eps is a constant of the converted graph.*convert again"):
        gm.norm.eps = 1e-3
    with pytest.raises(ValueError, match=r"Linear.in_features is a constant"):
        gm.head.in_features = 9
    with pytest.raises(ValueError, match=r"_ScaleNorm.eps is a constant"):
        del gm.norm.eps
    gm.norm.weight = nn.Parameter(torch.full((8,), 2.0))  # its tensors are the graph's to read, as before
    assert torch.allclose(gm(x), model.head(2 * (model.norm(model.fc(x)) / model.norm.weight)), atol=0.05)
    seen = []
    with pytest.warns(UserWarning, match="a hook on this Linear never runs"):
        handle = gm.head.register_forward_hook(lambda m, a, out: seen.append(out))
    gm(x)
    handle.remove()
    assert seen == []  # as warned
    # a module replaced by one of another class (a LoRA wrapper around the linear): refused, the model as it was
    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.weight, self.bias = base, base.weight, base.bias
            self.a, self.b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.zeros(4, 2))

    head = gm.head
    with pytest.raises(ValueError, match=r"'head' is a Linear whose ops the converted graph computes itself.*LoRA"):
        gm.head = LoRA(gm.head)
    with pytest.raises(ValueError, match=r"replacing it with a LoRA"):
        gm.add_module("head", LoRA(gm.head))
    assert gm.head is head
    with pytest.raises(ValueError, match=r"settings as constants; the new one's differ \(out_features=10\)"):
        gm.head = nn.Linear(8, 10)  # a head for other classes: the graph was planned for the old one's shapes
    gm.head = nn.Linear(8, 4)  # one of the same class and shapes: the graph reads its tensors (a fresh head)
    assert torch.allclose(gm(x), model.head.__class__.forward(gm.head, model.norm(model.fc(x)) * 2), atol=0.05)
    copy_ = __import__("copy").deepcopy(gm)  # copies keep the class and the read-only settings
    assert isinstance(copy_.norm, _ScaleNorm) and copy_.norm.eps == 1e-6
    with pytest.raises(ValueError, match="constant of the converted graph"):
        copy_.norm.eps = 0.5


class _Slotted(nn.Module):
    __slots__ = ("note",)

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


class _Registry(nn.Module):
    known: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _Registry.known[cls.__name__] = cls


class _Registered(_Registry):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


class _ManyLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.slotted, self.registered, self.head = _Slotted(), _Registered(), nn.Linear(8, 4)
        self.head.tool_hook = print  # what a tool leaves on a module (accelerate's _hf_hook, an instance forward)

    def forward(self, x):
        assert x.shape[1] == 3  # torch.export
        return self.head(self.registered(self.slotted(self.conv(x).mean((2, 3)))))


def test_held_modules_keep_to_what_their_classes_allow():
    """The class is given only where the instance can take it: not a class with ``__slots__``, a subclass hook or
    anything but plain settings (a tool's callable); a held module pickles as the model's class; a model holding a
    converted module's held module converts; a same-class replacement with other settings is refused; torch's own
    hooks that the graph would never run (pruning) are warned about as a user's are."""
    torch.manual_seed(0)
    model, x = _ManyLeaves(), torch.randn(2, 3, 6, 6)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert type(gm.conv).__name__ == "Conv2d" and isinstance(gm.conv, nn.Conv2d)
    assert [type(gm.get_submodule(n)).__name__ for n in ("slotted", "registered", "head")] == \
        ["Module", "_Registered", "Module"]
    assert _Registry.known == {"_Registered": _Registered}  # the capture's and the held subclasses are not announced
    gm.head.tool_hook = None  # a plain container: its attributes are its own
    buf = io.BytesIO()
    torch.save(gm.conv, buf)  # pickled as the model's class
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is nn.Conv2d and torch.equal(loaded.weight, model.conv.weight) and loaded.stride == (1, 1)
    with pytest.raises(ValueError, match=r"settings as constants; the new one's differ \(stride=\(2, 2\)\)"):
        gm.conv = nn.Conv2d(3, 8, 3, padding=1, stride=2)

    class Reuse(nn.Module):  # a new model around a held module of a converted one
        def __init__(self):
            super().__init__()
            self.conv = gm.conv

        def forward(self, x):
            assert x.shape[1] == 3
            return self.conv(x)

    again = autocastfx.convert(Reuse(), (x,), dtype=BF16)
    assert isinstance(again.conv, nn.Conv2d) and again(x).shape == (2, 8, 6, 6)
    with pytest.raises(ValueError, match=r"new parameter 'weight_orig'.*torch.nn.utils.parametrize"):
        __import__("torch.nn.utils.prune").nn.utils.prune.l1_unstructured(gm.conv, "weight", 0.5)
    assert list(gm.conv._parameters) == ["weight", "bias"] and gm.conv.weight is model.conv.weight


# ------------------------------------------------------------------------ another call, a compiled call

class _LossOrLogits(nn.Module):
    """Returns the loss where the targets are given, else the logits: converted for the loss call, ``gm(x)`` is a
    call of another structure, converted on first use."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y=None):
        out = self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))
        return out if y is None else F.cross_entropy(out, y)


def test_another_call_follows_modes_settings_and_modules_set_after_convert():
    """The logits call of a module converted for its loss call runs the modes, settings and modules the converted
    module has at that call, as the model would: a batch norm frozen after convert() (its statistics untouched), a
    dropout turned off through its module's ``p``, a head replaced by a fresh one after a first such call."""
    torch.manual_seed(0)
    model = _LossOrLogits()
    ref = _LossOrLogits()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm = autocastfx.convert(model, (x, y), dtype=torch.float16)
    for m in (gm, ref):
        m.train()
        m.bn.eval()
        m.drop.p = 0.0
    mean = ref.bn.running_mean.clone()
    torch.testing.assert_close(gm(x, y), ref(x, y), rtol=0, atol=2e-3)
    torch.manual_seed(1)
    first = gm(x)
    torch.manual_seed(2)
    torch.testing.assert_close(gm(x), first, rtol=0, atol=0)  # dropout off: the same output under another seed
    torch.testing.assert_close(first, ref(x), rtol=0, atol=2e-3)
    assert torch.equal(gm.bn.running_mean, mean) and int(gm.bn.num_batches_tracked) == 0  # frozen: not updated
    # a fresh head of the same class and shapes, after the logits call ran once: that call reads it too
    head = nn.Linear(32, 4)
    gm.fc2 = head
    ref.fc2.load_state_dict(head.state_dict())
    torch.testing.assert_close(gm(x), ref(x), rtol=0, atol=2e-3)
    gm.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), ref(x), rtol=0, atol=2e-3)


class _ExportOnlyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        b, *_ = x.shape  # symbolic_trace cannot unpack a traced size; torch.export captures it
        return self.fc2(F.relu(self.bn(self.fc1(x)))).reshape(b, -1)


def test_torch_compile_of_the_converted_module_follows_a_frozen_batch_norm():
    """``torch.compile(gm)`` runs the program of its modules' modes, as ``gm`` does: a batch norm frozen before
    convert() and again after each ``gm.train()`` (the documented recipe) keeps its statistics, and the losses follow
    the float32 model's; a module frozen after convert() on a torch.export capture is converted for, as eager, and
    without the model kept is the same ValueError as eager."""
    torch.manual_seed(0)
    model = _ExportOnlyNet()
    ref = _ExportOnlyNet()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model.train()
    model.bn.eval()
    gm = autocastfx.convert(model, (x,), dtype=torch.float16)
    net = torch.compile(gm, backend="eager")
    opt, ref_opt = torch.optim.SGD(gm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mean = ref.bn.running_mean.clone()
    for _ in range(3):
        for m in (gm, ref):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(net(x), ref(x), rtol=0, atol=2e-3)
        for m in (gm, ref):
            m.train()
            m.bn.eval()
        loss, ref_loss = F.cross_entropy(net(x), y), F.cross_entropy(ref(x), y)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-3)
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l.backward()
            o.step()
    assert torch.equal(gm.bn.running_mean, mean) and int(gm.bn.num_batches_tracked) == 0
    gm2 = autocastfx.convert(_ExportOnlyNet(), (x,), dtype=torch.float16)
    net2 = torch.compile(gm2, backend="eager")
    net2(x)
    ref2 = copy.deepcopy(gm2)  # a plain copy: the float32 model's values and modes
    gm2.bn.eval()  # after convert(): no program computes it, and the compiled call converts for it
    ref2_model = _ExportOnlyNet()
    ref2_model.load_state_dict(ref2.state_dict())
    ref2_model.train()
    ref2_model.bn.eval()
    stats = gm2.bn.running_mean.clone()
    for _ in range(2):  # converted once, then the compiled code runs it
        torch.testing.assert_close(net2(x).float(), ref2_model(x), rtol=0, atol=2e-2)
    assert torch.equal(gm2.bn.running_mean, stats)
    assert len(gm2.meta["autocastfx_other_calls"].by_key) == 1
    gm2.meta["autocastfx"].checks = None  # without the model kept: the same ValueError as eager
    gm2.train()
    gm2.bn.eval()
    with pytest.raises(ValueError, match="another mode than the program it runs"):
        net2(x)


class _ExportOnlyLossOrLogits(_LossOrLogits):
    def forward(self, x, y=None):
        b, *_ = x.shape  # torch.export captures it: the graph computes the dropout itself
        out = self.fc2(self.drop(F.relu(self.bn(self.fc1(x))))).reshape(b, -1)
        return out if y is None else F.cross_entropy(out, y)


def test_another_call_on_a_torch_export_capture_follows_the_mode_of_modules_it_holds_none_of():
    """Converted in eval mode for its loss call, on torch.export (whose graph computes the dropout itself; gm holds
    a module in its place, holding nothing): after ``gm.train()`` the logits call drops out, and after ``gm.eval()``
    it does not and gives the model's logits."""
    torch.manual_seed(0)
    model = _ExportOnlyLossOrLogits().eval()
    ref = _ExportOnlyLossOrLogits().eval()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm = autocastfx.convert(model, (x, y), dtype=torch.float16)
    assert not any(True for _ in gm.get_submodule("drop").parameters())
    gm.train()
    torch.manual_seed(1)
    first = gm(x)
    torch.manual_seed(2)
    assert not torch.equal(gm(x), first)  # dropout on
    gm.eval()
    torch.manual_seed(1)
    first = gm(x)
    torch.manual_seed(2)
    assert torch.equal(gm(x), first)
    ref.load_state_dict(gm.state_dict())  # the running statistics the training-mode calls updated
    torch.testing.assert_close(first, ref(x), rtol=0, atol=2e-3)


class _BNBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class _BNBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)
        self.layers = nn.ModuleList([_BNBlock(), _BNBlock()])

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean((2, 3)))


def test_converting_a_training_model_with_blocks_leaves_its_statistics_as_they_were():
    """convert() of a model in training mode, its blocks converted as modules of their own, runs the model once to
    learn what each block gives; the model's batch norms keep their running statistics (the converted module's
    own) and their count, bit for bit."""
    torch.manual_seed(0)
    model = _BNBlocks().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = autocastfx.convert(model, (torch.randn(4, 3, 8, 8),), dtype=torch.float16, blocks="auto")
    from autocastfx.base.meta import is_converted
    assert all(is_converted(b) for b in gm.layers)  # each block a converted module of its own
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_step_saved_inside_an_accumulation_cycle_resumes_it(tmp_path):
    """``step.state_dict()`` taken between the micro-batches of a cycle keeps their gradients: a step over a newly
    converted model, loaded from it, makes the same updates as the step that went on. ``save_checkpoint`` there
    (whose checkpoint loads on any number of processes, where one rank's gradients mean nothing) is a ValueError
    and writes nothing."""
    torch.manual_seed(0)
    make = same_model(_mlp)[1]
    x, y = _mlp_data().tensors

    def new_step():
        gm = autocastfx.convert(make(), (x[:8],), dtype=torch.float16)
        return autocastfx.train_step(gm, F.cross_entropy, torch.optim.SGD(gm.parameters(), lr=0.5), accum_steps=2)

    step = new_step()
    for i in range(5):
        step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    buf = io.BytesIO()
    torch.save(step.state_dict(), buf)
    with pytest.raises(ValueError, match="into an accumulation cycle of 2"):
        autocastfx.save_checkpoint(step, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    went_on = [float(step(x[:8], y[:8])) for _ in range(3)]
    buf.seek(0)
    resumed = new_step()
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert [float(resumed(x[:8], y[:8])) for _ in range(3)] == went_on
    for p, q in zip(step.gm.parameters(), resumed.gm.parameters()):
        assert torch.equal(p, q)


class _ScaledBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.scale = nn.Linear(d, d), 1.0

    def forward(self, x):
        return x + self.scale * F.gelu(self.fc(x))


class _Tempered(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp, self.out, self.temp = nn.Linear(8, d), nn.Linear(d, 4), 1.0
        self.layers = nn.ModuleList([_ScaledBlock(d) for _ in range(2)])

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h) / self.temp


@pytest.mark.parametrize("blocks", ["auto", None])
def test_a_plain_attribute_the_forward_read_is_refused_on_the_converted_module(blocks):
    """A model's plain attribute that its forward reads (a temperature, a block's residual scale) is a constant of
    the converted graph: the converted module answers it, and writing it is a ValueError that says what to do,
    instead of a value the graph never reads."""
    torch.manual_seed(0)
    model = _Tempered()
    x = torch.randn(4, 8)
    gm = autocastfx.convert(model, (x,), dtype=torch.float16, blocks=blocks)
    out = gm(x)
    assert gm.temp == 1.0
    with pytest.raises(ValueError, match=r"temp is an attribute of the model \(temp=1.0\).*Set it on the model"):
        gm.temp = 4.0
    if blocks == "auto":
        with pytest.raises(ValueError, match="scale is an attribute of the model"):
            gm.layers[1].scale = 0.0
    assert gm.temp == 1.0 and torch.equal(gm(x), out)
    model.temp = 4.0  # on the model, converted again: followed
    torch.testing.assert_close(autocastfx.convert(model, (x,), dtype=torch.float16, blocks=blocks)(x), out / 4)


class _MovingAverage(nn.Module):
    """A buffer the forward keeps as a moving average of its activations, and a step counter (a VQ-VAE codebook's
    statistics, a warm-up count): updated in place, in training mode only."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("avg", torch.zeros(16))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            self.avg.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            self.count.add_(1)
        else:
            h = h - self.avg
        return self.head(F.relu(h))


def test_a_buffer_the_forward_updates_in_place_is_updated_at_every_call():
    """Symbolic tracing runs an update of the model's own tensors at once, with no node (its inputs are no traced
    value): the converted module never made it again (count 1 after 20 calls, set by convert() itself; the
    average a running sum, 1.28 off). Such a model is captured by torch.export, and convert() leaves the
    buffers as they were."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    model = _MovingAverage()
    ref = _MovingAverage()
    ref.load_state_dict(model.state_dict())
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    assert int(model.count) == 0 and not model.avg.any()  # convert() made no update
    assert gm.meta["autocastfx"].capture == "torch.export"
    for _ in range(20):
        gm(x)
        ref(x)
    assert int(gm.count) == int(ref.count) == 20
    torch.testing.assert_close(gm.avg, ref.avg, rtol=2e-2, atol=2e-3)
    fresh = _MovingAverage()
    fresh.load_state_dict(gm.state_dict())  # the counter and the average are in the checkpoint
    gm.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.allclose(gm(x).float(), ref(x), rtol=5e-2, atol=5e-2)


class _Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h + torch.randn(8)  # drawn from no input
        return self.head(h)


class _OneDrawDropPath(_Noise):
    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h * (torch.rand(1) > 0.5).float() / 0.5  # one draw for the whole batch
        return self.head(x + h)


@pytest.mark.parametrize("cls", [_Noise, _OneDrawDropPath])
def test_a_random_draw_from_no_input_is_drawn_at_every_call(cls):
    """Symbolic tracing ran ``torch.randn(8)`` once and kept its draw as a constant: every training step got the
    same noise, and a drop path decided by one draw kept its first decision. Such a draw is now an op of the
    graph, made at each call, the same numbers as the model's for the same seed."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = cls()
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    outs, want = [], []
    for seed in range(6):
        torch.manual_seed(seed)
        outs.append(gm(x).detach().float())
        torch.manual_seed(seed)
        want.append(model(x).detach())
    assert len({round(o.sum().item(), 3) for o in outs}) > 1
    for o, w in zip(outs, want):
        assert torch.allclose(o, w, rtol=5e-2, atol=5e-2)


class _Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return y * 0.5 if self.training else y + 1.0


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = _Branch(), _Branch(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.b(F.relu(self.a(x))))


def test_torch_compile_of_the_converted_module_follows_the_mode_of_a_module_its_code_reads():
    """``torch.compile(gm)`` guarded on the root's mode alone: with ``gm.b`` frozen again after each
    ``gm.train()`` (as docs/training.md says), it kept running the program it compiled first (6.306 where the
    model gives -0.123, or the other way round). It now guards on the mode of every module whose mode the
    programs hold."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    model = _TwoBranches()
    model.b.eval()
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="eager")
    with torch.no_grad():
        for frozen in (False, True, False, True):
            for net in (model, gm):
                net.train()
                if frozen:
                    net.b.eval()
            want = model(x)
            assert torch.allclose(gm(x).float(), want, rtol=2e-2, atol=2e-2)
            assert torch.allclose(compiled(x).float(), want, rtol=2e-2, atol=2e-2), frozen


def test_checkpoint_blocks_moves_batch_norm_statistics_once_a_step():
    """torch's checkpoint runs a block's forward again in backward, and a batch norm there updated its running
    statistics a second time (num_batches_tracked 10 after 5 steps, the eval output 0.125 off). The recompute
    now gives the block's buffers back: the statistics are the plain run's."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.fc = nn.BatchNorm1d(16), nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(F.relu(self.bn(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    x, y = torch.randn(8, 16) + 2.0, torch.randint(0, 3, (8,))
    base = Net()

    def run(checkpointed):
        net = Net()
        net.load_state_dict(base.state_dict())
        gm = autocastfx.convert(net, (x,), dtype=torch.bfloat16)
        if checkpointed:
            autocastfx.checkpoint_blocks(gm)
        opt = torch.optim.SGD(gm.parameters(), lr=0.05)
        for _ in range(5):
            F.cross_entropy(gm(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        return gm.state_dict()

    plain, checkpointed = run(False), run(True)
    assert int(checkpointed["layers.0.bn.num_batches_tracked"]) == 5
    for k, v in plain.items():
        assert torch.equal(v, checkpointed[k]), k


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 8)

    def forward(self, x, scale=1.0, relu=False):
        out = self.l(x) * scale
        return F.relu(out) if relu else out


def test_a_plain_value_a_call_passes_is_not_dropped():
    """A call that passed a scale or a flag of its own (``gm(x, scale=3.0)``, ``gm(x, relu=True)``) was taken for
    the example's call spelled another way and ran with the example's values (0.67 off, a ReLU skipped). Plain
    values are now part of what a conversion is made for, and a call spelled another way than the conversion it
    reuses is spelled as that one's."""
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    calls = [((x,), {}), ((x,), {"scale": 3.0}), ((x, 3.0), {}), ((x,), {"relu": True}), ((x, 1.0, True), {})]
    with torch.no_grad():
        for args, kwargs in calls:
            want = model(*args, **kwargs)
            assert torch.allclose(gm(*args, **kwargs).float(), want, rtol=2e-2, atol=2e-2), (args[1:], kwargs)
        given = autocastfx.convert(model, (x,), example_kwargs={"scale": 1.0}, dtype=torch.bfloat16)
        assert torch.allclose(given(x, scale=3.0).float(), model(x, scale=3.0), rtol=2e-2, atol=2e-2)
        # a value that changes at every call: each converted, the oldest dropped past 16, which is said once
        with pytest.warns(UserWarning, match="_Scaled has been converted for 16 other calls") as said:
            for i in range(18):
                assert torch.allclose(gm(x, scale=0.5 * i).float(), model(x, scale=0.5 * i), rtol=2e-2, atol=2e-2)
        assert sum("other calls" in str(w.message) for w in said) == 1


@pytest.mark.parametrize("change", ["masked_fill_", "mul_", "setitem", "input add_"])
def test_a_value_changed_in_place_is_read_as_changed_by_a_low_op(change):
    """The cast a low op reads was put right after its value was made: a change made in place after that (padded
    frames zeroed before a feed-forward, an input incremented, a slice set through a view) was lost to the low op,
    forward and gradients (0.41-0.94 off). The cast of a value changed in place now comes before its first reader."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.ff = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x, pad):
            h = x if change == "input add_" else self.ln(x)
            if change == "masked_fill_":
                h.masked_fill_(pad.unsqueeze(-1), 0.0)
            elif change == "mul_":
                h.mul_(3.0)
            elif change == "setitem":
                h[:, :4] = 0
            else:
                h.add_(1.0)
            return self.ff(h)

    torch.manual_seed(0)
    x, pad = torch.randn(4, 12, 16), torch.zeros(4, 12, dtype=torch.bool)
    pad[:2, 8:] = True
    model = Net()
    gm = autocastfx.convert(model, (x.clone(), pad), dtype=torch.bfloat16)
    out, want = gm(x.clone(), pad), model(x.clone(), pad)
    assert torch.allclose(out.float(), want, rtol=3e-2, atol=3e-2)
    out.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    want.pow(2).mean().backward()
    for g, w in zip(grads, [p.grad for p in model.parameters() if p.grad is not None]):
        assert (g - w).norm() / w.norm() < 3e-2


class _ReadAroundAChange(nn.Module):
    """A value read before and after it is changed in place, in each form the change can take."""

    def __init__(self, change):
        super().__init__()
        self.change = change
        self.fc0, self.norm, self.fc1, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32), \
            nn.Linear(32, 10)
        self.relu, self.silu = nn.ReLU(inplace=True), nn.SiLU(inplace=True)

    def forward(self, x):
        c = self.change
        h = self.fc0(x) if c == "exp between" else self.norm(self.fc0(x))
        shortcut = h                                   # the same tensor: a change to h changes it too
        if c == "exp between":                         # a float32 reader before the change, one after
            before = torch.exp(h)
            h.mul_(2)
            return self.fc2(before + torch.exp(h))
        early = self.fc1(h)                            # a low reader before the change
        if c == "nn.ReLU(inplace=True)":
            h = self.relu(h)
        elif c == "nn.SiLU(inplace=True)":
            h = self.silu(h)
        elif c == "F.relu(inplace=True)":
            h = F.relu(h, inplace=True)
        elif c == "F.relu(h, True)":
            h = F.relu(h, True)
        elif c == "reshape().mul_":
            h.reshape(-1, 4, 8).mul_(3.0)
        elif c == "contiguous().mul_":
            h.contiguous().mul_(3.0)
        elif c == "detach().mul_":
            h.detach().mul_(3.0)
        elif c == "data.mul_":
            h.data.mul_(3.0)
        elif c == "view of a view":
            h.view(-1, 32)[:, :8].zero_()
        elif c == "boolean mask setitem":
            h[h > 0] = 0.5 * h[h > 0]
        return self.fc2(early + self.fc1(h) + self.fc1(shortcut))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("change", ["exp between", "nn.ReLU(inplace=True)", "nn.SiLU(inplace=True)",
                                    "F.relu(inplace=True)", "F.relu(h, True)", "reshape().mul_", "contiguous().mul_",
                                    "detach().mul_", "data.mul_", "view of a view", "boolean mask setitem"])
@pytest.mark.parametrize("hooked", [False, True], ids=["traced", "hooked"])
def test_readers_before_and_after_a_change_in_place_read_the_value_as_it_was_then(change, hooked):
    """Before: one cast per value served every reader, so a reader after a change in place read it unchanged
    (h.mul_ between two float32 readers: 0.57 off where autocast is 6e-3 off), and a change through an in-place
    activation module, an ``inplace=True`` argument or a view the plan did not know (reshape, contiguous, detach,
    .data) was not seen at all (0.41-0.67 off); a boolean-mask assignment of a low value to a float32 one failed
    ("Index put requires the source and destination dtypes match"). Each reader of a value changed in place now gets its own cast, where
    it reads, and every view of that value and every change to it run in its dtype."""
    torch.manual_seed(0)
    model = _ReadAroundAChange(change).eval()
    if hooked:  # a hook of its own: torch.export captures it, as aten ops
        model.register_forward_pre_hook(lambda module, args: None)
    x = torch.randn(6, 16)
    gm = autocastfx.convert(model, (torch.randn(4, 16),), dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            theirs = model(x).float()
        got = gm(x).float()
    bound = 3 * _rel(theirs, want) + 2e-3
    assert _rel(got, want) < bound, (_rel(got, want), _rel(theirs, want))
    assert any(n.target == "to" for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes)  # converted, with casts


class _Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_a_backward_hook_the_graph_would_not_run_is_refused_and_one_on_a_kept_layer_runs():
    """Before: a backward hook on a Linear the graph computes itself (or on the model) was dropped without a word:
    a hook that blocks a gradient left it flowing (the first layer's weight gradient 10.1 where the model's is
    0). Such a hook is a ValueError naming the module; one on a layer kept as a module (an activation) runs."""
    x = torch.randn(4, 8)
    for where in ("b", ""):
        model = _Hooked()
        target = model.get_submodule(where) if where else model
        target.register_full_backward_hook(lambda module, gin, gout: tuple(torch.zeros_like(g) for g in gin))
        with pytest.raises(ValueError, match=f"{where or 'the model'} of _Hooked has a backward hook.*"
                                             "gm.register_full_backward_hook"):
            autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    model, seen = _Hooked(), []
    model.act.register_full_backward_hook(lambda module, gin, gout: seen.append(gout[0].shape))
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    gm(x).sum().backward()
    assert seen == [torch.Size([4, 8])]
    gm.register_full_backward_hook(lambda module, gin, gout: seen.append("gm"))  # the fix the error names
    gm(x).sum().backward()
    assert seen.count("gm") == 1 and len(seen) == 3


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    extra: object = None


class _ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, x):
        return _Out(self.head(torch.relu(self.fc(x))), None), (_Out(self.fc(x)),)


def test_outputs_packed_in_a_dataclass_keep_the_inputs_dtype():
    """Before: a tensor the forward returned inside a plain dataclass came back bfloat16 with keep_io_types=True
    (a namedtuple's or a dict's came back float32), so a loss computed outside ran in bfloat16."""
    torch.manual_seed(0)
    model, x = _ReturnsADataclass(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    out, nested = gm(x)
    assert out.logits.dtype == torch.float32 and nested[0].logits.dtype == torch.float32
    assert _rel(out.logits, model(x)[0].logits) < 2e-2


class _TiedThenAnotherHead(nn.Module):
    """GPT-2's tied embedding and head, with a second vocabulary head after the tied one."""

    def __init__(self):
        super().__init__()
        self.wte, self.fc, self.ln = nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16)
        self.lm_head, self.mtp_head = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        h = self.ln(torch.relu(self.fc(self.wte(idx))))
        return self.lm_head(h) + self.mtp_head(h)


@pytest.mark.parametrize("blocks", ["auto", None])
def test_the_state_dict_of_a_tied_model_is_in_the_models_order(blocks):
    """Before: the tied head's name was added at the end of gm.state_dict(), after the head that follows it in the
    model, so an EMA that zips two state dicts' values (timm's ModelEmaV3) averaged the embedding into the other
    head (EMA logits 0.55 off, autocast's 0.018)."""
    model = _TiedThenAnotherHead()
    gm = autocastfx.convert(model, (torch.randint(0, 32, (2, 8)),), dtype=torch.bfloat16, blocks=blocks)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert list(nn.Sequential(gm).state_dict()) == ["0." + k for k in model.state_dict()]
    for (k, v), (k2, w) in zip(gm.state_dict().items(), model.state_dict().items()):
        assert k == k2 and v is not None and v.shape == w.shape and torch.equal(v, w)


class _DropPath(nn.Module):
    """timm's DropPath: a rate and no tensors."""

    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep) / keep


class _OwnDropout(nn.Dropout):
    pass


class _Scheduled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop_path, self.drop, self.head = nn.Linear(8, 8), _DropPath(0.5), _OwnDropout(0.5), \
            nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(x + self.drop_path(self.fc(x))))


@pytest.mark.parametrize("blocks", ["auto", None])
def test_a_schedule_that_finds_tensorless_modules_by_class_finds_them_and_is_refused(blocks):
    """Before: a drop path or a dropout subclass, which hold no tensor, were not in gm.modules(), so an early-dropout
    schedule (for m in model.modules(): if isinstance(m, DropPath): m.drop_prob = 0) found none and the rate fixed at
    convert() went on (loss 0.87 where float32 and autocast reach 0.60). They are there now, with their settings,
    and setting one is a ValueError naming it."""
    gm = autocastfx.convert(_Scheduled(), (torch.randn(4, 8),), dtype=torch.bfloat16, blocks=blocks)
    found = {type(m).__name__: m for m in gm.modules() if isinstance(m, (_DropPath, nn.Dropout))}
    assert set(found) == {"_DropPath", "_OwnDropout"}
    assert found["_DropPath"].drop_prob == 0.5 and found["_OwnDropout"].p == 0.5
    with pytest.raises(ValueError, match="_DropPath.drop_prob is a constant of the converted graph"):
        found["_DropPath"].drop_prob = 0.0
    with pytest.raises(ValueError, match="_OwnDropout.p is a constant"):
        found["_OwnDropout"].p = 0.0
    assert not any(True for _ in found["_DropPath"].parameters()) and list(gm.state_dict()) == \
        ["fc.weight", "fc.bias", "head.weight", "head.bias"]
    gm.eval()
    assert not found["_DropPath"].training
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), gm(x))


class _PlainTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)
        self.temp = torch.tensor(2.0)  # a plain tensor attribute
        self.register_buffer("scale", torch.ones(32))
        self.tables = [torch.ones(32)]  # a tensor in a list

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.scale * self.tables[0]) / self.temp


@pytest.mark.parametrize("blocks", ["auto", None])
def test_the_state_dict_holds_the_models_keys_only_where_it_keeps_plain_tensors(blocks):
    """Before: a plain tensor attribute and a tensor in a list were in gm.state_dict() (as 'temp' and
    '_tensor_constant0'), so model.load_state_dict(gm.state_dict()) failed on unexpected keys and
    gm.load_state_dict(model.state_dict()) on missing ones."""
    model, x = _PlainTensors(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16, blocks=blocks)
    assert list(gm.state_dict()) == list(model.state_dict())
    gm.load_state_dict(model.state_dict())
    fresh = _PlainTensors()
    fresh.load_state_dict(gm.state_dict())
    assert _rel(gm(x), fresh(x)) < 2e-2


def test_indexing_a_container_the_graph_computes_gives_the_child_at_that_position():
    """Before: gm.backbone[0] raised "'Module' object is not subscriptable", which names no cause and no fix. A
    container holding every child of the model's (the GELU a stand-in with its settings) is indexed as the model's;
    one with a child absent says to reach the child by name (test_a_held_container_of_every_child_...)."""
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), nn.Linear(8, 2))
    gm = autocastfx.convert(model, (torch.randn(4, 8),), dtype=torch.bfloat16, blocks=None)
    assert gm.get_submodule("0")[2] is getattr(gm.get_submodule("0"), "2")
    assert isinstance(gm.get_submodule("0")[2], nn.Linear)


class _LossOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("hooked", [False, True], ids=["traced", "hooked"])
def test_example_inputs_that_are_one_tensor_stay_two_inputs(hooked):
    """Before: example_kwargs={"input_ids": ids, "labels": ids} (one tensor twice) made torch.export capture one
    input for both, so the graph embedded the labels at every later call (logits 1.26 off)."""
    torch.manual_seed(0)
    model = _LossOfTokens()
    if hooked:  # a hook of its own: torch.export captures it
        model.register_forward_pre_hook(lambda module, args: None)
    ids = torch.randint(0, 32, (2, 8))
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids, "labels": ids}, dtype=torch.bfloat16)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        (got, _), (want, _) = gm(input_ids=x, labels=y), model(input_ids=x, labels=y)
    assert _rel(got.float(), want) < 2e-2


def test_a_backward_hook_on_a_layer_torch_export_computes_is_refused():
    """Before: a backward hook on an activation or norm (kept as a module by symbolic tracing, so exempt) was
    dropped where torch.export captured the model, whose graph computes every layer: a hook that zeroes the
    gradient left it flowing (18.0 where the model's is 0)."""
    model = _Hooked()
    model.register_forward_pre_hook(lambda module, args: None)  # a hook of its own: torch.export captures it
    model.act.register_full_backward_hook(lambda module, gin, gout: tuple(torch.zeros_like(g) for g in gin))
    with pytest.raises(ValueError, match="act of _Hooked has a backward hook"):
        autocastfx.convert(model, (torch.randn(4, 8),), dtype=torch.bfloat16)


class _Graph(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, adjacency):
        return torch.sparse.mm(adjacency, self.fc(x))


def test_a_sparse_example_input_converts():
    """The example's inputs that share memory are cloned before capture: a sparse input, which has no storage to
    compare, is passed as it is (it raised NotImplementedError)."""
    torch.manual_seed(0)
    x, adjacency = torch.randn(4, 8), torch.eye(4).to_sparse()
    model = _Graph()
    gm = autocastfx.convert(model, (x, adjacency), dtype=torch.bfloat16)
    assert _rel(gm(x, adjacency).float(), model(x, adjacency)) < 2e-2


class _LowOpInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.softmax(x, -1)  # float32
        h.addmm_(x, self.fc2.weight)
        return self.fc1(h)


def test_a_matmul_changing_a_float32_value_in_place_runs_in_float32():
    """Before: x.addmm_(a, b) on a float32 x had its other inputs cast low for a matmul that runs in x's dtype
    ("self and mat2 must have the same dtype"); autocast runs it in float32, and so does gm now."""
    torch.manual_seed(0)
    model, x = _LowOpInPlace(), torch.randn(4, 16)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    assert _rel(gm(x).float(), model(x)) < 2e-2


@pytest.mark.parametrize("change", ["bias_none", "prune", "weight_norm", "spectral_norm", "new_parameter"])
def test_a_change_the_graph_would_not_read_is_refused_and_undone(change):
    """``layer.bias = None``, torch.nn.utils.prune, the legacy weight_norm and spectral_norm, or a new parameter on
    a layer the graph computes itself: refused at the write, naming the fix, with the layer as it was (the model's
    own parameters, in their order), and a loop over gm goes on as float32 does. (They used to fail later: a bare
    AttributeError from the generated code, or "backward through the graph a second time" at the second step.)"""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    layer, utils = gm.get_submodule("0"), __import__("torch.nn.utils.prune").nn.utils
    write = {"bias_none": lambda: setattr(layer, "bias", None),
             "prune": lambda: utils.prune.l1_unstructured(layer, "weight", 0.5),
             "weight_norm": lambda: utils.weight_norm(layer),
             "spectral_norm": lambda: utils.spectral_norm(layer),
             "new_parameter": lambda: setattr(layer, "scale", nn.Parameter(torch.ones(16)))}[change]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own, for the legacy weight_norm
        with pytest.raises(ValueError, match=r"on the model and convert again|torch\.nn\.utils\.parametrize"):
            write()
    assert list(layer._parameters) == ["weight", "bias"] and not layer._forward_pre_hooks
    assert layer.weight is model[0].weight and layer.bias is model[0].bias and "weight" not in vars(layer)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (gm, ref)]
    for _ in range(3):
        for m, opt in zip((gm, ref), opts):
            m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert (model[0].weight - ref[0].weight).abs().max() < 1e-2


class _ShiftedLM(nn.Module):
    """A language model that torch.export captures (its assert on the length stops symbolic tracing), called on
    slices of a token batch as loops do (``tokens[:, :-1]``, ``tokens[:, 1:]``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, idx, targets=None):
        assert idx.shape[1] <= 64, "too long"
        logits = self.fc(self.emb(idx))
        if targets is None:
            return logits[:, -1]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_an_example_that_is_a_view_leaves_later_calls_of_fresh_tensors_running():
    """torch.export guards on a view input's base (``x._base.size()``): converted from ``tokens[:, :-1]``, every
    later call with a tensor that is no view failed in the program's guard with "'NoneType' object has no attribute
    'size'"; so did the call of another structure a ``generate`` loop makes from a slice of its prompt."""
    torch.manual_seed(0)
    model, tokens = _ShiftedLM(), torch.randint(0, 50, (4, 17))
    gm = autocastfx.convert(model, (tokens[:, :-1], tokens[:, 1:]), dtype=BF16)
    assert gm.meta["autocastfx"].capture == "torch.export"
    fresh = torch.randint(0, 50, (4, 17))
    inputs, targets = fresh[:, :-1].clone(), fresh[:, 1:].clone()  # no views
    assert abs(float(gm(inputs, targets)) - float(model(inputs, targets))) < 2e-2
    gm.eval()
    with torch.no_grad():
        first = gm(tokens[:, :5])  # another structure, converted from a view
        nxt = torch.cat([tokens[:, :5], first.argmax(-1, keepdim=True)], dim=1)  # no view
        assert (gm(nxt).float() - model(nxt)).abs().max() < 0.05


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_call_of_another_structure_the_model_refuses_raises_the_models_own_error(mode):
    """A call of another structure (no targets) with a sequence the model's own assert refuses: its conversion
    fails, and the caller gets the model's AssertionError and message, as the model gives it, not a TypeError about
    converting."""
    torch.manual_seed(0)
    model, tokens = _ShiftedLM(), torch.randint(0, 50, (2, 17))
    gm = autocastfx.convert(model, (tokens[:, :-1], tokens[:, 1:]), dtype=BF16)
    gm.train(mode == "train")
    with pytest.raises(AssertionError, match="too long"):
        gm(torch.randint(0, 50, (2, 65)))


class _BranchesAndSpares(nn.Module):
    """A layer only training reads, one only eval reads (an auxiliary head, a distillation head), a layer and
    buffers nothing reads."""

    def __init__(self, export_only=False):
        super().__init__()
        self.body, self.tr, self.ev, self.spare = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(3, 3)
        self.head, self.export_only = nn.Linear(16, 4), export_only
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x):
        if self.export_only:
            b, *_ = x.shape  # noqa: F841 - symbolic_trace cannot unpack a traced size; torch.export captures it
        h = F.relu(self.body(x))
        return self.head(self.tr(h) if self.training else self.ev(h))


@pytest.mark.parametrize("export_only", [False, True], ids=["symbolic_trace", "torch.export"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_converted_module_holds_the_whole_model_at_its_names(export_only, mode):
    """Before: ``gm`` held only what its programs read. A layer only the other mode reads was held under a name of
    the converted module's own (``ev_weight_mode``), and a layer nothing reads was not held: ``gm.state_dict()``
    did not load into the model (strict), and with ``strict=False`` the eval head came back at its initial values
    (0.87 off). ``gm`` now holds every parameter and buffer of the model at the model's name, in its order."""
    torch.manual_seed(0)
    init, make = same_model(lambda: _BranchesAndSpares(export_only))
    model = make().train(mode == "train")
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    gm = autocastfx.convert(model, (x,), dtype=BF16)
    assert gm.meta["autocastfx"].capture == ("torch.export" if export_only else "symbolic_trace")
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in gm.named_parameters()] == names
    assert all(p is q for p, q in zip(gm.parameters(), model.parameters()))
    assert list(gm.state_dict()) == list(model.state_dict())  # the non-persistent buffer in neither
    assert isinstance(gm.spare, nn.Linear) and gm.spare.in_features == 3
    ref = make()
    opt, ref_opt = torch.optim.SGD(gm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((gm, opt), (ref, ref_opt)):  # trained in both modes: the eval head by a loss on eval outputs
        for training in (True, False, True):
            m.train(training)
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    fresh = _BranchesAndSpares(export_only)
    fresh.load_state_dict(gm.state_dict())  # strict: the checkpoint is the whole model
    for training in (True, False):
        for m in (gm, ref, fresh):
            m.train(training)
        with torch.no_grad():
            want = ref(x)
            assert _rel(gm(x), want) < 2e-2 and _rel(fresh(x), want) < 2e-2
    assert torch.equal(fresh.spare.weight, init["spare.weight"])
    gm.load_state_dict(init)  # the model's own checkpoint loads into gm, strict
    assert torch.equal(gm.ev.weight, init["ev.weight"]) and torch.equal(model.ev.weight, init["ev.weight"])


class _CausalBlock(nn.Module):
    def __init__(self, d, heads, block_size):
        super().__init__()
        self.ln, self.qkv, self.proj, self.heads = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln(x)).split(c, 2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(x)


class _TinyGPT(nn.Module):
    """nanoGPT's shape: a causal mask buffer sliced to the length, tied head, last position only without targets,
    and a generate loop that crops the context to the block size."""

    def __init__(self, vocab=64, block_size=16, d=32, heads=4, layers=2):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList([_CausalBlock(d, heads, block_size) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.block_size, "longer than the block size"
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, new_tokens):
        for _ in range(new_tokens):
            logits, _ = self(idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:])
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        return idx


@pytest.mark.parametrize("blocks", [None, "auto"])
def test_generate_runs_at_every_length_up_to_the_block_size_and_past_it(blocks):
    """A call of another structure (no targets) was converted at the first length it met, and torch.export fixed
    that length: generate from a short prompt failed with a bare "Guard failed: idx.size()[1] != 16" when the
    context reached the block size (the float32 model generates). Another length of the captured call also failed
    where a converted block fixed it. Each is now converted for its sizes where the capture fixed them."""
    torch.manual_seed(0)
    init, make = same_model(_TinyGPT)
    idx, tgt = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    gm = autocastfx.convert(make(), (idx, tgt), dtype=BF16, blocks=blocks)
    ref = make()
    for m in (gm, ref):
        m.eval()
    with torch.no_grad():
        for t in (4, 5, 9, 16):  # every length a generate from a prompt of 4 meets, the block size included
            got, want = gm(idx[:1, :t].clone())[0], ref(idx[:1, :t])[0]
            assert got.shape == want.shape == (1, 1, 64) and _rel(got, want) < 2e-2, t
        assert gm.generate(idx[:1, :4].clone(), 16).shape == (1, 20)  # past the block size: the context is cropped
        short, short_tgt = idx[:, :9].clone(), tgt[:, :9].clone()
        loss, ref_loss = gm(short, short_tgt)[1], ref(short, short_tgt)[1]
        assert abs(float(loss) - float(ref_loss)) < 2e-2 * float(ref_loss)


def test_a_held_container_of_every_child_is_indexed_as_the_models():
    """A loop that freezes the first blocks by position (``for b in gm.h[:1]``) or counts them (``len(gm.h)``) got a
    TypeError from a held container, as positions could miss a child that holds nothing. Where the container holds
    every child of the model's, it is indexed, sliced, iterated and measured as the model's; where one is absent,
    still refused."""
    torch.manual_seed(0)
    model, idx = _TinyGPT(), torch.randint(0, 64, (2, 16))
    gm = autocastfx.convert(model, (idx, idx), dtype=BF16, blocks=None)
    assert len(gm.h) == len(model.h) == 2 and gm.h[-1] is gm.get_submodule("h.1")
    assert [type(b).__name__ for b in gm.h] == ["Module", "Module"] and len(gm.h[:1]) == 1
    for block in gm.h[:1]:
        block.requires_grad_(False)
    assert {n for n, p in gm.named_parameters() if not p.requires_grad} == \
        {f"h.0.{n}" for n, _ in model.h[0].named_parameters()}
    assert isinstance(gm.h[0].mlp[1], nn.GELU) and len(gm.h[0].mlp) == 3

    class Gapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.ModuleList([nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4)])

        def forward(self, x):
            return self.seq[2](self.seq[0](x))

    gapped = autocastfx.convert(Gapped(), (torch.randn(2, 4),), dtype=BF16, blocks=None)
    assert list(gapped.seq._modules) == ["0", "2"]  # the Identity holds nothing: positions would not match
    with pytest.raises(TypeError, match=r"reach a child by its name.*module.get_submodule\('2'\)"):
        gapped.seq[2]
    with pytest.raises(TypeError, match="reach a child by its name"):
        len(gapped.seq)
    assert gapped.seq  # a module is true, as nn.Module's


class _ConvBnDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop, self.fc = nn.Dropout(0.5), nn.Linear(512, 10)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x))).flatten(1)))


def test_the_model_and_the_converted_module_are_in_one_mode():
    """An evaluate() helper given ``gm`` while the epoch loop calls ``model.train()`` (or the other way round): the
    later call decides even where it changes none of the model's flags. Before, ``gm.eval()`` left the model in
    training mode, so the next ``model.train()`` changed nothing and was missed: a whole epoch trained in eval mode
    (no statistics, no dropout), and after ``gm.train()``, ``model.eval()`` left validation moving the statistics."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    model = _ConvBnDrop()
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    tracked = lambda: int(model.bn.num_batches_tracked)  # noqa: E731
    gm.eval()
    gm(x)
    assert not model.training and not model.bn.training  # gm.eval() is the model's eval()
    model.train()
    before = tracked()
    gm(x)
    assert gm.training and tracked() == before + 1
    model.eval()
    gm(x)
    gm.train()
    gm(x)
    model.eval()
    before = tracked()
    with torch.no_grad():
        a, b = gm(x), gm(x)
    assert not gm.training and tracked() == before and torch.equal(a, b)
    # a module set on gm alone: the model's module takes it (at gm's next call, for a module the graph calls, as
    # this batch norm); the model's train() after it decides again
    gm.train()
    gm.bn.eval()
    before = tracked()
    gm(x)
    assert tracked() == before and not model.bn.training and model.training
    gm.fc.eval()  # a module whose tensors the graph reads: at once
    assert not model.fc.training
    gm.fc.train()
    model.train()
    gm(x)
    assert gm.bn.training and tracked() == before + 1
    # a copy (an EMA) keeps modes of its own
    ema = copy.deepcopy(gm)
    ema.eval()
    assert model.training and gm.training and not ema.training
    ema(x)
    gm(x)
    assert gm.training and model.bn.training


class _SizedBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        if x.shape[1] == 16:  # a branch on the length: torch.export fixes the block's length at the example's
            x = x * 1.0
        return x + torch.tanh(self.fc(x))


class _MovesBeforeBlocks(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp, self.bn, self.drop = nn.Linear(4, d), nn.BatchNorm1d(d), nn.Dropout(0.2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.blocks = nn.ModuleList([_SizedBlock(d) for _ in range(2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        self.calls.add_(1)
        h = self.drop(self.bn(self.inp(x).transpose(1, 2)).transpose(1, 2))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def test_a_call_a_block_refuses_for_its_length_moves_the_statistics_once():
    """A block whose capture fixed the length refuses a call at another length after the code before it ran (a
    batch norm, a counter, a dropout draw); the call is then run converted for its length. Before, that second run
    moved the statistics and the counter again (6 calls counted for 4) and drew other dropout masks."""
    torch.manual_seed(0)
    model = _MovesBeforeBlocks()
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (torch.randn(4, 16, 4),), dtype=torch.bfloat16)
    assert any(isinstance(getattr(m, "meta", {}).get("autocastfx"), autocastfx.ConvertInfo)
               for m in gm.blocks)  # the blocks are converted modules of their own
    for i, length in enumerate((16, 8, 8, 12, 16)):
        x = torch.randn(4, length, 4)
        torch.manual_seed(i)
        out = gm(x)
        torch.manual_seed(i)
        want = ref(x)
        assert int(model.calls) == int(ref.calls) == i + 1
        assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked)
        assert torch.allclose(model.bn.running_mean, ref.bn.running_mean, atol=1e-3)
        assert torch.allclose(model.bn.running_var, ref.bn.running_var, atol=1e-2)
        assert torch.allclose(out.float(), want, atol=0.05), length  # the same dropout draws


class _BranchesOnOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids):
        h = self.emb(ids)
        if ids.shape[1] == 1:  # a single-token path
            return self.fc(h) * 0.5
        if ids.shape[0] == 1:  # a single-sequence path
            return self.fc(h) * 0.25
        return self.fc(h)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_size_of_one_where_the_capture_left_the_size_free_runs_the_models_branch(compiled):
    """torch.export takes a size it leaves free to be 2 or more and records no check of it: a call of one token
    or one sequence ran the program of the example's branch, 100% off the model with nothing raised. Such a call
    is now converted for its sizes of 1 (once per pattern of them), eagerly and under torch.compile."""
    torch.manual_seed(0)
    model = _BranchesOnOne()
    gm = autocastfx.convert(model, (torch.randint(0, 50, (2, 8)),), dtype=torch.bfloat16)
    assert gm.meta["autocastfx"].capture == "torch.export"
    run = torch.compile(gm, backend="eager") if compiled else gm
    if compiled:
        torch._dynamo.reset()
    for shape in [(2, 8), (2, 5), (2, 1), (3, 1), (1, 1), (1, 7), (1, 9), (4, 6)]:
        ids = torch.randint(0, 50, shape)
        want, got = model(ids), run(ids).float()
        assert float((got - want).norm() / want.norm()) < 0.02, shape
    if not compiled:  # one conversion per pattern of sizes of 1: (., 1), (1, 1), (1, .)
        assert len(gm.meta["autocastfx_other_calls"].by_key) == 3


class _ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(512, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        if h.mean() > 10:  # on a value: no graph captures it, so the model converts piecewise
            h = h * 2
        return self.head(h)


def _piecewise_value_branch():
    """A seed-0 ``_ValueBranch``, its input, and its (piecewise) bfloat16 conversion."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    model = _ValueBranch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    return x, model, gm


@pytest.mark.parametrize("change", ["eval", "momentum", "buffer", "parameter"])
def test_a_piecewise_conversion_follows_or_refuses_changes_to_the_model(change):
    """Around its converted parts a piecewise conversion runs the model's own Python on modules of its own, which
    nothing watched: after ``model.eval()`` it went on training (statistics moved), a batch norm's new momentum was
    ignored, and a replaced buffer or parameter left ``gm`` and the model's state dict apart (0.98 off). As for a
    single graph, a mode is now followed and a replacement or a changed setting refused."""
    x, model, gm = _piecewise_value_branch()
    assert gm.meta["autocastfx"].capture == "piecewise"
    if change == "eval":
        model.eval()
        gm(x)
        assert not gm.training and not gm.bn.training and int(model.bn.num_batches_tracked) == 0
        return
    if change == "momentum":
        model.bn.momentum = 0.9
    elif change == "buffer":
        model.bn.running_mean = torch.zeros(8)
    else:
        model.bn.weight = nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="after convert"):
        gm(x)


def test_a_module_level_value_the_forward_reads_is_refused_once_changed(tmp_path, monkeypatch):
    """A module-level number or dict the model's forward reads (``x / TEMPERATURE * CFG["scale"]``) is held by the
    graph as the constant it was at conversion: changed later, the converted module went on with the old value,
    30x off the model with nothing said. The change is now refused at the next call, naming the name and the fix;
    set back to an equal value it runs."""
    (tmp_path / "glob_model.py").write_text(
        "import torch.nn as nn\n"
        "TEMPERATURE = 1.0\n"
        "CFG = {'scale': 1.0}\n"
        "class G(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) / TEMPERATURE * CFG['scale']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import glob_model
    x = torch.randn(4, 8)
    model = glob_model.G()
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    glob_model.TEMPERATURE = 1.0
    gm(x)
    glob_model.TEMPERATURE = 0.1
    with pytest.raises(ValueError, match=r"glob_model\.TEMPERATURE, which G\.forward reads, was set to 0\.1"):
        gm(x)
    glob_model.TEMPERATURE = 1.0
    gm(x)
    glob_model.CFG["scale"] = 3.0
    with pytest.raises(ValueError, match=r"glob_model\.CFG.*changed in place.*Convert again"):
        gm(x)
    glob_model.CFG["scale"] = 1.0
    assert torch.allclose(gm(x).float(), model(x), atol=0.05)


class _FrozenNormBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.bn(self.fc(x))


class _FrozenNorms(nn.Module):
    """A model whose train() keeps every batch norm frozen (a fine-tuned backbone's norm_eval)."""

    def __init__(self, d=8):
        super().__init__()
        self.blocks = nn.ModuleList([_FrozenNormBlock(d) for _ in range(3)])
        self.head = nn.Linear(d, 2)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()
        return self

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("blocks", ["auto", None])
def test_following_the_models_train_keeps_the_modes_its_own_train_sets(blocks):
    """model.eval(), then model.train() (which keeps the batch norms frozen), each followed by gm at its next call,
    and gm.train() itself: the frozen statistics never move and the model's own flags stay as its train() set them
    (handing gm's modes to the model while following it once set the frozen norms training, on the model too)."""
    torch.manual_seed(0)
    model, x = _FrozenNorms().train(), torch.randn(32, 8)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16, blocks=blocks)
    stats = lambda: torch.cat([b.bn.running_mean for b in model.blocks]).clone()  # noqa: E731
    frozen = lambda net: [m.training for m in net.modules() if isinstance(m, nn.BatchNorm1d)]  # noqa: E731
    for switch in ("model", "gm"):
        (model if switch == "model" else gm).eval()
        gm(x)
        (model if switch == "model" else gm).train()
        before = stats()
        gm(x)
        assert torch.equal(stats(), before), switch
        assert frozen(model) == [False] * 3 and model.training and model.head.training, switch
        assert frozen(gm) == [False] * 3 and gm.training, switch


def test_a_piecewise_conversion_and_its_model_are_in_one_mode():
    """gm.eval() for validation, then model.train() for the next epoch: the later call decides for a piecewise
    conversion too (its train() hands the modes to the model, as a single graph's does)."""
    x, model, gm = _piecewise_value_branch()
    gm.eval()
    gm(x)
    assert not model.training and not model.bn.training
    model.train()
    before = int(model.bn.num_batches_tracked)
    gm(x)
    assert gm.training and gm.bn.training and int(model.bn.num_batches_tracked) == before + 1
    model.scale = 2.0  # a plain setting of the model's own Python, added after convert(): not read by it
    gm(x)


class _CountingPiecewise(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head, self.calls = nn.Linear(8, 8), nn.Linear(8, 2), 0

    def forward(self, x):
        self.calls += 1  # state its own Python moves, on the model and on the piecewise conversion alike
        h = torch.relu(self.a(x))
        if h.sum() > 0:
            h = h * 2
        return self.head(h)


def test_a_piecewise_conversion_takes_an_attribute_its_forward_moves_for_state_not_a_setting():
    """A float32 run of the model moves the model's counter; the piecewise conversion's Python moves its own. That
    is no setting changed after convert(), and the next call runs (it was refused, every call after)."""
    torch.manual_seed(0)
    model, x = _CountingPiecewise(), torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    assert gm.meta["autocastfx"].capture == "piecewise"
    gm(x)
    with torch.no_grad():
        model(x)
    gm(x)


def test_two_conversions_of_one_model_share_its_mode_and_a_counter_the_forward_moves_is_no_constant(tmp_path,
                                                                                                  monkeypatch):
    """Two converted modules of one model are in its one mode, as two torch.compile wrappers of it are (convert a
    deepcopy for one of its own); a module-level dict the forward changes in place (a call counter) is not taken
    for a constant the graph holds, and is not refused."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    model = _ConvBnDrop()
    a = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    b = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    b.eval()
    a(x)
    assert not a.training and not model.training
    (tmp_path / "counting_model.py").write_text(
        "import torch.nn as nn\n"
        "CALLS = {'forward': 0}\n"
        "class C(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.l = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        CALLS['forward'] += 1\n"
        "        return self.l(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import counting_model
    net = counting_model.C()
    gm = autocastfx.convert(net, (torch.randn(2, 4),), dtype=torch.bfloat16)
    gm(torch.randn(2, 4))
    net(torch.randn(2, 4))
    gm(torch.randn(2, 4))
