"""fuse_dequantize / LinearFloatOut: int8 Linears read only by float ops return float, on every backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit import kernels
from lowbit.nn.quantized.linear_float_out import LinearFloatOut


class Block(nn.Module):
    """Linear -> residual add -> LayerNorm (float consumers), and Linear -> Linear (an int consumer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.norm(x + self.a(x))          # a: float consumers only
        return self.c(self.b(h))              # b feeds c (int8 in): stays requantized; c feeds the output


def _converted():
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        model.a.weight[3] *= 40               # an outlier output channel, as BERT's FFN down projections
    calib = torch.randn(64, 16)
    prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(calib,))
    prepared(calib)
    return model, Q.convert_fx(prepared)


@pytest.mark.parametrize("backend", ["reference", "onednn"])
def test_float_outputs_where_only_float_ops_read_and_error_drops(backend):
    model, qmodel = _converted()
    x = torch.randn(32, 16)
    with kernels.use_backend(backend):
        before = qmodel(x)
        swapped = Q.fuse_dequantize(qmodel)
        after = qmodel(x)
    assert swapped == ["a", "c"]
    assert isinstance(qmodel.a, LinearFloatOut) and type(qmodel.b) is nnq.Linear
    ref = model(x)
    err_before, err_after = (before - ref).norm() / ref.norm(), (after - ref).norm() / ref.norm()
    assert err_after < 0.5 * err_before, (err_before, err_after)
    assert Q.fuse_dequantize(qmodel) == []   # idempotent


def test_linear_float_out_equals_the_unrounded_epilogue():
    _, qmodel = _converted()
    lin = qmodel.b
    x = Q.quantize_per_tensor(torch.randn(8, 16), 0.05, 128, Q.quint8)
    with kernels.use_backend("reference"):
        y = LinearFloatOut.from_linear(lin)(x)
        exact = x.dequantize() @ lin.weight().dequantize().T + lin.bias
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5)
        q = lin(x).dequantize()                 # the int8-output twin is y rounded onto its grid (clamped)
        s, z = float(lin.scale), int(lin.zero_point)
        y_on_grid = y.clamp((0 - z) * s, (255 - z) * s)
        assert float((q - y_on_grid).abs().max()) <= s / 2 + 1e-5
    twin = LinearFloatOut.from_linear(lin)
    fresh = LinearFloatOut(16, 16)
    fresh.load_state_dict(twin.state_dict())
    torch.testing.assert_close(fresh(x), twin(x))


def test_bad_input():
    with pytest.raises(TypeError, match="got Linear"):
        LinearFloatOut.from_linear(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="must be an nn.Module"):
        Q.fuse_dequantize("model")
    assert Q.fuse_dequantize(nn.Linear(2, 2)) == []   # no graph: nothing to do


def test_onnx_export_has_no_output_rounding(tmp_path):
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx

    _, qmodel = _converted()
    x = torch.randn(16, 16)
    with kernels.use_backend("reference"):
        rounded = qmodel(x)
        Q.fuse_dequantize(qmodel)
        expected = qmodel(x)
    got = run_onnx(to_onnx(qmodel, (x,), tmp_path / "m.onnx"), x)[0]
    err, err_rounded = float((got - expected).abs().max()), float((rounded - expected).abs().max())
    assert err < 0.2 * err_rounded, (err, err_rounded)   # the file follows the float-output model
