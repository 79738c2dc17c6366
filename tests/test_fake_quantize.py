"""FakeQuantize: parity with torch.ao.quantization.FakeQuantize, STE gradients, switches, state, errors."""

import io

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as tobs

import lowbit as Q

torch.set_num_threads(1)
TQS = {Q.per_tensor_affine: torch.per_tensor_affine, Q.per_tensor_symmetric: torch.per_tensor_symmetric,
       Q.per_channel_affine: torch.per_channel_affine, Q.per_channel_symmetric: torch.per_channel_symmetric}


def fq_pair(obs_name, qscheme, qdtype, **kw):
    ours = Q.FakeQuantize(getattr(Q, obs_name), qscheme=qscheme, qdtype=qdtype, eps=1e-8, **kw)
    theirs = tq.FakeQuantize(getattr(tobs, obs_name), quant_min=qdtype.quant_min, quant_max=qdtype.quant_max,
                             dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], eps=1e-8, **kw)
    return ours, theirs


CASES = [
    ("MovingAverageMinMaxObserver", Q.per_tensor_affine, Q.quint8, {}),
    ("MovingAverageMinMaxObserver", Q.per_tensor_symmetric, Q.qint8, {"averaging_constant": 0.3}),
    ("MinMaxObserver", Q.per_tensor_affine, Q.qint8, {}),
    ("MovingAveragePerChannelMinMaxObserver", Q.per_channel_symmetric, Q.qint8, {"ch_axis": 0}),
    ("PerChannelMinMaxObserver", Q.per_channel_affine, Q.quint8, {"ch_axis": 1}),
]


@pytest.mark.parametrize("obs_name,qscheme,qdtype,kw", CASES)
def test_matches_torch_fake_quantize_values_grads_and_qparams(obs_name, qscheme, qdtype, kw):
    ours, theirs = fq_pair(obs_name, qscheme, qdtype, **kw)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        shape = (6, 5, 700) if step == 4 else (6, 5, 4)         # 21000 elements: past the small-tensor fast path
        x = (torch.randn(shape, generator=g) * (1 + step)).relu_() if step % 2 else torch.randn(shape, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), theirs(xb)
        assert torch.equal(ya, yb), f"step {step}"
        gy = torch.randn(ya.shape, generator=g)
        ya.backward(gy); yb.backward(gy)
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(ours.scale, theirs.scale.reshape(ours.scale.shape))
        assert torch.equal(ours.zero_point, theirs.zero_point.reshape(ours.zero_point.shape).long())
    s, z = ours.calculate_qparams()
    assert torch.equal(s, ours.scale) and torch.equal(z, ours.zero_point)


@pytest.mark.parametrize("quant_min,quant_max,zp", [(0, 255, 128), (-128, 127, 0), (-128, 127, -37), (0, 15, 3)])
def test_functional_equals_torch_fused_kernels(quant_min, quant_max, zp):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=g) * 3
    s = torch.tensor(0.037)
    ties = (torch.arange(-200, 200).float() + 0.5) * s             # exact rounding ties
    for v in (x, ties):
        a, b = v.clone().requires_grad_(), v.clone().requires_grad_()
        ya = Q.fake_quantize(a, s, torch.tensor(zp), quant_min, quant_max)
        yb = torch.fake_quantize_per_tensor_affine(b, s, torch.tensor(zp, dtype=torch.int32), quant_min, quant_max)
        assert torch.equal(ya, yb)
        ya.sum().backward(); yb.sum().backward()
        assert torch.equal(a.grad, b.grad)
    sc, zc = torch.rand(4, generator=g) * 0.05 + 0.01, torch.randint(quant_min, quant_max + 1, (4,), generator=g)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = Q.fake_quantize(a, sc, zc, quant_min, quant_max, ch_axis=0)
    yb = torch.fake_quantize_per_channel_affine(b, sc, zc.int(), 0, quant_min, quant_max)
    assert torch.equal(ya, yb)
    ya.sum().backward(); yb.sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_switches_freeze_and_bypass():
    fq = Q.FakeQuantize()
    fq(torch.randn(64))
    scale = fq.scale.clone()
    assert fq.disable_observer() is fq
    fq(torch.tensor([-100.0, 100.0]))
    assert torch.equal(fq.scale, scale)                  # frozen
    x = torch.randn(10)
    assert fq.disable_fake_quant() is fq and torch.equal(fq(x), x)   # exact identity
    assert fq.enable_fake_quant() is fq and not torch.equal(fq(x), x)
    assert fq.enable_observer() is fq
    fq(torch.tensor([-100.0, 100.0]))
    assert fq.scale > scale


def switches(model):
    return [int(m.observer_enabled) + int(m.fake_quant_enabled) for m in model if isinstance(m, Q.FakeQuantize)]


def test_module_level_switches_apply_to_a_model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Q.FakeQuantize(), torch.nn.ReLU(), Q.FakeQuantize())
    model.apply(Q.disable_observer)
    model.apply(Q.disable_fake_quant)
    assert switches(model) == [0, 0]
    model.apply(Q.enable_observer)
    model.apply(Q.enable_fake_quant)
    assert switches(model) == [2, 2]


