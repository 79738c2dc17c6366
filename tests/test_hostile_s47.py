"""Session 47 (review47): hostile inputs on session 46's code. Each group failed before its fix:

- int8 ops after a scalar product that collapsed under the observer's floor (``a = y * 1e-30``): ``a * 2.0`` read
  ``a``'s codes on its observer's collapsed grid (not the input grid x c the scalar rule gave ``a``), and an add /
  cat / tensor product of such values, or any int op reading one, put every value on the zero point: 0.0 dB (torch.ao
  0.0). Now a scalar op reads its producer's rule grid, and an op whose output or input range collapsed (without such
  a grid) is kept float, warned: 38-39 dB;
- a NumPy scalar constant (``y * np.float64(0.5)``, ``scores / np.sqrt(d)``): torch.fx wrote ``np.float64(0.5)``
  into the prepared model's code, ``NameError: name 'np' is not defined`` on its first call;
- an untraceable forward reading ``self.get_submodule("block.fc").weight`` or a great-grandchild
  ``self.deep.inner.fc.weight``: ``'LinearReLU' object has no attribute 'weight'`` / ``'method' * float``; one
  testing ``isinstance(self.proj, nn.Linear)`` took the other branch after prepare, silently (now warned); one
  reading its child's layout as ``getattr(y, "stride")(1)`` was not seen as a layout reader (0.1 dB, now 39.5);
- ``refine_grids``: ``batches=None`` / ``only=None`` (``'NoneType' object is not iterable``), ``mults=("a",)``
  (``'<' not supported``), a generator of mults (drained by the check: the search had no steps), ``rank_samples``
  0 / -1 (accepted; -1 sliced off a sample), first batches of other feature sizes joined by ``samples=``
  (``torch.cat``'s bare error), a NaN / Inf batch (the search ran on NaN errors and changed nothing, silently);
- ``equalize_prepared(dense=np.float32(0.5))`` / ``Fraction(1, 2)`` was "must be a number";
- ``batch_failed`` of an error with no text named ``RuntimeError: `` and of an exception whose ``str`` fails raised
  that failure instead.
"""

from __future__ import annotations

import copy
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.algorithms.equalize import equalize_prepared
from lowbit.algorithms.grid_search import refine_grids
from lowbit.batches import batch_failed
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from test_hostile_s46 import _Net
from test_hostile_s46 import _calibrated as _calibrated46


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


_X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))


def _convert(model: nn.Module, x: torch.Tensor = _X) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        with torch.no_grad():
            p(x)
        return Q.convert_fx(p)


# ---------------------------------------------------------------- 1. after a collapsed scalar product
class _Tiny(nn.Module):
    def __init__(self, form: str, c: float = 1e-30) -> None:
        super().__init__()
        self.fc, self.fc2, self.form, self.c = nn.Linear(8, 8), nn.Linear(8, 8), form, c

    def forward(self, x):
        y = self.fc(x)
        a = y * 1e-30
        if self.form == "mul_mul":
            return (a * 2.0) * 1e30
        if self.form == "mul_div":
            return (a / 3.0) * 1e30
        if self.form == "add":
            return (a + a * 2.0) * 1e30
        if self.form == "add_linear":
            return self.fc2((a + a) * 1e30)
        if self.form == "cat":
            return torch.cat([a, a * 2.0], 1) * 1e30
        if self.form == "two_products":
            return (self.fc2(x) * 1e-30 + a) * 1e30
        if self.form == "numpy":
            return y * self.c
        return (y * 1e-15) * (y * 1e-15) * 1e30  # "tensor_mul"


@pytest.mark.parametrize("form", ["mul_mul", "mul_div", "add", "add_linear", "cat", "two_products", "tensor_mul"])
def test_int8_ops_after_a_collapsed_scalar_product(form):
    torch.manual_seed(0)
    model = _Tiny(form).eval()
    db = _sqnr(model(_X), _convert(model)(_X))
    assert db > 35.0, f"{db:.1f} dB"  # 0.0 before (torch.ao 0.0): every value on the zero point


def test_an_op_reading_a_collapsed_value_is_kept_float_and_named():
    torch.manual_seed(0)
    model = _Tiny("add").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(_X,))
        p(_X)
    with pytest.warns(UserWarning, match=r"'add'.*below the observer's scale floor.*kept float"):
        q = Q.convert_fx(p)
    assert any("scale floor" in v for k, v in q.lowbit_report.left_float.items() if k.startswith("add")), \
        q.lowbit_report.left_float


