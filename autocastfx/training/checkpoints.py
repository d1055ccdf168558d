"""TODO"""
from __future__ import annotations
import os
from typing import Any
import torch
from .checks import StepError
from .step import TrainStep, all_masters


def _named_state(step: TrainStep) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """(name -> float32 tensor the optimizer steps, id(tensor) -> name) over every converted unit: the masters
    under their weight's name, float32 parameters under their own."""
    gm = step.gm
    named: dict[str, torch.Tensor] = dict(all_masters(gm))
    low_ids = {id(p) for p in step.lows}
    for n, p in gm.named_parameters():
        if id(p) not in low_ids and p.requires_grad:
            named.setdefault(n, p)
    return named, {id(t): n for n, t in named.items()}


def _checkpoint_state(step: TrainStep) -> dict[str, Any]:
    named, name_of = _named_state(step)
    opt = step.optimizer
    low_ids = {id(p) for p in step.lows}
    master_names = set(named)
    module = {k: v for k, v in step.gm.state_dict().items() if k not in master_names}
    for n, p in step.gm.named_parameters():
        if id(p) in low_ids:
            module.pop(n, None)  # the low copies are the masters rounded: not saved, made again on load
    optim_state, groups = {}, []
    for group in opt.param_groups:
        names = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None:
                raise StepError("the optimizer holds a tensor that is neither a master nor a parameter of the module")
            names.append(name)
            st = opt.state.get(p)
            if st:
                optim_state[name] = dict(st)
        groups.append({**{k: v for k, v in group.items() if k != "params" and not torch.is_tensor(v)},
                       "lr": float(group["lr"]), "params": names})
    return {"weights": named, "module": module,
            "optimizer": {"state": optim_state, "param_groups": groups},
            "scaler": {k: v for k, v in step.state.state_dict().items() if torch.is_tensor(v)},
            "extra": {"micro": step.micro, "auto_pending": step.state.auto_pending}}


def _init_optimizer_state(step: TrainStep) -> None:
    """Create the optimizer's per-parameter state (an update at lr 0 over zero gradients) so that a checkpoint can
    be read into it in place, as torch.distributed.checkpoint loads."""
    opt = step.optimizer
    params = step.optimizer_params
    if all(opt.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    saved = {}
    for p in params:
        saved[id(p)] = p.detach().clone()
        p.grad = torch.zeros_like(p)
    opt.grad_scale = opt.found_inf = None
    with torch.no_grad():
        opt.step()
        for p in params:
            p.copy_(saved[id(p)])
            p.grad = None
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def save_checkpoint(step, path: str | os.PathLike) -> None:
    """Write ``step``'s whole training state to the directory ``path`` with ``torch.distributed.checkpoint``: every
    rank writes its own shards (call it on every rank). Float32 weights (masters, or the sharded parameters that
    are masters), buffers, optimizer state by parameter name, the loss-scaler state."""
    import torch.distributed.checkpoint as dcp
    step = getattr(step, "step", step)  # a CudaGraphStep: its eager step holds the state
    dcp.save(_checkpoint_state(step), checkpoint_id=os.fspath(path))


def load_checkpoint(step, path: str | os.PathLike) -> None:
    """Read a checkpoint written by :func:`save_checkpoint` into ``step`` (call it on every rank), whatever the
    number of ranks that wrote it: one process, DDP or FSDP2, with or without :func:`shard`. The low-precision
    weights are made again from the loaded masters; gradients of unfinished micro-batches are dropped."""
    import torch.distributed.checkpoint as dcp
    step = getattr(step, "step", step)
    _init_optimizer_state(step)
    sd = _checkpoint_state(step)
    saved_groups = sd["optimizer"]["param_groups"]
    dcp.load(sd, checkpoint_id=os.fspath(path))
    opt = step.optimizer
    named, name_of = _named_state(step)
    if [g["params"] for g in sd["optimizer"]["param_groups"]] != [g["params"] for g in saved_groups]:
        raise StepError("the checkpoint's optimizer groups hold other parameters than this optimizer's: was it "
                        "written by a step over the same model, with the optimizer built the same way?")
    for group, loaded in zip(opt.param_groups, sd["optimizer"]["param_groups"]):
        for k, v in loaded.items():
            if k in ("params", "fused", "foreach", "capturable", "differentiable"):
                continue
            if k == "lr" and torch.is_tensor(group["lr"]):
                group["lr"].fill_(v)
            else:
                group[k] = v
    with torch.no_grad():
        for p in step.optimizer_params:  # state was loaded in place; the step count too where it is a tensor
            st = sd["optimizer"]["state"].get(name_of[id(p)], {})
            for k, v in st.items():
                if not torch.is_tensor(v):
                    opt.state[p][k] = v
        if step.lows:
            torch._foreach_copy_(step.parallel.locals(step.lows), step.parallel.locals(step.masters))
        for p in step.grad_holders:
            p.grad = None
        step.parallel.drop_unsynced_grads()
    scaler = dict(sd["scaler"])
    scaler["auto_pending"] = bool(sd["extra"]["auto_pending"])
    step.state.load_state_dict(scaler)
    step.micro = int(sd["extra"]["micro"])
