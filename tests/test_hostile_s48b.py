"""Session 48 hostile sweep of the public API surface (review48b): quantized tensors, observers and fake
quantization, QConfig helpers, ONNX running. One test per fixed class; each failed before its fix.

Silent before: a switch method read ``"no"`` / ``2`` as on, ``get_embedding_qconfig(float_qparams="no")`` gave
torch.ao's float-qparams recipe, a per-tensor FakeQuantize adopted a ``(3,)`` grid from a checkpoint (failing on the next
forward, deep), a per-channel observer adopted a 2-d range, a symmetric ``FixedQParamsObserver`` kept an affine zero
point, ``LearnableFakeQuantize`` kept an off-grid zero point and resized past its ``channel_len``, ``QParams`` held a
NaN scale, ``QuantStub`` took torch.ao's QConfig (refused only by ``prepare``), ``averaging_constant=True`` read as 1.0,
``set_object_type(int)`` matched nothing, a lowbit ``QConfig`` of torch.ao observers (or ``nn.Identity``) prepared and
converted to a float model. Deep before: ``fake_quantize`` with a ``str`` bound, ``QTensor`` with a ``str`` scale,
``run_onnx`` on a corrupt file or a misfit input, ``qt.to(Q.qint8)`` (torch's argument parser).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import lowbit as Q

NAN = float("nan")


def test_switch_methods_take_bools_only():
    fq = Q.FakeQuantize()
    for bad in ("no", 2, None, 0.5, torch.tensor([1, 1])):
        with pytest.raises(TypeError, match=r"enabled=.* must be True or False"):
            fq.enable_fake_quant(bad)
        with pytest.raises(TypeError, match=r"enabled=.* must be True or False"):
            fq.enable_observer(bad)
    assert fq.fake_quant_enabled.item() == 1 and fq.observer_enabled.item() == 1  # nothing written
    for ok, on in ((False, 0), (1, 1), (0, 0), (np.bool_(True), 1), (torch.tensor(0), 0), (True, 1)):
        assert fq.enable_observer(ok).observer_enabled.item() == on
    with pytest.raises(TypeError, match="learning_enabled"):
        Q.LearnableFakeQuantize().toggle_qparam_learning("x")


def test_embedding_qconfig_float_qparams_is_a_bool():
    for fn in (Q.get_embedding_qconfig, Q.get_embedding_qat_qconfig):
        with pytest.raises(TypeError, match="float_qparams='no' must be True or False"):
            fn(float_qparams="no")
    assert Q.get_embedding_qconfig(float_qparams=True).weight().qscheme is Q.per_channel_affine_float_qparams


def test_fake_quantize_load_refuses_a_grid_of_the_wrong_shape():
    src = Q.FakeQuantize()
    src(torch.randn(16))
    sd = src.state_dict()
    dst = Q.FakeQuantize()
    with pytest.raises(RuntimeError, match=r"scale: a per-tensor FakeQuantize keeps one value, got shape \(3,\)"):
        dst.load_state_dict({**sd, "scale": torch.ones(3)})
    assert dst.scale.shape == () and dst.zero_point.shape == ()  # state kept
    dst.load_state_dict({**sd, "scale": sd["scale"].reshape(1)})  # torch.ao's (1,) still loads
    pc = Q.FakeQuantize(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    pc(torch.randn(4, 3))
    psd = pc.state_dict()
    fresh = Q.FakeQuantize(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    with pytest.raises(RuntimeError, match=r"per-channel FakeQuantize keeps a \(C,\) vector, got shape \(2, 2\)"):
        fresh.load_state_dict({**psd, "scale": torch.ones(2, 2)})
    with pytest.raises(RuntimeError, match=r"scale shape \(5,\) != zero_point shape \(4,\)"):
        fresh.load_state_dict({**psd, "scale": torch.ones(5)})
    lf = Q.LearnableFakeQuantize()
    lf(torch.randn(8))
    with pytest.raises(RuntimeError, match="per-tensor LearnableFakeQuantize keeps one value"):
        Q.LearnableFakeQuantize().load_state_dict({**lf.state_dict(), "scale": torch.ones(3)})


def test_per_channel_observer_load_refuses_a_2d_range():
    for make in (Q.PerChannelMinMaxObserver, Q.MovingAveragePerChannelMinMaxObserver,
                 lambda: Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)):
        obs = make()
        obs(torch.randn(4, 3))
        sd = obs.state_dict()
        dst = make()
        with pytest.raises(RuntimeError, match=r"per-channel observer keeps a \(C,\) range, got shape \(2, 2\)"):
            dst.load_state_dict({**sd, "min_val": torch.zeros(2, 2), "max_val": torch.ones(2, 2)})
        dst.load_state_dict(sd)
        assert dst.calculate_qparams()[0].shape == (4,)


def test_fake_quantize_bounds_must_be_ints():
    x = torch.randn(5)
    for lo, hi, name in (("0", 255, "quant_min='0'"), (0.5, 255, "quant_min=0.5"), (0, 255.0, "quant_max=255.0"),
                         (True, 255, "quant_min=True")):
        with pytest.raises(TypeError, match=f"fake_quantize: {name} must be an int"):
            Q.fake_quantize(x, 0.1, 0, lo, hi)
    assert Q.fake_quantize(x, 0.1, 0, np.int64(0), 255).shape == (5,)


def test_qtensor_names_qparams_that_are_no_numbers():
    codes = torch.zeros(3, dtype=torch.uint8)
    for scale, zp, shown in (("a", 0, "scale='a'"), (0.1, "b", "zero_point='b'"), (None, 0, "scale=None"),
                             (0.1, [1, "x"], "zero_point=\\[1, 'x'\\]")):
        with pytest.raises(TypeError, match=f"QTensor: .*{shown}.* must be numbers or tensors"):
            Q.QTensor(codes, scale, zp, Q.quint8)
    assert Q.QTensor(codes, np.float32(0.5), np.int64(2), Q.quint8).dequantize().tolist() == [-1.0] * 3  # (pin)


def test_fixed_qparams_observer_symmetric_zero_point_is_pinned():
    with pytest.raises(ValueError, match="zero_point=5 conflicts with qscheme=per_tensor_symmetric.* pinned at 0"):
        Q.FixedQParamsObserver(0.1, 5, qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8)
    with pytest.raises(ValueError, match="pinned at 128"):
        Q.FixedQParamsObserver(0.1, 0, qscheme=Q.per_tensor_symmetric, qdtype=Q.quint8)
    assert Q.FixedQParamsObserver(2 / 256, 128, qscheme=Q.per_tensor_symmetric).calculate_qparams()[1].item() == 128


def test_learnable_zero_point_on_the_grid_and_channel_len_kept():
    with pytest.raises(ValueError, match=r"zero_point=300.0 is outside the lowbit.quint8 grid \[0, 255\]"):
        Q.LearnableFakeQuantize(zero_point=300.0)
    fq = Q.LearnableFakeQuantize(observer=Q.MovingAveragePerChannelMinMaxObserver, channel_len=3, ch_axis=0)
    with pytest.raises(ValueError, match=r"hold 3 channels .* shape \(5, 3\) has 5 along ch_axis=0"):
        fq(torch.randn(5, 3))
    assert fq.scale.shape == (3,) and not torch.isfinite(fq.activation_post_process.min_val).any()  # nothing seen
    assert fq(torch.randn(3, 5)).shape == (3, 5)


def test_run_onnx_names_a_corrupt_file_and_a_misfit_input(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="bad.onnx' is not an ONNX model"):
        run_onnx(bad, torch.randn(2, 8))
    model = nn.Sequential(Q.QuantStub(), nn.Linear(8, 4), Q.DeQuantStub()).eval()
    prepared = Q.prepare(model, Q.get_minmax_qconfig())
    prepared(torch.randn(16, 8))
    path = to_onnx(Q.convert(prepared), torch.randn(2, 8), tmp_path / "m.onnx")
    assert run_onnx(path, torch.randn(5, 8))[0].shape == (5, 4)
    for x, shown in ((torch.randn(2, 7), r"shape \(2, 7\)"), (torch.ones(2, 8, dtype=torch.int64), "torch.int64"),
                     (torch.randn(8), r"shape \(8,\)")):
        with pytest.raises(ValueError, match=f"run_onnx: input 0 .*{shown}.*the model takes tensor\\(float\\)"):
            run_onnx(path, x)


def test_qparams_record_refuses_what_no_quantize_takes():
    t = torch.tensor
    with pytest.raises(ValueError, match="scale=nan must be positive and finite"):
        Q.QParams(t(NAN), t(0), Q.per_tensor_affine, Q.quint8)
    with pytest.raises(ValueError, match=r"zero_point=300 must be integers in \[0, 255\]"):
        Q.QParams(t(0.1), t(300), Q.per_tensor_affine, Q.quint8)
    with pytest.raises(TypeError, match="qscheme='bogus'"):
        Q.QParams(t(0.1), t(0), "bogus", Q.quint8)
    with pytest.raises(ValueError, match="ch_axis=None does not fit qscheme=per_channel_affine"):
        Q.QParams(torch.full((3,), 0.1), torch.zeros(3), Q.per_channel_affine, Q.qint8)
    assert Q.QParams(torch.full((3,), 0.1), torch.full((3,), -0.5), Q.per_channel_affine_float_qparams, Q.quint8,
                     0).ch_axis == 0


def test_stubs_refuse_torch_ao_qconfig():
    import torch.ao.quantization as tq

    for stub in (Q.QuantStub, Q.DeQuantStub):
        with pytest.raises(TypeError, match="qconfig must be a lowbit QConfig or None, got torch.ao"):
            stub(qconfig=tq.default_qconfig)
    assert Q.QuantStub(qconfig=Q.get_minmax_qconfig()).qconfig is not None


def test_qtensor_to_a_lowbit_grid():
    qt = Q.quantize_per_tensor(torch.randn(3), 0.1, 128, Q.quint8)
    for call in (lambda: qt.to(Q.qint8), lambda: qt.to(dtype=Q.qint8), lambda: qt.to("cpu", Q.qint4)):
        with pytest.raises(TypeError, match=r"QTensor.to\(lowbit.qint[48]\): a lowbit.quint8 QTensor cannot change"):
            call()
    with pytest.raises(TypeError, match=r"QTensor.type\(lowbit.qint8\)"):
        qt.type(Q.qint8)
    for same in (qt.to(Q.quint8), qt.to("cpu", dtype=Q.quint8), qt.type(Q.quint8)):  # its own grid: a no-op, as torch
        assert same.qdtype == Q.quint8 and torch.equal(same.int_repr(), qt.int_repr())


def test_averaging_constant_and_object_type_refuse_look_alikes():
    with pytest.raises(TypeError, match="averaging_constant=True must be a number"):
        Q.MovingAverageMinMaxObserver(averaging_constant=True)
    for cls in (int, torch.Tensor):
        with pytest.raises(TypeError, match="must be a module class"):
            Q.QConfigMapping().set_object_type(cls, Q.get_minmax_qconfig())
    assert nn.Linear in Q.QConfigMapping().set_object_type(nn.Linear, None).object_type_qconfigs


def test_qconfig_factories_must_build_lowbit_observers():
    import torch.ao.quantization as tq

    def prepared(qconfig):
        return Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval(), qconfig)

    with pytest.raises(TypeError, match=r"qconfig.activation\(\) built a torch.ao.quantization.observer.MinMaxObserver, "
                                        r"not a lowbit observer.*lowbit.MinMaxObserver"):
        prepared(Q.QConfig(activation=tq.MinMaxObserver, weight=tq.default_weight_observer))  # (was a float model)
    with pytest.raises(TypeError, match=r"built a torch.nn.modules.linear.Identity"):
        prepared(Q.QConfig(activation=lambda: nn.Identity(), weight=Q.PerChannelMinMaxObserver))
    p = prepared(Q.QConfig(activation=Q.MinMaxObserver, weight=lambda: 3))
    p(torch.randn(3, 4))
    with pytest.raises(TypeError, match=r"module '1'.*qconfig.weight\(\) built a builtins.int"):
        Q.convert(p)
    with pytest.raises(TypeError, match=r"qconfig.weight\(\) built a torch.ao.quantization.fake_quantize.FakeQuantize"):
        Q.prepare_qat(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).train(),
                      Q.QConfig(activation=Q.FakeQuantize, weight=tq.default_weight_fake_quant))
