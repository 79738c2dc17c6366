"""LSQ / LSQ+ fake quantization as an autograd function: ``fake_quantize_learnable``, differentiable in ``x``, the scale
and the zero point (``LearnableFakeQuantize`` runs it).

Esser et al., "Learned Step Size Quantization" (ICLR 2020), with the learnable zero point of LSQ+.
With ``s`` the scale, ``z = clamp(round(zero_point), qmin, qmax)``, ``g`` the gradient factor
(``1 / sqrt(x.numel() * qmax)`` when ``use_grad_scaling``, else 1) and ``v = round(x / s) + z``::

    y      = (clamp(v, qmin, qmax) - z) * s
    dy/dx  = 1[qmin <= v <= qmax]                                   # straight-through
    dy/ds  = g * (y - x) / s    inside,   g * (qmin - z) below,   g * (qmax - z) above
    dy/dz  = 0                  inside,   -g * s             outside (below or above)

``y - x`` is evaluated with one rounding, as the fused multiply-add of torch's compiled kernels does
(so the scale gradients are bit-identical). ``ds``/``dz`` are summed over every element (per tensor;
shape ``()``) or over every axis except ``ch_axis`` (per channel; shape ``(C,)``). NaN inputs stay NaN
and contribute no gradient.

>>> import torch
>>> s = torch.tensor(0.5, requires_grad=True)
>>> y = fake_quantize_learnable(torch.tensor([0.3, 9.0]), s, torch.tensor(0.0), -8, 7)
>>> y.sum().backward()
>>> y.tolist(), round(s.grad.item(), 3)                  # 9.0 clips at qmax = 7: dy/ds = qmax - z there
([0.5, 3.5], 7.4)
"""

from __future__ import annotations

import math

import torch

from ..functional import check_ch_axis

__all__ = ["fake_quantize_learnable"]


def _view(p: torch.Tensor, x: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``p`` (``()`` or ``(C,)``) shaped to broadcast against ``x`` along ``axis``."""
    if axis is None:
        return p.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return p.reshape(shape)


class _LearnableFakeQuantizeFn(torch.autograd.Function):
    # forward and its LSQ backward side by side (micrograd style)
    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max, axis, grad_factor):  # type: ignore[override]
        s = _view(scale.detach().to(torch.float32), x, axis)
        z = _view(zero_point.detach().to(torch.float32).round().clamp(quant_min, quant_max), x, axis)
        xf = x.detach().to(torch.float32)
        v = torch.round(xf * torch.reciprocal(s)) + z                  # unclipped codes, float
        y = (v.clamp(quant_min, quant_max) - z) * s
        ctx.save_for_backward(xf, v, s, z)
        ctx.qrange, ctx.axis, ctx.grad_factor = (quant_min, quant_max), axis, grad_factor
        ctx.shapes = scale.shape, zero_point.shape
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        xf, v, s, z = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        below, above = v < qmin, v > qmax
        inside = (v >= qmin) & (v <= qmax)                             # NaN: in none of the three
        dy32 = dy.to(torch.float32)
        dx = (dy32 * inside).to(dy.dtype) if ctx.needs_input_grad[0] else None
        g = torch.tensor(ctx.grad_factor, dtype=torch.float32, device=xf.device)
        dims = [d for d in range(xf.dim()) if d != ctx.axis] if ctx.axis is not None else None

        def reduce(t: torch.Tensor) -> torch.Tensor:  # to the parameter's shape, () or (C,)
            return t.sum() if dims is None else (t.sum(dims) if dims else t)  # sum([]) would sum everything

        ds = dz = None
        if ctx.needs_input_grad[1]:
            # y - x with one rounding, (q - z) * s - x (exact in float64, then float32): the fused
            # multiply-add torch's compiled kernels evaluate (a float32 product rounded first differs by ulps)
            err = ((v.clamp(qmin, qmax) - z).double() * s.double() - xf.double()).to(torch.float32)
            zero = torch.zeros((), device=xf.device)
            clipped = torch.where(below, dy32 * (qmin - z), torch.where(above, dy32 * (qmax - z), zero)) * g
            ds = reduce(torch.where(inside, dy32 * err * torch.reciprocal(s) * g, clipped)).reshape(ctx.shapes[0])
        if ctx.needs_input_grad[2]:
            dz = reduce(torch.where(below | above, -dy32 * s * g, torch.zeros((), device=xf.device))).reshape(ctx.shapes[1])
        return dx, ds, dz, None, None, None, None


def fake_quantize_learnable(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                            quant_max: int, ch_axis: int | None = None, grad_factor: float = 1.0) -> torch.Tensor:
    """LSQ fake quantization: differentiable in ``x``, ``scale`` and ``zero_point`` (module docstring).

    ``scale``/``zero_point`` are 0-d (per tensor) or ``(C,)`` with ``C = x.shape[ch_axis]``.

    >>> import torch
    >>> from lowbit.fake_quant import fake_quantize_learnable
    >>> s = torch.tensor(0.5, requires_grad=True)
    >>> fake_quantize_learnable(torch.tensor([0.3, 9.0]), s, torch.tensor(0.0), -8, 7).tolist()
    [0.5, 3.5]
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fake_quantize_learnable expects a floating-point tensor, got {got}")
    if quant_min >= quant_max:
        raise ValueError(f"fake_quantize_learnable: quant_min={quant_min} must be < quant_max={quant_max}")
    if not (isinstance(grad_factor, (int, float)) and 0 < grad_factor < math.inf):
        raise ValueError(f"fake_quantize_learnable: grad_factor={grad_factor!r} must be a positive finite number")
    axis = None if ch_axis is None else check_ch_axis(ch_axis, x.dim(), x.shape)
    channels = 1 if axis is None else x.shape[axis]
    for name, p in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"fake_quantize_learnable: {name} must be a tensor, got {type(p).__name__}")
        if p.numel() != channels or (axis is not None and p.dim() != 1):
            raise ValueError(f"fake_quantize_learnable: {name} of shape {tuple(p.shape)} does not fit "
                             f"{'per-tensor' if axis is None else f'ch_axis={ch_axis} of'} a tensor of shape "
                             f"{tuple(x.shape)}")
    return _LearnableFakeQuantizeFn.apply(x, scale, zero_point, int(quant_min), int(quant_max), axis,
                                          float(grad_factor))
