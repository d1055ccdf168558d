"""A deployment copy of a converted module: eval program, batch norms folded, every weight stored low. The result is
an ordinary converted module in eval mode, for ``report()`` and ``autocastfx.export``.
"""
from __future__ import annotations


import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.fusion import fuse_conv_bn_weights

from ..core import rewrite as _rewrite
from ..base import keys as K
from ..base.quiet import deepcopy_quietly
from ..base.meta import fetch, refuse_piecewise, require_info

_aten = torch.ops.aten
_CONVS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d, _aten.conv1d.default,
          _aten.conv2d.default, _aten.conv3d.default, _aten.convolution.default}
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def for_inference(gm: fx.GraphModule, example_inputs: tuple | None = None, *,
                  example_kwargs: dict | None = None) -> fx.GraphModule:
    """A new module for deployment, ``gm`` left as it is: ``gm``'s eval program in float32 on copies of its tensors,
    batch norms after convolutions folded in float32, converted again with the same dtype and policy (no padding),
    then every floating parameter stored low (cast up where the graph reads it in float32)."""
    from ..api import convert
    from ..base.meta import example_inputs_of

    info = require_info(gm, ValueError)
    refuse_piecewise(info, "autocastfx.for_inference")
    if example_inputs is None and example_kwargs is None:
        example_inputs, example_kwargs = example_inputs_of(gm)
    f32 = float32_eval_program(gm)
    folded = fold_batch_norms(f32)
    float32 = info.dtype == torch.float32  # converted for float32 compute ("auto" where no low dtype paid)
    inf = convert(f32, tuple(example_inputs or ()), example_kwargs=example_kwargs,
                  dtype="auto" if float32 else info.dtype,
                  policy=info.policy, pad_multiple=1,
                  keep_io_types=info.options.keep_io_types, memory_format=info.options.memory_format)
    inf.eval()
    low = inf.meta["autocastfx"].dtype
    stored = store_every_weight_low(inf, low) if low != torch.float32 else []
    new = inf.meta["autocastfx"]
    new.extra_totals["inference"] = {"batch_norms_folded": folded, "weights_stored_low_and_cast_up": stored}
    return inf


def float32_eval_program(gm: fx.GraphModule) -> fx.GraphModule:
    """The converted module's eval program as a plain float32 graph module (casts out), on copies of its tensors."""
    g = deepcopy_quietly(gm)
    g.eval()
    if g.meta.pop(K.PROGRAMS, None) is not None:
        g.graph = deepcopy_quietly(g.graph)  # the eval program alone
    _rewrite.undo(g)
    del g.meta["autocastfx"]
    return g


