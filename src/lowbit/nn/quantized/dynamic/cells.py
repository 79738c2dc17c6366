"""Dynamic int8 ``RNNCell``, ``LSTMCell`` and ``GRUCell``: one time step, two per-token int8 GEMMs.

With the weights quantized per row (per-channel symmetric int8, as the dynamic ``Linear``) and
``x`` ``(B, I)``, ``h`` ``(B, H)``::

    g_x = x W_ihᵀ + b_ih            # (B, G·H): per-token int8 GEMM (each batch row its own 8-bit grid)
    g_h = h W_hhᵀ + b_hh            # (B, G·H): per-token int8 GEMM
    RNN  (G=1): h' = tanh(g_x + g_h)  (or relu)
    LSTM (G=4): i, f, c̃, o = σ, σ, tanh, σ of (g_x + g_h);  c' = f c + i c̃;  h' = o tanh(c')
    GRU  (G=3): r, z = σ(gx_r + gh_r), σ(gx_z + gh_z);  n = tanh(gx_n + r gh_n);  h' = (1 - z) n + z h

The step functions below are the ones the full dynamic ``RNN``/``LSTM``/``GRU`` modules run, and
both GEMMs are the dynamic ``Linear``'s, so looping a cell over a sequence reproduces the full
module (which batches the ``W_ih`` GEMM over all steps: per-token grids make that the same
arithmetic). Gates and the cell state are float32; the result is cast back to the input's dtype.
Unlike ``torch.ao``'s dynamic cells, these accept unbatched ``(I,)`` inputs and ``bias=False``.

>>> import torch
>>> from lowbit.nn.quantized.dynamic import LSTMCell
>>> cell = torch.nn.LSTMCell(8, 16)
>>> qcell = LSTMCell.from_float(cell)
>>> x, hx = torch.randn(3, 8), (torch.randn(3, 16), torch.randn(3, 16))
>>> (h, c), (h_ref, c_ref) = qcell(x, hx), cell(x, hx)
>>> h.shape, bool((h - h_ref).abs().max() < 0.05), qcell.weight("weight_hh").qdtype
(torch.Size([3, 16]), True, lowbit.qint8)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ....fx_leaves import FxLeaf
from ....qscheme import QDtype, qint8
from ....qtensor import QTensor
from .linear import Linear, _activation_arg, _dtype_arg, activation_of, fp16_dynamic_weight, quantize_dynamic_weight

__all__ = ["RNNCell", "LSTMCell", "GRUCell", "rnn_tanh_step", "rnn_relu_step", "lstm_step", "gru_step"]

State = tuple[torch.Tensor, ...]


def rnn_tanh_step(gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
    """``(tanh(g_x + g_h),)`` — the Elman step (``state`` is ``(h,)``, unused)."""
    return (torch.tanh(gx + gh),)


def rnn_relu_step(gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
    """``(relu(g_x + g_h),)`` — the Elman step with ``nonlinearity="relu"``."""
    return (torch.relu(gx + gh),)


def lstm_step(gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
    """``(h', c')`` from gates ``(B, 4H)`` ordered i, f, g, o (torch's layout) and ``state = (h, c)``."""
    i, f, g, o = (gx + gh).chunk(4, 1)
    c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_step(gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
    """``(h',)`` from gates ``(B, 3H)`` ordered r, z, n (torch's layout); ``b_hn`` stays inside ``r ⊙ (·)``.
    ``h' = (1 - z) n + z h`` is computed in torch's cells' order, ``(h - n) z + n``."""
    xr, xz, xn = gx.chunk(3, 1)
    hr, hz, hn = gh.chunk(3, 1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return ((state[0] - n) * z + n,)


_RNN_STEPS = {"tanh": rnn_tanh_step, "relu": rnn_relu_step}


def nonlinearity_arg(nonlinearity: Any, where: str) -> str:
    """``"tanh"`` or ``"relu"``; anything else raises ``ValueError`` naming the value."""
    if nonlinearity not in _RNN_STEPS:
        raise ValueError(f"{where}: nonlinearity={nonlinearity!r} must be 'tanh' or 'relu'")
    return str(nonlinearity)


def check_size(name: str, **sizes: Any) -> None:
    for arg, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"dynamic {name}: {arg}={v!r} must be a positive int")


def weight_of(tables: dict[str, Linear], name: Any, where: str) -> QTensor | torch.Tensor:
    """The weight ``name`` (torch's parameter name) of ``tables[name]``: an int8 ``QTensor`` or float16 tensor."""
    if name not in tables:
        raise ValueError(f"{where}.weight: name={name!r} is not one of {sorted(tables)}")
    return tables[name].weight()


class _CellBase(FxLeaf, nn.Module):
    _float_type: type[nn.Module] = nn.RNNCellBase
    _gates = 1
    _n_states = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 dtype: QDtype | str | torch.dtype = qint8, activation: str = "per_token") -> None:
        super().__init__()
        name = type(self).__name__
        check_size(name, input_size=input_size, hidden_size=hidden_size)
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bool(bias)
        self.dtype = _dtype_arg(dtype, f"dynamic {name}")
        self.activation = _activation_arg(activation, f"dynamic {name}")
        g = self._gates * hidden_size
        self.ih = Linear(input_size, g, bias, self.dtype, self.activation)   # W_ih (G·H, I)
        self.hh = Linear(hidden_size, g, bias, self.dtype, self.activation)  # W_hh (G·H, H)

    def _step(self, gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
        raise NotImplementedError  # pragma: no cover

    def weight(self, name: str) -> QTensor | torch.Tensor:
        """``"weight_ih"`` or ``"weight_hh"`` (torch's names): per-channel int8 ``QTensor`` (float16 tensor)."""
        return weight_of({"weight_ih": self.ih, "weight_hh": self.hh}, name, f"dynamic {type(self).__name__}")

    def _split_hx(self, hx: Any) -> State:
        if not isinstance(hx, torch.Tensor):
            raise TypeError(f"dynamic {type(self).__name__}: hx must be a tensor h, got {type(hx).__name__}")
        return (hx,)

    def _join_hx(self, state: State) -> Any:
        return state[0]

    def forward(self, input: torch.Tensor, hx: Any = None) -> Any:
        name = type(self).__name__
        if not isinstance(input, torch.Tensor) or not input.is_floating_point():
            raise TypeError(f"dynamic {name}: input must be a float tensor, got "
                            + (f"dtype {input.dtype}" if isinstance(input, torch.Tensor) else type(input).__name__))
        if input.dim() not in (1, 2) or input.shape[-1] != self.input_size:
            raise ValueError(f"dynamic {name}: input shape {tuple(input.shape)} must be (input_size,) or "
                             f"(batch, input_size) with input_size={self.input_size}")
        unbatched = input.dim() == 1
        x = input.unsqueeze(0).to(torch.float32) if unbatched else input.to(torch.float32)   # (B, I)
        expect = (self.hidden_size,) if unbatched else (x.shape[0], self.hidden_size)
        if hx is None:
            state: State = (x.new_zeros(x.shape[0], self.hidden_size),) * self._n_states
        else:
            state = self._split_hx(hx)
            for s in state:
                if tuple(s.shape) != expect or not s.is_floating_point():
                    raise ValueError(f"dynamic {name}: hidden state shape {tuple(s.shape)} (dtype {s.dtype}) "
                                     f"must be float {expect}")
            state = tuple(s.reshape(x.shape[0], self.hidden_size).to(torch.float32) for s in state)
        new = self._step(self.ih(x), self.hh(state[0]), state)
        return self._join_hx(tuple((n.squeeze(0) if unbatched else n).to(input.dtype) for n in new))

    @classmethod
    def _init_kwargs(cls, mod: Any) -> dict[str, Any]:
        return {"input_size": mod.input_size, "hidden_size": mod.hidden_size, "bias": mod.bias}

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype = qint8) -> Any:
        """Quantize ``weight_ih``/``weight_hh`` of the float cell per row (or on ``mod.qconfig.weight``'s grid, with
        ``mod.qconfig.activation``'s recipe, as the dynamic ``Linear``)."""
        if not isinstance(mod, cls._float_type):
            raise TypeError(f"dynamic {cls.__name__}.from_float expects an nn.{cls._float_type.__name__}, "
                            f"got {type(mod).__name__}")
        d = _dtype_arg(dtype, f"dynamic {cls.__name__}.from_float")
        act = "per_token" if d == torch.float16 else activation_of(mod, f"dynamic {cls.__name__}.from_float")
        q = cls(**cls._init_kwargs(mod), dtype=d, activation=act)
        for kind, lin in (("ih", q.ih), ("hh", q.hh)):
            w = getattr(mod, f"weight_{kind}")
            wq = (fp16_dynamic_weight(w, f"dynamic {cls.__name__}") if d == torch.float16
                  else quantize_dynamic_weight(w, mod, d, f"dynamic {cls.__name__}"))  # type: ignore[arg-type]
            lin.set_weight_bias(wq, getattr(mod, f"bias_{kind}") if q.bias else None)
        return q.to(next(mod.parameters()).device)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}" + ("" if self.bias else ", bias=False")
        s += f", dtype={self.dtype!r}"
        return s if self.activation == "per_token" else s + f", activation={self.activation}"


