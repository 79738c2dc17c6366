"""Custom ops for the float-in/float-out quantized modules and ``QFunctional``'s integer arithmetic.

- ``lowbit::dynamic_linear(x (M, K), int8 weight (N, K), ...) -> (M, N)`` in ``x``'s dtype: per-token
  dynamic quantization, the int8 GEMM and the per-row epilogue of ``nn.quantized.dynamic.Linear``
  (``w_qdtype`` ``"<weight grid>|<activation>"`` for its 7-bit recipes, ``reduced.py``);
- ``lowbit::weight_only_linear(x (M, K), qweight, scales, zero_points, bias, ...) -> (M, N)``:
  ``WeightOnlyLinear``'s forward (int4 CPU kernel, int8 scaling or dequantize + ``F.linear``), in
  ``x``'s dtype;
- ``lowbit::qfunctional(op, a, b | None, c, out grid) -> codes``: ``QFunctional``'s ``add``,
  ``add_relu``, ``mul``, ``add_scalar``, ``mul_scalar`` on per-tensor QTensor codes;
- ``lowbit::max_pool2d_codes(codes (N, C, H, W) channels-last, kernel, stride) -> codes``: the eager
  strided-view window maximum (``qtensor.pool``). Opaque on purpose: inlined, inductor fused the window
  reads into the next kernel's index order (a ``flatten`` to NCHW order: a scalar gather with an integer
  division per element, 0.8 ms for SmallCNN's 64 × 32 × 14 × 14 add + pool + flatten on the Zen 4 EPYC);
  realized here, the ``flatten`` is a plain transposing copy;
- ``lowbit::quantize_codes(x float32, scale, zero_point, qdtype) -> codes``: the ``Quantize`` stub's eager
  forward on a CPU float32 input (with ``lowbit.native``: its one pass, NaN check included), what a traced stub
  emits where the native build exists (``native.traced_available``);
- ``lowbit::contiguous_codes(codes (N, C, H, W) channels-last) -> codes in NCHW order``: the copy a
  ``flatten`` / 2-d ``reshape`` of channels-last QTensor codes needs, as eager makes it (``native.to_contiguous``;
  inlined, inductor's copy was a scalar gather with an integer division per byte, ~105 µs for SmallCNN's
  64 × 32 × 7 × 7 codes against ~28 µs).

The implementations are the eager code (packed weights cached per weight tensor object), so a
compiled or exported program gives the eager numbers bit for bit.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.dynamic import Linear
>>> m = Linear.from_float(torch.nn.Linear(8, 4))
>>> x = torch.randn(3, 8)
>>> y = torch.ops.lowbit.dynamic_linear(x, m.weight_int8, m.weight_scale, m.weight_zero_point, "qint8:-128:127", m.bias)
>>> torch.equal(y, m(x))
True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import native
from ..compile_state import qdtype_from_key, tensor_version
from ..nn.quantized.dynamic.reduced import forward as _reduced_forward
from ..nn.quantized.functional_modules import QFunctional, _add_numbers, _fbgemm_dequantize
from ..nn.quantized._utils import check_out_grid
from ..nn.quantized.stubs import Quantize, grid_numbers, quantize_cpu
from ..qscheme import QDtype
from ..nn.quantized.weight_only import WeightOnlyLinear
from ..qtensor import QTensor
from ..qtensor.layout import nchw_copy
from ..qtensor.pool import max_pool2d_codes
from .checks import (check_dynamic_x, check_qfunctional, check_weight,
                     check_weight_only, check_weight_only_x)
from ..nn.quantized.dynamic import per_token as _per_token
from .fast_entry import _still
from .kernel_ops import _CACHES, cached_weight, checked_weight, held_copies, same_values, weight_cache
from .quant_ops import define, like

__all__: list[str] = []


def dynamic_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   w_qdtype: str, bias: torch.Tensor | None) -> torch.Tensor:
    hit = _CACHES.get(id(weight))  # the fast entry (_dyn_fast): the oneDNN route after identity and version checks
    if hit is not None and hit[0]() is weight:
        y = _dyn_fast(hit[1].get(("pt2.dyn_fast", w_qdtype)), x, weight, w_scale, w_zero_point, bias)
        if y is not None:
            return y
    given, w_given = (w_scale, w_zero_point, bias), weight
    cache, weight, (w_scale, w_zero_point, bias) = checked_weight("dynamic_linear", weight, w_scale, w_zero_point, bias,
                                                                  2)
    check_dynamic_x(x, weight)
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[0])
    key, _, act = w_qdtype.partition("|")  # "qint8:-128:127" (per token) or "...|per_token_7bit" (reduced.py)
    y = _reduced_forward(act or "per_token", x, weight, w_scale, w_zero_point, qdtype_from_key(key), bias, cache)
    if not act and x.dtype == torch.float32 and x.is_cpu and not x.requires_grad:
        _arm_dyn(cache, w_qdtype, x, w_given, given, (w_scale, w_zero_point, bias))
    # x's dtype, as the eager module returns: a program exported on float32 and fed float16 gave float32
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).contiguous()


def _arm_dyn(cache: dict[Any, Any], w_qdtype: str, x: torch.Tensor, weight: torch.Tensor, given: tuple[Any, ...],
             used: tuple[Any, ...]) -> None:
    """Keep ``dynamic_linear``'s fast entry for ``w_qdtype`` in the weight's cache after a per-token call that took the
    oneDNN route (``per_token.onednn_route``): the plan with what its key and ``checked_weight`` read of the layer, the
    given grid and bias objects (not where ``checked_weight`` gave held copies back: AOTInductor's per-call constants),
    their versions and addresses, the given weight's version and address (``cached_weight``'s key: the tensor it holds
    has a version counter of its own inside a compiled program)."""
    plan = cache.get("per_token.plan")
    if (plan is None or plan.weight is None or any(a is not b for a, b in zip(given, used, strict=True))
            or not _per_token.onednn_route(plan, x)):
        return
    ts = tuple(_still(t) for t in given)
    cache[("pt2.dyn_fast", w_qdtype)] = (given, ts, tuple(t._version for t in ts),
                                         tuple(-1 if t is None else t.data_ptr() for t in given),
                                         -1 if weight.is_inference() else weight._version, weight.data_ptr(), plan)


def _dyn_fast(entry: Any, x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """``dynamic_linear``'s later calls of a layer ``_arm_dyn`` armed: ``_grid_codes`` and ``onednn_rows`` (the full
    body's route and floats) once the given grid and bias are the armed objects at their versions and addresses, the
    weight at its version and address (``cached_weight``'s checks), and ``x`` a float32 CPU ``(M, K)`` the route takes
    (``onednn_route``: VNNI, no pinned backend, rows). ``None``: the full body runs (a non-finite row, errors)."""
    if entry is None:
        return None
    g, (ts, tz, tb), plan = entry[0], entry[1], entry[6]
    if not (g[0] is w_scale and g[1] is w_zero_point and g[2] is bias
            and (ts._version, tz._version, tb._version) == entry[2]
            and (w_scale.data_ptr(), w_zero_point.data_ptr(), -1 if bias is None else bias.data_ptr()) == entry[3]
            and (-1 if weight.is_inference() else weight._version) == entry[4] and weight.data_ptr() == entry[5]
            and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == plan.w_t.shape[0] and x.is_cpu
            and not x.requires_grad and _per_token.onednn_route(plan, x)):
        return None
    codes = _per_token._grid_codes(x)
    return None if codes is None else _per_token.onednn_rows(plan, *codes, w_scale, w_zero_point, bias)


def _dynamic_linear_fake(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str,
      bias: torch.Tensor | None) -> torch.Tensor:
    check_weight("dynamic_linear", weight, w_scale, w_zero_point, bias, 2)
    check_dynamic_x(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _weight_only_module(qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
                        bias: torch.Tensor | None, spec: list[int], kernel: str) -> WeightOnlyLinear:
    """A ``WeightOnlyLinear`` viewing these tensors (cached per tensor versions: keeps its int4 pack). Its grid and bias
    are copies held by the cache: other objects with their values (AOTInductor's inlined constants, a fresh buffer on
    every call: ``kernel_ops.checked_weight``) reuse the module instead of packing the weight again."""
    cache, qweight = cached_weight(qweight)
    key = (tuple(spec), kernel, tensor_version(qweight), tensor_version(scales), tensor_version(zero_points), id(scales),
           id(zero_points), None if bias is None else (id(bias), tensor_version(bias)))
    hit = cache.get("weight_only.module")
    if hit is not None and hit[0] == key:
        return hit[1]
    if hit is not None and hit[0][:3] == key[:3] and same_values(hit[2], (scales, zero_points, bias)):
        return hit[1]
    check_weight_only(qweight, scales, zero_points, bias, spec)  # (once per tensors and spec, as the module is kept)
    in_f, out_f, bits, group_size, symmetric, relu = spec
    m = WeightOnlyLinear(in_f, out_f, bias is not None, bits, group_size, bool(symmetric), bool(relu), kernel)
    grid = held_copies((scales, zero_points, bias))
    m.qweight, m.scales, m.zero_points = qweight, grid[0], grid[1]
    if bias is not None:
        m.bias = grid[2]
    # (the given grid rides along: while the entry holds it, the ids in the key cannot be reused)
    cache["weight_only.module"] = (key, m, grid, (scales, zero_points, bias))
    return m


def weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
                       bias: torch.Tensor | None, spec: list[int], kernel: str) -> torch.Tensor:
    """``spec``: ``[in_features, out_features, bits, group_size, symmetric, relu]``."""
    check_weight_only_x(x, spec)
    return _weight_only_module(qweight, scales, zero_points, bias, spec, kernel)._eager(x).contiguous()


def _weight_only_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
      bias: torch.Tensor | None, spec: list[int], kernel: str) -> torch.Tensor:
    check_weight_only_x(x, spec)
    check_weight_only(qweight, scales, zero_points, bias, spec)
    return x.new_empty((*x.shape[:-1], spec[1]))


class _Grid:
    """``QFunctional``'s arithmetic on an explicit output grid (no module needed)."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: Any) -> None:
        self.scale, self.zero_point, self.qdtype = scale, zero_point, qdtype


for _name in ("_out", "_from_float", "_binary", "_eager_add", "_eager_add_relu", "_eager_mul", "_eager_add_scalar",
              "_eager_mul_scalar"):
    setattr(_Grid, _name, getattr(QFunctional, _name))


class _WeakMemo(dict):  # type: ignore[type-arg]
    """``_fast_add``'s memo holding its grid tensors weakly: an entry serves while the six tensors whose ids key it
    live (so those ids are theirs), and holds none of them (an exported program's buffers die with it)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, (value[0], tuple(weakref.ref(t) for t in value[1])))

    def get(self, key: Any, default: Any = None) -> Any:
        hit = super().get(key, default)
        if hit is not default and any(r() is None for r in hit[1]):
            del self[key]
            return default
        return hit


_MEMOS: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, _WeakMemo]] = {}
_MAX_MEMOS = 64  # output grids whose memo is kept (a model has a few adds; past this all start afresh)


def _memo(scale: torch.Tensor, zero_point: torch.Tensor) -> _WeakMemo:
    """The ``_memo`` ``QFunctional``'s fast add keeps on its module (the three grids' numbers, read once per state of
    the grids: ~20 µs a call otherwise), one per output grid's tensor objects, as the op makes its ``_Grid`` afresh
    on every call. Weak throughout: nothing here keeps a tensor alive."""
    key = (id(scale), id(zero_point))
    hit = _MEMOS.get(key)
    if hit is None or hit[0]() is not scale or hit[1]() is not zero_point:
        if len(_MEMOS) >= _MAX_MEMOS:
            _MEMOS.clear()
        hit = _MEMOS[key] = (weakref.ref(scale), weakref.ref(zero_point), _WeakMemo())
    return hit[2]


def _qtensor(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str) -> QTensor:
    """A per-tensor QTensor of an op's arguments; grids traced from QTensors (0-d float32 / int64 on the codes'
    device) are taken as they are, others checked by ``QTensor``."""
    if (scale.dtype == torch.float32 and zero_point.dtype == torch.int64 and scale.dim() == 0 and zero_point.dim() == 0
            and scale.device == q.device == zero_point.device):
        return QTensor._trusted(q, scale, zero_point, qdtype_from_key(qdtype))
    return QTensor(q, scale, zero_point, qdtype_from_key(qdtype))


_ADDS: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # the armed adds (_add_entry), by op, grid strings and grid ids
_MAX_ADDS = 64


def _add_entry(key: tuple[Any, ...], x: torch.Tensor, y: torch.Tensor, grids: tuple[torch.Tensor, ...]
               ) -> torch.Tensor | None:
    """An ``add`` / ``add_relu`` whose six grid tensors are the very objects, at the versions, of an earlier call the
    native pass served (``_arm_add``): that pass on these codes (``native.qadd`` with the numbers ``_fast_add`` read
    then: the same call, so the same codes), skipping the body's checks, ``QTensor`` wraps and memo key (~10-15 µs).
    The codes' own terms (dtype, device, shape, layout) are checked here or by the pass; ``None``: the body runs."""
    hit = _ADDS.get(key)
    if hit is None:
        return None
    refs, versions, nums, xs, ys, storage = hit
    if (x.dtype is not xs or y.dtype is not ys or not x.is_cpu or x.shape != y.shape
            or any(r() is not t for r, t in zip(refs, grids)) or tuple(_still(t)._version for t in grids) != versions
            or any(t.numel() != 1 for t in grids)):  # (the numels: a .data swap, as the fast entries check)
        return None
    out = native.qadd(x, nums[2], nums[0], y, nums[3], nums[1], nums[4], nums[5], nums[6], storage)
    return None if out is None else like(out, x)


