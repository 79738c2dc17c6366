"""Session 41: ``to_onnx(..., exact=True)``, int8 Conv / Linear / ConvTranspose whose ONNX Runtime codes equal lowbit's.

The QDQ export lets ORT fuse ``QLinearConv`` (``QGemm`` / a float Gemm for Linears), which adds the bias as int32 codes
``round(b / (s_x s_w))`` and requantizes with a folded multiplier, and quantizes the model input as ``x / s`` where
lowbit rounds ``x · fl(1 / s)``: near-tie codes one step off lowbit's int8 model (50 of 640 outputs of the CNN below,
25 of 4,032 of the UNet). ``exact=True`` writes exact integer sums and lowbit's own float32 requantization (and
lowbit's quantize / add on the codes): every code equal, on random and on tie-heavy (dyadic-grid) inputs. Each test
failed before (``to_onnx`` had no ``exact`` argument).
"""

from __future__ import annotations

import warnings

import onnx
import onnx.numpy_helper
import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx

pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread  # noqa: E402
from test_deploy_s39 import PRODUCTS, _build  # noqa: E402

_ = one_thread


class CNN(nn.Module):
    """conv + ReLU (fused), depthwise conv -> ReLU6, pointwise conv, residual add, strided conv + ReLU, Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.quant, self.dq = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.r1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.dw, self.r2 = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU6()
        self.pw = nn.Conv2d(16, 16, 1)
        self.skip = Q.nn.quantized.FloatFunctional()
        self.c2, self.r3 = nn.Conv2d(16, 8, 3, stride=2, padding=1), nn.ReLU()
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.r1(self.c1(self.quant(x)))
        b = self.pw(self.r2(self.dw(a)))
        c = self.r3(self.c2(self.skip.add(a, b)))
        return self.dq(self.fc(c.flatten(1)))


def _cnn(backend: str | None = None) -> nn.Module:
    model = Q.fuse_modules(CNN().eval(), [["c1", "r1"], ["c2", "r3"]])
    model.qconfig = Q.get_default_qconfig(backend)
    p = Q.prepare(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            p(torch.randn(8, 3, 12, 12, generator=g))
    return Q.convert(p)


def _dyadic(q: nn.Module) -> nn.Module:
    """Every grid a power of two and every bias a multiple of ``s_x s_w / 2``: the requantizations hit exact ties
    (round half to even decides ~1/16 of the codes)."""
    with torch.no_grad():
        q.quant.scale.fill_(2.0 ** -5)
        s_in = {"c1": 2.0 ** -5, "dw": 2.0 ** -6, "pw": 2.0 ** -6, "c2": 2.0 ** -5, "fc": 2.0 ** -5}
        outs = {"c1": (2.0 ** -6, 0), "dw": (2.0 ** -6, 47), "pw": (2.0 ** -6, 60), "c2": (2.0 ** -5, 0),
                "fc": (2.0 ** -4, 61)}
        for name, (so, zo) in outs.items():
            m = getattr(q, name)
            m.weight_scale.fill_(2.0 ** -7)
            m.bias.copy_(torch.randint(-40, 40, m.bias.shape, generator=torch.Generator().manual_seed(2)).float()
                         * s_in[name] * 2.0 ** -8)
            m.set_output_grid(so, zo, m.out_qdtype)
        q.skip.scale.fill_(2.0 ** -5)
        q.skip.zero_point.fill_(33)
    return q


def _codes(y: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return torch.round(y / scale).to(torch.int64) + zp


def _ort_codes(q: nn.Module, x: torch.Tensor, path, exact: bool, out: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowbit's output codes, ORT's) on ``out``'s grid."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(q, x[:2], path, exact=exact)
    with torch.no_grad():
        ref = q(x)
    s, z = float(out.scale), int(out.zero_point)
    return _codes(ref, s, z), _codes(run_onnx(path, x)[0], s, z)


@pytest.mark.parametrize("backend", [None, "x86"])  # 8-bit activations (split routes) / 7-bit (one oneDNN call)
@pytest.mark.parametrize("ties", [False, True])
def test_exact_cnn_codes_equal_lowbit(tmp_path, backend, ties) -> None:
    q = _cnn(backend)
    if ties:
        q = _dyadic(q)
    x = torch.randn(64, 3, 12, 12, generator=torch.Generator().manual_seed(7)) * 1.5
    if ties:  # inputs on the half codes of the input grid too
        x = (torch.round(x * 32) + 0.5) / 32
    want, got = _ort_codes(q, x, tmp_path / "exact.onnx", True, q.fc)
    assert torch.equal(got, want)
    if not ties and backend is None:  # the QDQ form, for the record: near-tie codes one step off
        _, qdq = _ort_codes(q, x, tmp_path / "qdq.onnx", False, q.fc)
        assert 0 < int((qdq != want).sum()) and int((qdq - want).abs().max()) == 1


def test_exact_layers_each_equal_lowbit(tmp_path) -> None:
    # every layer's codes, not only the model output: the model returns each intermediate QTensor's values
    q = _cnn()

    class Taps(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            m = self.m
            a = m.r1(m.c1(m.quant(x)))
            d = m.r2(m.dw(a))
            b = m.pw(d)
            s = m.skip.add(a, b)
            c = m.r3(m.c2(s))
            return tuple(t.dequantize() for t in (a, d, b, s, c, m.fc(c.flatten(1))))

    t = Taps(q).eval()
    x = torch.randn(64, 3, 12, 12, generator=torch.Generator().manual_seed(9)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(t, x[:2], tmp_path / "taps.onnx", exact=True)
    got = run_onnx(tmp_path / "taps.onnx", x)
    with torch.no_grad():
        want = t(x)
    for name, mod, g, w in zip(["c1", "dw", "pw", "skip", "c2", "fc"], [q.c1, q.dw, q.pw, q.skip, q.c2, q.fc], got, want):
        s, z = float(mod.scale), int(mod.zero_point)
        assert torch.equal(_codes(g, s, z), _codes(w, s, z)), name


@pytest.mark.parametrize("name", ["unet_eager", "unet_fx"])
@pytest.mark.parametrize("seed", [7, 8])
def test_exact_unet_codes_equal_lowbit(tmp_path, name, seed) -> None:
    # conv + ReLU, strided conv, ConvTranspose with output_size (float sums of integers below 2**24), bilinear on the
    # codes, cat, BN + ReLU: the session 40 note's UNet (25 of 4,032 outputs one step off as QDQ)
    q = _build(name)
    x = torch.randn(32, *PRODUCTS[name][2][1:], generator=torch.Generator().manual_seed(seed))
    out = q.d if name == "unet_eager" else next(m for n, m in q.named_modules() if n.split(".")[-1] == "d")
    want, got = _ort_codes(q, x, tmp_path / "u.onnx", True, out)
    assert torch.equal(got, want)


def test_exact_graph_has_no_fused_qlinear_ops(tmp_path) -> None:
    q = _cnn()
    x = torch.randn(4, 3, 12, 12)
    to_onnx(q, x, tmp_path / "m.onnx", exact=True)
    opt = tmp_path / "opt.onnx"
    run_onnx(tmp_path / "m.onnx", x, optimized_model_path=str(opt))
    graph = onnx.load(str(opt)).graph
    ops = {n.op_type for n in graph.node}
    assert "MatMulInteger" in ops and "Round" in ops
    assert not ops & {"QLinearConv", "QGemm", "QLinearMatMul", "QLinearAdd"}
    # the float convs sum integer codes: ORT's ConvMulFusion did not fold lowbit's scale into their weights (it did
    # when the Mul followed the Conv directly: 1 of 147,456 codes off); NCHWc writes the per-channel Mul itself as a
    # 1x1 depthwise conv, one product per element (weights (C, 1, 1, 1))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    weights = [inits[n.input[1]] for n in graph.node if n.op_type == "Conv"]
    summing = [w for w in weights if w.shape[1:] != (1, 1, 1)]
    assert len(summing) == 4 and all((w == w.round()).all() for w in summing)


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_exact_rejects_non_bool(tmp_path, bad) -> None:
    with pytest.raises(TypeError, match=rf"to_onnx: exact={bad!r} must be True, False or 'x86'"):
        to_onnx(_cnn(), torch.randn(2, 3, 12, 12), tmp_path / "m.onnx", exact=bad)
