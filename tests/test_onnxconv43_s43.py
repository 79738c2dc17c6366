"""Session 43: ``to_onnx(exact=True)``'s float-sum convs with fewer ops, codes unchanged.

Before, every exact Conv / ConvTranspose summing float32 codes was written ``Cast -> Sub(z) -> Conv -> Cast(int32)
-> Cast(float) -> Mul(s_x s_w) -> ...``: the ``Sub`` even where ``z = 0`` and the int32 round trip only to keep ORT's
ConvMulFusion from folding the scale into the weights. Now an unpadded conv takes ``-z Σ w`` as its bias (integers
below 2**24: exact), ``z = 0`` drops the ``Sub``, and the scale is the ``Mul``'s first input (the fusion matches
``Mul(conv, constant)`` only; the product commutes). SmallCNN 65 -> 57 nodes, a MobileNetV2 (width 0.5) 623 -> 469.
The structure tests failed before; the code tests hold ORT's codes to lowbit's eager ones on every output.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx
from lowbit.export.exact import _zero_point_bias

pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread  # noqa: E402

_ = one_thread


class Net(nn.Module):
    """Quantize (z != 0) -> padded 3x3 conv (keeps its Sub) -> ReLU -> padded depthwise (z = 0) -> 1x1 conv (z = 0,
    no ReLU: z != 0 after) -> unpadded strided 2x2 conv (z != 0: the bias fold) -> Linear; every result is an output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.quant = Q.QuantStub()
        self.c1, self.r1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.dw, self.r2 = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU()
        self.pw = nn.Conv2d(16, 8, 1)
        self.down = nn.Conv2d(8, 8, 2, stride=2, bias=False)
        self.fc = nn.Linear(8 * 5 * 5, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = self.r1(self.c1(self.quant(x)))
        b = self.r2(self.dw(a))
        c = self.pw(b)
        d = self.down(c)
        return tuple(t.dequantize() for t in (a, b, c, d, self.fc(d.flatten(1))))


def _net(qdtype: Q.QDtype = Q.quint8) -> nn.Module:
    model = Q.fuse_modules(Net().eval(), [["c1", "r1"], ["dw", "r2"]])
    model.qconfig = Q.QConfig(Q.MinMaxObserver.with_args(qdtype=qdtype), Q.get_default_qconfig().weight)
    p = Q.prepare(model)
    with torch.no_grad():
        p(torch.randn(16, 3, 10, 10, generator=torch.Generator().manual_seed(1)) + 0.7)  # asymmetric: z != 0
    return Q.convert(p)


def _inputs() -> torch.Tensor:
    """Random inputs and the extremes (every code at the grid's ends: the largest partial sums)."""
    x = torch.randn(62, 3, 10, 10, generator=torch.Generator().manual_seed(5)) * 2
    return torch.cat([x, torch.full((1, 3, 10, 10), 1e3), torch.full((1, 3, 10, 10), -1e3)])


def _export(q: nn.Module, x: torch.Tensor, path) -> onnx.GraphProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(q, x[:2], path, exact=True)
    return onnx.load(str(path)).graph


def _codes(y: torch.Tensor, mod: nn.Module) -> torch.Tensor:
    return torch.round(y / float(mod.scale)).to(torch.int64) + int(mod.zero_point)


def _assert_codes_equal(q: nn.Module, x: torch.Tensor, path, mods: list[nn.Module]) -> None:
    got = run_onnx(path, x)
    with torch.no_grad():
        want = q(x)
    for mod, g, w in zip(mods, got, want):
        assert torch.equal(_codes(g, mod), _codes(w, mod)), mod


@pytest.mark.parametrize("qdtype", [Q.quint8, Q.qint8])
def test_conv_variants_codes_equal_lowbit(tmp_path, qdtype) -> None:
    # padded conv on z != 0 (Sub kept), depthwise and 1x1 on z = 0 (no Sub), unpadded conv on z != 0 (bias fold),
    # Linear (MatMulInteger); u8 and int8 activations
    q = _net(qdtype)
    assert int(q.quant.zero_point) != 0 and int(q.pw.zero_point) != 0 and int(q.c1.zero_point) == (
        0 if qdtype == Q.quint8 else -128)
    _export(q, _inputs(), tmp_path / "n.onnx")
    _assert_codes_equal(q, _inputs(), tmp_path / "n.onnx", [q.c1, q.dw, q.pw, q.down, q.fc])


def test_conv_chain_ops(tmp_path) -> None:
    # before: every Conv read Sub(z) (Sub(0.0) too) and fed Cast(int32) -> Cast(float) -> Mul
    q = _net()
    g = _export(q, _inputs(), tmp_path / "n.onnx")
    producer = {o: n for n in g.node for o in n.output}
    convs = [n for n in g.node if n.op_type == "Conv"]
    assert len(convs) == 4
    for n in convs:
        readers = [r.op_type for r in g.node if n.output[0] in r.input]
        assert readers == ["Mul"], readers
    c1, dw, pw, down = convs
    assert producer[c1.input[0]].op_type == "Sub" and len(c1.input) == 2  # padded, z != 0: the border is z's code
    assert all(producer[n.input[0]].op_type != "Sub" for n in (dw, pw, down))
    assert len(down.input) == 3  # -z Σ w as the bias
    bias = onnx.numpy_helper.to_array(next(t for t in g.initializer if t.name == down.input[2]))
    w = q.down.weight_int8.to(torch.int64).reshape(8, -1).sum(1)
    assert bias.tolist() == (-int(q.pw.zero_point) * w).float().tolist()


def test_ort_keeps_integer_weights(tmp_path) -> None:
    # ORT's optimized graph: the summing Convs keep the integer weights (ConvMulFusion did not fold the scale in)
    q = _net()
    x = _inputs()
    _export(q, x, tmp_path / "n.onnx")
    opt = tmp_path / "opt.onnx"
    run_onnx(tmp_path / "n.onnx", x, optimized_model_path=str(opt))
    g = onnx.load(str(opt)).graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    weights = [inits[n.input[1]] for n in g.node if n.op_type == "Conv" and n.input[1] in inits]
    summing = [w for w in weights if w.shape[1:] != (1, 1, 1)]  # (NCHWc writes a per-channel Mul as a 1x1 conv)
    assert len(summing) == 4 and all((w == w.round()).all() for w in summing)


def test_fold_refused_past_2_24_stays_exact(tmp_path) -> None:
    # (|z| + 255) Σ|w| >= 2**24 > 255 Σ|w|: a bias + partial sum could pass 2**24, so the Sub stays
    torch.manual_seed(3)
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(32, 4, 3), Q.DeQuantStub()).eval()
    with torch.no_grad():
        m[1].weight.copy_(torch.randint(0, 2, m[1].weight.shape).float() * 2 - 1)  # every code ±127
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    with torch.no_grad():
        p(torch.rand(8, 32, 6, 6) * 3 - 2.7)
    q = Q.convert(p)
    with torch.no_grad():
        q[0].scale.fill_(0.01)
        q[0].zero_point.fill_(230)
    assert 255 * 288 * 127 < 2**24 <= (230 + 255) * 288 * 127
    assert _zero_point_bias(q[1].weight_int8, 230, (0, 0)) is None
    assert _zero_point_bias(q[1].weight_int8, 1, (0, 0)) is not None
    x = torch.cat([torch.rand(30, 32, 6, 6) * 5 - 2.5, torch.full((1, 32, 6, 6), 9.0), torch.full((1, 32, 6, 6), -9.0)])
    g = _export(q, x, tmp_path / "big.onnx")
    conv = next(n for n in g.node if n.op_type == "Conv")
    assert len(conv.input) == 2
    got, want = run_onnx(tmp_path / "big.onnx", x)[0], q(x)
    assert torch.equal(_codes(got, q[1]), _codes(want, q[1]))


def test_zero_point_bias_bounds() -> None:
    w = torch.full((2, 1, 1, 1), 127, dtype=torch.int8)
    assert _zero_point_bias(w, 0, (0, 0)) is None  # nothing to correct
    assert _zero_point_bias(w, 3, (1, 0)) is None  # padded: the Conv pads with 0, not z
    assert _zero_point_bias(w, -3, (0, 0)).tolist() == [381.0, 381.0]
    big = torch.full((1, 2**24 // 127 // 510 + 1, 1, 1), 127, dtype=torch.int8)  # 510 Σ|w| just past 2**24
    assert _zero_point_bias(big, 255, (0, 0)) is None and _zero_point_bias(big, 1, (0, 0)) is not None
