"""Graph mode on embeddings, functional layers on model parameters, and ConvTranspose+BN folding."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.fx import convert_fx, prepare_fx, prepare_qat_fx
from lowbit.nn.quantized.conv_transpose import ConvTranspose2d as QConvTranspose2d
from lowbit.nn.quantized.embedding import Embedding as QEmbedding
from lowbit.nn.quantized.embedding import EmbeddingBag as QEmbeddingBag
from lowbit.observer import MinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


def sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach(), y.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum()))


def ptq_fx(model: nn.Module, x: torch.Tensor, qconfig=None) -> nn.Module:
    """prepare_fx -> one calibration batch -> convert_fx."""
    prepared = prepare_fx(model, qconfig or Q.get_minmax_qconfig(), example_inputs=(x,))
    prepared(x)
    return convert_fx(prepared)


def float_tensors(model: nn.Module) -> list[str]:
    return [k for k, v in model.state_dict().items() if v.is_floating_point() and v.dim() >= 2]


# ---- embeddings ----
class EmbHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.bag = nn.Embedding(50, 16), nn.EmbeddingBag(50, 16, mode="sum")
        self.fc = nn.Linear(16, 4)

    def forward(self, idx):  # (B, L) int -> (B, 4)
        return self.fc(self.emb(idx).mean(1)) + self.fc(self.bag(idx))


IDX = torch.randint(0, 50, (32, 6), generator=torch.Generator().manual_seed(1))


def eager_ptq(model: nn.Module, x: torch.Tensor, qconfig) -> nn.Module:
    m = copy.deepcopy(model)
    m.qconfig = qconfig
    m = Q.prepare(m)
    m(x)
    return Q.convert(m)


def test_embedding_head_converts_like_eager():
    model = EmbHead().eval()
    q = ptq_fx(model, IDX)
    assert type(q.emb) is QEmbedding and type(q.bag) is QEmbeddingBag and type(q.fc) is nnq.Linear
    assert q.lowbit_report.converted["emb"].endswith("quantized.embedding.Embedding")
    assert float_tensors(q) == []  # no float table or weight left
    eager = eager_ptq(model, IDX, Q.get_minmax_qconfig())
    # same per-row grids as eager convert, so the gathered rows are identical
    assert torch.equal(q.emb(IDX), eager.emb(IDX)) and torch.equal(q.bag(IDX), eager.bag(IDX))
    ref, y = model(IDX).detach(), q(IDX)
    assert sqnr(ref, y) > 30
    # each fc output is within one output quantum of the eager-converted one
    quantum = float(q.fc.scale)
    e = eager.fc(eager.emb(IDX).mean(1)).dequantize() + eager.fc(eager.bag(IDX)).dequantize()
    assert (y - e).abs().max() <= 2 * quantum + 1e-6


def test_embedding_weight_only_qconfig_and_exclusion():
    weight_only = Q.QConfig(activation=PlaceholderObserver.with_args(qdtype=Q.quint8),
                            weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme="per_channel_affine",
                                                                      qdtype=Q.quint8))
    mapping = (Q.QConfigMapping().set_global(Q.get_minmax_qconfig())
               .set_object_type(nn.Embedding, weight_only).set_object_type(nn.EmbeddingBag, None))
    model = EmbHead().eval()
    q = ptq_fx(model, IDX, mapping)
    assert type(q.emb) is QEmbedding and q.emb.qdtype == Q.quint8  # per-row affine table
    assert type(q.bag) is nn.EmbeddingBag  # excluded: stays float
    assert (q.emb(IDX) - model.emb(IDX)).abs().max() <= q.emb.weight_scale.max() / 2 + 1e-6


def test_embedding_only_graph_and_qat():
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(20, 8)

        def forward(self, idx):
            return self.table(idx) * 2.0

    model = nn.Sequential(Lookup(), nn.Linear(8, 3)).eval()
    idx = torch.randint(0, 20, (4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an embedding alone is something to quantize: no "nothing" warning
        prepared = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(idx,))
    prepared(idx)
    assert type(convert_fx(prepared).get_submodule("0.table")) is QEmbedding
    qat = prepare_qat_fx(model, example_inputs=(idx,))
    assert type(qat.get_submodule("0.table")).__module__ == "lowbit.nn.qat.modules"
    qat(idx).sum().backward()
    assert qat.get_submodule("0.table").weight.grad is not None
    qq = convert_fx(qat)
    assert type(qq.get_submodule("0.table")) is QEmbedding
    assert (qq(idx) - qat.eval()(idx)).abs().max() < 3 * float(qq.get_submodule("1").scale)


def test_embedding_bad_weight_observer_names_module():
    bad = Q.QConfig(activation=MinMaxObserver, weight=PerChannelMinMaxObserver.with_args(ch_axis=1))
    prepared = prepare_fx(EmbHead().eval(), Q.QConfigMapping().set_global(Q.get_minmax_qconfig())
                          .set_object_type(nn.Embedding, bad), example_inputs=(IDX,))
    prepared(IDX)
    with pytest.raises(ValueError, match=r"'emb'.*ch_axis=1"):
        convert_fx(prepared)


# ---- F.linear / F.conv2d on the model's own parameters ----
class FunctionalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cw, self.cb = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3), nn.Parameter(torch.randn(8) * 0.1)
        self.lw = nn.Parameter(torch.randn(10, 8 * 6 * 6) * 0.05)
        self.register_buffer("lb", torch.randn(10) * 0.1)

    def forward(self, x):  # (N, 3, 6, 6) -> (N, 10)
        # every argument given, as tuples: torch.ao FX's conv prepack needs them so (lowbit takes any form)
        y = F.relu(F.conv2d(x, self.cw, self.cb, (1, 1), (1, 1), (1, 1), 1))
        return F.linear(y.flatten(1), self.lw, bias=self.lb)


class ModuleNet(nn.Module):
    """FunctionalNet with nn.Conv2d / nn.Linear holding the same tensors."""

    def __init__(self, f: FunctionalNet) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 10)
        with torch.no_grad():
            self.conv.weight.copy_(f.cw), self.conv.bias.copy_(f.cb)
            self.fc.weight.copy_(f.lw), self.fc.bias.copy_(f.lb)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


X = torch.randn(32, 3, 6, 6, generator=torch.Generator().manual_seed(2))


def test_functional_layers_run_int8_like_modules():
    model = FunctionalNet().eval()
    q = ptq_fx(model, X)
    kinds = [type(m) for m in q.children()]
    assert nnq.ConvReLU2d in kinds and nnq.Linear in kinds  # relu(F.conv2d) fused into the kernel epilogue
    assert list(q.parameters()) == [] and float_tensors(q) == [] and not hasattr(q, "lb")
    assert not any("linear" in str(n.target) or "conv2d" in str(n.target)
                   for n in q.graph.nodes if n.op == "call_function")
    assert sorted(q.lowbit_report.converted) == ["conv2d", "linear"]
    ref, y = model(X).detach(), q(X)
    assert sqnr(ref, y) >= 30
    twin = ptq_fx(ModuleNet(model).eval(), X)
    assert torch.equal(y, twin(X))  # the same kernels on the same grids: bit-exact


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.booleans(), st.sampled_from(["conv1d", "conv2d", "linear"]))
def test_functional_matches_module_twin(stride, padding, groups, dilation, bias, op):
    g = torch.Generator().manual_seed(stride * 31 + padding * 7 + groups)
    cin, cout, k = 2 * groups, 4 * groups, 3
    if op == "linear":
        w, module = torch.randn(cout, cin, generator=g), nn.Linear(cin, cout, bias=bias)
        x = torch.randn(3, 5, cin, generator=g)  # (N, T, C): F.linear on a 3-D input
        kw: dict = {}
    else:
        d = 1 if op == "conv1d" else 2
        w = torch.randn(cout, cin // groups, *[k] * d, generator=g)
        kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        module = getattr(nn, "Conv" + op[-2:])(cin, cout, k, bias=bias, **kw)
        x = torch.randn(2, cin, *[9] * d, generator=g)
    b = torch.randn(cout, generator=g) if bias else None
    with torch.no_grad():
        module.weight.copy_(w)
        if bias:
            module.bias.copy_(b)

    class Fn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(w.clone())
            self.b = nn.Parameter(b.clone()) if bias else None

        def forward(self, x):
            return getattr(F, op)(x, self.w, self.b, **kw)

    q, twin = ptq_fx(Fn().eval(), x), ptq_fx(module.eval(), x)
    assert float_tensors(q) == [] and list(q.parameters()) == []
    assert torch.equal(q(x), twin(x))


def test_functional_forms_left_float_with_reason():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.v = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            y = F.linear(x, self.w.t())  # computed weight: stays float
            return F.linear(y, self.v) + self.v.sum()  # v also read elsewhere: kept as a tensor

    model, x = Odd().eval(), torch.randn(8, 4)
    prepared = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    assert "computed in the graph" in prepared.lowbit_report.left_float["linear"]
    prepared(x)
    q = convert_fx(prepared)
    assert list(q.lowbit_report.converted) == ["linear_1"]
    assert hasattr(q, "w") and hasattr(q, "v")  # still read by float nodes
    assert (q(x) - model(x)).abs().max() < 0.1 * model(x).abs().max()


class TiedLM(nn.Module):
    """Embedding whose table is also the output projection (weight tying)."""

    def __init__(self, computed: bool) -> None:
        super().__init__()
        self.emb, self.fc, self.computed = nn.Embedding(30, 8), nn.Linear(8, 8), computed

    def forward(self, idx):  # (B, L) -> (B, L, 30)
        h = self.fc(self.emb(idx))
        return h @ self.emb.weight.t() if self.computed else F.linear(h, self.emb.weight)


@pytest.mark.parametrize("computed", [False, True])
def test_tied_embedding_head(computed):
    model, idx = TiedLM(computed).eval(), torch.randint(0, 30, (4, 7))
    q = ptq_fx(model, idx)
    if computed:  # a float op reads the table: the embedding stays float (and says why)
        assert type(q.emb) is nn.Embedding and "also read" in q.lowbit_report.left_float["emb"]
    else:  # F.linear on the table: int8 head with its own per-channel copy, per-row table
        assert type(q.emb) is QEmbedding and float_tensors(q) == []
    assert sqnr(model(idx).detach(), q(idx)) >= 30


def test_functional_keyword_and_same_padding():
    class Same(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 3, 4))

        def forward(self, x):
            return F.conv1d(input=x, weight=self.w, padding="same", dilation=2)

    model, x = Same().eval(), torch.randn(2, 3, 11)
    q = ptq_fx(model, x)
    (layer,) = [m for m in q.children() if isinstance(m, nnq.Conv1d)]
    assert layer.padding_str == "same" and layer.dilation == (2,) and layer.bias is None
    assert sqnr(model(x).detach(), q(x)) >= 30


def test_functional_qat_trains_and_converts():
    model = FunctionalNet()
    qat = prepare_qat_fx(model, example_inputs=(X,))
    fq = [m for n, m in qat.named_children() if n.startswith("weight_post_process")]
    assert len(fq) == 2 and all(isinstance(m, Q.FakeQuantize) for m in fq)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    for _ in range(2):
        loss = qat(X).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert qat.lw.grad.abs().sum() > 0  # the straight-through gradient reaches the parameter
    q = convert_fx(qat)
    assert list(q.parameters()) == [] and float_tensors(q) == []
    ref = qat.eval()(X).detach()
    assert (q(X) - ref).abs().max() <= 2 * float(q.quantized_linear_3.scale)


def test_functional_bad_weight_observer_names_node():
    bad = Q.QConfig(activation=MinMaxObserver,
                    weight=PerChannelMinMaxObserver.with_args(qscheme="per_channel_affine", qdtype=Q.quint8))
    prepared = prepare_fx(FunctionalNet().eval(), bad, example_inputs=(X,))
    prepared(X)
    with pytest.raises(ValueError, match=r"'conv2d'.*signed 8-bit"):
        convert_fx(prepared)


# ---- ConvTranspose + BatchNorm ----
def _bn(c: int, d: int) -> nn.Module:
    bn = getattr(nn, f"BatchNorm{d}d")(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2), bn.bias.uniform_(-1, 1)
    return bn


@pytest.mark.parametrize("d,groups", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_eager_fuse_convtranspose_bn(d, groups):
    ct = getattr(nn, f"ConvTranspose{d}d")(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups)
    model = nn.Sequential(ct, _bn(6, d)).eval()
    fused = Q.fuse_modules(model, [["0", "1"]])
    x = torch.randn(2, 4, *[5] * d)
    assert type(fused[0]) is type(ct) and type(fused[1]) is nn.Identity
    torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=0)


class UpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.bn = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), _bn(6, 2)

    def forward(self, x):
        return torch.relu(self.bn(self.up(x)))


def test_fx_convtranspose_bn_folds_and_converts():
    model, x = UpBlock().eval(), torch.randn(8, 4, 5, 5)
    prepared = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    assert prepared.lowbit_report.fused == ["up: ConvTranspose2d + BatchNorm2d -> ConvTranspose2d"]
    assert [n.target for n in prepared.graph.nodes if n.op == "call_module" and "post" not in n.target] == ["up"]
    torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=0)  # observers are the identity
    q = convert_fx(prepared)
    assert type(q.up) is QConvTranspose2d and not any(isinstance(m, nn.BatchNorm2d) for m in q.modules())
    assert sqnr(model(x).detach(), q(x)) >= 30
    qat = prepare_qat_fx(UpBlock(), example_inputs=(x,))  # session 40: the QAT transposed conv-BN, as prepare_fx fuses
    assert qat.lowbit_report.fused == ["up: ConvTranspose2d + BatchNorm2d -> ConvTransposeBn2d"]


def test_fx_convtranspose_bn_train_mode_raises():
    with pytest.raises(ValueError, match="eval"):
        prepare_fx(UpBlock().train(), Q.get_minmax_qconfig(), example_inputs=(torch.randn(1, 4, 5, 5),))


# ---- parity with torch.ao FX ----
def _ao_qconfig(reduce_range: bool):
    from torch.ao.quantization import MinMaxObserver as AoMinMax
    from torch.ao.quantization import PerChannelMinMaxObserver as AoPerChannel
    from torch.ao.quantization import QConfig as AoQConfig
    return AoQConfig(activation=AoMinMax.with_args(dtype=torch.quint8, reduce_range=reduce_range),
                     weight=AoPerChannel.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def _ao_fx(model: nn.Module, x: torch.Tensor, engine: str, reduce_range: bool) -> torch.Tensor:
    from torch.ao.quantization import QConfigMapping as AoMapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
    from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare
    prev = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices
            prepared = ao_prepare(copy.deepcopy(model), AoMapping().set_global(_ao_qconfig(reduce_range)), (x,))
            prepared(x)
            return ao_convert(prepared)(x)
    finally:
        torch.backends.quantized.engine = prev


class FunctionalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(32, 16) * 0.3), nn.Parameter(torch.randn(32) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(8, 32) * 0.2), nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def _within_one_quantum(y: torch.Tensor, ref: torch.Tensor, quantum: float) -> None:
    """Equal up to requantization ties: every output within one quantum, nearly all bit-equal."""
    diff = (y - ref).abs()
    assert diff.max() <= quantum * 1.001
    assert (diff == 0).float().mean() >= 0.98


@pytest.mark.parametrize("make", [lambda: (FunctionalMLP(), torch.randn(64, 16)), lambda: (FunctionalNet(), X)],
                         ids=["F.linear", "F.conv2d"])
def test_parity_torch_ao_fx_onednn(make):
    # 7-bit activations (torch's reduce_range): oneDNN's u8 x s8 products cannot saturate on any x86 CPU
    # (full-range codes overflow its int16 pair sums on CPUs without VNNI), so the integer results
    # agree and only float requantization ties can differ
    model, x = make()
    seven_bit = Q.QConfig(activation=MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),
                          weight=Q.get_minmax_qconfig().weight)
    q = ptq_fx(model.eval(), x, seven_bit)
    last = [m for m in q.children() if hasattr(m, "weight_int8")][-1]
    _within_one_quantum(q(x), _ao_fx(model, x, "onednn", reduce_range=True), float(last.scale))


def test_parity_torch_ao_fx_qnnpack_full_range():
    model, x = FunctionalMLP().eval(), torch.randn(64, 16)
    q = ptq_fx(model, x)
    _within_one_quantum(q(x), _ao_fx(model, x, "qnnpack", reduce_range=False), float(q.quantized_linear_3.scale))
