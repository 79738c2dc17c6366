"""The one code formula of a converted model: where a float lands on an integer grid, and its rounded code.

``quantize`` (so ``quantize_per_channel``, ``convert``'s weight quantization and every Quantize step) computes, in
float32 with one rounding per operation::

    v = fl(fl(x · fl(1 / s)) + z)              # grid_position: the unrounded code
    q = clamp(round_half_even(v), qmin, qmax)  # round_codes

which is not ``round(x / s) + z``: the product with the reciprocal differs from the quotient by an ulp next to a tie,
and adding an odd ``z`` before rounding sends an exact tie the other way (a symmetric per-channel grid puts each
channel's extreme weight at ±127.5 steps, an exact tie). The rounding algorithms (AdaRound, quadratic codes,
block reconstruction, distillation, ``layers.weight_codes``) take their codes from here, so their "round to
nearest" is the converted model's code for code.

Each call checks its arguments once (``check=False``: callers that already checked them, ``quantize`` /
``fake_quantize`` with ``validate``): ``x`` a floating-point tensor, ``scale`` a floating-point tensor of positive
finite steps whose float32 value and reciprocal are finite (``[2.94e-39, 3.4e38]``), ``zero_point`` a real tensor of
values finite in float32, both broadcastable to ``x``'s shape, and (``round_codes``) integer ``quant_min <=
quant_max`` in int64's range; else a ``TypeError`` / ``ValueError`` naming the value (before: a float ``x`` list
raised ``AttributeError``, a zero / negative / NaN scale or a ``quant_min > quant_max`` gave codes silently; a step
below 2.94e-39, a float32 subnormal or a float64 ``1e-300``, gave NaN codes for ``x = 0``).
The check is a few attribute tests and one reduction over ``scale``: a (320, 960) per-channel weight rounds in
the same time with and without it (``docs/design.md``).

>>> import torch
>>> s = torch.tensor([1.0 / 3.0]); z = torch.tensor([1.0])
>>> x = torch.tensor([0.5 / 3.0, 1.5 / 3.0, 100.0])
>>> round_codes(x, s, z, -128, 127).tolist()    # 1.5 and 2.5: ties to even after adding z; 301 clamps to 127
[2.0, 2.0, 127.0]
>>> (torch.round(x / s) + z).tolist()[:2]       # rounding before adding z: the other way at both ties
[1.0, 3.0]
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["grid_position", "round_codes"]

_F32_MAX = torch.finfo(torch.float32).max

def _step_min() -> float:
    """The smallest float32 step whose float32 reciprocal is finite (about 2.94e-39)."""
    t = torch.tensor(1.0 / _F32_MAX, dtype=torch.float32)
    while not torch.isfinite(torch.reciprocal(t)):
        t = torch.nextafter(t, torch.tensor(1.0))
    return float(t)


_STEP_MIN = _step_min()
_I64 = (-2 ** 63, 2 ** 63 - 1)  # the grid bounds ``clamp_`` takes


def _check(where: str, x: Any, scale: Any, zero_point: Any) -> None:
    """``x`` / ``scale`` / ``zero_point`` as the module docstring says, else an error naming the value."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{where}: x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    for name, t in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor broadcastable to x's shape {tuple(x.shape)} (0-d per "
                            f"tensor), got {type(t).__name__} {t!r}")
        if t.dtype == torch.bool or t.is_complex() or (name == "scale" and not t.is_floating_point()):
            raise TypeError(f"{where}: {name} must be a {'floating-point' if name == 'scale' else 'real'} tensor, "
                            f"got {t.dtype}")
    for t in (scale, zero_point):  # broadcastable to x without growing it (torch.broadcast_shapes: ~50 us)
        if t.dim() > x.dim() or any(n not in (1, m) for n, m in zip(reversed(t.shape), reversed(x.shape))):
            raise ValueError(f"{where}: scale {tuple(scale.shape)} and zero_point {tuple(zero_point.shape)} must "
                             f"broadcast to x's shape {tuple(x.shape)} (0-d per tensor, [1, .., C, .., 1] per channel)")
    if scale.is_meta or zero_point.is_meta:  # shapes only: no values to check
        return
    if scale.numel():  # one reduction each (aminmax keeps a NaN): positive finite steps, finite zero points
        lo, hi = (float(v) for v in torch.aminmax(scale.detach()))
        if not (lo > 0 and hi < math.inf):
            flat = scale.detach().reshape(-1)
            v = float(flat[int((~((flat > 0) & (flat < math.inf))).nonzero()[0])])
            raise ValueError(f"{where}: scale holds {v!r}; every step must be positive and finite")
        # the codes are x · fl32(1 / fl32(s)): a step under ~2.94e-39 has an infinite reciprocal there (0 · inf gave
        # NaN codes), a float64 step past float32's range is inf (both ends of the range hold the extremes)
        if not (lo >= _STEP_MIN and hi <= _F32_MAX):  # (float32 values: exact; float64: within a float32 step)
            v = lo if lo < _STEP_MIN else hi
            raise ValueError(f"{where}: scale holds {v!r}; in float32, where the codes are computed as x · (1 / s), "
                             f"every step must lie in [{_STEP_MIN:.4g}, {_F32_MAX:.4g}] (1 / s finite)")
    if zero_point.numel() and zero_point.is_floating_point():
        lo, hi = (float(v) for v in torch.aminmax(zero_point.detach()))
        if not (abs(lo) <= _F32_MAX and abs(hi) <= _F32_MAX):  # finite, and still finite in float32
            flat = zero_point.detach().reshape(-1)
            v = float(flat[int((~(flat.abs() <= _F32_MAX)).nonzero()[0])])
            raise ValueError(f"{where}: zero_point holds {v!r}; zero points must be finite in float32")


