"""Session 37, plain float torch modules and functions fed a lowbit ``QTensor`` (an int8/float boundary: a layer left
float, a ``DeQuantStub`` forgotten). The contract (``qtensor/fallback.py``): the result of feeding ``qt.dequantize()``,
with the one-time float-fallback warning, or a ``TypeError`` naming the QTensor. Oracle: the same module on
``qt.dequantize()``, bit for bit.

- torch's float RNNs (``nn.RNN`` / ``LSTM`` / ``GRU`` and the cells) raised "zeros(): argument 'dtype' must be
  torch.dtype, not QDtype": their Python code builds the zero hidden state from ``input.dtype`` before any torch
  function runs. ``nn.MultiheadAttention`` / ``nn.TransformerEncoder`` with a padding mask raised the same from
  ``zeros_like`` (the mask is converted to ``query.dtype``). To code in ``torch.nn.modules``, ``QTensor.dtype`` is now
  ``torch.float32`` (the fallback's values); everywhere else it stays the grid.
- One QTensor passed as several arguments (``mha(x, x, x)``) became several float copies: ``nn.MultiheadAttention``
  (and ``TransformerEncoderLayer``) left its packed self-attention path (``query is key``) and differed from
  ``mha(d, d, d)`` in the last bits; the fallback now dequantizes each QTensor object once per call.
- ``nn.Embedding`` / ``EmbeddingBag`` / ``F.one_hot`` given a QTensor of ids said "got torch.FloatTensor"; now a
  ``TypeError`` naming the QTensor (a QuantStub quantized the ids).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.qtensor import _warned_ops


def _qt(*shape: int, seed: int = 0) -> Q.QTensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return Q.quantize_per_tensor(x, 0.05, 3, Q.quint8)


def _run(fn, *args):
    """``fn(*args)`` with the fallback warnings recorded (the one-time set cleared first)."""
    _warned_ops.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(x.message) for x in w if "lowbit:" in str(x.message)]


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    raise AssertionError(f"unexpected output {type(out).__name__}")


def _same(a, b) -> None:
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert not isinstance(x, Q.QTensor) and x.dtype == y.dtype and torch.equal(x, y)


def _rnns() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return {
        "RNN": (nn.RNN(8, 4), (5, 2, 8)),
        "RNN-relu-2layers": (nn.RNN(8, 4, num_layers=2, nonlinearity="relu"), (5, 2, 8)),
        "LSTM": (nn.LSTM(8, 4), (5, 2, 8)),
        "LSTM-batch_first-bidirectional-2layers": (nn.LSTM(8, 4, 2, batch_first=True, bidirectional=True), (2, 5, 8)),
        "LSTM-proj": (nn.LSTM(8, 4, proj_size=2), (5, 2, 8)),
        "LSTM-unbatched": (nn.LSTM(8, 4), (5, 8)),
        "GRU": (nn.GRU(8, 4), (5, 2, 8)),
        "RNNCell": (nn.RNNCell(8, 4), (2, 8)),
        "LSTMCell": (nn.LSTMCell(8, 4), (2, 8)),
        "GRUCell": (nn.GRUCell(8, 4), (2, 8)),
        "GRUCell-unbatched": (nn.GRUCell(8, 4), (8,)),
    }


@pytest.mark.parametrize(("name", "context"), [(n, "plain") for n in _rnns()] + [
    (n, c) for n in ("GRU", "LSTMCell") for c in ("no_grad", "autocast")])  # (no bf16 nn.LSTM in oneDNN on AVX2)
def test_a_float_rnn_fed_a_qtensor_runs_on_its_dequantized_values_with_the_warning(name, context):
    mod, shape = _rnns()[name]
    qt = _qt(*shape)
    ctx = {"plain": torch.enable_grad, "no_grad": torch.no_grad,
           "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[context]
    with ctx():
        out, warned = _run(mod, qt)  # raised TypeError: zeros(): argument 'dtype' must be torch.dtype, not QDtype
        ref = mod(qt.dequantize())
    _same(out, ref)
    assert len(warned) == 1 and "dequantized float values" in warned[0], warned


def test_a_float_lstm_takes_a_qtensor_hidden_state_and_keeps_its_dtype_check():
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 4)
    x, h, c = _qt(5, 2, 8), _qt(1, 2, 4, seed=1), _qt(1, 2, 4, seed=2)
    out, warned = _run(lstm, x, (h, c))  # raised "RNN input dtype (lowbit.quint8) does not match weight dtype"
    _same(out, lstm(x.dequantize(), (h.dequantize(), c.dequantize())))
    assert warned
    _same(_run(lstm, x.dequantize(), (h, c))[0], lstm(x.dequantize(), (h.dequantize(), c.dequantize())))
    # a float64 LSTM refuses the float32 values exactly as it refuses x.dequantize()
    with pytest.raises(ValueError, match=r"input dtype \(torch.float32\) does not match weight dtype \(torch.float64"):
        lstm.double()(x)


def test_attention_with_a_padding_mask_fed_a_qtensor_runs_on_its_dequantized_values():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2).eval()
    qt = _qt(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        # both raised TypeError: zeros_like(): argument 'dtype' must be torch.dtype, not QDtype
        out, warned = _run(lambda x: mha(x, x, x, key_padding_mask=pad), qt)
        d = qt.dequantize()
        ref = mha(d, d, d, key_padding_mask=pad)  # (torch's fused fast path for a float input: last-bit differences)
        for a, b in zip(_flat(out), _flat(ref)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert warned
        out, warned = _run(lambda x: enc(x, src_key_padding_mask=pad), qt)
        ref = enc(qt.dequantize(), src_key_padding_mask=pad)
    assert warned
    # the float input takes torch's nested-tensor fast path (padded rows come back 0); a QTensor the general path,
    # as a float input that requires grad would: the real rows agree
    keep = ~pad
    torch.testing.assert_close(out[keep], ref[keep], rtol=0, atol=1e-5)


def test_a_converted_model_with_a_float_lstm_after_a_quantized_layer_runs():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.fc, self.lstm = Q.QuantStub(), nn.Linear(8, 8), nn.LSTM(8, 4)

        def forward(self, x):
            return self.lstm(self.fc(self.quant(x)))[0]  # no DeQuantStub before the float LSTM

    model = Net().eval()
    model.qconfig = Q.get_minmax_qconfig()
    model.lstm.qconfig = None
    x = torch.randn(5, 2, 8)
    prepared = Q.prepare(model)
    prepared(x)
    qm = Q.convert(prepared)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = qm(x)  # raised TypeError: zeros(): argument 'dtype' must be torch.dtype, not QDtype
    mid = qm.fc(qm.quant(x))
    assert isinstance(mid, Q.QTensor) and torch.equal(out, qm.lstm(mid.dequantize())[0])


def test_qtensor_dtype_stays_the_grid_outside_torch_nn_modules():
    qt = _qt(2, 3)
    assert qt.dtype is Q.quint8 and qt.dtype == qt.qdtype
    assert Q.quantize_per_tensor(torch.ones(2), 0.1, 0, Q.qint8).dtype is Q.qint8
    assert f"{qt.dtype}" == "lowbit.quint8"


def test_dtype_is_the_grid_while_dynamo_traces():
    def f(q):
        return q.dequantize() * 2 if q.dtype == Q.quint8 else q.dequantize()

    qt = _qt(4)
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(qt)
    assert torch.equal(out, qt.dequantize() * 2)


@pytest.mark.parametrize("call", ["Embedding", "EmbeddingBag", "embedding_bag offsets", "one_hot", "one_hot kw"])
def test_integer_ids_given_as_a_qtensor_are_a_type_error_naming_it(call):
    torch.manual_seed(0)
    ids = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0, 3.0]]), 1.0, 0, Q.quint8)
    fn = {"Embedding": lambda: nn.Embedding(10, 4)(ids),
          "EmbeddingBag": lambda: nn.EmbeddingBag(10, 4)(ids),
          "embedding_bag offsets": lambda: F.embedding_bag(torch.tensor([1, 2]), torch.randn(10, 4),
                                                           offsets=ids.reshape(-1)[:2]),
          "one_hot": lambda: F.one_hot(ids, 10),
          "one_hot kw": lambda: F.one_hot(input=ids)}[call]
    # was torch's "Expected tensor for argument #1 'indices' ... but got torch.FloatTensor" (no FloatTensor was given)
    with pytest.raises(TypeError, match=r"is a lowbit QTensor .* takes integer ids; .*QuantStub"):
        fn()


def test_a_qtensor_table_still_takes_the_float_fallback():
    table = Q.quantize_per_tensor(torch.randn(10, 4, generator=torch.Generator().manual_seed(0)), 0.1, 0, Q.qint8)
    idx = torch.tensor([[1, 2], [3, 3]])
    out, warned = _run(F.embedding, idx, table)
    assert torch.equal(out, table.dequantize()[idx]) and warned
    out, _ = _run(lambda i, t: F.embedding_bag(i, t, mode="sum"), idx, table)
    assert torch.equal(out, table.dequantize()[idx].sum(1))


# ---- the sweep's other float modules and functions: the contract holds (guards) -------------------------------------

def _float_cases() -> dict:
    torch.manual_seed(0)
    f, w = torch.randn(2, 8), torch.randn(4, 8)
    lin, conv, ln = nn.Linear(8, 4), nn.Conv2d(3, 4, 3), nn.LayerNorm(8)
    tel = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).eval()
    mha = nn.MultiheadAttention(8, 2).eval()
    return {
        "Linear": (lin, (2, 8)), "Conv2d": (conv, (1, 3, 6, 6)), "LayerNorm": (ln, (2, 8)),
        "BatchNorm2d-train": (nn.BatchNorm2d(3), (2, 3, 4, 4)), "GroupNorm": (nn.GroupNorm(1, 3), (2, 3, 4)),
        "GELU": (nn.GELU(), (2, 8)), "Softmax": (nn.Softmax(-1), (2, 8)), "LogSoftmax": (nn.LogSoftmax(-1), (2, 8)),
        "Upsample-bicubic": (nn.Upsample(scale_factor=2, mode="bicubic"), (1, 2, 3, 3)),  # (bilinear: int8 since s39)
        "PixelShuffle": (nn.PixelShuffle(2), (1, 8, 2, 2)),
        "MultiheadAttention": (lambda x: mha(x, x, x), (5, 2, 8)), "TransformerEncoderLayer": (tel, (5, 2, 8)),
        "F.scaled_dot_product_attention": (lambda x: F.scaled_dot_product_attention(x, x, x), (1, 2, 5, 8)),
        "torch.einsum": (lambda x: torch.einsum("ij,kj->ik", x, w), (2, 8)),
        "torch.baddbmm": (lambda x: torch.baddbmm(torch.zeros(2, 3, 3), x, x.transpose(1, 2)), (2, 3, 8)),
        "torch.addmm": (lambda x: torch.addmm(torch.zeros(4), x, w.t()), (2, 8)),
        "torch.where": (lambda x: torch.where(f > 0, x, f), (2, 8)),
        "torch.cat with a float tensor": (lambda x: torch.cat([f, x]), (2, 8)),
        "torch.stack with a float tensor": (lambda x: torch.stack([x, f]), (2, 8)),
        "F.linear with a QTensor weight": (lambda q: F.linear(f, q, torch.ones(4)), (4, 8)),
        "autocast Linear": (lambda x: torch.autocast("cpu", dtype=torch.bfloat16)(lin)(x), (2, 8)),
    }


@pytest.mark.parametrize("name", list(_float_cases()))
def test_float_modules_and_functions_fed_a_qtensor_give_the_dequantized_result_with_the_warning(name):
    fn, shape = _float_cases()[name]
    qt = _qt(*shape)
    out, warned = _run(fn, qt)
    _same(out, fn(qt.dequantize()))
    assert warned
