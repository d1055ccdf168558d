"""The converted module answers the model's own attributes and methods, with ``self`` the converted module."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx


class Config:
    block_size = 16
    vocab = 50


class GPT(nn.Module):
    """A GPT written as nanoGPT writes one: a config attribute, helpers and a ``generate`` calling ``self``."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, 32)
        self.wpe = nn.Embedding(cfg.block_size, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, cfg.vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(F.gelu(self.fc(x)))

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    @property
    def context(self):
        return self.config.block_size

    @torch.no_grad()
    def generate(self, idx, steps):
        for _ in range(steps):
            logits = self(idx[:, -self.config.block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return idx


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_methods_attributes_and_properties_of_the_model():
    torch.manual_seed(0)
    model = GPT(Config())
    gm = autocastfx.convert(model, (torch.randint(0, 50, (2, 16)),), dtype=torch.bfloat16)
    assert gm.config is model.config and gm.context == 16
    assert gm.get_num_params() == model.get_num_params()

    calls = []
    gm.register_forward_hook(lambda *a: calls.append(1))
    start = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(1))
    out = gm.generate(start, 3)  # samples through the converted forward: `self` is gm
    assert out.shape == (1, 19) and len(calls) == 3
    assert torch.equal(out[:, :16], start)
    assert copy.deepcopy(gm).get_num_params() == model.get_num_params()
    with pytest.raises(AttributeError, match="no_such_thing"):
        gm.no_such_thing


@pytest.mark.parametrize("how", ["torch.compile(gm)", "gm.compile()"])
def test_train_step_over_a_compiled_module_follows_eager(how):
    """``train_step`` takes ``torch.compile(gm)`` (an ``OptimizedModule``: the step calls it, and finds the
    weights in the module it compiled) and a module compiled in place; the losses are eager's
    (backend aot_eager: Dynamo and AOTAutograd without code generation, fast on this CPU)."""
    def run(compile_it):
        torch.manual_seed(0)
        model = GPT(Config())
        gm = autocastfx.convert(model, (torch.randint(0, 50, (2, 16)),), dtype=torch.bfloat16)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
        if compile_it and how == "gm.compile()":
            gm.compile(backend="aot_eager")
            target = gm
        elif compile_it:
            target = torch.compile(gm, backend="aot_eager")
        else:
            target = gm
        step = autocastfx.train_step(target, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), opt)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randint(0, 50, (2, 16), generator=g)
            losses.append(float(step(x, torch.roll(x, -1, 1))))
        return losses, gm.state_dict()

    torch._dynamo.reset()
    eager, w_eager = run(False)
    compiled, w_compiled = run(True)
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-3, abs=1e-3)
    for k, v in w_eager.items():
        torch.testing.assert_close(w_compiled[k], v, rtol=1e-3, atol=1e-3)


