"""The static conv's eager plan (``lowbit.kernels.conv_plan``) gives the generic path's codes, bit for bit.

A quantized ``Conv2d`` / ``ConvReLU2d`` module (which runs its plan where one is made) is compared with the generic
dispatcher (``onednn.conv`` on the same weight, input and output grid) over geometries (strides, padding, dilation,
groups, depthwise), input grids (u8, 7-bit u8, s8: declined), output grids (u8, 7-bit u8), weights (full int8:
declined without VNNI, the split; 7-bit: one call either way), ReLU, bias, batch sizes and memory formats, with the
CPU's VNNI forced on and off (``helpers.force``), so an AVX2-only and a VNNI machine both run every case.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import lowbit as Q
from helpers import force
from lowbit import kernels as K
from lowbit.kernels import ConvSpec, OutGrid, conv_small, onednn
from lowbit.kernels.conv_plan import conv_plan
from lowbit.nn.quantized import Conv2d, ConvReLU2d

torch.set_num_threads(1)

GEOMETRIES = [  # (c_in, c_out, kernel, stride, padding, dilation, groups)
    (3, 8, 3, 1, 1, 1, 1), (8, 16, 3, 2, 1, 1, 1), (16, 16, 3, 1, 1, 1, 16), (8, 8, 1, 1, 0, 1, 1),
    (8, 12, 3, 1, 2, 2, 2), (16, 16, 5, 2, 2, 1, 16)]
X_GRIDS = [(Q.quint8, 131), (Q.quint8.with_range(0, 127), 60), (Q.qint8, -7)]
OUT_GRIDS = [(0.05, 100, Q.quint8), (0.05, 3, Q.quint8.with_range(0, 127))]


def _layer(geo: tuple[int, ...], full: bool, relu: bool, bias: bool, out: tuple[float, int, Q.QDtype],
           seed: int) -> Conv2d:
    c_in, c_out, k, stride, pad, dil, groups = geo
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if full else (-64, 63)
    codes = torch.randint(lo, hi + 1, (c_out, c_in // groups, k, k), generator=g, dtype=torch.int8)
    if full:
        codes.view(c_out, -1)[:, :2] = 127  # saturates vpmaddubsw with 8-bit activations: the split without VNNI
    w = Q.QTensor(codes, torch.rand(c_out, generator=g) / 50 + 1e-3, torch.zeros(c_out, dtype=torch.long), Q.qint8, 0)
    mod = (ConvReLU2d if relu else Conv2d)(c_in, c_out, k, stride, pad, dil, groups, bias=bias)
    mod.set_weight_bias(w, torch.randn(c_out, generator=g) if bias else None)
    mod.set_output_grid(*out)
    return mod


def _input(c_in: int, batch: int, grid: tuple[Q.QDtype, int], channels_last: bool, seed: int) -> Q.QTensor:
    qd, zp = grid
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(qd.quant_min, qd.quant_max + 1, (batch, c_in, 9, 11), generator=g).to(qd.storage)
    if channels_last:
        codes = codes.contiguous(memory_format=torch.channels_last)
    return Q.QTensor(codes, torch.tensor(0.02), torch.tensor(zp), qd)


@pytest.mark.parametrize("vnni", [True, False])
def test_conv_plan_gives_the_generic_codes(monkeypatch: pytest.MonkeyPatch, vnni: bool) -> None:
    force(monkeypatch, vnni=vnni, fbgemm=False)
    planned = generic = 0
    cases = itertools.product(GEOMETRIES, [True, False], [False, True], X_GRIDS, OUT_GRIDS)
    for i, (geo, full, relu, xg, og) in enumerate(cases):
        mod = _layer(geo, full, relu, bias=i % 3 != 0, out=og, seed=i)
        x = _input(geo[0], 1 + i % 3, xg, channels_last=i % 2 == 0, seed=100 + i)
        before = K.counts[("onednn", "conv")]
        with torch.inference_mode(i % 4 == 0):
            y = mod(x)
        assert K.counts[("onednn", "conv")] == before + 1  # one oneDNN conv, planned or not: no fallback
        weight, out = mod._prepared()
        want = onednn.conv(x, weight, mod.bias, mod._spec, out, relu, {})
        assert torch.equal(y.int_repr(), want.int_repr()), (geo, full, relu, xg, og)
        assert (float(y.scale), int(y.zero_point), y.qdtype) == (float(out.scale_t), og[1], og[2])
        # a small window takes the native pass on any CPU (exact: no split), planned too (kernels.conv_small)
        split = not (vnni or onednn.saturation_safe(weight.int_repr())) and xg[0].quant_max > 127
        small = conv_small.takes(weight, mod._spec, out, split)
        expect_plan = xg[0].storage == torch.uint8 and (vnni or not full or small)
        made = mod._cache["plan"][2]
        assert (made is not None) == expect_plan, (geo, full, xg, vnni)
        planned += made is not None
        generic += made is None
    assert planned and generic


def test_conv_plan_packs_per_input_and_takes_nchw_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One planned layer meets batch sizes, NCHW and channels-last codes, zero and non-zero input zero points: the
    weight is packed once per (input shape, zero point zero or not) and the codes stay the generic path's; NCHW codes
    go to channels-last memory through ``lowbit.native`` where it is built (oneDNN's own copy is ~3x slower)."""
    from lowbit import native

    force(monkeypatch, vnni=True, fbgemm=False)
    mod = _layer((8, 8, 3, 2, 1, 1, 1), False, True, bias=True, out=OUT_GRIDS[0], seed=7)  # (past conv_small's window)
    packs = []
    real = torch.ops.onednn.qconv_prepack

    recording = [False]

    def prepack(*a: object) -> object:
        if recording[0]:  # the plan's packs (not the reference's, made by the generic path on a fresh cache)
            packs.append((a[3], tuple(a[8])))  # type: ignore[arg-type]
        return real(*a)

    monkeypatch.setattr(torch.ops.onednn, "qconv_prepack", prepack)
    native.counts.clear()
    for batch, zp, last in [(2, 0, False), (2, 0, False), (2, 9, False), (5, 9, True), (5, 9, True), (2, 0, True)]:
        x = Q.QTensor(_input(8, batch, (Q.quint8, zp), last, seed=batch + zp).int_repr(), torch.tensor(0.02),
                      torch.tensor(zp), Q.quint8)
        recording[0] = True
        y = mod(x)
        recording[0] = False
        weight, out = mod._prepared()
        assert mod._cache["plan"][2] is not None
        assert torch.equal(y.int_repr(), onednn.conv(x, weight, mod.bias, mod._spec, out, True, {}).int_repr())
    assert packs == [(0, (2, 8, 9, 11)), (9, (2, 8, 9, 11)), (9, (5, 8, 9, 11))], packs
    assert native.counts.get("to_nhwc", 0) == (3 if native.available() else 0)


