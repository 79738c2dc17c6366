"""Exact bilinear resampling in QAT / prepared models, fast (session 41). ``qtensor.resample.bilinear_on_grid`` (eager
prepared / QAT models' shared grid, graph mode's ``grid_blend``, reference graphs' ``bilinear_per_tensor``) and
``bilinear_codes`` (a QTensor's bilinear ``F.interpolate``) ran ``bilinear_blend`` per call: both axes' indices and
weights rebuilt in Python, four gathers and the blend over the full output, int32 round trips: 48 ms against 8.7 ms
for the float op (8x16x32x32 -> 64x64, 1 thread). Eager calls now take a cached plan and a separable blend.

Oracle: session 40's code, kept verbatim below (``_old_*``): every value bit for bit (NaN, signed zeros, int32
codes included), the memory format, and the gradients.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: one thread)
from lowbit.qtensor import resample
from lowbit.qtensor.resample import bilinear_args, bilinear_codes, bilinear_on_grid


# ---- session 40's implementation (the oracle) ----------------------------------------------------------------------
def _old_f32(v: float, device: torch.device) -> torch.Tensor:
    return torch.full((), v, dtype=torch.float32, device=device)


def _old_axis(n: int, m: int, align_corners: bool, scale: float | None, device: torch.device,
              same: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if align_corners:  # (float32 divisions of the sizes, as torch's; 1 / scale in float64, then rounded)
        if same is None:
            r = _old_f32(n - 1, device) / _old_f32(m - 1, device) if m > 1 else _old_f32(0.0, device)
        else:  # (m > 1 as a tensor: no guard; the 0 / 0 of m = 1 is not selected)
            mt = _old_f32(m, device)
            r = torch.where(mt > 1, _old_f32(n - 1, device) / (mt - 1), _old_f32(0.0, device))
    else:
        r = (_old_f32(1.0 / scale, device) if scale is not None and scale > 0
             else _old_f32(n, device) / _old_f32(m, device))
        if same is not None and scale is not None:
            r = torch.where(same, _old_f32(1.0, device), r)
    d = torch.arange(m, dtype=torch.float32, device=device)
    t = d * r if align_corners else ((d + 0.5) * r - 0.5).clamp_min(0.0)
    i0 = t.to(torch.int64)
    i1 = i0 + (i0 < n - 1).to(torch.int64)
    l1 = t - i0.to(torch.float32)
    return i0, i1, 1.0 - l1, l1


def _old_blend(p: torch.Tensor, out_size: Sequence[int], align_corners: bool,
               scales: Sequence[float | None] = (None, None)) -> torch.Tensor:
    (h, w), (oh, ow) = p.shape[-2:], out_size
    same = None
    if any(isinstance(v, torch.SymInt) for v in (h, w, oh, ow)):  # (torch.export: dynamic spatial dims)
        same = (_old_f32(h, p.device) == _old_f32(oh, p.device)) & (_old_f32(w, p.device) == _old_f32(ow, p.device))
    elif (oh, ow) == (h, w):
        return p
    h0, h1, hl0, hl1 = _old_axis(h, oh, align_corners, scales[0], p.device, same)
    w0, w1, wl0, wl1 = _old_axis(w, ow, align_corners, scales[1], p.device, same)
    hl0, hl1 = hl0[:, None], hl1[:, None]
    top, bottom = p.index_select(-2, h0), p.index_select(-2, h1)
    a, b, c, d = (top.index_select(-1, w0), top.index_select(-1, w1), bottom.index_select(-1, w0),
                  bottom.index_select(-1, w1))
    return (a * wl0 + b * wl1) * hl0 + (c * wl0 + d * wl1) * hl1  # (each product and sum rounded: no FMA)


def _old_codes(q: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int,
               out_size: Sequence[int], align_corners: bool,
               scales: Sequence[float | None] = (None, None)) -> torch.Tensor:
    channels_last = q.is_contiguous(memory_format=torch.channels_last)
    if not any(isinstance(v, torch.SymInt) for v in (*q.shape[-2:], *out_size)) and tuple(out_size) == q.shape[-2:]:
        return q.clone(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    v = _old_blend(q.to(torch.float32), out_size, align_corners, scales)
    z = zero_point.to(torch.float32)
    # fbgemm's Quantize (torch's quantize_val): nearbyint(z + (v - z)), the difference rounded to float32 first
    out = ((v - z) + z).round_().clamp_(quant_min, quant_max).to(q.dtype)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def _old_on_grid(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                 quant_min: int, quant_max: int, axis: int | None, size: Any = None, scale_factor: Any = None,
                 align_corners: Any = None, recompute_scale_factor: Any = None) -> torch.Tensor:
    if axis is None:
        s, z = scale.detach().reshape(()), zero_point.detach().reshape(())
    else:
        shape = [-1 if i == axis else 1 for i in range(4)]
        s, z = scale.detach().reshape(shape), zero_point.detach().reshape(shape)
    with torch.no_grad():
        s32, z32 = s.to(torch.float32), z.to(torch.float32)
        q = (x.detach().to(torch.float32) / s32).round_().add_(z32).clamp_(quant_min, quant_max).to(torch.int32)
        out, scales = bilinear_args(x.shape, size, scale_factor, recompute_scale_factor)
        codes = _old_codes(q, z.to(torch.int32), quant_min, quant_max, out,
                           bool(align_corners) if align_corners is not None else False, scales)
        exact = ((codes.to(torch.float32) - z32) * s32).to(y.dtype)
    return y + (exact - y).detach()


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN payloads and signed zeros compare too)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert a.stride() == b.stride(), (a.stride(), b.stride())
    if a.is_floating_point():
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{diff} of {a.numel()} values differ in their bits"
    else:
        assert torch.equal(a, b)


GRIDS = {  # name: (qmin, qmax, per-tensor zero point)
    "quint8": (0, 255, 128), "quint8-odd-z": (0, 255, 37), "qint8-sym": (-128, 127, 0), "qint8-reduced": (-64, 63, 3),
    "16-bit": (-32768, 32767, 5), "qint32": (-(1 << 31), (1 << 31) - 1, 0),
}


def _case(rng: random.Random) -> tuple[tuple[int, ...], dict[str, Any]]:
    """A random ``(input shape, interpolate kwargs)``: up / down / mixed, odd sizes, size or scale factor (with or
    without recompute), ``align_corners`` both ways, batch 1."""
    n, c = rng.choice([1, 1, 2, 3]), rng.choice([1, 2, 3, 5])
    h, w = rng.randint(1, 13), rng.randint(1, 13)
    kw: dict[str, Any] = {"align_corners": rng.choice([None, False, True])}
    if rng.random() < 0.5:
        kw["size"] = (rng.randint(1, 27), rng.randint(1, 27)) if rng.random() < 0.8 else rng.randint(1, 27)
    else:
        pick = lambda: rng.choice([0.5, 0.75, 1.0, 1.3, 1.5, 2.0, 2.5, 3.0, 4.0, 7 / 3])  # noqa: E731
        kw["scale_factor"] = (pick(), pick()) if rng.random() < 0.7 else pick()
        kw["recompute_scale_factor"] = rng.choice([None, None, True])
        if min(int(h * (kw["scale_factor"][0] if isinstance(kw["scale_factor"], tuple) else kw["scale_factor"])),
               int(w * (kw["scale_factor"][1] if isinstance(kw["scale_factor"], tuple) else kw["scale_factor"]))) < 1:
            kw["scale_factor"] = 2.0
    return (n, c, h, w), kw


def _x_on_grid(shape: Sequence[int], s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int, g: torch.Generator,
               axis: int | None = None) -> torch.Tensor:
    span = min(qmax - qmin, 1 << 20)
    codes = torch.randint(0, span + 1, tuple(shape), generator=g).to(torch.float64) + max(qmin, -(1 << 19))
    if axis is not None:
        sh = [-1 if i == axis else 1 for i in range(4)]
        s, z = s.reshape(sh), z.reshape(sh)
    return ((codes - z.double()) * s.double()).float()


def _both(x: torch.Tensor, y: torch.Tensor, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return bilinear_on_grid(x, y, *args, **kw), _old_on_grid(x, y, *args, **kw)


# ---- 1. bit identity --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_on_grid_random_sweep_is_bit_identical(grid):
    """60 random cases per grid (up / down / odd sizes, size / scale factor / recompute, align_corners both,
    batch 1, contiguous and channels-last, y float32 or bfloat16): values, bits and strides as session 40's."""
    qmin, qmax, zp = GRIDS[grid]
    rng, g = random.Random(sorted(GRIDS).index(grid)), torch.Generator().manual_seed(7)
    s, z = torch.tensor(0.0173), torch.tensor(zp)
    for i in range(60):
        shape, kw = _case(rng)
        x = _x_on_grid(shape, s, z, qmin, qmax, g)
        if i % 3 == 1:
            x = x.contiguous(memory_format=torch.channels_last)
        y = F.interpolate(x, mode="bilinear", **kw)
        y = (y + 0.01 * torch.randn(y.shape, generator=g)).to(torch.bfloat16 if i % 7 == 3 else torch.float32)
        new, old = _both(x, y, s, z, qmin, qmax, None, **kw)
        _same(new, old)