def _is_get_param(gm: fx.GraphModule, node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and isinstance(fetch(gm, node.target), nn.Parameter)


def _bn_of(gm: fx.GraphModule, node: fx.Node):
    """(weight, bias, mean, var, eps, output node) of an eval batch norm node, or None."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if (isinstance(m, _BN_MODULES) and not m.training and m.running_mean is not None
                and type(m).forward is nn.modules.batchnorm._BatchNorm.forward):
            return m.weight, m.bias, m.running_mean, m.running_var, m.eps, node
        return None
    if node.op != "call_function":
        return None
    args = list(node.args)
    if node.target is _aten._native_batch_norm_legit_no_training.default:
        w, b, mean, var, _, eps = args[1:7]
        users = list(node.users)
        if len(users) != 1 or users[0].target is not __import__("operator").getitem or users[0].args[1] != 0:
            return None
        out = users[0]
    elif node.target is F.batch_norm and not _arg(node, 5, "training", False):
        # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        mean, var = _arg(node, 1, "running_mean", None), _arg(node, 2, "running_var", None)
        w, b = _arg(node, 3, "weight", None), _arg(node, 4, "bias", None)
        eps, out = _arg(node, 7, "eps", 1e-5), node
    elif node.target is _aten.batch_norm.default and not _arg(node, 5, "training", False):
        # aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
        w, b = _arg(node, 1, "weight", None), _arg(node, 2, "bias", None)
        mean, var = _arg(node, 3, "running_mean", None), _arg(node, 4, "running_var", None)
        eps, out = _arg(node, 7, "eps", 1e-5), node
    else:
        return None
    vals = [(fetch(gm, a.target) if isinstance(a, fx.Node) and a.op == "get_attr" else a) for a in (w, b, mean, var)]
    if any(v is not None and not isinstance(v, torch.Tensor) for v in vals) or vals[2] is None or vals[3] is None:
        return None
    return (*vals, eps, out)


def _arg(node: fx.Node, i: int, name: str, default):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if i < len(node.args) else default


def fold_batch_norms(gm: fx.GraphModule) -> list[str]:
    """Fold every eval batch norm whose input is a convolution read by nothing else, in float32, in place (an
    exporter folding it later mixes float32 weights with float16 activations, which onnxruntime refuses); returns
    the folded batch norms' node names."""
    folded = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_module", "call_function") or not node.args:
            continue
        conv = node.args[0]
        if not (isinstance(conv, fx.Node) and conv.op == "call_function" and conv.target in _CONVS
                and len(conv.users) == 1):
            continue
        bn = _bn_of(gm, node)
        if bn is None or not _is_get_param(gm, conv.args[1]):
            continue
        if conv.target is _aten.convolution.default and conv.args[6]:  # a transposed convolution
            continue
        bias_arg = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
        if bias_arg is not None and not _is_get_param(gm, bias_arg):
            continue
        gamma, beta, mean, var, eps, out = bn
        f32 = lambda t: t.detach().float() if t is not None else None  # noqa: E731
        new_w, new_b = fuse_conv_bn_weights(f32(fetch(gm, conv.args[1].target)),
                                            f32(fetch(gm, bias_arg.target)) if bias_arg is not None else None,
                                            f32(mean), f32(var), eps, f32(gamma), f32(beta))
        base = f"_folded_{conv.name}"
        gm.register_parameter(f"{base}_weight", new_w.requires_grad_(False))
        gm.register_parameter(f"{base}_bias", new_b.requires_grad_(False))
        with gm.graph.inserting_before(conv):
            wn, bn_ = gm.graph.get_attr(f"{base}_weight"), gm.graph.get_attr(f"{base}_bias")
        args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
        args[1], args[2] = wn, bn_
        conv.args = tuple(args)
        conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
        out.replace_all_uses_with(conv)
        for dead in ([out, node] if out is not node else [node]):
            if not dead.users:
                gm.graph.erase_node(dead)
        folded.append(node.name)
    gm.graph.eliminate_dead_code()
    _drop_unread(gm)
    gm.graph.lint()
    gm.recompile()
    return folded


def _drop_unread(gm: fx.GraphModule) -> None:
    """Remove parameters and buffers no node reads (a folded convolution's old weights) and modules no node calls
    (its batch norm), so the file holds only what runs."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    inside = lambda name: any(name == c or name.startswith(c + ".") for c in called)  # noqa: E731
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in read and not inside(name):
            owner, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(owner), attr)
    gm.delete_all_unused_submodules()


class _LowParams(nn.Module):
    """A leaf module whose floating parameters are kept low and given to its forward in float32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = module
        self.names = [n for n, p in module.named_parameters() if p.is_floating_point() and p.dtype == torch.float32]
        for n in self.names:
            self.register_buffer("low_" + n.replace(".", "_"), module.get_parameter(n).detach().to(dtype))
        for n in self.names:  # held low above; the module keeps the name (its repr reads it), not the tensor
            owner, _, attr = n.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = None

    def casts_per_call(self) -> list[int]:
        """The elements of each cast its forward makes (for the report)."""
        return [getattr(self, "low_" + n.replace(".", "_")).numel() for n in self.names]

    def forward(self, *args, **kwargs):
        params = {n: getattr(self, "low_" + n.replace(".", "_")).float() for n in self.names}
        return torch.func.functional_call(self.inner, params, args, kwargs)


def _casts_to(node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``node`` is a cast the conversion inserted, to ``dtype``."""
    decision = node.meta.get("autocastfx")
    return getattr(decision, "kind", None) == "cast" and getattr(decision, "dtype", None) == dtype


def store_every_weight_low(gm: fx.GraphModule, dtype: torch.dtype) -> list[str]:
    """Store each float32 parameter that the graph reads (by ``get_attr`` or inside a leaf module) in ``dtype``
    and cast it up where it is read; returns their names."""
    stored = []
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            p = fetch(gm, node.target)
            if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dtype == torch.float32 and isinstance(
                    p, nn.Parameter):
                owner, _, name = str(node.target).rpartition(".")
                low = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                setattr(gm.get_submodule(owner), name, low)
                casts = [u for u in node.users if _casts_to(u, dtype)]
                if len(casts) < len(node.users):  # read in float32 too: cast up there
                    with gm.graph.inserting_after(node):
                        up = gm.graph.call_method("to", (node, torch.float32))
                    up.meta["autocastfx"] = _rewrite.Decision(  # a cast the report counts
                        "cast", None, torch.float32, f"{node.target}, stored {dtype}, read in float32",
                        numel=p.numel())
                    node.replace_all_uses_with(up, delete_user_cb=lambda u: u is not up and u not in casts)
                for cast in casts:  # read low: the stored weight itself now
                    cast.replace_all_uses_with(node)
                    gm.graph.erase_node(cast)
                stored.append(str(node.target))
        elif node.op == "call_module":
            m = gm.get_submodule(str(node.target))
            if any(p.dtype == torch.float32 for p in m.parameters(recurse=True)):
                owner, _, name = str(node.target).rpartition(".")
                setattr(gm.get_submodule(owner), name, _LowParams(m, dtype))
                stored.append(str(node.target))
    gm.graph.lint()
    gm.recompile()
    return stored
