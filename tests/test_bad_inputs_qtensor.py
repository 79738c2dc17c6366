"""Hostile but valid-looking inputs at QTensors and converted modules: dtypes, layouts, devices (session 24).

torch's own quantized tensors and the float model are the oracle: the same result, or a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q


def _qt(shape=(2, 4), scale=0.05, zp=3) -> tuple[Q.QTensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.linspace(-1, 10, int(torch.tensor(shape).prod())).reshape(shape)
    return Q.quantize_per_tensor(x, scale, zp, Q.quint8), torch.quantize_per_tensor(x, scale, zp, torch.quint8)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_view_dtype_gives_the_codes_bytes_as_torch_does(dtype):
    a, ta = _qt()
    v = a.view(dtype)
    assert type(v) is torch.Tensor and v.dtype == dtype  # was a QTensor of wrapped values
    assert v.tolist() == ta.view(dtype).tolist()  # (torch.equal on torch's quantized view crashes the process)
    assert torch.equal(a.view(dtype=dtype), v)
    assert a.view(size=(4, 2)).shape == (4, 2)


def test_mean_refuses_dims_out_of_range_or_repeated_like_torch():
    a = Q.quantize_per_tensor(torch.randn(2, 3, 4, 5), 0.05, 3, Q.quint8)
    for d in (4, -5):
        with pytest.raises(IndexError, match=f"but got {d}"):  # mean(4) averaged dim 0
            a.mean(d)
        with pytest.raises(IndexError):
            torch.randn(2, 3, 4, 5).mean(d)
    with pytest.raises(RuntimeError, match="more than once"):
        a.mean((1, 1))
    assert a.mean((1, -1)).shape == (2, 4)


def test_to_memory_format_and_copy():
    a = Q.quantize_per_tensor(torch.randn(2, 3, 4, 5), 0.05, 3, Q.quint8)
    for b in (a.to(memory_format=torch.channels_last), a.to("cpu", memory_format=torch.channels_last)):
        assert b.int_repr().is_contiguous(memory_format=torch.channels_last)  # "required rank 4 tensor"
        assert torch.equal(b.dequantize(), a.dequantize())
    c = a.to("cpu", copy=True)
    assert c.int_repr().data_ptr() != a.int_repr().data_ptr() and torch.equal(c.int_repr(), a.int_repr())


def test_iteration():
    s = Q.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, Q.quint8).mean()
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):  # gave [] silently
        list(s)
    a, _ = _qt()
    rows = list(a)
    assert len(rows) == 2 and torch.equal(rows[1].int_repr(), a.int_repr()[1])


def test_shape_ops_take_torchs_keyword_names():
    a = Q.quantize_per_tensor(torch.randn(1, 3, 4), 0.05, 3, Q.quint8)
    f = a.dequantize()
    pairs = [(torch.transpose(a, dim0=0, dim1=2), f.transpose(0, 2)), (torch.permute(a, dims=(2, 0, 1)), f.permute(2, 0, 1)),
             (torch.squeeze(a, dim=0), f.squeeze(0)), (a.reshape(shape=(3, 4)), f.reshape(3, 4))]
    for got, want in pairs:
        assert torch.equal(got.dequantize(), want)
    assert [p.shape[1] for p in a.split(split_size=2, dim=1)] == [2, 1]


@pytest.mark.parametrize("bits,group", [(4, 32), (8, -1)])
def test_weight_only_backpropagates_at_every_batch_size(bits, group):
    torch.manual_seed(0)
    wo = Q.quantize_weight_only(nn.Sequential(nn.Linear(64, 32)).eval(), bits=bits, group_size=group)
    grads = []
    for rows in (2, 64):  # 2 rows took the packed decode kernel, which has no derivative
        x = torch.randn(rows, 64, requires_grad=True)
        wo(x).sum().backward()
        grads.append(x.grad[:1])
    assert torch.allclose(grads[0], grads[1])  # d(sum y)/dx is the same row for every input


def test_a_quantized_conv_takes_8bit_codes_stored_wider():
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 4, 3), Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(2, 3, 8, 8))
    q = Q.convert(p)
    qx = q[0](torch.randn(2, 3, 8, 8))
    wide = Q.QTensor(qx.int_repr().to(torch.int32), qx.q_scale(), qx.q_zero_point(), Q.quint8)
    assert torch.equal(q[1](wide).int_repr(), q[1](qx).int_repr())  # was "expects 8-bit codes, got ... quint8"


def test_meta_tensors_get_a_clear_error_and_meta_models_print():
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(8, 4))
    q = Q.convert(p)
    dyn = Q.quantize_dynamic(nn.Sequential(nn.Linear(4, 3)))
    for model in (q, dyn):
        with pytest.raises(RuntimeError, match="a meta tensor .* has no values to quantize"):  # was Tensor.item()
            model(torch.randn(2, 4, device="meta"))
    assert "scale=<meta>" in repr(q.to("meta"))
