"""Session 50 (dyncomp50): the compiled ``lowbit::dynamic_linear``'s fast entry (``pt2.module_ops._dyn_fast``: a
layer's later oneDNN-route calls skip the weight / grid / input checks and plan lookups) and the row grid's
AVX-512BW code store (``rowquant.c`` ``codes64_avx512bw``). Outputs bit-identical to the eager module throughout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels, native
from lowbit.kernels import onednn
from lowbit.nn.quantized.dynamic import Linear
from lowbit.pt2 import module_ops as MO
from lowbit.pt2.kernel_ops import weight_cache

KEY = "qint8:-128:127"
VNNI = onednn.has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the oneDNN route of the dynamic Linear needs VNNI")


def _layer(k: int, n: int, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear.from_float(nn.Linear(k, n, bias=bias))


def _op(m: Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.lowbit.dynamic_linear(x, m.weight_int8, m.weight_scale, m.weight_zero_point, KEY, m.bias)


class _Taken:
    """Counts the fast entry's served calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n, fast = 0, MO._dyn_fast

        def counted(*a: object) -> object:
            y = fast(*a)
            self.n += y is not None
            return y
        monkeypatch.setattr(MO, "_dyn_fast", counted)


@pytest.mark.parametrize("m,k,n,bias", [(200, 384, 384, True), (129, 100, 33, False), (300, 67, 1536, True),
                                        (1, 384, 384, True), (5, 63, 17, True), (512, 1536, 384, False)])
