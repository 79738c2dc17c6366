"""Bilinear resampling on the codes (session 39): ``F.interpolate(mode="bilinear")`` / ``nn.Upsample(mode="bilinear")``
/ ``nn.UpsamplingBilinear2d`` / ``F.upsample_bilinear`` of a QTensor ran on dequantized floats (eager: a float
output and a warning; graph mode: a DeQuantize + Quantize pair around a UNet decoder's upsample). Now it runs torch's
quantized CPU kernel's math on the codes, on the input's grid. Oracle: torch's ``quantized`` bilinear kernel on
``torch.quantize_per_tensor`` inputs (code for code) and torch.ao's converted graph (node counts, codes).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import helpers
from helpers import Fn, one_thread  # noqa: F401  (autouse: one thread)
from lowbit.nn.quantized.stubs import DeQuantize, Quantize
from lowbit.qtensor.resample import bilinear_codes
from lowbit.reference.fx import convert_to_reference_fx

_TORCH = {Q.quint8: torch.quint8, Q.qint8: torch.qint8, Q.qint32: torch.qint32}


def _torch_q(x: torch.Tensor, scale: float, zp: int, qd) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's quantized tensors are deprecated)
        return torch.quantize_per_tensor(x, scale, zp, _TORCH[qd])


def _cases(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        qd = rng.choice([Q.quint8, Q.qint8, Q.qint32])
        zp = rng.randint(0, 255) if qd is Q.quint8 else rng.randint(-128, 127)
        shape = (rng.randint(1, 2), rng.choice([1, 3, 8, 17, 32]), rng.randint(1, 9), rng.randint(1, 9))
        kind = rng.choice(["size", "scale", "recompute"])
        if kind == "size":
            kw = {"size": (rng.randint(1, 19), rng.randint(1, 19))}
        else:
            kw = {"scale_factor": (rng.choice([0.5, 0.7, 1.0, 1.1, 1.5, 2.0, 2.3, 3.0]), rng.choice([0.6, 1.0, 1.7, 2.0])),
                  "recompute_scale_factor": kind == "recompute"}
        yield qd, zp, shape, rng.random() < 0.5, rng.random() < 0.5, kw


def test_codes_equal_torchs_quantized_kernel():
    """250 random cases (quint8 / qint8 / qint32, contiguous and channels-last, align_corners both ways, size /
    scale_factor / recompute_scale_factor, odd sizes, up- and downsampling): the QTensor's codes equal torch's
    quantized ``upsample_bilinear2d`` on NCHW code for code (before: a float tensor came back, with a warning), in
    either layout: one definition. torch's NHWC kernel fuses multiply-adds per CPU build, so it moves near-ties by one
    step against its own NCHW kernel; lowbit is within one step of it, on a small share of the codes."""
    torch.manual_seed(0)
    checked, exact, moved, total = 0, 0, 0, 0
    for qd, zp, shape, channels_last, align, kw in _cases(250, 0):
        if shape[2] == shape[3] == 1 and shape[1] > 1:
            continue  # torch runs its NHWC kernel on a 1x1 input (either layout), which scrambles the channels
        x = torch.randn(shape)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        tq = _torch_q(x, 0.02, zp, qd)
        try:
            want = F.interpolate(tq, mode="bilinear", align_corners=align, **kw)  # torch's NCHW kernel
        except RuntimeError:
            continue  # (an empty output size: torch's error, checked below)
        qt = Q.quantize_per_tensor(x, 0.02, zp, qd)
        qt = Q.QTensor(qt.int_repr().contiguous(memory_format=fmt), qt.scale, qt.zero_point, qd, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the float fallback warns)
            got = F.interpolate(qt, mode="bilinear", align_corners=align, **kw)
        assert isinstance(got, Q.QTensor) and got.q_scale() == qt.q_scale() and got.q_zero_point() == zp
        assert got.int_repr().is_contiguous(memory_format=fmt)
        plain = Q.QTensor(qt.int_repr().contiguous(), qt.scale, qt.zero_point, qd, None)
        assert torch.equal(got.int_repr(), F.interpolate(plain, mode="bilinear", align_corners=align, **kw).int_repr())
        if not tq.is_contiguous(memory_format=torch.channels_last):  # (C = 1 is both: torch runs its NHWC kernel)
            assert torch.equal(got.int_repr(), want.int_repr()), (qd, zp, shape, channels_last, align, kw)
            exact += 1
        else:
            nhwc = F.interpolate(tq.contiguous(memory_format=torch.channels_last), mode="bilinear",
                                 align_corners=align, **kw)
            d = (got.int_repr().int() - nhwc.int_repr().int()).abs()
            assert int(d.max()) <= 1, (qd, zp, shape, align, kw)
            moved, total = moved + int(d.sum()), total + d.numel()
        checked += 1
    assert checked > 200 and exact > 150 and moved <= 0.01 * total


def test_ties_follow_torch_not_the_float_op():
    """An exact average ``k + 0.5`` (2x upsampling: weights 1/4, 3/4) rounds as torch's kernel (``z + (v - z)`` in
    float32, to even), not as the float op requantized: a fake-quant simulation would pick the other code."""
    q = torch.tensor([[[[10, 11], [12, 14]]]], dtype=torch.uint8)
    for z in (0, 3, 41):
        tq = torch._make_per_tensor_quantized_tensor(q, 0.1, z)
        want = F.interpolate(tq, scale_factor=2, mode="bilinear").int_repr()
        assert torch.equal(bilinear_codes(q, torch.tensor(z), 0, 255, (4, 4), False), want)


@pytest.mark.parametrize("up", [nn.Upsample(scale_factor=2, mode="bilinear"), nn.UpsamplingBilinear2d(size=(7, 5)),
                                lambda t: F.upsample_bilinear(t, scale_factor=2),
                                lambda t: F.upsample(t, scale_factor=1.5, mode="bilinear")],
                         ids=["Upsample", "UpsamplingBilinear2d", "F.upsample_bilinear", "F.upsample"])
def test_module_and_legacy_forms_keep_the_grid(up):
    x = torch.randn(2, 3, 5, 4)
    qt = Q.quantize_per_tensor(x, 0.03, 7, Q.quint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's deprecation notices of F.upsample*)
        warnings.simplefilter("error", RuntimeWarning)
        got = up(qt)
        want = up(_torch_q(x, 0.03, 7, Q.quint8))
    assert isinstance(got, Q.QTensor) and torch.equal(got.int_repr(), want.int_repr())


def test_per_channel_uses_each_channels_zero_point():
    """Per channel on axis 1 (torch has no per-channel bilinear): each channel as torch's per-tensor kernel."""
    x = torch.randn(2, 3, 5, 6)
    scales, zps = torch.tensor([0.01, 0.02, 0.05]), torch.tensor([3, 128, 200])
    qt = Q.quantize_per_channel(x, scales, zps, 1, Q.quint8)
    got = F.interpolate(qt, size=(9, 4), mode="bilinear", align_corners=True)
    assert isinstance(got, Q.QTensor) and got.q_per_channel_axis() == 1
    for c in range(3):
        tq = torch._make_per_tensor_quantized_tensor(qt.int_repr()[:, c:c + 1].contiguous(), float(scales[c]),
                                                     int(zps[c]))
        want = F.interpolate(tq, size=(9, 4), mode="bilinear", align_corners=True).int_repr()
        assert torch.equal(got.int_repr()[:, c:c + 1], want)


