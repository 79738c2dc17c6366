"""per_channel_affine_float_qparams (torch.ao's embedding scheme), QAT Embedding/EmbeddingBag and
quantize_dynamic with embedding qconfigs — against torch.ao on the same tables and indices."""

import warnings

import pytest
import torch
import torch.ao.nn.qat as tnnqat
import torch.ao.nn.quantized as tnnq
import torch.ao.quantization as tq
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.nn.qat as nnqat
from lowbit.nn.quantized.embedding import Embedding as QEmbedding
from lowbit.nn.quantized.embedding import EmbeddingBag as QEmbeddingBag

FQP = Q.per_channel_affine_float_qparams


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation warnings
        yield


def _table(rows, dim, seed, shift=0.0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g) * spread + shift


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), dim=st.integers(1, 9), seed=st.integers(0, 2**16), shift=st.floats(-5, 5),
       spread=st.sampled_from([1e-3, 0.5, 3.0, 40.0]), bits=st.sampled_from([8, 4]))
def test_float_qparams_observer_and_codes_match_torch_ao(rows, dim, seed, shift, spread, bits):
    w = _table(rows, dim, seed, shift, spread)
    if seed % 5 == 0:
        w[0] = shift  # a constant row: scale 1.0 in both
    ours = Q.PerChannelMinMaxObserver(ch_axis=0, qscheme=FQP, qdtype=Q.quint8 if bits == 8 else Q.quint4)
    theirs = (tq.default_float_qparams_observer if bits == 8 else tq.default_float_qparams_observer_4bit)()
    ours(w), theirs(w)
    (s, z), (ts, tz) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert z.dtype == torch.float32 and tz.dtype == torch.float32
    torch.testing.assert_close(s, ts, rtol=1e-6, atol=0)
    torch.testing.assert_close(z, tz, rtol=1e-6, atol=1e-6)
    if bits == 8:  # the codes torch.quantize_per_channel gives with float zero points, bit for bit
        ref = torch.quantize_per_channel(w, ts, tz, 0, torch.quint8)
        assert torch.equal(Q.quantize(w, s, z, Q.quint8, 0).to(torch.int64), ref.int_repr().to(torch.int64))
        torch.testing.assert_close(Q.dequantize(Q.quantize(w, s, z, Q.quint8, 0), s, z, 0), ref.dequantize(),
                                   rtol=0, atol=1e-6 * float(s.max()) * 300)


def _pair_tables(kind, bits, mode="sum"):
    torch.manual_seed(0)
    if kind == "emb":
        f = nn.Embedding(40, 10, padding_idx=3)
    else:
        f = nn.EmbeddingBag(40, 10, mode=mode)
    with torch.no_grad():
        f.weight.mul_(torch.linspace(0.1, 4, 40)[:, None]).add_(torch.linspace(-2, 2, 40)[:, None])
    return f


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_embedding_bag_matches_torch_ao(bits):
    f = _pair_tables("bag", bits)
    f.qconfig = tq.float_qparams_weight_only_qconfig if bits == 8 else tq.float_qparams_weight_only_qconfig_4bit
    theirs = tnnq.EmbeddingBag.from_float(f)
    f.qconfig = Q.get_embedding_qconfig(bits, float_qparams=True)
    ours = QEmbeddingBag.from_float(f)
    assert ours.qscheme is FQP and ours.weight_zero_point.dtype == torch.float32
    assert ours.weight().qscheme() is FQP
    g = torch.Generator().manual_seed(2)
    idx, offsets = torch.randint(0, 40, (25,), generator=g), torch.tensor([0, 4, 5, 12, 20])
    psw = torch.rand(25, generator=g)
    for kw in ({}, {"per_sample_weights": psw}):
        y, ty = ours(idx, offsets, **kw), theirs(idx, offsets, **kw)
        # 8-bit: same codes, (q - z) s vs torch's s q + (-z s); 4-bit: torch stores s and -z s in float16
        tol = 2e-5 if bits == 8 else 1e-3 * float((f.weight.amax(1) - f.weight.amin(1)).max()) * 8
        torch.testing.assert_close(y, ty, rtol=0, atol=tol)


def test_quantized_embedding_matches_torch_ao_codes_and_outputs():
    f = _pair_tables("emb", 8)
    f.qconfig = tq.float_qparams_weight_only_qconfig
    theirs = tnnq.Embedding.from_float(f)
    f.qconfig = Q.get_embedding_qconfig(float_qparams=True)
    ours = QEmbedding.from_float(f)
    tw = theirs.weight()
    assert torch.equal(ours.weight().int_repr().to(torch.int64), tw.int_repr().to(torch.int64))
    torch.testing.assert_close(ours.weight_zero_point, tw.q_per_channel_zero_points(), rtol=0, atol=0)
    idx = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(idx), theirs(idx), rtol=0, atol=2e-5)
    # a float-qparams table round-trips through state_dict into a default (integer zero point) module
    fresh = QEmbedding(40, 10, padding_idx=3)
    fresh.load_state_dict(ours.state_dict())
    assert fresh.qscheme is FQP and torch.equal(fresh(idx), ours(idx))
    assert "per_row_float_qparams" in repr(fresh)


