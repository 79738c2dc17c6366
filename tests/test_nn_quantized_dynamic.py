"""Dynamic int8 Linear / LSTM / GRU: per-token activations, int8 weights, float in and out.

Oracles: fp32 (relative error), ``torch.ao.nn.quantized.dynamic`` (we must be at least as close to
fp32), and the float simulation ``F.linear(x̂, ŵ)`` of the same integer codes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import lowbit as Q
from helpers import roundtrip
from lowbit import kernels
from lowbit.nn.quantized import dynamic as nnqd
from lowbit.nn.quantized.dynamic.linear import per_token_linear, quantize_per_token

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def ao_dynamic(mod: nn.Module) -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(mod), {type(mod)}, dtype=torch.qint8)[0]


def outlier_tokens(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[::4] *= 30  # every 4th token is 30x larger: one per-tensor grid wastes its levels on them
    return x


# ---- per-token quantization and the GEMM ----
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), k=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_quantize_per_token_each_row_on_its_own_grid(m, k, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.rand(m, 1) * 10
    xq = quantize_per_token(x)
    assert xq.axis == 0 and xq.qdtype == Q.quint8 and xq.scale.shape == (m,)
    assert ((xq.dequantize() - x).abs() <= xq.scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("backend", [None, "reference", "int_mm"])
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 70), n=st.integers(1, 12), seed=st.integers(0, 2**16),
       w_zp=st.booleans())
def test_per_token_linear_integer_exact(backend, m, k, n, seed, w_zp):
    g = torch.Generator().manual_seed(seed)
    zx = torch.randint(0, 256, (m,), generator=g)
    q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.int64).to(torch.uint8)
    xq = Q.QTensor(q, torch.ones(m), zx, Q.quint8, axis=0)  # unit scales: y is the integer sum itself
    wc = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int64).to(torch.int8)
    zw = torch.randint(-3, 4, (n,), generator=g) if w_zp else torch.zeros(n, dtype=torch.int64)
    w = Q.QTensor(wc, torch.ones(n), zw, Q.qint8, axis=0)
    exact = (q.long() - zx[:, None]) @ (wc.long() - zw[:, None]).t()
    with kernels.use_backend(backend):
        y = per_token_linear(xq, w, None, {})
    assert torch.equal(y, exact.to(torch.float32))


def test_per_token_linear_matches_float_simulation_and_qint8_codes():
    x, fc = outlier_tokens(33, 48), nn.Linear(48, 20)
    qfc = nnqd.Linear.from_float(fc)
    xq = quantize_per_token(x)
    ref = F.linear(xq.dequantize(), qfc.weight().dequantize(), qfc.bias)
    assert torch.allclose(per_token_linear(xq, qfc.weight(), qfc.bias), ref, rtol=1e-5, atol=1e-4)
    s = x.abs().amax(1) / 127  # symmetric qint8 rows take the same path
    zq = torch.zeros(33, dtype=torch.int64)
    xs = Q.QTensor(Q.functional.quantize(x, s, zq, Q.qint8, 0), s, zq, Q.qint8, axis=0)
    ref = F.linear(xs.dequantize(), qfc.weight().dequantize(), qfc.bias)
    assert torch.allclose(per_token_linear(xs, qfc.weight(), qfc.bias), ref, rtol=1e-5, atol=1e-4)


# ---- dynamic Linear ----
def test_linear_close_to_fp32_and_closer_than_torch_ao():
    fc = nn.Linear(256, 512)
    x = outlier_tokens(64, 256)
    ref = fc(x)
    ours, theirs = rel(nnqd.Linear.from_float(fc)(x), ref), rel(ao_dynamic(fc)(x), ref)
    assert ours < 0.015 and ours < theirs / 2
    y = nnqd.Linear.from_float(fc)(x.reshape(4, 16, 256))  # any leading shape
    assert y.shape == (4, 16, 512) and rel(y, ref.reshape(4, 16, 512)) < 0.015


def test_linear_transformer_mlp_relative_error_about_one_percent():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    q = nn.Sequential(nnqd.Linear.from_float(mlp[0]), nn.GELU(), nnqd.Linear.from_float(mlp[2]))
    x = torch.randn(4, 32, 128)
    x[..., 3] *= 20  # an outlier channel, as in real transformers
    assert rel(q(x), mlp(x)) < 0.02


def test_linear_float16_weights_bias_free_and_empty_input():
    fc = nn.Linear(16, 8, bias=False)
    q = nnqd.Linear.from_float(fc, dtype=torch.float16)
    x = torch.randn(5, 16)
    assert q.weight().dtype == torch.float16 and rel(q(x), fc(x)) < 1e-3
    assert sorted(q.state_dict()) == ["weight_fp16"]
    q8 = nnqd.Linear.from_float(fc)
    assert q8.bias is None and q8(torch.randn(0, 16)).shape == (0, 8)
    assert q8(torch.randn(3, 16, dtype=torch.float64)).dtype == torch.float64


def test_linear_state_dict_round_trip_and_cache_invalidation():
    fc, x = nn.Linear(32, 24), torch.randn(7, 32)
    q = nnqd.Linear.from_float(fc)
    sd = roundtrip(q)
    assert sorted(sd) == ["bias", "weight_int8", "weight_scale", "weight_zero_point"]
    assert sd["weight_int8"].dtype == torch.int8 and bool((sd["weight_zero_point"] == 0).all())
    fresh = nnqd.Linear(32, 24)
    fresh(x)  # fills the packed-weight cache with the zero weight
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), q(x))
    w = q.weight()
    assert isinstance(w, Q.QTensor) and w.axis == 0 and w.qdtype == Q.qint8
    assert torch.allclose(w.dequantize(), fc.weight, atol=float(w.scale.max()) / 2 + 1e-7)
    assert "qint8" in repr(q) and "per_token" in repr(q)


def test_linear_cache_follows_a_scale_only_change():
    """Scales changed in place with the codes unchanged (a rescaled layer) must not reuse the row sums cached for
    the old scales: the result equals a module that never ran with the old ones."""
    fc, x = nn.Linear(32, 24), torch.randn(7, 32)
    q = nnqd.Linear.from_float(fc)
    before = q(x)
    with torch.no_grad():
        q.weight_scale.mul_(2)
    fresh = nnqd.Linear(32, 24)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(q(x), fresh(x)) and not torch.equal(q(x), before)


def test_linear_from_float_honours_a_qconfig_weight_observer():
    fc = nn.Linear(8, 4)
    fc.qconfig = Q.QConfig(activation=Q.PlaceholderObserver,
                           weight=Q.MinMaxObserver.with_args(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8))
    q = nnqd.Linear.from_float(fc)
    assert torch.unique(q.weight_scale).numel() == 1  # one per-tensor scale, broadcast to every channel


def test_linear_errors():
    with pytest.raises(ValueError, match="in_features=0"):
        nnqd.Linear(0, 3)
    with pytest.raises(ValueError, match="dtype"):
        nnqd.Linear(2, 3, dtype=Q.quint8)
    with pytest.raises(TypeError, match="qdtype"):
        nnqd.Linear(2, 3, dtype=torch.int32)
    q = nnqd.Linear(4, 3)
    with pytest.raises(ValueError, match="in_features=4"):
        q(torch.randn(2, 5))
    with pytest.raises(TypeError, match="floating-point"):
        q(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="nn.Linear"):
        nnqd.Linear.from_float(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="weight shape"):
        q.set_weight_bias(Q.quantize_per_channel(torch.randn(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.long),
                                                 0, Q.qint8), None)
    with pytest.raises(TypeError, match="int8 QTensor"):
        q.set_weight_bias(torch.randn(3, 4), torch.zeros(3))


# ---- LSTM / GRU ----
def _float_rnn(kind, **kw):
    torch.manual_seed(1)
    return (nn.LSTM if kind == "lstm" else nn.GRU)(12, 20, **kw).eval()


def _cls(kind):
    return nnqd.LSTM if kind == "lstm" else nnqd.GRU


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}, {"batch_first": True, "bias": False}])
def test_rnn_close_to_fp32_and_torch_ao(kind, kw):
    f = _float_rnn(kind, **kw)
    q = _cls(kind).from_float(f)
    x = torch.randn(6, 4, 12) * 2
    y_ref, h_ref = f(x)
    y, h = q(x)
    assert y.shape == y_ref.shape and rel(y, y_ref) < 0.02
    if f.bias:  # torch.ao's dynamic RNNs require biases
        y_ao, _ = ao_dynamic(f)(x)
        assert rel(y, y_ref) <= rel(y_ao, y_ref) * 1.25 + 1e-3
    for a, b in zip(h if kind == "lstm" else (h,), h_ref if kind == "lstm" else (h_ref,)):
        assert a.shape == b.shape and rel(a, b) < 0.03


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_initial_state_unbatched_and_float16(kind):
    f = _float_rnn(kind, num_layers=2)
    q = _cls(kind).from_float(f)
    x = torch.randn(5, 3, 12)
    h0 = torch.randn(2, 3, 20)
    hx = (h0, torch.randn(2, 3, 20)) if kind == "lstm" else h0
    assert rel(q(x, hx)[0], f(x, hx)[0]) < 0.02
    hx1 = tuple(h[:, 0] for h in hx) if kind == "lstm" else h0[:, 0]
    y1, _ = q(x[:, 0], hx1)  # unbatched (L, H_in)
    assert y1.shape == (5, 20) and torch.allclose(y1, q(x[:, :1], tuple(h[:, :1] for h in hx) if kind == "lstm"
                                                        else h0[:, :1])[0][:, 0], atol=1e-6)
    assert rel(_cls(kind).from_float(f, dtype=torch.float16)(x)[0], f(x)[0]) < 1e-3


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_packed_sequence_matches_per_sequence_runs(kind):
    f = _float_rnn(kind, bidirectional=True)
    q = _cls(kind).from_float(f)
    lengths = torch.tensor([3, 6, 1, 4])
    x = torch.randn(6, 4, 12)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, h = q(packed)
    out_ref, h_ref = f(packed)
    y, _ = pad_packed_sequence(out, total_length=6)
    y_ref, _ = pad_packed_sequence(out_ref, total_length=6)
    assert rel(y, y_ref) < 0.02
    hn = h[0] if kind == "lstm" else h
    for b, n in enumerate(lengths.tolist()):  # per-token grids: each sequence alone gives the same numbers
        yb, hb = q(x[:n, b:b + 1])
        assert torch.allclose(y[:n, b], yb[:, 0], atol=1e-5)
        assert (y[n:, b] == 0).all()
        assert torch.allclose(hn[:, b], (hb[0] if kind == "lstm" else hb)[:, 0], atol=1e-5)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_state_dict_round_trip(kind):
    f = _float_rnn(kind, num_layers=2, bidirectional=True)
    q = _cls(kind).from_float(f)
    sd = roundtrip(q)
    assert "ih.l1_reverse.weight_int8" in sd and "hh.l0.bias" in sd
    fresh = _cls(kind)(12, 20, num_layers=2, bidirectional=True)
    fresh.load_state_dict(sd)
    x = torch.randn(4, 2, 12)
    assert torch.equal(fresh(x)[0], q(x)[0])
    assert "num_layers=2" in repr(q) and "qint8" in repr(q)


def test_rnn_errors():
    with pytest.raises(TypeError, match="nn.LSTM"):
        nnqd.LSTM.from_float(nn.GRU(2, 3))
    with pytest.raises(TypeError, match="nn.GRU"):
        nnqd.GRU.from_float(nn.Linear(2, 3))
    with pytest.raises(ValueError, match="proj_size=2"):
        nnqd.LSTM.from_float(nn.LSTM(4, 3, proj_size=2))
    with pytest.raises(ValueError, match="hidden_size=0"):
        nnqd.GRU(3, 0)
    with pytest.raises(ValueError, match="dropout"):
        nnqd.LSTM(3, 4, dropout=2.0)
    q = nnqd.LSTM(3, 4)
    with pytest.raises(ValueError, match="input_size=3"):
        q(torch.randn(2, 1, 5))
    with pytest.raises(ValueError, match="hidden state shape"):
        q(torch.randn(2, 1, 3), (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))
    with pytest.raises(TypeError, match=r"\(h0, c0\)"):
        q(torch.randn(2, 1, 3), torch.zeros(1, 1, 4))
    with pytest.raises(TypeError, match="float tensor"):
        q(torch.ones(2, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D .* or 3-D"):
        q(torch.randn(2))
    with pytest.raises(TypeError, match="tensor h0"):
        nnqd.GRU(3, 4)(torch.randn(2, 1, 3), (torch.zeros(1, 1, 4),))


# ---- fused Linear + ReLU --------------------------------------------------------------------------------
def _fused_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    return Q.fuse_modules(m, [["0", "1"]])


def test_dynamic_linear_relu_is_relu_of_the_dynamic_linear_and_beats_torch_ao():
    import torch.ao.nn.intrinsic as tnni
    import torch.ao.nn.intrinsic.quantized.dynamic as tnniqd

    m = _fused_mlp()
    q = nnqd.LinearReLU.from_float(m[0])
    x = torch.randn(16, 32) * torch.logspace(-1, 1, 32)  # columns on different scales
    assert torch.equal(q(x), torch.relu(nnqd.Linear.from_float(m[0][0])(x)))
    ref = m[0](x)
    lin = copy.deepcopy(m[0][0])
    lin.qconfig = torch.ao.quantization.default_dynamic_qconfig
    tm = tnni.LinearReLU(lin, nn.ReLU())
    tm.qconfig = lin.qconfig
    ao = tnniqd.LinearReLU.from_float(tm)
    assert (q(x) - ref).norm() <= (ao(x) - ref).norm()
    assert "LinearReLU" in repr(q) and "per_token" in repr(q)
    with pytest.raises(TypeError, match="fused lowbit.nn.intrinsic.LinearReLU"):
        nnqd.LinearReLU.from_float(nn.Linear(4, 4))


def test_fused_linear_relu_goes_dynamic_through_quantize_dynamic_and_convert():
    m = _fused_mlp(1)
    x = torch.randn(8, 32)
    a = Q.quantize_dynamic(m)
    prepared = Q.prepare(m, Q.QConfigMapping().set_global(Q.get_dynamic_qconfig()))
    b, report = Q.convert(prepared, return_report=True)
    for q in (a, b):
        assert type(q[0]) is nnqd.LinearReLU and type(q[2]) is nnqd.Linear
    assert torch.equal(a(x), b(x)) and not report.left_float
