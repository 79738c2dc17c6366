"""lowbit.nn.quantized Linear / Conv / ConvTranspose: from_float, integer kernels, parity with torch.ao, state."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic as nni
import lowbit.nn.quantized as nnq
from lowbit import kernels as K
from lowbit.observer.minmax import MinMaxObserver, PerChannelMinMaxObserver
from lowbit.qconfig import QConfig

torch.set_num_threads(1)
# oneDNN is exact on every int8 weight with VNNI/AMX; on older x86 only with 7-bit weights (see kernels.onednn)
W7 = Q.qint8.with_range(-64, 63)
QCONFIG = QConfig(activation=MinMaxObserver.with_args(), weight=PerChannelMinMaxObserver.with_args(ch_axis=0))
QCONFIG_W7 = QConfig(activation=MinMaxObserver.with_args(),
                     weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qdtype=W7))


def prepared(float_mod: nn.Module, *inputs: torch.Tensor, qconfig: QConfig = QCONFIG) -> nn.Module:
    """Attach a qconfig and a calibrated output observer, as ``prepare`` + calibration would."""
    float_mod.qconfig = qconfig
    float_mod.activation_post_process = qconfig.activation()
    with torch.no_grad():
        for x in inputs:
            float_mod.activation_post_process(float_mod(x))
    return float_mod


def simulate(qmod: nn.Module, qx: Q.QTensor, fn, relu: bool = False) -> Q.QTensor:
    """Float simulation from the module's own int8 state: dequantize, float op, requantize."""
    y = fn(qx.dequantize(), qmod.weight().dequantize(), qmod.bias)
    y = torch.relu(y) if relu else y
    return Q.quantize_per_tensor(y, float(qmod.scale), int(qmod.zero_point), qmod.out_qdtype)


def assert_codes_close(a: Q.QTensor, b: Q.QTensor, tol: int = 1, frac: float = 1.0) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    close = (a.int_repr().int() - b.int_repr().int()).abs() <= tol
    assert close.float().mean() >= frac, f"only {close.float().mean():.4f} of codes within {tol}"


def quant_in(x: torch.Tensor) -> Q.QTensor:
    lo, hi = x.aminmax()
    s, z = Q.calculate_qparams(lo, hi, Q.per_tensor_affine, Q.quint8)
    return Q.quantize_per_tensor(x, s, z, Q.quint8)


# ---------------------------------------------------------------- Linear

@pytest.mark.parametrize("cls,relu", [(nnq.Linear, False), (nnq.LinearReLU, True)])
def test_linear_from_float_matches_simulation_and_runs_onednn(cls, relu: bool) -> None:
    torch.manual_seed(0)
    lin, x = nn.Linear(32, 16), torch.randn(4, 5, 32)
    src = nni.LinearReLU(lin, nn.ReLU()) if relu else lin
    qmod = cls.from_float(prepared(src, x, qconfig=QCONFIG_W7))
    qx = quant_in(x)
    before = K.counts[("onednn", "linear")]
    y = qmod(qx)
    assert K.counts[("onednn", "linear")] == before + 1  # the int8 oneDNN path ran
    assert isinstance(y, Q.QTensor) and y.shape == (4, 5, 16) and y.qdtype == Q.quint8
    assert_codes_close(y, simulate(qmod, qx, F.linear, relu))
    # and the quantized layer approximates the float one
    ref = src(x)
    assert (y.dequantize() - ref).abs().max() < 4 * float(qmod.scale) + 0.05


def test_linear_default_int8_weights_run_onednn_on_every_cpu() -> None:
    torch.manual_seed(1)
    lin, x = nn.Linear(24, 8), torch.randn(6, 24)
    qmod = nnq.Linear.from_float(prepared(lin, x))
    qx = quant_in(x)
    before = K.counts[("onednn", "linear")]
    y = qmod(qx)
    assert K.counts[("onednn", "linear")] == before + 1
    assert_codes_close(y, simulate(qmod, qx, F.linear))


