"""Session 39 ONNX export sweep: QAT / prepared models with every fake-quant kind (eager and graph mode, observer and
fake-quant toggles, frozen BN, a state dict loaded into a fresh prepared model, fixed and dynamic batch) and converted
models with the session 38-39 modules, run in ONNX Runtime against the QAT model and the converted int8 model (each
test failed before its fix)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx
from lowbit.fake_quant import enable_param_learning
from lowbit.nn.intrinsic.qat.modules import freeze_bn_stats
from lowbit.qconfig.defaults import _with_fixed_qparams

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread  # noqa: E402

_ = one_thread


class Net(nn.Module):
    """conv-BN-ReLU (fused for QAT), a plain conv, an activation (sigmoid: a fixed-grid output), a Linear head."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.act = nn.Conv2d(8, 8, 3), act
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.act(self.conv2(x))
        return self.dequant(self.fc(torch.flatten(x, 1)))


QCONFIGS = {
    "default": lambda: Q.get_default_qat_qconfig(),
    "minmax_per_tensor": lambda: Q.QConfig(
        activation=Q.FakeQuantize.with_args(observer=Q.MinMaxObserver, qdtype=Q.quint8),
        weight=Q.FakeQuantize.with_args(observer=Q.MinMaxObserver, qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8)),
    "fused": lambda: Q.get_fused_qat_qconfig(),
    "lsq": lambda: Q.get_lsq_qat_qconfig(),
    "x86": lambda: Q.get_default_qat_qconfig("x86"),
    "x86_v0": lambda: Q.get_default_qat_qconfig("x86", 0),
    "qnnpack": lambda: Q.get_default_qat_qconfig("qnnpack"),
}


