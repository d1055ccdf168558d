"""The training step across processes: DistributedDataParallel and FSDP2, sharding, distributed checkpoints.

The generated step (autocastfx.step) asks three questions that only the data-parallel wrapper can answer, and
:class:`autocastfx.step.Local` answers them for one process:

- *what is a master here*: under DDP the full float32 masters of ``convert()``; under FSDP2 each master is
  sharded exactly like its low-precision weight (a DTensor with the weight's mesh and placements), so that no
  rank holds a full float32 copy; with :func:`shard` the sharded float32 parameter is its own master.
- *one skip decision*: ``found_inf`` is reduced (MAX) over the processes before the optimizer reads it, and so
  is the first update's gradient maximum that ``init_scale="auto"`` turns into a scale; every rank skips, or
  steps, together. Gradient norms for clipping are summed over the shards.
- *gradient sync on the last micro-batch only*: ``no_sync()`` under DDP, ``set_requires_gradient_sync(False)``
  under FSDP2, for every micro-batch of an accumulation cycle but the last.

Everything here is device-side: the reductions are collectives on device tensors, no value is read by the host.

:func:`shard` applies the policy that makes FSDP2 and mixed precision fit together: every parameter stays a
float32 shard (the master), FSDP2 casts the shard to the low dtype before the all-gather (half the bytes of a
float32 all-gather) and reduces gradients in float32; parameters the cast plan keeps in float32 (norms) are
gathered in float32 in a group of their own, so the kernels see what the plan promised. It shards a module
converted on the meta device too, before anything is allocated; the sharded module then loads the float32
model's full state dict, each rank copying its own slices (``autocastfx.materialize``: the large-model flow).

:func:`save_checkpoint` / :func:`load_checkpoint` write and read a step's whole state with
``torch.distributed.checkpoint``: float32 weights, buffers, optimizer state and scaler state keyed by the
model's parameter names, each rank writing its shards. The same checkpoint loads on any number of ranks, and into
one process.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import weights as _weights
from .checks import StepError
from .step import DYNAMIC, Local, TrainStep, _is_converted, all_masters, compiled_module, converted_units

try:  # FSDP2 and DTensor: torch >= 2.6 on every platform with torch.distributed
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    FSDPModule = DTensor = None


# ------------------------------------------------------------------------------------------ the wrappers

def parallel_for(model: nn.Module) -> Local:
    """The answers for ``model``: DDP around a converted module, an FSDP2-sharded one, or one process; any of
    them compiled (``torch.compile(gm)``: the step calls the compiled module, and finds the weights and masters
    in the module it compiled)."""
    inner = compiled_module(model)
    if inner is not model:
        parallel = parallel_for(inner)
        parallel.model = model
        return parallel
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDP(model)
    if FSDPModule is not None and isinstance(model, FSDPModule):
        return FSDP(model)
    if FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise StepError("some submodules of this module are sharded with fully_shard() but the module itself is "
                        "not: call fully_shard(gm) on the converted module too, after its blocks (FSDP2 needs "
                        "the root to be sharded last), or use autocastfx.shard(gm)")
    return Local(model)


class DDP(Local):
    """DistributedDataParallel around a converted module: full masters on every rank, gradients all-reduced by
    DDP; the step reduces ``found_inf`` and skips DDP's all-reduce on all micro-batches but the last."""
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
    """A converted module sharded with FSDP2's ``fully_shard`` (by hand, or by :func:`shard`).

    Masters: a stored-low weight's float32 master is cut to the weight's own shard (same mesh, same placements),
    so optimizer state and gradients are sharded with it; a float32 parameter is its own master. The step works on
    the shards' local tensors (``_local_tensor``: no copy) and gives the optimizer DTensors, so the optimizer's
    state is sharded DTensors that ``torch.distributed.checkpoint`` writes and reshards."""
    kind = "fsdp"
    distributed = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._check_group_dtypes(model)
        meshes = []
        for p in model.parameters():
            if isinstance(p, DTensor) and all(p.device_mesh != m for m in meshes):
                meshes.append(p.device_mesh)
        if len(meshes) != 1:
            raise StepError(f"the sharded module's parameters live on {len(meshes)} device meshes: the step reduces "
                            "its overflow flag over one mesh; shard every block and the root on the same mesh")
        self.mesh = meshes[0]
        self.group = self.mesh.get_group()
        unsharded = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if unsharded:
            raise StepError(f"parameters {unsharded[:3]} of the sharded module are not sharded (fully_shard(..., "
                            "ignored_params=...)?): the step needs every trainable parameter under FSDP2")

    @staticmethod
    def _check_group_dtypes(model: nn.Module) -> None:
        """FSDP2 gathers each fully_shard group in one dtype and asserts it at the first forward; say it here, with
        the two ways out, before anything runs."""
        owner: dict[int, str] = {}
        names = dict(model.named_modules())
        for name, m in reversed(list(names.items())):  # innermost first: a parameter belongs to the nearest
            if isinstance(m, FSDPModule):
                for pname, p in m.named_parameters():
                    owner.setdefault(id(p), (name or "the root") + ":" + (f"{name}.{pname}" if name else pname))
        dtypes: dict[str, dict] = {}
        for p in model.parameters():
            if p.requires_grad and id(p) in owner:
                unit, pname = owner[id(p)].split(":", 1)
                dtypes.setdefault(unit, {}).setdefault(p.dtype, pname)
        for unit, seen in dtypes.items():
            if len(seen) > 1:
                example = ", ".join(f"{n} is {str(d).replace('torch.', '')}" for d, n in seen.items())
                raise StepError(
                    f"the fully_shard group of {unit} holds parameters of several dtypes ({example}): the cast plan "
                    "stores weights read only by low-precision ops in the low dtype and keeps the others float32, "
                    "and FSDP2 gathers a group in one dtype. Either shard with autocastfx.shard(gm) (float32 "
                    "shards as masters, gathered low, norms in a float32 group of their own), or convert with "
                    "master_weights=False (every parameter float32, cast in the graph) before fully_shard")

    def master_pairs(self, gm) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(qualified name, sharded low weight, its master cut to the same shard). The full float32 master in
        ``meta["autocastfx"].masters`` is replaced there by its shard, so that it is freed."""
        pairs = []
        for prefix, unit in converted_units(gm):
            info = unit.meta["autocastfx"]
            params = dict(unit.named_parameters(remove_duplicate=False))
            for name, master in list(info.masters.items()):
                low = params[name]
                if isinstance(master, DTensor):
                    pairs.append((prefix + name, low, master))
                    continue
                if not isinstance(low, DTensor):
                    raise StepError(f"the low-precision weight {name!r} is not sharded, but the module is: shard "
                                    "the root module last, after its blocks")
                local = _local_slice(master.detach(), low)
                sharded = nn.Parameter(DTensor.from_local(local, low.device_mesh, low.placements, run_check=False,
                                                          shape=low.shape, stride=low.stride()),
                                       requires_grad=master.requires_grad)
                info.masters[name] = sharded
                pairs.append((prefix + name, low, sharded))
        return pairs

    def local(self, t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def locals(self, ts):
        return [t._local_tensor if isinstance(t, DTensor) else t for t in ts]

    def as_grad(self, master, view):
        if not isinstance(master, DTensor):
            return view
        return DTensor.from_local(view, master.device_mesh, master.placements, run_check=False,
                                  shape=master.shape, stride=master.stride())

    def all_reduce_max(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def sync(self, last: bool):
        return _GradientSync(self.model, last)

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm over every shard of every rank: local sums of squares, summed over the mesh (a
        replicated tensor would be counted once per rank; FSDP2 shards every parameter, so none is)."""
        local = self.locals(grads)
        sq = torch.stack(torch._foreach_norm(local, 2.0)).pow(2).sum() if local else torch.zeros(())
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        return sq.sqrt()

    def drop_unsynced_grads(self) -> None:
        """Forget the gradients of an unfinished accumulation cycle: with gradient sync off, FSDP2 keeps them
        unsharded inside its own parameter state, where setting ``.grad = None`` on the shards does not reach."""
        for m in self.model.modules():
            if not isinstance(m, FSDPModule):
                continue
            for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", ()):
                for fp in group.fsdp_params:
                    fp.unsharded_accumulated_grad = None
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None

    def allows_fused(self, optimizer: torch.optim.Optimizer) -> bool:
        """DTensor runs the fused Adam and AdamW kernels on the shards (torch has sharding rules for them); other
        fused kernels (SGD's) it refuses, so those optimizers run their foreach kernels and the step reads
        ``found_inf`` on the host once per update to skip."""
        return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