def test_conv_default_int8_weights_run_onednn_on_every_cpu() -> None:
    torch.manual_seed(13)
    conv, x = nn.Conv2d(6, 8, 3, padding=1), torch.randn(2, 6, 8, 8)
    qmod, qx = nnq.Conv2d.from_float(prepared(conv, x)), quant_in(x)
    before = K.counts[("onednn", "conv")]
    y = qmod(qx)
    assert K.counts[("onednn", "conv")] == before + 1
    assert_codes_close(y, simulate(qmod, qx, lambda a, w, b: F.conv2d(a, w, b, 1, 1)))


def test_linear_backends_agree() -> None:
    torch.manual_seed(2)
    lin, x = nn.Linear(40, 12), torch.randn(7, 40)
    qmod, qx = nnq.Linear.from_float(prepared(lin, x, qconfig=QCONFIG_W7)), quant_in(x)
    outs = {}
    for name in ("reference", "int_mm", "onednn"):
        with K.use_backend(name):
            outs[name] = qmod(qx)
    assert_codes_close(outs["int_mm"], outs["reference"])
    assert_codes_close(outs["onednn"], outs["reference"])
    assert torch.equal(outs["int_mm"].int_repr(), outs["onednn"].int_repr()) or \
        int((outs["int_mm"].int_repr().int() - outs["onednn"].int_repr().int()).abs().max()) <= 1


@pytest.mark.parametrize("engine", ["x86", "onednn"])
def test_linear_parity_with_torch_ao(engine: str) -> None:
    torch.manual_seed(3)
    lin, x = nn.Linear(64, 32), torch.randn(16, 64)
    qmod = nnq.Linear.from_float(prepared(lin, x, qconfig=QCONFIG_W7))
    qx = quant_in(x)
    w = qmod.weight()
    saved = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = engine
        ao = torch.ao.nn.quantized.Linear(64, 32)
        ao.set_weight_bias(torch.quantize_per_channel(w.dequantize(), w.scale.double(), w.zero_point, 0, torch.qint8),
                           qmod.bias)
        ao.scale, ao.zero_point = float(qmod.scale), int(qmod.zero_point)
        tx = torch.quantize_per_tensor(qx.dequantize(), float(qx.scale), int(qx.zero_point), torch.quint8)
        ty = ao(tx)
        torch.backends.quantized.engine = saved
    ours = qmod(qx)
    assert torch.equal(tx.int_repr(), qx.int_repr())
    assert_codes_close(ours, Q.QTensor(ty.int_repr(), ty.q_scale(), ty.q_zero_point(), Q.quint8), frac=0.99)


# ---------------------------------------------------------------- Conv

CONVS = [
    (nnq.Conv1d, lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 4, 12)),
    (nnq.Conv2d, lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), (2, 4, 9, 9)),
    (nnq.Conv2d, lambda: nn.Conv2d(3, 4, 4, padding="same", dilation=2), (1, 3, 8, 7)),
    (nnq.Conv2d, lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), (1, 3, 6, 6)),
    (nnq.Conv2d, lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate"), (1, 3, 6, 6)),
    (nnq.Conv2d, lambda: nn.Conv2d(3, 4, (3, 2), padding=(1, 2), padding_mode="circular", bias=False), (2, 3, 5, 6)),
    (nnq.Conv3d, lambda: nn.Conv3d(2, 4, 3, padding=1), (1, 2, 4, 5, 5)),
]


@pytest.mark.parametrize("cls,make,shape", CONVS,
                         ids=["1d", "2d-groups", "2d-same-even", "2d-reflect", "2d-replicate", "2d-circular", "3d"])
def test_conv_from_float_matches_float_conv(cls, make, shape) -> None:
    torch.manual_seed(4)
    conv, x = make(), torch.randn(*shape)
    qmod = cls.from_float(prepared(conv, x, qconfig=QCONFIG_W7))
    qx = quant_in(x)
    before = K.counts[("onednn", "conv")]
    y = qmod(qx)
    assert K.counts[("onednn", "conv")] == before + 1
    # the float conv itself (same padding semantics) on the dequantized int8 state, requantized
    sim = copy.deepcopy(conv)
    del sim.activation_post_process
    with torch.no_grad():
        sim.weight.copy_(qmod.weight().dequantize())
    ref = sim(qx.dequantize())
    assert_codes_close(y, Q.quantize_per_tensor(ref, float(qmod.scale), int(qmod.zero_point), Q.quint8))
    assert y.shape == conv(x).shape


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_conv_relu_from_marker(dim: int) -> None:
    torch.manual_seed(5)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim](3, 5, 3, padding=1)
    marker = {1: nni.ConvReLU1d, 2: nni.ConvReLU2d, 3: nni.ConvReLU3d}[dim](conv, nn.ReLU())
    x = torch.randn(2, 3, *([6] * dim))
    cls = {1: nnq.ConvReLU1d, 2: nnq.ConvReLU2d, 3: nnq.ConvReLU3d}[dim]
    qmod = cls.from_float(prepared(marker, x, qconfig=QCONFIG_W7))
    qx = quant_in(x)
    y = qmod(qx)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dim]
    assert_codes_close(y, simulate(qmod, qx, lambda a, w, b: fn(a, w, b, 1, 1), relu=True))
    assert int(y.int_repr().min()) >= int(qmod.zero_point)


