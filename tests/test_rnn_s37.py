"""Session 37 sweep of the dynamic RNN / LSTM / GRU modules and cells, torch.ao's dynamic twins as the oracle.

Each test here failed before its fix in ``src/lowbit/nn/quantized/dynamic/{rnn,cells}.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import lowbit as Q
from helpers import threads
from lowbit.nn.quantized import dynamic as nnqd

one_thread = threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ao(mod: nn.Module) -> nn.Module:
    """torch.ao's dynamic twin (its default qconfig: per-tensor symmetric weights, 7-bit per-tensor activations)."""
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(copy.deepcopy(mod)), {type(mod)}, dtype=torch.qint8)[0]


def _h(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[index,return-value]


# ---- the qconfig's activation recipe reaches the gate GEMMs (it was silently per-token 8-bit) ----
@pytest.mark.parametrize("cls,kw", [(nn.LSTM, {"num_layers": 2, "bidirectional": True}),
                                    (nn.GRU, {"num_layers": 2, "bidirectional": True}),
                                    (nn.LSTM, {"batch_first": True}), (nn.GRU, {"batch_first": True})])
def test_rnn_x86_qconfig_is_torch_ao_dynamic_rnn(cls, kw):
    """``get_dynamic_qconfig(backend="x86")`` is torch.ao's ``default_dynamic_qconfig``: its weight grid was honoured
    but the activations stayed lowbit's per-token 8-bit (1e-3 off torch.ao); now every gate GEMM is torch.ao's."""
    torch.manual_seed(0)
    f = cls(6, 8, **kw).eval()
    a = _ao(f)
    q = Q.quantize_dynamic(nn.Sequential(copy.deepcopy(f)), {cls: Q.get_dynamic_qconfig(backend="x86")})[0]
    assert q.activation == "per_tensor_7bit" and all(m.activation == "per_tensor_7bit" for m in q.ih.values())
    x = torch.randn(2, 5, 6) if kw.get("batch_first") else torch.randn(5, 2, 6)
    (y, hq), (ya, ha) = q(x), a(x)
    torch.testing.assert_close(y, ya, atol=1e-6, rtol=0)  # GRU: a few ulps (torch's in-place sigmoid on strided gates)
    torch.testing.assert_close(_h(hq), _h(ha), atol=1e-6, rtol=0)
    if not kw.get("batch_first"):
        p = pack_sequence([torch.randn(n, 6) for n in (3, 5, 1)], enforce_sorted=False)
        (y, hq), (ya, ha) = q(p), a(p)
        torch.testing.assert_close(y.data, ya.data, atol=1e-6, rtol=0)
        torch.testing.assert_close(_h(hq), _h(ha), atol=1e-6, rtol=0)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_cell_x86_qconfig_is_torch_ao_dynamic_cell(cls):
    torch.manual_seed(1)
    f = cls(8, 16).eval()
    a = _ao(f)
    q = Q.quantize_dynamic(nn.Sequential(copy.deepcopy(f)), {cls: Q.get_dynamic_qconfig(backend="x86")})[0]
    assert q.activation == "per_tensor_7bit" and "activation=per_tensor_7bit" in q.extra_repr()
    assert torch.equal(q.weight("weight_ih").int_repr(), torch.ops.quantized.linear_unpack(a._packed_weight_ih)[0].int_repr())
    x, h = torch.randn(3, 8), torch.randn(3, 16)
    hx = (h, torch.randn(3, 16)) if cls is nn.LSTMCell else h
    torch.testing.assert_close(_h(q(x, hx)), _h(a(x, hx)), atol=1e-6, rtol=0)
    torch.testing.assert_close(_h(q(x)), _h(a(x)), atol=1e-6, rtol=0)


def test_rnn_reduce_range_qconfig_and_a_module_named_in_the_spec():
    """An LSTM inside a custom module, named in ``qconfig_spec``: its recipe is the named qconfig's."""

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.fc = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.lstm(x)[0])

    torch.manual_seed(2)
    m = nn.Sequential(Enc()).eval()
    q = Q.quantize_dynamic(m, {"0.lstm": Q.get_dynamic_qconfig(reduce_range=True), nn.Linear: Q.qint8})
    assert q[0].lstm.activation == "per_token_7bit" and q[0].fc.activation == "per_token"
    x = torch.randn(2, 5, 4)
    ref = q[0].lstm.ih.l0(x)  # the gate GEMM is the 7-bit per-token Linear
    lin = nnqd.Linear(4, 32, activation="per_token_7bit")
    lin.set_weight_bias(q[0].lstm.weight("weight_ih_l0"), m[0].lstm.bias_ih_l0)
    assert torch.equal(ref, lin(x))
    assert ((q(x) - m(x)).norm() / m(x).norm()) < 0.02


# ---- the x86 recipe on a NaN / Inf input: NaN out (fbgemm's op gave finite garbage, or raised from deep inside) ----
@pytest.mark.parametrize("pos", [(0, 0), (1, 2)])
@pytest.mark.parametrize("v", [float("nan"), float("inf"), float("-inf")])
def test_x86_recipe_linear_non_finite_input_is_nan(pos, v):
    """A NaN first in the input raised "In ChooseQuantizationParams, min should be less than or equal to max" from
    fbgemm; one further on was skipped by its min/max and became a code (finite, wrong outputs); ±Inf gave ±inf."""
    torch.manual_seed(3)
    f = nn.Linear(5, 4)
    q = Q.quantize_dynamic(nn.Sequential(f), {nn.Linear: Q.get_dynamic_qconfig(backend="x86")})
    x = torch.randn(3, 5)
    x[pos] = v
    assert torch.isnan(q(x)).all()
    x[pos] = 0.5  # a finite input: still torch.ao's op, bit for bit
    assert torch.equal(q(x), _ao(f)(x))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_x86_recipe_rnn_nan_input_is_nan_not_a_deep_error(cls):
    """The recipe's ``W_ih`` GEMM has one grid for all steps and the ``W_hh`` GEMM one for the batch, so a NaN anywhere
    is NaN everywhere (as a NaN scale); it raised from fbgemm (torch.ao's dynamic LSTM too) or became finite values."""
    torch.manual_seed(4)
    f = cls(4, 6).eval()
    q = Q.quantize_dynamic(nn.Sequential(f), {cls: Q.get_dynamic_qconfig(backend="x86")})[0]
    x = torch.randn(4, 3, 4)
    x[1, 0, 2] = float("nan")
    y, h = q(x)
    assert torch.isnan(y).all() and torch.isnan(_h(h)).all()
    hx = torch.zeros(1, 3, 6)
    hx[0, 0, 0] = float("nan")  # a NaN first in the initial state
    y, _ = q(torch.randn(4, 3, 4), (hx, torch.zeros(1, 3, 6)) if cls is nn.LSTM else hx)
    assert torch.isnan(y).all()
