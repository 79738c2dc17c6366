"""The ``torch.ops.lowbit`` ops' argument checks, shared by each op's real and fake implementation.

Called by hand, a wrong shape or dtype failed deep in fbgemm / oneDNN (a 1-d ``qlinear`` weight freed an invalid
pointer and took the process down) or gave garbage (int64 / float codes, a short zero point vector). The real and the
fake implementation of each op run the same checks, so an eager call, ``torch.compile`` and ``torch.export`` raise the
same error, ``lowbit::<op>: <what is wrong, with its shape or dtype>``. The checks read attributes only (no tensor
data) and static dims only (a dynamic batch adds no guard); the common case is one boolean expression per call.

>>> import torch
>>> w = torch.zeros(8, 16, dtype=torch.int8)
>>> try:
...     check_weight("qlinear", w, torch.ones(3), torch.zeros(3, dtype=torch.int64), None, 2)
... except ValueError as e:
...     print(str(e).split(" or ")[0])
lowbit::qlinear: w_scale of shape (3,) must hold 1 value
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..compile_state import qdtype_from_key
from ..kernels import ConvSpec

__all__ = ["bad_arg", "check_codes", "check_conv", "check_dynamic_x", "check_geometry", "check_linear",
           "check_per_tensor", "check_qfunctional", "check_weight", "check_weight_only", "check_weight_only_x",
           "grids_ok"]

# Cost (session 34, A/B on a 2-core EPYC): the real implementations check the weight side once per weight, grid and
# bias objects (``kernel_ops.checked_weight``, kept in the weight's cache as the plans are) and the input side per
# call: +0.4-1.1 µs on a 13 µs M = 1 ``qlinear`` and an 11 µs ``dynamic_linear``.


def bad_arg(op: str, text: str, error: type[Exception] = ValueError) -> Exception:
    """The error an op raises for an argument: ``lowbit::<op>: <text>``."""
    return error(f"lowbit::{op}: {text}")


@functools.lru_cache(maxsize=256)
def codes_dtype(key: str) -> torch.dtype:
    """The storage dtype of a ``qdtype_key``'s codes (parsed once per distinct key)."""
    return qdtype_from_key(key).storage


def check_codes(op: str, name: str, codes: torch.Tensor, key: str) -> None:
    """``codes`` (argument ``name``) are stored in ``key``'s storage dtype, as ``QTensor.int_repr()`` gives them."""
    if codes.dtype != codes_dtype(key):
        raise bad_arg(op, f"{name} must hold {codes_dtype(key)} codes of the grid {key!r}, got dtype {codes.dtype}",
                      TypeError)


def check_per_tensor(op: str, name: str, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> None:
    """A per-tensor grid: one scale and one zero point, both or neither."""
    if (scale is None) != (zero_point is None):
        raise bad_arg(op, f"{name}_scale and {name}_zero_point go together, got "
                          f"{'None' if scale is None else 'a tensor'} and {'None' if zero_point is None else 'a tensor'}")
    if scale is not None and (scale.numel() != 1 or zero_point.numel() != 1):  # type: ignore[union-attr]
        raise bad_arg(op, f"{name}_scale and {name}_zero_point must hold one value each ({name} is quantized per "
                          f"tensor), got shapes {tuple(scale.shape)} and {tuple(zero_point.shape)}")  # type: ignore[union-attr]


def grids_ok(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
             out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None) -> bool:
    """The per-call side of ``check_codes`` / ``check_per_tensor`` for ``x`` and the output grid, as one expression."""
    return (x.dtype == codes_dtype(x_qdtype) and x_scale.numel() == 1 and x_zero_point.numel() == 1
            and (out_scale.numel() == 1 == out_zero_point.numel() if out_scale is not None and out_zero_point is not None
                 else out_scale is out_zero_point))


def check_weight(op: str, weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                 bias: torch.Tensor | None, dim: int, axis: int = 0, n_out: Any = None) -> None:
    """An int8 weight of ``dim`` dims with a per-tensor or per-channel grid (1 or ``weight.shape[axis]`` values) and a
    bias of the output channels (``weight.shape[0]``, or ``n_out`` where that differs: a transposed conv)."""
    if weight.dtype != torch.int8:
        raise bad_arg(op, f"weight must hold int8 codes, got dtype {weight.dtype}", TypeError)
    if weight.dim() != dim:
        raise bad_arg(op, f"weight must be {dim}-d, got shape {tuple(weight.shape)}")
    n = weight.shape[axis]
    for name, t in (("w_scale", w_scale), ("w_zero_point", w_zero_point)):
        if t.dim() > 1 or (t.numel() != 1 and t.numel() != n):
            raise bad_arg(op, f"{name} of shape {tuple(t.shape)} must hold 1 value or one per channel of the "
                              f"weight's dim {axis} ({n}: weight shape {tuple(weight.shape)})")
    n_out = weight.shape[0] if n_out is None else n_out
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n_out):
        raise bad_arg(op, f"bias of shape {tuple(bias.shape)} must be ({n_out},), one value per output channel "
                          f"(weight shape {tuple(weight.shape)})")


