"""Hostile inputs to converted modules found by session 23's probes: a NaN or infinite operand of a quantized
add/mul/cat (was a finite code), a hardtanh with min > max and NaN clamp / pad bounds, EmbeddingBag offsets torch's
kernel reads out of bounds on (one crashed the process) and a (B, 0) bag input, and dynamic RNNs with an empty batch
(float returns empty outputs) or an empty sequence. Each now matches the float module or names the value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq


@pytest.fixture
def qf_and_a():
    return nnq.QFunctional(0.05, 128), Q.quantize_per_tensor(torch.tensor([0.5, -1.0, 0.0]), 0.02, 128, Q.quint8)


@pytest.mark.parametrize(("op", "c"), [("add_scalar", float("nan")), ("mul_scalar", float("inf")),
                                      ("add_scalar", float("-inf")), ("mul_scalar", torch.tensor(float("nan")))])
def test_a_non_finite_scalar_operand_is_an_error(qf_and_a, op, c):
    qf, a = qf_and_a
    with pytest.raises(ValueError, match=rf"QFunctional.{op}: the scalar operand must be finite"):
        getattr(qf, op)(a, c)
    assert getattr(qf, op)(a, 0.5).dequantize().shape == (3,)


def test_a_nan_float_operand_of_add_or_cat_is_an_error_like_quantize(qf_and_a):
    qf, a = qf_and_a
    with pytest.raises(RuntimeError, match=r"QFunctional: the float input of shape \(3,\) holds 3 NaN"):
        qf.add(torch.full((3,), float("nan")), a)
    with pytest.raises(RuntimeError, match="holds 1 NaN"):
        qf.cat([torch.tensor([float("nan")]), a])
    assert torch.allclose(qf.add(torch.ones(3), a).dequantize(), torch.tensor([1.5, 0.0, 1.0]), atol=0.05)


def test_hardtanh_bounds_and_nan_clamp_or_pad_values_on_qtensors():
    qt = Q.quantize_per_tensor(torch.randn(1, 2, 4, 4), 0.05, 128, Q.quint8)
    with pytest.raises(ValueError, match="hardtanh: min_val=1.0 cannot be greater than max_val=-1.0"):
        F.hardtanh(qt, 1.0, -1.0)
    with pytest.raises(ValueError, match="NaN has no code on the grid"):
        torch.clamp(qt, min=float("nan"))
    with pytest.raises(ValueError, match="NaN has no code on the grid"):
        F.pad(qt, (1, 1), value=float("nan"))
    assert F.hardtanh(qt, -1.0, 1.0).dequantize().abs().max() <= 1.0


@pytest.mark.parametrize(("inputs", "offsets", "last", "exc", "match"), [
    ([1, 2, 3], torch.tensor([0.0, 0.9]), False, TypeError, "offsets must be an integer tensor, got dtype torch.float32"),
    ([2, 2, 1, 3], torch.tensor([0]), True, ValueError, "include_last_offset needs at least 2 offsets"),  # was a segfault
    ([2, 2, 1, 3], torch.tensor([0, 3, 1]), False, ValueError, r"offsets \[0, 3, 1\] must start at 0, never decrease"),
    ([2, 2, 1, 3], torch.tensor([-1, 2]), False, ValueError, r"offsets \[-1, 2\]"),
    ([2, 2, 1, 3], torch.tensor([0, 5]), False, ValueError, "stay within the 4 inputs"),
    ([2, 2, 1, 3], torch.tensor([0, 2, 3]), True, ValueError, "the last one = the input count"),
])
def test_embedding_bag_offsets_torch_cannot_take_are_refused(inputs, offsets, last, exc, match):
    eb = nnq.EmbeddingBag(10, 4, mode="mean", include_last_offset=last)
    with pytest.raises(exc, match=match):
        eb(torch.tensor(inputs), offsets)


def test_embedding_bag_matches_float_on_valid_bags_including_empty_ones():
    torch.manual_seed(0)
    fl = nn.EmbeddingBag(10, 3, mode="sum")
    q = nnq.EmbeddingBag.from_float(fl)
    x, off = torch.tensor([2, 2, 1, 3]), torch.tensor([0, 2, 2, 4])  # bag 1 and the last bag are empty
    assert torch.allclose(q(x, off), fl(x, off), atol=0.05)
    with pytest.raises(TypeError, match="per_sample_weights must be a floating-point tensor, got dtype torch.int64"):
        q(torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([2, 2]))
    assert q(torch.zeros(3, 0, dtype=torch.long)).tolist() == [[0.0] * 3] * 3  # three empty bags (was shape (0, 3))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
def test_dynamic_rnn_takes_an_empty_batch_and_names_an_empty_sequence(cls, batch_first):
    torch.manual_seed(0)
    fl = nn.Sequential(cls(4, 3, batch_first=batch_first, num_layers=2, bidirectional=True))
    q = Q.quantize_dynamic(fl)[0]
    x = torch.randn(0, 5, 4) if batch_first else torch.randn(5, 0, 4)
    (fo, fh), (qo, qh) = fl[0](x), q(x)
    assert qo.shape == fo.shape and (qh[0] if cls is nn.LSTM else qh).shape == (fh[0] if cls is nn.LSTM else fh).shape
    empty = torch.randn(2, 0, 4) if batch_first else torch.randn(0, 2, 4)
    with pytest.raises(RuntimeError):
        fl[0](empty)
    with pytest.raises(ValueError, match=f"dynamic {cls.__name__}: the input sequence is empty"):
        q(empty)
