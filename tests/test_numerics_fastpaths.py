"""The fast paths of ``functional.quantize`` / ``dequantize`` and the blocked per-token epilogue are
bit-identical to the plain formulas they replace (``round(x · float32(1/s) + z)``, ``(q - z) · s``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q
from lowbit.functional import dequantize, quantize
from lowbit.nn.quantized.dynamic import per_token as dl


def plain_quantize(x, s, z, qd):
    s, z = torch.tensor(s, dtype=torch.float32), torch.tensor(z, dtype=torch.float32)
    return torch.round(x.to(torch.float32) * torch.reciprocal(s) + z).clamp(qd.quant_min, qd.quant_max).to(qd.storage)


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([1, 7, 33, 4097, 9000]), log_s=st.floats(-12, 6), z=st.integers(0, 255),
       u8=st.booleans(), seed=st.integers(0, 2**16), as_tensor=st.booleans())
def test_quantize_and_dequantize_match_plain_formulas(n, log_s, z, u8, seed, as_tensor):
    g = torch.Generator().manual_seed(seed)
    s = float(torch.tensor(2.0 ** log_s, dtype=torch.float32))
    qd, z = (Q.quint8, z) if u8 else (Q.qint8, z - 128)
    x = torch.randn(n, generator=g) * s * 100
    x[::2] = torch.round(x[::2] / s * 2) / 2 * s  # rounding ties
    sv, zv = (torch.tensor(s), torch.tensor(z)) if as_tensor else (s, z)
    q = quantize(x, sv, zv, qd)
    assert torch.equal(q, plain_quantize(x, s, z, qd))
    assert torch.equal(dequantize(q, sv, zv), (q.to(torch.float32) - float(z)) * torch.tensor(s))


def test_dequantize_does_not_modify_a_float_input_and_keeps_grid_errors():
    q = torch.tensor([1.0, 2.0])
    assert torch.equal(dequantize(q, 0.5, 1), torch.tensor([0.0, 0.5])) and torch.equal(q, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="per-tensor qparams"):
        dequantize(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(3), torch.zeros(3, dtype=torch.long))


def test_blocked_epilogue_equals_whole_tensor_expression(monkeypatch):
    g = torch.Generator().manual_seed(0)
    raw, c = torch.randn(37, 11, generator=g) * 1e3, torch.randint(-128, 128, (37,), generator=g).float()
    wsum, sx, b = torch.randn(11, generator=g), torch.rand(37, generator=g), torch.randn(11, generator=g)
    ref = (raw - c[:, None] * wsum) * sx[:, None] + b
    monkeypatch.setattr(dl, "_BLOCK", 30)  # blocks of 2 rows, the last one short
    assert torch.equal(dl._epilogue(raw.clone(), c[:, None], wsum, sx[:, None], b), ref)


@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (4, 16, 12, 12), (9, 8, 11, 13)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset"])
def test_dequantize_fast_is_dequantize(shape, dtype, layout):
    """``dequantize_fast`` (one torch dequantize of the codes, above 4096 elements through a view of their memory) gives
    ``dequantize``'s floats bit for bit, in the codes' layout: contiguous, channels-last, and a view at a storage offset."""
    from lowbit.functional import dequantize_fast
    g = torch.Generator().manual_seed(sum(shape))
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    q = torch.randint(lo, hi, (shape[0] + 1, *shape[1:]), generator=g, dtype=dtype)
    q = q[1:] if layout == "offset" else q[:-1].clone()
    if layout == "channels_last":
        q = q.contiguous(memory_format=torch.channels_last)
    for s, z in [(0.0123, 3), (1e-5, -7 if dtype == torch.int8 else 200), (7.5, 0)]:
        st, zt = torch.tensor(s, dtype=torch.float32), torch.tensor(z)
        y = dequantize_fast(q, st, zt)
        assert torch.equal(y, dequantize(q, st, zt)) and y.stride() == q.stride(), (s, z)
