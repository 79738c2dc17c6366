"""Min/max observer family: parity with torch.ao on random and real-ish data, edges, state, seeds."""

import io
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as tobs

import lowbit as Q

torch.set_num_threads(1)
TQS = {Q.per_tensor_affine: torch.per_tensor_affine, Q.per_tensor_symmetric: torch.per_tensor_symmetric,
       Q.per_channel_affine: torch.per_channel_affine, Q.per_channel_symmetric: torch.per_channel_symmetric}


def data(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return {
        "normal": x,
        "relu": torch.relu(x) * 3,                                                    # post-ReLU activations
        "heavy": x / torch.rand(*shape, generator=g).clamp(min=0.02) ** 0.5,          # heavy tails (t-like)
        "lognormal": torch.exp(x),                                                    # all positive, skewed
        "negative": -torch.rand(*shape, generator=g) - 0.5,                           # all negative
        "channels": x * torch.logspace(-3, 1, shape[0]).reshape(-1, *[1] * (len(shape) - 1)),  # wild per-channel ranges
    }[kind]


def pair(name, qscheme, qdtype, **kw):
    """(ours, torch's) observer with equal settings; eps equal on both sides."""
    ours = getattr(Q, name)(qscheme=qscheme, qdtype=qdtype, eps=1e-8, **kw)
    theirs = getattr(tobs, name)(dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], eps=1e-8, **kw)
    return ours, theirs


def assert_parity(ours, theirs, batches):
    for b in batches:
        assert ours(b) is b
        theirs(b)
    torch.testing.assert_close(ours.min_val, theirs.min_val.reshape(ours.min_val.shape), rtol=0, atol=0)
    torch.testing.assert_close(ours.max_val, theirs.max_val.reshape(ours.max_val.shape), rtol=0, atol=0)
    (s, z), (ts, tz) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert s.dtype == torch.float32 and z.dtype == torch.int64
    torch.testing.assert_close(s, ts.reshape(s.shape), rtol=1e-6, atol=0)
    assert torch.equal(z, tz.reshape(z.shape).to(torch.int64))


SCHEMES_T = [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_affine, Q.qint8),
             (Q.per_tensor_symmetric, Q.qint8), (Q.per_tensor_symmetric, Q.quint8)]
SCHEMES_C = [(Q.per_channel_symmetric, Q.qint8), (Q.per_channel_affine, Q.quint8), (Q.per_channel_affine, Q.qint8)]
KINDS = ["normal", "relu", "heavy", "lognormal", "negative"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qscheme,qdtype", SCHEMES_T)
@pytest.mark.parametrize("name,kw", [("MinMaxObserver", {}),
                                     ("MovingAverageMinMaxObserver", {"averaging_constant": 0.1})])
def test_per_tensor_parity(name, kw, qscheme, qdtype, kind):
    assert_parity(*pair(name, qscheme, qdtype, **kw), [data(kind, (8, 33), s) for s in range(4)])


@pytest.mark.parametrize("kind", KINDS + ["channels"])
@pytest.mark.parametrize("qscheme,qdtype", SCHEMES_C)
@pytest.mark.parametrize("name,kw", [("PerChannelMinMaxObserver", {}),
                                     ("MovingAveragePerChannelMinMaxObserver", {"averaging_constant": 0.2})])
@pytest.mark.parametrize("ch_axis,shape", [(0, (6, 4, 3, 3)), (1, (5, 7)), (-1, (4, 2, 9))])
def test_per_channel_parity(name, kw, qscheme, qdtype, kind, ch_axis, shape):
    shape = (shape[ch_axis],) + tuple(d for i, d in enumerate(shape) if i != ch_axis % len(shape))
    batches = [data(kind, shape, s).movedim(0, ch_axis) for s in range(3)]
    assert_parity(*pair(name, qscheme, qdtype, ch_axis=ch_axis, **kw), batches)


def test_default_eps_parity_on_degenerate_range():
    ours = Q.MinMaxObserver(eps=torch.finfo(torch.float32).eps)
    theirs = tobs.MinMaxObserver()
    assert_parity(ours, theirs, [torch.zeros(4), torch.full((3,), 1e-9)])


def test_defaults_follow_the_seeds():
    assert (Q.MinMaxObserver().qscheme, Q.MinMaxObserver().qdtype, Q.MinMaxObserver().eps) == (
        Q.per_tensor_affine, Q.quint8, 1e-8)
    pc = Q.PerChannelMinMaxObserver()
    assert (pc.ch_axis, pc.qscheme, pc.qdtype) == (0, Q.per_channel_symmetric, Q.qint8)
    assert Q.MovingAverageMinMaxObserver().averaging_constant == 0.01
    assert Q.MovingAveragePerChannelMinMaxObserver().averaging_constant == 0.01


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=20), min_size=1, max_size=5))
def test_minmax_is_the_range_of_the_union_and_quantizes_it_within_half_a_step(batches):
    obs = Q.MinMaxObserver()
    for b in batches:
        obs(torch.tensor(b))
    union = torch.tensor([v for b in batches for v in b])
    assert obs.min_val.item() == union.min().item() and obs.max_val.item() == union.max().item()
    s, z = obs.calculate_qparams()
    assert s > 0 and 0 <= z <= 255
    err = (Q.fake_quantize(union, s, z, 0, 255) - union).abs().max()
    assert err <= s / 2 * (1 + 1e-5) + 1e-6 * union.abs().max()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.floats(0.01, 1.0), st.integers(0, 2**31 - 1))
