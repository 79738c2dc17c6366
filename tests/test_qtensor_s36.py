"""QTensor conversions, text and Tensor-method parity against torch's quantized tensors (session 36): each test failed
before its fix."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import lowbit as Q
from lowbit.qtensor import _warned_ops

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")

X = torch.linspace(-1, 1, 24).reshape(2, 3, 4)
S, Z = torch.tensor([0.01, 0.02, 0.03]), torch.tensor([0, 10, -5])


def _pairs() -> list[tuple[torch.Tensor, Q.QTensor]]:
    """(torch's quantized tensor, lowbit's) on the same grid: per tensor quint8 / qint8 / qint32, per channel."""
    return [
        (torch.quantize_per_tensor(X, 0.01, 128, torch.quint8), Q.quantize_per_tensor(X, 0.01, 128, Q.quint8)),
        (torch.quantize_per_tensor(X, 0.01, 3, torch.qint8), Q.quantize_per_tensor(X, 0.01, 3, Q.qint8)),
        (torch.quantize_per_tensor(X, 0.001, 0, torch.qint32), Q.quantize_per_tensor(X, 0.001, 0, Q.qint32)),
        (torch.quantize_per_channel(X, S, Z, 1, torch.qint8), Q.quantize_per_channel(X, S, Z, 1, Q.qint8)),
    ]


_INT_SHORTCUTS = ["int", "long", "short", "char", "byte", "bool"]
_FLOAT_SHORTCUTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                    "bfloat16": torch.bfloat16, "cfloat": torch.complex64, "cdouble": torch.complex128}


@pytest.mark.parametrize("name", _INT_SHORTCUTS)
def test_integer_dtype_shortcuts_are_refused_as_to_refuses_them(name):
    # before: qt.int() / qt.byte() ... truncated (wrapped, for byte) the dequantized values with a warning, while
    # qt.to(torch.int32) refused; torch's quantized tensors refuse both
    for tq, qt in _pairs():
        with pytest.raises(RuntimeError):
            getattr(tq, name)()
        with pytest.raises(TypeError, match=rf"QTensor\.{name}\(\).*int_repr\(\)"):
            getattr(qt, name)()
        dtype = getattr(torch, {"int": "int32", "long": "int64", "short": "int16", "char": "int8",
                                "byte": "uint8", "bool": "bool"}[name])
        with pytest.raises(TypeError, match="not integers"):
            qt.to(dtype)


@pytest.mark.parametrize("name", sorted(_FLOAT_SHORTCUTS))
def test_float_dtype_shortcuts_give_the_dequantized_values_as_to_does(name):
    dtype = _FLOAT_SHORTCUTS[name]
    for _, qt in _pairs():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an explicit request for float values: no fallback warning
            out = getattr(qt, name)()
        assert out.dtype == dtype and torch.equal(out, qt.dequantize().to(dtype)) and torch.equal(out, qt.to(dtype))
    qt4 = Q.quantize_per_tensor(torch.randn(1, 3, 2, 2), 0.05, 0, Q.qint8)
    out = getattr(qt4, name)(memory_format=torch.channels_last)
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_type_without_argument_is_torchs_type_string():
    for tq, qt in _pairs():
        assert qt.type() == tq.type()  # 'torch.quantized.QUInt8Tensor' ... (was 'torch.FloatTensor')
    assert Q.quantize_per_tensor(X, 0.1, 0, Q.qint4).type() == "lowbit.quantized.QInt4Tensor"


def test_type_to_its_own_quantized_dtype_is_itself_and_others_are_refused():
    # before: every quantized type(...) failed inside torch ("empty_strided not supported on quantized tensors")
    for tq, qt in _pairs():
        own = tq.dtype
        name = {torch.quint8: "QUInt8", torch.qint8: "QInt8", torch.qint32: "QInt32"}[own]
        assert tq.type(own) is tq and qt.type(own) is qt
        if own != torch.qint32:  # torch's own string parser knows the 8-bit names
            assert tq.type(f"torch.{name}Tensor") is tq
        assert qt.type(f"torch.{name}Tensor") is qt and qt.type(qt.type()) is qt
        other = torch.qint8 if own != torch.qint8 else torch.quint8
        with pytest.raises(RuntimeError):
            tq.type(other)
        with pytest.raises(TypeError, match=f"cannot change its quantized dtype to {other}"):
            qt.type(other)
        with pytest.raises(TypeError, match="cannot change its quantized dtype"):
            qt.type("torch.QInt32Tensor" if own != torch.qint32 else "torch.QInt8Tensor")


def test_type_to_a_float_or_integer_type_follows_to():
    _, qt = _pairs()[3]
    for target in (torch.float64, "torch.DoubleTensor", torch.DoubleTensor):
        out = qt.type(target)
        assert out.dtype == torch.float64 and torch.equal(out, qt.dequantize().double())
    for target in (torch.int32, "torch.IntTensor", torch.LongTensor, torch.bool):
        with pytest.raises(TypeError, match="not integers"):
            qt.type(target)
    with pytest.raises(ValueError, match=r"QTensor.type\('torch.NoSuchTensor'\): invalid type"):
        qt.type("torch.NoSuchTensor")
    with pytest.raises(TypeError, match="dtype=5"):
        qt.type(5)


def test_type_as_follows_the_same_rule():
    _, qt = _pairs()[0]
    assert torch.equal(qt.type_as(torch.zeros(1, dtype=torch.float64)), qt.dequantize().double())
    assert qt.type_as(qt) is qt
    with pytest.raises(TypeError, match="not integers"):  # was the values truncated to int32
        qt.type_as(torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="cannot change its quantized dtype"):
        qt.type_as(_pairs()[1][1])


def _meta_qtensors() -> list[Q.QTensor]:
    codes = torch.empty(2, 3, dtype=torch.int8, device="meta")
    return [Q.QTensor(codes, 0.1, 0, Q.qint8), _pairs()[0][1].to("meta"), _pairs()[3][1].to("meta"),
            Q.QTensor(codes, torch.full((3,), 0.1, device="meta"), torch.zeros(3, device="meta"), Q.qint8, axis=1)]


def test_a_meta_qtensor_prints_its_metadata_without_reading_data():
    # before: repr / str / format called Tensor.item() on the meta qparams: RuntimeError
    for qt in _meta_qtensors():
        for text in (repr(qt), str(qt), f"{qt}"):
            assert text.startswith(f"QTensor(shape={tuple(qt.shape)}, dtype={qt.qdtype!r}, ") and "device=meta" in text
            assert ("scale=?" if qt.axis is None else f"axis={qt.axis}, scales=?") in text


def test_a_meta_qtensor_dequantizes_to_a_meta_float_tensor():
    for qt in _meta_qtensors():  # before: the qparam check read the meta scale (RuntimeError)
        out = qt.dequantize()
        assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == qt.shape


def test_format_is_str_and_a_0d_qtensor_formats_its_value_as_torch():
    _, qt = _pairs()[0]
    assert f"{qt}" == str(qt) == repr(qt)  # was the dequantized float tensor's repr (it read as a float tensor)
    t0 = torch.quantize_per_tensor(torch.tensor(0.5), 0.01, 128, torch.quint8)
    q0 = Q.quantize_per_tensor(torch.tensor(0.5), 0.01, 128, Q.quint8)
    assert format(q0, ".3f") == format(t0, ".3f") == "0.500"
    with pytest.raises(TypeError):
        format(_pairs()[0][0], ".3f")
    with pytest.raises(TypeError, match="unsupported format string"):
        format(qt, ".3f")


def test_requires_grad_false_is_torchs_noop_and_true_stays_refused():
    for tq, qt in _pairs():
        assert tq.requires_grad_(False) is tq and qt.requires_grad_(False) is qt  # was a TypeError
        with pytest.raises(TypeError, match="cannot require gradients"):
            qt.requires_grad_()
        assert qt.requires_grad is False


def test_share_memory_moves_the_codes_to_shared_memory_as_torch():
    for tq, qt in _pairs():
        before = qt.int_repr().clone()
        assert tq.share_memory_() is tq and tq.is_shared()
        assert qt.share_memory_() is qt and qt.is_shared() and torch.equal(qt.int_repr(), before)  # was a TypeError


@pytest.mark.parametrize("op, channel, oracle", [
    (lambda a: a[:, :1].squeeze(1), 0, True), (lambda a: a[:, 2:].squeeze(), 2, True),
    (lambda a: a[:1, 1:2].squeeze(), 1, True),
    (lambda a: a[:, 1:2].flatten(1), 1, False), (lambda a: a[:, 2:].reshape(8), 2, False),  # (torch: per channel)
])
def test_squeezing_or_merging_a_single_channel_gives_its_grid_per_tensor(op, channel, oracle):
    tq, qt = _pairs()[3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was the float fallback with its warning
        out = op(qt)
    assert isinstance(out, Q.QTensor) and out.axis is None
    assert out.q_scale() == S[channel].item() and out.q_zero_point() == Z[channel].item()
    assert torch.equal(out.int_repr(), op(qt.int_repr())) and torch.equal(out.dequantize(), op(qt.dequantize()))
    if oracle:  # torch's squeeze of a size-1 channel dim: that channel's grid, per tensor
        ref = op(tq)
        assert ref.qscheme() == torch.per_tensor_affine and torch.equal(out.int_repr(), ref.int_repr())
        assert out.q_scale() == pytest.approx(ref.q_scale()) and out.q_zero_point() == ref.q_zero_point()


def test_one_channel_of_fractional_float_zero_points_is_its_float_values():
    # before: qt[0] / unbind / select raised "zero_point=0.5 must be an integer", a value the user never passed
    codes = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8)
    qt = Q.QTensor(codes, torch.tensor([0.1, 0.2]), torch.tensor([0.5, 1.25]), Q.quint8, axis=0)
    _warned_ops.discard("selecting one channel of a float-zero-point per-channel QTensor")
    with pytest.warns(UserWarning, match="float-zero-point"):
        row = qt[0]
    assert not isinstance(row, Q.QTensor) and torch.equal(row, qt.dequantize()[0])
    assert all(torch.equal(r, d) for r, d in zip(qt.unbind(0), qt.dequantize().unbind(0)))
    assert torch.equal(qt.select(0, 1), qt.dequantize()[1])
    whole = Q.QTensor(codes, torch.tensor([0.1, 0.2]), torch.tensor([2.0, 1.25]), Q.quint8, axis=0)
    assert isinstance(whole[0], Q.QTensor) and whole[0].q_zero_point() == 2  # an integral one keeps its grid


def test_every_qtensor_module_stays_small():
    src = Path(Q.__file__).parent / "qtensor"
    sizes = {p.name: len(p.read_text().splitlines()) for p in src.glob("*.py")}
    assert "convert.py" in sizes and max(sizes.values()) <= 400, sizes  # __init__.py was 434 lines
