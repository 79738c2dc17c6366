"""FusedMovingAvgObsFakeQuantize: parity with torch.ao over batch sequences (both paths), qparams, edges, QAT loop."""

import io
import math
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q
from nets import StubMLP
from lowbit.fake_quant import choose_qparams_fbgemm

torch.set_num_threads(1)
TQS = {Q.per_tensor_affine: torch.per_tensor_affine, Q.per_tensor_symmetric: torch.per_tensor_symmetric,
       Q.per_channel_affine: torch.per_channel_affine, Q.per_channel_symmetric: torch.per_channel_symmetric}
SCHEMES = [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_symmetric, Q.qint8), (Q.per_tensor_affine, Q.qint8),
           (Q.per_tensor_symmetric, Q.quint8), (Q.per_channel_symmetric, Q.qint8), (Q.per_channel_affine, Q.quint8),
           (Q.per_tensor_affine, Q.quint8.with_range(0, 127))]


def fused_pair(qscheme, qdtype, c=0.01, torch_kernel=True):
    ch = {"ch_axis": 0} if qscheme.is_per_channel else {}
    obs, tobs = ((Q.MovingAveragePerChannelMinMaxObserver, tq.MovingAveragePerChannelMinMaxObserver) if ch
                 else (Q.MovingAverageMinMaxObserver, tq.MovingAverageMinMaxObserver))
    ours = Q.FusedMovingAvgObsFakeQuantize(obs, qscheme=qscheme, qdtype=qdtype, averaging_constant=c, **ch)
    ours._use_torch_kernel = torch_kernel
    theirs = tq.FusedMovingAvgObsFakeQuantize(tobs, quant_min=qdtype.quant_min, quant_max=qdtype.quant_max,
                                              dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], averaging_constant=c, **ch)
    return ours, theirs


def assert_step_equal(ours, theirs, x, gy, where=""):
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    ya.backward(gy), yb.backward(gy)
    oa, ob = ours.activation_post_process, theirs.activation_post_process
    checks = {"y": torch.equal(ya, yb), "dx": torch.equal(xa.grad, xb.grad),
              "min_val": torch.equal(oa.min_val, ob.min_val), "max_val": torch.equal(oa.max_val, ob.max_val),
              "scale": torch.equal(ours.scale.reshape(-1), theirs.scale),
              "zero_point": torch.equal(ours.zero_point.reshape(-1), theirs.zero_point.long())}
    assert all(checks.values()), (where, checks)


@settings(max_examples=40, deadline=None)
@given(scheme=st.sampled_from(SCHEMES), torch_kernel=st.booleans(), c=st.sampled_from([0.01, 0.3, 1.0]),
       seed=st.integers(0, 2**16), batches=st.integers(1, 5), rows=st.integers(1, 5), cols=st.integers(1, 9),
       spread=st.floats(1e-6, 1e3), shift=st.floats(-2, 2), relu=st.booleans())
def test_property_matches_torch_over_a_batch_sequence(scheme, torch_kernel, c, seed, batches, rows, cols, spread, shift,
                                                      relu):
    """Outputs, input gradients, running min/max, scale and zero point equal torch.ao's after every batch,
    on torch's fused kernel and on lowbit's composite alike."""
    ours, theirs = fused_pair(*scheme, c=c, torch_kernel=torch_kernel)
    g = torch.Generator().manual_seed(seed)
    for b in range(batches):
        x = (torch.randn(rows, cols, generator=g) + shift) * spread * (1 + b)
        x = x.relu() if relu and b % 2 else x
        assert_step_equal(ours, theirs, x, torch.randn(rows, cols, generator=g), f"batch {b}")


@pytest.mark.parametrize("torch_kernel", [True, False])
def test_switches_follow_torch(torch_kernel):
    ours, theirs = fused_pair(Q.per_tensor_affine, Q.quint8, c=0.5, torch_kernel=torch_kernel)
    g = torch.Generator().manual_seed(0)
    plan = [(1, 1), (0, 1), (1, 0), (0, 0), (1, 1)]                 # (observer, fake quant) per batch
    for i, (obs_on, fq_on) in enumerate(plan):
        for m in (ours, theirs):
            m.enable_observer(bool(obs_on)), m.enable_fake_quant(bool(fq_on))
        assert_step_equal(ours, theirs, torch.randn(3, 7, generator=g) * (i + 1), torch.randn(3, 7, generator=g), i)


