"""Policy(widest=True): autocast's widest-type rule inside the min-cut. Checked at the aten level: the residual
stream and the embeddings of a transformer stay float32, every matmul still runs low, a convnet's stream (which
starts at a low convolution) stays low; the same plan on the meta device as on the materialised model."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples"))
import train_nanogpt as nano  # noqa: E402

WIDEST = autocastfx.Policy.default().override(widest=True)
MIN_CUT = autocastfx.Policy.default().override(widest=False)


def _gpt():
    torch.manual_seed(0)
    return nano.GPT(nano.GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))


def _adds_on_the_stream(rec, shape):
    return [c for c in rec.ops("add") if len(c.in_shapes) == 2 and c.in_shapes[0] == c.in_shapes[1] == shape]


@pytest.mark.parametrize("blocks", ["auto", None])
def test_the_residual_stream_and_embeddings_stay_float32_and_matmuls_run_low(blocks):
    x = torch.randint(0, 40, (2, 16))
    y = torch.randint(0, 40, (2, 16))
    outs, costs = {}, {}
    for name, policy in (("widest", WIDEST), ("min-cut", MIN_CUT)):
        gm = autocastfx.convert(_gpt(), (x, y), dtype=torch.bfloat16, policy=policy, blocks=blocks).eval()
        with AtenRecorder() as rec, torch.no_grad():
            outs[name] = gm(x, y)
        stream = _adds_on_the_stream(rec, (2, 16, 32))
        assert len(stream) >= 4  # two residual adds per block
        mm = rec.ops("mm", "addmm", "bmm", "linear", "_scaled_dot_product_flash_attention_for_cpu")
        assert mm and all(d == torch.bfloat16 for c in mm for d in c.in_dtypes if d.is_floating_point)
        assert gm.wte.weight.dtype == torch.float32  # the model's own parameter, whichever the plan
        read_low = any(p is gm.wte.weight for p in autocastfx.master_parameters(gm))
        if name == "widest":
            assert all(c.in_dtypes == [torch.float32, torch.float32] for c in stream), stream
            assert {c.out_dtypes[0] for c in rec.ops("embedding")} == {torch.float32}
            assert not read_low  # read by the embedding as it is, which does not round it
        elif blocks == "auto":
            # the blocks take the stream in the dtype the model around them chooses: the min-cut's is low, the
            # embedding reading the table's low cast (the one the tied LM head reads)
            assert any(torch.bfloat16 in c.in_dtypes for c in stream)  # the min-cut's stream is low
            assert read_low and {c.out_dtypes[0] for c in rec.ops("embedding")} == {torch.bfloat16}
        if blocks is None:  # one graph: the plan's cast cost, (elements, casts)
            costs[name] = gm.meta["autocastfx"].plan.after
    if blocks is None:
        # the weights cast every forward, an embedding read low costs a cast of its table each forward too: the
        # one graph's min-cut may then keep the float32 stream of widest, never at a higher cost than widest
        assert costs["min-cut"][0] <= costs["widest"][0], costs
    with torch.no_grad():
        ref = _gpt()(x, y)[0]
    err = {k: float((v[0].float() - ref).norm() / ref.norm()) for k, v in outs.items()}
    assert err["widest"] < 2e-2 and err["min-cut"] < 2e-2, err


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.b2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(h + self.b2(self.c2(h)))  # a residual add of two low values
        return self.fc(h.mean((2, 3)))


def test_a_convnets_stream_stays_low_as_under_autocast():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    gm = autocastfx.convert(_ConvNet(), (x,), dtype=torch.bfloat16, policy=WIDEST).eval()
    with AtenRecorder() as rec, torch.no_grad():
        gm(x)
    stream = _adds_on_the_stream(rec, (2, 16, 8, 8))
    assert stream and all(c.in_dtypes == [torch.bfloat16, torch.bfloat16] for c in stream)


def test_widest_is_the_same_plan_on_meta_and_materialised_with_blocks():
    x = torch.randint(0, 40, (2, 16))
    y = torch.randint(0, 40, (2, 16))
    real = autocastfx.convert(_gpt(), (x, y), dtype=torch.bfloat16, policy=WIDEST)
    with torch.device("meta"):
        torch.manual_seed(0)
        meta_model = nano.GPT(nano.GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32,
                                             dropout=0.0))
    on_meta = autocastfx.convert(meta_model, (x, y), dtype=torch.bfloat16, policy=WIDEST)
    on_meta = autocastfx.materialize(on_meta, "cpu", _gpt().state_dict())
    assert on_meta.code == real.code
    for (n, a), (m, b) in zip(real.named_modules(), on_meta.named_modules()):
        assert n == m and getattr(a, "code", None) == getattr(b, "code", None), n
    with torch.no_grad():
        assert torch.equal(real.eval()(x, y)[0], on_meta.eval()(x, y)[0])


def test_the_report_and_a_saved_policy_say_widest(tmp_path):
    x = torch.randint(0, 40, (2, 16))
    gm = autocastfx.convert(_gpt(), (x, x), dtype=torch.bfloat16, policy=WIDEST)
    assert "Policy.widest" in str(autocastfx.report(gm))
    autocastfx.save(gm, tmp_path / "m", (x, x))
    assert autocastfx.load(tmp_path / "m").meta["autocastfx"].policy.widest
    with pytest.raises(ValueError, match="widest must be True"):
        autocastfx.Policy.default().override(widest="yes")
