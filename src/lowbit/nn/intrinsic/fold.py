"""Folding a BatchNorm into the weight and bias of the conv / linear before it.

With ``s = gamma / sqrt(running_var + eps)`` (``gamma = 1`` for a non-affine BN)::

    W'[c] = W[c] * s[c]                      # c: the output-channel axis (1 for ConvTranspose)
    b'    = (b - running_mean) * s + beta    # b = 0 when the layer has no bias

so ``bn_eval(layer(x)) == layer'(x)`` exactly up to float rounding. ``W'`` keeps the dtype of ``W`` and ``b'``
that of ``b`` (of ``W`` when there is none), as torch.ao's ``fuse_conv_bn_weights``: an fp16 layer after which an
fp32 BN runs stays fp16 (the fused layer's forward refused its fp16 input).

>>> import torch
>>> from torch import nn
>>> conv, bn = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3).eval()
>>> bn.running_mean.uniform_(-1, 1); bn.running_var.uniform_(0.5, 2)  # doctest: +ELLIPSIS
tensor(...)
tensor(...)
>>> w, b = fold_bn_weights(conv.weight, conv.bias, bn)
>>> x = torch.randn(1, 2, 6, 6)
>>> torch.allclose(bn(conv(x)), torch.nn.functional.conv2d(x, w, b), atol=1e-5)
True
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fold_bn_weights", "bn_scale", "carry_linear_bn_check", "check_bn_statistics", "check_linear_bn_input"]


def bn_scale(bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """``gamma / sqrt(running_var + eps)`` of ``bn``, shape ``(C,)`` (differentiable in gamma)."""
    if bn.running_var is None:
        raise ValueError(f"cannot fold {type(bn).__name__} with track_running_stats=False: "
                         "it has no running statistics")
    std = torch.sqrt(bn.running_var + bn.eps)
    return (bn.weight if bn.weight is not None else torch.ones_like(std)) / std


def check_bn_statistics(bn: nn.modules.batchnorm._BatchNorm, s: torch.Tensor) -> None:
    """``ValueError`` naming the first channel whose fold is not finite: ``running_var[c]`` (NaN / Inf, or
    ``running_var[c] + eps <= 0``: a zero variance with ``eps=0`` divides by zero), else ``running_mean[c]``, the
    BN's ``weight[c]`` / ``bias[c]``. (Before, the fold went through and convert refused "the bias holds NaN/Inf
    values" of the fused conv, a parameter the user never wrote.)"""
    checks = [("running_var", bn.running_var, s)]
    checks += [(name, t, t) for name, t in (("running_mean", bn.running_mean), ("weight", bn.weight),
                                             ("bias", bn.bias)) if t is not None]
    for name, t, v in checks:
        bad = ~torch.isfinite(v.detach())
        if bool(bad.any()):
            c = int(bad.nonzero()[0, 0])
            raise ValueError(f"cannot fold {type(bn).__name__}({s.numel()}, eps={bn.eps}) into the layer before it: "
                             f"{name}[{c}] = {float(t[c])}"
                             + (f" makes 1/sqrt(running_var + eps) = {float(v[c])}" if t is not v else " is not finite")
                             + "; fix its statistics (recalibrate) or leave the BN unfused")


