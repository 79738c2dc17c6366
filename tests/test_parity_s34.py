"""Session 34 parity sweep against torch.ao (the oracle): each test failed before its fix."""

from __future__ import annotations

import pytest
import torch
import torch.ao.quantization as tq
import torch.ao.quantization.observer as tao

import lowbit as Q
from lowbit import observer as lo

_EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("cls_t, cls_l, kw", [
    (tao.MinMaxObserver, lo.MinMaxObserver, {}),
    (tao.MovingAverageMinMaxObserver, lo.MovingAverageMinMaxObserver, {"averaging_constant": 0.3}),
])
def test_qint32_affine_zero_point_is_exact_as_torch_ao(cls_t, cls_l, kw):
    # qint32's zero point qmin - round(min / s) was subtracted in float32 and lost its low bits
    # (-2086203264 where torch.ao gives -2086203224)
    torch.manual_seed(0)
    # (all-negative data is left out: torch.ao's round(min / s) overflows its int32 cast there and gives
    # zero point 0; lowbit gives qmax, the zero at the grid's top)
    xs = [torch.randn(4, 3, 5), torch.randn(4, 3, 5) * 3, torch.rand(7) * 1e3 - 10.0]
    for x in xs:
        t, lb = cls_t(dtype=torch.qint32, eps=_EPS, **kw), cls_l(qdtype=Q.qint32, eps=_EPS, **kw)
        t(x), lb(x)
        (ts, tz), (ls, lz) = t.calculate_qparams(), lb.calculate_qparams()
        assert ls.item() == ts.item()
        assert lz.item() == tz.item()


def test_qint32_zero_point_exact_in_calculate_qparams_per_channel():
    lo_v = torch.tensor([-0.75, -1.5e-3, 0.0, -3.0])
    hi_v = torch.tensor([2.0, 0.5, 1.0, -1.0])
    t = tao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint32, qscheme=torch.per_channel_affine, eps=_EPS)
    ts, tz = t._calculate_qparams(lo_v, hi_v)
    ls, lz = Q.calculate_qparams(lo_v, hi_v, Q.per_channel_affine, Q.qint32, _EPS)
    assert torch.equal(ls, ts)
    assert lz.tolist() == tz.tolist()


def test_torch_ao_observer_and_fake_quant_checkpoints_load_with_their_eps():
    """torch.ao saves an observer's eps as a buffer: its checkpoints failed lowbit's strict load ("Unexpected key(s)
    in state_dict: 'eps'"); the value is adopted, so the loaded observer gives torch.ao's grid."""
    torch.manual_seed(0)
    a = tao.MinMaxObserver()
    a(torch.randn(10) * 1e-9)  # (a range below eps: the grid is eps's)
    o = Q.MinMaxObserver()
    o.load_state_dict(a.state_dict())
    assert o.eps == float(a.eps)
    (s, z), (s_ao, z_ao) = o.calculate_qparams(), a.calculate_qparams()
    assert float(s) == float(s_ao) and int(z) == int(z_ao)
    f = tq.FakeQuantize()
    f(torch.randn(4, 8))
    lf = Q.FakeQuantize()
    lf.load_state_dict(f.state_dict())
    assert float(lf.calculate_qparams()[0]) == float(f.calculate_qparams()[0])
    bad = {**a.state_dict(), "eps": torch.tensor([-1.0])}
    with pytest.raises(RuntimeError, match="eps: expected one positive finite float32 value"):
        Q.MinMaxObserver().load_state_dict(bad)