def _arm_add(key: tuple[Any, ...], x: QTensor, y: QTensor, grids: tuple[torch.Tensor, ...], qd: QDtype) -> None:
    """After a served ``add`` / ``add_relu`` of same-shape CPU codes on per-tensor grids (0-d float32 / int64 CPU
    tensors: ``_qtensor``'s trusted ones): keep its numbers for ``_add_entry``, where ``_fast_add`` would take them."""
    if not (_fbgemm_dequantize() and qd.storage in (torch.uint8, torch.int8) and x.shape == y.shape and x.is_cpu
            and all(t is not None and t.dim() == 0 and t.is_cpu and t.dtype == (torch.float32 if i % 2 == 0 else torch.int64)
                    for i, t in enumerate(grids))):
        return
    nums = _add_numbers(x, y, grids[4], grids[5], qd, key[0] == "add_relu")
    if nums is not None:
        if len(_ADDS) >= _MAX_ADDS:
            _ADDS.clear()
        _ADDS[key] = (tuple(weakref.ref(t) for t in grids), tuple(_still(t)._version for t in grids), nums,
                      x.int_repr().dtype, y.int_repr().dtype, qd.storage)


def qfunctional(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
                y: torch.Tensor | None, y_scale: torch.Tensor | None, y_zero_point: torch.Tensor | None,
                y_qdtype: str, c: float, out_scale: torch.Tensor, out_zero_point: torch.Tensor,
                out_qdtype: str) -> torch.Tensor:
    key: tuple[Any, ...] | None = None
    if y is not None and (op == "add_relu" or op == "add"):  # (SmallCNN's skip: the armed add first)
        grids = (x_scale, x_zero_point, y_scale, y_zero_point, out_scale, out_zero_point)
        key = (op, x_qdtype, y_qdtype, out_qdtype, *map(id, grids))
        fast = _add_entry(key, x, y, grids)  # type: ignore[arg-type]
        if fast is not None:
            return fast
    check_qfunctional(op, x, x_qdtype, y, y_qdtype, out_scale, out_zero_point)
    qd = qdtype_from_key(out_qdtype)
    grid = _Grid(out_scale, out_zero_point, qd)
    grid._memo = _memo(out_scale, out_zero_point)
    xq = _qtensor(x, x_scale, x_zero_point, x_qdtype)
    other: Any = c if y is None else _qtensor(y, y_scale, y_zero_point, y_qdtype)  # type: ignore[arg-type]
    before = native.counts["qadd"]
    out = getattr(grid, f"_eager_{op}")(xq, other).int_repr()
    if key is not None and native.counts["qadd"] != before and key not in _ADDS:  # (the pass served: _fast_add's)
        _arm_add(key, xq, other, grids, qd)
    out = out.clone() if out is x or out is y else out
    ref = _layout_ref(x, y)
    return like(out, ref) if ref is not None else out.contiguous()