def test_antialias_bicubic_stay_float_and_bad_arguments_are_torchs_errors():
    """antialias=True / bicubic have no quantized kernel (torch's neither): float values, warned (a decision: as
    the float op, not refused). Bad arguments raise torch's own one-line errors before any work."""
    qt = Q.quantize_per_tensor(torch.randn(1, 2, 4, 4), 0.05, 0, Q.qint8)
    for kw in ({"mode": "bilinear", "antialias": True}, {"mode": "bicubic"}):
        with pytest.warns(UserWarning, match="no integer implementation"):
            from lowbit.qtensor import _warned_ops
            _warned_ops.clear()
            out = F.interpolate(qt, scale_factor=2, **kw)
        assert not isinstance(out, Q.QTensor)
    with pytest.raises(ValueError, match="only one of size or scale_factor"):
        F.interpolate(qt, size=(3, 3), scale_factor=2, mode="bilinear")
    with pytest.raises(ValueError, match="spatial dimensions.*\\[4, 4\\].*\\(3,\\)"):
        F.interpolate(qt, size=(3,), mode="bilinear")


def UNet(up: nn.Module) -> nn.Module:
    return helpers.UNet(up, width=8)


def _q_dq(gm: nn.Module) -> tuple[int, int]:
    mods = dict(gm.named_modules())
    kinds = [type(mods[n.target]) for n in gm.graph.nodes if n.op == "call_module"]
    return kinds.count(Quantize), kinds.count(DeQuantize)


