"""ONNX export cases a session-36 probe found silently wrong in ONNX Runtime (each failed before its fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx
from onnx_helpers import one_thread, within_one_quantum

_ = one_thread


def _static(layers: list[nn.Module], calib: torch.Tensor, fuse: list[list[str]] | None = None) -> nn.Module:
    m = nn.Sequential(Q.QuantStub(), *layers, Q.DeQuantStub()).eval()
    if fuse:
        m = Q.fuse_modules(m, fuse)
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    with torch.no_grad():
        p(calib)
    return Q.convert(p)


@pytest.mark.parametrize("calib", ["zeros", "tiny"])
@pytest.mark.parametrize("relu", [False, True])
def test_linear_bias_off_the_int32_grid_survives_ort(tmp_path, calib, relu):
    # calibrated on all-zero (scale 1e-8) or 1e-10-sized inputs, bias / (s_x s_w) does not fit int32 and the bias
    # stays float: ORT fused MatMul + Add into a Gemm and WeightBiasQuantization put that bias on the int32 grid
    # anyway -> the bias was lost (every output at the bottom of its grid, 0.24 off on outputs of 0.24)
    torch.manual_seed(0)
    x = torch.zeros(4, 8) if calib == "zeros" else torch.randn(4, 8) * 1e-10
    lin = nn.Linear(8, 4)
    with torch.no_grad():
        lin.bias.copy_(torch.tensor([-0.3, 0.1, 0.25, 0.4]))  # positive ones survive the ReLU
    layers: list[nn.Module] = [lin] + ([nn.ReLU()] if relu else [])
    q = _static(layers, x, [["1", "2"]] if relu else None)
    path = to_onnx(q, x, tmp_path / "m.onnx")
    with torch.no_grad():
        ref = q(x)
    got = run_onnx(path, x)[0]
    assert within_one_quantum(got, ref, float(q[1].scale)) == 1.0, (got, ref)
    assert ref.abs().max() > 5 * float(q[1].scale)  # the bias carries the output: a lost bias would show


def test_linear_bias_off_the_int32_grid_on_3d_inputs(tmp_path):
    torch.manual_seed(1)
    x = torch.zeros(2, 3, 8)
    q = _static([nn.Linear(8, 5)], x)
    path = to_onnx(q, x, tmp_path / "m.onnx")
    with torch.no_grad():
        ref = q(x)
    assert within_one_quantum(run_onnx(path, x)[0], ref, float(q[1].scale)) == 1.0
