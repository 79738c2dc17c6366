"""LearnableFakeQuantize (LSQ/LSQ+): parity with torch.ao's _LearnableFakeQuantize, phases, state, QAT loop, errors."""

import io
import math
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import lowbit as Q
from nets import StubMLP
from lowbit.fake_quant import enable_param_learning, enable_static_observation, fake_quantize_learnable

torch.set_num_threads(1)
TQS = {Q.per_tensor_affine: torch.per_tensor_affine, Q.per_tensor_symmetric: torch.per_tensor_symmetric,
       Q.per_channel_affine: torch.per_channel_affine, Q.per_channel_symmetric: torch.per_channel_symmetric}


def torch_learnable(x, s, z, qmin, qmax, axis, gf):
    if axis is None:
        return torch._fake_quantize_learnable_per_tensor_affine(x, s.reshape(1), z.reshape(1), qmin, qmax, gf)
    return torch._fake_quantize_learnable_per_channel_affine(x, s, z, axis, qmin, qmax, gf)


def grads(fn, x, s, z, gy):
    x, s, z = (t.clone().requires_grad_() for t in (x, s, z))
    y = fn(x, s, z)
    y.backward(gy)
    return y, x.grad, s.grad.reshape(-1), z.grad.reshape(-1)


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       per_channel=st.booleans(), axis_pick=st.integers(0, 3), log_scale=st.floats(-6, 0),
       grid=st.sampled_from([(0, 255), (-128, 127), (-8, 7), (0, 15)]), zp_frac=st.sampled_from([0.0, 0.25, 0.4]),
       scaled=st.booleans())
def test_property_functional_matches_torch_learnable_kernels(shape, seed, per_channel, axis_pick, log_scale, grid,
                                                             zp_frac, scaled):
    """Values and gradients w.r.t. x, scale and zero point are bit-identical to torch's LSQ kernels."""
    g = torch.Generator().manual_seed(seed)
    qmin, qmax = grid
    if per_channel and len(shape) == 1:
        shape = shape + [3]  # torch's per-channel backward returns a 0-d gradient for a 1-d input (its bug)
    axis = axis_pick % len(shape) if per_channel else None
    c = shape[axis] if per_channel else 1
    x = torch.randn(shape, generator=g) * 3
    s = torch.exp2(torch.full((c,), log_scale) + torch.rand(c, generator=g))
    z = torch.randint(qmin, qmax + 1, (c,), generator=g).float()
    z = (z + zp_frac).clamp(max=qmax)
    if not per_channel:  # torch's per-tensor backward truncates z + 0.5: one code off for every negative z
        z = z.clamp(min=0)
    gf = 1 / math.sqrt(x.numel() * qmax) if scaled else 1.0
    gy = torch.randn(shape, generator=g)
    ours = grads(lambda a, b, d: fake_quantize_learnable(a, b if per_channel else b.reshape(()),
                                                         d if per_channel else d.reshape(()), qmin, qmax, axis, gf),
                 x, s, z, gy)
    theirs = grads(lambda a, b, d: torch_learnable(a, b, d, qmin, qmax, axis, gf), x, s, z, gy)
    for name, a, b in zip(("y", "dx", "dscale", "dzero_point"), ours, theirs):
        assert torch.equal(a, b), name


def lsq_pair(qscheme, qdtype, ch_axis=None, c=4, **kw):
    channel = {} if ch_axis is None else {"ch_axis": ch_axis}
    obs, tobs = ((Q.MovingAveragePerChannelMinMaxObserver, tq.MovingAveragePerChannelMinMaxObserver) if ch_axis is not None
                 else (Q.MovingAverageMinMaxObserver, tq.MovingAverageMinMaxObserver))
    ours = Q.LearnableFakeQuantize(obs, qscheme=qscheme, qdtype=qdtype, averaging_constant=0.5, eps=1e-8, **channel, **kw)
    theirs = _LearnableFakeQuantize(tobs, quant_min=qdtype.quant_min, quant_max=qdtype.quant_max,
                                    dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], averaging_constant=0.5, eps=1e-8,
                                    channel_len=-1 if ch_axis is None else c, **channel, **kw)
    theirs.toggle_qparam_learning(False)  # torch's __init__ leaves requires_grad on while learning is off
    return ours, theirs