def _ao_convert(model: nn.Module, x: torch.Tensor) -> nn.Module:
    from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver, QConfig, QConfigMapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
    qc = QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=True),
                 weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = prepare_fx(copy.deepcopy(model), QConfigMapping().set_global(qc), (x,))
        p(x)
        return convert_fx(p)


def _lowbit_convert(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    # 7-bit activations (torch's reduce_range): torch.ao's x86 u8 x s8 pair sums saturate on this AVX2 CPU otherwise
    seven_bit = Q.QConfig(activation=Q.MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),
                          weight=Q.get_minmax_qconfig().weight)
    p = Q.prepare_fx(copy.deepcopy(model), Q.QConfigMapping().set_global(seven_bit), (x,))
    p(x)
    return Q.convert_fx(copy.deepcopy(p)), p


UPS = {
    "F.interpolate": Fn(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")),
    "F.interpolate-size-align": Fn(lambda t: F.interpolate(t, size=(12, 12), mode="bilinear", align_corners=True)),
    "F.upsample_bilinear": Fn(lambda t: F.upsample_bilinear(t, scale_factor=2)),
    "Upsample": nn.Upsample(scale_factor=2, mode="bilinear"),
    "UpsamplingBilinear2d": nn.UpsamplingBilinear2d(scale_factor=2),
}


@pytest.mark.parametrize("name", list(UPS))
def test_unet_upsample_stays_int8(name):
    """A UNet decoder's bilinear upsample sat between a DeQuantize and a Quantize (2 / 2); now 1 / 1. torch.ao: 1 / 1
    for the functional forms, 2 / 2 for the module forms (its x86 backend config shares no Upsample module)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    model = UNet(UPS[name]).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (F.upsample_bilinear is deprecated)
        q, _ = _lowbit_convert(model, x)
        ao = _ao_convert(model, x)
    assert _q_dq(q) == (1, 1) and not q.lowbit_report.left_float
    ao_q = ao.code.count("torch.quantize_per_tensor(")
    assert ao_q == (2 if name in ("Upsample", "UpsamplingBilinear2d") else 1)


class ConvUp(nn.Module):
    def __init__(self, up: nn.Module) -> None:
        super().__init__()
        self.c1, self.up = nn.Conv2d(3, 8, 3, padding=1), up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.c1(x))


@pytest.mark.parametrize("name", ["F.interpolate", "F.interpolate-size-align", "F.upsample_bilinear"])
def test_converted_upsample_is_torch_ao_within_one_step(name):
    """conv → bilinear upsample, converted by both (MinMax activations, per-channel symmetric weights): the
    upsample's codes equal torch.ao's wherever the conv's codes do (they differ only at the conv's requantization
    ties, a deliberate difference of lowbit's conv epilogue), and never by more than one step."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 10, 10)
    model = ConvUp(UPS[name]).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q, _ = _lowbit_convert(model, x)
        ao = _ao_convert(model, x)
        conv_q = q.c1(q.quantize_1(x))
        conv_ao = ao.c1(torch.quantize_per_tensor(x, float(ao.c1_input_scale_0), int(ao.c1_input_zero_point_0),
                                                  torch.quint8))
        up_ao = UPS[name](conv_ao).int_repr()
    assert conv_q.q_scale() == conv_ao.q_scale() and conv_q.q_zero_point() == conv_ao.q_zero_point()
    # lowbit's upsample on torch.ao's conv codes: torch's NCHW kernel's codes exactly, within one step of the
    # NHWC kernel torch.ao's channels-last conv output runs (its fused multiply-adds move near-ties)
    same_in = Q.QTensor(conv_ao.int_repr(), conv_q.scale, conv_q.zero_point, Q.quint8, None)
    assert torch.equal(UPS[name](same_in).int_repr(), UPS[name](conv_ao.contiguous()).int_repr())
    assert (UPS[name](same_in).int_repr().int() - up_ao.int()).abs().max() <= 1
    step = conv_q.q_scale()
    diff = (q(x) - ao(x)).abs()
    assert diff.max() <= step * 1.001
    assert (diff > 0).float().mean() <= 0.02


def test_prepared_model_rounds_onto_the_input_grid():
    """The prepared graph calls the input's observer again after the upsample (torch.ao's shared observer): QAT
    fake-quantizes the averaged values on the input's grid; the reference model holds them on that grid and is
    within one step of the int8 model (exact but at the kernel's near-ties); convert drops the second call."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    model = UNet(UPS["F.interpolate"]).train()
    p = Q.prepare_qat_fx(copy.deepcopy(model), Q.get_default_qat_qconfig_mapping(), (x,))
    calls = [n for n in p.graph.nodes if n.meta.get("lowbit_kind") == "obs_share"]
    assert len(calls) == 1 and calls[0].target == calls[0].args[0].args[0].target
    p(x)
    p.eval()
    seen: list[torch.Tensor] = []
    h = p.get_submodule(calls[0].target).register_forward_hook(lambda m, i, o: seen.append(o))
    p(x)
    h.remove()
    fq = p.get_submodule(calls[0].target)
    assert seen[1].shape[-1] == 12  # (its second call: the upsample's output)
    codes = seen[1] / fq.scale + fq.zero_point
    assert torch.allclose(codes, codes.round(), atol=1e-3)  # on the grid (it was off it: float averages)
    q = Q.convert_fx(copy.deepcopy(p))
    assert _q_dq(q) == (1, 1)
    ref = convert_to_reference_fx(copy.deepcopy(p))
    with torch.no_grad():
        got, want = q(x), ref(x)
    assert (got - want).abs().max() <= float(q.c3.scale) * 1.001


def test_compile_and_export_of_a_converted_upsample():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    q, _ = _lowbit_convert(UNet(UPS["F.interpolate"]).eval(), x)
    want = q(x)
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), want)
    ep = torch.export.export(q, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    assert torch.equal(ep.module()(x), want)
    assert torch.equal(ep.module()(x[:1]), q(x[:1]))


def test_lsq_qat_trains_through_the_shared_grid_call():
    """The prepared graph calls the upsample input's fake-quant a second time (``obs_share``); with LSQ
    (``LearnableFakeQuantize``) that call moved the scale in place while the first call's backward still held it:
    "modified by an inplace operation" at the first ``backward()``. Its updates now go through ``.data``, as torch.ao's."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    p = Q.prepare_qat_fx(UNet(UPS["F.interpolate"]).train(), Q.QConfigMapping().set_global(Q.get_lsq_qat_qconfig()),
                         (x,))
    assert any(n.meta.get("lowbit_kind") == "obs_share" for n in p.graph.nodes)
    opt = torch.optim.SGD(p.parameters(), lr=1e-3)
    for step in range(4):
        if step == 2:
            p.apply(lambda m: m.enable_param_learning() if hasattr(m, "enable_param_learning") else None)
        opt.zero_grad()
        p(x).square().mean().backward()
        opt.step()
    q = Q.convert_fx(p.eval())
    assert _q_dq(q) == (1, 1) and torch.isfinite(q(x)).all()
