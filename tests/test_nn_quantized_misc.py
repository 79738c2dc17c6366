"""Quantized activations, stubs, FloatFunctional/QFunctional and Embedding/EmbeddingBag.

Oracles: the float op on dequantized values (one output quantum), and ``torch.ao.nn.quantized``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from helpers import roundtrip
from lowbit.functional import quantize
from lowbit.nn.quantized.activation import ELU, Hardsigmoid, Hardswish, LeakyReLU, ReLU6, Sigmoid, Tanh
from lowbit.nn.quantized.embedding import Embedding, EmbeddingBag, _pack4, _unpack4
from lowbit.nn.quantized.functional_modules import FloatFunctional, QFunctional
from lowbit.nn.quantized.stubs import DeQuantize, Quantize

warnings.filterwarnings("ignore", category=UserWarning)
import torch.ao.nn.quantized as aonnq  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---- helpers ----
def qt(x: torch.Tensor, s: float, z: int, d=Q.quint8) -> Q.QTensor:
    return Q.quantize_per_tensor(x, s, z, d)


def ao(x: torch.Tensor, s: float, z: int, d=torch.quint8) -> torch.Tensor:
    return torch.quantize_per_tensor(x, s, z, d)


def codes_close(a: torch.Tensor, b: torch.Tensor, tol: int = 1) -> None:
    assert (a.to(torch.int64) - b.to(torch.int64)).abs().max().item() <= tol


def observed(mod: nn.Module, x: torch.Tensor, fn) -> nn.Module:
    mod.activation_post_process = Q.MinMaxObserver()
    mod.activation_post_process(fn(x))
    return mod


ACTS = [  # (lowbit module, float function)
    (lambda: Hardswish(0.03, 30), F.hardswish),
    (lambda: ELU(0.02, 80, alpha=0.7), lambda x: F.elu(x, 0.7)),
    (lambda: LeakyReLU(0.025, 60, negative_slope=0.1), lambda x: F.leaky_relu(x, 0.1)),
    (lambda: Sigmoid(), torch.sigmoid),
    (lambda: Hardsigmoid(), F.hardsigmoid),
    (lambda: Tanh(), torch.tanh),
    (lambda: Tanh(0.01, 0, Q.qint8), torch.tanh),
]


# ---- activations ----
@pytest.mark.parametrize("make,f", ACTS)
@settings(max_examples=15, deadline=None)
@given(s_in=st.floats(0.005, 0.2), z_in=st.integers(0, 255), seed=st.integers(0, 2**16))
def test_activation_lut_exact_and_within_one_quantum(make, f, s_in, z_in, seed):
    m = make()
    x = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * 5
    qx = qt(x, s_in, z_in)
    y = m(qx)
    # LUT path == quantize(f(dequantize(q))) bit for bit (the float path does exactly that)
    assert torch.equal(y.int_repr(), m(qx.dequantize()).int_repr())
    # and within one output quantum of the float op (plus clamping at the grid's ends)
    ref = f(qx.dequantize()).clamp((m.qdtype.quant_min - m.zero_point) * m.scale,
                                   (m.qdtype.quant_max - m.zero_point) * m.scale)
    assert (y.dequantize() - ref).abs().max() <= 0.5 * m.scale + 1e-6


def test_activation_lut_over_every_code_and_qint8_input():
    m = Hardswish(0.02, 10)
    codes = torch.arange(-128, 128, dtype=torch.int8)
    qx = Q.QTensor(codes, 0.05, -3, Q.qint8)
    expect = quantize(F.hardswish((codes.float() + 3) * 0.05), 0.02, 10, Q.quint8)
    assert torch.equal(m(qx).int_repr(), expect)
    assert m.lut(qx).shape == (256,)


@pytest.mark.parametrize("ours,theirs", [
    (lambda: Hardswish(0.03, 30), lambda: aonnq.Hardswish(0.03, 30)),
    (lambda: ELU(0.02, 80, alpha=0.7), lambda: aonnq.ELU(0.02, 80, alpha=0.7)),
    (lambda: LeakyReLU(0.025, 60, 0.1), lambda: aonnq.LeakyReLU(0.025, 60, 0.1)),
    (lambda: Sigmoid(), lambda: aonnq.Sigmoid(1 / 256, 0)),
    (lambda: ReLU6(), lambda: aonnq.ReLU6()),
])
def test_activation_parity_with_torch_ao(ours, theirs):
    x = torch.randn(1000) * 4
    y, y_ao = ours()(qt(x, 0.05, 120)), theirs()(ao(x, 0.05, 120))
    assert (y.q_scale(), y.q_zero_point()) == pytest.approx((y_ao.q_scale(), y_ao.q_zero_point()))
    codes_close(y.int_repr(), y_ao.int_repr())


def test_fixed_qparams_match_torch_tanh_and_sigmoid():
    x = torch.randn(500) * 3
    for m, op in ((Tanh(), torch.tanh), (Sigmoid(), torch.sigmoid), (Hardsigmoid(), F.hardsigmoid)):
        y_ao = op(ao(x, 0.05, 120))
        y = m(qt(x, 0.05, 120))
        assert (y.q_scale(), y.q_zero_point()) == (y_ao.q_scale(), y_ao.q_zero_point())
        codes_close(y.int_repr(), y_ao.int_repr())
    assert Tanh.fixed_qparams(Q.qint8) == (2 / 256, 0) and Sigmoid.fixed_qparams(Q.qint8) == (1 / 256, -128)


def test_relu6_keeps_grid_and_clamps_codes():
    x = torch.linspace(-3, 9, 200)
    qx = qt(x, 0.05, 60)
    y = ReLU6()(qx)
    assert (y.q_scale(), y.q_zero_point()) == (qx.q_scale(), qx.q_zero_point())
    assert torch.equal(y.dequantize(), qt(F.relu6(qx.dequantize()), 0.05, 60).dequantize())
    pc = Q.quantize_per_channel(x.reshape(2, 100), torch.tensor([0.05, 0.1]), torch.tensor([60, 10]), 0, Q.quint8)
    assert torch.allclose(ReLU6()(pc).dequantize(), F.relu6(pc.dequantize()), atol=0.05)
    assert ReLU6()(x).dequantize().max() == 6.0  # float input: the [0, 6] grid


def test_activation_from_float_and_errors():
    x = torch.randn(100) * 3
    fm = observed(nn.Hardswish(), x, F.hardswish)
    m = Hardswish.from_float(fm)
    s, z = fm.activation_post_process.calculate_qparams()
    assert m.scale.item() == pytest.approx(s.item()) and m.zero_point.item() == z.item()
    assert "scale=" in repr(m) and "zero_point=" in repr(m) and "quint8" in repr(m)
    assert LeakyReLU.from_float(observed(nn.LeakyReLU(0.2), x, lambda t: F.leaky_relu(t, 0.2))).negative_slope == 0.2
    assert ELU.from_float(observed(nn.ELU(0.5), x, lambda t: F.elu(t, 0.5))).alpha == 0.5
    sig = Sigmoid.from_float(nn.Sigmoid())
    assert (sig.scale.item(), sig.zero_point.item()) == (1 / 256, 0)
    assert ReLU6.from_float(nn.ReLU6()).inplace is False
    with pytest.raises(ValueError, match="activation_post_process"):
        Hardswish.from_float(nn.Hardswish())
    with pytest.raises(TypeError, match="nn.Hardswish"):
        Hardswish.from_float(nn.ReLU())
    with pytest.raises(ValueError, match="scale"):
        Hardswish(-1.0, 0)
    with pytest.raises(ValueError, match="zero_point=300"):
        ELU(0.1, 300)
    with pytest.raises(ValueError, match="both scale and zero_point"):
        Sigmoid(0.1)
    with pytest.raises(TypeError, match="float tensor"):
        Hardswish(0.1, 0)(torch.arange(3))
    with pytest.raises(TypeError, match="float tensor"):
        ReLU6()([1.0])


def test_activation_state_dict_round_trip():
    m = ELU(0.02, 80, alpha=0.7)
    m2 = ELU(1.0, 0, alpha=0.7)
    m2.load_state_dict(roundtrip(m))
    x = qt(torch.randn(50), 0.05, 128)
    assert sorted(m.state_dict()) == ["scale", "zero_point"]
    assert torch.equal(m(x).int_repr(), m2(x).int_repr())


# ---- stubs ----
def test_quantize_dequantize_match_torch():
    x = torch.randn(4, 5) * 3
    q = Quantize(0.03, 100, torch.quint8)(x)
    assert torch.equal(q.int_repr(), torch.quantize_per_tensor(x, 0.03, 100, torch.quint8).int_repr())
    assert torch.equal(DeQuantize()(q), q.dequantize()) and DeQuantize()(x) is x
    assert Quantize(0.03, 100)(q) is q  # same grid: passes through
    q2 = Quantize(0.05, 0, Q.qint8)(q)
    assert q2.qdtype == Q.qint8 and torch.equal(q2.int_repr(), quantize(q.dequantize(), 0.05, 0, Q.qint8))
    assert "zero_point=100" in repr(Quantize(0.03, 100))
    stub = Q.QuantStub()
    stub.activation_post_process = Q.MinMaxObserver()
    stub.activation_post_process(x)
    qs = Quantize.from_float(stub)
    s, z = stub.activation_post_process.calculate_qparams()
    assert qs.scale.item() == pytest.approx(s.item()) and qs.zero_point.item() == z.item()
    assert isinstance(DeQuantize.from_float(Q.DeQuantStub()), DeQuantize)
    qs2 = Quantize(1.0, 0)
    qs2.load_state_dict(roundtrip(qs))
    assert torch.equal(qs2(x).int_repr(), qs(x).int_repr())


def test_stub_errors():
    with pytest.raises(TypeError, match="float tensor"):
        Quantize(0.1, 0)(torch.arange(4))
    with pytest.raises(TypeError, match="QTensor or a tensor"):
        DeQuantize()("x")
    with pytest.raises(ValueError, match="scale"):
        Quantize(0.0, 0)
    with pytest.raises(TypeError, match="qdtype"):
        Quantize(0.1, 0, "int3")
    with pytest.raises(ValueError, match="activation_post_process"):
        Quantize.from_float(nn.Identity())


# ---- FloatFunctional / QFunctional ----
class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x)
        return x


def test_float_functional_routes_every_result_through_its_observer():
    ff = FloatFunctional()
    assert isinstance(ff.activation_post_process, nn.Identity)
    ff.activation_post_process = rec = _Recorder()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    outs = [ff.add(a, b), ff.mul(a, b), ff.cat([a, b], 1), ff.add_relu(a, b), ff.add_scalar(a, 2.0),
            ff.mul_scalar(a, 3), ff.matmul(a, b.t())]
    refs = [a + b, a * b, torch.cat([a, b], 1), torch.relu(a + b), a + 2, a * 3, a @ b.t()]
    assert len(rec.seen) == 7 and all(torch.equal(o, r) for o, r in zip(outs, refs))
    with pytest.raises(RuntimeError, match="not called directly"):
        ff(a)
    with pytest.raises(TypeError, match="scalar"):
        ff.add_scalar(a, "2")


def _ops(a, b):
    return {
        "add": (lambda m, x, y: m.add(x, y), lambda x, y: x + y),
        "add_relu": (lambda m, x, y: m.add_relu(x, y), lambda x, y: torch.relu(x + y)),
        "mul": (lambda m, x, y: m.mul(x, y), lambda x, y: x * y),
        "add_scalar": (lambda m, x, y: m.add_scalar(x, 0.7), lambda x, y: x + 0.7),
        "mul_scalar": (lambda m, x, y: m.mul_scalar(x, -1.3), lambda x, y: x * -1.3),
        "cat": (lambda m, x, y: m.cat([x, y], 1), lambda x, y: torch.cat([x, y], 1)),
        "matmul": (lambda m, x, y: m.matmul(x, y.transpose(0, 1)), lambda x, y: x @ y.transpose(0, 1)),
    }


@pytest.mark.parametrize("op", list(_ops(None, None)))
@settings(max_examples=10, deadline=None)
@given(sa=st.floats(0.01, 0.1), za=st.integers(0, 255), sb=st.floats(0.01, 0.1), zb=st.integers(0, 255),
       so=st.floats(0.02, 0.5), zo=st.integers(0, 255), seed=st.integers(0, 2**16))
def test_qfunctional_within_one_quantum_of_float_math(op, sa, za, sb, zb, so, zo, seed):
    g = torch.Generator().manual_seed(seed)
    qa, qb = qt(torch.randn(6, 8, generator=g) * 3, sa, za), qt(torch.randn(6, 8, generator=g) * 3, sb, zb)
    run, ref = _ops(qa, qb)[op]
    m = QFunctional(so, zo)
    y = run(m, qa, qb)
    expect = quantize(ref(qa.dequantize(), qb.dequantize()), so, zo, Q.quint8)
    codes_close(y.int_repr(), expect)
    assert (y.q_scale(), y.q_zero_point()) == pytest.approx((so, zo))
    # a float operand takes the float path, exactly quantize(op(float))
    yf = run(m, qa.dequantize(), qb)
    assert torch.equal(yf.int_repr(), expect)


@pytest.mark.parametrize("op", ["add", "add_relu", "mul", "cat"])
def test_qfunctional_parity_with_torch_ao(op):
    a, b = torch.randn(5, 7) * 2, torch.randn(5, 7)
    m, m_ao = QFunctional(0.04, 90), aonnq.QFunctional()
    m_ao.scale, m_ao.zero_point = 0.04, 90
    run, _ = _ops(None, None)[op]
    y = run(m, qt(a, 0.02, 128), qt(b, 0.01, 100))
    y_ao = run(m_ao, ao(a, 0.02, 128), ao(b, 0.01, 100))
    codes_close(y.int_repr(), y_ao.int_repr())


def test_qfunctional_scalar_ops_match_torch_ao_values():
    a = torch.randn(40) * 2
    m_ao = aonnq.QFunctional()
    for name, c in (("add_scalar", 0.5), ("mul_scalar", 2.0)):
        y_ao = getattr(m_ao, name)(ao(a, 0.02, 128), c)  # torch moves the grid instead of requantizing
        m = QFunctional(y_ao.q_scale(), y_ao.q_zero_point())
        y = getattr(m, name)(qt(a, 0.02, 128), c)
        assert (y.dequantize() - y_ao.dequantize()).abs().max() <= y_ao.q_scale() + 1e-6


def test_qfunctional_cat_same_grid_copies_codes_and_per_channel_falls_back():
    qa = qt(torch.randn(3, 4), 0.05, 128)
    m = QFunctional(0.05, 128)
    assert torch.equal(m.cat([qa, qa]).int_repr(), torch.cat([qa.int_repr()] * 2))
    pc = Q.quantize_per_channel(torch.randn(3, 4), torch.full((3,), 0.05), torch.full((3,), 128), 0, Q.quint8)
    y = m.add(pc, qa)
    assert torch.equal(y.int_repr(), quantize(pc.dequantize() + qa.dequantize(), 0.05, 128, Q.quint8))


def test_qfunctional_from_float_state_and_errors():
    ff = FloatFunctional()
    with pytest.raises(ValueError, match="never prepared"):
        QFunctional.from_float(ff)
    with pytest.raises(TypeError, match="FloatFunctional"):
        QFunctional.from_float(nn.Linear(2, 2))
    ff.activation_post_process = Q.MinMaxObserver()
    ff.add(torch.randn(10), torch.randn(10))
    m = QFunctional.from_float(ff)
    s, z = ff.activation_post_process.calculate_qparams()
    assert m.scale.item() == pytest.approx(s.item()) and m.zero_point.item() == z.item()
    m2 = QFunctional()
    m2.load_state_dict(roundtrip(m))
    assert torch.equal(m2.scale, m.scale) and torch.equal(m2.zero_point, m.zero_point)
    assert "scale=" in repr(m)
    with pytest.raises(TypeError, match="QTensors or float tensors"):
        m.add(torch.arange(3), torch.arange(3))
    with pytest.raises(TypeError, match="list of QTensors"):
        m.cat(qt(torch.randn(3), 0.1, 0))
    with pytest.raises(TypeError, match="scalar"):
        m.mul_scalar(qt(torch.randn(3), 0.1, 0), None)
    with pytest.raises(RuntimeError):
        m(torch.randn(3))


# ---- Embedding / EmbeddingBag ----
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), d=st.integers(1, 9), signed=st.booleans(), seed=st.integers(0, 2**16))
def test_pack4_round_trip(n, d, signed, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if signed else (0, 16)
    codes = torch.randint(lo, hi, (n, d), generator=g).to(torch.int8 if signed else torch.uint8)
    packed = _pack4(codes)
    assert packed.shape == (n, (d + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(_unpack4(packed, d, signed), codes)


@pytest.mark.parametrize("dtype", [Q.quint8, Q.qint8, Q.quint4, Q.qint4])
def test_embedding_within_half_a_row_quantum(dtype):
    emb = nn.Embedding(30, 11, padding_idx=2)
    q = Embedding.from_float(emb, dtype=dtype)
    idx = torch.randint(0, 30, (4, 6))
    err = (q(idx) - emb(idx)).abs()
    assert q(idx).shape == (4, 6, 11) and (err <= q.weight_scale[idx][..., None] / 2 + 1e-6).all()
    assert (q(torch.tensor([2])) == 0).all()  # the zero padding row is exact
    w = q.weight()
    assert w.qdtype == dtype and w.axis == 0 and torch.equal(q(idx), w.dequantize()[idx])
    q2 = Embedding(30, 11, padding_idx=2, qdtype=dtype)
    q2.load_state_dict(roundtrip(q))
    assert torch.equal(q2(idx), q(idx))
    if dtype.bits == 4:
        assert q.weight_q.shape == (30, 6)  # two codes per byte


def test_embedding_parity_with_torch_ao():
    emb = nn.Embedding(50, 16)
    emb.qconfig = torch.ao.quantization.float_qparams_weight_only_qconfig
    q_ao = aonnq.Embedding.from_float(emb)
    q = Embedding.from_float(emb, dtype=Q.quint8)
    idx = torch.randint(0, 50, (20,))
    scale = q.weight_scale[idx][:, None]
    assert ((q(idx) - q_ao(idx)).abs() <= 1.5 * scale).all()


def test_embedding_from_float_uses_qconfig_or_qat_grid():
    emb = nn.Embedding(10, 4)
    emb.qconfig = Q.QConfig(activation=Q.PlaceholderObserver,
                            weight=Q.PerChannelMinMaxObserver.with_args(ch_axis=0))
    q = Embedding.from_float(emb)
    assert q.qdtype == Q.qint8 and bool((q.weight_zero_point == 0).all())  # per-row symmetric from the qconfig
    assert torch.allclose(q(torch.arange(10)), emb.weight, atol=float(q.weight_scale.max()))


def _bag_ref(q, flat, offsets, mode, psw=None, include_last=False):
    return F.embedding_bag(flat, q.weight().dequantize(), offsets, mode=mode, per_sample_weights=psw,
                           include_last_offset=include_last, padding_idx=q.padding_idx)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [Q.quint8, Q.quint4])
def test_embedding_bag_modes_offsets_and_padding(mode, dtype):
    fb = nn.EmbeddingBag(40, 9, mode=mode, padding_idx=5)
    q = EmbeddingBag.from_float(fb, dtype=dtype)
    flat = torch.tensor([5, 1, 2, 5, 7, 9, 9, 30, 5, 11])
    offsets = torch.tensor([0, 3, 3, 8])  # includes an empty bag and a padding-only-ish bag
    y = q(flat, offsets)
    assert torch.allclose(y, _bag_ref(q, flat, offsets, mode), atol=1e-5)
    tol = 2 * float(q.weight_scale.max()) * (4 if mode == "sum" else 1)
    assert torch.allclose(y, fb(flat, offsets), atol=tol)
    x2 = torch.randint(0, 40, (3, 4))
    assert torch.allclose(q(x2), fb(x2), atol=tol)


def test_embedding_bag_per_sample_weights_include_last_offset_and_state():
    fb = nn.EmbeddingBag(20, 6, mode="sum", include_last_offset=True)
    q = EmbeddingBag.from_float(fb)
    flat, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 5])
    psw = torch.rand(5)
    y = q(flat, offsets, per_sample_weights=psw)
    assert y.shape == (2, 6)
    assert torch.allclose(y, _bag_ref(q, flat, offsets, "sum", psw, True), atol=1e-5)
    assert torch.allclose(y, fb(flat, offsets, per_sample_weights=psw), atol=0.05)
    q2 = EmbeddingBag(20, 6, mode="sum", include_last_offset=True)
    q2.load_state_dict(roundtrip(q))
    assert torch.equal(q2(flat, offsets, psw), y)
    assert "mode='sum'" in repr(q) and "quint8" in repr(q)


def test_embedding_bag_parity_with_torch_ao():
    fb = nn.EmbeddingBag(30, 8, mode="sum")
    fb.qconfig = torch.ao.quantization.float_qparams_weight_only_qconfig
    q_ao = aonnq.EmbeddingBag.from_float(fb)
    q = EmbeddingBag.from_float(fb, dtype=Q.quint8)
    flat, offsets = torch.randint(0, 30, (12,)), torch.tensor([0, 4, 9])
    assert torch.allclose(q(flat, offsets), q_ao(flat, offsets), atol=6 * float(q.weight_scale.max()))


def test_embedding_errors():
    with pytest.raises(ValueError, match="num_embeddings=0"):
        Embedding(0, 4)
    with pytest.raises(ValueError, match="padding_idx=9"):
        Embedding(5, 4, padding_idx=9)
    with pytest.raises(ValueError, match="8-bit or 4-bit"):
        Embedding(5, 4, qdtype=Q.qint32)
    with pytest.raises(ValueError, match="mode='median'"):
        EmbeddingBag(5, 4, mode="median")
    e = Embedding(5, 4)
    with pytest.raises(IndexError, match="index 5 is out of range"):
        e(torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="integer tensor"):
        e(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="weight shape"):
        e.set_weight(torch.randn(3, 4))
    with pytest.raises(TypeError, match="nn.Embedding"):
        Embedding.from_float(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.EmbeddingBag"):
        EmbeddingBag.from_float(nn.Embedding(2, 2))
    b = EmbeddingBag(5, 4, mode="mean")
    with pytest.raises(ValueError, match="per_sample_weights need mode='sum'"):
        b(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(ValueError, match="offsets must be None"):
        b(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="needs 1-D offsets"):
        b(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        b(torch.zeros(1, 1, 1, dtype=torch.long))


@pytest.mark.parametrize("dtype", [Q.qint8, Q.quint4, Q.qint4])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_no_index_at_all_gives_zero_bags_like_torch(dtype, mode):
    fb = nn.EmbeddingBag(10, 5, mode=mode)
    q = EmbeddingBag.from_float(fb, dtype=dtype)
    idx, off = torch.tensor([], dtype=torch.long), torch.tensor([0, 0, 0])
    out = q(idx, off)
    assert out.shape == (3, 5) and torch.equal(out, fb(idx, off).detach())