class RNNCell(_CellBase):
    """Dynamic int8 ``nn.RNNCell``: ``forward(input, h=None) -> h'`` with ``h' = tanh|relu(g_x + g_h)``."""

    _float_type = nn.RNNCell

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh",
                 dtype: QDtype | str | torch.dtype = qint8, activation: str = "per_token") -> None:
        nonlinearity = nonlinearity_arg(nonlinearity, "dynamic RNNCell")
        super().__init__(input_size, hidden_size, bias, dtype, activation)
        self.nonlinearity = nonlinearity

    def _step(self, gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
        return _RNN_STEPS[self.nonlinearity](gx, gh, state)

    @classmethod
    def _init_kwargs(cls, mod: Any) -> dict[str, Any]:
        return {**super()._init_kwargs(mod), "nonlinearity": mod.nonlinearity}

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.nonlinearity == "tanh" else s + f", nonlinearity={self.nonlinearity}"


class LSTMCell(_CellBase):
    """Dynamic int8 ``nn.LSTMCell``: ``forward(input, (h, c)=None) -> (h', c')``."""

    _float_type = nn.LSTMCell
    _gates = 4
    _n_states = 2

    def _step(self, gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
        return lstm_step(gx, gh, state)

    def _split_hx(self, hx: Any) -> State:
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(h, torch.Tensor) for h in hx)):
            raise TypeError(f"dynamic LSTMCell: hx must be a tuple (h, c) of tensors, got {type(hx).__name__}")
        return tuple(hx)

    def _join_hx(self, state: State) -> Any:
        return state[0], state[1]


class GRUCell(_CellBase):
    """Dynamic int8 ``nn.GRUCell``: ``forward(input, h=None) -> h'``."""

    _float_type = nn.GRUCell
    _gates = 3

    def _step(self, gx: torch.Tensor, gh: torch.Tensor, state: State) -> State:
        return gru_step(gx, gh, state)