def test_op_calls_equal_the_eager_layer_bit_for_bit(m: int, k: int, n: int, bias: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call of the op (the first, full body; the later ones, the fast entry where the route is oneDNN's) gives
    the eager layer's floats. Pin (already right on main): the entry must not change them."""
    taken = _Taken(monkeypatch)
    layer = _layer(k, n, bias)
    with torch.inference_mode():
        for i in range(3):
            x = torch.randn(m, k) * (i + 1)
            assert torch.equal(_op(layer, x), layer(x))
    big = m > 1 and not (m <= 128 and m * n <= 262144 and native.vnni())
    assert taken.n == (2 if VNNI and big else 0)


@needs_vnni
def test_fast_entry_is_armed_and_serves_later_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on main (no entry): after one oneDNN-route call the layer's entry is kept and serves the next calls."""
    taken = _Taken(monkeypatch)
    layer = _layer(384, 384)
    x = torch.randn(256, 384)
    with torch.inference_mode():
        _op(layer, x)
        assert ("pt2.dyn_fast", KEY) in weight_cache(layer.weight_int8)
        y = _op(layer, x)
    assert taken.n == 1 and torch.equal(y, layer(x))


@needs_vnni
@pytest.mark.parametrize("change", ["scale_in_place", "bias_in_place", "weight_in_place", "other_bias",
                                    "scale_data_swap", "bias_none"])
def test_fast_entry_steps_aside_after_a_change(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid, bias or weight written in place, another bias object, a ``.data`` swap: the op gives the changed
    layer's eager floats (the entry declines, the full body runs). Pins of the full body's behaviour."""
    layer = _layer(96, 40)
    x = torch.randn(300, 96)
    w, s, z, b = layer.weight_int8, layer.weight_scale, layer.weight_zero_point, layer.bias
    with torch.no_grad():
        torch.ops.lowbit.dynamic_linear(x, w, s, z, KEY, b), torch.ops.lowbit.dynamic_linear(x, w, s, z, KEY, b)
        if change == "scale_in_place":
            s.mul_(1.5)
        elif change == "bias_in_place":
            b.add_(1.0)
        elif change == "weight_in_place":
            w.copy_(torch.flip(w, [1]))
        elif change == "other_bias":
            b = b + 2.0
        elif change == "scale_data_swap":
            s.data = s.data * 0.5
        else:
            b = None
        y = torch.ops.lowbit.dynamic_linear(x, w, s, z, KEY, b)
        ref = Linear.from_float(nn.Linear(96, 40, bias=b is not None))
        ref.weight_int8, ref.weight_scale, ref.weight_zero_point = w.clone(), s.clone(), z.clone()
        if b is not None:
            ref.bias = b.clone()
        assert torch.equal(y, ref(x))


@needs_vnni
def test_fast_entry_declines_a_pinned_backend_a_non_finite_row_and_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned backend runs its kernels, a NaN row the generic path's floats, a grad input the full body: what the
    eager layer does. Pin."""
    taken = _Taken(monkeypatch)
    layer = _layer(64, 48)
    x = torch.randn(200, 64)
    with torch.no_grad():
        _op(layer, x), _op(layer, x)
        assert taken.n == 1
        with kernels.use_backend("reference"):
            before = kernels.counts[("reference", "linear")]
            assert torch.equal(_op(layer, x), layer(x))
            assert kernels.counts[("reference", "linear")] > before
        xn = x.clone()
        xn[3, 5] = float("nan")
        torch.testing.assert_close(_op(layer, xn), layer(xn), rtol=0, atol=0, equal_nan=True)
    assert taken.n == 1
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)  # an AVX2-only CPU's answer: the no-VNNI routes
    with torch.no_grad():
        _op(layer, x)
    assert taken.n == 1


def test_compiled_dynamic_model_fullgraph_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_dynamic models on a 3-d input compiled with fullgraph (no graph break): two Linears (the second without
    bias) give the eager floats on every call, the fast entry serving the later ones; with a GELU between them the
    program runs too (inductor's GELU rounds differently from eager's, so only the first Linear is compared). Pin."""
    taken = _Taken(monkeypatch)
    torch.manual_seed(1)
    x = torch.randn(3, 70, 100)
    for gelu in (False, True):
        mods = [nn.Linear(100, 150)] + ([nn.GELU()] if gelu else []) + [nn.Linear(150, 70, bias=False)]
        qm = Q.quantize_dynamic(nn.Sequential(*mods).eval())
        with torch.no_grad():  # (a weight written once, as a loaded model's: the entry keys the given weight's version)
            qm[0].weight_int8.add_(0), qm[-1].weight_int8.add_(0)
        c = torch.compile(qm, fullgraph=True, dynamic=False)
        with torch.inference_mode():
            want = qm(x)
            for _ in range(3):
                y = c(x)
                assert y.shape == (3, 70, 70)
                if not gelu:
                    assert torch.equal(y, want)
    assert taken.n == (2 * 2 * 2 if VNNI else 0)


@pytest.mark.parametrize("k", [1, 15, 63, 64, 65, 100, 128, 191, 384, 1536, 1537])
@pytest.mark.parametrize("rows", [1, 3, 130])
@pytest.mark.parametrize("levels", [255.0, 127.0])
def test_row_grid_codes_equal_across_bodies(k: int, rows: int, levels: float) -> None:
    """The row grid's u8 codes and grids from the best body (AVX-512BW's 64-code blocks where the CPU has them) equal
    the scalar and AVX2 bodies', contiguous and row-strided, 8-bit and 7-bit
    (``per_token_7bit``). Pin (the narrowing stores before gave them too)."""
    if not native.available():
        pytest.skip(native.reason())
    torch.manual_seed(k * 7 + rows)
    x = torch.randn(rows, k + 5) * torch.rand(rows, 1) * 8
    x[:, ::3] = torch.round(x[:, ::3] * 4) / 4
    for xs in (x[:, :k], x[:, :k].contiguous()):
        best = native.row_grid(xs, levels, "codes")
        with native.force_scalar():
            scalar = native.row_grid(xs, levels, "codes")
        with native.force_avx2():
            avx2 = native.row_grid(xs, levels, "codes")
        for other in (scalar, avx2):
            assert all(torch.equal(a, b) for a, b in zip(best, other, strict=True))
