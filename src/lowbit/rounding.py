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

>>> import torch
>>> s = torch.tensor([1.0 / 3.0]); z = torch.tensor([1.0])
>>> x = torch.tensor([0.5 / 3.0, 1.5 / 3.0, 100.0])
>>> round_codes(x, s, z, -128, 127).tolist()    # 1.5 and 2.5: ties to even after adding z; 301 clamps to 127
[2.0, 2.0, 127.0]
>>> (torch.round(x / s) + z).tolist()[:2]       # rounding before adding z: the other way at both ties
[1.0, 3.0]
"""

from __future__ import annotations

import torch

__all__ = ["grid_position", "round_codes"]


def grid_position(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """``fl(fl(x · fl(1 / s)) + z)`` in float32 (a new tensor): the code ``x`` has on the grid before rounding.
    ``scale`` / ``zero_point`` are tensors broadcastable to ``x`` (0-d per tensor, ``[1, .., C, .., 1]`` per channel).

    >>> grid_position(torch.tensor([0.25]), torch.tensor(0.1), torch.tensor(3.0)).tolist()
    [5.5]
    """
    return torch.mul(x.detach().to(torch.float32), torch.reciprocal(scale.to(torch.float32))).add_(
        zero_point.to(torch.float32))


def round_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                quant_max: int) -> torch.Tensor:
    """Integer-valued float32 codes ``clamp(round_half_even(grid_position(x, s, z)), qmin, qmax)``: ``quantize``'s.

    >>> round_codes(torch.tensor([0.25, -9.0]), torch.tensor(0.1), torch.tensor(3.0), -8, 7).tolist()
    [6.0, -8.0]
    """
    return grid_position(x, scale, zero_point).round_().clamp_(quant_min, quant_max)