def _layout_ref(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor | None:
    """The operand whose strides ``qfunctional``'s output has (as ``torch.empty_like``): ``x``, or ``y`` where only
    ``y`` has the broadcast shape; ``None`` (contiguous) where neither has it. The fake promises the same: a
    broadcasting ``mul`` (squeeze-excite's gate) of channels-last codes gave channels-last codes while the fake
    promised contiguous ones, and inductor's stride assertion failed the compiled model."""
    if y is None or y.shape == x.shape:
        return x
    shape = torch.broadcast_shapes(x.shape, y.shape)
    return x if x.shape == shape else y if y.shape == shape else None


def _qfunctional_fake(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
      y: torch.Tensor | None, y_scale: torch.Tensor | None, y_zero_point: torch.Tensor | None, y_qdtype: str,
      c: float, out_scale: torch.Tensor, out_zero_point: torch.Tensor, out_qdtype: str) -> torch.Tensor:
    check_qfunctional(op, x, x_qdtype, y, y_qdtype, out_scale, out_zero_point)
    dtype = qdtype_from_key(out_qdtype).storage
    ref = _layout_ref(x, y)
    if ref is not None:
        return torch.empty_like(ref, dtype=dtype)
    assert y is not None
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape), dtype=dtype)


define("dynamic_linear(Tensor x, Tensor weight, Tensor w_scale, Tensor w_zero_point, str w_qdtype, Tensor? bias) "
       "-> Tensor", dynamic_linear, _dynamic_linear_fake)
