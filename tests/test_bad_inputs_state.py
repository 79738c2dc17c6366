"""Tampered checkpoints at ``load_state_dict`` of every quantized module family (session 24).

A checkpoint must describe a valid grid: a bad key is refused with a line naming it, and the refused module keeps
its state (``nn/quantized/_state.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q


def _refused(model: nn.Module, sd: dict, *needles: str, **kw) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError) as e:
        model.load_state_dict(sd, **kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())


def test_weight_only_linear_checks_scales_zero_points_codes_and_bias():
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(64, 32)).eval()
    q = Q.quantize_weight_only(f, bits=4, group_size=32)
    sd = {k: v.clone() for k, v in q.state_dict().items()}
    sd["0.scales"][0, 0], sd["0.zero_points"][2, 0], sd["0.bias"][3] = float("nan"), 100, float("inf")
    _refused(q, sd, "0.scales: scale=[nan", "0.zero_points: zero_point [100]", "0.bias: the bias holds NaN/Inf")
    affine = Q.quantize_weight_only(f, bits=4, group_size=32, symmetric=False).state_dict()
    _refused(q, affine, "equal to 0 (symmetric lowbit.qint4)")  # loaded: 211 % error against float
    q8 = Q.quantize_weight_only(f, bits=8, group_size=-1)
    sd8 = dict(q8.state_dict())
    sd8["0.qweight"] = sd8["0.qweight"].float() + 0.5
    _refused(q8, sd8, "0.qweight: codes [")  # fractional codes were truncated
    q.load_state_dict(Q.quantize_weight_only(f, bits=4, group_size=32).state_dict())  # a valid one still loads


def test_dynamic_linear_checks_its_weight_grid():
    q = Q.quantize_dynamic(nn.Sequential(nn.Linear(4, 2)))
    sd = dict(q.state_dict())
    sd["0.weight_zero_point"] = torch.tensor([300, -999])
    sd["0.weight_int8"] = torch.full((2, 4), 200, dtype=torch.int16)  # wrapped to -56
    _refused(q, sd, "0.weight_int8: codes [200", "0.weight_zero_point: zero_point [300, -999]")


def _embedding(bits: int = 8, float_qparams: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(6, 4))
    m[0].qconfig = Q.get_embedding_qconfig(bits, float_qparams=float_qparams)
    return Q.convert(Q.prepare(m))


def test_embedding_checks_its_codes_and_a_refused_load_keeps_its_zero_points():
    q = _embedding()
    sd = dict(q.state_dict())
    for codes in (torch.full((6, 4), 300, dtype=torch.int64), torch.full((6, 4), 2.7)):  # wrapped / truncated
        _refused(q, {**sd, "0.weight_q": codes}, "0.weight_q: codes [")
    ids = torch.tensor([0, 3])
    before = q(ids).clone()
    fq = {k: v.clone() for k, v in _embedding(float_qparams=True).state_dict().items()}
    fq["0.weight_scale"][0] = float("nan")
    _refused(q, fq, "0.weight_scale: scale=[nan")
    assert torch.equal(q(ids), before) and not q[0].qscheme.has_float_zero_point  # zero points were swapped
    q.load_state_dict(_embedding(float_qparams=True).state_dict())  # a valid float-qparams table still loads
    assert q[0].qscheme.has_float_zero_point
    _embedding(4).load_state_dict(_embedding(4).state_dict())  # packed 4-bit bytes


def test_quantized_norms_check_their_grid_and_affine_weight():
    from lowbit.nn.quantized.normalization import NORM_MAPPINGS

    mp = {**Q.get_default_static_quant_module_mappings(), **NORM_MAPPINGS}
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3), Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_default_qconfig(), mapping=mp)
    p(torch.randn(8, 4))
    q = Q.convert(p, mapping=mp)
    sd = dict(q.state_dict())
    _refused(q, {**sd, "2.scale": torch.tensor(float("nan")), "2.zero_point": torch.tensor(2.5)},
             "2.scale: scale=nan", "2.zero_point: zero_point 2.5")
    _refused(q, {**sd, "2.weight": torch.full((4,), float("nan"))}, "2.weight: the weight holds NaN/Inf")


def test_assign_true_refuses_a_buffer_of_another_dtype():
    q = Q.quantize_dynamic(nn.Sequential(nn.Linear(4, 2)))
    sd = {k: (v.long() if k.endswith("weight_int8") else v) for k, v in q.state_dict().items()}
    _refused(q, sd, "0.weight_int8: expected dtype torch.int8, got torch.int64 with assign=True", assign=True)
    q.load_state_dict(sd)  # copied into the int8 buffer: fine
    assert q[0].weight_int8.dtype == torch.int8