def test_switches_and_per_channel_qparams_survive_state_dict():
    fq = Q.FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    w = torch.randn(8, 4)
    fq(w)
    fq.disable_observer()
    buf = io.BytesIO()
    torch.save(fq.state_dict(), buf)
    buf.seek(0)
    fresh = Q.FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert int(fresh.observer_enabled) == 0 and int(fresh.fake_quant_enabled) == 1
    assert fresh.scale.shape == (8,) and torch.equal(fresh.scale, fq.scale)
    assert torch.equal(fresh(w), fq(w))
    assert torch.equal(fresh.calculate_qparams()[0], fq.calculate_qparams()[0])


def test_attributes_defaults_and_with_args():
    fq = Q.FakeQuantize()
    assert isinstance(fq.activation_post_process, Q.MovingAverageMinMaxObserver)
    assert (fq.qdtype, fq.qscheme, fq.ch_axis) == (Q.quint8, Q.per_tensor_affine, None)
    assert (fq.quant_min, fq.quant_max) == (0, 255)
    assert (fq.scale.item(), fq.zero_point.item()) == (1.0, 0)
    make = Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=1)
    a, b = make(), make()
    assert a is not b and a.activation_post_process is not b.activation_post_process
    assert (a.ch_axis, a.qdtype, a.qscheme) == (1, Q.qint8, Q.per_channel_symmetric)
    assert "ch_axis=1" in repr(a) and "fake_quant_enabled=1" in repr(a)


def test_before_any_data_the_grid_is_neutral_and_calculate_qparams_raises():
    fq = Q.FakeQuantize()
    x = torch.randn(0, 3)
    assert fq(x).shape == (0, 3)
    assert (fq.scale.item(), fq.zero_point.item()) == (1.0, 0)
    with pytest.raises(RuntimeError, match="MovingAverageMinMaxObserver"):
        fq.calculate_qparams()


def test_other_observers_plug_in():
    fixed = Q.FakeQuantize(Q.FixedQParamsObserver, scale=1.0 / 256, zero_point=0)
    y = fixed(torch.tensor([0.5, 2.0, -1.0]))
    assert y.tolist() == [0.5, 255 / 256, 0.0] and fixed.scale.item() == 1 / 256
    hold = Q.FakeQuantize(Q.PlaceholderObserver)
    assert torch.equal(hold(torch.tensor([0.25, 3.0])), torch.tensor([0.0, 3.0]))   # neutral grid (1.0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_float_dtypes_keep_their_dtype(dtype):
    fq = Q.FakeQuantize()
    x = torch.randn(4, 8).to(dtype)
    y = fq(x)
    assert y.dtype == dtype
    assert torch.equal(y, Q.fake_quantize(x, fq.scale, fq.zero_point, 0, 255))


def test_bad_arguments():
    with pytest.raises(TypeError, match="observer=3"):
        Q.FakeQuantize(observer=3)
    with pytest.raises(TypeError, match="built a Linear"):
        Q.FakeQuantize(observer=torch.nn.Linear, in_features=2, out_features=2)
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        Q.FakeQuantize()(torch.arange(3))
    with pytest.raises(ValueError, match="averaging_constant=2"):
        Q.FakeQuantize(averaging_constant=2)


@pytest.mark.parametrize("qdtype", [Q.quint8, Q.qint8, Q.qint8.with_range(-127, 127), Q.quint8.with_range(0, 127), Q.qint4])
@pytest.mark.parametrize("ch_axis", [None, 1, -1])
def test_fast_path_is_bit_identical_to_lowbit_fake_quantize(qdtype, ch_axis):
    from lowbit.fake_quant.base import _fake_quantize_fast
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, 7, generator=g) * 4
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30])
    x[1, 1] = (torch.arange(7) - 3.5) * 0.05                          # rounding ties for scale 0.05
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    n = 1 if ch_axis is None else x.shape[ch_axis]
    s = torch.full((n,), 0.05) if ch_axis is not None else torch.tensor(0.05)
    z = torch.randint(qmin, qmax + 1, s.shape, generator=g)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = _fake_quantize_fast(a, s, z, qmin, qmax, ch_axis)
    yb = Q.fake_quantize(b, s, z, qmin, qmax, ch_axis)
    assert torch.equal(ya.isnan(), yb.isnan()) and torch.equal(ya.nan_to_num(), yb.nan_to_num())
    gy = torch.randn(x.shape, generator=g)
    ya.backward(gy); yb.backward(gy)
    assert torch.equal(a.grad, b.grad)


def test_package_attributes_are_the_functions():
    # the FakeQuantize modules are the package lowbit/fake_quant/ and the workflows lowbit/workflow/, so
    # the package attributes Q.fake_quantize / Q.quantize stay the functions
    import lowbit.fake_quant  # noqa: F401
    import lowbit.workflow  # noqa: F401
    assert callable(Q.fake_quantize) and Q.fake_quantize.__module__ == "lowbit.functional"
    assert callable(Q.quantize) and Q.quantize.__module__ == "lowbit.functional"
    assert Q.FakeQuantize.__module__ == "lowbit.fake_quant.base"