class WithTargets(nn.Module):
    """A model that returns its loss when given targets (nanoGPT's ``forward(idx, targets=None)``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_a_call_of_another_structure_is_converted_on_first_use_on_the_same_weights():
    """A graph is captured for one call's structure; ``gm(x, y)`` on a module converted with ``(x,)`` is converted
    for that call on first use, from the model kept on meta, and runs on gm's own parameters and buffers
    (what the step trains), in gm's mode, through gm's hooks. The captured call spelled another way
    (``gm(idx=x)``) is no other call."""
    from autocastfx.base import keys as K
    torch.manual_seed(0)
    model, x = WithTargets(), torch.randint(0, 50, (2, 8))
    gm = autocastfx.convert(copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    assert gm(x)[1] is None and torch.equal(gm(idx=x)[0], gm(x)[0])
    assert not gm.meta.get(K.OTHER_CALLS) or not gm.meta[K.OTHER_CALLS].by_key
    step = autocastfx.train_step(gm, lambda out, y: F.cross_entropy(out[0].flatten(0, 1).float(), y.flatten()),
                                 torch.optim.AdamW(gm.parameters(), lr=1e-2))
    for _ in range(3):
        step(x, x)  # trains through the captured call: (x,) -> logits
    seen = []
    hook = gm.register_forward_hook(lambda m, a, out: seen.append(out[1] is not None))
    logits, loss = gm(x, x)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and seen == [True]
    hook.remove()
    (other, _), = gm.meta[K.OTHER_CALLS].by_key.values()
    assert gm(x, targets=x)[1] is not None and len(gm.meta[K.OTHER_CALLS].by_key) == 1  # one call, two spellings
    own = {id(p) for p in gm.parameters()}
    masters = {id(m) for m in autocastfx.master_parameters(gm)}
    assert all(id(p) in own for p in other.parameters())
    assert all(id(m) in masters for m in autocastfx.master_parameters(other)) and masters
    # it keeps no tensor of its own: every storage it holds is gm's (a lifted constant of a few elements aside)
    owned = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers(),
                                                       *autocastfx.master_parameters(gm)]}
    held = [t for m in other.modules() for t in [*m._parameters.values(), *m._buffers.values(),
                                                  *[v for v in vars(m).values() if isinstance(v, torch.Tensor)]]
            if t is not None] + autocastfx.master_parameters(other)
    assert held and all(t.untyped_storage().data_ptr() in owned or t.numel() <= 16 for t in held)
    trained = copy.deepcopy(model)  # the trained float32 weights, converted for (x, y) from the start
    trained.load_state_dict(gm.state_dict())
    both = autocastfx.convert(trained, (x, x), dtype=torch.bfloat16)
    ref_logits, ref_loss = both(x, x)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    step(x, x)  # one more update: the other call sees it at once, the same Parameter objects
    trained.load_state_dict(gm.state_dict())
    assert torch.equal(gm(x, x)[1], autocastfx.convert(trained, (x, x), dtype=torch.bfloat16)(x, x)[1])
    gm.eval()  # a conversion of its own for the modes the modules are in now, on the same tensors
    gm(x, x)
    (_, _), (evaluating, _) = gm.meta[K.OTHER_CALLS].by_key.values()
    assert other.training and not evaluating.training and all(id(p) in own for p in evaluating.parameters())
    with pytest.raises(IndexError):  # an error of the model's own, on a call of the captured shape: as it was
        gm(torch.full((2, 8), 99))


def test_the_models_own_checks_speak_on_a_call_of_another_structure():
    class Checked(WithTargets):
        def forward(self, idx, targets=None):
            assert idx.shape[1] <= 8, f"cannot forward a sequence of {idx.shape[1]} tokens, block size is 8"
            return super().forward(idx, targets)

    x = torch.randint(0, 50, (2, 8))
    gm = autocastfx.convert(Checked(), (x, x), dtype=torch.bfloat16)
    assert gm(x)[1] is None  # the other call, converted
    long = torch.randint(0, 50, (2, 12))
    for call in (lambda: gm(long, long), lambda: gm(long)):
        with pytest.raises(AssertionError, match="cannot forward a sequence of 12 tokens, block size is 8"):
            call()


class ReadsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        y = self.fc(x)
        if scale is not None:  # a float32 op on the weight: this call's plan reads it in float32 too
            y = y * torch.exp(self.fc.weight).mean() * scale
        return y


def test_a_call_whose_plan_reads_a_weight_otherwise_runs_on_the_same_float32_parameter():
    """The first call's graph reads ``fc.weight`` only through its cast to the low dtype, the other call's reads
    it in float32 as well: both run on the one float32 parameter, the model's, each casting what it needs."""
    from autocastfx.base import keys as K
    torch.manual_seed(0)
    x, scale = torch.randn(2, 8), torch.tensor(2.0)
    model = ReadsItsWeight()
    ref = copy.deepcopy(model)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    assert gm.fc.weight is model.fc.weight and gm.fc.weight.dtype == torch.float32
    assert any(p is gm.fc.weight for p in autocastfx.master_parameters(gm))  # read low only, here
    out = gm(x, scale)
    (other, _), = gm.meta[K.OTHER_CALLS].by_key.values()
    assert other.fc.weight is gm.fc.weight and other.fc.bias is gm.fc.bias
    assert not any(p is gm.fc.weight for p in autocastfx.master_parameters(other))  # exp reads it in float32
    assert "exp = torch.exp(fc_weight)" in other.code and "to_bf16_fc_weight = fc_weight.to(torch.bfloat16)" \
        in other.code
    assert torch.equal(out, autocastfx.convert(ref, (x, scale), dtype=torch.bfloat16)(x, scale))
    with torch.no_grad():
        gm.fc.weight.mul_(0.5)  # a change of the one parameter: both calls see it
    ref.load_state_dict(model.state_dict())
    assert torch.equal(gm(x, scale), autocastfx.convert(ref, (x, scale), dtype=torch.bfloat16)(x, scale))
    gm2 = autocastfx.convert(nn.Sequential(nn.Linear(8, 8)), (x,), dtype=torch.bfloat16)  # traced from a module
    with pytest.raises(TypeError, match=r"converted for a call \(float32 tensor\) and was called with"):
        gm2(x, x)  # nn.Sequential takes one input: no conversion for this call, the refusal names both


