"""Conv weight packs made for their input, and the exact 8-bit convs of CPUs without VNNI (``onednn.conv``'s helpers).

``packed_for_input``: a conv weight packed by ``onednn::qconv_prepack`` for the input shape and zero point it meets
(kept per shape), shared by ``conv_plan``, the generic ``onednn.conv`` and the split below. ``_wsplit_conv``: an exact
8-bit conv without VNNI, the weights split into 7-bit halves so ``vpmaddubsw`` cannot saturate on u8 codes (one
oneDNN call on the unmodified codes, float32 raw sums, ``avx2._acc_epilogue`` or the native epilogue).
``gemm_conv``: a 2-d conv of one group as the Linear it is over its output pixels (the patches made tile by tile inside
the native call, ``LinearPlan.run_conv``; ``native.im2col`` first where that declines), ``lowbit.native``'s any-code
many-row kernel at half the split's multiply-adds (the same sums and epilogue).

>>> import torch
>>> from lowbit.kernels.conv_split import packed_for_input
>>> packed_for_input({}, torch.zeros(1, 2, 3, 3), 0, lambda z, shape: shape)
[1, 2, 3, 3]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import native
from ..qtensor import QTensor
from .avx2 import (_acc_epilogue, _inv_scale, _relu_floor, _scaled, combine_stacked, stack_halves,
                   weight_halves)
from .small_m import _linear_plan, _per_weight, out_codes
from .spec import ConvSpec, OutGrid

__all__ = ["GEMM_MIN_COUT", "SHAPED_PACKS", "gemm_conv", "packed_for_input"]


def _pack_wsplit(w: torch.Tensor, geometry: tuple[list[int], list[int], list[int]], groups: int) -> Any:
    """oneDNN packs of ``avx2.weight_halves(w)`` with unit scales (raw sums come out as float32) and the unit scales
    and zero points they are called with; ``None`` where the halves' float32 sums could be inexact. Depthwise
    (one input and one output channel a group): the two halves packed apart, as oneDNN's depthwise kernels take
    no channel multiplier (stacked, a 96-channel 3×3 ran ~100x slower); otherwise one ``stack_halves`` pack."""
    halves = weight_halves(w)
    if halves is None:
        return None
    hi, lo = halves
    dw = groups > 1 and w.shape[0] == groups and w.shape[1] == 1
    ws = (hi, lo) if dw else (stack_halves(hi, lo, groups),)
    n = ws[0].shape[0]
    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    shaped: dict[tuple[Any, bool], Any] = {}  # (input shape, z_x != 0) -> the packs for that input (_wsplit_packs)
    # (on a new thread, as packed_for_input's: packed after a same-geometry z_x != 0 pack in the calling thread, ideep's
    # cache gave these the other layout, and a 3-d conv's every call reordered its weight: tests/test_pt2lane_s48.py)
    packs = in_fresh_thread(lambda z, shape: tuple(torch.ops.onednn.qconv_prepack(t, ones, 1.0, z, *geometry, groups,
                                                                                  shape) for t in ws), 0, None)
    return packs, ones, zeros, ws, shaped


SHAPED_PACKS = 8  # input shapes (with a zero / non-zero input zero point) a conv layer keeps weight packs for


def packed_for_input(store: dict[tuple[Any, bool], Any], q: torch.Tensor, zx: int,
                     make: Callable[[int, list[int] | None], Any]) -> Any:
    """``store[(q.shape, z_x != 0)]``, made by ``make(z_x, shape)`` on a miss (``shape``: ``q``'s as a list for a 2-d
    conv's 4-d input, else ``None``), keeping the ``SHAPED_PACKS`` newest. A conv weight packed by ``qconv_prepack``
    for the input it meets: packed without its shape and zero point, oneDNN's layout for the real input can differ and
    every call reorders the weight (``conv_plan``'s docstring); the layout does not change the sums. Shared by
    ``conv_plan``, the generic ``conv`` and the weight-split convs (``_wsplit_packs``). ``make`` runs on a new thread
    (``in_fresh_thread``: a thread's ideep cache can hand out the other zero point's layout).

    >>> store = {}
    >>> packed_for_input(store, torch.zeros(2, 3, 4, 4), 5, lambda z, shape: (z, shape))
    (5, [2, 3, 4, 4])
    >>> packed_for_input(store, torch.zeros(2, 3, 4, 4), 7, lambda z, shape: "not made: same shape, z_x != 0 again")
    (5, [2, 3, 4, 4])
    """
    key = (q.shape, zx != 0)
    packed = store.get(key)
    if packed is None:
        if len(store) >= SHAPED_PACKS:
            store.pop(next(iter(store)))
        packed = store[key] = in_fresh_thread(make, zx, list(q.shape) if q.dim() == 4 else None)
    return packed


def in_fresh_thread(make: Callable[[int, list[int] | None], Any], zx: int, shape: list[int] | None) -> Any:
    """``make(zx, shape)`` run on a new thread (with the caller's ``torch.get_num_threads()``), its error re-raised.

    ``qconv_prepack`` asks ideep for the weight layout through a per-thread cache of primitive descriptors whose key
    leaves out the input zero point, so in a thread that packed the same geometry and input shape with the other kind
    of ``z_x`` (zero / non-zero) it gets that pack's layout: a weight with zero-point compensation (``f8:zpm1``) for a
    ``z_x = 0`` input or one without for ``z_x != 0``, and oneDNN reorders it on every call (``ONEDNN_VERBOSE``;
    MobileNetV2's three 960-channel depthwise convs, the first fed ``z_x = 0``, the other two ``z_x != 0``). A new
    thread starts with an empty cache (~80 µs, once per layer, input shape and kind of ``z_x``); the layout does not
    change the sums.

    >>> in_fresh_thread(lambda z, shape: (z, shape, threading.current_thread() is threading.main_thread()), 3, None)
    (3, None, False)
    """
    n, box = torch.get_num_threads(), []

    def work() -> None:
        try:
            if torch.get_num_threads() != n:  # (the layout query, like the call, sees the caller's thread count)
                torch.set_num_threads(n)
            box.append((True, make(zx, shape)))
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            box.append((False, e))
    t = threading.Thread(target=work, name="lowbit-qconv-prepack", daemon=True)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _wsplit_packs(entry: Any, q: torch.Tensor, zx: int, groups: int,
                  geometry: tuple[list[int], list[int], list[int]]) -> Any:
    """The halves packed for this input (``qconv_prepack`` given its shape and whether ``z_x`` is non-zero): packed
    without them, oneDNN's layout for the real input can differ, and every call then reorders the weights
    (``ONEDNN_VERBOSE``: two reorders per call, to the plain layout and back with the zero-point compensation, for a
    1x1 conv reading a non-zero zero point); the layout does not change the sums."""
    return packed_for_input(entry[4], q, zx, lambda z, shape: tuple(
        torch.ops.onednn.qconv_prepack(t, entry[1], 1.0, z, *geometry, groups, shape) for t in entry[3]))


def _wsplit_conv(entry: Any, q: torch.Tensor, sx: float, zx: int, weight: QTensor, bias: torch.Tensor | None,
                 groups: int, geometry: tuple[list[int], list[int], list[int]], out: OutGrid | None, relu: bool,
                 cache: dict[str, Any] | None) -> QTensor | torch.Tensor:
    """Exact 8-bit conv without VNNI, the weights split: oneDNN on the unmodified u8 codes.

    ``acc = Σ (q - z) q_w = 2 Σ (q - z) (q_w >> 1) + Σ (q - z) (q_w & 1)``: the halves (``avx2.weight_halves``,
    packed once by ``_pack_wsplit``) never saturate ``vpmaddubsw`` with u8 codes; oneDNN returns both sums as
    float32 (unit scales: exact integers, checked at pack time) from one call on ``2 C_out`` channels (depthwise:
    two calls), and ``fl(lo + 2·hi) = fl(acc)`` goes through ``avx2._acc_epilogue`` (``· fl(s_x s_w) + bias``, ReLU,
    requantization). Against the activation split (``_split_run``): no staging of code halves (shift, mask,
    copies out of channels-last), no doubled batch; the same multiply-adds.
    """
    _, ones, zeros = entry[:3]
    # (a 3-d conv's z_x != 0 too: packed for z_x = 0, its every call reordered the weights, 1 reorder a call)
    packs = _wsplit_packs(entry, q, zx, groups, geometry) if q.dim() == 4 or zx != 0 else entry[0]
    stride, padding, dilation = geometry
    ys = [torch.ops.onednn.qconv_pointwise(q, 1.0, zx, p, ones, zeros, None, stride, padding, dilation, groups, 1.0, 0,
                                           torch.float32, "none", [], "") for p in packs]
    if out is not None and out.qdtype.storage == torch.uint8:  # the whole epilogue in one native pass (same codes)
        codes = native.conv_epilogue(ys, groups, _scaled(weight.scale, sx, cache), bias, _inv_scale(out.scale),
                                     out.zero_point, _relu_floor(out.qdtype.quant_min, out.zero_point, relu),
                                     out.qdtype.quant_max)
        if codes is not None:
            return out.wrap(codes)
    acc = ys[1].add_(ys[0], alpha=2) if len(ys) == 2 else combine_stacked(ys[0], groups, out is not None)  # (2·hi exact)
    return _acc_epilogue(acc, weight.scale, sx, bias, out, relu, cache)


# output channels from which gemm_conv runs: below, the codes' per-call sign pass (O(M·K)) and a part-empty block of
# 16 columns weigh more than the halved multiply-adds. Session 25 set 32 (MobileNetV2's 144 -> 24 1x1 at 56², batch 8:
# 0.89x the split; 24 -> 144: 1.55x). Session 27's cheaper sign codes (made per row tile, vector tails) moved it to 16
# (1 / 2 threads, Zen 3, against the split, 1x1 at 56² batch 8: 96 -> 16 1.16 / 1.39x, 144 -> 24 1.19 / 1.21x, 96 -> 12
# 0.99 / 1.06x, 96 -> 8 0.77 / 0.95x, 96 -> 4 0.83 / 0.84x; in MobileNetV2 b8 its three projections to 16 and 24
# channels 1.14-1.22x). k x k convs through the patches: 1.13-1.56x the split on a non-zero input zero point; where
# z_x = 0 (a ReLU's output: oneDNN's call then skips its zero-point compensation) 0.93-1.10x until session 27, so
# those kept the split; with session 28's codes epilogue (32 codes a step) SmallCNN's 16 -> 32 and 32 -> 32 3x3 at
# 14², batch 64, ran 1.11-1.23x / 1.20-1.29x the split (1 / 2 threads, Zen 3, interleaved), so every zero point
# takes the patches now.
GEMM_MIN_COUT = 16


def gemm_conv(q: torch.Tensor, sx: float, zx: int, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec,
              out: OutGrid | None, relu: bool, cache: dict[str, Any] | None) -> QTensor | torch.Tensor | None:
    """``_wsplit_conv``'s result, the same codes or floats, for a 2-d conv of one group on a CPU without VNNI, as the
    Linear it is over its output pixels: ``(N·OH·OW, KH·KW·C_in) · (C_out, KH·KW·C_in)ᵀ`` on the patches (made tile
    by tile inside the call, ``LinearPlan.run_conv``, else by
    ``native.im2col`` first; a 1x1 conv with stride 1 and no padding reads the channels-last codes as they are), the
    weights reordered tap by tap once per weight version. The codes go to a
    ``native.qlinear`` plan
    (``small_m._linear_plan``: the any-code many-row kernel, exact int32 sums ``Σ (q - z_x) q_w``, padding taps at
    ``z_x`` adding 0, then ``fl(fl(acc) · fl(s_x s_w)) + b``, ReLU and lowbit's requantization: ``_acc_epilogue``'s
    operations) instead of oneDNN's call on the weights' two 7-bit halves (twice the multiply-adds). ``None``: not
    taken (another geometry, no native build, or weights the split does not take: ``avx2.weight_halves`` declines
    them where float32 half sums would round; ``onednn.conv``'s activation split then runs, as before).

    >>> import torch, lowbit as Q
    >>> zeros = torch.zeros(2, dtype=torch.long)
    >>> w = Q.quantize_per_channel(torch.ones(2, 3, 1, 1), torch.tensor([0.01, 0.02]), zeros, 0, Q.qint8)
    >>> q = torch.full((1, 3, 2, 2), 200, dtype=torch.uint8)
    >>> y = gemm_conv(q, 0.1, 128, w, None, ConvSpec(2, (1, 1), (0, 0), (1, 1), 1), None, False, {})
    >>> y is None or [round(v, 4) for v in y[0, :, 0, 0].tolist()] == [21.6, 21.6]   # 3 · 72 · 100 · 0.01 · 0.1
    True
    """
    if (spec.dim != 2 or spec.transposed or spec.groups != 1 or q.dim() != 4 or not native.available()
            or weight.shape[0] < GEMM_MIN_COUT or (out is not None and out.qdtype.storage != torch.uint8)):
        return None
    kh, kw = weight.shape[2], weight.shape[3]
    stride, padding, dilation = list(spec.stride), list(spec.padding), list(spec.dilation)
    pixels = (kh, kw) == (1, 1) and stride == [1, 1] and padding == [0, 0]
    if not _per_weight(cache, "native.conv_halves", weight.int_repr(), lambda t: weight_halves(t) is not None):
        return None  # (no weight split here: the activation split's floats, which rounds its half sums, stay)
    w = _per_weight(cache, "native.conv_rows", weight.int_repr(),  # (C_out, KH·KW·C_in), tap by tap
                    lambda t: t.permute(0, 2, 3, 1).reshape(t.shape[0], -1).contiguous())
    if not q.is_contiguous(memory_format=torch.channels_last):
        q = native.to_channels_last(q)
        if q is None:
            return None
    n, c, h, wd = q.shape
    oh, ow = (h, wd) if pixels else native.conv_out_hw(h, wd, (kh, kw), stride, padding, dilation)
    if oh < 1 or ow < 1:
        return None
    o = out_codes(out, relu)
    plan = _linear_plan(w, _scaled(weight.scale, sx, cache), bias, o, relu, True, cache)
    if plan is None:
        return None
    y = torch.empty((n, oh, ow, plan.n), dtype=torch.float32 if out is None else torch.uint8)
    if pixels:  # (a view: the channels-last pixels are the rows)
        done = plan.run(q.permute(0, 2, 3, 1).reshape(-1, c), zx, y.view(-1, plan.n))
    else:  # the patches made tile by tile inside the native call, else in memory first (the same rows)
        done = plan.run_conv(q, zx, (kh, kw), stride, padding, dilation, y.view(-1, plan.n))
        if not done:
            rows = native.im2col(q, zx, (kh, kw), stride, padding, dilation)
            done = rows is not None and plan.run(rows, zx, y.view(-1, plan.n))
    if not done:
        return None
    y = y.permute(0, 3, 1, 2)  # (N, C_out, OH, OW) in channels-last memory, as oneDNN's output
    return y if out is None else out.wrap(y)
