"""Cache-blocked quantization of large float tensors: ``functional.quantize``'s arithmetic, bit for bit.

``q = clamp(round(x · inv + z), qmin, qmax)`` (``inv = float32(1 / s)``) is four elementwise passes
plus a cast. On a large tensor each pass streams it through memory again (and the float → uint8
cast is a scalar loop in torch's CPU kernels), so ``codes`` runs the passes on blocks of rows that
stay in L2, reusing one float32 scratch block::

    for each block b of rows:   t = x_b · inv_b;  t += z_b;  round(t);  clamp(t)     # in L2
                                out_b = int8(t - 128)   (uint8 storage)   or   int8(t) / int16(t) / ...
    uint8 storage: out ^= 0x80  (int8(v - 128) viewed as uint8, xor 128, is v); a 7-bit uint8 grid
    (qmax ≤ 127) is int8(t) viewed as uint8, no shift

``inv`` / ``z`` are 0-d (per tensor) or ``(R, 1)`` (one grid per row: per-token) float32 tensors.

>>> import torch
>>> from lowbit.blocked import codes
>>> x = torch.tensor([[0.26, -1.0], [2.0, 0.5]])
>>> codes(x, torch.tensor(10.0), torch.tensor(128.0), 0, 255, torch.uint8, block=2).tolist()
[[131, 118], [148, 133]]
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "codes"]

# floats per block: a 256 KiB scratch, its input block and codes fit in a 2 MiB L2. 8-bit per-tensor and per-token
# codes on CPU no longer come here: lowbit.qstore's one pass beats these blocks at every size measured (98K-2M floats)
BLOCK = 65536

_C128 = torch.tensor(128.0)


def codes(x2: torch.Tensor, inv: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int, storage: torch.dtype,
          block: int = BLOCK) -> torch.Tensor:
    """Integer codes of the contiguous 2-d float32 ``x2`` (``(R, C)``) in ``storage``, by row blocks."""
    r, c = x2.shape
    rows = max(1, block // max(1, c))
    u8 = storage == torch.uint8 and qmax > 127  # codes in [0, 127] (a 7-bit grid) need no shift: int8 as they are
    seven = storage == torch.uint8 and not u8
    out = torch.empty((r, c), dtype=torch.int8 if u8 or seven else storage, device=x2.device)
    tmp = torch.empty((min(rows, r), c), dtype=torch.float32, device=x2.device)
    per_row = inv.dim() > 0
    for i in range(0, r, rows):
        n = min(rows, r - i)
        t = tmp[:n]
        torch.mul(x2[i:i + n], inv[i:i + n] if per_row else inv, out=t)
        t.add_(z[i:i + n] if per_row else z).round_().clamp_(qmin, qmax)
        if u8:
            t.sub_(_C128)  # exact on integers: int8(v - 128) is a vectorised cast, uint8(v) a scalar loop
        out[i:i + n].copy_(t)
    return out.view(torch.uint8).bitwise_xor_(128) if u8 else out.view(torch.uint8) if seven else out