@pytest.mark.parametrize("axis", [0, 1])
def test_on_grid_per_channel_grids(axis):
    """A per-channel grid (axis 0 or 1: each channel's scale and zero point), both layouts."""
    rng, g = random.Random(axis), torch.Generator().manual_seed(axis)
    for i in range(20):
        shape, kw = _case(rng)
        k = shape[axis]
        s = torch.rand(k, generator=g) * 0.05 + 0.001
        z = torch.randint(0, 256, (k,), generator=g)
        x = _x_on_grid(shape, s, z, 0, 255, g, axis)
        if i % 2:
            x = x.contiguous(memory_format=torch.channels_last)
        y = F.interpolate(x, mode="bilinear", **kw)
        _same(*_both(x, y, s, z, 0, 255, axis, **kw))


@pytest.mark.parametrize("shape, kw", [
    ((8, 16, 32, 32), {"size": (64, 64)}),
    ((1, 3, 7, 5), {"scale_factor": 2, "align_corners": True}),
    ((2, 3, 64, 48), {"size": (5, 7)}),                      # downsample: only some input rows are read
    ((2, 3, 9, 9), {"size": (9, 9)}),                        # torch's copy shortcut
    ((2, 3, 9, 9), {"scale_factor": 1.0001}),                # same size, scale factor: copied too
    ((2, 3, 1, 1), {"size": (3, 4)}),                        # 1x1 maps (channels-last contiguous too)
    ((1, 1, 5, 6), {"size": (1, 1)}),
    ((0, 3, 4, 4), {"size": (8, 8)}),                        # an empty batch
    ((2, 3, 2, 2), {"scale_factor": 3.0}),                   # sources past the last row (i0 = i1 = n - 1)
])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_on_grid_edge_shapes(shape, kw, layout):
    g = torch.Generator().manual_seed(1)
    s, z = torch.tensor(0.05), torch.tensor(131)
    x = _x_on_grid(shape, s, z, 0, 255, g)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = _x_on_grid((shape[0], shape[1], shape[2], 2 * shape[3]), s, z, 0, 255, g)[..., ::2]
    y = F.interpolate(x, mode="bilinear", **kw)
    _same(*_both(x, y, s, z, 0, 255, None, **kw))