@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quantize_float_qparams_matches_torch_ao(bits):
    w = _table(16, 6, 4, shift=1.0).requires_grad_()
    theirs = (tq.default_embedding_fake_quant if bits == 8 else tq.default_embedding_fake_quant_4bit)()
    ours = Q.get_embedding_qat_qconfig(bits, float_qparams=True).weight()
    assert ours.zero_point.dtype == torch.float32
    y, ty = ours(w), theirs(w)
    torch.testing.assert_close(ours.scale, theirs.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.zero_point, theirs.zero_point, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, ty, rtol=0, atol=1e-6)
    g = torch.randn(16, 6)
    (gy,) = torch.autograd.grad(y, w, g)
    (tgy,) = torch.autograd.grad(ty, w, g)
    assert torch.equal(gy, tgy)


@pytest.mark.parametrize("kind", ["emb", "bag"])
def test_qat_embeddings_train_and_convert_like_torch_ao(kind):
    f = _pair_tables(kind, 8)
    f.qconfig = tq.default_embedding_qat_qconfig
    theirs = (tnnqat.Embedding if kind == "emb" else tnnqat.EmbeddingBag).from_float(f)
    f2 = _pair_tables(kind, 8)
    f2.qconfig = Q.get_embedding_qat_qconfig(float_qparams=True)
    ours = (nnqat.Embedding if kind == "emb" else nnqat.EmbeddingBag).from_float(f2)
    assert ours.weight is f2.weight
    idx = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(3))
    for m in (ours, theirs):  # two SGD steps on the same loss
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            m(idx).square().sum().backward()
            opt.step()
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours(idx), theirs(idx), rtol=0, atol=1e-4)
    q = (QEmbedding if kind == "emb" else QEmbeddingBag).from_float(ours)
    tqm = (tnnq.Embedding if kind == "emb" else tnnq.EmbeddingBag).from_float(theirs)
    assert q.qscheme is FQP
    torch.testing.assert_close(q(idx), tqm(idx), rtol=0, atol=1e-4)


def test_prepare_qat_and_convert_embedding_bag_end_to_end():
    model = nn.Sequential(nn.EmbeddingBag(40, 8, mode="mean"), nn.Linear(8, 2))
    qc = Q.QConfigMapping().set_object_type(nn.EmbeddingBag, Q.get_embedding_qat_qconfig(4, float_qparams=True))
    p = Q.prepare_qat(model, qc)
    assert type(p[0]) is nnqat.EmbeddingBag and type(p[1]) is nn.Linear
    p(torch.randint(0, 40, (3, 4))).sum().backward()
    q = Q.convert(p)
    assert type(q[0]) is QEmbeddingBag and q[0].qdtype == Q.quint4 and q[0].qscheme is FQP
    idx = torch.randint(0, 40, (3, 4))
    torch.testing.assert_close(q(idx), p(idx), rtol=0, atol=1e-5)