define("weight_only_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zero_points, Tensor? bias, int[] spec, "
       "str kernel) -> Tensor", weight_only_linear, _weight_only_linear_fake)
define("qfunctional(str op, Tensor x, Tensor x_scale, Tensor x_zero_point, str x_qdtype, Tensor? y, "
       "Tensor? y_scale, Tensor? y_zero_point, str y_qdtype, float c, Tensor out_scale, Tensor out_zero_point, "
       "str out_qdtype) -> Tensor", qfunctional, _qfunctional_fake)


def _pool_not_covered(q: torch.Tensor, kernel_size: list[int], stride: list[int]) -> ValueError:
    return ValueError(f"lowbit::max_pool2d_codes: kernel_size={kernel_size}, stride={stride} on a {q.dtype} "
                      f"tensor of shape {tuple(q.shape)} (channels-last 8-bit CPU codes, no padding) is not covered")


def _max_pool2d_codes(q: torch.Tensor, kernel_size: list[int], stride: list[int]) -> torch.Tensor:
    if len(kernel_size) == 2 == len(stride):  # the traced pool's own lists: its window and stride as eager pools them
        (kh, kw), (sh, sw) = kernel_size, stride
        if 1 <= min(kh, kw, sh, sw) and kh * kw <= 16:  # (max_pool2d_codes' terms; the pass checks the tensor's own)
            y = native.maxpool_codes(q, kh, kw, sh, sw)  # (its one pass, without max_pool2d_codes' argument parsing)
            if y is not None:
                return y
    if q.numel() == 0 and q.dim() == 4:  # an empty batch of a dynamic-batch program (eager pools it another way)
        return _max_pool2d_codes_fake(q, kernel_size, stride)
    y = max_pool2d_codes(q, kernel_size, stride)
    if y is None:  # (the caller traced only what max_pool2d_codes takes)
        raise _pool_not_covered(q, kernel_size, stride)
    return y.contiguous(memory_format=torch.channels_last)