def test_ema_is_a_convex_combination_of_batch_ranges(c_rows, n, c, seed):
    g = torch.Generator().manual_seed(seed)
    obs = Q.MovingAveragePerChannelMinMaxObserver(ch_axis=0, averaging_constant=c)
    lo, hi = torch.full((c_rows,), float("inf")), torch.full((c_rows,), float("-inf"))
    for _ in range(n):
        x = torch.randn(c_rows, 7, generator=g) * 5
        obs(x)
        lo, hi = torch.minimum(lo, x.amin(1)), torch.maximum(hi, x.amax(1))
        assert bool((obs.min_val >= lo - 1e-4).all() & (obs.max_val <= hi + 1e-4).all())


# -- lucid unit invariants --------------------------------------------------------------------------
def test_running_and_averaged_ranges():
    obs = Q.MinMaxObserver()
    obs(torch.tensor([-1.0, 3.0])); obs(torch.tensor([-2.0, 1.0]))
    assert (obs.min_val.item(), obs.max_val.item()) == (-2.0, 3.0)
    ema = Q.MovingAverageMinMaxObserver(averaging_constant=0.5)
    ema(torch.tensor([-2.0, 2.0])); ema(torch.tensor([-4.0, 4.0]))
    assert (ema.min_val.item(), ema.max_val.item()) == (-3.0, 3.0)
    pc = Q.PerChannelMinMaxObserver(ch_axis=0)
    pc(torch.tensor([[1.0, 3.0], [-4.0, 0.5]]))
    assert pc.min_val.tolist() == [1.0, -4.0] and pc.max_val.tolist() == [3.0, 0.5]
    assert pc.calculate_qparams()[1].tolist() == [0, 0]


def test_per_channel_ema_outlier_batch_is_smoothed():
    obs = Q.MovingAveragePerChannelMinMaxObserver(ch_axis=0)
    obs(torch.ones(3, 4))
    before = obs.calculate_qparams()[0]
    obs(torch.full((3, 4), 50.0))
    after = obs.calculate_qparams()[0]
    assert bool((after < 50 / 127.5).all() & (after >= before).all())


# -- edges ------------------------------------------------------------------------------------------
ALL = [Q.MinMaxObserver, Q.MovingAverageMinMaxObserver, Q.PerChannelMinMaxObserver,
       Q.MovingAveragePerChannelMinMaxObserver]


@pytest.mark.parametrize("cls", ALL)
def test_uncalibrated_raises_naming_the_observer_and_reset_forgets(cls):
    obs = cls()
    assert not obs.is_calibrated
    with pytest.raises(RuntimeError, match=cls.__name__):
        obs.calculate_qparams()
    obs(torch.randn(3, 4))
    assert obs.is_calibrated
    obs.reset_min_max_vals()
    assert not obs.is_calibrated and obs.min_val.shape == ()
    with pytest.raises(RuntimeError, match=cls.__name__):
        obs.calculate_qparams()


