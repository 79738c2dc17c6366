"""Dynamic int8 RNN (tanh/relu) and the RNNCell / LSTMCell / GRUCell cells: per-token GEMMs, float gates.

Oracles: fp32 (relative error), ``torch.ao.nn.quantized.dynamic``'s cells (we must be at least as close to
fp32; torch.ao has no dynamic ``nn.RNN``, so its RNNCell looped over time stands in), the float simulation
of the same codes, and the full module vs a cell looped over the sequence on shared weights.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from helpers import roundtrip
from lowbit.mappings import get_default_dynamic_quant_module_mappings
from lowbit.nn.quantized import dynamic as nnqd
from lowbit.nn.quantized.dynamic import quantize_per_token
from lowbit.nn.quantized.dynamic.cells import gru_step, lstm_step, rnn_relu_step, rnn_tanh_step

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KINDS = ["tanh", "relu", "lstm", "gru"]
STEPS = {"tanh": rnn_tanh_step, "relu": rnn_relu_step, "lstm": lstm_step, "gru": gru_step}


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def flat(out) -> torch.Tensor:
    """A cell's output (h or (h, c)) as one tensor."""
    return torch.cat(out, -1) if isinstance(out, tuple) else out


def float_cell(kind: str, i: int = 12, h: int = 20, bias: bool = True, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("tanh", "relu"):
        return nn.RNNCell(i, h, bias, nonlinearity=kind)
    return (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(i, h, bias)


def qcls(f: nn.Module) -> type:
    return getattr(nnqd, type(f).__name__)


def hidden(kind: str, *shape: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, generator=g)
    return (h, torch.randn(*shape, generator=g)) if kind == "lstm" else h


def ao_dynamic(mod: nn.Module) -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(mod), {type(mod)}, dtype=torch.qint8)[0]


def heavy_tailed(m: int, k: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.distributions.StudentT(2.0).sample((m, k))
    x[::4] *= 10  # every 4th token much larger: a per-tensor grid spends its levels on them
    return x


def shared_rnn_and_cell(kind: str, i: int = 6, h: int = 10) -> tuple[nn.Module, nn.Module]:
    """A one-layer float RNN/LSTM/GRU and a float cell holding the very same weights."""
    torch.manual_seed(3)
    if kind in ("tanh", "relu"):
        rnn, cell = nn.RNN(i, h, nonlinearity=kind), nn.RNNCell(i, h, nonlinearity=kind)
    else:
        rnn, cell = (nn.LSTM(i, h), nn.LSTMCell(i, h)) if kind == "lstm" else (nn.GRU(i, h), nn.GRUCell(i, h))
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(cell, name).data = getattr(rnn, name + "_l0").data.clone()
    return rnn, cell


# ---- cells: accuracy against fp32 and torch.ao ----
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dist", ["randn", "heavy"])
def test_cell_closer_to_fp32_than_torch_ao(kind, dist):
    f = float_cell(kind, 32, 48)
    x = torch.randn(16, 32) if dist == "randn" else heavy_tailed(16, 32)
    hx = hidden(kind, 16, 48)
    ref = flat(f(x, hx))
    ours, theirs = rel(flat(qcls(f).from_float(f)(x, hx)), ref), rel(flat(ao_dynamic(f)(x, hx)), ref)
    assert ours < (0.015 if dist == "randn" else 0.03)
    assert ours <= theirs  # measured: 0.3-0.7x torch.ao's error on random, 0.03-0.3x on heavy-tailed inputs


@pytest.mark.parametrize("kind", KINDS)
def test_cell_float16_weights_bias_free_unbatched_and_dtype(kind):
    f = float_cell(kind, bias=False)
    x, hx = torch.randn(5, 12), hidden(kind, 5, 20)
    q16 = qcls(f).from_float(f, dtype=torch.float16)
    assert rel(flat(q16(x, hx)), flat(f(x, hx))) < 1e-3
    assert sorted(q16.state_dict()) == ["hh.weight_fp16", "ih.weight_fp16"]
    assert q16.weight("weight_ih").dtype == torch.float16
    q = qcls(f).from_float(f)  # torch.ao's dynamic cells refuse bias=False and unbatched inputs
    assert rel(flat(q(x, hx)), flat(f(x, hx))) < 0.02
    h1 = tuple(t[2] for t in hx) if kind == "lstm" else hx[2]
    assert torch.equal(flat(q(x[2], h1)), flat(q(x[2:3], tuple(t[2:3] for t in hx) if kind == "lstm" else hx[2:3]))[0])
    assert flat(q(x.double())).dtype == torch.float64 and flat(q(x[:0])).shape[0] == 0
    zeros = (torch.zeros(5, 20),) * 2 if kind == "lstm" else torch.zeros(5, 20)
    assert torch.equal(flat(q(x)), flat(q(x, zeros)))  # hx=None is the zero state


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), b=st.integers(1, 6), i=st.integers(1, 24), h=st.integers(1, 16),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_cell_property_equals_float_simulation_of_its_codes(kind, b, i, h, bias, seed):
    """h' = step(x̂ Ŵ_ihᵀ + b_ih, ĥ Ŵ_hhᵀ + b_hh) with per-token x̂, ĥ: the cell's integer GEMMs, simulated in float."""
    f = float_cell(kind, i, h, bias, seed)
    q = qcls(f).from_float(f)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, i, generator=g) * torch.rand(b, 1, generator=g) * 5
    hx = hidden(kind, b, h, seed=seed)
    h0 = hx[0] if kind == "lstm" else hx
    gx = F.linear(quantize_per_token(x).dequantize(), q.weight("weight_ih").dequantize(), q.ih.bias)
    gh = F.linear(quantize_per_token(h0).dequantize(), q.weight("weight_hh").dequantize(), q.hh.bias)
    sim = STEPS[kind](gx, gh, hx if kind == "lstm" else (hx,))
    out = q(x, hx)
    assert flat(out).shape == (b, 2 * h if kind == "lstm" else h)
    assert torch.allclose(flat(out), flat(sim if kind == "lstm" else sim[0]), rtol=1e-4, atol=1e-4)


