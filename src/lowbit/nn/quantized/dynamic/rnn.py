"""Dynamic int8 ``RNN``, ``LSTM`` and ``GRU``: every gate GEMM is a per-token int8 GEMM.

Per layer and direction, with the weights quantized per row (per-channel symmetric int8)::

    G_x = x W_ihᵀ + b_ih            # (T·B, G·H): ONE int8 GEMM over all time steps, per-token activations
    for t in time order (reversed for the reverse direction):
        g = G_x[t] + h W_hhᵀ + b_hh   # (B_t, G·H): int8 GEMM, each batch row of h its own grid
        RNN  (G=1): h = tanh(g) or relu(g)   (``nonlinearity``)
        LSTM (G=4): i, f, c̃, o = σ(g_i), σ(g_f), tanh(g_c), σ(g_o);  c = f c + i c̃;  h = o tanh(c)
        GRU  (G=3): r, z = σ(gx_r + gh_r), σ(gx_z + gh_z);  n = tanh(gx_n + r gh_n);  h = (1 - z) n + z h

The step functions are ``lowbit.nn.quantized.dynamic.cells``' (a cell looped over a sequence gives
the same numbers). ``torch.ao`` has no dynamic ``nn.RNN``; lowbit's follows its LSTM/GRU.
Gate nonlinearities and the cell state stay float32; the output is float. This quantizes more
finely than ``torch.ao``'s dynamic RNNs (one 8-bit grid per tensor per GEMM), so it tracks fp32
more closely. ``from_float`` reads the activation recipe from ``mod.qconfig`` as the dynamic ``Linear`` does
(``activation=``): ``get_dynamic_qconfig(backend="x86")`` gives torch.ao's dynamic LSTM / GRU, to an ulp.
``PackedSequence`` inputs run natively: at step ``t`` only the first
``batch_sizes[t]`` rows are active, so padded positions cost nothing and never touch the state.
Dropout between layers is an inference no-op (these are inference modules); ``proj_size`` is not supported.

>>> import torch
>>> from lowbit.nn.quantized.dynamic import LSTM
>>> lstm = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True)
>>> qlstm = LSTM.from_float(lstm)
>>> x = torch.randn(3, 5, 8)
>>> (y, (h, c)), (y_ref, _) = qlstm(x), lstm(x)
>>> y.shape, h.shape, bool((y - y_ref).abs().max() < 0.05)
(torch.Size([3, 5, 16]), torch.Size([2, 3, 16]), True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ....fx_leaves import FxLeaf
from ....qscheme import QDtype, qint8
from ....qtensor import QTensor
from .cells import _RNN_STEPS, check_size, gru_step, lstm_step, nonlinearity_arg, weight_of
from .linear import Linear, _activation_arg, _dtype_arg, activation_of, fp16_dynamic_weight, quantize_dynamic_weight

__all__ = ["RNN", "LSTM", "GRU"]


class _RNNBase(FxLeaf, nn.Module):
    _float_type: type[nn.Module] = nn.RNNBase
    _gates = 1
    _n_states = 1

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 dtype: QDtype | str | torch.dtype = qint8, activation: str = "per_token") -> None:
        super().__init__()
        name = type(self).__name__
        check_size(name, input_size=input_size, hidden_size=hidden_size, num_layers=num_layers)
        if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1):
            raise ValueError(f"dynamic {name}: dropout={dropout!r} must be in [0, 1]")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bool(bias), bool(batch_first), float(dropout)
        self.bidirectional = bool(bidirectional)
        self.dtype = _dtype_arg(dtype, f"dynamic {name}")
        self.activation = _activation_arg(activation, f"dynamic {name}")
        dirs = 2 if bidirectional else 1
        g = self._gates * hidden_size
        self.ih, self.hh = nn.ModuleDict(), nn.ModuleDict()
        for layer in range(num_layers):
            for sfx in self._suffixes():
                key = f"l{layer}{sfx}"
                self.ih[key] = Linear(input_size if layer == 0 else hidden_size * dirs, g, bias, self.dtype,
                                      self.activation)
                self.hh[key] = Linear(hidden_size, g, bias, self.dtype, self.activation)

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def weight(self, name: str) -> QTensor | torch.Tensor:
        """The weight of torch's parameter ``name`` (``"weight_ih_l0"``, ``"weight_hh_l1_reverse"``, ...):
        a per-channel int8 ``QTensor`` (the float16 tensor for ``dtype=torch.float16``)."""
        tables = {f"weight_{kind}_{k}": lin for kind, t in (("ih", self.ih), ("hh", self.hh)) for k, lin in t.items()}
        return weight_of(tables, name, f"dynamic {type(self).__name__}")  # type: ignore[arg-type]

    # ---- one step of the cell: gates (B_t, G·H) -> new state ----
    def _cell(self, gx: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError  # pragma: no cover

    def _zero_state(self, batch: int, ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = ref.new_zeros(self.num_layers * len(self._suffixes()), batch, self.hidden_size)
        return tuple(z.clone() for _ in range(self._n_states))

    def _split_hx(self, hx: Any) -> tuple[torch.Tensor, ...]:
        if not isinstance(hx, torch.Tensor):
            raise TypeError(f"dynamic {type(self).__name__}: hx must be a tensor h0, got {type(hx).__name__}")
        return (hx,)

    def _run(self, data: torch.Tensor, batch_sizes: list[int], hx: tuple[torch.Tensor, ...]
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Time-major flat ``data`` (Σ B_t, I) -> (Σ B_t, D·H) and final states (L·D, B, H) each."""
        offsets = [0]
        for b in batch_sizes:
            offsets.append(offsets[-1] + b)
        finals: list[list[torch.Tensor]] = [[] for _ in hx]
        dirs = self._suffixes()
        for layer in range(self.num_layers):
            outs = []
            for d, sfx in enumerate(dirs):
                key = f"l{layer}{sfx}"
                gx_all = self.ih[key](data)                           # (Σ B_t, G·H): one GEMM for all steps
                state = tuple(s[layer * len(dirs) + d].clone() for s in hx)   # (B, H) each
                out = data.new_empty(data.shape[0], self.hidden_size)
                steps = range(len(batch_sizes)) if sfx == "" else reversed(range(len(batch_sizes)))
                for t in steps:
                    b, o = batch_sizes[t], offsets[t]
                    active = tuple(s[:b] for s in state)
                    new = self._cell(gx_all[o:o + b], self.hh[key](active[0]), active)
                    for s, n in zip(state, new):
                        s[:b] = n
                    out[o:o + b] = new[0]
                outs.append(out)
                for f, s in zip(finals, state):
                    f.append(s)
            data = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return data, tuple(torch.stack(f) for f in finals)

    def forward(self, input: torch.Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        name = type(self).__name__
        packed = isinstance(input, PackedSequence)
        unbatched = False
        if packed:
            data, batch_sizes_t, sorted_idx, unsorted_idx = input
            if not data.is_floating_point():  # (cast silently before; torch's RNNs refuse it)
                raise TypeError(f"dynamic {name}: a PackedSequence must hold float data, got dtype {data.dtype}")
            batch_sizes = batch_sizes_t.tolist()
            batch = batch_sizes[0] if batch_sizes else 0
        else:
            if not isinstance(input, torch.Tensor) or not input.is_floating_point():
                raise TypeError(f"dynamic {name}: input must be a float tensor or a PackedSequence, got "
                                + (f"dtype {input.dtype}" if isinstance(input, torch.Tensor) else type(input).__name__))
            if input.dim() not in (2, 3):
                raise ValueError(f"dynamic {name}: input must be 2-D (unbatched) or 3-D, "
                                 f"got shape {tuple(input.shape)}")
            unbatched = input.dim() == 2
            x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
            steps, batch = x.shape[0], x.shape[1]
            if steps == 0:  # as torch's RNNs
                raise ValueError(f"dynamic {name}: the input sequence is empty (shape {tuple(input.shape)}); "
                                 "expected a sequence length larger than 0")
            data, batch_sizes, sorted_idx, unsorted_idx = x.reshape(steps * batch, x.shape[-1]), [batch] * steps, None, None
        if data.shape[-1] != self.input_size:
            raise ValueError(f"dynamic {name}: input feature size {data.shape[-1]} != input_size={self.input_size}")
        dtype = data.dtype  # computed in float32, returned in the input's dtype (as the float RNN and the cells do)
        data = data.to(torch.float32)
        states = self._zero_state(batch, data) if hx is None else self._split_hx(hx)
        expect = (self.num_layers * len(self._suffixes()), self.hidden_size)
        checked = []
        for s in states:
            s = s.unsqueeze(1) if unbatched and s.dim() == 2 else s
            if not s.is_floating_point():  # (an integer / bool state was cast silently; the cells refuse it too)
                raise TypeError(f"dynamic {name}: the hidden state must be a float tensor, got dtype {s.dtype}")
            if tuple(s.shape) != (expect[0], batch, expect[1]):
                raise ValueError(f"dynamic {name}: hidden state shape {tuple(s.shape)} != "
                                 f"{(expect[0], batch, expect[1]) if not unbatched else expect}")
            checked.append(s.to(torch.float32) if sorted_idx is None else s.index_select(1, sorted_idx).float())
        out, finals = self._run(data, batch_sizes, tuple(checked))
        if dtype != torch.float32:
            out, finals = out.to(dtype), tuple(f.to(dtype) for f in finals)
        if unsorted_idx is not None:
            finals = tuple(f.index_select(1, unsorted_idx) for f in finals)
        if unbatched:
            finals = tuple(f.squeeze(1) for f in finals)
        if packed:
            output: Any = PackedSequence(out, batch_sizes_t, sorted_idx, unsorted_idx)
        else:
            output = out.reshape(len(batch_sizes), batch, out.shape[-1])  # (batch 0 too: empty outputs, as torch)
            output = output.squeeze(1) if unbatched else (output.transpose(0, 1) if self.batch_first else output)
        return output, self._join_hx(finals)

    def _join_hx(self, finals: tuple[torch.Tensor, ...]) -> Any:
        return finals[0]

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype = qint8) -> Any:
        """Quantize every ``weight_{ih,hh}_l*`` of a float RNN per row (or on ``mod.qconfig.weight``'s grid, with
        ``mod.qconfig.activation``'s recipe, as the dynamic ``Linear``); biases stay float."""
        if not isinstance(mod, cls._float_type):
            raise TypeError(f"dynamic {cls.__name__}.from_float expects an nn.{cls._float_type.__name__}, "
                            f"got {type(mod).__name__}")
        if getattr(mod, "proj_size", 0):
            raise ValueError(f"dynamic {cls.__name__}.from_float: proj_size={mod.proj_size} is not supported")
        d = _dtype_arg(dtype, f"dynamic {cls.__name__}.from_float")
        act = "per_token" if d == torch.float16 else activation_of(mod, f"dynamic {cls.__name__}.from_float")
        q = cls(**cls._init_kwargs(mod), dtype=d, activation=act)
        for key in q.ih:
            for kind, table in (("ih", q.ih), ("hh", q.hh)):
                w = getattr(mod, f"weight_{kind}_{key}")
                b = getattr(mod, f"bias_{kind}_{key}") if q.bias else None
                wq = (fp16_dynamic_weight(w, f"dynamic {cls.__name__}") if d == torch.float16
                      else quantize_dynamic_weight(w, mod, d, f"dynamic {cls.__name__}"))  # type: ignore[arg-type]
                table[key].set_weight_bias(wq, b)  # type: ignore[operator]  # a dynamic Linear
        return q.to(next(mod.parameters()).device)

    @classmethod
    def _init_kwargs(cls, mod: Any) -> dict[str, Any]:
        return {k: getattr(mod, k) for k in ("input_size", "hidden_size", "num_layers", "bias", "batch_first",
                                             "dropout", "bidirectional")}

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        for flag in ("bias", "batch_first", "bidirectional"):
            if getattr(self, flag) != (flag == "bias"):
                s += f", {flag}={getattr(self, flag)}"
        s += f", dtype={self.dtype!r}"
        return s if self.activation == "per_token" else s + f", activation={self.activation}"


