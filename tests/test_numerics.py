"""Numerics of the foundation: calculate_qparams, quantize / dequantize / fake_quantize, QScheme/QDtype.

Property tests (hypothesis) for the contract of DESIGN §2, and parity against torch's own kernels
and ``torch.ao`` observers (the oracle) on random data.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as tobs

import lowbit as Q
from lowbit.qscheme import QDtype

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

qint6 = QDtype("qint6", 6, True, -32, 31, torch.int8)
GRIDS = [Q.qint8, Q.quint8, Q.qint4, Q.quint4, Q.qint8.with_range(-127, 127), Q.quint8.with_range(0, 127), qint6]
SCHEMES = [Q.per_tensor_affine, Q.per_tensor_symmetric]


# ---- strategies ----
@st.composite
def ranges(draw, n: int | None = None):
    """(min, max) float32 tensors, 0-d or (n,), with min <= max; wide, narrow and degenerate widths."""
    shape = () if n is None else (n,)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mag = draw(st.sampled_from([1e-7, 1e-3, 1.0, 1e2, 1e4]))
    a, b = (torch.randn(shape, generator=g) * mag for _ in range(2))
    if draw(st.booleans()):
        b = a + torch.rand(shape, generator=g) * mag * 1e-4  # narrow ranges exercise the eps floor
    return torch.minimum(a, b), torch.maximum(a, b)


@st.composite
def data(draw, shape=None):
    """A random float32 tensor, mostly inside the grid but with out-of-range tails."""
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return torch.randn(shape, generator=g) * draw(st.sampled_from([0.01, 1.0, 30.0]))


def qparams_for(x: torch.Tensor, qscheme, qdtype, ch_axis=None):
    if ch_axis is None:
        return Q.calculate_qparams(x.min(), x.max(), qscheme, qdtype)
    flat = x.movedim(ch_axis, 0).reshape(x.shape[ch_axis], -1)
    return Q.calculate_qparams(flat.amin(1), flat.amax(1), qscheme, qdtype)


def bshape(p: torch.Tensor, x: torch.Tensor, axis: int | None) -> torch.Tensor:
    if axis is None:
        return p
    return p.reshape([-1 if i == axis % x.dim() else 1 for i in range(x.dim())])


# ---- QScheme / QDtype ----
def test_builtin_grids():
    got = [(d.quant_min, d.quant_max, d.storage, repr(d)) for d in (Q.qint8, Q.quint8, Q.qint4, Q.quint4, Q.qint32)]
    assert got == [(-128, 127, torch.int8, "lowbit.qint8"), (0, 255, torch.uint8, "lowbit.quint8"),
                   (-8, 7, torch.int8, "lowbit.qint4"), (0, 15, torch.uint8, "lowbit.quint4"),
                   (-(2**31), 2**31 - 1, torch.int32, "lowbit.qint32")]
    assert repr(Q.qint8.with_range(-127, 127)) == "lowbit.qint8[-127, 127]"
    assert [s.is_per_channel for s in Q.QScheme] == [False, False, True, True, True]  # + float_qparams
    assert [s.is_symmetric for s in Q.QScheme] == [False, True, False, True, False]


def test_scheme_and_dtype_spellings():
    assert Q.qscheme.as_qscheme("per_channel_symmetric") is Q.per_channel_symmetric
    assert Q.qscheme.as_qscheme(torch.per_tensor_affine) is Q.per_tensor_affine
    assert Q.qscheme.as_qdtype("quint8") == Q.quint8 and Q.qscheme.as_qdtype(torch.qint8) == Q.qint8


@pytest.mark.parametrize("args, err, match", [
    (("q", 8, True, 5, 5, torch.int8), ValueError, "quant_min=5"),
    (("q", 8, True, -200, 127, torch.int8), ValueError, r"\[-200, 127\]"),
    (("q", 4, False, 0, 16, torch.uint8), ValueError, r"\[0, 16\]"),
])
def test_bad_qdtype(args, err, match):
    with pytest.raises(err, match=match):
        QDtype(*args)


def test_bad_scheme_and_dtype_names():
    with pytest.raises(ValueError, match="per_tensor_afine"):
        Q.calculate_qparams(0.0, 1.0, "per_tensor_afine", Q.quint8)
    with pytest.raises(TypeError, match="int7"):
        Q.calculate_qparams(0.0, 1.0, Q.per_tensor_affine, "int7")
    with pytest.raises(TypeError, match="float32"):
        Q.quantize(torch.ones(2), 0.1, 0, torch.float32)


# ---- calculate_qparams: properties ----
@fast
@given(r=ranges(), qscheme=st.sampled_from(SCHEMES), qdtype=st.sampled_from(GRIDS))
def test_qparams_cover_the_range(r, qscheme, qdtype):
    lo, hi = r
    s, z = Q.calculate_qparams(lo, hi, qscheme, qdtype)
    assert s.shape == () and s.dtype == torch.float32 and z.dtype == torch.int64
    assert s > 0 and math.isfinite(s.item()) and qdtype.quant_min <= z <= qdtype.quant_max
    # 0.0 is exactly representable, and both ends of the (zero-widened) range are within s/2
    assert Q.fake_quantize(torch.zeros(1), s, z, qdtype.quant_min, qdtype.quant_max).item() == 0.0
    ends = torch.stack([torch.clamp(lo, max=0), torch.clamp(hi, min=0)])
    err = (Q.fake_quantize(ends, s, z, qdtype.quant_min, qdtype.quant_max) - ends).abs()
    assert (err <= s / 2 * (1 + 1e-5) + 1e-6 * ends.abs()).all()


@fast
@given(r=ranges(n=6), qscheme=st.sampled_from([Q.per_channel_affine, Q.per_channel_symmetric]))
def test_qparams_per_channel_are_elementwise(r, qscheme):
    lo, hi = r
    s, z = Q.calculate_qparams(lo, hi, qscheme, Q.qint8)
    assert s.shape == z.shape == (6,)
    for c in range(6):
        sc, zc = Q.calculate_qparams(lo[c], hi[c], qscheme, Q.qint8)
        assert s[c] == sc and z[c] == zc


def test_qparams_documented_values():
    s, z = Q.calculate_qparams(-1.0, 3.0, Q.per_tensor_affine, Q.quint8)
    assert s.item() == pytest.approx(4 / 255, rel=1e-6) and z.item() == 64
    s, z = Q.calculate_qparams(-1.0, 3.0, Q.per_tensor_symmetric, Q.quint8)
    assert s.item() == pytest.approx(3 / 127.5, rel=1e-6) and z.item() == 128
    assert Q.calculate_qparams(0.0, 0.0)[0].item() == pytest.approx(1e-8)
    assert Q.calculate_qparams(3.0, 3.0)[0].item() == pytest.approx(3 / 255)  # widened to (0, 3)
    # custom unsigned symmetric grid: rounded-up midpoint (a documented departure from torch)
    assert Q.calculate_qparams(-1.0, 1.0, Q.per_tensor_symmetric, Q.quint8.with_range(0, 127))[1].item() == 64


# ---- calculate_qparams: parity with torch.ao observers ----
def torch_custom(qdtype) -> bool:
    return (qdtype.quant_min, qdtype.quant_max) not in ((-128, 127), (0, 255))


def torch_qparams(lo, hi, qscheme, qdtype, eps=1e-8):
    per_channel = lo.dim() == 1
    cls = tobs.PerChannelMinMaxObserver if per_channel else tobs.MinMaxObserver
    tscheme = {(False, False): torch.per_tensor_affine, (False, True): torch.per_tensor_symmetric,
               (True, False): torch.per_channel_affine, (True, True): torch.per_channel_symmetric}
    kw = dict(quant_min=qdtype.quant_min, quant_max=qdtype.quant_max) if torch_custom(qdtype) else {}
    obs = cls(dtype=torch.qint8 if qdtype.signed else torch.quint8, eps=eps,
              qscheme=tscheme[per_channel, Q.qscheme.as_qscheme(qscheme).is_symmetric], **kw)
    return obs._calculate_qparams(lo, hi)


@fast
@given(r=ranges(), qscheme=st.sampled_from(SCHEMES), qdtype=st.sampled_from(GRIDS),
       eps=st.sampled_from([1e-8, torch.finfo(torch.float32).eps]))
def test_qparams_match_torch_ao(r, qscheme, qdtype, eps):
    lo, hi = r
    s, z = Q.calculate_qparams(lo, hi, qscheme, qdtype, eps=eps)
    ts, tz = torch_qparams(lo, hi, qscheme, qdtype, eps)
    torch.testing.assert_close(s.reshape(1), ts.reshape(1).float(), rtol=1e-6, atol=0)
    if qscheme.is_symmetric and not qdtype.signed and torch_custom(qdtype):
        tz = tz + (qdtype.quant_min + qdtype.quant_max) % 2  # torch rounds the midpoint down (departure)
    assert z.reshape(1).tolist() == tz.reshape(1).tolist()


@fast
@given(r=ranges(n=5), symmetric=st.booleans())
def test_per_channel_qparams_match_torch_ao(r, symmetric):
    lo, hi = r
    qscheme = Q.per_channel_symmetric if symmetric else Q.per_channel_affine
    s, z = Q.calculate_qparams(lo, hi, qscheme, Q.qint8)
    ts, tz = torch_qparams(lo, hi, qscheme, Q.qint8)
    torch.testing.assert_close(s, ts.float(), rtol=1e-6, atol=0)
    assert z.tolist() == tz.tolist()


# ---- quantize / dequantize / fake_quantize: properties ----
@fast
@given(x=data(), qscheme=st.sampled_from(SCHEMES), qdtype=st.sampled_from(GRIDS))
def test_quantize_properties_per_tensor(x, qscheme, qdtype):
    check_quantize_properties(x, qscheme, qdtype, None)


@fast
@given(x=data(), qscheme=st.sampled_from([Q.per_channel_affine, Q.per_channel_symmetric]),
       qdtype=st.sampled_from(GRIDS), axis_pick=st.integers(0, 7))
def test_quantize_properties_per_channel(x, qscheme, qdtype, axis_pick):
    axis = axis_pick % x.dim() - (x.dim() if axis_pick >= 4 else 0)  # negative axes too
    check_quantize_properties(x, qscheme, qdtype, axis)


def check_quantize_properties(x, qscheme, qdtype, axis):
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    # calibrate on the middle of the data so the tails fall outside the grid
    s, z = qparams_for(x * 0.7, qscheme, qdtype, axis)
    q = Q.quantize(x, s, z, qdtype, axis)
    assert q.dtype == qdtype.storage and q.shape == x.shape
    assert int(q.min()) >= qmin and int(q.max()) <= qmax                       # codes stay on the grid
    xh = Q.dequantize(q, s, z, axis)
    assert xh.dtype == torch.float32
    sb, zb = bshape(s, x, axis), bshape(z, x, axis)
    inside = (x >= (qmin - zb) * sb) & (x <= (qmax - zb) * sb)
    tol = sb / 2 * (1 + 1e-5) + 1e-6 * x.abs()
    assert ((xh - x).abs() <= tol)[inside].all()                              # |x̂ - x| <= s/2 inside
    assert torch.equal(Q.quantize(xh, s, z, qdtype, axis), q)                 # quantize∘dequantize idempotent
    fq = Q.fake_quantize(x, s, z, qmin, qmax, axis)
    assert torch.equal(Q.fake_quantize(fq, s, z, qmin, qmax, axis), fq)       # fake_quantize idempotent
    t = x * torch.reciprocal(sb)  # fake_quantize rounds t then adds z, quantize rounds t + z: equal off ties
    off_tie = ((t - t.floor()) - 0.5).abs() > 1e-3
    assert torch.equal(fq[off_tie], xh[off_tie])                             # = dequantize(quantize(x))


def test_rounding_is_half_to_even_and_saturates():
    s = torch.tensor(0.5)  # exact: x / s = k + 0.5 has no rounding error
    x = torch.tensor([0.25, 0.75, -0.25, -0.75, 1000.0, -1000.0])
    assert Q.quantize(x, s, 0, Q.qint8).tolist() == [0, 2, 0, -2, 127, -128]
    assert Q.quantize(torch.zeros(1), 0.1, 128, Q.quint8).tolist() == [128]


def test_fake_quantize_ste_mask():
    x = torch.tensor([-100.0, 0.2, 0.5, 100.0], requires_grad=True)
    Q.fake_quantize(x, 0.1, 0, -128, 127).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    w = torch.tensor([[0.1, 0.2, 10.0], [-10.0, 0.0, 0.3]], requires_grad=True)
    Q.fake_quantize(w, torch.tensor([0.01, 0.01]), torch.tensor([0, 0]), -128, 127, ch_axis=0).sum().backward()
    assert w.grad.tolist() == [[1, 1, 0], [0, 1, 1]]


# ---- parity with torch's quantized kernels ----
TORCH_DT = {"qint8": torch.qint8, "quint8": torch.quint8}


@fast
@given(x=data(), qdtype=st.sampled_from([Q.qint8, Q.quint8]), qscheme=st.sampled_from(SCHEMES))
def test_quantize_matches_torch_per_tensor(x, qdtype, qscheme):
    s, z = qparams_for(x * 0.7, qscheme, qdtype)
    ref = torch.quantize_per_tensor(x, s.item(), int(z), TORCH_DT[qdtype.name])
    assert torch.equal(Q.quantize(x, s, z, qdtype), ref.int_repr())
    assert torch.equal(Q.dequantize(Q.quantize(x, s, z, qdtype), s, z), ref.dequantize())


@fast
@given(x=data(), qdtype=st.sampled_from([Q.qint8, Q.quint8]), axis_pick=st.integers(0, 3),
       symmetric=st.booleans())
def test_quantize_matches_torch_per_channel(x, qdtype, axis_pick, symmetric):
    axis = axis_pick % x.dim()
    s, z = qparams_for(x * 0.7, Q.per_channel_symmetric if symmetric else Q.per_channel_affine, qdtype, axis)
    ref = torch.quantize_per_channel(x, s.double(), z, axis, TORCH_DT[qdtype.name])
    assert torch.equal(Q.quantize(x, s, z, qdtype, axis), ref.int_repr())
    qt = Q.quantize_per_channel(x, s, z, axis, qdtype)
    assert torch.equal(qt.int_repr(), ref.int_repr()) and torch.equal(qt.dequantize(), ref.dequantize())


@fast
@given(x=data(), qscheme=st.sampled_from(SCHEMES), qdtype=st.sampled_from(GRIDS))
def test_fake_quantize_matches_torch_per_tensor(x, qscheme, qdtype):
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    s, z = qparams_for(x * 0.7, qscheme, qdtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = Q.fake_quantize(a, s, z, qmin, qmax)
    ref = torch.fake_quantize_per_tensor_affine(b, s.item(), int(z), qmin, qmax)
    assert torch.equal(out, ref)
    g = torch.randn_like(x)
    out.backward(g), ref.backward(g)
    assert torch.equal(a.grad, b.grad)


@fast
@given(x=data(), qdtype=st.sampled_from(GRIDS), axis_pick=st.integers(0, 3), symmetric=st.booleans())
def test_fake_quantize_matches_torch_per_channel(x, qdtype, axis_pick, symmetric):
    axis, qmin, qmax = axis_pick % x.dim(), qdtype.quant_min, qdtype.quant_max
    s, z = qparams_for(x * 0.7, Q.per_channel_symmetric if symmetric else Q.per_channel_affine, qdtype, axis)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = Q.fake_quantize(a, s, z, qmin, qmax, axis)
    ref = torch.fake_quantize_per_channel_affine(b, s, z.int(), axis, qmin, qmax)
    assert torch.equal(out, ref)
    out.sum().backward(), ref.sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("zp", [0, 3])
def test_ste_mask_at_clip_boundary_matches_torch(zp):
    s = 0.25  # codes just inside / on / just past qmax and qmin, including exact .5 ties
    codes = torch.tensor([127.4, 127.5, 127.6, 128.5, -128.4, -128.5, -128.6, -129.5])
    x = ((codes - zp) * s).requires_grad_()
    y = x.detach().clone().requires_grad_()
    out, ref = Q.fake_quantize(x, s, zp, -128, 127), torch.fake_quantize_per_tensor_affine(y, s, zp, -128, 127)
    out.sum().backward(), ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, y.grad)
    assert x.grad.sum() > 0 and x.grad.sum() < len(codes)


# ---- bad input: a clear error, never NaN ----
@pytest.mark.parametrize("lo, hi, match", [
    (float("nan"), 1.0, "finite"), (0.0, float("inf"), "finite"), (float("-inf"), 0.0, "finite"),
    (2.0, 1.0, "exceeds"), (torch.tensor([0.0, 3.0]), torch.tensor([1.0, 2.0]), "exceeds"),
])
def test_calculate_qparams_rejects_bad_ranges(lo, hi, match):
    with pytest.raises(ValueError, match=match):
        Q.calculate_qparams(lo, hi)


@pytest.mark.parametrize("eps", [0.0, -1e-8, float("nan"), float("inf"), "1e-8", None])
def test_calculate_qparams_rejects_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        Q.calculate_qparams(0.0, 1.0, eps=eps)


def test_calculate_qparams_rejects_bad_types():
    with pytest.raises(TypeError, match="min_val='0'"):
        Q.calculate_qparams("0", 1.0)
    with pytest.raises(ValueError, match="shape"):
        Q.calculate_qparams(torch.zeros(3), torch.ones(4))


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="int64"):
        Q.quantize(torch.arange(4), 0.1, 0, Q.qint8)
    with pytest.raises(TypeError, match="int32"):
        Q.fake_quantize(torch.arange(4, dtype=torch.int32), 0.1, 0, -128, 127)
    with pytest.raises(ValueError, match="ch_axis=2"):
        Q.quantize(torch.ones(4, 3), torch.ones(3), torch.zeros(3), Q.qint8, ch_axis=2)
    with pytest.raises(ValueError, match=r"\(4,\).*size 3"):
        Q.quantize(torch.ones(4, 3), torch.ones(4), torch.zeros(4), Q.qint8, ch_axis=1)
    with pytest.raises(ValueError, match=r"\(2,\).*size 3"):
        Q.dequantize(torch.ones(4, 3, dtype=torch.int8), torch.ones(2), torch.zeros(2), ch_axis=-1)
    with pytest.raises(ValueError, match="scalars"):
        Q.quantize(torch.ones(4, 3), torch.ones(3), 0, Q.qint8)
    with pytest.raises(ValueError, match="quant_min=5"):
        Q.fake_quantize(torch.ones(2), 0.1, 0, 5, 5)
    with pytest.raises(TypeError, match="ch_axis"):
        Q.quantize(torch.ones(4, 3), torch.ones(3), torch.zeros(3), Q.qint8, ch_axis=1.0)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
def test_quantize_rejects_bad_scale(scale):
    for fn in (lambda: Q.quantize(torch.ones(3), scale, 0, Q.qint8),
               lambda: Q.fake_quantize(torch.ones(3), scale, 0, -128, 127),
               lambda: Q.quantize_per_tensor(torch.ones(3), scale, 0, Q.qint8)):
        with pytest.raises(ValueError, match="scale"):
            fn()