def test_ordinary_scalar_products_keep_their_bits():
    """``x * 0.5`` / ``x / 3``: no collapsed range, the rule does not touch them (the same codes as a plain int8
    scalar op on its observed grid)."""
    torch.manual_seed(0)
    model = _Tiny("numpy", 0.5).eval()
    q = _convert(model)
    assert not q.lowbit_report.left_float
    assert "QFunctional" in str([type(m).__name__ for m in q.modules()])


# ---------------------------------------------------------------- 2. NumPy scalar constants
@pytest.mark.parametrize("c", [np.float64(0.5), np.float64(1e-30), np.sqrt(np.float64(8.0)), np.float32(0.25)],
                         ids=["f64", "f64_tiny", "sqrt", "f32"])
def test_a_numpy_scalar_constant(c):
    torch.manual_seed(0)
    model = _Tiny("numpy", c).eval()
    db = _sqnr(model(_X), _convert(model)(_X))  # NameError: name 'np' is not defined before (f64)
    assert db > 35.0, f"{db:.1f} dB"


# ---------------------------------------------------------------- 3. reads by a dotted get_submodule, deeper down
class _DeepBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = nn.Sequential()
        self.block.fc, self.block.relu = nn.Linear(8, 8), nn.ReLU()
        self.deep = nn.Sequential()
        self.deep.inner = nn.Sequential()
        self.deep.inner.fc = nn.Linear(8, 8)

    def gate(self, x):
        h = self.pre(x)
        if h.sum() > -1e9:  # (data-dependent: the children are prepared one by one)
            h = h + 0
        return h


class _Dotted(_DeepBase):
    def forward(self, x):
        h = self.gate(x)
        return self.block(h) + F.linear(h, self.get_submodule("block.fc").weight * 0.5)


class _GreatGrandchild(_DeepBase):
    def forward(self, x):
        h = self.gate(x)
        return self.deep(h) + F.linear(h, self.deep.inner.fc.weight * 0.5)


class _Grandchild(_DeepBase):
    def forward(self, x):  # (session 46's holder: fc.module)
        h = self.gate(x)
        return self.block(h) + F.linear(h, self.block.fc.weight * 0.5)


_DEEP = {"dotted": _Dotted, "great_grandchild": _GreatGrandchild, "grandchild": _Grandchild}


@pytest.mark.parametrize("form", ["dotted", "great_grandchild"])
def test_reads_of_a_deeper_submodule(form):
    torch.manual_seed(0)
    model = _DEEP[form]().eval()
    q = _convert(model, _X)  # AttributeError: 'LinearReLU' ... 'weight' / TypeError: 'method' * float before
    assert _sqnr(model(_X), q(_X)) > 35.0
    assert torch.equal(copy.deepcopy(q)(_X), q(_X))
    read = q.block.fc.weight if form == "dotted" else q.deep.inner.fc.weight
    assert isinstance(read, nn.Parameter) and torch.equal(read, model.get_submodule(
        "block.fc" if form == "dotted" else "deep.inner.fc").weight)


class _TypeTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        if h.sum() > -1e9:
            h = h + 0
        return self.proj(h) * (1.0 if isinstance(self.proj, nn.Linear) else 2.0)


def test_a_type_test_of_a_prepared_child_is_warned():
    """The prepared child is a GraphModule: the forward's ``isinstance(self.proj, nn.Linear)`` turns False and the
    output doubles (0 dB against the float model). Named at prepare (it was silent)."""
    with pytest.warns(UserWarning, match=r"prepare_fx: 'proj': the forward of _TypeTest \(not traced\) tests the type "
                                         r"of self.proj .*not a Linear"):
        Q.prepare_fx(_TypeTest().eval(), Q.get_default_qconfig_mapping(), example_inputs=(_X,))


class _GetattrStride(nn.Module):
    """An untraceable parent reading its conv child's layout as ``getattr(y, "stride")``."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        if y.sum() > -1e9:
            y = y + 0
        return y.flatten(1) * (getattr(y, "stride")(1) / 64)  # noqa: B009


def test_a_layout_read_spelled_by_getattr():
    """``reads_layout`` saw only ``y.stride``: the child's channels-last int8 output gave stride(1) = 1, 0.1 dB."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    model = _GetattrStride().eval()
    db = _sqnr(model(x), _convert(model, x)(x))
    assert db > 35.0, f"{db:.1f} dB"  # 0.1 before


# ---------------------------------------------------------------- 4. refine_grids' arguments
_G = torch.Generator().manual_seed(0)
_ONES = [(torch.randn(4, 8, generator=_G) * (1 + i),) for i in range(4)]


def _calibrated():
    return _calibrated46(_Net, _ONES)


_NAN = (torch.full((4, 8), float("nan")),)


