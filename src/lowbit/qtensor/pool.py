"""Max pooling of ``QTensor`` codes: exact, the grid is unchanged.

``max`` is monotone in the codes (``x̂ = (q - z) s`` with ``s > 0``), so pooling the codes is pooling the
values: ``q_out[n, c, i, j] = max_{di < kh, dj < kw} q[n, c, i·sh + di - ph, j·sw + dj - pw]``.

Paths (all give the same codes):

- 2-d, channels-last uint8/int8 codes on CPU, no dilation, no ``ceil_mode``, no padding (the layout oneDNN's
  int8 convs produce): one native pass (``lowbit.native.maxpool_codes``, vector maxima along the contiguous
  channel dim; SmallCNN's 64×32×14×14 → 7×7 pool ~27 µs against ~50 for the two ``maximum`` calls below) where
  ``lowbit.native`` is built, else the window maximum as ``torch.maximum`` over strided views, vectorised along the
  contiguous channel dim. For the common 2×2 / stride 2 window on even sizes the two ``W`` neighbours are
  adjacent halves of one ``2C`` row, so it is two ``maximum`` calls on plain views (SmallCNN, 64×16×28×28:
  ~0.05 ms, where torch's quantized ``max_pool2d`` takes ~0.9 ms at 16 channels);
- other 2-d uint8 CPU codes: torch's quantized ``max_pool2d`` (one pass);
- the rest: the float op on codes converted to float32 (exact for 8- and 16-bit codes; float64 for 32-bit ones).

While ``torch.compile`` / ``torch.export`` trace, the strided-view path runs as one opaque op,
``lowbit::max_pool2d_codes`` (``lowbit.pt2``), on the 8-bit codes: inlined, inductor fused the window reads into
the next kernel (SmallCNN's ``flatten``: a scalar gather, ~0.6 ms at batch 64).

>>> import torch, torch.nn.functional as F, lowbit as Q
>>> x = torch.arange(16.0).reshape(1, 1, 4, 4)
>>> qt = Q.quantize_per_tensor(x, 1.0, 0, Q.quint8)
>>> F.max_pool2d(qt.contiguous(memory_format=torch.channels_last), 2).int_repr()[0, 0].tolist()
[[5, 7], [13, 15]]
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import native
from ..compile_state import tracing
from ..functional import as_torch_quantized
from . import _INT_OPS, QTensor

__all__ = ["max_pool2d_codes", "as_torch_quantized"]


def _pair(v: Any, default: Any = None) -> tuple[int, int] | None:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return (int(v[0]), int(v[1]))
    if isinstance(v, (list, tuple)) and len(v) == 1 and isinstance(v[0], int):
        return (int(v[0]), int(v[0]))
    return None


def max_pool2d_codes(q: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                     ceil_mode: bool = False) -> torch.Tensor | None:
    """2-d max pooling of channels-last ``(N, C, H, W)`` 8-bit codes by strided-view maxima, or ``None``
    when the case is not covered (then the caller pools another way). The output is channels-last."""
    k, s = _pair(kernel_size), _pair(stride, kernel_size)
    if (k is None or s is None or ceil_mode or _pair(padding) != (0, 0) or _pair(dilation) != (1, 1)
            or q.dim() != 4 or q.element_size() != 1 or q.device.type != "cpu" or min(k) < 1 or min(s) < 1
            or not q.is_contiguous(memory_format=torch.channels_last) or (not tracing() and q.numel() == 0)):
        return None
    n, c, h, w = q.shape
    (kh, kw), (sh, sw) = k, s
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    if ho <= 0 or wo <= 0 or kh * kw > 16:
        return None
    if tracing():  # one opaque op (lowbit.pt2): the window reads stay out of the next kernel's index order
        return torch.ops.lowbit.max_pool2d_codes(q, [kh, kw], [sh, sw])
    y = native.maxpool_codes(q, kh, kw, sh, sw)  # one pass (None: no native build)
    if y is not None:
        return y
    if k == s == (2, 2) and h % 2 == 0 and w % 2 == 0:
        rows = q.permute(0, 2, 3, 1).reshape(n, ho, 2, wo, 2 * c)  # a view: (W pairs) x C are contiguous
        m = torch.maximum(rows[:, :, 0], rows[:, :, 1])
        return torch.maximum(m[..., :c], m[..., c:]).permute(0, 3, 1, 2)
    out = torch.empty((n, c, ho, wo), dtype=q.dtype, memory_format=torch.channels_last)
    views = [q[:, :, di:di + sh * (ho - 1) + 1:sh, dj:dj + sw * (wo - 1) + 1:sw] for di in range(kh) for dj in range(kw)]
    if len(views) == 1:
        return out.copy_(views[0])
    torch.maximum(views[0], views[1], out=out)
    for v in views[2:]:
        torch.maximum(out, v, out=out)
    return out


def _max_pool(fn: Callable, spatial: int) -> Callable:
    """``fn`` (a max pooling of the last ``spatial`` dims) on the codes. A per-channel ``QTensor`` whose channel axis
    is not pooled keeps its grid too (``s > 0`` per channel: the maximum of the codes is the maximum of the values);
    until session 36 it fell back to float values (a float ``Tensor`` out, warned)."""
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        if (not isinstance(x, QTensor) or kwargs.get("return_indices")
                or (x.axis is not None and x.axis >= x.dim() - spatial)):
            return NotImplemented
        q = x.int_repr()
        if fn is F.max_pool2d:  # eager, and traced: the compiled kernel then works on the 8-bit codes too
            y = max_pool2d_codes(q, *args, **{k: v for k, v in kwargs.items() if k != "return_indices"})
            if y is not None:
                return _keep_grid(x, y)
            if q.dtype == torch.uint8 and q.device.type == "cpu" and not tracing():  # torch pools uint8 as quint8
                return _keep_grid(x, fn(as_torch_quantized(q), *args, **kwargs).int_repr())
        wide = torch.float32 if q.element_size() <= 2 else torch.float64  # (float32 rounded qint32 codes past 2**24)
        return _keep_grid(x, fn(q.to(wide), *args, **kwargs).to(q.dtype))
    return op


def _keep_grid(x: QTensor, q: torch.Tensor) -> QTensor:
    """Codes ``q`` on ``x``'s grid, per tensor or per channel on the same (unpooled) axis."""
    if x.axis is None:
        return x._same_grid(q)
    return QTensor._trusted(q, x.scale, x.zero_point, x.qdtype, axis=x.axis)


_INT_OPS.update({
    F.max_pool1d: _max_pool(F.max_pool1d, 1),
    F.max_pool2d: _max_pool(F.max_pool2d, 2),
    F.max_pool3d: _max_pool(F.max_pool3d, 3),
    F.adaptive_max_pool2d: _max_pool(F.adaptive_max_pool2d, 2),
})