class _Rec(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bag, self.fc = nn.Embedding(30, 8), nn.EmbeddingBag(30, 8, mode="sum"), nn.Linear(8, 4)

    def forward(self, i):
        return self.fc(self.emb(i).sum(1) + self.bag(i))


def test_quantize_dynamic_with_embedding_qconfigs_matches_torch_ao():
    torch.manual_seed(0)
    m = _Rec().eval()
    theirs = tq.quantize_dynamic(m, {nn.Embedding: tq.float_qparams_weight_only_qconfig,
                                     "bag": tq.float_qparams_weight_only_qconfig_4bit})
    ours = Q.quantize_dynamic(m, {nn.Embedding: Q.get_embedding_qconfig(float_qparams=True),
                                  "bag": Q.get_embedding_qconfig(4, float_qparams=True)})
    assert type(ours.emb) is QEmbedding and type(ours.bag) is QEmbeddingBag and ours.bag.qdtype == Q.quint4
    assert type(ours.fc) is nn.Linear and type(theirs.fc) is nn.Linear
    i = torch.randint(0, 30, (5, 6), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours.emb(i), theirs.emb(i), rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.bag(i), theirs.bag(i), rtol=0, atol=0.05)
    # a dynamic (qint8) recipe never reaches embeddings unless they are named with an embedding qconfig
    q = Q.quantize_dynamic(m, Q.get_dynamic_qconfig())
    assert type(q.emb) is nn.Embedding and type(q.fc).__module__.endswith("dynamic.linear")
    with pytest.raises(ValueError, match="Embedding needs an embedding qconfig"):
        Q.quantize_dynamic(m, {nn.Embedding})
    with pytest.raises(ValueError, match="EmbeddingBag needs an embedding qconfig"):
        Q.quantize_dynamic(m, {"bag": Q.qint8})


def test_float_qparams_errors(tmp_path):
    lin = nn.Linear(4, 4)
    lin.qconfig = Q.QConfig(Q.MinMaxObserver.with_args(), Q.PerChannelMinMaxObserver.with_args(qscheme=FQP,
                                                                                               qdtype=Q.qint8))
    from lowbit.nn.quantized.linear import Linear as QLinear
    lin.activation_post_process = Q.MinMaxObserver()
    lin.activation_post_process(torch.randn(3, 4))
    with pytest.raises(ValueError, match="float_qparams"):
        QLinear.from_float(lin)
    with pytest.raises(ValueError, match="does not fit"):
        Q.MinMaxObserver(qscheme=FQP)
    with pytest.raises(ValueError, match="qscheme=per_channel_symmetric"):
        QEmbedding(4, 4, qscheme=Q.per_channel_symmetric)
    f = nn.Embedding(10, 4)
    f.qconfig = Q.get_embedding_qconfig(float_qparams=True)
    pytest.importorskip("onnx")
    from lowbit.export import to_onnx
    with pytest.raises(ValueError, match="float zero points"):
        to_onnx(nn.Sequential(QEmbedding.from_float(f)), torch.tensor([[1, 2]]), tmp_path / "e.onnx")
    qat = Q.prepare_qat(nn.Sequential(nn.Embedding(10, 4)),
                        Q.QConfigMapping().set_object_type(nn.Embedding, Q.get_embedding_qat_qconfig(float_qparams=True)))
    qat(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="float zero points"):
        to_onnx(qat.eval(), torch.tensor([[1, 2]]), tmp_path / "q.onnx")


def test_static_workflow_takes_torch_ao_style_dynamic_activation_embedding_qconfig():
    """torch.ao's test: QConfigDynamic(activation=default_dynamic_quant_observer, weight=float_qparams observer)
    on an EmbeddingBag through prepare/convert gives a quantized bag (the activation entry is irrelevant)."""
    for qdtype, tdtype in ((Q.quint8, torch.quint8), (Q.quint4, torch.quint4x2)):
        torch.manual_seed(0)
        m = nn.Sequential(nn.EmbeddingBag(10, 12, mode="sum", include_last_offset=True))
        m.qconfig = Q.QConfig(Q.get_dynamic_qconfig().activation,
                              Q.PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=FQP, qdtype=qdtype))
        t = nn.Sequential(nn.EmbeddingBag(10, 12, mode="sum", include_last_offset=True))
        t.load_state_dict(m.state_dict())
        t.qconfig = tq.QConfig(activation=tq.default_dynamic_quant_observer,
                               weight=tq.PerChannelMinMaxObserver.with_args(
                                   dtype=tdtype, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "nothing to quantize" warning from prepare
            q = Q.convert(Q.prepare(m))
        tqm = tq.convert(tq.prepare(t))
        assert type(q[0]) is QEmbeddingBag and q[0].qdtype == qdtype
        idx, off = torch.tensor([9, 6, 5, 7, 8, 8, 9, 2, 8, 6]), torch.tensor([0, 4, 4, 10])
        tol = 2e-5 if qdtype == Q.quint8 else 0.05
        torch.testing.assert_close(q[0](idx, off), tqm[0](idx, off), rtol=0, atol=tol)
    # a dynamic int8 recipe on an embedding still leaves it float (no table recipe)
    e = nn.Sequential(nn.Embedding(5, 4))
    e.qconfig = Q.get_dynamic_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert type(Q.convert(Q.prepare(e))[0]) is nn.Embedding


class _BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.emb, self.fc = nn.EmbeddingBag(20, 8, mode="sum"), nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, i):
        return self.fc(self.bag(i) + self.emb(i).sum(1))


def test_graph_mode_qat_and_table_recipes_under_a_dynamic_activation():
    torch.manual_seed(0)
    i = torch.randint(0, 20, (4, 5))
    qm = (Q.QConfigMapping().set_global(Q.get_default_qat_qconfig())
          .set_object_type(nn.EmbeddingBag, Q.get_embedding_qat_qconfig(float_qparams=True))
          .set_object_type(nn.Embedding, Q.get_embedding_qat_qconfig(4)))
    p = Q.prepare_qat_fx(_BagNet().train(), qm, (i,))
    assert type(p.bag) is nnqat.EmbeddingBag and type(p.emb) is nnqat.Embedding
    p(i).sum().backward()
    q = Q.convert_fx(p)
    assert type(q.bag) is QEmbeddingBag and q.bag.qscheme is FQP and type(q.emb) is QEmbedding
    assert q.emb.qdtype == Q.quint4
    torch.testing.assert_close(q.bag(i), p.bag(i), rtol=0, atol=1e-5)  # the table the QAT model trained on
    table = Q.QConfig(Q.get_dynamic_qconfig().activation,
                      Q.PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=FQP, qdtype=Q.quint8))
    p2 = Q.prepare_fx(_BagNet().eval(), Q.QConfigMapping().set_global(Q.get_minmax_qconfig())
                      .set_object_type(nn.EmbeddingBag, table), (i,))
    p2(i)
    assert type(Q.convert_fx(p2).bag) is QEmbeddingBag