def test_hugging_face_generate_and_save_pretrained_through_the_converted_module(tmp_path):
    """``gm.generate()`` samples through the converted forward (converted for the call generate makes: no cache),
    greedy tokens as the float32 model's; ``gm.save_pretrained`` writes the float32 weights, which
    ``from_pretrained`` loads as the model's own weights."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    gm = autocastfx.convert(model, example_kwargs={"input_ids": ids, "use_cache": False, "return_dict": True},
                            dtype=torch.bfloat16).eval()
    assert gm.config.to_dict() == model.config.to_dict() and gm.dtype == torch.float32
    out = gm.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert out.shape == (1, 12)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False))
    gm.save_pretrained(tmp_path)
    loaded = tf.LlamaForCausalLM.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert loaded.state_dict()[k].dtype == torch.float32 and torch.equal(loaded.state_dict()[k], v), k
    # a method that reshapes the model's tensors in place is refused before it changes anything, the model's too
    before = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(\) changes the model's tensor shapes"):
        gm.resize_token_embeddings(160)
    assert {k: v.shape for k, v in model.state_dict().items()} == before
    assert {k: v.shape for k, v in gm.state_dict().items()} == before


class Checked(nn.Module):
    """A model that checks its inputs as nanoGPT does (an assert with a message) and with torch._check."""

    def __init__(self, block_size=16):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(50, 32)
        self.wpe = nn.Embedding(block_size, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, idx):
        B, T = idx.shape
        assert T <= self.block_size, f"cannot forward a sequence of {T} tokens, block size is {self.block_size}"
        torch._check(B % 2 == 0, lambda: f"the batch must be even, got {B}")
        return self.head(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))


@pytest.mark.parametrize("blocks", ["auto", None])
def test_the_models_own_checks_raise_their_own_messages(blocks):
    x = torch.randint(0, 50, (2, 8))
    gm = autocastfx.convert(Checked(), (x,), dtype=torch.bfloat16, blocks=blocks)
    assert gm(torch.randint(0, 50, (4, 12))).shape == (4, 12, 50)  # other sizes the model allows still run
    with pytest.raises(AssertionError, match="cannot forward a sequence of 17 tokens, block size is 16") as e:
        gm(torch.randint(0, 50, (2, 17)))
    assert e.value.__cause__ is not None  # the converted module's own error, chained
    with pytest.raises(RuntimeError, match="the batch must be even, got 3"):
        gm(torch.randint(0, 50, (3, 8)))
    # an error that is no check of the model's stays the converted module's: out-of-range token ids
    with pytest.raises(IndexError):
        gm(torch.full((2, 8), 99))
    # what the meta twin holds costs no memory, and a deep copy or a save keeps working
    assert all(t.is_meta for t in gm.meta["autocastfx"].checks.model.parameters())
    copy.deepcopy(gm)


@pytest.mark.parametrize("dropout", ["functional", "module, exported"])
@pytest.mark.parametrize("how", ["torch.compile(gm)", "gm.compile()"])
def test_a_compiled_module_runs_the_program_of_its_mode_and_compiles_each_mode_once(how, dropout):
    """torch.compile guards on what the traced code reads; the programs hold the mode as constants, so a compiled
    module kept running its first mode's program after gm.eval() (dropout on in eval: a silent wrong answer).
    The converted module reads its mode where the compiler traces, and each mode keeps the forward written for
    it: one compile per mode, whatever the number of switches."""
    from torch._dynamo.testing import CompileCounter

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):  # functional dropout: written into the graph, one program per mode
            return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, self.training))

    class ModuleDropout(Net):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):  # a traced shape: torch.export, which writes the module's mode as the op's flag
            b, *_ = x.shape  # noqa: F841
            return self.fc2(self.drop(F.relu(self.fc1(x))))

    torch._dynamo.reset()
    x = torch.randn(8, 16)
    gm = autocastfx.convert(Net() if dropout == "functional" else ModuleDropout(), (x,), dtype=torch.bfloat16)
    assert "autocastfx_programs" in gm.meta  # one program per mode
    assert gm.meta["autocastfx"].capture == ("symbolic_trace" if dropout == "functional" else "torch.export")
    eager = {}
    for mode in (True, False):
        gm.train(mode)
        torch.manual_seed(0)
        eager[mode] = gm(x)
    assert not torch.equal(eager[True], eager[False])
    counter = CompileCounter()
    if how == "gm.compile()":
        gm.compile(backend=counter)
        compiled = gm
    else:
        compiled = torch.compile(gm, backend=counter)
    for mode in (True, False, True, False, True, False):
        gm.train(mode)
        torch.manual_seed(0)
        assert torch.equal(compiled(x), eager[mode]), (how, mode)
    assert counter.frame_count == 2, counter.frame_count
    # an edit of the graph drops the kept code: the next switch writes it again
    gm.recompile()
    assert not gm.meta["autocastfx_programs"].code


def test_the_model_checks_do_not_mistake_other_errors_and_do_not_stop_a_save():
    """A model whose code needs a real device cannot judge calls on meta (its twin is not kept); torch's own
    kernel checks are no model check; a converted module with a lambda hook inside saves whole."""
    class DeviceAssert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            assert x.device.type == "cpu", "model wants cpu"
            return self.fc(x)

    gm = autocastfx.convert(DeviceAssert(), (torch.randn(2, 8),), dtype=torch.bfloat16)
    with pytest.raises(Exception) as e:  # the wrong width: the converted module's error, not "model wants cpu"
        gm(torch.randn(2, 9))
    assert "model wants cpu" not in str(e.value)
    assert gm.meta["autocastfx"].checks.usable is False  # its model on meta fails the example's call too

    class Hooked(Checked):
        def __init__(self):
            super().__init__()
            self.calls = []
            self.head.register_forward_hook(lambda m, a, o: self.calls.append(1))

    model = Hooked()
    gm = autocastfx.convert(model, (torch.randint(0, 50, (2, 8)),), dtype=torch.bfloat16, blocks=None)
    twin = gm.meta["autocastfx"].checks.model
    assert twin is not None and not any(m._forward_hooks for m in twin.modules())  # the user's hooks not kept
    with pytest.raises(AssertionError, match="sequence of 17 tokens"):
        gm(torch.randint(0, 50, (2, 17)))
    assert copy.deepcopy(gm).meta["autocastfx"].checks is gm.meta["autocastfx"].checks  # shared by copies
    # what the twin holds never goes into a pickle (a model's lambdas may not pickle): dropped, not an error
    import pickle
    assert pickle.loads(pickle.dumps(gm.meta["autocastfx"].checks)).model is None
    assert "blocks=" in str(autocastfx.report(gm))


def test_a_compiled_module_compiles_once_for_every_batch_and_sequence_length():
    """torch.compile specialises a first call's sizes and recompiles on a new one (12 s for a small GPT on a CPU).
    A converted module marks its inputs' free sizes (the batch, a token input's length) maybe-dynamic before a
    compiled call, under ``gm.compile()`` and under ``train_step(torch.compile(gm))``: one compile for them all,
    and the outputs and losses are eager's."""
    from torch._dynamo.testing import CompileCounter

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc1, self.fc2 = nn.Embedding(50, 16), nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, ids):
            return self.fc2(F.relu(self.fc1(self.emb(ids))))

    def batch(b, t):
        g = torch.Generator().manual_seed(b * 100 + t)
        return torch.randint(0, 50, (b, t), generator=g), torch.randint(0, 4, (b, t), generator=g)

    sizes = [(8, 12), (4, 12), (6, 10), (3, 7), (8, 12)]
    torch.manual_seed(0)
    model = Tagger()
    gm = autocastfx.convert(copy.deepcopy(model), (batch(8, 12)[0],), dtype=torch.bfloat16).eval()
    eager = [gm(batch(*s)[0]) for s in sizes]
    torch._dynamo.reset()
    counter = CompileCounter()
    gm.compile(backend=counter)
    for s, want in zip(sizes, eager):
        torch.testing.assert_close(gm(batch(*s)[0]), want, rtol=0, atol=0)
    assert counter.frame_count == 1, counter.frame_count

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())

    def train(compiled):
        torch.manual_seed(0)
        gm = autocastfx.convert(copy.deepcopy(model), (batch(8, 12)[0],), dtype=torch.bfloat16)
        counter = CompileCounter()
        target = torch.compile(gm, backend=counter) if compiled else gm
        step = autocastfx.train_step(target, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-2))
        return [float(step(*batch(*s))) for s in sizes], counter.frame_count

    torch._dynamo.reset()
    (eager_losses, _), (losses, frames) = train(False), train(True)
    assert frames == 1, frames
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-5)
