"""Routers in float32: a gating linear whose scores reach a topk/argmax/sort computes its logits and its choice in
float32 (Switch Transformer's selective precision, Megatron, DeepSeek-V3), found by behaviour; its experts stay
low; a model without routing is planned as before. At the aten level, and on Hugging Face MoE models against
float32 and torch.autocast."""
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import autocastfx
from autocastfx.base.meta import is_converted as is_unit
from helpers import AtenRecorder
from small_models import TinyGPT

OFF = autocastfx.Policy.default().override(fp32_routers=False)


class MoE(nn.Module):
    """Top-k of a few experts: a softmax router (Mixtral) or a sigmoid one with a correction bias that only
    the choice reads (DeepSeek-V3)."""

    def __init__(self, d=32, hidden=64, experts=4, k=2, score="softmax"):
        super().__init__()
        self.k, self.score = k, score
        self.gate = nn.Linear(d, experts, bias=False)
        self.register_buffer("correction", torch.linspace(-0.01, 0.01, experts))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d))
                                     for _ in range(experts))

    def forward(self, x):
        logits = self.gate(x)
        probs = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        idx = (probs if self.score == "softmax" else probs + self.correction).topk(self.k, dim=-1).indices
        w = probs.gather(-1, idx)
        weights = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        out = torch.stack([e(x) for e in self.experts], dim=-2)
        return (out * weights.unsqueeze(-1)).sum(-2)


class TopK(TorchDispatchMode):
    """The experts each topk chose, in call order (one per router)."""

    def __init__(self):
        super().__init__()
        self.chosen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._opname == "topk":
            self.chosen.append(out[1].sort(-1).values)
        return out


def rows(gm):
    """Report rows of a converted module and of each block in it."""
    return [r for _, m in gm.named_modules() if is_unit(m) for r in autocastfx.report(m).rows]


def gemms(rec):
    """(in dtypes, output width) of each matmul the recorder saw."""
    return [(c.in_dtypes, c.in_shapes[-1][-1]) for c in rec.ops("mm", "addmm", "bmm")]


# ------------------------------------------------------------------------------------- a hand-written layer

@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_float32_experts_low_at_the_aten_level(score):
    torch.manual_seed(0)
    model, x = MoE(score=score).eval(), torch.randn(2, 8, 32)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16)
    with torch.no_grad(), AtenRecorder() as rec:
        gm(x)
    router = [d for d, width in gemms(rec) if width == 4]
    experts = [d for d, width in gemms(rec) if width != 4]
    assert router and all(d == [torch.float32] * len(d) for d in router), router
    assert len(experts) == 8 and all(torch.bfloat16 in d and torch.float32 not in d for d in experts), experts
    why = {r.name: r.reason for r in autocastfx.report(gm).rows}  # the router is the model's; experts are blocks
    assert why["linear"].startswith("router: feeds topk (topk) through "), why["linear"]
    assert why["topk"].startswith("router: the choice of the gate linear"), why["topk"]
    # the router's weight is the model's float32 parameter, which the gate linear reads as it is: no node casts
    # it (the experts' weights are cast low once per forward in their blocks)
    assert "kept float32" in why["gate_weight"], why["gate_weight"]
    (gate,) = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "gate.weight"]
    assert gate.users and not any(u.meta["autocastfx"].kind == "cast" for u in gate.users), list(gate.users)
    assert gm.gate.weight is model.gate.weight and gm.gate.weight.dtype == torch.float32
    assert not any(p is gm.gate.weight for p in autocastfx.master_parameters(gm))
    assert all(any(p is e[0].weight for p in autocastfx.master_parameters(gm)) for e in model.experts)

    off = autocastfx.convert(model, (x,), dtype=torch.bfloat16, policy=OFF)  # the switch: a gate like any linear
    with torch.no_grad(), AtenRecorder() as rec:
        off(x)
    assert all(torch.bfloat16 in d for d, _ in gemms(rec))
    assert not any(r.reason.startswith("router") for r in rows(off))


def test_a_class_given_by_name_wins():
    torch.manual_seed(0)
    model, x = MoE().eval(), torch.randn(2, 8, 32)
    gm = autocastfx.convert(model, (x,), dtype=torch.bfloat16,
                            policy=autocastfx.Policy.default().override(module_names={"gate": "low"}))
    why = {r.name: (r.dtype, r.reason) for r in autocastfx.report(gm).rows}
    assert why["linear"] == ("bf16", "module name 'gate'")


