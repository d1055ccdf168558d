"""On a CUDA device: the same guarantees where they matter most (skipped without one)."""
import pytest
import torch
import torch.nn.functional as F

import autocastfx
from helpers import AtenRecorder
from small_models import example
from test_step import SyncCounter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", ["resnet", "vit", "gpt"])
def test_cuda_policy_and_training_without_host_syncs(name):
    model, inputs = example(name, batch=8)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    gm = autocastfx.convert(model, inputs)
    rec = AtenRecorder()
    with rec:
        out = gm(*inputs)
    for c in rec.ops("convolution", "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        assert all(d == torch.float16 for d in c.in_dtypes if d.is_floating_point), c
    target = torch.zeros(out.shape[:-1], dtype=torch.long, device="cuda")

    def loss_fn(o, t):
        return F.cross_entropy(o.flatten(0, -2), t.flatten())

    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    for _ in range(3):
        step(inputs, target)
    torch.cuda.synchronize()
    counter = SyncCounter()
    with counter:
        for _ in range(5):
            loss = step(inputs, target)
    assert counter.syncs == []
    torch.cuda.synchronize()
    assert torch.isfinite(loss)


def test_cuda_softmax_upcast_has_no_cast_kernel():
    x = torch.randn(4, 64, device="cuda").half()
    rec = AtenRecorder()
    with rec:
        torch.softmax(x, -1, dtype=torch.float32)
    assert rec.float_casts() == []