def test_non_finite_inputs_keep_their_old_codes():
    """NaN / inf values of ``x`` (off any grid) take the same codes as before (NaN: int32's conversion of it)."""
    g = torch.Generator().manual_seed(3)
    s, z = torch.tensor(0.1), torch.tensor(100)
    x = _x_on_grid((2, 3, 6, 7), s, z, 0, 255, g)
    x[0, 0, 2, 3], x[1, 2, 0, 0], x[0, 1, 5, 6] = float("nan"), float("inf"), -float("inf")
    y = F.interpolate(x, size=(11, 13), mode="bilinear")
    _same(*_both(x, y, s, z, 0, 255, None, size=(11, 13)))


def test_codes_of_qtensors_are_bit_identical():
    """``bilinear_codes`` (the int8 model's QTensor path) on uint8 / int8 / int32 codes, both layouts, per-tensor and
    per-channel zero points; and through ``F.interpolate`` of a QTensor."""
    rng, g = random.Random(11), torch.Generator().manual_seed(11)
    for i in range(90):
        shape, kw = _case(rng)
        dtype, (qmin, qmax) = [(torch.uint8, (0, 255)), (torch.int8, (-128, 127)),
                               (torch.int32, (-(1 << 31), (1 << 31) - 1))][i % 3]
        q = torch.randint(max(qmin, -1000), min(qmax, 1000) + 1, shape, generator=g).to(dtype)
        if i % 2:
            q = q.contiguous(memory_format=torch.channels_last)
        z = torch.tensor(rng.randint(max(qmin, -50), min(qmax, 50)), dtype=torch.int32)
        if i % 5 == 4:
            z = torch.randint(0, 100, (shape[1],), generator=g, dtype=torch.int32).reshape(1, -1, 1, 1)
        out, scales = bilinear_args(shape, kw.get("size"), kw.get("scale_factor"), kw.get("recompute_scale_factor"))
        align = bool(kw["align_corners"])
        _same(bilinear_codes(q, z, qmin, qmax, out, align, scales), _old_codes(q, z, qmin, qmax, out, align, scales))
    x = Q.quantize_per_tensor(torch.rand(2, 3, 9, 7), 0.01, 3, Q.quint8)
    want = _old_codes(x.int_repr(), torch.tensor(3), 0, 255, [20, 15], False)
    _same(F.interpolate(x, size=(20, 15), mode="bilinear").int_repr(), want)