# ---- the full RNN (tanh / relu) ----
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}, {"batch_first": True, "bias": False}])
def test_rnn_close_to_fp32_and_to_torch_ao_cell_loop(nonlinearity, kw):
    torch.manual_seed(2)
    f = nn.RNN(12, 20, nonlinearity=nonlinearity, **kw).eval()
    q = nnqd.RNN.from_float(f)
    x = heavy_tailed(6 * 4, 12).reshape(6, 4, 12) / 4
    (y_ref, h_ref), (y, h) = f(x), q(x)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    assert rel(y, y_ref) < 0.03 and rel(h, h_ref) < 0.03
    if not kw:  # torch.ao has no dynamic RNN: its dynamic RNNCell looped over time is the oracle
        cell = nn.RNNCell(12, 20, nonlinearity=nonlinearity)
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).data = getattr(f, name + "_l0").data.clone()
        ao_cell, h_ao, outs = ao_dynamic(cell), torch.zeros(4, 20), []
        for t in range(6):
            h_ao = ao_cell(x[t], h_ao)
            outs.append(h_ao)
        assert rel(y, y_ref) <= rel(torch.stack(outs), y_ref)


def test_rnn_initial_state_unbatched_float16_and_repr():
    torch.manual_seed(4)
    f = nn.RNN(6, 8, num_layers=2, nonlinearity="relu")
    q = nnqd.RNN.from_float(f)
    x, h0 = torch.randn(5, 3, 6), torch.randn(2, 3, 8)
    assert rel(q(x, h0)[0], f(x, h0)[0]) < 0.02
    y1, h1 = q(x[:, 0], h0[:, 0])  # unbatched (L, H_in)
    assert y1.shape == (5, 8) and h1.shape == (2, 8)
    assert torch.equal(y1, q(x[:, :1], h0[:, :1])[0][:, 0])
    assert rel(nnqd.RNN.from_float(f, dtype=torch.float16)(x)[0], f(x)[0]) < 1e-3
    assert "nonlinearity=relu" in repr(q) and "num_layers=2" in repr(q) and "qint8" in repr(q)
    assert "nonlinearity" not in repr(nnqd.RNN(6, 8)) and "nonlinearity=relu" in repr(nnqd.RNNCell(6, 8, nonlinearity="relu"))


