"""Session 40 ONNX export of ops on the codes: the bilinear replay on a zero point of 0 (the deploy sweep's eager UNet,
which needed a float-Resize fallback), graph-mode QAT bilinear upsampling, and the average / max pools and means of
QTensors in eager- and graph-converted models, run in ONNX Runtime against lowbit's int8 codes (each test failed
before its fix)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread  # noqa: E402
from test_deploy_s39 import EagerUNet, _build  # noqa: E402

_ = one_thread


def _codes(y: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return torch.round(y / scale).to(torch.int64) + zp


def _export_quietly(model: nn.Module, x: torch.Tensor, path) -> list[str]:
    """``to_onnx`` of ``model``; the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_onnx(model, x, path)
    return [str(w.message) for w in caught if "to_onnx" in str(w.message)]


# ---- 1. bilinear on the codes with a zero point of 0 / a scale of 1 -------------------------------------------------
class _UNetAndUpsample(EagerUNet):
    """The deploy sweep's eager UNet, returning its bilinear upsample's output too (to compare it code for code)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        a = self.r1(self.e1(self.quant(x)))
        b = self.r2(self.down(a))
        u = self.up(b, output_size=a.shape[-2:])
        v = F.interpolate(b, size=a.shape[-2:], mode="bilinear")
        return self.dequant(self.d(self.r3(self.bn(self.cat.cat([a, u, v], 1))))), self.dequant(b), self.dequant(v)


def test_eager_unet_exports_on_the_codes_without_the_fallback(tmp_path) -> None:
    # The bilinear input is a ReLU'd conv's output: zero point 0. The codes replay's autograd Functions traced
    # ``round(x / s) + 0`` into a block of their PythonOp, which TorchScript's alias-sensitive peephole visits but its
    # alias analysis never registered: "IndexError: Argument passed to at() was not in the map"; the lead's fallback
    # then wrote a float Resize (warned). Now the Functions' bodies are not traced.
    q = _build("unet_eager")
    q2 = copy.deepcopy(q)
    q2.__class__ = _UNetAndUpsample
    assert int(q.down.zero_point) == 0  # (the fused conv-ReLU feeding the upsample)
    x = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(3))
    assert _export_quietly(q, x, tmp_path / "unet.onnx") == []
    assert _export_quietly(q2, x, tmp_path / "unet2.onnx") == []
    xs = torch.randn(32, 3, 7, 9, generator=torch.Generator().manual_seed(7))
    out, b, up = run_onnx(tmp_path / "unet2.onnx", xs)
    with torch.no_grad():
        ref_out, ref_b, ref_up = q2(xs)
    s, z = float(q.down.scale), int(q.down.zero_point)
    # the upsample of the codes ORT's conv gave (its float sums move 15 of 3,840 near-tie codes of the int8 conv by
    # one): every code (a Resize on the codes missed 56 of 12,096: ORT blends in another float order)
    qb = Q.quantize_per_tensor(b, s, z, Q.quint8)
    want = F.interpolate(qb, size=up.shape[-2:], mode="bilinear").int_repr().to(torch.int64)
    assert torch.equal(_codes(up, s, z), want)
    assert (_codes(up, s, z) - _codes(ref_up, s, z)).abs().max() <= 1
    step = float(q.d.scale)
    assert ((out - ref_out).abs() / step).max() <= 1.001  # (after the transposed conv's and BN's float sums)
    assert torch.equal(run_onnx(tmp_path / "unet.onnx", xs)[0], out)


@pytest.mark.parametrize("grid", [(0.05, 0), (1.0, 3), (1.0, 0), (0.05, 7)])
def test_codes_replay_traces_for_any_grid(tmp_path, grid) -> None:
    # zero point 0 (x + 0, x - 0 in the Functions' traced bodies) failed with the IndexError above. The file's codes are
    # lowbit's (resample.py).
    from lowbit.export.codes import to_codes_and_back
    s, z = grid

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return to_codes_and_back(x, (s, z, Q.quint8), lambda c: F.interpolate(c, scale_factor=2, mode="bilinear"))

    x = (torch.rand(2, 3, 5, 4, generator=torch.Generator().manual_seed(1)) * 40).round() * s - z * s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(M(), (x,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17)
    qx = Q.quantize_per_tensor(x, s, z, Q.quint8)
    want = F.interpolate(qx, scale_factor=2, mode="bilinear").int_repr().to(torch.int64)
    assert torch.equal(_codes(run_onnx(tmp_path / "m.onnx", x)[0], s, z), want)


class _Resize(nn.Module):
    """conv -> ReLU (a zero point of 0) -> bilinear; returns the conv's and the upsample's outputs."""

    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.quant, self.dequant, self.kw = Q.QuantStub(), Q.DeQuantStub(), kw
        self.conv, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.relu(self.conv(self.quant(x)))
        return self.dequant(h), self.dequant(F.interpolate(h, mode="bilinear", **self.kw))


def _int8(model: nn.Module, mode: str, x: torch.Tensor, groups: list[list[str]] | None = None) -> nn.Module:
    model = model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "fx":
            p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), (x,))
        else:
            model = Q.fuse_modules(model, groups) if groups else model
            model.qconfig = Q.get_default_qconfig()
            p = Q.prepare(model)
        with torch.no_grad():
            p(x)
        return Q.convert_fx(p) if mode == "fx" else Q.convert(p)


@pytest.mark.parametrize("mode", ["eager", "fx"])
@pytest.mark.parametrize("kw", [dict(size=(13, 11)), dict(size=(4, 3), align_corners=True),
                                dict(scale_factor=1.7), dict(scale_factor=(0.6, 2.5), recompute_scale_factor=True)])
def test_bilinear_resize_on_codes_is_exact(tmp_path, mode, kw) -> None:
    # Non-dyadic blends: ORT's Resize on the codes (its own source index and float order) missed near-ties, up to
    # 0.5 % of the codes one step off; the file now holds lowbit's blend (Gather, Mul, Add in its float32 order): the
    # codes of lowbit's upsample of the codes ORT's conv gave, every one. (Eager: a zero point of 0, whose export
    # failed, then fell back to a float Resize, warned.)
    torch.manual_seed(0)
    x = torch.randn(16, 3, 7, 6, generator=torch.Generator().manual_seed(2))
    qm = _int8(_Resize(**kw), mode, x, [["conv", "relu"]])
    assert _export_quietly(qm, x[:2], tmp_path / "r.onnx") == []
    h, up = run_onnx(tmp_path / "r.onnx", x)
    with torch.no_grad():
        ref_h, ref_up = qm(x)
    grid = qm.conv if mode == "eager" else next(m for n, m in qm.named_modules() if n.startswith("conv"))
    s, z = float(grid.scale), int(grid.zero_point)
    if mode == "eager":
        assert z == 0
    want = F.interpolate(Q.quantize_per_tensor(h, s, z, Q.quint8), mode="bilinear", **kw).int_repr().to(torch.int64)
    assert torch.equal(_codes(up, s, z), want)
    assert (_codes(up, s, z) - _codes(ref_up, s, z)).abs().max() <= 1


# ---- 2. graph-mode QAT / prepared: the shared-grid bilinear upsample on the codes ------------------------------------
class _QATUp(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.c1, self.c2, self.kind = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), kind
        self.up = {"upsample": nn.Upsample(scale_factor=2, mode="bilinear"),
                   "upsampling_bilinear": nn.UpsamplingBilinear2d(size=(11, 9))}.get(kind, nn.Identity())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.c1(x))
        if self.kind == "scale":
            u = F.interpolate(h, scale_factor=2, mode="bilinear")
        elif self.kind == "size":
            u = F.interpolate(h, size=(13, 11), mode="bilinear")
        else:
            u = self.up(h)
        return u, self.c2(u)


@pytest.mark.parametrize("kind", ["scale", "size", "upsample", "upsampling_bilinear"])
def test_graph_qat_bilinear_exports_on_the_codes_of_convert(tmp_path, kind) -> None:
    # prepare_qat_fx shares the input's fake-quant across the upsample (called again on its output), so convert_fx
    # runs it on the codes; the twin exported a float Resize then Q/DQ: 3-5 of 12,672-18,304 upsample codes one step
    # off the converted model. Now the converted model's codes, every one (the QAT simulation itself rounds a float
    # blend: 0.04-0.24 % of its codes one step off, within one step).
    import onnx
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_qat_fx(_QATUp(kind).train(), Q.get_default_qat_qconfig_mapping(), (x,))
        opt = torch.optim.SGD(p.parameters(), lr=0.01)
        for _ in range(3):
            sum(o.sum() for o in p(x)).backward()
            opt.step()
            opt.zero_grad()
        p.apply(Q.disable_observer)
        qat = copy.deepcopy(p).eval()
        converted = Q.convert_fx(copy.deepcopy(p).eval())
    assert _export_quietly(qat, x[:2], tmp_path / "q.onnx") == []
    xs = torch.randn(32, 3, 6, 5, generator=torch.Generator().manual_seed(5))
    up, y = run_onnx(tmp_path / "q.onnx", xs)
    with torch.no_grad():
        ref_up, ref_y = converted(xs)
        qat_up, _ = qat(xs)
    s, z = float(qat.activation_post_process_1.scale), int(qat.activation_post_process_1.zero_point)
    assert torch.equal(_codes(up, s, z), _codes(ref_up, s, z))
    assert (_codes(up, s, z) - _codes(qat_up, s, z)).abs().max() <= 1
    assert "Resize" not in {n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    s2 = float(converted.c2.scale)
    assert ((y - ref_y).abs() / s2).max() <= 1.001


# ---- 3. averages and max pooling of QTensors --------------------------------------------------------------------------
AVERAGES = {
    "mean_hw": lambda h: torch.mean(h, (2, 3), keepdim=True),
    "mean_all": lambda h: torch.mean(h).reshape(1, 1, 1, 1).expand(h.shape[0], 1, 1, 1),
    "tensor_mean": lambda h: h.mean(dim=-1, keepdim=True),
    "avg_pool2d": lambda h: F.avg_pool2d(h, 2),
    "avg_pool2d_pad": lambda h: F.avg_pool2d(h, 3, stride=2, padding=1),
    "avg_pool2d_ceil": lambda h: F.avg_pool2d(h, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    "avg_pool1d": lambda h: F.avg_pool1d(h.flatten(2), 4).unsqueeze(-1),
    "adaptive_3x2": lambda h: F.adaptive_avg_pool2d(h, (3, 2)),
    "adaptive_1": lambda h: F.adaptive_avg_pool2d(h, 1),
    "max_pool2d": lambda h: F.max_pool2d(h, 3, stride=2, padding=1),
}


class _Pool(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.quant, self.dequant, self.name = Q.QuantStub(), Q.DeQuantStub(), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(AVERAGES[self.name](self.quant(x)))


@pytest.mark.parametrize("name", AVERAGES)
def test_eager_averages_of_qtensors_export_on_the_codes(tmp_path, name) -> None:
    # An eager int8 model averages QTensor codes (round(mean(q - z) + z), qtensor/ops.py); the twin averaged float
    # values and kept them off the grid (up to 0.5 step: every exact tie; the next layer then rounded them at ties
    # either way, up to 3 steps at its output). Few levels: many exact ties (windows of 4, 6, 9, 12, 72 codes).
    # Now Q -> Cast -> Sub z -> AveragePool / ReduceSum + Div -> Add z -> Round -> Clip -> DQ: every code.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (16, 3, 9, 8), generator=g).float() * 0.3 - 0.45
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = _int8(_Pool(name), "eager", x)
    assert _export_quietly(qm, x[:2], tmp_path / "p.onnx") == []
    s, z = float(qm.quant.scale), int(qm.quant.zero_point)
    with torch.no_grad():
        want = _codes(qm(x), s, z)
    got = run_onnx(tmp_path / "p.onnx", x)[0]
    assert torch.equal(_codes(got, s, z), want)
    assert ((got / s - torch.round(got / s)).abs() < 1e-3).all()  # on the grid


@pytest.mark.parametrize("name", ["mean_hw", "avg_pool2d_ceil", "adaptive_3x2", "max_pool2d"])
def test_graph_mode_averages_stay_float_ops_like_the_converted_model(tmp_path, name) -> None:
    # Graph mode gives an average its own output grid (DeQuantize -> float op -> Quantize, as torch.ao's reference
    # graphs): the file writes the same float op then Q/DQ, within float rounding of lowbit's (max pooling selects
    # codes: exact).
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (16, 3, 9, 8), generator=g).float() * 0.3 - 0.45
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = _int8(_Pool(name), "fx", x)
    assert _export_quietly(qm, x[:2], tmp_path / "p.onnx") == []
    with torch.no_grad():
        ref = qm(x)
    assert torch.allclose(run_onnx(tmp_path / "p.onnx", x)[0], ref, atol=1e-6, rtol=0)