@pytest.mark.parametrize("batches, kw, error, match", [
    (None, {}, TypeError, r"refine_grids: batches must be an iterable of calibration batches, got NoneType"),
    (_ONES, {"only": None}, TypeError, r"refine_grids: only=None must be a sequence"),
    (_ONES, {"mults": ("a",)}, ValueError, r"refine_grids: mults=\('a',\) must be multipliers in \(0, 1\]"),
    (_ONES, {"rank_samples": -1}, ValueError, r"refine_grids: rank_samples=-1 must be an int >= 1"),
    (_ONES, {"rank_samples": 0}, ValueError, r"refine_grids: rank_samples=0 must be an int >= 1"),
    ([_ONES[0], (torch.randn(4, 5),)], {"samples": 8}, ValueError,
     r"refine_grids: samples=8 joins the first batches, whose input shapes differ .*\[\[\(4, 8\)\], \[\(4, 5\)\]\]"),
    ([_NAN], {}, ValueError, r"refine_grids: batch 0, input 0 holds 32 NaN/Inf values"),
    ([_ONES[0], _NAN], {"held": 4}, ValueError, r"refine_grids: batch 1, input 0 holds 32 NaN/Inf values"),
], ids=["batches_none", "only_none", "mults_str", "rank_samples_neg", "rank_samples_0", "mismatched_join", "nan",
        "nan_held"])
def test_refine_grids_names_a_bad_argument(batches, kw, error, match):
    with pytest.raises(error, match=match):
        refine_grids(_calibrated(), batches, progress=False, **kw)


def test_refine_grids_reads_a_generator_of_mults_once():
    want = [(g.source, g.scale_after) for g in refine_grids(_calibrated(), _ONES, progress=False, mults=(0.5, 0.8))]
    got = [(g.source, g.scale_after) for g in refine_grids(_calibrated(), _ONES, progress=False,
                                                           mults=(m for m in (0.5, 0.8)))]
    assert got == want and any(s != b for (_, s), (_, b) in zip(got, [(g.source, g.scale_before) for g in
                                                                     refine_grids(_calibrated(), _ONES, progress=False,
                                                                                  top=8, mults=(1.0,))]))


# ---------------------------------------------------------------- 5. dense= any real number; batch_failed
class _DW(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.r, self.b = nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.ReLU6(), nn.Conv2d(4, 8, 1)

    def forward(self, x):
        return self.b(self.r(self.a(x)))


@pytest.mark.parametrize("dense", [np.float32(0.5), Fraction(1, 2)], ids=["np_float32", "fraction"])
def test_equalize_dense_takes_any_real(dense):
    x = torch.randn(8, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 3
    outs = []
    for d in (0.5, dense):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = Q.prepare_fx(_DW().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
            equalize_prepared(p, [(x,)], relu6="range", dense=d)  # "must be a number in [0, 1]" before
        outs.append(p(x))
    assert torch.equal(*outs)


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str fails")


@pytest.mark.parametrize("err, tail", [(RuntimeError(""), "RuntimeError: (no message)"),
                                       (_BadStr(), "_BadStr: (no message)")], ids=["empty", "str_fails"])
def test_batch_failed_without_a_message(err, tail):
    assert str(batch_failed("demo", "calib batch 1", (torch.zeros(1, 3),), err)).endswith(tail)


# ---------------------------------------------------------------- 6. ONNX export of a grandchild-read holder (a pin)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("form", ["grandchild", "great_grandchild"])
def test_onnx_export_of_the_grandchild_read_holder(tmp_path, form, exact):
    """``self.block.fc.weight`` read by an untraceable forward: ``fc`` holds the float weight and calls ``fc.module``
    (keys ``block.fc.module.*``); the exported file runs in ONNX Runtime as the converted model (already so: a pin;
    the great-grandchild's holder ``deep.inner.fc`` is new)."""
    ort = pytest.importorskip("onnxruntime")
    from lowbit.export import to_onnx

    torch.manual_seed(0)
    model = _DEEP[form]().eval()
    q = _convert(model)
    holder = "block.fc" if form == "grandchild" else "deep.inner.fc"
    assert any(k.startswith(f"{holder}.module.") for k in q.state_dict()) and f"{holder}.weight" in q.state_dict()
    path = to_onnx(q, (_X[:8],), tmp_path / "m.onnx", exact=exact)
    sess = ort.InferenceSession(str(path))
    got = sess.run(None, {sess.get_inputs()[0].name: _X[:5].numpy()})[0]
    want = q(_X[:5]).detach().numpy()
    assert np.abs(got - want).max() <= (1e-6 if exact else 1e-2) * np.abs(want).max()  # (exact: the float reads
    # of the holder are float matmuls, rounded as ORT sums)