class _GradientSync:
    """FSDP2's switch for the reduce-scatter after backward: off for all micro-batches but the last."""

    def __init__(self, model, last):
        self.model, self.last = model, last

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.last)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


def _local_slice(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of ``full``, cut as the DTensor ``like`` is sharded (FSDP2's chunking, uneven included)."""
    return _local_view(full, like).to(like.device).clone(memory_format=torch.contiguous_format).contiguous()


def _local_view(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of ``full`` as a view, cut as the DTensor ``like`` is sharded."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]




# ------------------------------------------------------------------------------------------------ shard

def shard(gm: nn.Module, mesh=None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard a converted module with FSDP2, the float32 shard of each parameter being its master (in place;
    returns ``gm``).

    Each converted block (a submodule with ``meta["autocastfx"]`` of its own), then the root, gets two FSDP2
    groups: its stored-low weights, whose float32 masters go back into the module and are gathered as
    ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=float32)``, so every rank holds 1/N of the float32
    weights, gathers half the bytes of a float32 all-gather and reduces gradients in float32; and the
    parameters the cast plan keeps in float32 (norms, biases read by float32 ops), gathered in float32 and kept
    gathered through backward (they are small), so the kernels see float32 weights as the plan says.

    The module must have been converted with ``master_weights=True`` (the default): the plan's split between
    stored-low and float32 parameters is what the two groups are made of. Build the optimizer over
    ``gm.parameters()`` after this call, then ``train_step(gm, loss_fn, optimizer)``.

    A module converted on the meta device shards on meta (nothing allocated; the mesh is the accelerator's where
    the process group is NCCL's, the CPU's under gloo, or pass ``mesh``); then
    ``autocastfx.materialize(gm, device, state_dict, buffers=...)`` allocates each rank's shards and copies into
    them its slice of each full tensor of ``state_dict`` (the float32 model's, or low-precision values, upcast):
    ``gm.load_state_dict`` of a sharded module takes full tensors, and with a state dict read by
    ``torch.load(path, mmap=True)`` a rank reads its slices alone, never a whole weight.
    """
    if FSDPModule is None:
        raise RuntimeError("autocastfx.shard needs torch.distributed with FSDP2 (torch.distributed.fsdp.fully_shard)")
    if not _is_converted(gm):
        raise TypeError(f"shard() takes the module autocastfx.convert() returned, got {type(gm).__name__}")
    if any(isinstance(m, FSDPModule) for m in gm.modules()):
        raise ValueError("this module is already sharded with fully_shard(): shard() applies the whole policy "
                         "itself, to a converted module that is not sharded yet")
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("shard() needs a process group: call torch.distributed.init_process_group() first "
                               "(torchrun sets the environment for it), or pass a DeviceMesh")
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(_mesh_device(gm), (dist.get_world_size(),))
    units = [u for _, u in converted_units(gm)]
    plans = []
    for unit in units:  # every check before anything changes
        info = unit.meta["autocastfx"]
        if not info.options.get("master_weights", True):
            raise ValueError("shard() needs a module converted with master_weights=True (the default): then the "
                             "plan says which weights are stored low, and those are gathered low while the rest "
                             "stays float32. With master_weights=False every weight is float32 in the module and "
                             "cast inside the graph, so FSDP2 would gather float32 (twice the bytes); convert again "
                             "without master_weights=False")
        plans.append(_float32_owners(unit, units))
    for unit, fp32_owners in zip(units, plans):
        info = unit.meta["autocastfx"]
        low = info.dtype
        read = []  # groups whose modules' forward never runs (a graph reads their weights): gathered by hand
        if fp32_owners:
            # FSDP2 runs a group's hooks when its modules run; a group whose modules are partly called and partly
            # read through get_attr takes FSDP2's partial-forward path and loses the read weights' gradients, so
            # the two kinds are two groups
            names = {id(m): n for n, m in unit.named_modules()}
            if hasattr(unit, "graph"):
                called = {str(n.target) for g in _graphs(unit) for n in g.nodes if n.op == "call_module"}
            else:  # converted piecewise: the model's own Python calls its modules
                called = set(names.values())
            calls = [m for m in fp32_owners if names.get(id(m)) in called]
            reads = [m for m in fp32_owners if names.get(id(m)) not in called]
            for group in (calls, reads):
                if group:
                    made = fully_shard(group, mesh=mesh, reshard_after_forward=False,
                                       mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32))
                    if group is reads:
                        read.append(made[0] if isinstance(made, list) else made)
        _weights.restore_masters(unit)  # the float32 masters are the module's parameters again: FSDP2 shards them
        info.masters.clear()
        # the root keeps its weights gathered from forward to backward (FSDP2's own rule for the root: they would
        # be gathered again at once), so reshard_after_forward is for the blocks
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward if unit is not gm else None,
                    mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
        for g in read:
            # their own forward never runs (the graph reads their weights through get_attr): gathered when the
            # unit starts, after FSDP2's own pre-forward
            unit.register_forward_pre_hook(lambda *_, g=g: g.unshard())
        unit.meta["autocastfx_shard"] = {"low": low, "float32_groups": len(fp32_owners)}
        unit.register_load_state_dict_pre_hook(_full_tensors_to_shards)
    return gm


def _mesh_device(gm: nn.Module) -> str:
    """The device type of the mesh ``shard()`` makes: the parameters' own, or on the meta device the one the
    process group's backend drives (gloo: the CPU)."""
    device = next(gm.parameters()).device
    if device.type != "meta":
        return device.type
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None and dist.get_backend() != "gloo" else "cpu"


def _full_tensors_to_shards(unit, state_dict, prefix, *_):
    """A load-state-dict pre-hook of a sharded unit: each full tensor meant for a sharded parameter becomes a
    DTensor over this rank's slice of it (a view: nothing is copied until the parameter's own ``copy_``), so that
    ``load_state_dict`` (and :func:`autocastfx.materialize`) takes the float32 model's state dict on every rank.
    DTensors (``torch.distributed.checkpoint``, ``set_model_state_dict``) and mismatched shapes pass as they are."""
    for name, p in unit.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == p.shape:
            state_dict[prefix + name] = DTensor.from_local(
                _local_view(value.detach(), p).to(p.device), p.device_mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride())


def _graphs(unit: nn.Module) -> list:
    """Every graph a converted unit may run (one per mode where the modes differ)."""
    programs = getattr(unit, "meta", {}).get("autocastfx_programs")
    if programs is not None:
        return list(programs.graphs.values())
    graph = getattr(unit, "graph", None)
    return [graph] if graph is not None else []


def _float32_owners(unit: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The submodules that own the unit's trainable float32 parameters (those the plan did not store low),
    leaving out what a nested converted block owns. Raises for a module that holds both kinds (FSDP2 gathers a
    group in one dtype) and for a float32 parameter of the unit itself."""
    info = unit.meta["autocastfx"]
    nested = {id(m) for m in units if m is not unit}
    inner_params: set[int] = set()
    for m in unit.modules():
        if id(m) in nested:
            inner_params |= {id(p) for p in m.parameters()}
    params, by_id = _weights.aliases(unit)
    low_ids = {id(params[n]) for n in info.masters}
    owners: dict[int, nn.Module] = {}
    kinds: dict[int, set] = {}
    for name, p in params.items():
        if id(p) in inner_params or not p.is_floating_point():
            continue  # frozen float32 parameters too: the low group would gather them in the low dtype
        owner_name = name.rpartition(".")[0]
        owner = unit.get_submodule(owner_name)
        kinds.setdefault(id(owner), set()).add("low" if id(p) in low_ids else "float32")
        if id(p) not in low_ids:
            if owner is unit:
                raise ValueError(f"the float32 parameter {name!r} belongs to the converted module itself, not to "
                                 "a submodule: shard() cannot gather it in float32 beside the low weights. Keep it "
                                 "in a submodule of the model (as nn.LayerNorm keeps its weight), or convert with "
                                 "master_weights=False and use fully_shard(gm)")
            owners[id(owner)] = owner
    mixed = [i for i, k in kinds.items() if len(k) == 2 and i in owners]
    if mixed:
        names = [n for n, m in unit.named_modules() if id(m) in mixed]
        raise ValueError(f"submodule {names[0]!r} holds both stored-low and float32 parameters; FSDP2 gathers one "
                         "dtype per group, so shard() cannot keep its float32 ones float32. Convert with "
                         "master_weights=False and use fully_shard(gm)")
    return list(owners.values())


# ----------------------------------------------------------------------------------------- checkpoints

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


# ------------------------------------------------------------------------------------------ the factory

def train_step(gm, loss_fn, optimizer, *, loss_scale=DYNAMIC, init_scale="auto", growth_factor=2.0,
               backoff_factor=0.5, growth_interval=2000, min_scale=1.0, hysteresis=1, on_overflow="skip",
               max_retries=8, accum_steps=1, clip_grad_norm=None, cuda_graph: bool = False):
    """A generated, loss-scaled training step for a converted module (see autocastfx.step).

    The step owns backward, ``/ accum_steps``, unscaling, clipping, ``optimizer.step()`` on the float32 masters
    (the optimizer's groups are re-pointed at them, ``fused=True`` where it has a fused kernel) and freeing the
    gradients: the loop keeps the data, the learning rate (``group["lr"]`` or a scheduler on ``optimizer``),
    ``gm.eval()``/``gm.train()`` and checkpoints (``gm.state_dict()`` or ``step.state_dict()``); no
    ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()`` or ``zero_grad()`` of its own.
    ``torch.compile(gm)`` and ``gm.compile()`` are taken as ``gm``.

    ``gm``: the module ``convert()`` returned, DistributedDataParallel around it, or that module sharded with
    FSDP2 (``fully_shard`` on its blocks and then on it, or :func:`shard`).
    Call it as ``step(inputs, *targets)``: ``inputs`` is a tensor, a tuple of positional inputs or a dict of
    keyword inputs; the loss is ``loss_fn(output, *targets)``, with zero or more targets (a model that computes
    its own loss from ``labels=``: ``loss_fn=lambda out: out.loss`` and ``step({"input_ids": ids, "labels": y})``).
    ``loss_scale``: "dynamic" (default for float16), a number for a static scale, or None (off; the default
    for bfloat16). ``init_scale``: "auto" (default: the first update runs at scale 1, is applied, and the scale
    jumps to the largest power of two, at most 2^16, that keeps its gradients 8x under the float16 maximum, all
    on the device), or the first dynamic scale as a number (GradScaler's 2^16). Dynamic scaling grows by
    ``growth_factor`` after ``growth_interval`` clean steps and backs off by ``backoff_factor`` after
    ``hysteresis`` consecutive overflows; every overflowing step is skipped.
    ``on_overflow="retry"`` redoes the batch at the lowered scale up to ``max_retries`` times.
    ``accum_steps``: call the step once per micro-batch; the update happens on every ``accum_steps``-th call
    (under DDP and FSDP2 gradients are synchronised on that call only).
    ``clip_grad_norm``: clip by the global norm (over every shard of every rank).
    ``cuda_graph=True``: the step captured and replayed as one CUDA graph (``autocastfx.graphed.CudaGraphStep``;
    one process: DDP and FSDP2 are refused before anything changes).
    """
    from . import graphed  # graphed imports step, never the reverse: the factory that knows both lives here
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph and on_overflow == "retry":
        raise ValueError("cuda_graph=True cannot be combined with on_overflow='retry': retrying reads the overflow "
                         "flag on the host, which a replayed CUDA graph cannot do. Use on_overflow='skip' (the "
                         "default) with cuda_graph=True, or keep retry without the graph")
    if cuda_graph:
        graphed.refuse_before_building(gm, optimizer, on_overflow)  # before the optimizer is re-pointed and fused
    parallel = parallel_for(gm) if isinstance(gm, nn.Module) else None
    step = TrainStep(gm, loss_fn, optimizer, parallel=parallel, loss_scale=loss_scale, init_scale=init_scale,
                     growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
                     min_scale=min_scale, hysteresis=hysteresis, on_overflow=on_overflow, max_retries=max_retries,
                     accum_steps=accum_steps, clip_grad_norm=clip_grad_norm)
    return graphed.CudaGraphStep(step) if cuda_graph else step


__all__ = ["train_step", "shard", "save_checkpoint", "load_checkpoint", "parallel_for", "DDP", "FSDP",
           "converted_units"]