def test_meta_and_inference_mode():
    """A meta input (eager, as an exported QAT model on meta runs it) and a first call in inference mode (its cached
    plan is still usable by a later training step)."""
    resample._plan.cache_clear()
    s, z = torch.tensor(0.1), torch.tensor(3)
    xm = torch.empty(2, 3, 5, 7, device="meta")
    out = bilinear_on_grid(xm, torch.empty(2, 3, 10, 14, device="meta"), s, z, 0, 255, None, size=(10, 14))
    assert out.shape == (2, 3, 10, 14) and out.device.type == "meta"
    g = torch.Generator().manual_seed(4)
    x = _x_on_grid((2, 3, 5, 7), s, z, 0, 255, g)
    with torch.inference_mode():
        bilinear_on_grid(x, F.interpolate(x, size=(9, 9), mode="bilinear"), s, z, 0, 255, None, size=(9, 9))
    x.requires_grad_()
    y = F.interpolate(x, size=(9, 9), mode="bilinear")
    new = bilinear_on_grid(x, y, s, z, 0, 255, None, size=(9, 9))
    new.sum().backward()
    _same(new.detach(), _old_on_grid(x, y, s, z, 0, 255, None, size=(9, 9)).detach())


# ---- 2. gradients -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lsq", [False, True])
def test_gradients_equal_the_old_ones(lsq):
    """The gradient is ``y``'s (the fake-quantized float op's), as before: ``x``'s and an LSQ fake-quant's scale /
    zero point gradients are bit-identical to session 40's."""
    torch.manual_seed(5)
    qc = Q.get_lsq_qat_qconfig() if lsq else Q.get_default_qat_qconfig()
    grads = []
    for fn in (bilinear_on_grid, _old_on_grid):
        torch.manual_seed(5)
        fq = qc.activation()
        x0 = torch.randn(3, 4, 7, 9).relu()
        fq(x0)
        if lsq:
            fq.enable_param_learning()
        x = fq(x0).detach().requires_grad_()
        y = fq(F.interpolate(x, scale_factor=(1.5, 2.5), mode="bilinear", align_corners=False))
        s, z = fq.scale, fq.zero_point
        if lsq:  # (as shared_grids reads an LSQ grid)
            s, z = s.clamp(min=fq.eps), z.round().clamp(fq.quant_min, fq.quant_max)
        out = fn(x, y, s, z, fq.quant_min, fq.quant_max, None, scale_factor=(1.5, 2.5))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        (out * w).sum().backward()
        grads.append([out.detach(), x.grad] + ([fq.scale.grad, fq.zero_point.grad] if lsq else []))
    assert grads[0][1] is not None and (not lsq or grads[0][2] is not None)
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            _same(a, b)


# ---- 3. what makes it fast ----------------------------------------------------------------------------------------------
class _Count(TorchDispatchMode):
    """aten calls, and the elements they write, on tensors at least ``big`` elements large."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big, self.calls, self.written = big, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.big and func._opname not in ("view", "slice",
                                                                                              "expand", "detach"):
            self.calls, self.written = self.calls + 1, self.written + out.numel()
        return out


def test_eager_calls_reuse_a_cached_plan_and_skip_the_traced_blend(monkeypatch):
    """An eager call builds the axes' indices and weights once per (sizes, align_corners, scales, device) and does
    not run ``bilinear_blend`` (the ops ``torch.compile`` / ONNX export record); before, every call rebuilt both axes
    in Python (``_axis``) and ran it."""
    s, z = torch.tensor(0.1), torch.tensor(3)
    x = _x_on_grid((2, 3, 10, 12), s, z, 0, 255, torch.Generator().manual_seed(8))
    y = F.interpolate(x, size=(17, 19), mode="bilinear")
    want = _old_on_grid(x, y, s, z, 0, 255, None, size=(17, 19))
    bilinear_on_grid(x, y, s, z, 0, 255, None, size=(17, 19))

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("rebuilt per call")
    monkeypatch.setattr(resample, "_axis", refuse)
    monkeypatch.setattr(resample, "bilinear_blend", refuse)
    _same(bilinear_on_grid(x, y, s, z, 0, 255, None, size=(17, 19)), want)


def test_fewer_passes_over_the_output():
    """8x16x32x32 -> 64x64: aten calls writing tensors of at least half the output's size, and the elements they
    write (session 40: 25 calls, 12.6 M elements, 24 output sizes; now 14 calls, 8.1 M, 15.5 output sizes)."""
    s, z = torch.tensor(0.1), torch.tensor(3)
    x = _x_on_grid((8, 16, 32, 32), s, z, 0, 255, torch.Generator().manual_seed(9))
    y = F.interpolate(x, size=(64, 64), mode="bilinear")
    bilinear_on_grid(x, y, s, z, 0, 255, None, size=(64, 64))
    counts = []
    for fn in (bilinear_on_grid, _old_on_grid):
        with _Count(y.numel() // 2) as c:
            fn(x, y, s, z, 0, 255, None, size=(64, 64))
        counts.append((c.calls, c.written))
    (calls, written), (old_calls, old_written) = counts
    assert (old_calls, old_written) == (25, 12_582_912)
    assert calls <= 14 and written <= 8_200_000, (calls, written)
