"""Quantized elementwise activations: a lookup table over input codes.

For a per-tensor input grid ``(s_in, z_in)`` with at most 2**16 codes and the module's output grid
``(scale, zero_point, qdtype)``, the activation is one gather::

    LUT[c - qmin_in] = clamp(round_half_even(f((c - z_in) * s_in) / scale) + zero_point, qmin, qmax)
    q_out = LUT[q_in - qmin_in]                                    # (*) codes -> (*) codes

which equals quantizing the float activation of the dequantized input bit for bit (the table
is that very computation, done once per input grid and cached). Float inputs are activated in
float and quantized onto the output grid. ``ReLU6`` keeps the input grid and clamps codes.
``Sigmoid``, ``Hardsigmoid`` and ``Tanh`` default to fixed output grids that cover their exact
range ([0, 1) as 1/256 steps, [-1, 1) as 2/256 steps), as torch does.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.activation import Hardswish
>>> qx = Q.quantize_per_tensor(torch.tensor([-3.0, 0.0, 1.0, 3.0]), 0.05, 128, Q.quint8)
>>> Hardswish(scale=0.02, zero_point=20)(qx).dequantize().tolist()
[0.0, 0.0, 0.6599999666213989, 3.0]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...compile_state import tracing
from ...fx_leaves import FxLeaf
from ...functional import quantize
from ...qscheme import QDtype, as_qdtype, quint8
from ...qtensor import QTensor
from ._checks import check_no_nan
from ._utils import check_out_grid, output_qparams
from ._state import CheckedQuantState

__all__ = ["ReLU6", "Hardswish", "Hardsigmoid", "ELU", "LeakyReLU", "Sigmoid", "Tanh"]

_MAX_LUT = 2**16


class _LUTActivation(CheckedQuantState):
    """Base class: ``f`` in float, once per input grid, tabulated over the input codes."""

    _float_type: type[nn.Module] = nn.Module

    def __init__(self, scale: float, zero_point: int, qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__()
        scale, zero_point, self.qdtype = check_out_grid(scale, zero_point, qdtype, type(self).__name__)
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(zero_point, dtype=torch.int64))
        # (key, table) as one attribute: threads sharing the module, fed other input grids, must never pair one
        # grid's key with another's table (two attributes did, for good: a key set after a racing thread's table)
        self._lut: tuple[tuple, torch.Tensor] | None = None

    def _f(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _quantize_out(self, y: torch.Tensor) -> torch.Tensor:
        return quantize(y, self.scale, self.zero_point, self.qdtype)

    def lut(self, x: QTensor) -> torch.Tensor:
        """The table ``(qmax_in - qmin_in + 1,)`` of output codes for ``x``'s per-tensor grid."""
        d = x.qdtype
        if tracing():  # torch.compile / torch.export: the same table from tensor ops, no grid read into Python
            codes = torch.arange(d.quant_min, d.quant_max + 1, device=x.device, dtype=torch.float32)
            return self._quantize_out(self._f((codes - x.zero_point.to(torch.float32)) * x.scale.to(torch.float32)))
        key = (float(x.scale), int(x.zero_point), d.quant_min, d.quant_max, x.device,
               float(self.scale), int(self.zero_point), self.qdtype, self._params())
        hit = self._lut
        if hit is None or hit[0] != key:
            codes = torch.arange(d.quant_min, d.quant_max + 1, device=x.device, dtype=torch.float32)
            hit = self._lut = (key, self._quantize_out(self._f((codes - key[1]) * x.scale.to(torch.float32))))
        return hit[1]

    def _params(self) -> tuple:
        return ()

    def forward(self, input: torch.Tensor | QTensor) -> QTensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if isinstance(x, QTensor):
            d = x.qdtype
            if x.axis is None and d.quant_max - d.quant_min < _MAX_LUT:
                idx = x.int_repr().to(torch.int64)
                if d.quant_min != 0:
                    idx = idx - d.quant_min
                return QTensor(self.lut(x)[idx], self.scale, self.zero_point, self.qdtype)
            x = x.dequantize()
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a QTensor or a float tensor, got "
                            + (f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__))
        if not isinstance(input, QTensor):  # (a NaN would become a finite code)
            check_no_nan(x, type(self).__name__)
        return QTensor(self._quantize_out(self._f(x.to(torch.float32))), self.scale, self.zero_point, self.qdtype)

    @classmethod
    def _check_float(cls, mod: nn.Module) -> None:
        if not isinstance(mod, cls._float_type):
            raise TypeError(f"{cls.__name__}.from_float expects an nn.{cls._float_type.__name__}, "
                            f"got {type(mod).__name__}")

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        """Build from a calibrated float module: the output grid comes from its ``activation_post_process``."""
        cls._check_float(mod)
        return cls(*output_qparams(mod, cls.__name__))

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, zero_point={self.zero_point.item()}, dtype={self.qdtype!r}"


class Hardswish(_LUTActivation):
    """``x * relu6(x + 3) / 6`` onto the output grid."""

    _float_type = nn.Hardswish

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardswish(x)


