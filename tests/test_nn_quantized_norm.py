"""Quantized LayerNorm / GroupNorm / InstanceNorm1d-3d / Dropout: parity with torch.ao.nn.quantized
(same input codes, same output grid: within one output quantum), from_float and the opt-in workflow."""

import warnings

import pytest
import torch
import torch.ao.nn.quantized as tnnq
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.nn.quantized.normalization import NORM_MAPPINGS

torch.set_num_threads(1)


def codes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's quantized tensors warn that they are deprecated
        tx = torch.quantize_per_tensor(x, 0.05, 100, torch.quint8)
    return Q.quantize_per_tensor(x, 0.05, 100, Q.quint8), tx


def affine(c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g) * 0.1


def par(t):  # torch.ao's constructors assign weight/bias as Parameters
    return None if t is None else nn.Parameter(t.clone())


def assert_within_one_quantum(ours, theirs):
    a, b = ours.int_repr().to(torch.int32), theirs.int_repr().to(torch.int32)
    assert (a - b).abs().max() <= 1, (a - b).abs().max()
    assert (a == b).float().mean() > 0.95


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(0.02, 128), (0.04, 60)]))
def test_layer_norm_matches_torch_ao(seed, grid):
    w, b = affine(8, seed)
    qx, tx = codes((3, 5, 8), seed)
    ours = nnq.LayerNorm(8, w, b, *grid)
    theirs = tnnq.LayerNorm(8, par(w), par(b), *grid)
    assert_within_one_quantum(ours(qx), theirs(tx))


@pytest.mark.parametrize("affine_on", [True, False])
def test_group_norm_matches_torch_ao(affine_on):
    w, b = affine(6, 1) if affine_on else (None, None)
    qx, tx = codes((2, 6, 4, 4), 1)
    ours = nnq.GroupNorm(3, 6, w, b, 0.03, 120, affine=affine_on)
    theirs = tnnq.GroupNorm(3, 6, par(w), par(b), 0.03, 120, affine=affine_on)
    assert_within_one_quantum(ours(qx), theirs(tx))


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_instance_norm_matches_torch_ao(dim):
    w, b = affine(4, dim)
    qx, tx = codes((2, 4) + (5,) * dim, dim)
    ours = getattr(nnq, f"InstanceNorm{dim}d")(4, w, b, 0.03, 128, affine=True)
    theirs = getattr(tnnq, f"InstanceNorm{dim}d")(4, par(w), par(b), 0.03, 128, affine=True)
    assert_within_one_quantum(ours(qx), theirs(tx))


def test_dropout_is_the_identity_on_codes():
    qx, tx = codes((4, 4), 0)
    assert nnq.Dropout(0.5)(qx) is qx and tnnq.Dropout(0.5)(tx) is tx
    assert type(nnq.Dropout.from_float(nn.Dropout(0.3))) is nnq.Dropout


def test_norms_through_prepare_convert_with_the_opt_in_mapping():
    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True),
                          nn.Dropout(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.LayerNorm(8), Q.DeQuantStub()).eval()
    mapping = {**Q.get_default_static_quant_module_mappings(), **NORM_MAPPINGS}
    prepared = Q.prepare(model, Q.get_minmax_qconfig(), mapping=mapping)
    for _ in range(4):
        prepared(torch.randn(8, 3, 8, 8))
    q, report = Q.convert(prepared, mapping=mapping, return_report=True)
    assert [type(q[i]) for i in (2, 3, 4, 7)] == [nnq.GroupNorm, nnq.InstanceNorm2d, nnq.Dropout, nnq.LayerNorm]
    assert not report.left_float
    x = torch.randn(4, 3, 8, 8)
    ref = model(x)
    assert ((q(x) - ref).norm() / ref.norm()) < 0.08


def test_default_mapping_keeps_norms_float():
    assert nn.LayerNorm not in Q.get_default_static_quant_module_mappings()


def test_bad_input_and_from_float_errors():
    ln = nnq.LayerNorm(4, None, None, 0.1, 0, elementwise_affine=False)
    with pytest.raises(TypeError, match="LayerNorm expects a QTensor or a float tensor"):
        ln(torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="expects an nn.GroupNorm"):
        nnq.GroupNorm.from_float(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="no activation_post_process"):
        nnq.LayerNorm.from_float(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="zero_point=300"):
        nnq.InstanceNorm1d(4, None, None, 0.1, 300)
