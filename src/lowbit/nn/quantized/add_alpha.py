"""``scaled_operand``: the second operand of an add with ``alpha`` (``torch.add(a, b, alpha=c)``, ``a.add(b,
alpha=c)``) or of a sub (``torch.sub(a, b[, alpha=c])``, ``a - b``: ``-c``) on its codes, ``c · b`` as ``b``'s codes
on the grid ``(|c| · s_b, z_b)`` (mirrored for ``c < 0``), which ``convert_fx`` feeds to ``QFunctional.add``; split
from ``functional_modules``.

Its scaled grid is made once per state of ``b``'s grid and ``c`` (``_scaled_grid``) and kept in a memo on the
``QFunctional`` that adds it (``owner``, the converted graph's third argument; ``owner._scaled``, next to its memo
of the requantization constants ``owner._memo``), so every call hands ``QFunctional.add`` the same scale /
zero-point tensors and that memo (``functional_modules._fast_add``) hits, as for an add without alpha. The memo
lives and dies with its model (a process-wide cache kept up to 64 deleted models' grids alive); without an owner
(a direct call, a graph converted before session 45) the grid is made per call, the same codes.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ...compile_state import graph_leaf, tracing
from ...kernels.plan import input_grid_key
from ...qtensor import QTensor

__all__ = ["scaled_operand"]

_REAL = (numbers.Real, torch.SymInt, torch.SymFloat)  # alpha's types (a traced shape's arithmetic under compile)


@graph_leaf  # (one node when torch.fx traces it, re-tracing a pickled GraphModule's code included)
def scaled_operand(x: Any, alpha: float, owner: Any = None) -> Any:
    """``alpha · x``, the second operand of ``torch.add(a, b, alpha=alpha)`` (``torch.sub``: ``-alpha``), on the codes:
    the same codes on the grid ``(|alpha| · s, z)``; for ``alpha < 0`` the codes mirrored, ``q' = qmin + qmax - q``,
    ``z' = qmin + qmax - z`` (``s · (q' - z') = -s · (q - z)``). Exact but for the float32 rounding of
    ``|alpha| · s``; a float tensor (or a scale that overflows / underflows float32) is multiplied in float. With
    ``owner`` (the ``QFunctional`` that adds the result) the scaled grid is made once per state of ``x``'s grid and
    ``alpha`` and kept on ``owner`` (``_scaled_grid``): the same tensors each call, so ``owner``'s memo of its
    requantization constants hits; without, it is made per call.

    >>> import torch, lowbit as Q
    >>> qb = Q.quantize_per_tensor(torch.tensor([0.5, -0.25]), 0.25, 2, Q.quint8)
    >>> y = scaled_operand(qb, -2.0)
    >>> y.int_repr().tolist(), float(y.scale), int(y.zero_point), y.dequantize().tolist()
    ([251, 254], 0.5, 253, [-1.0, 0.5])
    >>> from lowbit.nn.quantized.functional_modules import QFunctional
    >>> qf = QFunctional(0.5, 128)
    >>> scaled_operand(qb, -2.0, qf).scale is scaled_operand(qb, -2.0, qf).scale, scaled_operand(qb, -2.0).scale is y.scale
    (True, False)
    """
    if not isinstance(alpha, _REAL) and not (isinstance(alpha, torch.Tensor) and alpha.numel() == 1):
        raise TypeError(f"scaled_operand: alpha must be a real number (torch.add / torch.sub's alpha), got "
                        f"{type(alpha).__name__} {alpha!r}")
    if isinstance(alpha, numbers.Real) and not isinstance(alpha, (int, float)):
        alpha = float(alpha)  # (Fraction(1, 2), numpy.float32: torch multiplies a scale tensor by neither / rounds)
    if not isinstance(x, QTensor):
        return x * alpha
    scale, z, ok = _scaled_grid(x, alpha, owner)
    if not ok:
        return x.dequantize() * alpha
    q = x.int_repr()
    if alpha < 0:  # (a full 8-bit range's m - q is ~q: 255 - q in uint8, -1 - q in int8; one pass, not three)
        m = x.qdtype.quant_min + x.qdtype.quant_max
        full = (q.dtype, m) in ((torch.uint8, 255), (torch.int8, -1))
        q = torch.bitwise_not(q) if full else (m - q.to(torch.int16)).to(q.dtype)
    return QTensor._trusted(q, scale, z, x.qdtype, x.axis)


_MEMO_SIZE = 8  # grids kept per QFunctional (one per state of its operand's grid and alpha: 1 in a steady model)


def _scaled_grid(x: QTensor, alpha: float, owner: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(|alpha| · s, z or qmin + qmax - z, ok)``, ``ok``: the scale finite and positive; read once per state of
    ``x``'s grid and ``alpha`` (a Python number) while nobody traces, kept in ``owner._scaled`` (with ``x``'s grid
    tensors held, so the ids in the key stay, and checked by identity: a memo copied with its module misses)."""
    memo = key = None
    if owner is not None and not tracing() and type(alpha) in (int, float):
        memo = owner.__dict__.setdefault("_scaled", {})
        key = input_grid_key(x._scale, x._zero_point) + (type(alpha), alpha, x.qdtype)
        hit = memo.get(key)
        if (hit is not None and hit[4] is x._scale and hit[5] is x._zero_point
                and input_grid_key(hit[0], hit[1]) == hit[3]):  # (unless written in place since)
            return hit[0], hit[1], hit[2]
    scale, z = x.scale * abs(alpha), x.zero_point
    ok = tracing() or bool(torch.isfinite(scale).all() and (scale > 0).all())
    if alpha < 0:
        z = x.qdtype.quant_min + x.qdtype.quant_max - z
    if memo is not None:
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[key] = (scale, z, ok, input_grid_key(scale, z), x._scale, x._zero_point)
    return scale, z, ok
