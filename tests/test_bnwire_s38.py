"""A standalone BatchNorm is int8 by default (session 38), as in torch.ao's default static mapping.

``nn.BatchNorm2d/3d`` → ``lowbit.nn.quantized.normalization.BatchNorm2d/3d`` and ``nni.BNReLU2d/3d`` → ``BNReLU2d/3d`` are in
``get_default_static_quant_module_mappings`` (before: opt-in through ``NORM_MAPPINGS``; by default the BN of a DenseNet
pre-activation or one after a cat ran in float, between a DeQuantize and a Quantize in graph mode). A BN that normalizes
with batch statistics (``track_running_stats=False``) stays float, reported (one in training mode at convert is int8
since session 39, as torch.ao: tests/test_bnedge_s39.py).
Oracles: torch.ao's ``convert`` / ``convert_fx`` (x86 engine, 7-bit activations: no fbgemm saturation without VNNI),
lowbit's own reference model, the float model, and the graph's Quantize / DeQuantize count.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import ao_x86, one_thread  # noqa: F401  (autouse: one thread)
from lowbit import kernels
from lowbit.nn.quantized import normalization as qn
from lowbit.nn.quantized.functional_modules import FloatFunctional
from lowbit.nn.quantized.stubs import DeQuantize, Quantize
from lowbit.reference.fx import convert_to_reference_fx

tq = pytest.importorskip("torch.ao.quantization")
tqfx = pytest.importorskip("torch.ao.quantization.quantize_fx")
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _init(*bns: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    for bn in bns:
        c = bn.num_features
        bn.running_mean.copy_(torch.rand(c, generator=g) * 2 - 1)
        bn.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
        bn.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.data.copy_(torch.rand(c, generator=g) - 0.5)


class Dense(nn.Module):
    """DenseNet layer: pre-activation BN → ReLU → conv1x1 → BN → ReLU → conv3x3, cat with its input, BN → ReLU → conv."""

    def __init__(self, stubs: tuple = (Q.QuantStub, Q.DeQuantStub), cat: type = FloatFunctional,
                 graph: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.dq, self.f, self.graph = stubs[0](), stubs[1](), cat(), graph
        self.c0, self.bn1, self.r1, self.c1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 8, 1)
        self.bn2, self.r2, self.c2 = nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)
        self.bn3, self.r3, self.c3 = nn.BatchNorm2d(10), nn.ReLU(), nn.Conv2d(10, 4, 1)
        _init(self.bn1, self.bn2, self.bn3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c0(x if self.graph else self.q(x))
        y = self.c2(self.r2(self.bn2(self.c1(self.r1(self.bn1(a))))))
        both = torch.cat([a, y], 1) if self.graph else self.f.cat([a, y], 1)
        out = self.c3(self.r3(self.bn3(both)))
        return out if self.graph else self.dq(out)


class CatBN(nn.Module):
    """conv → cat → BN → ReLU → conv (the cat's inputs share one grid, as torch.ao's graph mode makes them)."""

    def __init__(self, dims: int = 2, track_running_stats: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, bn = getattr(nn, f"Conv{dims}d"), getattr(nn, f"BatchNorm{dims}d")
        self.c, self.bn, self.r, self.c2 = conv(3, 4, 3), bn(8, track_running_stats=track_running_stats), nn.ReLU(), conv(8, 4, 1)
        if track_running_stats:
            _init(self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c(x)
        return self.c2(self.r(self.bn(torch.cat([a, a], 1))))


def _ao_qconfig():
    return tq.QConfig(activation=tq.MinMaxObserver.with_args(reduce_range=True),
                      weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def _qconfig() -> Q.QConfig:  # lowbit's twin of _ao_qconfig
    return Q.QConfig(activation=Q.MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),
                     weight=Q.PerChannelMinMaxObserver.with_args(qdtype=Q.qint8, qscheme="per_channel_symmetric"))


_ao = ao_x86


def _q_dq(gm: nn.Module) -> tuple[int, int]:
    mods = dict(gm.named_modules())
    kinds = [type(mods[n.target]) for n in gm.graph.nodes if n.op == "call_module"]
    return kinds.count(Quantize), kinds.count(DeQuantize)


FUSE = [["c1", "bn2", "r2"], ["bn1", "r1"], ["bn3", "r3"]]


def test_eager_densenet_block_is_int8_and_matches_torch_ao_code_for_code():
    """Eager: the pre-activation BN → ReLU and the BN after the cat ran in float (QTensor fallback, with a warning);
    now they are BNReLU2d on the codes, as torch.ao's nniq.BNReLU2d, and the model equals torch.ao's and the reference."""
    def ao():
        m = tq.fuse_modules(Dense((tq.QuantStub, tq.DeQuantStub), torch.ao.nn.quantized.FloatFunctional).eval(), FUSE)
        m.qconfig = _ao_qconfig()
        p = tq.prepare(m)
        p(X)
        return tq.convert(p)(X)
    want = _ao(ao)
    m = Q.fuse_modules(Dense().eval(), FUSE)
    m.qconfig = _qconfig()
    p = Q.prepare(m)
    p(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no QTensor float fallback)
        q, report = Q.convert(copy.deepcopy(p), return_report=True)
        got = q(X)
    assert type(q.bn1) is qn.BNReLU2d and type(q.bn3) is qn.BNReLU2d and not report.left_float
    assert torch.equal(got, want)
    ref = Q.convert(p, is_reference=True)
    with torch.no_grad(), kernels.use_backend("reference"):
        assert torch.equal(q(X), ref(X))


def test_graph_mode_densenet_block_has_no_float_island():
    """Graph mode: BN → ReLU (fused, BNReLU2d) and the BN after the cat sat between a DeQuantize and a Quantize
    (3 of each); now one Quantize in, one DeQuantize out; the model equals the reference, and the pre-activation
    BN's codes equal torch.ao's."""
    model = Dense(graph=True).eval()
    p = Q.prepare_fx(copy.deepcopy(model), Q.QConfigMapping().set_global(_qconfig()), example_inputs=(X,))
    p(X)
    ref = convert_to_reference_fx(copy.deepcopy(p))
    q = Q.convert_fx(p)
    assert _q_dq(q) == (1, 1) and not q.lowbit_report.left_float
    assert type(q.bn1) is qn.BNReLU2d and type(q.bn3) is qn.BNReLU2d
    with torch.no_grad(), kernels.use_backend("reference"):
        assert torch.equal(q(X), ref(X))

    def ao():
        tp = tqfx.prepare_fx(copy.deepcopy(model), tq.QConfigMapping().set_global(_ao_qconfig()), (X,))
        tp(X)
        return tqfx.convert_fx(tp)
    tqm = _ao(ao)
    seen = {}
    for name, m in (("ao", tqm.bn1), ("lowbit", q.bn1)):
        m.register_forward_hook(lambda mod, i, o, name=name: seen.update({name: o.int_repr().to(torch.int32)}))
    _ao(lambda: tqm(X))
    q(X)
    assert torch.equal(seen["ao"], seen["lowbit"])  # (the cat differs: torch.ao shares its inputs' grid)


@pytest.mark.parametrize("dims", [2, 3])
def test_graph_mode_cat_bn_relu_conv_matches_torch_ao_code_for_code(dims):
    x = torch.randn(2, 3, *(6,) * dims, generator=torch.Generator().manual_seed(2))
    model = CatBN(dims).eval()
    p = Q.prepare_fx(copy.deepcopy(model), Q.QConfigMapping().set_global(_qconfig()), example_inputs=(x,))
    p(x)
    ref = convert_to_reference_fx(copy.deepcopy(p))
    q = Q.convert_fx(p)
    assert type(q.bn) is getattr(qn, f"BNReLU{dims}d") and _q_dq(q) == (1, 1)  # (before: 2, 2)

    def ao():
        tp = tqfx.prepare_fx(copy.deepcopy(model), tq.QConfigMapping().set_global(_ao_qconfig()), (x,))
        tp(x)
        return tqfx.convert_fx(tp)(x / 2)
    # (inputs inside the calibrated range: torch's kernels clamp a code past the 7-bit grid to 255, lowbit to 127)
    assert torch.equal(q(x / 2), _ao(ao))
    with torch.no_grad(), kernels.use_backend("reference"):
        assert torch.equal(q(x), ref(x))


def _eager_catbn(track_running_stats: bool, train: bool) -> tuple[nn.Module, nn.Module, Q.ConvertReport]:
    class M(CatBN):
        def __init__(self) -> None:
            super().__init__(2, track_running_stats)
            self.q, self.f, self.dq = Q.QuantStub(), FloatFunctional(), Q.DeQuantStub()

        def forward(self, x):
            a = self.c(self.q(x))
            return self.dq(self.c2(self.r(self.bn(self.f.cat([a, a], 1)))))
    model = M().eval()
    m = copy.deepcopy(model)
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(X)
    p.train(train)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no QTensor float fallback: the float BN dequantizes its input
        q, report = Q.convert(p, return_report=True)
        torch.testing.assert_close(q(X), model(X), atol=0.05, rtol=0)
    return model, q, report


@pytest.mark.parametrize("track_running_stats, train, why", [(False, False, "track_running_stats=False")])
def test_batch_statistics_bn_stays_float_in_both_modes(track_running_stats, train, why):
    """A BN without running statistics (batch statistics even in eval) has no int8 form: it stays float, reported
    with the reason (torch.ao converts it, and it then fails at run time), and the model's numbers stay the float
    model's within a few quanta. (A BN in training mode at convert is int8 since session 39, as torch.ao.)"""
    model, q, report = _eager_catbn(track_running_stats, train)
    assert type(q.bn) is nn.BatchNorm2d and why in report.left_float["bn"]
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(X,))
    p(X)
    p.train(train)
    q = Q.convert_fx(p)
    assert type(q.bn) is Q.nn.intrinsic.BNReLU2d and why in q.lowbit_report.left_float["bn"]
    assert _q_dq(q) == (2, 2) and not q.training
    torch.testing.assert_close(q(X), model(X), atol=0.05, rtol=0)