def _max_pool2d_codes_fake(q: torch.Tensor, kernel_size: list[int], stride: list[int]) -> torch.Tensor:
    if (q.dim() != 4 or q.element_size() != 1 or len(kernel_size) != 2 or len(stride) != 2
            or min(*kernel_size, *stride) < 1):  # (what the real op refuses that the shape formula would misread)
        raise _pool_not_covered(q, kernel_size, stride)
    n, c, h, w = q.shape
    shape = (n, c, (h - kernel_size[0]) // stride[0] + 1, (w - kernel_size[1]) // stride[1] + 1)
    return torch.empty(shape, dtype=q.dtype, device=q.device, memory_format=torch.channels_last)


define("max_pool2d_codes(Tensor q, int[] kernel_size, int[] stride) -> Tensor", _max_pool2d_codes,
       _max_pool2d_codes_fake)


def _contiguous_codes_fake(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


define("contiguous_codes(Tensor q) -> Tensor", nchw_copy, _contiguous_codes_fake)


def _stub_grid(scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype) -> tuple[Any, ...]:
    """``stubs.grid_numbers`` of this grid, kept per scale tensor object as packed weights are (``weight_cache``) for
    the buffers' versions and the zero point's object (held weakly: the entry must not keep its own key alive)."""
    cache = weight_cache(scale)
    key = (tensor_version(scale), tensor_version(zero_point), qdtype)
    hit = cache.get("pt2.quantize")
    if hit is None or hit[0] != key or hit[1]() is not zero_point:
        if scale.numel() != 1 or zero_point.numel() != 1:
            raise ValueError(f"lowbit::quantize_codes: scale and zero_point must hold one value each, got shapes "
                             f"{tuple(scale.shape)} and {tuple(zero_point.shape)}")
        check_out_grid(float(scale), int(zero_point), qdtype, "lowbit::quantize_codes")  # (what Quantize's constructor checks)
        hit = cache["pt2.quantize"] = (key, weakref.ref(zero_point), grid_numbers(scale, zero_point, qdtype))
    return hit[2]


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str) -> torch.Tensor:
    qd = qdtype_from_key(qdtype)
    if x.dtype == torch.float32 and x.is_cpu:
        y = quantize_cpu(x, _stub_grid(scale, zero_point, qd), scale, zero_point, qd)
    else:  # (what a traced stub never sends: the module's general path)
        y = Quantize(float(scale), int(zero_point), qd)(x)
    return like(y.int_repr(), x)


def _quantize_codes_fake(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str) -> torch.Tensor:
    return torch.empty_like(x, dtype=qdtype_from_key(qdtype).storage)


define("quantize_codes(Tensor x, Tensor scale, Tensor zero_point, str qdtype) -> Tensor", quantize_codes,
       _quantize_codes_fake)