# ------------------------------------------------------------------------------------- Hugging Face MoE

def transformers():
    return pytest.importorskip("transformers", reason="needs transformers: pip install 'autocastfx[hf]'")


def mixtral(seed):
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, use_cache=False)
    return tf.MixtralForCausalLM(cfg).eval()


def qwen2_moe(seed):
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            use_cache=False)
    return tf.Qwen2MoeForCausalLM(cfg).eval()


def against_float32(model, ids, dtype):
    """(max error, tokens routed elsewhere) of the converted model and of torch.autocast, against float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops of the experts' fallback that the policy does not list
        gm = autocastfx.convert(model, (ids,), dtype=dtype)
    runs = {}
    for name, run in (("float32", lambda: model(ids)), ("autocastfx", lambda: gm(ids))):
        with torch.no_grad(), TopK() as tk:
            runs[name] = run().logits.float(), tk.chosen
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype), TopK() as tk:
        runs["autocast"] = model(ids).logits.float(), tk.chosen
    ref, chosen = runs["float32"]
    assert len(chosen) == 2
    return gm, {k: ((y - ref).abs().max().item(), sum(int((c != r).any(-1).sum()) for c, r in zip(ch, chosen)))
                for k, (y, ch) in runs.items() if k != "float32"}


@pytest.mark.parametrize("dtype, seed, tokens", [(torch.bfloat16, 10, 32), (torch.float16, 0, 8)], ids=["bf16", "fp16"])
def test_mixtral_routes_every_token_as_float32(dtype, seed, tokens):
    """Blocks on (the default): each decoder layer a module of its own, its input arriving low. On these inputs
    the bfloat16 gate sent one token to another expert (error 0.038 against autocast's 0.0025)."""
    model = mixtral(seed)
    ids = torch.randint(0, 128, (1, tokens))
    gm, got = against_float32(model, ids, dtype)
    (err, flips), (err_ac, _) = got["autocastfx"], got["autocast"]
    print(f"mixtral {dtype}: autocastfx {err:.5f} ({flips} tokens routed elsewhere), autocast {err_ac:.5f}")
    assert flips == 0
    assert err <= 2 * err_ac, (err, err_ac)
    gates = [r for r in rows(gm) if r.reason.startswith("router: feeds topk")]
    assert len(gates) == 2 and all(r.dtype == "fp32" for r in gates)


def test_qwen2_moe_router_float32_shared_expert_gate_low():
    """The shared expert's sigmoid gate scales an output and chooses nothing: it stays low."""
    model = qwen2_moe(0)
    ids = torch.randint(0, 128, (1, 16))
    gm, got = against_float32(model, ids, torch.bfloat16)
    (err, flips), (err_ac, _) = got["autocastfx"], got["autocast"]
    print(f"qwen2-moe bf16: autocastfx {err:.5f} ({flips} tokens routed elsewhere), autocast {err_ac:.5f}")
    assert flips == 0 and err <= 2 * err_ac, got
    linears = [r for r in rows(gm) if r.target == "aten.linear.default"]
    gates = [r for r in linears if r.reason.startswith("router: feeds topk")]
    assert len(gates) == 2 and all(r.dtype == "fp32" for r in gates)
    # per layer q k v o, the shared expert (3) and its gate; the LM head
    assert [r.dtype for r in linears if r not in gates] == ["bf16"] * (2 * 8 + 1)


# ------------------------------------------------------------------------------------- no routing

@pytest.mark.parametrize("greedy", [False, True], ids=["logits", "argmax"])
def test_a_model_without_a_router_is_planned_as_before(greedy):
    """No topk: nothing changes. An LM head before an argmax is wider than its input: not a router, left low."""
    torch.manual_seed(0)
    gpt, ids = TinyGPT(), torch.randint(0, 101, (2, 16))
    model = nn.Sequential(gpt, *([Argmax()] if greedy else [])).eval()
    on, off = (autocastfx.convert(model, (ids,), dtype=torch.bfloat16, policy=p) for p in (None, OFF))
    assert [(r.name, r.dtype, r.reason) for r in rows(on)] == [(r.name, r.dtype, r.reason) for r in rows(off)]
    assert not any(r.reason.startswith("router") for r in rows(on))
    assert all(r.dtype == "bf16" for r in rows(on) if r.target in ("linear", "torch._C._nn.linear"))


class Argmax(nn.Module):
    def forward(self, logits):
        return logits.argmax(-1)