def test_channel_axis_other_than_zero_uses_the_composite():
    """torch's kernel only supports ch_axis=0; lowbit's composite handles any axis, equal to torch on the
    moved tensor."""
    ours = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=2, averaging_constant=0.2)
    _, theirs = fused_pair(Q.per_channel_symmetric, Q.qint8, c=0.2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 3, 4, generator=g)
        xa, xb = x.clone().requires_grad_(), x.movedim(2, 0).clone().requires_grad_()
        ya, yb = ours(xa), theirs(xb)
        assert torch.equal(ya.movedim(2, 0), yb) and torch.equal(ours.scale, theirs.scale)
        gy = torch.randn(x.shape, generator=g)
        ya.backward(gy), yb.backward(gy.movedim(2, 0))
        assert torch.equal(xa.grad.movedim(2, 0), xb.grad)


EDGE_RANGES = [(0.0, 0.0), (0.0, 1e-4), (-1e-4, 1e-4), (0.0, 1e-30), (-3.0, 1e-4), (0.0, 5.0), (-5.0, 0.0),
               (-2.0, -1.0), (1.0, 2.0), (-1e-5, 3.0), (-1e30, 1e30), (-0.3, 1000.0)]


@pytest.mark.parametrize("qmin,qmax", [(0, 255), (-128, 127), (0, 15), (-8, 7), (0, 127)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_choose_qparams_equals_torch_kernel_at_the_edges(qmin, qmax, symmetric):
    """fbgemm's rules (small-scale floor, zero-range fallback, symmetric only when the range straddles 0)."""
    for lo, hi in EDGE_RANGES:
        s, z = torch.ones(1), torch.zeros(1, dtype=torch.int64)
        on = torch.ones(1, dtype=torch.long)
        torch.fused_moving_avg_obs_fake_quant(torch.tensor([lo, hi]), on, on, torch.tensor(float("inf")),
                                              torch.tensor(float("-inf")), s, z, 1.0, qmin, qmax, 0, False, symmetric)
        ours = choose_qparams_fbgemm(torch.tensor(lo), torch.tensor(hi), qmin, qmax, symmetric)
        assert (ours[0].item(), ours[1].item()) == (s.item(), z.item()), (lo, hi)


@settings(max_examples=100, deadline=None)
@given(lo=st.floats(-1e6, 0, width=32), hi=st.floats(0, 1e6, width=32), grid=st.sampled_from([(0, 255), (-128, 127), (0, 15)]),
       symmetric=st.booleans(), nudge=st.floats(-1, 1, width=32))
def test_property_choose_qparams_equals_torch_kernel(lo, hi, grid, symmetric, nudge):
    lo, hi = (lo + nudge, hi) if nudge > 0 else (lo, hi + nudge)   # ranges not containing 0 too
    lo, hi = min(lo, hi), max(lo, hi)
    s, z = torch.ones(1), torch.zeros(1, dtype=torch.int64)
    on = torch.ones(1, dtype=torch.long)
    torch.fused_moving_avg_obs_fake_quant(torch.tensor([lo, hi]), on, on, torch.tensor(float("inf")),
                                          torch.tensor(float("-inf")), s, z, 1.0, *grid, 0, False, symmetric)
    ours = choose_qparams_fbgemm(torch.tensor(lo), torch.tensor(hi), *grid, symmetric)
    assert (ours[0].item(), ours[1].item()) == (s.item(), z.item())


def test_calculate_qparams_is_the_grid_the_forward_used():
    """Departure: torch.ao's calculate_qparams() asks its observer (amax / 127.5 for symmetric qint8), not the
    grid its kernel fake-quantized with; lowbit's returns the forward's grid, so convert reproduces QAT."""
    ours, theirs = fused_pair(Q.per_tensor_symmetric, Q.qint8)
    x = torch.tensor([-6.0, 12.7])
    ours(x), theirs(x)
    s, z = ours.calculate_qparams()
    assert s.item() == ours.scale.item() == theirs.scale.item() == pytest.approx(12.7 / 127)
    assert z.item() == 0 and s.shape == ()
    assert theirs.calculate_qparams()[0].item() == pytest.approx(12.7 / 127.5)
    with pytest.raises(RuntimeError, match="has not observed any finite data"):
        Q.FusedMovingAvgObsFakeQuantize().calculate_qparams()


@pytest.mark.parametrize("torch_kernel", [True, False])
def test_nan_and_inf_are_ignored_and_nan_propagates(torch_kernel):
    fq = Q.FusedMovingAvgObsFakeQuantize(averaging_constant=1.0)
    fq._use_torch_kernel = torch_kernel
    fq(torch.tensor([-1.0, 3.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = fq(torch.tensor([float("nan"), float("inf"), -2.0, 2.0]))
    obs = fq.activation_post_process
    assert (obs.min_val.item(), obs.max_val.item()) == (-2.0, 2.0) and math.isnan(y[0].item())
    fq.disable_observer()
    x = torch.tensor([float("nan"), 1.0], requires_grad=True)
    y = fq(x)
    y.sum().backward()
    assert math.isnan(y[0].item()) and x.grad.tolist() == [0.0, 1.0]
    pc = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0, averaging_constant=1.0)
    pc._use_torch_kernel = torch_kernel
    pc(torch.tensor([[-1.0, 1.0], [2.0, 3.0]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = pc(torch.tensor([[float("nan"), 0.5], [-4.0, float("-inf")]]))
    obs = pc.activation_post_process
    assert obs.min_val.tolist() == [0.5, -4.0] and obs.max_val.tolist() == [0.5, -4.0] and math.isnan(y[0, 0].item())


def test_unobserved_module_with_observer_off_is_a_clear_error_not_a_crash():
    # torch's kernel raises deep inside here; lowbit fake-quantized on the placeholder grid scale=1.0 until session 43
    # (tests/test_qat43_s43.py): silently constant outputs for a model whose observers were disabled before step 1
    fq = Q.FusedMovingAvgObsFakeQuantize().disable_observer()
    x = torch.tensor([0.2, 3.0])
    with pytest.raises(RuntimeError, match=r"observer is off and has seen no data.*placeholder scale=1\.0"):
        fq(x)
    assert torch.equal(fq(torch.empty(0)), torch.empty(0))
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)


def test_other_devices_and_dtypes_take_the_composite():
    ours, theirs = fused_pair(Q.per_channel_affine, Q.quint8, c=0.5)
    x = torch.randn(3, 8)
    y64 = ours(x.double())
    assert y64.dtype == torch.float64 and torch.equal(y64.float(), theirs(x))


def test_state_dict_round_trip_and_repr():
    a = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    a(torch.randn(5, 3))
    b = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    w = torch.randn(5, 3)
    assert torch.equal(a(w), b(w)) and torch.equal(a.scale, b.scale)
    assert "per_channel_symmetric" in repr(b) and "ch_axis=0" in repr(b)


def test_fused_qat_loop_trains_and_converts_to_the_same_outputs():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x[:, :4].argmax(1)
    qat = Q.prepare_qat(Q.fuse_modules_qat(StubMLP(), [["fc1", "relu"]]), Q.get_fused_qat_qconfig())
    assert type(qat.fc1.weight_fake_quant) is Q.FusedMovingAvgObsFakeQuantize
    opt = torch.optim.Adam(qat.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    qat.eval().apply(Q.disable_observer)        # freeze the grids (a moving-average observer moves on every batch)
    ref = qat(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Q.convert(qat)
    s_out = qat.fc2.activation_post_process.scale.item()
    assert q.fc2.scale.item() == s_out
    assert (q(x) - ref).abs().max().item() <= s_out * (1 + 1e-5)


def test_bad_input_names_the_value():
    with pytest.raises(TypeError, match="built a MinMaxObserver"):
        Q.FusedMovingAvgObsFakeQuantize(Q.MinMaxObserver)
    with pytest.raises(TypeError, match="observer=1"):
        Q.FusedMovingAvgObsFakeQuantize(1)
    fq = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    with pytest.raises(TypeError, match="torch.int32"):
        fq(torch.tensor([1, 2], dtype=torch.int32))
    fq(torch.randn(4, 2))
    with pytest.raises(ValueError, match="has 3 channels along ch_axis=0, but this module has recorded 4"):
        fq(torch.randn(3, 2))
    with pytest.raises(ValueError, match="ch_axis=0 is out of range"):
        fq(torch.tensor(1.0))