def test_conv2d_parity_with_torch_ao() -> None:
    torch.manual_seed(6)
    conv, x = nn.Conv2d(8, 16, 3, padding=1), torch.randn(2, 8, 10, 10)
    qmod, qx = nnq.Conv2d.from_float(prepared(conv, x, qconfig=QCONFIG_W7)), quant_in(x)
    w = qmod.weight()
    saved = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "x86"
        ao = torch.ao.nn.quantized.Conv2d(8, 16, 3, padding=1)
        ao.set_weight_bias(torch.quantize_per_channel(w.dequantize(), w.scale.double(), w.zero_point, 0, torch.qint8),
                           qmod.bias)
        ao.scale, ao.zero_point = float(qmod.scale), int(qmod.zero_point)
        ty = ao(torch.quantize_per_tensor(qx.dequantize(), float(qx.scale), int(qx.zero_point), torch.quint8))
        torch.backends.quantized.engine = saved
    assert_codes_close(qmod(qx), Q.QTensor(ty.int_repr(), ty.q_scale(), ty.q_zero_point(), Q.quint8), frac=0.99)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_conv_transpose(dim: int) -> None:
    torch.manual_seed(7)
    ct = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dim](4, 6, 3, stride=2, padding=1,
                                                                                    output_padding=1, groups=2)
    x = torch.randn(2, 4, *([4] * dim))
    cls = {1: nnq.ConvTranspose1d, 2: nnq.ConvTranspose2d, 3: nnq.ConvTranspose3d}[dim]
    qmod = cls.from_float(prepared(ct, x))
    w = qmod.weight()
    assert w.axis == 1 and w.scale.shape == (3,) and qmod.weight_int8.shape == ct.weight.shape
    qx = quant_in(x)
    y = qmod(qx)
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[dim]
    assert_codes_close(y, simulate(qmod, qx, lambda a, w, b: fn(a, w, b, 2, 1, 1, 2)))
    assert y.shape == ct(x).shape
    assert (y.dequantize() - ct(x)).abs().max() < 0.1 * ct(x).abs().max() + 4 * float(qmod.scale)


# ---------------------------------------------------------------- QAT / low-level constructors

def test_from_float_uses_weight_fake_quant_and_from_reference() -> None:
    torch.manual_seed(8)
    import lowbit.nn.qat as nnqat
    from lowbit.qconfig import get_default_qat_qconfig
    lin = nn.Linear(16, 4)
    lin.qconfig = get_default_qat_qconfig()
    qat = nnqat.Linear.from_float(lin)
    x = torch.randn(8, 16)
    qat.activation_post_process = qat.qconfig.activation()
    qat.activation_post_process(qat(x))
    qmod = nnq.Linear.from_float(qat)
    s, z = qat.weight_fake_quant.calculate_qparams()
    assert torch.equal(qmod.weight_scale, s) and torch.equal(qmod.weight_zero_point, z)
    # from_reference: a conv-like with (e.g. folded) weights plus its quantized weight and an output grid
    conv = nn.Conv2d(3, 4, 3)
    wq = Q.quantize_per_channel(conv.weight.detach(), conv.weight.detach().abs().amax((1, 2, 3)) / 127,
                                torch.zeros(4, dtype=torch.long), 0, Q.qint8)
    qc = nnq.Conv2d.from_reference(conv, wq, 0.05, 10, Q.quint8)
    assert torch.equal(qc.weight_int8, wq.int_repr()) and float(qc.scale) == pytest.approx(0.05)
    assert torch.equal(qc.bias, conv.bias.detach())