def _prepared(mode: str, qconfig: Q.QConfig, act: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(1)
    m = Net(act if act is not None else nn.Sigmoid()).train()
    mapping = _with_fixed_qparams(qconfig, qat=True)  # sigmoid / tanh / hardsigmoid: FixedQParamsFakeQuantize
    if mode == "eager":
        return Q.prepare_qat(Q.fuse_modules_qat(m, [["conv1", "bn1", "relu1"]]), mapping)
    return Q.prepare_qat_fx(m, mapping, (torch.randn(2, 3, 8, 8),))


def _train(qat: nn.Module, lsq: bool, steps: int = 3) -> nn.Module:
    """SGD steps: the weights move after the last step their fake-quant observed (LSQ: learning from step 1)."""
    g = torch.Generator().manual_seed(2)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
    for i in range(steps):
        if lsq and i == 1:
            qat.apply(enable_param_learning)
            opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
        loss = qat(torch.randn(16, 3, 8, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return qat


def _out_step(qat: nn.Module) -> float:
    fq = qat.fc.activation_post_process if hasattr(qat.fc, "activation_post_process") else \
        [m for m in qat.modules() if isinstance(m, Q.FakeQuantize)][-1]
    return float(fq.calculate_qparams()[0].reshape(-1)[0])


def _converted(qat: nn.Module) -> nn.Module:
    m = copy.deepcopy(qat).eval()
    return Q.convert_fx(m) if isinstance(m, torch.fx.GraphModule) else Q.convert(m)


def _steps_off(a: torch.Tensor, b: torch.Tensor, step: float) -> float:
    return ((a - b).abs() / step).max().item()


def _check_qat_export(qat: nn.Module, tmp_path, dynamic_batch: bool = True, vs_converted: bool = True) -> None:
    """ORT within one output step of the QAT model and of ``convert``. The QAT model runs with its activation grids as
    they stand and its weight fake-quants as they are (one whose observer is on observes the current weight first, as
    ``convert`` does)."""
    x = torch.randn(12, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    x = x if dynamic_batch else x[:2]
    path = to_onnx(qat, x[:2], tmp_path / "qat.onnx", dynamic_batch=dynamic_batch)
    got = run_onnx(path, x)[0]
    step = _out_step(qat)
    ref = copy.deepcopy(qat).eval()
    for name, m in ref.named_modules():
        if isinstance(m, Q.FakeQuantize) and not name.endswith("weight_fake_quant"):
            m.disable_observer()
    with torch.no_grad():
        assert _steps_off(got, ref(x), step) <= 1.001
        if vs_converted:
            assert _steps_off(got, _converted(qat)(x), step) <= 1.001


# ---- LSQ: the unused input fake-quant of a layer fed fake-quantized values ---------------------------------------
def test_lsq_static_phase_conv_model_exports_its_grid(tmp_path):
    # before: RuntimeError "LearnableFakeQuantize: scale/zero_point hold no grid yet" from the conv's
    # input_activation_post_process, which the model never calls (its input comes from the QuantStub)
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), Q.DeQuantStub())
    qat = Q.prepare_qat(m.train(), Q.get_lsq_qat_qconfig())
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
    for _ in range(3):  # training steps in LSQ's first (static-estimate) phase
        loss = qat(torch.randn(8, 3, 10, 10)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval().apply(Q.disable_observer)
    x = torch.randn(16, 3, 10, 10)
    path = to_onnx(qat, x[:2], tmp_path / "lsq.onnx")
    got = run_onnx(path, x)[0]
    step = float(qat[3].activation_post_process.calculate_qparams()[0])
    with torch.no_grad():
        qat_out, int8_out = qat(x), _converted(qat)(x)
    assert _steps_off(got, qat_out, step) <= 1.001 and _steps_off(got, int8_out, step) <= 1.001
    assert ((got - int8_out).abs() < 1e-6).double().mean() > 0.99  # the learned grids themselves, not scale 1.0


@pytest.mark.parametrize("mode", ["eager", "fx"])
@pytest.mark.parametrize("kind", ["lsq", "default", "fused"])
def test_untrained_qat_model_is_refused_naming_the_fake_quant(tmp_path, kind, mode):
    # before: FakeQuantize / FusedMovingAvgObsFakeQuantize exported their initial scale 1.0, zero point 0 silently
    # (every activation on a grid of step 1.0); LSQ raised calculate_qparams' message, not naming the module
    qat = _prepared(mode, QCONFIGS[kind]()).eval()
    with pytest.raises(RuntimeError, match=r"to_onnx: fake-quant '.*activation_post_process.*' \(\w*FakeQuantize\) "
                                           r"holds no grid"):
        to_onnx(qat, torch.randn(2, 3, 8, 8), tmp_path / "m.onnx")


def test_weight_fake_quant_that_never_observed_is_refused_naming_it(tmp_path):
    # activations trained, the weight fake-quants' observers off from the start: the weight grid is the initial
    # scale 1.0 (every weight code 0 or +-1); before: exported silently, now refused like convert
    qat = _prepared("eager", Q.get_default_qat_qconfig())
    weight_fqs = [m for name, m in qat.named_modules() if name.endswith("weight_fake_quant")]
    for m in weight_fqs:
        m.disable_observer()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="observer is off and has seen no data"):
            qat(torch.randn(8, 3, 8, 8))  # (session 43: the QAT forward on that placeholder grid is refused itself)
        for m in weight_fqs:
            m.disable_fake_quant()
        qat(torch.randn(8, 3, 8, 8))
        for m in weight_fqs:
            m.enable_fake_quant()
    qat.eval()
    with pytest.raises(RuntimeError, match=r"weight fake-quant 'conv1\.weight_fake_quant' \(FakeQuantize\) holds no"):
        to_onnx(qat, torch.randn(2, 3, 8, 8), tmp_path / "m.onnx")
    with pytest.raises(RuntimeError, match=r"module 'conv1' .*observer is off and has seen no data"):
        _converted(qat)  # (convert refuses it too)


# ---- the sweep: every fake-quant kind, eager and graph mode ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "fx"])
@pytest.mark.parametrize("kind", list(QCONFIGS))
def test_trained_qat_model_matches_the_qat_model_and_convert(tmp_path, kind, mode):
    # before: a weight fake-quant whose observer was still on kept the grid of the last training forward, while
    # convert (and the QAT model's own next forward) observe the current weight: 2-3 steps off convert, 85 % within one
    # (default qconfig, 3 SGD steps)
    qat = _train(_prepared(mode, QCONFIGS[kind]()), kind == "lsq")
    _check_qat_export(qat, tmp_path)


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh, nn.Hardsigmoid])
def test_fixed_qparams_activations_export(tmp_path, act):
    _check_qat_export(_train(_prepared("eager", Q.get_default_qat_qconfig(), act()), False), tmp_path)