@pytest.mark.parametrize("kind", KINDS)
def test_cell_looped_over_a_sequence_equals_the_full_module(kind):
    rnn, cell = shared_rnn_and_cell(kind)
    q_rnn, q_cell = nnqd.RNN if kind in ("tanh", "relu") else (nnqd.LSTM if kind == "lstm" else nnqd.GRU), qcls(cell)
    q_rnn, q_cell = q_rnn.from_float(rnn), q_cell.from_float(cell)
    x, hx = torch.randn(7, 3, 6) * 2, hidden(kind, 3, 10)
    state, outs = hx, []
    for t in range(7):
        state = q_cell(x[t], state)
        outs.append(state[0] if kind == "lstm" else state)
    y, h_n = q_rnn(x, tuple(s[None] for s in hx) if kind == "lstm" else hx[None])
    assert torch.allclose(torch.stack(outs), y, rtol=1e-5, atol=1e-6)  # W_ih batched over steps: same per-token grids
    assert torch.allclose(flat(state), flat(tuple(s[0] for s in h_n) if kind == "lstm" else h_n[0]), atol=1e-6)


# ---- state, accessors, workflow ----
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [Q.qint8, torch.float16])
def test_cell_state_dict_round_trip_bit_exact(kind, dtype):
    f = float_cell(kind)
    q = qcls(f).from_float(f, dtype=dtype)
    sd = roundtrip(q)
    if dtype == Q.qint8:
        assert sd["ih.weight_int8"].dtype == torch.int8 and "hh.weight_scale" in sd and "hh.bias" in sd
    kw = {"nonlinearity": kind} if kind in ("tanh", "relu") else {}
    fresh = qcls(f)(12, 20, dtype=dtype, **kw)
    x, hx = torch.randn(4, 12), hidden(kind, 4, 20)
    fresh(x, hx)  # fill the packed-weight caches with the zero weights first
    fresh.load_state_dict(sd)
    assert torch.equal(flat(fresh(x, hx)), flat(q(x, hx)))


def test_rnn_state_dict_round_trip_and_weight_accessor():
    f = nn.RNN(12, 20, num_layers=2, bidirectional=True, nonlinearity="relu")
    q = nnqd.RNN.from_float(f)
    fresh = nnqd.RNN(12, 20, 2, "relu", bidirectional=True)
    fresh.load_state_dict(roundtrip(q))
    x = torch.randn(4, 2, 12)
    assert torch.equal(fresh(x)[0], q(x)[0])
    w = q.weight("weight_hh_l1_reverse")
    assert isinstance(w, Q.QTensor) and w.axis == 0 and w.qdtype == Q.qint8 and w.shape == (20, 20)
    assert torch.allclose(w.dequantize(), f.weight_hh_l1_reverse, atol=float(w.scale.max()) / 2 + 1e-7)
    assert nnqd.LSTM.from_float(nn.LSTM(3, 4)).weight("weight_ih_l0").shape == (16, 3)
    with pytest.raises(ValueError, match="name='weight_ih_l2'"):
        q.weight("weight_ih_l2")
    with pytest.raises(ValueError, match="name='weight'"):
        nnqd.GRUCell(3, 4).weight("weight")


def test_from_float_honours_a_qconfig_weight_observer():
    cell = nn.GRUCell(8, 4)
    cell.qconfig = Q.QConfig(activation=Q.PlaceholderObserver,
                             weight=Q.MinMaxObserver.with_args(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8))
    q = nnqd.GRUCell.from_float(cell)
    assert torch.unique(q.ih.weight_scale).numel() == 1  # one per-tensor scale, broadcast to every channel


def test_quantize_dynamic_default_mapping_covers_torch_ao_cells_and_rnn():
    from torch.ao.quantization.quantization_mappings import get_default_dynamic_quant_module_mappings as ao_map
    ao_types = {t for t, qt in ao_map().items() if qt.__module__.startswith("torch.ao.nn.quantized.dynamic")
                and t.__module__ == "torch.nn.modules.rnn"}
    mine = get_default_dynamic_quant_module_mappings()
    assert ao_types <= set(mine) and mine[nn.RNN] is nnqd.RNN
    m = nn.ModuleDict({"rnn": nn.RNN(4, 5), "a": nn.RNNCell(4, 5), "b": nn.LSTMCell(4, 5), "c": nn.GRUCell(4, 5)})
    qm = Q.quantize_dynamic(m)
    assert [type(c) for c in qm.values()] == [nnqd.RNN, nnqd.RNNCell, nnqd.LSTMCell, nnqd.GRUCell]
    assert qm["b"].dtype == Q.qint8 and qm["a"].nonlinearity == "tanh"
    assert Q.quantize_dynamic(nn.GRUCell(4, 5), dtype=torch.float16).dtype == torch.float16  # a bare target