@pytest.mark.parametrize("cls", ALL)
def test_empty_batch_is_a_noop(cls):
    obs = cls()
    obs(torch.empty(0, 4)); obs(torch.empty(3, 0))
    assert not obs.is_calibrated
    obs(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    state = (obs.min_val.clone(), obs.max_val.clone())
    obs(torch.empty(2, 0))
    assert torch.equal(obs.min_val, state[0]) and torch.equal(obs.max_val, state[1])


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("value", [0.0, 3.0, -7.5, 1e-12])
def test_constant_tensor_gives_a_valid_scale(cls, value):
    obs = cls()
    obs(torch.full((2, 5), value))
    s, z = obs.calculate_qparams()
    assert bool(torch.isfinite(s).all() & (s > 0).all())
    x = torch.full((2, 5), value)
    fq = Q.fake_quantize(x, s, z, obs.quant_min, obs.quant_max, obs.ch_axis)
    assert bool(((fq - x).abs() <= s.max() / 2 + 1e-6).all())


@pytest.mark.parametrize("cls", ALL)
def test_nan_and_inf_are_ignored_with_a_warning(cls):
    obs = cls(averaging_constant=1.0) if "Moving" in cls.__name__ else cls()
    x = torch.tensor([[1.0, float("nan"), -2.0], [float("inf"), 0.5, float("-inf")]])
    with pytest.warns(UserWarning, match="NaN or Inf"):
        obs(x)
    if obs.ch_axis is None:
        assert (obs.min_val.item(), obs.max_val.item()) == (-2.0, 1.0)
    else:
        assert obs.min_val.tolist() == [-2.0, 0.5] and obs.max_val.tolist() == [1.0, 0.5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = obs.min_val.clone()
        obs(torch.full((2, 3), float("nan")))            # nothing finite: statistics unchanged
    assert torch.equal(obs.min_val, before)


def test_channel_that_never_saw_finite_data_is_named():
    obs = Q.PerChannelMinMaxObserver()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs(torch.tensor([[1.0, 2.0], [float("nan"), float("nan")], [0.0, -1.0]]))
    with pytest.raises(RuntimeError, match=r"channels \[1\]"):
        obs.calculate_qparams()


@pytest.mark.parametrize("cls", ALL)
def test_wrong_inputs_raise_typeerror(cls):
    obs = cls()
    with pytest.raises(TypeError, match="int64"):
        obs(torch.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="list"):
        obs([1.0, 2.0])


@pytest.mark.parametrize("cls", [Q.PerChannelMinMaxObserver, Q.MovingAveragePerChannelMinMaxObserver])
def test_per_channel_axis_errors(cls):
    with pytest.raises(ValueError, match=r"ch_axis=3 is out of range for a tensor of shape \(16, 8\)"):
        cls(ch_axis=3)(torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"ch_axis=0 .* shape \(\)"):
        cls()(torch.tensor(1.0))
    obs = cls()
    obs(torch.randn(4, 3))
    with pytest.raises(ValueError, match="has 5 channels .* recorded 4"):
        obs(torch.randn(5, 3))
    with pytest.raises(TypeError, match="ch_axis=1.5"):
        cls(ch_axis=1.5)
    with pytest.raises(ValueError, match="per_tensor_affine .* use MinMaxObserver"):
        cls(qscheme=Q.per_tensor_affine)


def test_constructor_errors():
    with pytest.raises(ValueError, match="per_channel_symmetric .* use PerChannelMinMaxObserver"):
        Q.MinMaxObserver(qscheme=Q.per_channel_symmetric)
    with pytest.raises(ValueError, match="averaging_constant=0"):
        Q.MovingAverageMinMaxObserver(averaging_constant=0)
    with pytest.raises(ValueError, match="averaging_constant=1.5"):
        Q.MovingAveragePerChannelMinMaxObserver(averaging_constant=1.5)
    with pytest.raises(ValueError, match="eps=-1"):
        Q.MinMaxObserver(eps=-1)
    with pytest.raises(TypeError, match="qdtype='int7'"):
        Q.MinMaxObserver(qdtype="int7")
    with pytest.raises(ValueError, match="qscheme='nope'"):
        Q.PerChannelMinMaxObserver(qscheme="nope")


def test_custom_range_comes_from_the_qdtype():
    obs = Q.MinMaxObserver(qdtype=Q.quint8.with_range(0, 127))
    obs(torch.tensor([-1.0, 3.0]))
    theirs = tobs.MinMaxObserver(quant_min=0, quant_max=127, eps=1e-8)
    theirs(torch.tensor([-1.0, 3.0]))
    s, z = obs.calculate_qparams()
    ts, tz = theirs.calculate_qparams()
    assert torch.allclose(s, ts.reshape(()), rtol=1e-6) and int(z) == int(tz)


# -- state -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", ALL)
def test_state_dict_round_trip_into_a_fresh_observer(cls):
    obs = cls()
    obs(torch.randn(5, 3) * 4)
    obs(torch.randn(5, 3))
    buf = io.BytesIO()
    torch.save(obs.state_dict(), buf)
    buf.seek(0)
    fresh = cls()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.min_val.shape == obs.min_val.shape
    for a, b in zip(fresh.calculate_qparams(), obs.calculate_qparams()):
        assert torch.equal(a, b)
    fresh(torch.randn(5, 3))                             # keeps observing after the load
    assert fresh.is_calibrated


def test_with_args_and_repr():
    make = Q.MovingAveragePerChannelMinMaxObserver.with_args(ch_axis=1, averaging_constant=0.5)
    a, b = make(), make()
    assert a is not b and a.ch_axis == 1 and b.averaging_constant == 0.5
    assert "averaging_constant=0.5" in repr(a) and "ch_axis=1" in repr(a)


# -- seeds 000 (PerChannelMinMaxObserver) and 001 (ObserverBase) -------------------------------------
def test_seed_000_per_channel_examples():
    obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    _ = obs(torch.randn(16, 8))
    scale, zero_point = obs.calculate_qparams()
    assert tuple(scale.shape) == (16,)
    assert bool((zero_point == 0).all().item()) is True
    w = torch.stack([torch.ones(4) * 0.001, torch.ones(4) * 1.0])
    obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    _ = obs(w)
    s, _ = obs.calculate_qparams()
    assert bool(s[0].item() < s[1].item()) is True


def test_seed_001_observer_base_examples():
    obs = Q.MinMaxObserver()
    assert isinstance(obs, Q.ObserverBase)
    _ = obs(torch.randn(64, 128))
    scale, zero_point = obs.calculate_qparams()
    assert (tuple(scale.shape), tuple(zero_point.shape)) == ((), ())
    obs2 = Q.PerChannelMinMaxObserver.with_args(ch_axis=0)()
    assert type(obs2).__name__ == "PerChannelMinMaxObserver"
