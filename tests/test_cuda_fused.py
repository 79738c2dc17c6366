"""The fused CUDA epilogues (``lowbit.kernels.cuda_fused``), checked on CPU: the ``int_mm`` backend's strict (CUDA)
layout is pinned on CPU and the epilogues run as plain torch code (and once through ``torch.compile``), so every
figure below is the one the CUDA path computes, against the torch-op epilogue it replaces."""

from __future__ import annotations

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit.kernels import ConvSpec, OutGrid, cuda_fused, int_mm, reference
from lowbit.nn.quantized.dynamic.per_token import per_token_linear, quantize_per_token

from test_kernels import qinput, qweight

OUTS = [OutGrid(0.05, 100, Q.quint8), OutGrid(0.04, -5, Q.qint8), OutGrid(0.05, 3, Q.quint8.with_range(0, 127))]


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The CUDA route on CPU: strict layout, epilogues on, uncompiled (the same torch code the compiler fuses)."""
    monkeypatch.setattr(int_mm, "STRICT_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(cuda_fused, "enabled", lambda device: True)
    monkeypatch.setattr(cuda_fused, "_COMPILED", {"token_codes": cuda_fused._token_codes,
                                                  "dynamic_epilogue": cuda_fused._dynamic_epilogue,
                                                  "static_float": cuda_fused._static_float,
                                                  "static_codes": cuda_fused._static_codes,
                                                  "requant": cuda_fused._requant})


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (5, 13, 7), (33, 64, 24)])
@pytest.mark.parametrize("xdtype", [Q.quint8, Q.qint8])
@pytest.mark.parametrize("relu", [False, True])
def test_static_epilogue_gives_the_torch_op_codes(fused_on_cpu, monkeypatch, m, k, n, xdtype, relu):
    torch.manual_seed(3)
    x, w, b = qinput(m, k, qdtype=xdtype, zp=9), qweight(n, k, lo=-128, hi=127), torch.randn(n)
    for out in OUTS:
        fused = int_mm.linear(x, w, b, out, relu, cache={})
        floats = int_mm.linear(x, w, None if relu else b, None, relu, cache={})
        monkeypatch.setattr(cuda_fused, "enabled", lambda device: False)
        assert torch.equal(fused.int_repr(), int_mm.linear(x, w, b, out, relu, cache={}).int_repr()), out
        assert fused.int_repr().dtype == out.qdtype.storage and float(fused.scale) == float(torch.tensor(out.scale))
        assert torch.equal(floats, int_mm.linear(x, w, None if relu else b, None, relu, cache={}))
        monkeypatch.setattr(cuda_fused, "enabled", lambda device: True)


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (5, 13, 7), (40, 96, 24)])
def test_dynamic_linear_gives_quantize_per_token_codes_and_outputs(fused_on_cpu, m, k, n):
    torch.manual_seed(4)
    x = torch.randn(m, k) * 3
    x[0, 0] = 0.0
    w, b = qweight(n, k, lo=-127, hi=127), torch.randn(n)
    q, sx, neg_zp = cuda_fused.token_codes(x)
    ref = quantize_per_token(x)
    assert torch.equal(q.to(torch.int16) + 128, ref.int_repr().to(torch.int16))
    assert torch.equal(sx.reshape(-1), ref.scale) and torch.equal(-neg_zp.reshape(-1).long(), ref.zero_point)
    y = int_mm.dynamic_linear(x, w, b, cache={})
    expect = per_token_linear(ref, w, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, expect, rtol=2e-6, atol=2e-5)
    assert int_mm.dynamic_linear(x, w, None, cache={}).sub(expect - b).abs().max() < 2e-5


def test_dynamic_linear_declines_affine_weights_and_nan_rows_stay_nan(fused_on_cpu):
    torch.manual_seed(5)
    x = torch.randn(4, 16)
    assert int_mm.dynamic_linear(x, qweight(8, 16, lo=-128, hi=127, zp=True), None, cache={}) is None
    x[2, 3] = float("nan")
    y = int_mm.dynamic_linear(x, qweight(8, 16), None, cache={})
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()


def test_dynamic_module_routes_through_the_fused_path(fused_on_cpu, monkeypatch):
    lin = torch.nn.Linear(24, 12)
    q = Q.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear})
    x = torch.randn(6, 24)
    want = q(x)  # CPU: the native / oneDNN routes
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type in ("cpu", "cuda")))
    before = K.counts[("int_mm", "linear")]
    got = q(x)
    assert K.counts[("int_mm", "linear")] == before + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_epilogues_equal_the_plain_functions():
    # the one compile per function a CUDA process makes, here on CPU (Inductor's C++ backend): no graph break,
    # dynamic shapes, the plain functions' values
    torch.manual_seed(6)
    x = torch.randn(9, 40) * 2
    plain = cuda_fused.token_codes(x, compiled=False)
    got = cuda_fused.token_codes(x)
    assert got is not None, cuda_fused._FAILED
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
    acc = torch.randint(-5000, 5000, (9, 12), dtype=torch.int32)
    wsum, scale, bias = torch.randint(-900, 900, (12,), dtype=torch.int32), torch.rand(12) * 1e-3, torch.randn(12)
    zx = torch.tensor(-3)
    grid = cuda_fused.grid_tensors(0.05, 100, 0, 255, True, torch.device("cpu"))
    want = cuda_fused.static_codes(acc, zx, wsum, scale, bias, grid, torch.uint8, compiled=False)
    assert torch.equal(cuda_fused.static_codes(acc, zx, wsum, scale, bias, grid, torch.uint8), want)
    assert int(want.min()) >= 100  # ReLU: the low clamp is the zero point


def test_grid_tensors_are_made_once_and_name_the_relu_floor():
    a = cuda_fused.grid_tensors(0.1, -5, -128, 127, True, torch.device("cpu"))
    assert a is cuda_fused.grid_tensors(0.1, -5, -128, 127, True, torch.device("cpu"))
    assert [float(t) for t in a[1:]] == [-5.0, -5.0, 127.0] and float(a[0]) == float(torch.tensor(0.1).reciprocal())
    assert float(cuda_fused.grid_tensors(0.1, -5, -128, 127, False, torch.device("cpu"))[2]) == -128.0


def test_switched_off_by_env_and_on_cpu(monkeypatch):
    assert not cuda_fused.enabled(torch.device("cpu"))
    monkeypatch.setenv("LOWBIT_CUDA_FUSED", "0")
    assert not cuda_fused.enabled(torch.device("cuda"))


@pytest.mark.parametrize("relu", [False, True])
def test_reference_requantize_gives_the_torch_op_codes(fused_on_cpu, monkeypatch, relu):
    torch.manual_seed(7)
    x = Q.quantize_per_tensor(torch.randn(2, 3, 9, 9), 0.05, 120, Q.quint8)
    w, b = qweight(5, 3, 3, 3, lo=-127, hi=127), torch.randn(5)
    spec = ConvSpec(dim=2, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    cache: dict = {}
    for out in OUTS:
        got = reference.conv(x, w, b, spec, out, relu, cache=cache)
        monkeypatch.setattr(cuda_fused, "enabled", lambda device: False)
        want = reference.conv(x, w, b, spec, out, relu)
        monkeypatch.setattr(cuda_fused, "enabled", lambda device: True)
        assert torch.equal(got.int_repr(), want.int_repr()) and got.qdtype == out.qdtype
    assert "reference.float_weight" not in cache  # a CPU weight is the oracle's: no float copy kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_modules_fused_equal_unfused(monkeypatch):
    torch.manual_seed(8)
    x = torch.randn(40, 64)
    lin = torch.nn.Linear(64, 24)
    dyn = Q.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}).cuda()
    xq = Q.quantize_per_tensor(x, 0.03, 120, Q.quint8)
    w = Q.quantize_per_channel(lin.weight.detach(), lin.weight.detach().abs().amax(1) / 127,
                               torch.zeros(24, dtype=torch.long), 0, Q.qint8)
    out = OutGrid(0.05, 100, Q.quint8)
    got_d, got_s = dyn(x.cuda()), K.linear(xq.to("cuda"), w.to("cuda"), lin.bias.detach().cuda(), out, True, cache={})
    assert not cuda_fused._FAILED and cuda_fused.enabled(torch.device("cuda"))
    monkeypatch.setenv("LOWBIT_CUDA_FUSED", "0")
    want_d, want_s = dyn(x.cuda()), K.linear(xq.to("cuda"), w.to("cuda"), lin.bias.detach().cuda(), out, True, cache={})
    torch.testing.assert_close(got_d, want_d, rtol=1e-5, atol=1e-5)
    assert (got_s.int_repr().int() - want_s.int_repr().int()).abs().max() <= 1  # float32 rounding on the GPU