def fold_bn_weights(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.modules.batchnorm._BatchNorm, transpose: bool = False,
    groups: int = 1, check: bool = True, rsqrt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(W', b')`` of the layer ``bn(layer(x))`` with ``bn`` in eval mode (see module doc).

    ``weight``: ``(C_out, ...)``, or ``(C_in, C_out/groups, ...)`` with ``transpose=True``, where
    output channel ``g*(C_out/groups) + j`` owns the rows of group ``g`` at column ``j``. ``check``: a non-finite
    fold raises ``check_bn_statistics``'s error (``False``: a QAT step's live fold, unchecked). ``rsqrt``: ``s = gamma
    * rsqrt(running_var + eps)`` and the bias in torch.ao's order (``fuse_conv_bn_eval`` / ``fuse_linear_bn_eval``:
    the eval-mode fusions of ``fuse_modules`` and graph mode, bit for bit torch.ao's); else the QAT modules'
    ``gamma / sqrt(running_var + eps)``, so a QAT model in eval and its converted fold agree exactly.
    """
    s = bn_scale(bn)  # (C_out,)
    if check:
        check_bn_statistics(bn, s)
    c = weight.shape[1] * groups if transpose else weight.shape[0]
    if s.numel() != c:
        raise ValueError(f"cannot fold {type(bn).__name__}({s.numel()}) into a layer with {c} output channels")
    b = bias if bias is not None else torch.zeros_like(s)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(s)
    if rsqrt:  # torch.ao's fuse_conv_bn_weights / fuse_linear_bn_weights, operation for operation
        rs = torch.rsqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.weight is not None else torch.ones_like(rs)
        s = gamma * rs
        centred = b - bn.running_mean
        b_fold = (centred * s if weight.dim() == 2 and not transpose else centred * rs * gamma) + beta
    else:
        b_fold = (b - bn.running_mean) * s + beta
    b_fold = b_fold.to(weight.dtype if bias is None else bias.dtype)
    if not transpose:
        return (weight * s.reshape([-1] + [1] * (weight.dim() - 1))).to(weight.dtype), b_fold
    cin, cout_g, *k = weight.shape
    w = weight.reshape(groups, cin // groups, cout_g, *k) * s.reshape(groups, 1, cout_g, *[1] * len(k))
    return w.reshape(weight.shape).to(weight.dtype), b_fold


def check_linear_bn_input(linear: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    """Forward pre-hook of a ``Linear`` with a ``BatchNorm1d`` folded in: refuse an input that is not ``(N, F_in)``
    (positional, or ``input=`` where it is registered ``with_kwargs=True``, as ``fuse_modules`` does).

    The fold scales output feature ``f`` by ``s[f]``; ``BatchNorm1d`` normalises dim 1 of its input, which is the
    features only on the 2-d output of a 2-d input. On ``(N, L, F_in)`` (``L == F_out``, else the BN refused it) it
    normalised ``L``, so the folded layer computed another function, silently (torch.ao's fused Linear too).

    >>> import torch
    >>> lin = torch.nn.Linear(3, 4); _ = lin.register_forward_pre_hook(check_linear_bn_input)
    >>> lin(torch.randn(2, 3)).shape
    torch.Size([2, 4])
    >>> lin(torch.randn(2, 4, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Linear(3, 4) with a BatchNorm1d folded in takes a 2-d input (N, 3), got shape (2, 4, 3): ...
    """
    x = args[0] if args else (kwargs or {}).get("input")
    shape = getattr(x, "shape", None)  # a tensor, or a QTensor once converted
    if shape is not None and len(shape) != 2:
        shape = tuple(shape)
        what = f"dim 1 of the unfused output ({shape[1]} entries)" if len(shape) > 2 else "no batch (it refuses 1-d input)"
        raise ValueError(f"Linear({linear.in_features}, {linear.out_features}) with a BatchNorm1d folded in takes a "
                         f"2-d input (N, {linear.in_features}), got shape {shape}: BatchNorm1d normalised {what}, not "
                         f"the {linear.out_features} features the fold scales; leave this Linear and BatchNorm1d "
                         "unfused")


def carry_linear_bn_check(old: nn.Module, new: nn.Module) -> nn.Module:
    """Put ``check_linear_bn_input`` on ``new``, the module that replaces ``old`` (``convert``, ``convert_fx``), where
    ``old`` is a Linear with a BatchNorm1d folded in: it holds the check, or is a QAT ``LinearBn1d`` (a ``linear``
    layer and a ``BatchNorm1d`` ``bn``). Before, the int8 Linear of a QAT / graph-mode fold took an ``(N, L, F)``
    input silently (0.89 off the float model's output). Returns ``new``.

    >>> import torch
    >>> old = torch.nn.Linear(3, 4); _ = old.register_forward_pre_hook(check_linear_bn_input)
    >>> new = carry_linear_bn_check(old, torch.nn.Linear(3, 4))
    >>> check_linear_bn_input in new._forward_pre_hooks.values()
    True
    """
    layer, bn = getattr(old, "layer", None), getattr(old, "bn", None)
    folded = isinstance(layer, nn.Linear) and isinstance(bn, nn.BatchNorm1d)
    if new is not old and (folded or check_linear_bn_input in old._forward_pre_hooks.values()) \
            and check_linear_bn_input not in new._forward_pre_hooks.values():
        new.register_forward_pre_hook(check_linear_bn_input, with_kwargs=True)
    return new
