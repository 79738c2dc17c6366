"""lowbit.kernels: every fast backend against the float reference and an exact integer oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q
from lowbit import kernels as K
from lowbit.kernels import ConvSpec, OutGrid, int_mm, onednn, reference

torch.set_num_threads(1)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# On CPUs without VNNI, oneDNN's u8×s8 pairs saturate in int16 unless weights are 7-bit; there the
# tests that must take the oneDNN path use 7-bit weights (every int8 weight on VNNI/AMX CPUs).
WMAX = 127 if onednn.has_vnni() else 63


def qweight(n: int, *rest: int, lo: int = -WMAX, hi: int = WMAX, zp: bool = False, axis: int = 0,
            device: str = "cpu") -> Q.QTensor:
    shape = (n, *rest)
    c = shape[axis]
    codes = torch.randint(lo, hi + 1, shape, dtype=torch.int8)
    zps = torch.randint(-3, 4, (c,)) if zp else torch.zeros(c, dtype=torch.int64)
    return Q.QTensor(codes.to(device), (torch.rand(c) * 0.01 + 0.001).to(device), zps.to(device), Q.qint8, axis)


def qinput(*shape: int, qdtype: Q.QDtype = Q.quint8, zp: int = 120, device: str = "cpu") -> Q.QTensor:
    info = torch.iinfo(qdtype.storage)
    codes = torch.randint(info.min, info.max + 1, shape, dtype=qdtype.storage)
    return Q.QTensor(codes.to(device), 0.03, zp, qdtype)


def exact_linear(x: Q.QTensor, w: Q.QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 of the exact int64 accumulator: Σ (q_x - z_x)(q_w - z_w) · s_x s_w + b."""
    acc = (x.int_repr().long() - x.zero_point) @ (w.int_repr().long() - w.zero_point[:, None]).t()
    y = acc.double() * (x.scale.double() * w.scale.double())
    return y if bias is None else y + bias.double()


def codes_close(a: Q.QTensor, b: Q.QTensor, tol: int = 1) -> None:
    assert a.qdtype == b.qdtype and a.shape == b.shape
    assert float(a.scale) == float(b.scale) and int(a.zero_point) == int(b.zero_point)
    diff = (a.int_repr().int() - b.int_repr().int()).abs()
    assert int(diff.max()) <= tol, f"max code difference {int(diff.max())}"


OUTS = [OutGrid(0.05, 100, Q.quint8), OutGrid(0.04, -5, Q.qint8), OutGrid(0.05, 3, Q.quint8.with_range(0, 127))]


@pytest.mark.parametrize("backend", ["onednn", "int_mm"])
@pytest.mark.parametrize("xdtype", [Q.quint8, Q.qint8])
@pytest.mark.parametrize("out", OUTS + [None], ids=["u8", "s8", "u7", "float"])
@pytest.mark.parametrize("relu", [False, True])
def test_linear_backend_matches_reference(backend: str, xdtype: Q.QDtype, out: OutGrid | None, relu: bool) -> None:
    torch.manual_seed(0)
    x, w, b = qinput(3, 7, 40, qdtype=xdtype, zp=120 if xdtype is Q.quint8 else -7), qweight(24, 40), torch.randn(24)
    before = K.counts[(backend, "linear")]
    with K.use_backend(backend):
        y = K.linear(x, w, b, out, relu, cache={})
    assert K.counts[(backend, "linear")] == before + 1  # the integer path ran, not a fallback
    ref = reference.linear(x, w, b, out, relu)
    if out is None:
        exact = exact_linear(x, w, b)
        exact = exact.relu() if relu else exact
        assert y.shape == (3, 7, 24) and torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-4)
    else:
        codes_close(y, ref)
        assert y.int_repr().min() >= out.qdtype.quant_min and y.int_repr().max() <= out.qdtype.quant_max


def test_int_mm_exact_with_weight_zero_points() -> None:
    torch.manual_seed(1)
    x, w, b = qinput(9, 33), qweight(5, 33, lo=-128, hi=127, zp=True), torch.randn(5)
    y = int_mm.linear(x, w, b, None)
    assert torch.allclose(y.double(), exact_linear(x, w, b), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (5, 13, 7), (33, 64, 24)])