class ELU(_LUTActivation):
    """``x if x > 0 else alpha * (exp(x) - 1)`` onto the output grid."""

    _float_type = nn.ELU

    def __init__(self, scale: float, zero_point: int, alpha: float = 1.0,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__(scale, zero_point, qdtype)
        self.alpha = float(alpha)

    def _params(self) -> tuple:
        return (self.alpha,)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x, self.alpha)

    @classmethod
    def from_float(cls, mod: nn.Module) -> ELU:
        cls._check_float(mod)
        s, z, d = output_qparams(mod, cls.__name__)
        return cls(s, z, mod.alpha, d)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", alpha={self.alpha}"


class LeakyReLU(_LUTActivation):
    """``x if x >= 0 else negative_slope * x`` onto the output grid."""

    _float_type = nn.LeakyReLU

    def __init__(self, scale: float, zero_point: int, negative_slope: float = 0.01,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__(scale, zero_point, qdtype)
        self.negative_slope = float(negative_slope)

    def _params(self) -> tuple:
        return (self.negative_slope,)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.negative_slope)

    @classmethod
    def from_float(cls, mod: nn.Module) -> LeakyReLU:
        cls._check_float(mod)
        s, z, d = output_qparams(mod, cls.__name__)
        return cls(s, z, mod.negative_slope, d)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", negative_slope={self.negative_slope}"


class _FixedGridActivation(_LUTActivation):
    """An activation with a bounded range: the output grid defaults to fixed qparams covering it."""

    _lo: float = 0.0  # the function's range [lo, hi]; the fixed grid spans [lo, lo + 256 steps)
    _hi: float = 1.0

    def __init__(self, scale: float | None = None, zero_point: int | None = None,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        if (scale is None) != (zero_point is None):
            raise ValueError(f"{type(self).__name__}: give both scale and zero_point, or neither for the fixed grid")
        if scale is None:
            scale, zero_point = self.fixed_qparams(qdtype)
        super().__init__(scale, zero_point, qdtype)  # type: ignore[arg-type]

    @classmethod
    def fixed_qparams(cls, qdtype: QDtype | str | torch.dtype = quint8) -> tuple[float, int]:
        """The fixed 8-bit grid: ``scale = (hi - lo) / 256``, ``lo`` on the lowest code."""
        d = as_qdtype(qdtype)
        scale = (cls._hi - cls._lo) / 256
        return scale, int(d.quant_min - round(cls._lo / scale))

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        """The observed output grid when ``mod`` was prepared, else the fixed quint8 grid."""
        cls._check_float(mod)
        if getattr(mod, "activation_post_process", None) is None:
            return cls()
        return cls(*output_qparams(mod, cls.__name__))


class Sigmoid(_FixedGridActivation):
    """``1 / (1 + exp(-x))``; fixed grid scale 1/256, zero point 0 (quint8) / -128 (qint8)."""

    _float_type = nn.Sigmoid

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


class Hardsigmoid(_FixedGridActivation):
    """``relu6(x + 3) / 6``; fixed grid scale 1/256, zero point 0 (quint8) / -128 (qint8)."""

    _float_type = nn.Hardsigmoid

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardsigmoid(x)


class Tanh(_FixedGridActivation):
    """``tanh(x)``; fixed grid scale 2/256, zero point 128 (quint8) / 0 (qint8)."""

    _float_type = nn.Tanh
    _lo, _hi = -1.0, 1.0

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class ReLU6(FxLeaf, nn.Module):
    """``min(max(x, 0), 6)`` on the input's grid: ``q_out = clamp(q, z, q(6))``, exact, no requantization.

    A float input is quantized onto the quint8 grid ``(6/255, 0)``, which spans [0, 6] exactly.
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace  # accepted for torch signature parity; codes are never modified in place

    def forward(self, input: torch.Tensor | QTensor) -> QTensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point():
                raise TypeError(f"ReLU6 expects a QTensor or a float tensor, got dtype {x.dtype}")
            check_no_nan(x, "ReLU6")  # (a NaN would become a finite code)
            return QTensor(quantize(F.relu6(x), 6.0 / 255, 0, quint8), 6.0 / 255, 0, quint8)
        if not isinstance(x, QTensor):
            raise TypeError(f"ReLU6 expects a QTensor or a float tensor, got {type(x).__name__}")
        q, d = x.int_repr(), x.qdtype
        z = x.zero_point.to(torch.float32)
        s = x.scale.to(torch.float32)
        if x.axis is not None:
            shape = [-1 if i == x.axis else 1 for i in range(x.dim())]
            z, s = z.reshape(shape), s.reshape(shape)
        six = torch.clamp(torch.round(6.0 * torch.reciprocal(s)) + z, d.quant_min, d.quant_max)
        out = torch.minimum(torch.maximum(q.to(torch.float32), z), six).to(q.dtype)
        return QTensor(out, x.scale, x.zero_point, d, x.axis)

    @classmethod
    def from_float(cls, mod: nn.Module) -> ReLU6:
        if not isinstance(mod, nn.ReLU6):
            raise TypeError(f"ReLU6.from_float expects an nn.ReLU6, got {type(mod).__name__}")
        return cls(mod.inplace)