@pytest.mark.parametrize("qscheme,qdtype,ch_axis,scaling", [
    (Q.per_tensor_affine, Q.quint8, None, False), (Q.per_tensor_affine, Q.quint8.with_range(0, 15), None, True),
    (Q.per_tensor_symmetric, Q.qint8, None, True), (Q.per_channel_symmetric, Q.qint8, 0, True),
    (Q.per_channel_affine, Q.quint8, 1, False),
])
def test_module_matches_torch_through_static_and_learning_phases(qscheme, qdtype, ch_axis, scaling):
    ours, theirs = lsq_pair(qscheme, qdtype, ch_axis, use_grad_scaling=scaling)
    opt_a = torch.optim.Adam(ours.parameters(), lr=1e-3)
    opt_b = torch.optim.Adam(theirs.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    for step in range(7):
        if step == 2:
            ours.enable_param_learning(), theirs.enable_param_learning()
        x = torch.randn(4, 4, 5, generator=g) * (1 + step % 3) + 0.3
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), theirs(xb)
        assert torch.equal(ya, yb), step
        gy = torch.randn(x.shape, generator=g)
        for opt in (opt_a, opt_b):
            opt.zero_grad()
        ya.backward(gy), yb.backward(gy)
        assert torch.equal(xa.grad, xb.grad), step
        if step >= 2:  # learning: the parameter gradients match
            assert torch.equal(ours.scale.grad.reshape(-1), theirs.scale.grad), step
            if not qscheme.is_symmetric:
                assert torch.equal(ours.zero_point.grad.reshape(-1), theirs.zero_point.grad), step
            else:
                assert ours.zero_point.grad is None  # pinned, not trained (torch computes and discards it)
        opt_a.step(), opt_b.step()
        assert torch.equal(ours.scale.detach().reshape(-1), theirs.scale.detach())
    s, z = ours.calculate_qparams()
    ts, tz = theirs.calculate_qparams()
    assert torch.equal(s.reshape(-1), ts) and torch.equal(z.reshape(-1), tz)


def test_departure_backward_uses_the_forward_zero_point():
    """torch's per-tensor backward truncates z + 0.5 (-4 -> -3 while the forward used -4); lowbit
    differentiates the function it computed. It equals torch's gradients wherever torch's backward
    zero point is right (z >= 0), and differs at the grid's edge for a negative one."""
    k = torch.arange(-130.0, 136.0)
    x, s, z, gy = k * 0.25, torch.tensor(0.25), torch.tensor(-4.0), torch.ones(k.shape)   # x / s = k exactly
    ours = grads(lambda a, b, d: fake_quantize_learnable(a, b, d, -128, 127), x, s, z, gy)
    theirs = grads(lambda a, b, d: torch_learnable(a, b, d, -128, 127, None, 1.0), x, s, z, gy)
    assert torch.equal(ours[0], theirs[0])                        # same forward: codes k - 4, clipped
    edge = (k == 131) | (k == -125)                               # codes 127 (inside) and -129 (clipped)
    assert ours[1][edge].tolist() == [0.0, 1.0] and theirs[1][edge].tolist() == [1.0, 0.0]
    assert torch.equal(ours[1][~edge], theirs[1][~edge]) and not torch.equal(ours[2], theirs[2])
    for zp in (torch.tensor(3.0), torch.tensor(3.4)):             # z >= 0: identical
        a = grads(lambda a, b, d: fake_quantize_learnable(a, b, d, -128, 127), x, s, zp, gy)
        b = grads(lambda a, b, d: torch_learnable(a, b, d, -128, 127, None, 1.0), x, s, zp, gy)
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_departure_per_channel_ties_follow_the_forward():
    """At exact ties x / s = k + 1/2 with an odd zero point, torch's per-channel backward rounds z + x / s
    jointly (to the other side); lowbit's gradient is that of round(x / s) + z, which the forward uses."""
    s, z = torch.tensor([1.0]), torch.tensor([1.0])
    x = torch.tensor([[0.5], [2.5]])                              # round-half-even: codes 0 + 1, 2 + 1
    _, _, ds, _ = grads(lambda a, b, d: fake_quantize_learnable(a, b, d, 0, 255, 1), x, s, z, torch.ones(2, 1))
    assert ds.tolist() == [(0.0 - 0.5) + (2.0 - 2.5)]             # (y - x) / s summed over the channel
    _, _, tds, _ = grads(lambda a, b, d: torch_learnable(a, b, d, 0, 255, 1, 1.0), x, s, z, torch.ones(2, 1))
    assert tds.tolist() != ds.tolist()