def grid_position(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, *,
                  check: bool = True) -> torch.Tensor:
    """``fl(fl(x · fl(1 / s)) + z)`` in float32 (a new tensor): the code ``x`` has on the grid before rounding.
    ``scale`` / ``zero_point`` are tensors broadcastable to ``x`` (0-d per tensor, ``[1, .., C, .., 1]`` per channel);
    ``check=False`` skips the argument check (module docstring).

    >>> grid_position(torch.tensor([0.25]), torch.tensor(0.1), torch.tensor(3.0)).tolist()
    [5.5]
    >>> grid_position(torch.tensor([0.25]), torch.tensor(0.0), torch.tensor(3.0))
    Traceback (most recent call last):
    ValueError: grid_position: scale holds 0.0; every step must be positive and finite
    """
    if check:
        _check("grid_position", x, scale, zero_point)
    return torch.mul(x.detach().to(torch.float32), torch.reciprocal(scale.to(torch.float32))).add_(
        zero_point.to(torch.float32))


def round_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                quant_max: int, *, check: bool = True) -> torch.Tensor:
    """Integer-valued float32 codes ``clamp(round_half_even(grid_position(x, s, z)), qmin, qmax)``: ``quantize``'s.

    >>> round_codes(torch.tensor([0.25, -9.0]), torch.tensor(0.1), torch.tensor(3.0), -8, 7).tolist()
    [6.0, -8.0]
    >>> round_codes(torch.tensor([0.25]), torch.tensor(0.1), torch.tensor(3.0), 7, -8)
    Traceback (most recent call last):
    ValueError: round_codes: quant_min=7 > quant_max=-8; the grid [quant_min, quant_max] is empty
    """
    if check:
        _check("round_codes", x, scale, zero_point)
        for name, v in (("quant_min", quant_min), ("quant_max", quant_max)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"round_codes: {name}={v!r} must be an int")
            if not _I64[0] <= v <= _I64[1]:  # clamp_ raised OverflowError: "int too big to convert"
                raise ValueError(f"round_codes: {name}={v!r} is outside the int64 range [-2**63, 2**63 - 1]")
        if quant_min > quant_max:
            raise ValueError(f"round_codes: quant_min={quant_min!r} > quant_max={quant_max!r}; the grid "
                             "[quant_min, quant_max] is empty")
    return grid_position(x, scale, zero_point, check=False).round_().clamp_(quant_min, quant_max)