def test_qat_standalone_bn_gets_a_fake_quant_and_converts_as_torch_ao():
    """torch.ao's QAT mapping has no BN entry: prepare_qat leaves the BN a float BN with an output fake-quant (it is in the
    static mapping), and convert makes it int8; graph mode alike (BN → ReLU fused to BNReLU2d)."""
    class M(CatBN):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.f, self.dq = Q.QuantStub(), FloatFunctional(), Q.DeQuantStub()

        def forward(self, x):
            a = self.c(self.q(x))
            return self.dq(self.c2(self.r(self.bn(self.f.cat([a, a], 1)))))
    m = M().train()
    m.qconfig = Q.get_default_qat_qconfig()
    p = Q.prepare_qat(m)
    assert type(p.bn) is nn.BatchNorm2d and isinstance(p.bn.activation_post_process, Q.FakeQuantize)
    p(X)
    q = Q.convert(p.eval())
    assert type(q.bn) is qn.BatchNorm2d
    with torch.no_grad():
        torch.testing.assert_close(q(X), p(X), atol=0.05, rtol=0)
    pf = Q.prepare_qat_fx(CatBN().train(), Q.get_default_qat_qconfig_mapping(), example_inputs=(X,))
    pf(X)
    qf = Q.convert_fx(pf.eval())
    assert type(qf.bn) is qn.BNReLU2d and _q_dq(qf) == (1, 1)
    with torch.no_grad():
        torch.testing.assert_close(qf(X), pf(X), atol=0.05, rtol=0)


