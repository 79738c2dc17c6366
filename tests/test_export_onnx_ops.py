"""lowbit.export.to_onnx, op by op: every QFunctional op, LUT activations, conv variants, dynamic input
grids, embeddings, and ORT's QDQ nodes against lowbit.fake_quantize (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx
from lowbit.export.qdq import QDQ
from lowbit.nn.quantized import DeQuantize, Embedding, FloatFunctional, Linear

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread, ort_ops, quantized, within_one_quantum  # noqa: E402,F401 (one_thread: autouse fixture)


class Merges(nn.Module):
    """Every QFunctional op and the LUT activations (Sigmoid/Tanh fixed grids, LeakyReLU, ELU, Hardsigmoid)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.mul, self.cat, self.adds, self.muls, self.mm = (FloatFunctional() for _ in range(5))
        self.sig, self.tanh, self.lrelu, self.elu, self.hs = nn.Sigmoid(), nn.Tanh(), nn.LeakyReLU(0.1), nn.ELU(), \
            nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:                                   # (B, 8)
        x = self.quant(x)
        a, b = self.a(x), self.b(x)
        y = self.mul.mul(self.sig(a), self.tanh(b))
        y = self.cat.cat([y, self.lrelu(a), self.elu(b)], dim=1)                          # (B, 24)
        y = self.muls.mul_scalar(self.adds.add_scalar(y, 0.5), -2.0)
        y = self.mm.matmul(y.reshape(-1, 4, 6), y.reshape(-1, 6, 4))                      # (B, 4, 4)
        return self.dequant(self.hs(y))


class Convs(nn.Module):
    """'same' even-kernel reflect padding, a strided ConvTranspose2d, dilation; Conv1d circular + ReLU6."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.quant, self.dequant, self.dim = Q.QuantStub(), Q.DeQuantStub(), dim
        if dim == 2:
            self.c1 = nn.Conv2d(3, 4, 4, padding="same", padding_mode="reflect")
            self.ct = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
            self.c3 = nn.Conv2d(3, 2, 3, dilation=2)
        else:
            self.c1, self.r = nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        return self.dequant(self.c3(self.ct(self.c1(x))) if self.dim == 2 else self.r(self.c1(x)))


def output_quantum(qm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """lowbit's output on ``x`` and the scale of the grid its final DeQuantize received."""
    seen: list[float] = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append(float(a[0].scale)))
             for m in qm.modules() if isinstance(m, DeQuantize)]
    out = qm(x)
    for h in hooks:
        h.remove()
    return out, seen[-1]


# ---- converted models: ORT matches lowbit, on integer kernels ------------------------------------
@pytest.mark.parametrize("make, shape, kernels", [
    (Merges, (16, 8), {"QLinearMul", "QLinearConcat", "QLinearMatMul", "QLinearSigmoid", "QLinearLeakyRelu"}),
    (lambda: Convs(2), (4, 3, 8, 8), {"QLinearConv"}),
    (lambda: Convs(1), (4, 3, 10), {"QLinearConv"}),
])
def test_module_zoo_matches_ort(make, shape, kernels, tmp_path):
    torch.manual_seed(9)
    qm = quantized(make(), [torch.randn(*shape) for _ in range(3)])
    path = to_onnx(qm, torch.randn(2, *shape[1:]), tmp_path / "zoo.onnx")
    x = torch.randn(7, *shape[1:])
    ref, quantum = output_quantum(qm, x)
    out, ops = ort_ops(path, x, tmp_path)
    assert within_one_quantum(out, ref, quantum) >= 0.99
    assert kernels <= ops


class Grids(nn.Module):
    """One QDQ per grid, each fed ``x * scale * 100`` (so every grid clips some values): (G, N) output."""

    def __init__(self, grids: list[tuple[float, int, Q.QDtype]]) -> None:
        super().__init__()
        self.gains = [g[0] * 100 for g in grids]
        self.qdqs = nn.ModuleList(QDQ(*g) for g in grids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([q(x * k) for q, k in zip(self.qdqs, self.gains)])


@st.composite
def grids(draw: st.DrawFn) -> tuple[float, int, Q.QDtype]:
    qdtype = draw(st.sampled_from([Q.qint8, Q.quint8, Q.qint8.with_range(-64, 63), Q.quint8.with_range(0, 127),
                                   Q.qint4, Q.quint4]))
    return draw(st.floats(1e-3, 10.0)), draw(st.integers(qdtype.quant_min, qdtype.quant_max)), qdtype


@settings(max_examples=8, deadline=None)
@given(gs=st.lists(grids(), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_qdq_nodes_are_lowbit_fake_quantize(gs, seed, tmp_path_factory):
    """ORT's QuantizeLinear -> DequantizeLinear (+ Clip for narrow grids) = lowbit.fake_quantize, within a code."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(seed))
    model = Grids(gs)
    out = run_onnx(to_onnx(model, x[:2], tmp_path_factory.mktemp("qdq") / "qdq.onnx"), x)[0]   # (G, 512)
    for row, (scale, zp, d), k in zip(out, gs, model.gains):
        ref = Q.fake_quantize(x * k, scale, zp, d.quant_min, d.quant_max)
        assert ((row - ref).abs() <= torch.tensor(scale, dtype=torch.float32) * 1.0001).all()
        assert (row == ref).double().mean() >= 0.99          # x / s (ONNX) vs x * (1 / s) (lowbit) differ at ties


def test_dynamic_input_grid_uses_dynamic_quantize_linear(tmp_path):
    torch.manual_seed(10)
    lin = nn.Linear(8, 4)
    qlin = Linear.from_reference(lin, Q.quantize_per_channel(lin.weight.detach(), lin.weight.detach().abs().amax(1) / 127,
                                                             torch.zeros(4, dtype=torch.long), 0, Q.qint8), 0.02, 128)
    assert qlin.input_grid is None                        # float input -> per-call quint8 grid
    path = to_onnx(nn.Sequential(qlin, DeQuantize()), torch.randn(2, 8), tmp_path / "dyn.onnx")
    assert "DynamicQuantizeLinear" in {n.op_type for n in onnx.load(str(path)).graph.node}
    x = torch.randn(30, 8)
    assert within_one_quantum(run_onnx(path, x)[0], qlin(x).dequantize(), 0.02) >= 0.99


def test_embedding_table_is_int8_gather(tmp_path):
    emb = Embedding.from_float(nn.Embedding(50, 6))
    path = to_onnx(nn.Sequential(emb), torch.tensor([[1, 2, 3]]), tmp_path / "emb.onnx")
    idx = torch.randint(0, 50, (4, 3))
    assert torch.equal(run_onnx(path, idx)[0], emb(idx))
    assert {t.data_type for t in onnx.load(str(path)).graph.initializer if len(t.dims) == 2} == {onnx.TensorProto.UINT8}