def test_symmetric_zero_point_is_pinned_and_quint8_uses_the_midpoint():
    fq = Q.LearnableFakeQuantize(Q.MovingAverageMinMaxObserver, qscheme=Q.per_tensor_symmetric, qdtype=Q.quint8)
    fq(torch.tensor([-1.0, 2.0]))
    assert fq.zero_point.item() == 128 and fq.calculate_qparams()[1].item() == 128
    fq.enable_param_learning()
    assert fq.scale.requires_grad and not fq.zero_point.requires_grad
    with torch.no_grad():
        fq.zero_point.fill_(7.0)
    fq(torch.tensor([0.3]))
    assert fq.zero_point.item() == 128


def test_nan_propagates_without_poisoning_parameter_gradients():
    fq = Q.LearnableFakeQuantize(qdtype=Q.quint8)
    fq(torch.tensor([-1.0, 3.0]))
    fq.enable_param_learning()
    x = torch.tensor([float("nan"), 0.51, 9.0], requires_grad=True)
    y = fq(x)
    y.sum().backward()
    assert math.isnan(y[0].item()) and torch.isfinite(fq.scale.grad).all() and torch.isfinite(fq.zero_point.grad).all()
    assert x.grad.tolist() == [0.0, 1.0, 0.0]


def test_parameter_gradients_take_the_parameter_shape():
    s, z = torch.tensor([0.1], requires_grad=True), torch.tensor([3.0], requires_grad=True)   # (1,) per tensor
    fake_quantize_learnable(torch.randn(4, 3), s, z, 0, 255).sum().backward()
    w = torch.randn(5, requires_grad=True)
    sc = torch.full((5,), 0.1, requires_grad=True)
    fake_quantize_learnable(w, sc, torch.zeros(5), -8, 7, ch_axis=0).sum().backward()    # 1-d, per channel
    assert s.grad.shape == (1,) and z.grad.shape == (1,) and sc.grad.shape == (5,) and w.grad.shape == (5,)


def test_reduced_precision_input_keeps_dtype_and_trains():
    fq = Q.LearnableFakeQuantize(qdtype=Q.qint8, scale=0.1).enable_param_learning()
    x = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    y = fq(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and fq.scale.grad is not None


def test_phases_switches_and_model_apply_helpers():
    fq = Q.LearnableFakeQuantize(qdtype=Q.quint8)
    assert fq.static_enabled is fq.observer_enabled and fq.learning_enabled.item() == 0
    assert not fq.scale.requires_grad                                # nothing learns until asked
    m = nn.Sequential(fq)
    m.apply(enable_static_observation)
    x = torch.tensor([-1.0, 0.123, 3.0])
    assert torch.equal(m(x), x) and fq.scale.item() == pytest.approx(4 / 255)   # observed, not quantized
    m.apply(enable_param_learning)
    assert (fq.learning_enabled.item(), fq.observer_enabled.item(), fq.fake_quant_enabled.item()) == (1, 0, 1)
    with torch.no_grad():
        fq.scale.fill_(-1.0)                                         # an optimizer overshoot
    m(x)
    assert fq.scale.item() == pytest.approx(fq.eps)                  # clamped to eps before use
    m.apply(Q.enable_observer)                                       # lowbit's generic switch: static again
    m(x)
    assert fq.scale.item() == pytest.approx(4 / 255)
    fq.enable_static_estimate()
    assert (fq.learning_enabled.item(), fq.observer_enabled.item(), fq.fake_quant_enabled.item()) == (0, 1, 1)


def test_calculate_qparams_returns_learned_values():
    fq = Q.LearnableFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme=Q.per_channel_affine,
                                 qdtype=Q.quint8)
    fq(torch.randn(3, 5))
    with torch.no_grad():
        fq.scale.copy_(torch.tensor([0.5, 0.25, 0.125]))
        fq.zero_point.copy_(torch.tensor([3.4, 300.0, -2.0]))
    s, z = fq.calculate_qparams()
    assert s.tolist() == [0.5, 0.25, 0.125] and z.tolist() == [3, 255, 0] and z.dtype == torch.int64