def test_bn_after_a_conv_is_still_folded():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).eval()
    p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(X,))
    p(X)
    q = Q.convert_fx(p)
    assert not any(isinstance(c, nn.modules.batchnorm._BatchNorm) for c in q.modules())


def test_batchnorm_float_reason():
    assert qn.batchnorm_float_reason(nn.BatchNorm2d(3).eval()) is None
    assert qn.batchnorm_float_reason(nn.BatchNorm3d(3).train()) is None  # (running statistics, as torch.ao)
    fused = Q.nn.intrinsic.BNReLU2d(nn.BatchNorm2d(3, track_running_stats=False), nn.ReLU()).eval()
    assert "track_running_stats" in qn.batchnorm_float_reason(fused)
    assert qn.batchnorm_float_reason(nn.LayerNorm(3)) is None
    mapping = Q.get_default_static_quant_module_mappings()
    assert mapping[nn.BatchNorm3d] is qn.BatchNorm3d and mapping[Q.nn.intrinsic.BNReLU3d] is qn.BNReLU3d
    assert nn.LayerNorm not in mapping and nn.GroupNorm not in mapping and nn.InstanceNorm2d not in mapping


def test_int8_batchnorm_exports_to_onnx(tmp_path):
    """A DenseNet block exported before with a float BN; its int8 BNReLU2d had no QDQ twin (to_onnx refused it):
    now BatchNormalization (+ Relu) between QDQ nodes, within one output quantum of the int8 model in ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from lowbit.export import run_onnx, to_onnx
    m = Q.fuse_modules(Dense().eval(), FUSE)
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(X)
    q = Q.convert(p)
    path = tmp_path / "dense.onnx"
    to_onnx(q, X, path)
    assert "BatchNormalization" in {n.op_type for n in onnx.load(str(path)).graph.node}
    got = run_onnx(path, X)
    got = torch.as_tensor(got[0] if isinstance(got, (list, tuple)) else got)
    assert (got - q(X)).abs().max() <= float(q.c3.scale) * 1.001