def test_cpu_int_mm_without_u8_support_gives_the_same_sums(monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int) -> None:
    # torch 2.11's CPU _int_mm rejects uint8 activations (seen on the H200 machine's torch): u8 - 128 as int8, + 128 Σw
    torch.manual_seed(2)
    q, w = torch.randint(0, 256, (m, k), dtype=torch.uint8), torch.randint(-128, 128, (n, k), dtype=torch.int8)
    exact = q.long() @ w.long().t()
    monkeypatch.setattr(int_mm, "_U8", [False])
    got = int_mm.cpu_int_mm(q, w.t(), w.to(torch.int32).sum(1))
    assert got.dtype == torch.int32 and torch.equal(got.long(), exact)
    x, wq = qinput(m, k, zp=9), qweight(n, k, lo=-128, hi=127, zp=True)
    shifted = int_mm.linear(x, wq, None, None)
    monkeypatch.setattr(int_mm, "_U8", [True])
    assert torch.equal(shifted, int_mm.linear(x, wq, None, None))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 70), n=st.integers(1, 20), zx=st.integers(0, 255),
       seed=st.integers(0, 2**16))
def test_int_mm_accumulator_is_exact(m: int, k: int, n: int, zx: int, seed: int) -> None:
    torch.manual_seed(seed)
    x, w = qinput(m, k, zp=zx), qweight(n, k, lo=-128, hi=127, zp=True)
    y = int_mm.linear(x, w, None, None)
    assert torch.allclose(y.double(), exact_linear(x, w, None), rtol=1e-6, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 70), n=st.integers(1, 20), zx=st.integers(0, 255),
       wmax=st.sampled_from([63, 127]), seed=st.integers(0, 2**16))
