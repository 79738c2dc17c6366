"""Session 37: the functional ops a converted model calls on QTensors, against torch.ao's quantized tensors.

- dropout at inference (``F.dropout(x, p, training=False)``, ``nn.Dropout2d`` in ``eval()``, ``torch.dropout``
  ...) is the identity on a QTensor, as on torch's quantized tensors (it dequantized and returned float, warned);
- ``F.threshold`` keeps the grid: the codes above the threshold, the rest ``value``'s code (float fallback before);
- ``torch.ao.nn.quantized.functional.hardtanh`` (``torch._C._nn.hardtanh``) clamps the codes (float fallback before);
- ``torch.ops.quantized.*`` kernels (``qF.hardswish / elu / celu / threshold / linear`` call them) handed a
  QTensor say what to use instead (torch's "Could not run 'quantized::elu' ... 'CPU' backend" before).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.nn.quantized.functional as qF
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.functional import as_torch_quantized

_DROPOUTS = [
    lambda t: F.dropout(t, 0.5, False), lambda t: F.dropout(t, 0.5, training=False, inplace=True),
    lambda t: F.dropout1d(t[0], 0.5, False), lambda t: F.dropout2d(t, 0.5, False), lambda t: F.dropout3d(t, 0.5, False),
    lambda t: F.alpha_dropout(t, 0.5, False), lambda t: F.feature_alpha_dropout(t, 0.5, False),
    lambda t: torch.dropout(t, 0.5, False), lambda t: torch.feature_dropout(t, 0.5, False),
    lambda t: F.dropout(t, 0.0, True), nn.Dropout2d(0.3).eval(), nn.AlphaDropout(0.3).eval(),
]


def _qx(dtype: Q.QDtype = Q.quint8, zp: int = 100) -> Q.QTensor:
    torch.manual_seed(0)
    return Q.quantize_per_tensor(torch.randn(2, 3, 6, 5) * 2, 0.05, zp, dtype)


def _no_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


@pytest.mark.parametrize("k", range(len(_DROPOUTS)))
def test_dropout_at_inference_is_the_identity(k):
    qx = _qx()
    out = _no_warning(_DROPOUTS[k], qx)
    want = qx[0] if k == 2 else qx
    assert isinstance(out, Q.QTensor) and torch.equal(out.int_repr(), want.int_repr())
    assert out.q_scale() == qx.q_scale() and out.q_zero_point() == qx.q_zero_point()
    tq = as_torch_quantized(qx.int_repr(), qx.q_scale(), qx.q_zero_point())  # torch.ao: the same codes, unchanged
    assert torch.equal(_DROPOUTS[k](tq).int_repr(), want.int_repr())


def test_dropout_probability_is_checked_and_training_still_falls_back():
    qx = _qx()
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout probability"):
            F.dropout(qx, p, False)
    with pytest.warns(UserWarning, match="dropout"):
        y = F.dropout(qx, 0.5, True)  # (torch's quantized tensors refuse a training dropout)
    assert isinstance(y, torch.Tensor) and y.shape == qx.shape


def test_functional_dropout_in_a_converted_model_stays_integer():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.c1, self.c2, self.dq = Q.QuantStub(), nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3), Q.DeQuantStub()

        def forward(self, x):
            return self.dq(self.c2(F.dropout(self.c1(self.q(x)), 0.3, self.training)))

    torch.manual_seed(0)
    m = Net().eval()
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(copy.deepcopy(m))
    xs = [torch.randn(4, 3, 12, 12) for _ in range(3)]
    for x in xs:
        p(x)
    qm = Q.convert(p)
    seen = []
    qm.c2.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0])))
    y = _no_warning(qm, xs[0])  # (the dropout dequantized before: a warning, c2 quantized a float input)
    assert seen == [Q.QTensor]
    c1 = qm.c1(qm.q(xs[0]))
    assert torch.equal(y, qm.dq(qm.c2(c1)))


@pytest.mark.parametrize("dtype,zp", [(Q.quint8, 100), (Q.qint8, -3)])
def test_threshold_keeps_the_grid(dtype, zp):
    qx = _qx(dtype, zp)
    out = _no_warning(F.threshold, qx, 0.3, -0.2)
    assert isinstance(out, Q.QTensor) and out.q_scale() == qx.q_scale() and out.q_zero_point() == qx.q_zero_point()
    want = F.threshold(qx.dequantize(), 0.3, -0.2)  # the float op on the values; -0.2 is on the grid (4 steps)
    assert torch.equal(out.dequantize(), want)
    tq = as_torch_quantized(qx.int_repr(), qx.q_scale(), qx.q_zero_point())
    torch_codes = F.threshold(tq, 0.3, -0.2).int_repr()
    off_tie = (qx.dequantize() - 0.3).abs() > 0.025  # torch keeps a value equal to the threshold once rounded
    assert torch.equal(out.int_repr()[off_tie], torch_codes[off_tie]) and not off_tie.all()
    assert torch.equal(torch.threshold(qx, 0.3, -0.2).int_repr(), out.int_repr())


def test_threshold_per_channel_off_grid_and_nan():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 4)
    pc = Q.quantize_per_channel(x, torch.tensor([0.02, 0.05, 0.1]), torch.tensor([0, 3, -7]), 1, Q.qint8)
    out = _no_warning(F.threshold, pc, 0.1, 0.0)
    assert isinstance(out, Q.QTensor) and out.axis == 1
    assert torch.equal(out.dequantize(), F.threshold(pc.dequantize(), 0.1, 0.0))
    qx = _qx()
    with pytest.warns(UserWarning, match="threshold"):
        y = F.threshold(qx, 0.0, 100.0)  # the grid ends at 7.75: float values, not a saturated code
    assert torch.equal(y, F.threshold(qx.dequantize(), 0.0, 100.0))
    with pytest.raises(ValueError, match="threshold=nan"):
        F.threshold(qx, float("nan"), 0.0)


def test_torch_ao_functional_hardtanh_clamps_the_codes():
    qx = _qx()
    out = _no_warning(qF.hardtanh, qx, -0.5, 0.7)
    tq = as_torch_quantized(qx.int_repr(), qx.q_scale(), qx.q_zero_point())
    assert isinstance(out, Q.QTensor) and torch.equal(out.int_repr(), qF.hardtanh(tq, -0.5, 0.7).int_repr())


@pytest.mark.parametrize("call,kernel", [
    (lambda t: qF.hardswish(t, 0.03, 10), "hardswish"), (lambda t: qF.elu(t, 0.03, 10), "elu"),
    (lambda t: qF.celu(t, 0.03, 10), "celu"), (lambda t: qF.threshold(t, 0.1, 0.0), "threshold"),
    (lambda t: torch.ops.quantized.hardswish.default(t, 0.03, 10), "hardswish"),
])
def test_torch_ao_kernels_say_what_to_use(call, kernel):
    with pytest.raises(TypeError, match=rf"torch\.ops\.quantized\.{kernel} is a torch\.ao kernel.*lowbit\.nn\.quantized"):
        call(_qx())