@pytest.mark.parametrize("mode", ["eager", "fx"])
@pytest.mark.parametrize("toggle", ["observers_off", "frozen_bn", "fixed_batch", "loaded"])
def test_qat_toggles_frozen_bn_and_loaded_state(tmp_path, mode, toggle):
    qat = _train(_prepared(mode, QCONFIGS["default"]()), False)
    if toggle == "observers_off":
        qat.apply(Q.disable_observer)
    elif toggle == "frozen_bn":
        qat.apply(freeze_bn_stats)
    elif toggle == "loaded":  # a fresh prepared model given the trained state
        fresh = _prepared(mode, QCONFIGS["default"]())
        fresh.load_state_dict(qat.state_dict())
        qat = fresh
    _check_qat_export(qat, tmp_path, dynamic_batch=toggle != "fixed_batch")


def test_disabled_fake_quant_exports_the_float_model_it_runs(tmp_path):
    """A QAT model with fake quantization off runs float: the file does too (no weight codes, no Q/DQ)."""
    import onnx
    qat = _train(_prepared("eager", QCONFIGS["default"]()), False)
    qat.apply(Q.disable_fake_quant)
    x = torch.randn(6, 3, 8, 8)
    path = to_onnx(qat, x[:2], tmp_path / "f.onnx")
    with torch.no_grad():
        ref = copy.deepcopy(qat).eval()(x)
    assert torch.allclose(run_onnx(path, x)[0], ref, atol=1e-5)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in onnx.load(str(path)).graph.node}


# ---- converted models: bilinear resampling on the codes -------------------------------------------------------------
class _Upsampler(nn.Module):
    def __init__(self, kind: str, conv: bool) -> None:
        super().__init__()
        self.quant, self.dequant, self.kind = Q.QuantStub(), Q.DeQuantStub(), kind
        self.conv = nn.Conv2d(3, 4, 3, padding=1) if conv else nn.Identity()
        self.up = {"upsample": nn.Upsample(scale_factor=2, mode="bilinear"),
                   "upsampling_bilinear": nn.UpsamplingBilinear2d(scale_factor=2)}.get(kind, nn.Identity())
        self.head = nn.Conv2d(4 if conv else 3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        if self.kind == "size":
            y = F.interpolate(y, size=(13, 11), mode="bilinear", align_corners=False)
        elif self.kind == "scale":
            y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        else:
            y = self.up(y)
        return self.dequant(self.head(y)), self.dequant(y)


def _int8(model: nn.Module, mode: str, x: torch.Tensor) -> nn.Module:
    model = model.eval()
    if mode == "fx":
        prepared = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), (x,))
    else:
        model.qconfig = Q.get_default_qconfig()
        prepared = Q.prepare(model)
    with torch.no_grad():
        prepared(x)
    return Q.convert_fx(prepared) if mode == "fx" else Q.convert(prepared)


@pytest.mark.parametrize("mode,kind,conv", [(m, k, c) for m in ("eager", "fx") for k in ("upsample", "upsampling_bilinear",
                                                                                        "scale", "size")
                                             for c in (False, True) if m == "eager" or c])  # (fx: a graph input
# resampled first stays float, there is nothing on codes)
def test_bilinear_resample_of_codes_exports_on_the_codes(tmp_path, mode, kind, conv):
    # lowbit resamples the codes and rounds onto the input grid; the twin resampled float values and kept them off the
    # grid: 14 % of the upsample's outputs equal to lowbit's, up to 1.06 steps off, and the codes the next conv read
    # one step off at the ties of the 2x blend (its outputs up to 2 steps off). Now Q -> Cast -> Resize -> Round -> DQ.
    import onnx
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = _int8(_Upsampler(kind, conv), mode, torch.randn(8, 3, 6, 5))
    x = torch.randn(6, 3, 6, 5, generator=torch.Generator().manual_seed(4))
    path = to_onnx(qm, x[:2], tmp_path / "up.onnx")
    head, up = run_onnx(path, x)
    with torch.no_grad():
        ref_head, ref_up = qm(x)
    from lowbit.nn.quantized import Quantize
    first = qm.conv if conv else next(m for m in qm.modules() if isinstance(m, Quantize))
    up_step, head_step = float(first.scale), float(qm.head.scale)
    assert _steps_off(up, ref_up, up_step) <= 1.001 and _steps_off(head, ref_head, head_step) <= 1.001
    exact = ((up - ref_up).abs() < 1e-6).double().mean().item()
    # exact for the 2x blends (dyadic weights: the ties are exact ties); 13 x 11: near-ties in another float order,
    # and with a conv first its own near-tie codes in ORT's kernel
    assert exact == 1.0 if not conv and kind != "size" else exact > 0.98, exact
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Gather", "Round", "Cast"} <= ops and "Resize" not in ops  # (session 40: lowbit's blend, not a Resize)
