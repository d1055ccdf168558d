"""shard(): FSDP2 over a converted module, its weights gathered in the low dtype; full tensors loaded into shards."""
from __future__ import annotations
from typing import NamedTuple
import torch
import torch.distributed as dist
import torch.nn as nn
from ..core import weights as _weights
from ..core.weights import converted_units
from ..base import keys as K
from ..base.meta import is_converted
from .parallel import is_fsdp


def _local_view(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of ``full`` as a view, cut as the DTensor ``like`` is sharded."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def shard(gm: nn.Module, mesh=None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard a converted module with FSDP2, in place (returns ``gm``); build the optimizer over ``gm.parameters()``
    after.

    Each converted block, then the root, gets FSDP2 groups for the weights its graph reads only in the low dtype,
    gathered low, and for the parameters the plan reads in float32, gathered in float32; gradients are reduced in
    float32. A module on the meta device shards on meta, for ``autocastfx.materialize``; ``gm.load_state_dict``
    then takes full tensors, each rank copying its slice.

    Args:
        mesh: the DeviceMesh; default one over the world, on the parameters' device type (on meta, the process
            group backend's).
    """
    try:
        import torch.distributed.fsdp  # noqa: F401  (FSDP2: torch >= 2.6 wherever torch.distributed is built)
    except ImportError:  # pragma: no cover - torch built without distributed
        raise RuntimeError("autocastfx.shard needs torch.distributed with FSDP2 "
                           "(torch.distributed.fsdp.fully_shard)") from None
    if not is_converted(gm):
        raise TypeError(f"shard() takes the module autocastfx.convert() returned, got {type(gm).__name__}")
    if any(is_fsdp(m) for m in gm.modules()):
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
        plans.append(_owners(unit, units))
    for unit, owners in zip(units, plans):
        _shard_unit(unit, owners, mesh, reshard_after_forward if unit is not gm else None)
    return gm


def _shard_unit(unit: nn.Module, owners: "_Owners", mesh, reshard_after_forward) -> None:
    """FSDP2 groups of one converted unit; the unit's own group is gathered low, unless the unit holds float32
    parameters of its own (a position table), when the low weights' owners get groups of their own."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    info = unit.meta["autocastfx"]
    low = info.dtype
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    # the unit's inputs as they come (FSDP2 would cast them to param_dtype): its plan casts each on entry, and
    # one it keeps float32 (a residual stream) would be rounded
    low_mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False)
    read = _groups(unit, owners.float32, mesh, False, fp32)
    if owners.own_float32:
        # FSDP2 gathers a group in one dtype: the unit's own parameters are float32, so the low weights' owners
        # are groups of their own, gathered low
        read += _groups(unit, owners.low, mesh, bool(reshard_after_forward), low_mp)
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=fp32)
    else:
        # the root keeps its weights gathered from forward to backward (FSDP2's own rule for the root: they would
        # be gathered again at once), so reshard_after_forward is for the blocks
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=low_mp)
    for g in read:
        # their own forward never runs (the graph reads their weights through get_attr): gathered when the
        # unit starts, after FSDP2's own pre-forward
        unit.register_forward_pre_hook(lambda *_, g=g: g.unshard())
    unit.meta[K.SHARD] = {"low": low, "float32_groups": len(owners.float32) + bool(owners.own_float32)}
    unit.register_load_state_dict_pre_hook(_full_tensors_to_shards)


def _groups(unit: nn.Module, modules: list[nn.Module], mesh, reshard: bool, mp) -> list:
    """FSDP2 groups over ``modules``: one for those the unit's graph calls, one (returned, to be gathered by hand)
    for those whose weights it only reads; a mixed group would lose the read weights' gradients."""
    if not modules:
        return []
    from torch.distributed.fsdp import fully_shard
    names = {id(m): n for n, m in unit.named_modules()}
    if hasattr(unit, "graph"):
        called = {str(n.target) for g in _graphs(unit) for n in g.nodes if n.op == "call_module"}
    else:  # converted piecewise: the model's own Python calls its modules
        called = set(names.values())
    calls = [m for m in modules if names.get(id(m)) in called]
    reads = [m for m in modules if names.get(id(m)) not in called]
    out = []
    for group in (calls, reads):
        if group:
            made = fully_shard(group, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
            if group is reads:
                out.append(made[0] if isinstance(made, list) else made)
    return out


def _mesh_device(gm: nn.Module) -> str:
    """The device type of the mesh ``shard()`` makes: the parameters', or on meta the backend's (gloo: the CPU)."""
    device = next(gm.parameters()).device
    if device.type != "meta":
        return device.type
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None and dist.get_backend() != "gloo" else "cpu"


def _full_tensors_to_shards(unit, state_dict, prefix, *_):
    """Load-state-dict pre-hook: a full tensor for a sharded parameter becomes a DTensor over a view of this rank's
    slice; DTensors and mismatched shapes pass as they are."""
    from torch.distributed.tensor import DTensor  # a sharded unit's parameters are DTensors: loaded already
    for name, p in unit.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == p.shape:
            state_dict[prefix + name] = DTensor.from_local(
                _local_view(value.detach(), p).to(p.device), p.device_mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride())


def _graphs(unit: nn.Module) -> list:
    """Every graph a converted unit may run (one per mode where the modes differ)."""
    programs = getattr(unit, "meta", {}).get(K.PROGRAMS)
    if programs is not None:
        return list(programs.graphs.values())
    graph = getattr(unit, "graph", None)
    return [graph] if graph is not None else []


class _Owners(NamedTuple):
    """Who holds a unit's trainable parameters (nested blocks left out): submodules holding any read in float32,
    submodules read only low, and the unit's own parameter names where one is read in float32."""
    float32: list
    low: list
    own_float32: list


def _owners(unit: nn.Module, units: list[nn.Module]) -> _Owners:
    """The unit's parameters by owner and kind: an owner that holds both kinds counts as float32."""
    nested = {id(m) for m in units if m is not unit}
    inner_params: set[int] = set()
    for m in unit.modules():
        if id(m) in nested:
            inner_params |= {id(p) for p in m.parameters()}
    params, by_id = _weights.aliases(unit)
    low_ids = {id(params[n]) for n in _weights.low_read_names(unit)}
    owners: dict[int, nn.Module] = {}
    kinds: dict[int, set] = {}
    own: dict[str, list[str]] = {"low": [], "float32": []}
    for name, p in params.items():
        if id(p) in inner_params or not p.is_floating_point():
            continue  # frozen float32 parameters too: the low group would gather them in the low dtype
        owner = unit.get_submodule(name.rpartition(".")[0])
        kind = "low" if id(p) in low_ids else "float32"
        if owner is unit:
            own[kind].append(name)
            continue
        kinds.setdefault(id(owner), set()).add(kind)
        owners[id(owner)] = owner
    # a group is gathered in one dtype: one holding a parameter read in float32 is gathered in float32
    if own["float32"]:
        own["float32"] += own["low"]
    kinds = {i: ({"float32"} if "float32" in k else k) for i, k in kinds.items()}
    return _Owners(float32=[m for i, m in owners.items() if kinds[i] == {"float32"}],
                   low=[m for i, m in owners.items() if kinds[i] == {"low"}], own_float32=own["float32"])