def test_onednn_linear_accumulator_is_exact(m: int, k: int, n: int, zx: int, wmax: int, seed: int) -> None:
    # full-range weights take the single-call path on VNNI CPUs and the exact split path elsewhere
    torch.manual_seed(seed)
    x, w, b = qinput(m, k, zp=zx), qweight(n, k, lo=-wmax - 1, hi=wmax), torch.randn(n)
    y = onednn.linear(x, w, b, None, cache={})
    assert torch.allclose(y.double(), exact_linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_onednn_declines_what_it_cannot_do_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    x = qinput(4, 16)
    affine = qweight(8, 16, zp=True)
    affine._zero_point[0] = 1  # ensure a non-zero weight zero point: oneDNN would ignore it
    assert onednn.linear(x, affine, None, None, cache={}) is NotImplemented
    before = K.counts[("int_mm", "linear")]
    y = K.linear(x, affine, None, None, cache={})  # automatic chain: onednn declines -> int_mm
    assert K.counts[("int_mm", "linear")] == before + 1
    assert torch.allclose(y.double(), exact_linear(x, affine, None), rtol=1e-6, atol=1e-5)
    assert onednn.linear(Q.QTensor(x.int_repr().to("meta"), 0.1, 0, Q.quint8), qweight(8, 16), None, None) \
        is NotImplemented


@pytest.mark.parametrize("out", [None, OUTS[0]], ids=["float", "u8"])
def test_linear_split_path_is_exact_for_full_int8_weights(monkeypatch: pytest.MonkeyPatch, out: OutGrid) -> None:
    # what a CPU without VNNI runs for weights that would saturate vpmaddubsw: two 7-bit GEMMs
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    torch.manual_seed(2)
    x, b, cache = qinput(5, 3, 16, zp=131), torch.randn(8), {}
    full = qweight(8, 16, lo=-128, hi=127)
    full._q[:, :2] = 127  # a pair that saturates vpmaddubsw: 255 * 254 > 32767
    assert not onednn.saturation_safe(full.int_repr())
    y = onednn.linear(x, full, b, out, True, cache=cache)
    assert cache["onednn.linear"][1][1] is True  # the split path was chosen
    if out is None:
        assert torch.allclose(y.double(), exact_linear(x, full, b).relu(), rtol=1e-5, atol=1e-4)
    else:
        codes_close(y, reference.linear(x, full, b, out, True))


def test_saturation_safe_bound() -> None:
    assert onednn.saturation_safe(torch.tensor([[64, 64, -64, -64, 0]], dtype=torch.int8))
    assert not onednn.saturation_safe(torch.tensor([[65, 64, 0]], dtype=torch.int8))
    assert not onednn.saturation_safe(torch.tensor([[-65, -64, 127]], dtype=torch.int8))
    assert onednn.saturation_safe(torch.tensor([[-128, 127, 1]], dtype=torch.int8))


def test_onednn_packs_once_and_repacks_after_weight_change() -> None:
    torch.manual_seed(3)
    x, w, cache = qinput(2, 16), qweight(4, 16), {}
    with K.use_backend("onednn"):
        K.linear(x, w, None, None, cache=cache)
        packed = cache["onednn.linear"][1]
        assert packed is not None
        K.linear(x, w, None, None, cache=cache)
        assert cache["onednn.linear"][1] is packed  # no repacking per call
        w.int_repr().neg_()  # in-place change: the version moves, the cache repacks
        y = K.linear(x, w, None, None, cache=cache)
    assert cache["onednn.linear"][1] is not packed
    assert torch.allclose(y.double(), exact_linear(x, w, None), rtol=1e-5, atol=1e-5)


CONV_CASES = [  # (dim, x shape, weight shape, stride, padding, dilation, groups)
    (1, (2, 6, 11), (4, 6, 3), (1,), (1,), (1,), 1),
    (2, (2, 8, 9, 7), (6, 4, 3, 3), (2, 1), (1, 0), (1, 2), 2),
    (2, (1, 3, 8, 8), (5, 3, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    (3, (1, 4, 5, 6, 4), (4, 4, 3, 2, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=["1d", "2d-groups", "2d-1x1", "3d"])
@pytest.mark.parametrize("xdtype", [Q.quint8, Q.qint8])
@pytest.mark.parametrize("out", [OUTS[0], OUTS[1], None], ids=["u8", "s8", "float"])
def test_conv_onednn_matches_reference(case: tuple, xdtype: Q.QDtype, out: OutGrid | None) -> None:
    torch.manual_seed(4)
    dim, xs, ws, stride, padding, dilation, groups = case
    x, w, b = qinput(*xs, qdtype=xdtype, zp=17 if xdtype is Q.quint8 else 3), qweight(*ws), torch.randn(ws[0])
    spec = ConvSpec(dim, stride, padding, dilation, groups)
    before = K.counts[("onednn", "conv")]
    y = K.conv(x, w, b, spec, out, relu=True, cache={})
    assert K.counts[("onednn", "conv")] == before + 1
    ref = reference.conv(x, w, b, spec, out, relu=True)
    if out is None:
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3)
    else:
        codes_close(y, ref)


@pytest.mark.parametrize("zp", [0, 128, 77])
def test_conv_split_path_is_exact_for_full_int8_weights(monkeypatch: pytest.MonkeyPatch, zp: int) -> None:
    # what a CPU without VNNI runs for weights that would saturate vpmaddubsw: two 7-bit convs
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    torch.manual_seed(8)
    x = Q.QTensor(torch.randint(0, 256, (2, 8, 7, 7), dtype=torch.uint8), 0.02, zp, Q.quint8)
    w = qweight(6, 4, 3, 3, lo=-128, hi=127)
    w._q[:, :2] = 127  # guarantee saturating pairs
    b, spec, cache = torch.randn(6), ConvSpec(2, (1, 1), (1, 1), (1, 1), 2), {}
    y = onednn.conv(x, w, b, spec, None, cache=cache)
    assert cache["onednn.conv"][1][1] is True  # the split path was chosen
    acc = F.conv2d(x.int_repr().double() - zp, w.int_repr().double(), None, 1, 1, 1, 2)
    exact = acc * (0.02 * w.scale.double()).reshape(1, -1, 1, 1) + b.double().reshape(1, -1, 1, 1)
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-4)
    codes_close(onednn.conv(x, w, b, spec, OUTS[0], True, cache), reference.conv(x, w, b, spec, OUTS[0], True))


def test_conv_prepack_ignores_input_qparams() -> None:
    # onednn.conv prepacks with x_scale=1, x_zp=0; the packed weight must serve any input grid
    torch.manual_seed(5)
    w, cache, spec = qweight(4, 3, 3, 3), {}, ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    for zp, scale in [(0, 0.1), (200, 0.01), (77, 1.0)]:
        x = Q.QTensor(torch.randint(0, 256, (1, 3, 6, 6), dtype=torch.uint8), scale, zp, Q.quint8)
        assert torch.allclose(onednn.conv(x, w, None, spec, None, cache=cache), reference.conv(x, w, None, spec, None),
                              rtol=1e-4, atol=1e-4)


def test_transposed_conv_runs_on_onednn() -> None:
    # session 38: a transposed conv runs as one ordinary int8 conv (kernels/conv_transpose.py), no longer the reference
    torch.manual_seed(6)
    x, w = qinput(1, 4, 5, 5), qweight(4, 3, 3, 3, axis=1)
    spec = ConvSpec(2, (2, 2), (1, 1), (1, 1), 1, True, (1, 1))
    before = K.counts[("onednn", "conv_transpose")]
    y = K.conv(x, w, None, spec, OUTS[0])
    assert K.counts[("onednn", "conv_transpose")] == before + (1 if onednn.available() else 0)
    assert y.shape == (1, 3, 10, 10)
    with K.use_backend("reference"):
        ref = K.conv(x, w, None, spec, OUTS[0])
    assert (y.int_repr().int() - ref.int_repr().int()).abs().max() <= 1


def test_backend_override() -> None:
    assert K.get_backend() is None
    assert [b.NAME for b in K.backend_chain(torch.device("cpu"))] == ["onednn", "int_mm", "reference"]
    assert [b.NAME for b in K.backend_chain(torch.device("cuda"))] == ["int_mm", "reference"]
    with K.use_backend("reference"):
        assert K.get_backend() == "reference"
        assert [b.NAME for b in K.backend_chain(torch.device("cpu"))] == ["reference"]
        with K.use_backend("int_mm"):
            assert [b.NAME for b in K.backend_chain(torch.device("cpu"))] == ["int_mm", "onednn", "reference"]
        before = K.counts[("reference", "linear")]
        K.linear(qinput(2, 8), qweight(3, 8))
        assert K.counts[("reference", "linear")] == before + 1
    assert K.get_backend() is None
    K.set_backend("int_mm")
    try:
        assert K.get_backend() == "int_mm"
    finally:
        K.set_backend(None)
    with pytest.raises(ValueError, match="'cublas'"):
        K.set_backend("cublas")
    with pytest.raises(ValueError, match="'fast'"):
        with K.use_backend("fast"):
            pass


def test_bad_inputs() -> None:
    w = qweight(3, 8)
    with pytest.raises(TypeError, match="QTensor"):
        K.linear(torch.randn(2, 8), w)  # type: ignore[arg-type]
    per_channel = Q.quantize_per_channel(torch.randn(2, 8), torch.ones(2), torch.zeros(2, dtype=torch.long), 0, Q.qint8)
    with pytest.raises(ValueError, match="per tensor"):
        K.linear(per_channel, w)
    with pytest.raises(TypeError, match="int8 codes"):
        K.linear(qinput(2, 8), torch.randn(3, 8))  # type: ignore[arg-type]


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (5, 13, 7), (33, 64, 24)])
@pytest.mark.parametrize("xdtype", [Q.quint8, Q.qint8])
def test_int_mm_strict_layout_path(monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int, xdtype: Q.QDtype) -> None:
    # the CUDA code path (s8 activations, M padded past 16, K and N padded to multiples of 8), run on CPU
    torch.manual_seed(9)
    x, w, b = qinput(m, k, qdtype=xdtype, zp=9), qweight(n, k, lo=-128, hi=127, zp=True), torch.randn(n)
    loose = int_mm.linear(x, w, b, None, cache={})
    monkeypatch.setattr(int_mm, "STRICT_DEVICES", {"cpu", "cuda"})
    cache: dict = {}
    strict = int_mm.linear(x, w, b, None, cache=cache)
    assert cache["int_mm.linear"][1][0].shape == (-(-k // 8) * 8, -(-n // 8) * 8)
    assert torch.allclose(strict.double(), exact_linear(x, w, b), rtol=1e-6, atol=1e-5)
    assert torch.allclose(strict, loose, rtol=1e-6, atol=1e-5)


@CUDA
@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (5, 13, 7), (33, 64, 24)])
@pytest.mark.parametrize("xdtype", [Q.quint8, Q.qint8])
def test_int_mm_cuda_matches_cpu(m: int, k: int, n: int, xdtype: Q.QDtype) -> None:
    torch.manual_seed(7)
    x, w, b = qinput(m, k, qdtype=xdtype, zp=9), qweight(n, k, lo=-128, hi=127, zp=True), torch.randn(n)
    out = OUTS[0]
    y_cpu = int_mm.linear(x, w, b, out, True)
    xc, wc = x.to("cuda"), w.to("cuda")
    before = K.counts[("int_mm", "linear")]
    y_gpu = K.linear(xc, wc, b.cuda(), out, True, cache={})
    assert K.counts[("int_mm", "linear")] == before + 1 and y_gpu.device.type == "cuda"
    codes_close(y_gpu.cpu(), y_cpu)
    f_gpu = K.linear(xc, wc, b.cuda(), None, cache={})
    assert torch.allclose(f_gpu.cpu().double(), exact_linear(x, w, b), rtol=1e-5, atol=1e-4)
