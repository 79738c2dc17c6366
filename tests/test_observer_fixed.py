"""FixedQParamsObserver, PlaceholderObserver, NoopObserver: seed 002, torch parity, state, errors."""

import io

import pytest
import torch
from torch.ao.quantization import observer as tobs

import lowbit as Q


def test_seed_002_fixed_qparams_examples():
    obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    scale, zero_point = obs.calculate_qparams()
    assert (round(scale.item(), 6), int(zero_point.item())) == (0.003906, 0)
    before = obs.scale.item()
    x = torch.randn(4, 4)
    assert obs(x) is x
    assert obs.scale.item() == before


@pytest.mark.parametrize("scale,zp,qdtype",
                         [(1.0 / 256, 0, Q.quint8), (2.0 / 256, 128, Q.quint8), (1.0 / 128, 0, Q.qint8)])
def test_fixed_matches_torch(scale, zp, qdtype):
    ours = Q.FixedQParamsObserver(scale, zp, qdtype=qdtype)
    theirs = tobs.FixedQParamsObserver(scale, zp, dtype=qdtype.torch_dtype,
                                       quant_min=qdtype.quant_min, quant_max=qdtype.quant_max)
    (s, z), (ts, tz) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert s.item() == ts.item() and z.item() == tz.item()
    assert (s.dtype, z.dtype, s.shape) == (torch.float32, torch.int64, ())


def test_fixed_buffers_travel_in_state_dict_and_results_are_copies():
    obs = Q.FixedQParamsObserver(0.5, 3)
    s, _ = obs.calculate_qparams()
    s.fill_(9.0)                                         # mutating the result does not touch the buffer
    assert obs.scale.item() == 0.5 and obs.is_calibrated
    buf = io.BytesIO()
    torch.save(obs.state_dict(), buf)
    buf.seek(0)
    fresh = Q.FixedQParamsObserver(1.0, 0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert (fresh.scale.item(), fresh.zero_point.item()) == (0.5, 3)
    assert "scale=0.5, zero_point=3" in repr(fresh)


@pytest.mark.parametrize("kwargs,err,match", [
    ({"scale": 0.0, "zero_point": 0}, ValueError, "scale=0.0"),
    ({"scale": float("nan"), "zero_point": 0}, ValueError, "scale=nan"),
    ({"scale": "1", "zero_point": 0}, ValueError, "scale='1'"),
    ({"scale": 0.1, "zero_point": 1.5}, TypeError, "zero_point=1.5"),
    ({"scale": 0.1, "zero_point": 256}, ValueError, r"zero_point=256 is outside the lowbit.quint8 grid \[0, 255\]"),
    ({"scale": 0.1, "zero_point": 0, "qscheme": Q.per_channel_affine}, ValueError, "per_channel_affine"),
])
def test_fixed_rejects_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        Q.FixedQParamsObserver(**kwargs)


@pytest.mark.parametrize("cls", [Q.PlaceholderObserver, Q.NoopObserver])
def test_placeholders_carry_a_dtype_and_refuse_qparams(cls):
    obs = cls(qdtype=Q.qint8, is_dynamic=True)
    assert (obs.qdtype, obs.is_dynamic, obs.is_calibrated) == (Q.qint8, True, False)
    x = torch.randn(3)
    assert obs(x) is x
    assert obs.state_dict() == {}
    with pytest.raises(RuntimeError, match=f"{cls.__name__} collects no statistics"):
        obs.calculate_qparams()
    with pytest.raises(TypeError, match="is_dynamic='yes'"):
        cls(is_dynamic="yes")
    with pytest.raises(TypeError, match="takes tensors"):
        obs([1.0])


def test_noop_is_a_placeholder_and_defaults():
    assert issubclass(Q.NoopObserver, Q.PlaceholderObserver)
    obs = Q.PlaceholderObserver()
    assert (obs.qscheme, obs.qdtype, obs.eps, obs.is_dynamic) == (Q.per_tensor_affine, Q.quint8, 1e-8, False)
    assert isinstance(Q.FixedQParamsObserver.with_args(scale=0.1, zero_point=0)(), Q.ObserverBase)
