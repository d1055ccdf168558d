"""A recurrent layer the model calls with a ``PackedSequence``, converted as a part that runs low: torch.export
captures neither the packing nor the call, but symbolic tracing records the call as one op on the packed fields
(``torch.lstm(data, batch_sizes, ...)``), so a stand-in making that call is converted and :class:`PackedCall` packs
and unpacks around it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from ..converted.module import add_model_surface
from ..base import keys as K
from ..base.errors import one_line, CaptureError
from .parts import float_dtypes

_TYPES = (nn.LSTM, nn.GRU, nn.RNN)
_CALLS = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}
# what the model's code may read of its layer (and PackedCall reads): answered by the converted part
_CONFIG = ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional",
           "proj_size")


def has_recurrent(m: nn.Module) -> bool:
    """Whether ``m`` holds a recurrent layer (nn.LSTM, nn.GRU, nn.RNN): its matmuls are worth a part."""
    return any(isinstance(s, nn.RNNBase) for s in m.modules())


def _bind(a: tuple, k: dict) -> tuple | None:
    """(input, hx) of a call ``layer(input, hx=None)``; None for any other call."""
    if len(a) > 2 or set(k) - {"input", "hx"} or (a and "input" in k) or (len(a) > 1 and "hx" in k):
        return None
    return (a[0] if a else k.get("input"), a[1] if len(a) > 1 else k.get("hx"))


def takes_packed(m: nn.Module, a: tuple, k: dict, policy) -> bool:
    """Whether ``m`` is torch's own LSTM, GRU or RNN (forward not overridden, no hooks, not a policy leaf) called
    with a packed sequence of floats: what :func:`convert_packed` converts."""
    call = _bind(a, k)
    return (call is not None and isinstance(call[0], PackedSequence) and call[0].data.is_floating_point()
            and any(type(m) is t or (isinstance(m, t) and type(m).forward is t.forward) for t in _TYPES)
            and not m._forward_hooks and not m._forward_pre_hooks and not policy.is_leaf(m))


class _Packed(nn.Module):
    """A recurrent layer's call on a packed sequence's fields, holding the layer's parameters (the same tensors)
    under their own names."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        for key in _CONFIG:
            setattr(self, key, getattr(rnn, key))
        self._flat_weights_names = list(rnn._flat_weights_names)
        for name in self._flat_weights_names:
            self.register_parameter(name, getattr(rnn, name))

    def _flags(self) -> tuple:
        return (self.bias, self.num_layers, float(self.dropout), self.training, self.bidirectional)

    def _weights(self) -> list:
        return [getattr(self, n) for n in self._flat_weights_names]


class _PackedLSTM(_Packed):
    def forward(self, data, batch_sizes, h0, c0):
        out, h, c = torch.lstm(data, batch_sizes, [h0, c0], self._weights(), *self._flags())
        return out, h, c


class _PackedRNN(_Packed):
    def forward(self, data, batch_sizes, h0):
        out, h = _CALLS[self.mode](data, batch_sizes, h0, self._weights(), *self._flags())
        return out, h


def _permute(h: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return h if index is None else h.index_select(1, index)


def _graph_inputs(layer, input: PackedSequence, hx) -> list:
    """The graph's inputs ``[data, batch_sizes, h0(, c0)]`` for the call ``layer(input, hx)``, as
    ``nn.RNNBase.forward`` makes them: zeros where no state is given, else the given state in the sequence's
    sorted order."""
    lstm = layer.mode == "LSTM"
    if hx is None:
        batch, data = int(input.batch_sizes[0]), input.data
        rows = layer.num_layers * (2 if layer.bidirectional else 1)
        sizes = (layer.proj_size or layer.hidden_size, layer.hidden_size) if lstm else (layer.hidden_size,)
        state = [torch.zeros(rows, batch, s, dtype=data.dtype, device=data.device) for s in sizes]
    else:
        state = [_permute(h, input.sorted_indices) for h in (hx if lstm else (hx,))]
    return [input.data, input.batch_sizes, *state]


class PackedCall:
    """Mixed into a converted packed layer's class: turns the call ``layer(packed, hx=None)`` into the graph's
    inputs and packs the result as the layer does. The layer's sizes and flags are answered from ``meta``, which
    copies and subclasses (checkpoint_blocks) keep."""

    def __call__(self, input, hx=None):
        if not isinstance(input, PackedSequence):
            raise TypeError(f"this {self.mode} layer was converted for calls with a PackedSequence, as the model "
                            f"called it at conversion; got {type(input).__name__}: its graph runs packed sequences")
        out = super().__call__(*_graph_inputs(self, input, hx))
        output = PackedSequence(out[0], input.batch_sizes, input.sorted_indices, input.unsorted_indices)
        hidden = tuple(_permute(h, input.unsorted_indices) for h in out[1:])
        return output, (hidden if self.mode == "LSTM" else hidden[0])

    def __getattr__(self, name):
        config = self.__dict__.get("meta", {}).get(K.PACKED)
        if config is not None and name in config:
            return config[name]
        return super().__getattr__(name)

    def flatten_parameters(self) -> None:
        """Nothing to do: the converted layer's weights are separate tensors (code written for cuDNN calls this)."""


_CLASSES: dict[type, type] = {}


def _take_packed_calls(part: nn.Module, stand_in: _Packed) -> None:
    """Give ``part`` a class over its own with :class:`PackedCall` first, the stand-in's surface, and the layer's
    sizes and flags in its meta."""
    base = next(c for c in type(part).__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    sub = _CLASSES.get(base)
    if sub is None:
        sub = _CLASSES[base] = type(f"Packed{base.__name__}", (PackedCall, base), {"__module__": __name__})
    part.__class__ = type("GraphModuleImpl", (sub,), {})
    add_model_surface(part)
    part.recompile()
    part.meta[K.PACKED] = {key: getattr(stand_in, key) for key in _CONFIG}


def convert_packed(m: nn.RNNBase, a: tuple, k: dict, whole, options, ctx) -> tuple[nn.Module, str, list]:
    """The layer ``m``, called with a packed sequence, converted by ``whole`` as its stand-in; returns (the part,
    its plan as the report says it, its inputs' dtypes)."""
    packed, hx = _bind(a, k)
    stand_in = (_PackedLSTM if m.mode == "LSTM" else _PackedRNN)(m)
    example = tuple(_graph_inputs(stand_in, packed, hx))
    try:
        part = whole(stand_in, example, {}, options, ctx)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - the layer then runs as the model's float32 code; the report says why
        raise CaptureError(f"its call on the packed sequence did not convert: {one_line(e)}") from e
    _take_packed_calls(part, stand_in)
    info = part.meta[K.CONVERTED]
    weights = "float32 weights, cast as the plan says"
    plan = (f"converted ({info.capture}) as its call on the packed sequence, torch.{_CALLS[m.mode].__name__}(data, "
            f"batch_sizes, state, weights), low dtype {str(options.dtype).removeprefix('torch.')}; {weights}; "
            "float32 at its boundary")
    return part, plan, float_dtypes(example)

