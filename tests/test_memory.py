"""Memory of a training step against autocast + GradScaler, counted as bench/ counts it (tensor storage alive,
by holder), and what the step keeps between calls."""
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import autocastfx
from small_models import ALL, example

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from measure import Runner  # noqa: E402


def _workload(name):
    model, inputs = example(name, batch=4)
    if name == "gpt":
        return model, inputs, torch.roll(inputs[0], -1, 1), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
    return model, inputs, torch.arange(4) % 10, F.cross_entropy


@pytest.mark.parametrize("name", ALL)
def test_between_steps_no_more_than_autocast(name):
    model, inputs, target, loss_fn = _workload(name)
    ac = Runner("autocast", model, inputs, target, loss_fn).memory()
    fx = Runner("autocastfx", model, inputs, target, loss_fn).memory()
    assert fx.grads == 0  # no gradient of any precision is kept between steps
    assert fx.between <= ac.between, (fx, ac)
    # the peak: float32 masters + float16 weights + optimizer state + the float32 gradients of one update;
    # autocast holds float32 weights + float32 gradients + optimizer state. Within 10% on these small models,
    # where weights, not activations, dominate
    assert fx.peak <= 1.10 * ac.peak, (fx.peak, ac.peak)


def test_master_gradients_are_freed_after_each_update():
    model, inputs, target, loss_fn = _workload("resnet")
    gm = autocastfx.convert(model, inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    for _ in range(2):
        step(inputs, target)
        assert all(p.grad is None for p in gm.parameters())
        assert all(m.grad is None for m in autocastfx.master_parameters(gm))
    assert not hasattr(step, "master_grads")


def test_load_state_dict_copies_the_checkpoint_and_keeps_the_fused_skip():
    model, inputs, target, loss_fn = _workload("resnet")
    gm = autocastfx.convert(model, inputs)
    step = autocastfx.train_step(gm, loss_fn, torch.optim.AdamW(gm.parameters(), lr=1e-3))
    step(inputs, target)
    sd = step.state_dict()
    for group in sd["optimizer"]["param_groups"]:  # as a checkpoint of a plain optimizer would have it
        group["fused"] = False
    kept = copy.deepcopy(sd["optimizer"]["state"])
    step.load_state_dict(sd)
    assert all(g["fused"] for g in step.optimizer.param_groups)
    for _ in range(2):
        step(inputs, target)
    for k, st in kept.items():  # training on did not write into the caller's checkpoint
        for n, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, sd["optimizer"]["state"][k][n]), (k, n)
