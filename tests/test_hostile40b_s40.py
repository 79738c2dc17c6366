"""Hostile inputs to session 40's APIs (eager shared grids, QAT conv-BN extra state, the folded Linear + BN input
check, mixed-precision op keys, averages on codes in ONNX). Each test failed before its fix:

- ``F.avg_pool2d / 3d(..., divisor_override=d)`` of a QTensor exported on the codes as ``AveragePool`` (torch's ONNX
  exporter drops ``divisor_override``): 327 of 360 codes off the eager int8 model, up to 56 steps;
- ``QTensor.mean(dtype=...)`` was a ``TypeError`` (the float model takes it);
- a Linear with a BatchNorm1d folded in took a 3-d input silently after ``convert_fx`` (PTQ and QAT) and eager QAT
  ``convert`` (0.89 off the float model), and when called with ``input=``;
- ``keep_float`` of a graph-mode op's row name without its ``op_keys`` kept the op int8 silently;
- a complex or meta ``_extra_state`` loaded (a complex one as ``freeze_bn=True``) or failed deep in ``.item()``;
- a ``KeyboardInterrupt`` inside a prepared resampling model's forward left the shared-grid ``TorchFunctionMode`` on
  for the rest of the process (torch runs always-called hooks after ``Exception`` only).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import lowbit as Q
import lowbit.nn.intrinsic as nni
import lowbit.nn.intrinsic.qat as nniqat
from helpers import one_thread  # noqa: F401  (autouse: one thread)
from lowbit.debug.table import keep_float


# ---- averages on codes in ONNX: divisor_override --------------------------------------------------------------------
class _Pool(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.quant, self.dequant, self.fn = Q.QuantStub(), Q.DeQuantStub(), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fn(self.quant(x)))


DIVIDED = {
    "2d": lambda h: F.avg_pool2d(h, 3, stride=2, padding=1, divisor_override=5),
    "2d_ceil": lambda h: F.avg_pool2d(h, (2, 3), 2, 0, True, True, 4),
    "2d_ceil_pad": lambda h: F.avg_pool2d(h, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False,
                                          divisor_override=7),
    "3d": lambda h: F.avg_pool3d(h.unsqueeze(1), 2, divisor_override=3).squeeze(1),
}


@pytest.mark.parametrize("name", DIVIDED)
def test_avg_pool_divisor_override_exports_every_code(tmp_path, name) -> None:
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (6, 3, 9, 8), generator=g).float() * 0.3 - 0.45
    model = _Pool(DIVIDED[name]).eval()
    model.qconfig = Q.get_default_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare(model)
        p(x)
        qm = Q.convert(p)
        to_onnx(qm, x[:2], tmp_path / "p.onnx")
    s, z = float(qm.quant.scale), int(qm.quant.zero_point)
    with torch.no_grad():
        want = torch.round(qm(x) / s) + z
    got = torch.round(run_onnx(tmp_path / "p.onnx", x)[0] / s) + z
    assert got.shape == want.shape
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} codes off"


@pytest.mark.parametrize("kw", [dict(dim=2), dict(), dict(dim=(1, 2), keepdim=True)])
def test_qtensor_mean_takes_dtype_as_the_float_model(kw) -> None:
    x = torch.randn(2, 3, 4)
    qt = Q.quantize_per_tensor(x, 0.05, 128, Q.quint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = qt.mean(**kw, dtype=torch.float64)
    want = qt.dequantize().mean(**kw, dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)


# ---- a Linear with a BatchNorm1d folded in keeps its 2-d input check ------------------------------------------------
class _LinBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.l, self.b, self.dq = Q.QuantStub(), nn.Linear(3, 4), nn.BatchNorm1d(4), Q.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.b(self.l(self.quant(x))))


def _converted(how: str) -> nn.Module:
    torch.manual_seed(0)
    x2 = torch.randn(8, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "fx":
            p = Q.prepare_fx(_LinBn().eval(), Q.get_default_qconfig_mapping(), (x2,))
        elif how == "fx_qat":
            p = Q.prepare_qat_fx(_LinBn().train(), Q.get_default_qat_qconfig_mapping(), (x2,))
        else:
            m = _LinBn().train()
            m.qconfig = Q.get_default_qat_qconfig()
            p = Q.prepare_qat(Q.fuse_modules_qat(m, [["l", "b"]]))
        p(x2)
        p.eval()
        return Q.convert(p) if how == "eager_qat" else Q.convert_fx(p)


@pytest.mark.parametrize("how", ["fx", "fx_qat", "eager_qat"])
def test_converted_linear_bn_refuses_a_3d_input(how) -> None:
    c = _converted(how)
    assert c(torch.randn(5, 3)).shape == (5, 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 4, 3\)"):
        c(torch.randn(2, 4, 3))


def test_fused_linear_bn_checks_an_input_keyword() -> None:
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    fused = Q.fuse_modules(m, [["0", "1"]])[0]
    assert fused(input=torch.randn(2, 3)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 4, 3\)"):
        fused(input=torch.randn(2, 4, 3))


# ---- mixed precision: an op's row name needs its key ---------------------------------------------------------------
def test_keep_float_refuses_an_op_name_without_its_key() -> None:
    with pytest.raises(ValueError, match=r"'features.3:operator.add#0'"):
        keep_float(Q.QConfigMapping(), "features.3:operator.add#0", {})
    assert keep_float(Q.QConfigMapping(), "features.3", {}).module_name_qconfigs == {"features.3": None}


# ---- QAT conv-BN extra state -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [torch.tensor([1 + 0j, 0j]), torch.empty(2, dtype=torch.uint8, device="meta")],
                         ids=["complex", "meta"])
def test_extra_state_refuses_complex_and_meta(bad) -> None:
    marker = nni.ConvTransposeBn2d(nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4))
    marker.qconfig = Q.get_default_qat_qconfig()
    m = nniqat.ConvTransposeBn2d.from_float(marker.train())
    sd = m.state_dict()
    sd["_extra_state"] = bad
    with pytest.raises(ValueError, match=r"ConvTransposeBn2d: _extra_state=tensor\("):
        m.load_state_dict(sd)
    assert m.freeze_bn is False


# ---- the shared-grid mode after a KeyboardInterrupt ------------------------------------------------------------------
class _Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stop:
            raise KeyboardInterrupt
        return F.interpolate(x, scale_factor=2, mode="bilinear")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.up, self.c2 = nn.Conv2d(3, 4, 3, padding=1), _Up(), nn.Conv2d(4, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.c2(self.up(self.c1(self.quant(x)))))


def test_shared_grid_mode_left_by_a_keyboard_interrupt_is_turned_off() -> None:
    m = _Net().eval()
    m.qconfig = Q.get_default_qconfig()
    x = torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare(m)
        ref = p(x)
        depth = len(_get_current_function_mode_stack())
        p.up.stop = True
        with pytest.raises(KeyboardInterrupt):
            p(x)
        p.up.stop = False
        seen = []  # a nested call of the same model keeps the outer call's mode
        h = p.c2.register_forward_hook(lambda *a: seen.append(len(_get_current_function_mode_stack())))
        y = p(x)
        h.remove()
    assert len(_get_current_function_mode_stack()) == depth
    assert seen == [depth + 1]
    assert torch.equal(y, ref)