# ---------------------------------------------------------------- state, devices, repr

def _roundtrip(qmod: nn.Module, twin: nn.Module, x: Q.QTensor) -> None:
    y0 = qmod(x)
    buf = io.BytesIO()
    torch.save(qmod.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert set(state) >= {"weight_int8", "weight_scale", "weight_zero_point", "scale", "zero_point"}
    assert all(type(v) is torch.Tensor for v in state.values())
    twin(x)  # run once so a stale packed weight exists: load must invalidate it
    twin.load_state_dict(state)
    for k, v in qmod.state_dict().items():
        assert torch.equal(twin.state_dict()[k], v) and twin.state_dict()[k].dtype == v.dtype
    assert torch.equal(twin(x).int_repr(), y0.int_repr())


def test_state_dict_round_trip_linear_and_conv() -> None:
    torch.manual_seed(9)
    x = torch.randn(3, 12)
    qmod = nnq.Linear.from_float(prepared(nn.Linear(12, 5), x))
    _roundtrip(qmod, nnq.Linear(12, 5), quant_in(x))
    xc = torch.randn(1, 3, 6, 6)
    qc = nnq.ConvReLU2d.from_float(prepared(nni.ConvReLU2d(nn.Conv2d(3, 4, 3), nn.ReLU()), xc, qconfig=QCONFIG_W7))
    _roundtrip(qc, nnq.ConvReLU2d(3, 4, 3), quant_in(xc))
    qt = nnq.ConvTranspose2d.from_float(prepared(nn.ConvTranspose2d(3, 2, 2, bias=False), xc))
    assert "bias" not in qt.state_dict()
    _roundtrip(qt, nnq.ConvTranspose2d(3, 2, 2, bias=False), quant_in(xc))


def test_cache_is_not_state_and_survives_copy_and_to() -> None:
    torch.manual_seed(10)
    x = torch.randn(2, 8)
    qmod = nnq.Linear.from_float(prepared(nn.Linear(8, 3), x, qconfig=QCONFIG_W7))
    y = qmod(quant_in(x))
    assert qmod._cache and "_cache" not in str(list(qmod.state_dict()))
    clone = copy.deepcopy(qmod)
    assert clone._cache == {} and torch.equal(clone(quant_in(x)).int_repr(), y.int_repr())
    qmod.to("cpu")
    assert qmod._cache == {}
    assert torch.equal(qmod(quant_in(x)).int_repr(), y.int_repr())
    qmod.double()  # float casts leave the int8 contract (float32 scales) intact
    assert qmod.weight_scale.dtype == torch.float32 and qmod.weight_int8.dtype == torch.int8
    assert torch.equal(qmod(quant_in(x)).int_repr(), y.int_repr())


def test_repr_and_weight() -> None:
    qmod = nnq.Linear(4, 2)
    qmod.set_output_grid(0.5, 3, Q.quint8)
    r = repr(qmod)
    assert all(s in r for s in ("in_features=4", "out_features=2", "scale=0.5", "zero_point=3", "quint8",
                                "per_channel_symmetric"))
    assert "padding='same'" in repr(nnq.Conv2d(1, 1, 3, padding="same"))
    assert "padding_mode='reflect'" in repr(nnq.Conv1d(1, 1, 3, padding=1, padding_mode="reflect"))
    w = qmod.weight()
    assert isinstance(w, Q.QTensor) and w.q_per_channel_axis() == 0 and w.shape == (2, 4)


def test_float_input_accepted() -> None:
    torch.manual_seed(11)
    x = torch.randn(5, 10)
    qmod = nnq.Linear.from_float(prepared(nn.Linear(10, 4), x))
    dyn = qmod(x)  # dynamic per-tensor quint8
    assert isinstance(dyn, Q.QTensor)
    assert torch.equal(dyn.int_repr(), qmod(quant_in(x)).int_repr())
    qmod.input_grid = (0.05, 128, Q.quint8)  # recorded input grid
    rec = qmod(x)
    assert torch.equal(rec.int_repr(), qmod(Q.quantize_per_tensor(x, 0.05, 128, Q.quint8)).int_repr())
    conv = nnq.Conv2d(3, 2, 3)
    assert conv(torch.randn(3, 5, 5)).shape == (2, 3, 3)  # unbatched float input


def test_qint8_input_activations() -> None:
    torch.manual_seed(12)
    x = torch.randn(4, 16)
    qmod = nnq.Linear.from_float(prepared(nn.Linear(16, 6), x, qconfig=QCONFIG_W7))
    s8 = Q.quantize_per_tensor(x, 0.02, -3, Q.qint8)
    assert_codes_close(qmod(s8), simulate(qmod, s8, F.linear))


def test_bad_inputs_and_arguments() -> None:
    lin = nnq.Linear(4, 2)
    with pytest.raises(ValueError, match="in_features=4"):
        lin(torch.randn(3, 5))
    with pytest.raises(TypeError, match="int64"):
        lin(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="list"):
        lin([1.0, 2.0])
    with pytest.raises(ValueError, match="per-channel"):
        lin(Q.quantize_per_channel(torch.randn(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.long), 0, Q.qint8))
    with pytest.raises(ValueError, match="in_features=0"):
        nnq.Linear(0, 2)
    with pytest.raises(ValueError, match="scale=-1"):
        lin.set_output_grid(-1.0, 0)
    with pytest.raises(ValueError, match="zero_point=300"):
        lin.set_output_grid(0.1, 300, Q.quint8)
    with pytest.raises(ValueError, match="qint32"):
        lin.set_output_grid(0.1, 0, Q.qint32)
    conv = nnq.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"\(N, 3"):
        conv(torch.randn(1, 2, 5, 5))
    with pytest.raises(ValueError, match="padding_mode='mirror'"):
        nnq.Conv2d(3, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="stride"):
        nnq.Conv2d(3, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="groups=2"):
        nnq.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="kernel_size"):
        nnq.Conv2d(3, 4, (3, 3, 3))
    with pytest.raises(ValueError, match="'same'"):
        nnq.ConvTranspose2d(3, 4, 3, padding="same")
    with pytest.raises(ValueError, match="no qconfig"):
        nnq.Linear.from_float(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="activation_post_process"):
        lin2 = nn.Linear(3, 2)
        lin2.qconfig = QCONFIG
        nnq.Linear.from_float(lin2)
    with pytest.raises(TypeError, match="Conv2d"):
        nnq.Linear.from_float(prepared(nn.Conv2d(1, 1, 1), torch.randn(1, 1, 2, 2)))
    with pytest.raises(TypeError, match="ReLU variant"):
        nnq.Linear.from_float(prepared(nni.LinearReLU(nn.Linear(3, 2), nn.ReLU()), torch.randn(2, 3)))
    bad_w = QConfig(activation=MinMaxObserver.with_args(), weight=MinMaxObserver.with_args(qdtype=Q.quint8))
    with pytest.raises(ValueError, match="signed 8-bit"):
        nnq.Linear.from_float(prepared(nn.Linear(3, 2), torch.randn(2, 3), qconfig=bad_w))
    with pytest.raises(ValueError, match="does not match"):
        lin.set_weight_bias(Q.quantize_per_channel(torch.randn(3, 4), torch.ones(3), torch.zeros(3, dtype=torch.long),
                                                   0, Q.qint8), torch.zeros(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_on_cuda_runs_int_mm_and_matches_cpu() -> None:
    torch.manual_seed(14)
    x = torch.randn(32, 64)
    qmod = nnq.LinearReLU.from_float(prepared(nni.LinearReLU(nn.Linear(64, 24), nn.ReLU()), x))
    qx = quant_in(x)
    y_cpu = qmod(qx)
    qmod.cuda()
    assert qmod._cache == {}
    before = K.counts[("int_mm", "linear")]
    y_gpu = qmod(qx.to("cuda"))
    assert K.counts[("int_mm", "linear")] == before + 1 and y_gpu.device.type == "cuda"
    assert_codes_close(y_gpu.cpu(), y_cpu)
    conv = nnq.Conv2d.from_float(prepared(nn.Conv2d(3, 4, 3), torch.randn(1, 3, 6, 6))).cuda()
    assert conv(torch.randn(1, 3, 6, 6, device="cuda")).device.type == "cuda"  # reference conv on CUDA