# ---- errors ----
def test_errors():
    with pytest.raises(ValueError, match="hidden_size=0"):
        nnqd.LSTMCell(3, 0)
    with pytest.raises(ValueError, match="input_size=True"):
        nnqd.GRUCell(True, 3)
    with pytest.raises(ValueError, match="nonlinearity='gelu'"):
        nnqd.RNNCell(3, 4, nonlinearity="gelu")
    with pytest.raises(ValueError, match="nonlinearity='sigmoid'"):
        nnqd.RNN(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="num_layers=0"):
        nnqd.RNN(3, 4, 0)
    with pytest.raises(ValueError, match="dtype"):
        nnqd.RNNCell(3, 4, dtype=Q.quint8)
    with pytest.raises(TypeError, match="nn.LSTMCell"):
        nnqd.LSTMCell.from_float(nn.GRUCell(2, 3))
    with pytest.raises(TypeError, match="nn.RNNCell"):
        nnqd.RNNCell.from_float(nn.RNN(2, 3))
    with pytest.raises(TypeError, match="nn.RNN, got LSTM"):
        nnqd.RNN.from_float(nn.LSTM(2, 3))
    q = nnqd.LSTMCell(3, 4)
    with pytest.raises(ValueError, match=r"input shape \(2, 5\).*input_size=3"):
        q(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"input shape \(1, 2, 3\)"):
        q(torch.randn(1, 2, 3))
    with pytest.raises(TypeError, match="float tensor"):
        q(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"\(h, c\)"):
        q(torch.randn(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"hidden state shape \(3, 4\)"):
        q(torch.randn(2, 3), (torch.zeros(3, 4), torch.zeros(3, 4)))
    with pytest.raises(TypeError, match="tensor h"):
        nnqd.GRUCell(3, 4)(torch.randn(2, 3), (torch.zeros(2, 4),))
    with pytest.raises(ValueError, match=r"hidden state shape \(2, 5\)"):
        nnqd.RNNCell(3, 4)(torch.randn(2, 3), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="hidden state shape"):
        nnqd.RNN(3, 4)(torch.randn(5, 2, 3), torch.zeros(2, 2, 4))
    with pytest.raises(TypeError, match="tensor h0"):
        nnqd.RNN(3, 4)(torch.randn(5, 2, 3), [torch.zeros(1, 2, 4)])


# ---- ONNX: the export twins against ONNX Runtime ----
@pytest.mark.parametrize("kind", KINDS)
def test_cell_export_twin_matches_lowbit_on_onnx_runtime(tmp_path, kind):
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx
    from lowbit.export.dynamic import DynamicCellTwin, dynamic_twin

    f = float_cell(kind, 6, 8)
    q = qcls(f).from_float(f)
    twin = dynamic_twin(q, "auto")
    assert isinstance(twin, DynamicCellTwin)

    class Step(nn.Module):  # (x, h[, c]) -> h'[, c']: plain tensors in and out
        def __init__(self) -> None:
            super().__init__()
            self.cell = twin

        def forward(self, x: torch.Tensor, *h: torch.Tensor):
            return self.cell(x, h if kind == "lstm" else h[0])

    n_h = 2 if kind == "lstm" else 1
    path = to_onnx(Step(), (torch.randn(2, 6), *(torch.randn(2, 8) for _ in range(n_h))), tmp_path / "cell.onnx")
    args = (torch.randn(9, 6) * 3, *(torch.randn(9, 8) for _ in range(n_h)))        # batch 9: dynamic
    out = run_onnx(path, *args)
    ref = q(args[0], tuple(args[1:]) if kind == "lstm" else args[1])
    assert torch.allclose(torch.cat(out, -1), flat(ref), atol=1e-4)


def test_rnn_export_twin_matches_lowbit_on_onnx_runtime(tmp_path):
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx
    from lowbit.export.dynamic import DynamicRNNTwin, dynamic_twin

    torch.manual_seed(6)
    q = nnqd.RNN.from_float(nn.RNN(6, 8, num_layers=2, nonlinearity="relu", batch_first=True, bidirectional=True))
    twin = dynamic_twin(q, "auto")
    assert isinstance(twin, DynamicRNNTwin) and dynamic_twin(nn.Linear(2, 2), "auto") is None
    path = to_onnx(twin, torch.randn(2, 5, 6), tmp_path / "rnn.onnx")
    x = torch.randn(7, 5, 6)
    y, h = run_onnx(path, x)
    y_ref, h_ref = q(x)
    assert torch.allclose(y, y_ref, atol=1e-4) and torch.allclose(h, h_ref, atol=1e-4)