def test_narrow_output_grid_clamped_by_the_post_op_gives_the_clamped_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7-bit (or narrower) output grid is clamped by oneDNN's hardtanh post-op in the plan and by a clamp after the
    call in the generic path: the same codes over random scales and zero points (inside and at the grid's ends, with
    and without ReLU), outputs pushed past both ends."""
    force(monkeypatch, vnni=True, fbgemm=False)
    g = torch.Generator().manual_seed(11)
    for i in range(24):
        qd = Q.quint8.with_range(0, 127) if i % 3 else Q.quint8.with_range(10, 100)
        z = int(torch.randint(qd.quant_min, qd.quant_max + 1, (), generator=g))
        scale = float(torch.rand((), generator=g)) * 0.05 + 0.002
        mod = _layer((6, 5, 3, 1, 1, 1, 1), False, i % 2 == 0, bias=True, out=(scale, z, qd), seed=200 + i)
        x = _input(6, 2, (Q.quint8, 17 * (i % 4)), i % 2 == 1, seed=300 + i)
        y = mod(x)
        assert mod._cache["plan"][2] is not None
        weight, out = mod._prepared()
        want = onednn.conv(x, weight, mod.bias, mod._spec, out, i % 2 == 0, {})
        assert torch.equal(y.int_repr(), want.int_repr()), (i, scale, z, qd)
        assert int(y.int_repr().min()) >= qd.quant_min and int(y.int_repr().max()) <= qd.quant_max


def test_conv_plan_follows_weight_and_grid_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed weight (in place), bias or input grid reaches the planned call, as on the generic path."""
    force(monkeypatch, vnni=True, fbgemm=False)
    mod = _layer(GEOMETRIES[1], False, True, True, OUT_GRIDS[0], seed=7)
    x = _input(8, 2, X_GRIDS[0], True, seed=8)
    y0 = mod(x).int_repr()
    mod.weight_int8.neg_()  # in place: a new version of the same buffer
    weight, out = mod._prepared()
    y1 = mod(x).int_repr()
    assert not torch.equal(y0, y1) and torch.equal(y1, onednn.conv(x, weight, mod.bias, mod._spec, out, True, {}).int_repr())
    x.scale.mul_(1.5)  # the input grid's scale tensor changed in place
    assert torch.equal(mod(x).int_repr(), onednn.conv(x, weight, mod.bias, mod._spec, out, True, {}).int_repr())


def test_conv_plan_declines_what_the_generic_path_must_run() -> None:
    w = Q.quantize_per_channel(torch.randn(4, 2, 3, 3), torch.full((4,), 0.02), torch.zeros(4, dtype=torch.long), 0,
                               Q.qint8)
    spec2 = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    out = OutGrid(0.05, 10, Q.quint8)
    assert conv_plan(w, None, None, False, Q.quint8, spec2) is None  # float output
    assert conv_plan(w, None, out, False, Q.qint8, spec2) is None  # s8 input codes (shifted on the generic path)
    assert conv_plan(w, None, OutGrid(0.05, 0, Q.qint8), False, Q.quint8, spec2) is None  # s8 output
    assert conv_plan(w, None, out, False, Q.quint8, ConvSpec(2, (1, 1), (0, 0), (1, 1), 1, True, (0, 0))) is None
    w3 = Q.quantize_per_channel(torch.randn(4, 2, 3), torch.full((4,), 0.02), torch.zeros(4, dtype=torch.long), 0, Q.qint8)
    assert conv_plan(w3, None, out, False, Q.quint8, ConvSpec(1, (1,), (1,), (1,), 1)) is None  # 1-d: generic