class LSTM(_RNNBase):
    """Dynamic int8 ``nn.LSTM``: ``forward(input, (h0, c0)=None) -> (output, (h_n, c_n))``."""

    _float_type = nn.LSTM
    _gates = 4
    _n_states = 2

    def _cell(self, gx: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return lstm_step(gx, gh, state)

    def _split_hx(self, hx: Any) -> tuple[torch.Tensor, ...]:
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(h, torch.Tensor) for h in hx)):
            raise TypeError(f"dynamic LSTM: hx must be a tuple (h0, c0) of tensors, got {type(hx).__name__}")
        return tuple(hx)

    def _join_hx(self, finals: tuple[torch.Tensor, ...]) -> Any:
        return finals[0], finals[1]


class GRU(_RNNBase):
    """Dynamic int8 ``nn.GRU``: ``forward(input, h0=None) -> (output, h_n)``."""

    _float_type = nn.GRU
    _gates = 3

    def _cell(self, gx: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return gru_step(gx, gh, state)


class RNN(_RNNBase):
    """Dynamic int8 ``nn.RNN`` (Elman, ``nonlinearity`` tanh or relu): ``forward(input, h0=None) -> (output, h_n)``.

    The constructor takes ``nn.RNN``'s arguments in its order (``nonlinearity`` after ``num_layers``).

    >>> import torch
    >>> rnn = torch.nn.RNN(4, 8, nonlinearity="relu", bidirectional=True)
    >>> q = RNN.from_float(rnn)
    >>> y, h = q(torch.randn(5, 2, 4))
    >>> y.shape, h.shape, q.weight("weight_hh_l0_reverse").shape
    (torch.Size([5, 2, 16]), torch.Size([2, 2, 8]), torch.Size([8, 8]))
    """

    _float_type = nn.RNN

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 dtype: QDtype | str | torch.dtype = qint8, activation: str = "per_token") -> None:
        nonlinearity = nonlinearity_arg(nonlinearity, "dynamic RNN")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, dtype,
                         activation)
        self.nonlinearity = nonlinearity

    def _cell(self, gx: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return _RNN_STEPS[self.nonlinearity](gx, gh, state)

    @classmethod
    def _init_kwargs(cls, mod: Any) -> dict[str, Any]:
        return {**super()._init_kwargs(mod), "nonlinearity": mod.nonlinearity}

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.nonlinearity == "tanh" else s.replace(", dtype=", f", nonlinearity={self.nonlinearity}, dtype=")