def check_linear(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
                 weight: torch.Tensor, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None) -> None:
    """``qlinear``'s input side, its weight checked (``check_weight``): ``x`` ``(*, K)`` codes on a per-tensor grid,
    a per-tensor output grid or none."""
    if grids_ok(x, x_scale, x_zero_point, x_qdtype, out_scale, out_zero_point) and x.dim() and x.shape[-1] == weight.shape[1]:
        return
    check_codes(op, "x", x, x_qdtype)
    check_per_tensor(op, "x", x_scale, x_zero_point)
    check_per_tensor(op, "out", out_scale, out_zero_point)
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise bad_arg(op, f"x of shape {tuple(x.shape)} does not end in the weight's K={weight.shape[1]} "
                          f"(weight shape {tuple(weight.shape)})")


def check_geometry(op: str, spec: ConvSpec) -> None:
    """One stride, padding, dilation (and output padding, transposed) per spatial dim, positive strides, dilations and
    groups, non-negative paddings."""
    d = spec.dim
    if (d == 0 or len(spec.padding) != d or len(spec.dilation) != d or (spec.transposed and len(spec.output_padding) != d)
            or spec.groups < 1 or min(*spec.stride, *spec.dilation) < 1 or min(spec.padding) < 0):
        raise bad_arg(op, f"stride={list(spec.stride)}, padding={list(spec.padding)}, dilation={list(spec.dilation)}"
                          f"{f', output_padding={list(spec.output_padding)}' if spec.transposed else ''}, "
                          f"groups={spec.groups}: one value per spatial dim each, strides, dilations and groups >= 1, "
                          "paddings >= 0")


def check_conv(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
               weight: torch.Tensor, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None,
               spec: ConvSpec) -> None:
    """``qconv``'s input side, its weight (``check_weight``) and geometry (``check_geometry``) checked: ``(N, C,
    *spatial)`` codes on a per-tensor grid, ``C`` the weight's input channels (times ``groups``)."""
    c_in = weight.shape[0] if spec.transposed else weight.shape[1] * spec.groups
    if grids_ok(x, x_scale, x_zero_point, x_qdtype, out_scale, out_zero_point) and x.dim() == spec.dim + 2 \
            and x.shape[1] == c_in:
        return
    check_codes(op, "x", x, x_qdtype)
    check_per_tensor(op, "x", x_scale, x_zero_point)
    check_per_tensor(op, "out", out_scale, out_zero_point)
    if x.dim() != spec.dim + 2:
        raise bad_arg(op, f"x of shape {tuple(x.shape)} must be {spec.dim + 2}-d (N, C, *spatial) for a {spec.dim}-d "
                          "convolution")
    raise bad_arg(op, f"x of shape {tuple(x.shape)} has {x.shape[1]} channels; the weight of shape "
                      f"{tuple(weight.shape)} with groups={spec.groups} takes {c_in}")


