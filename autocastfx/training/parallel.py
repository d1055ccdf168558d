"""The step's answers for a module spread over processes: DistributedDataParallel around a converted module,
or one sharded with FSDP2's ``fully_shard``; :func:`parallel_for` picks them."""
from __future__ import annotations
import contextlib
import sys
import torch
import torch.distributed as dist
import torch.nn as nn
from .checks import StepError
from .step import Local, compiled_module


def loaded_class(module: str, name: str):
    """Class ``name`` of ``module`` if that module is imported, else None (importing FSDP2 and DTensor would slow
    ``import autocastfx``, and nothing is an instance of a class never loaded)."""
    return getattr(sys.modules.get(module), name, None)


def is_fsdp(module: nn.Module) -> bool:
    cls = loaded_class("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(module, cls)


def is_dtensor(t) -> bool:
    cls = loaded_class("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def parallel_for(model: nn.Module) -> Local:
    """The answers for ``model`` (DDP, FSDP2 or one process), ``torch.compile``d or not."""
    inner = compiled_module(model)
    if inner is not model:
        parallel = parallel_for(inner)
        parallel.model = model
        return parallel
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDP(model)
    if is_fsdp(model):
        return FSDP(model)
    if any(is_fsdp(m) for m in model.modules()):
        raise StepError("some submodules of this module are sharded with fully_shard() but the module itself is "
                        "not: call fully_shard(gm) on the converted module too, after its blocks (FSDP2 needs "
                        "the root to be sharded last), or use autocastfx.shard(gm)")
    return Local(model)


class DDP(Local):
    """DistributedDataParallel around a converted module: ``found_inf`` reduced across ranks, DDP's all-reduce
    skipped on all micro-batches but the last."""
    kind = "ddp"
    distributed = True

    def __init__(self, model: nn.Module):
        super().__init__(model.module)
        self.model = model
        self.group = model.process_group

    def all_reduce_max(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDP(Local):
    """A converted module sharded with FSDP2's ``fully_shard``: the fused kernels work on the shards' local
    tensors."""
    kind = "fsdp"
    distributed = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        meshes = []
        for p in model.parameters():
            if is_dtensor(p) and all(p.device_mesh != m for m in meshes):
                meshes.append(p.device_mesh)
        if len(meshes) != 1:
            raise StepError(f"the sharded module's parameters live on {len(meshes)} device meshes: the step reduces "
                            "its overflow flag over one mesh; shard every block and the root on the same mesh")
        self.mesh = meshes[0]
        self.group = self.mesh.get_group()
        self._dtensor = loaded_class("torch.distributed.tensor", "DTensor")  # loaded: the parameters are DTensors
        unsharded = [n for n, p in model.named_parameters() if p.requires_grad and not is_dtensor(p)]
        if unsharded:
            raise StepError(f"parameters {unsharded[:3]} of the sharded module are not sharded (fully_shard(..., "
                            "ignored_params=...)?): the step needs every trainable parameter under FSDP2")

    def local(self, t):
        return t._local_tensor if isinstance(t, self._dtensor) else t

    def locals(self, ts):
        return [t._local_tensor if isinstance(t, self._dtensor) else t for t in ts]

    def all_reduce_max(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def sync(self, last: bool):
        return _GradientSync(self.model, last)

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm over every shard of every rank (right only because FSDP2 replicates no parameter)."""
        local = self.locals(grads)
        sq = torch.stack(torch._foreach_norm(local, 2.0)).pow(2).sum() if local else torch.zeros(())
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        return sq.sqrt()

    grads_in_params = False

    def drop_unsynced_grads(self) -> None:
        """Forget an unfinished accumulation cycle's gradients, which FSDP2 keeps unsharded in its own parameter
        state, out of reach of ``.grad = None`` on the shards."""
        for m in self.model.modules():
            if not is_fsdp(m):
                continue
            for group in _param_groups(m._get_fsdp_state()):
                for fp in group.fsdp_params:
                    fp.unsharded_accumulated_grad = None
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None

    def allows_fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """Only fused Adam and AdamW: DTensor has sharding rules for them and refuses other fused kernels."""
        return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups (a list in newer torch, one or none in torch 2.11); RuntimeError for a
    layout this code does not know, rather than silently keeping unsynced gradients."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    raise RuntimeError(f"autocastfx: this torch's FSDP2 ({torch.__version__}) keeps its parameter groups where "
                       "autocastfx does not look (it reads them as torch 2.11 to 2.13 keep them), so the gradients "
                       "of an unfinished accumulation cycle could not be dropped when a state is loaded: use one of "
                       "those torch versions, or an autocastfx release that supports this one")


class _GradientSync:
    """FSDP2's switch for the reduce-scatter after backward: off for all micro-batches but the last."""

    def __init__(self, model, last):
        self.model, self.last = model, last

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.last)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


