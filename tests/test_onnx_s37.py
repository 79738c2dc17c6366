"""ONNX export cases a session-37 probe found failing or silently wrong in ONNX Runtime (each failed before its fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread, within_one_quantum  # noqa: E402

_ = one_thread


def _convert(model: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    model = model.eval()
    model.qconfig = Q.get_default_qconfig()
    p = Q.prepare(model)
    with torch.no_grad():
        for b in batches:
            p(b)
    return Q.convert(p)


class _Dequantizes(nn.Module):
    """Returns the conv's QTensor and its own ``.dequantize()`` of it, scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.conv = Q.QuantStub(), nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(self.quant(x))
        return y, y.dequantize() * 2


def test_model_calling_dequantize_on_its_qtensor_exports(tmp_path):
    # the twin's value is a float tensor there, and torch's aten::dequantize symbolic expects a torch quantized
    # tensor: to_onnx failed deep in the TorchScript exporter ("expected ... to be a quantized tensor")
    from torch.onnx._internal.torchscript_exporter import registration, symbolic_opset10

    torch.manual_seed(0)
    q = _convert(_Dequantizes(), [torch.randn(4, 3, 8, 8) for _ in range(2)])
    path = to_onnx(q, torch.randn(2, 3, 8, 8), tmp_path / "m.onnx")
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        y, y2 = q(x)
    got = run_onnx(path, x)
    assert torch.equal(got[0], y.dequantize()) and torch.equal(got[1], y2)
    # the export's override is gone: torch's own symbolic is back for other exports
    assert registration.registry.get_function_group("aten::dequantize").get(17) is symbolic_opset10.dequantize


class _SizedTranspose(nn.Module):
    def __init__(self, size: list[int]) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.ct, self.size = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.ct(self.quant(x), output_size=self.size))


@pytest.mark.parametrize("size", [[12, 11], [2, 4, 11, 12]])
def test_conv_transpose_called_with_output_size_exports(tmp_path, size):
    # lowbit's ConvTranspose takes torch's output_size; its export twin did not (TypeError: unexpected keyword)
    torch.manual_seed(1)
    q = _convert(_SizedTranspose(size), [torch.randn(4, 3, 6, 6) for _ in range(2)])
    x = torch.randn(2, 3, 6, 6)
    path = to_onnx(q, x, tmp_path / "m.onnx")
    with torch.no_grad():
        ref = q(x)
    got = run_onnx(path, x)[0]
    assert got.shape == ref.shape == (2, 4, *size[-2:])
    assert within_one_quantum(got, ref, float(q.ct.scale)) == 1.0
    assert (got == ref).double().mean() > 0.95


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_unbatched_padded_conv1d_runs_in_ort(tmp_path, mode):
    # an unbatched (C, L) input: the twin's explicit circular Pad was exported on a rank-2 tensor with axis-2 Slices,
    # which ONNX Runtime refused to load ("Unexpected axis value: 2")
    torch.manual_seed(2)
    seq = nn.Sequential(Q.QuantStub(), nn.Conv1d(3, 4, 3, padding=2, padding_mode=mode), Q.DeQuantStub())
    q = _convert(seq, [torch.randn(3, 9) for _ in range(3)])
    x = torch.randn(3, 9)
    path = to_onnx(q, x, tmp_path / "m.onnx", dynamic_batch=False)
    with torch.no_grad():
        ref = q(x)
    got = run_onnx(path, x)[0]
    assert got.shape == ref.shape == (4, 11)
    assert within_one_quantum(got, ref, float(q[1].scale)) == 1.0


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_dynamic_rnn_runs_a_zero_size_batch_in_ort(tmp_path, cls):
    # the gate GEMMs' (T·B, G·H) -> (T, B, G·H) Reshape had target (T, 0, G·H): ONNX's default reads that 0 as "copy
    # the input's dim", so ORT failed on an empty batch ("cannot be reshaped to the requested shape {5,48,48}")
    torch.manual_seed(3)

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cls(8, 16, batch_first=True, bidirectional=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    q = Q.quantize_dynamic(Seq().eval(), {cls})
    path = to_onnx(q, torch.randn(2, 5, 8), tmp_path / "m.onnx")
    for x in (torch.randn(0, 5, 8), torch.randn(3, 5, 8)):
        with torch.no_grad():
            ref = q(x)
        got = run_onnx(path, x)[0]
        assert got.shape == ref.shape == (x.shape[0], 5, 32)
        assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("qconfig", [Q.get_dynamic_qconfig(backend="x86"), Q.get_dynamic_qconfig(reduce_range=True)])
def test_seven_bit_dynamic_linear_refusal_names_the_layer(tmp_path, qconfig):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).eval()
    q = Q.quantize_dynamic(model, {nn.Linear: qconfig})
    with pytest.raises(ValueError, match=r"7-bit recipe.*get_dynamic_qconfig\(\).*module '0'"):
        to_onnx(q, torch.randn(2, 8), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