def test_state_dict_round_trip_repr_and_with_args():
    factory = Q.LearnableFakeQuantize.with_args(observer=Q.PerChannelMinMaxObserver, ch_axis=0, use_grad_scaling=True)
    a = factory()
    a(torch.randn(4, 6))
    a.enable_param_learning()
    with torch.no_grad():
        a.scale.mul_(1.5)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = factory()                                                    # fresh: 0-d parameters, adopts (4,)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert torch.equal(a.scale, b.scale) and b.learning_enabled.item() == 1
    b.enable_param_learning()
    w = torch.randn(4, 6)
    assert torch.equal(a(w), b(w))
    r = repr(b)
    assert "learning_enabled=1" in r and "use_grad_scaling=True" in r and "per_channel_symmetric" in r
    c = Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0, channel_len=4)
    assert c.scale.shape == (4,) and isinstance(c.scale, nn.Parameter)


def test_lsq_qat_loop_learns_scales_and_converts_to_the_same_outputs():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x[:, :4].argmax(1)
    qat = Q.prepare_qat(Q.fuse_modules_qat(StubMLP(), [["fc1", "relu"]]), Q.get_lsq_qat_qconfig())
    assert type(qat.fc2.weight_fake_quant) is Q.LearnableFakeQuantize
    opt = torch.optim.Adam(qat.parameters(), lr=1e-2)
    losses, start = [], {}
    for step in range(40):
        if step == 3:  # three static batches initialise the grids, then they are learned
            qat.apply(enable_param_learning)
            start = {n: m.scale.detach().clone() for n, m in qat.named_modules() if isinstance(m, Q.LearnableFakeQuantize)}
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    for name in ("quant.activation_post_process", "fc1.weight_fake_quant", "fc1.activation_post_process",
                 "fc2.weight_fake_quant", "fc2.activation_post_process"):
        m = qat.get_submodule(name)
        moved = ((m.scale.detach() - start[name]).abs() / start[name]).max().item()
        assert moved > 1e-3, name                                    # the learned scales moved
    qat.eval()
    ref = qat(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Q.convert(qat)
    s_out, _ = qat.fc2.activation_post_process.calculate_qparams()
    assert q.fc2.scale.item() == s_out.item()                        # convert read the learned grid
    assert (q(x) - ref).abs().max().item() <= s_out.item() * (1 + 1e-5)   # within one output quantum


@pytest.mark.parametrize("kwargs,err,match", [
    ({"scale": 0.0}, ValueError, "scale=0.0"), ({"scale": float("inf")}, ValueError, "scale=inf"),
    ({"zero_point": float("nan")}, ValueError, "zero_point=nan"), ({"use_grad_scaling": 1}, TypeError, "use_grad_scaling=1"),
    ({"channel_len": 4}, ValueError, "channel_len=4 needs a per-channel"),
    ({"qscheme": Q.per_tensor_symmetric, "qdtype": Q.qint8, "zero_point": 3}, ValueError, "zero_point=3 conflicts"),
    ({"observer": 3}, TypeError, "observer=3"),
])
def test_bad_constructor_arguments_name_the_value(kwargs, err, match):
    with pytest.raises(err, match=match):
        Q.LearnableFakeQuantize(**kwargs)
    with pytest.raises(ValueError, match="channel_len=0"):
        Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0, channel_len=0)


def test_bad_forward_and_functional_arguments_name_the_value():
    fq = Q.LearnableFakeQuantize()
    with pytest.raises(TypeError, match="torch.int64"):
        fq(torch.tensor([1, 2]))
    x, s, z = torch.randn(3, 4), torch.ones(3), torch.zeros(3)
    with pytest.raises(ValueError, match=r"scale of shape \(3,\) does not fit ch_axis=1"):
        fake_quantize_learnable(x, s, z, 0, 255, ch_axis=1)
    with pytest.raises(ValueError, match="ch_axis=2 is out of range"):
        fake_quantize_learnable(x, s, z, 0, 255, ch_axis=2)
    with pytest.raises(ValueError, match="grad_factor=0"):
        fake_quantize_learnable(x, s, z, 0, 255, ch_axis=0, grad_factor=0)
    with pytest.raises(ValueError, match="quant_min=5 must be < quant_max=5"):
        fake_quantize_learnable(x, s, z, 5, 5, ch_axis=0)
    with pytest.raises(TypeError, match="zero_point must be a tensor"):
        fake_quantize_learnable(x, torch.tensor(1.0), 0.0, 0, 255)