def check_dynamic_x(x: torch.Tensor, weight: torch.Tensor) -> None:
    """``dynamic_linear``'s input, its weight checked (``check_weight``): ``(M, K)`` float."""
    if x.is_floating_point() and x.dim() == 2 and x.shape[1] == weight.shape[1]:
        return
    if not x.is_floating_point():
        raise bad_arg("dynamic_linear", f"x must be a float tensor, got dtype {x.dtype}", TypeError)
    raise bad_arg("dynamic_linear", f"x of shape {tuple(x.shape)} must be (M, K) with the weight's K={weight.shape[1]} "
                                    f"(weight shape {tuple(weight.shape)})")


def check_weight_only_x(x: torch.Tensor, spec: list[int]) -> None:
    """``weight_only_linear``'s input: ``(*, in_features)`` float (``spec``:
    ``[in_features, out_features, bits, group_size, symmetric, relu]``)."""
    if x.is_floating_point() and x.dim() and len(spec) == 6 and x.shape[-1] == spec[0]:
        return
    if len(spec) != 6:
        raise bad_arg("weight_only_linear", f"spec={list(spec)} must be [in_features, out_features, bits, group_size, "
                                            "symmetric, relu]")
    if not x.is_floating_point():
        raise bad_arg("weight_only_linear", f"x must be a float tensor, got dtype {x.dtype}", TypeError)
    raise bad_arg("weight_only_linear", f"x of shape {tuple(x.shape)} does not end in in_features={spec[0]} "
                                        f"(spec={list(spec)})")


def check_weight_only(qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
                       bias: torch.Tensor | None, spec: list[int]) -> None:
    """``weight_only_linear``'s tensors against ``spec`` (its values are ``WeightOnlyLinear``'s constructor's to check):
    ``qweight`` ``(out_features, in_features // 2)`` uint8 (4 bits) or ``(out_features, in_features)`` int8, one row
    of scales and zero points per output feature, bias ``(out_features,)``."""
    op = "weight_only_linear"
    k, n, bits = spec[0], spec[1], spec[2]
    want = (torch.uint8, (n, k // 2)) if bits == 4 else (torch.int8, (n, k))
    if qweight.dtype != want[0] or tuple(qweight.shape) != want[1]:
        raise bad_arg(op, f"qweight of dtype {qweight.dtype} and shape {tuple(qweight.shape)} does not hold {bits}-bit "
                          f"codes of spec={list(spec)} ({want[0]}, {want[1]})")
    if scales.dim() != 2 or scales.shape[0] != n or zero_points.shape != scales.shape:
        raise bad_arg(op, f"scales of shape {tuple(scales.shape)} and zero_points of shape {tuple(zero_points.shape)} "
                          f"must both be ({n}, groups), one row per output feature (spec={list(spec)})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise bad_arg(op, f"bias of shape {tuple(bias.shape)} must be ({n},) (spec={list(spec)})")


QF_OPS = {"add": False, "add_relu": False, "mul": False, "add_scalar": True, "mul_scalar": True}  # op: takes c?


def check_qfunctional(op: str, x: torch.Tensor, x_qdtype: str, y: torch.Tensor | None, y_qdtype: str,
                       out_scale: torch.Tensor, out_zero_point: torch.Tensor) -> None:
    """``qfunctional``'s arguments: one of its ops, codes in their grids' storage dtypes, ``y`` exactly for the binary
    ops and broadcastable with ``x``, a per-tensor output grid."""
    name = "qfunctional"
    scalar = QF_OPS.get(op)
    if scalar is None:
        raise bad_arg(name, f"op={op!r} is not one of {sorted(QF_OPS)}")
    if scalar != (y is None):
        raise bad_arg(name, f"op={op!r} takes {'the scalar c and y=None' if scalar else 'a tensor y'}, got "
                            f"{'None' if y is None else 'a tensor'} for y")
    check_codes(name, "x", x, x_qdtype)
    check_per_tensor(name, "out", out_scale, out_zero_point)
    if y is not None:
        check_codes(name, "y", y, y_qdtype)
        if y.shape != x.shape:
            try:
                torch.broadcast_shapes(x.shape, y.shape)
            except RuntimeError:
                raise bad_arg(name, f"x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)} do not "
                                    "broadcast") from None
