"""Session 44 (edges44): hostile-input edges hostile44 found and left. Each test failed before its fix:

- graph mode: a write through ``a.as_strided(size, a.stride())`` was replayed on a row-major float copy with the
  strides read from the QTensor (its codes' channels-last layout after an int8 conv): the write hit other elements
  (7.7 dB against the float model; ``a.stride()[2]`` items: 2.2 dB); the replay now reads the copy's strides;
- ``QTensor.view(torch.float32)`` (a no-op in the float model) raised torch's "stride(-1) must be 1 to view Byte as
  Float" (channels-last codes) or reinterpreted 4 code bytes as one float; other multi-byte dtypes raised torch's
  element-size errors; ``view(q.qdtype)`` raised "view() received an invalid combination of arguments";
- ``to_onnx(path=...)``: a symbolic link at ``path`` (to a file, or dangling) was replaced by a regular file (a
  dangling link's check also left an empty file at its target); ``'x.onnx/'`` / ``'x.onnx/.'`` wrote ``x.onnx``;
- ``quantize_ptq(iters=2**70)`` was accepted and ran on (over 40 s for a 2-layer model before it was stopped);
  ``tune=2**70`` was refused by ``tune_biases`` as "iters=..."; ``refine`` / ``batch_size`` had no upper bound.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.ptq_checks import check_options
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-30)))


class _Net(nn.Module):
    def __init__(self, fn):
        super().__init__()
        torch.manual_seed(1)
        self.c1 = nn.Conv2d(4, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


def _lowbit(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(x.clone(),))
        with torch.no_grad():
            for i in range(3):
                p(x.clone() + 0.05 * i)
        return Q.convert_fx(p)


def _write(view, whole: bool = False):
    return lambda m, x: (lambda a: ((view(a) if whole else view(a)[:, :4]).mul_(2), m.c3(a))[1])(m.c1(x))


_SLICE = _write(lambda a: a)
_STRIDED = {
    "as_strided(a.size(), a.stride())": (_write(lambda a: a.as_strided(a.size(), a.stride())), _SLICE),
    "a.stride() items": (_write(lambda a: a.as_strided((2, 8, 8, 8), (a.stride(0), a.stride()[1], a.stride()[2], 1)),
                                whole=False), _SLICE),
    "storage_offset": (_write(lambda a: a.as_strided(a.size(), a.stride(), a.storage_offset())), _SLICE),
    "view(torch.float32)": (_write(lambda a: a.view(torch.float32)), _SLICE),
}


# ---- graph mode: strides read from a QTensor ----
@pytest.mark.parametrize("name", list(_STRIDED))
def test_a_write_through_as_strided_with_the_tensors_own_strides_is_the_plain_write(name):
    # before: 7.7 dB (as_strided(a.size(), a.stride()), storage_offset), 2.2 dB (a.stride() items); view(float32) raised
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    fn, plain = _STRIDED[name]
    model, twin = _Net(fn).eval(), _Net(plain).eval()
    with torch.no_grad():
        ref = model(x.clone())
        assert torch.equal(ref, twin(x.clone()))
        out = _lowbit(model, x)(x.clone())
        assert _sqnr(ref, out) > 30
        assert torch.equal(out, _lowbit(twin, x)(x.clone()))  # bit-exact: the same model written with a slice


def test_a_whole_write_through_as_strided_with_stride_items():
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    fn = _write(lambda a: a.as_strided((2, 4, 8, 8), (a.stride(0), a.stride()[1], a.stride(2), 1)), whole=True)
    model = _Net(fn).eval()
    with torch.no_grad():
        assert _sqnr(model(x.clone()), _lowbit(model, x)(x.clone())) > 30  # before: 2.2 dB


def test_view_float32_in_graph_mode_is_the_tensor_itself():
    # before: RuntimeError "self.stride(-1) must be 1 to view Byte as Float" from the converted model
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    model = _Net(lambda m, x: m.c3(m.c1(x).view(torch.float32))).eval()
    twin = _Net(lambda m, x: m.c3(m.c1(x))).eval()
    with torch.no_grad():
        assert torch.equal(_lowbit(model, x)(x.clone()), _lowbit(twin, x)(x.clone()))


# ---- QTensor.view(dtype) ----
@pytest.mark.parametrize("axis", [None, 1])
def test_qtensor_view_as_its_float_dtype_or_grid_is_the_same_qtensor(axis):
    x = torch.linspace(-1, 1, 24).reshape(2, 3, 4)
    q = (Q.quantize_per_tensor(x, 0.01, 3, Q.quint8) if axis is None
         else Q.quantize_per_channel(x, torch.tensor([0.01, 0.02, 0.03]), torch.tensor([0, 1, 2]), 1, Q.qint8))
    for dtype in (torch.float32, q.qdtype):
        for v in (q.view(dtype), q.view(dtype=dtype)):
            assert isinstance(v, Q.QTensor) and v.qdtype == q.qdtype and v.axis == axis
            assert torch.equal(v.int_repr(), q.int_repr()) and torch.equal(v.dequantize(), q.dequantize())
    assert torch.equal(q.view(torch.uint8 if axis is None else torch.int8), q.int_repr())  # codes' bytes, as before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int16, torch.int32, torch.float64,
                                   torch.float8_e4m3fn])
def test_qtensor_view_as_another_dtype_is_a_clear_error(dtype):
    # before: torch's "self.size(-1) must be divisible by 2 to view Byte as Half" (float8: a plain tensor of bytes)
    q = Q.quantize_per_tensor(torch.randn(2, 3), 0.1, 3, Q.quint8)
    with pytest.raises(ValueError, match=rf"QTensor\.view\(dtype={dtype}\).*torch\.float32"):
        q.view(dtype)


# ---- to_onnx: symbolic links and directory names ----
def test_to_onnx_writes_through_a_symbolic_link_and_keeps_it(tmp_path):
    # before: the link was replaced by a regular file; a dangling link's check left an empty file at its target
    onnx = pytest.importorskip("onnx")
    from lowbit.export.onnx import to_onnx
    m, x = nn.Linear(2, 2), (torch.randn(1, 2),)
    (tmp_path / "kept.onnx").write_bytes(b"old")
    cases = {"dangling.onnx": tmp_path / "new.onnx", "to_file.onnx": tmp_path / "kept.onnx"}
    for link, target in cases.items():
        os.symlink(target, tmp_path / link)
        assert to_onnx(m, x, tmp_path / link) == tmp_path / link
        assert (tmp_path / link).is_symlink() and os.readlink(tmp_path / link) == str(target)
        onnx.checker.check_model(onnx.load(str(target)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.onnx", "kept.onnx", "new.onnx", "to_file.onnx"]


def test_to_onnx_refuses_a_symbolic_link_to_a_directory_naming_both(tmp_path):
    pytest.importorskip("onnx")
    from lowbit.export.onnx import to_onnx
    os.symlink(tmp_path, tmp_path / "d.onnx")
    with pytest.raises(ValueError, match=r"d\.onnx' \(a symbolic link to .*\) is a directory"):
        to_onnx(nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "d.onnx")


@pytest.mark.parametrize("tail", ["x.onnx/", "x.onnx/.", "x.onnx/.."])
def test_to_onnx_refuses_a_name_that_ends_as_a_directory(tail, tmp_path):
    # before: 'x.onnx/' and 'x.onnx/.' wrote x.onnx ('x.onnx/..' said the directory is a directory)
    pytest.importorskip("onnx")
    from lowbit.export.onnx import to_onnx
    path = str(tmp_path) + os.sep + tail
    with pytest.raises(ValueError, match=rf"path={path!r} names a directory".replace(".", r"\.")):
        to_onnx(nn.Linear(2, 2), (torch.randn(1, 2),), path)
    assert list(tmp_path.iterdir()) == []


# ---- quantize_ptq: step and sample counts ----
_OPTS = dict(iters=500, batch_size=8, seed=0, blocks=True, rounding="adaround", learn_grids=True, distill=0, tune=0,
             float_output=True, refine=8, max_float_layers=0, streams=0.75, equalize="range", progress=False)


@pytest.mark.parametrize("option", ["iters", "tune", "refine", "batch_size"])
@pytest.mark.parametrize("value", [2 ** 63, 2 ** 70])
def test_quantize_ptq_refuses_counts_past_int64_naming_them(option, value):
    # before: iters=2**70 ran on (> 40 s on a 2-layer model), tune=2**70 failed in tune_biases as "iters=...",
    # refine / batch_size were taken
    with pytest.raises(ValueError, match=rf"quantize_ptq: {option}={value} must be an int in \[[01], 2\*\*63\)"):
        check_options("accurate", **dict(_OPTS, **{option: value}))


@pytest.mark.parametrize("option", ["iters", "tune", "refine", "batch_size"])
def test_quantize_ptq_takes_large_real_counts(option):
    check_options("accurate", **dict(_OPTS, **{option: 10 ** 6}))
    check_options("accurate", **dict(_OPTS, **{option: 2 ** 63 - 1}))
