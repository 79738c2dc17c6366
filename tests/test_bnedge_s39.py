"""Session 39: BatchNorm edge cases left by session 38's int8 standalone BatchNorm2d/3d and BNReLU2d/3d.

1. A QAT model converted without ``.eval()`` (torch.ao's own ``quantize_qat`` flow) kept its standalone BN float
   ("training mode at convert"); torch.ao converts it, and its int8 module applies the running statistics. lowbit now
   does the same, code for code (eager and graph mode; conv-BN QAT modules converted in training mode already did).
2. ``debug.compare`` showed an "inf" weight SQNR for an int8 BN (its ``weight`` is the float gamma): now ``None``
   ("-"), as for other layers without an int8 weight, the activation still compared.
3. The graph-mode sensitivity scan skipped every BN; a standalone one is now a layer (a folded one still is not).
4. Hostile BNs: NaN / infinite statistics, ``running_var + eps`` not above 0, ``eps < 0`` set after calibration gave
   clamped garbage codes silently: now a ``ValueError`` naming the value at convert; a wrong channel count on a float
   input was torch's RuntimeError; ``momentum=None`` was stored as 0.1. ``affine=False`` (torch.ao: "Weight must be
   provided"), ``eps`` tiny / huge and ``BatchNorm1d`` (not int8 in either mapping) match torch.ao.
Oracles: torch.ao's ``convert`` / ``convert_fx`` (x86 engine, 7-bit activations), lowbit's reference model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import ao_x86, one_thread  # noqa: F401  (autouse: one thread)
from lowbit import kernels
from lowbit.debug import compare, layer_sensitivity
from lowbit.nn.quantized import normalization as qn
from lowbit.qscheme import qint8, quint8

tq = pytest.importorskip("torch.ao.quantization")
tqfx = pytest.importorskip("torch.ao.quantization.quantize_fx")
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))


_ao = ao_x86


def _ao_qat():
    return tq.QConfig(
        activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=127),
        weight=tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                         quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def _qat() -> Q.QConfig:  # lowbit's twin of _ao_qat
    return Q.QConfig(activation=Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver,
                                                         qdtype=quint8.with_range(0, 127)),
                     weight=Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver, qdtype=qint8,
                                                     qscheme="per_channel_symmetric", ch_axis=0))


def _ao_ptq():
    return tq.QConfig(activation=tq.MinMaxObserver.with_args(reduce_range=True),
                      weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def _ptq() -> Q.QConfig:  # lowbit's twin of _ao_ptq
    return Q.QConfig(activation=Q.MinMaxObserver.with_args(qdtype=quint8.with_range(0, 127)),
                     weight=Q.PerChannelMinMaxObserver.with_args(qdtype=qint8, qscheme="per_channel_symmetric"))


def _stats(bn: nn.Module, seed: int = 1) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    c = bn.num_features
    bn.running_mean.copy_(torch.rand(c, generator=g) * 2 - 1)
    bn.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
    if bn.affine:
        bn.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.data.copy_(torch.rand(c, generator=g) - 0.5)
    return bn


class Eager(nn.Module):
    """stub → conv → BN (standalone: the conv's output is cat-free but not fused) → conv → BN → stub."""

    def __init__(self, ao: bool = False, bn: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.dq = (tq.QuantStub(), tq.DeQuantStub()) if ao else (Q.QuantStub(), Q.DeQuantStub())
        self.c, self.r = nn.Conv2d(3, 4, 3), nn.ReLU()
        self.bn = _stats(nn.BatchNorm2d(4)) if bn is None else copy.deepcopy(bn)
        self.c2, self.bn2 = nn.Conv2d(4, 4, 1), _stats(nn.BatchNorm2d(4), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.bn2(self.c2(self.bn(self.r(self.c(self.q(x)))))))


class Graph(nn.Module):
    """conv → ReLU → BN → ReLU → conv (the BN standalone: fused with its ReLU to BNReLU) → BN (folded)."""

    def __init__(self, dims: int = 2, bn: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, norm = getattr(nn, f"Conv{dims}d"), getattr(nn, f"BatchNorm{dims}d")
        self.c, self.r = conv(3, 8, 3), nn.ReLU()
        self.bn = _stats(norm(8)) if bn is None else copy.deepcopy(bn)
        self.r2, self.c2, self.bn2 = nn.ReLU(), conv(self.bn.num_features, 4, 1), _stats(norm(4), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.c2(self.r2(self.bn(self.r(self.c(x))))))


def _steps(p: nn.Module, x: torch.Tensor) -> None:
    for i in range(3):  # training-mode forwards: BN statistics and fake-quant ranges move
        p(x * (1 + i))


# ---------------------------------------------------------------- 1. QAT converted without .eval()


def test_eager_qat_converted_in_training_mode_has_int8_bns_as_torch_ao():
    """Before: both BNs stayed nn.BatchNorm2d ("training mode at convert"); torch.ao: nnq.BatchNorm2d. Now int8, and
    the model and the first BN's codes equal torch.ao's."""
    def ao():
        m = Eager(ao=True).train()
        m.qconfig = _ao_qat()
        p = tq.prepare_qat(m)
        _steps(p, X)
        q = tq.convert(p)  # no .eval(): torch.ao's quantize_qat flow
        seen = {}
        q.bn.register_forward_hook(lambda mod, i, o: seen.update(codes=o.int_repr().to(torch.int32)))
        return type(q.bn).__name__, q(X), seen["codes"]
    ao_type, want, ao_codes = _ao(ao)
    m = Eager().train()
    m.qconfig = _qat()
    p = Q.prepare_qat(m)
    _steps(p, X)
    q, report = Q.convert(p, return_report=True)
    assert ao_type == "BatchNorm2d" and type(q.bn) is qn.BatchNorm2d and type(q.bn2) is qn.BatchNorm2d
    assert not report.left_float
    seen = {}
    q.bn.register_forward_hook(lambda mod, i, o: seen.update(codes=o.int_repr().to(torch.int32)))
    assert torch.equal(q(X), want) and torch.equal(seen["codes"], ao_codes)


@pytest.mark.parametrize("dims", [2, 3])
def test_graph_mode_qat_converted_in_training_mode_has_int8_bn_as_torch_ao(dims):
    x = torch.randn(2, 3, *(6,) * dims, generator=torch.Generator().manual_seed(2))

    def ao():
        p = tqfx.prepare_qat_fx(Graph(dims).train(), tq.QConfigMapping().set_global(_ao_qat()), (x,))
        _steps(p, x)
        q = tqfx.convert_fx(p)
        return type(q.bn).__name__, q(x / 2)
    ao_type, want = _ao(ao)
    p = Q.prepare_qat_fx(Graph(dims).train(), Q.QConfigMapping().set_global(_qat()), example_inputs=(x,))
    _steps(p, x)
    q = Q.convert_fx(p)
    assert ao_type == f"BNReLU{dims}d" and type(q.bn) is getattr(qn, f"BNReLU{dims}d"), q.lowbit_report.left_float
    assert not q.lowbit_report.left_float
    assert torch.equal(q(x / 2), want)  # (inputs inside the calibrated range: torch saturates 7-bit codes at 255)


def test_ptq_model_in_training_mode_at_convert_equals_the_eval_conversion():
    """The int8 BN applies the running statistics whatever the mode at convert (torch.ao's semantics)."""
    for graph in (False, True):
        m = Graph() if graph else Eager()
        if graph:
            p = Q.prepare_fx(m.eval(), Q.QConfigMapping().set_global(_ptq()), example_inputs=(X,))
        else:
            m.qconfig = _ptq()
            p = Q.prepare(m.eval())
        p(X)
        convert = Q.convert_fx if graph else Q.convert
        q_eval, q_train = convert(copy.deepcopy(p)), convert(copy.deepcopy(p).train())
        assert isinstance(q_train.bn, qn.BatchNorm2d)
        assert torch.equal(q_train(X), q_eval(X))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_bn_qat_converted_in_training_mode_matches_torch_ao(dims):
    """(Held before: a guard.) ConvBn / ConvBnReLU QAT modules converted without .eval() fold the running
    statistics, in eager and graph mode, code for code with torch.ao."""
    x = torch.randn(2, 3, *(6,) * dims, generator=torch.Generator().manual_seed(2))

    class CB(nn.Module):
        def __init__(self, ao: bool, graph: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            conv, norm = getattr(nn, f"Conv{dims}d"), getattr(nn, f"BatchNorm{dims}d")
            self.q, self.dq = (tq.QuantStub(), tq.DeQuantStub()) if ao else (Q.QuantStub(), Q.DeQuantStub())
            self.graph = graph
            self.c, self.bn, self.r, self.c2, self.bn2 = conv(3, 8, 3), norm(8), nn.ReLU(), conv(8, 4, 1), norm(4)

        def forward(self, x):
            y = self.bn2(self.c2(self.r(self.bn(self.c(x if self.graph else self.q(x))))))
            return y if self.graph else self.dq(y)

    groups = [["c", "bn", "r"], ["c2", "bn2"]]

    def ao():
        m = tq.fuse_modules_qat(CB(True).train(), groups)
        m.qconfig = _ao_qat()
        p = tq.prepare_qat(m)
        _steps(p, x)
        pf = tqfx.prepare_qat_fx(CB(True, graph=True).train(), tq.QConfigMapping().set_global(_ao_qat()), (x,))
        _steps(pf, x)
        return tq.convert(p)(x / 2), tqfx.convert_fx(pf)(x / 2)
    want, want_fx = _ao(ao)
    m = Q.fuse_modules_qat(CB(False).train(), groups)
    m.qconfig = _qat()
    p = Q.prepare_qat(m)
    _steps(p, x)
    pf = Q.prepare_qat_fx(CB(False, graph=True).train(), Q.QConfigMapping().set_global(_qat()), example_inputs=(x,))
    _steps(pf, x)
    assert torch.equal(Q.convert(p)(x / 2), want) and torch.equal(Q.convert_fx(pf)(x / 2), want_fx)


def test_batchnorm_float_reason_ignores_the_mode():
    assert qn.batchnorm_float_reason(nn.BatchNorm2d(3).train()) is None
    assert "track_running_stats" in qn.batchnorm_float_reason(nn.BatchNorm2d(3, track_running_stats=False).train())


# ---------------------------------------------------------------- 2. compare


def test_compare_int8_bn_has_no_weight_sqnr_but_its_activation_is_measured():
    """Before: weight SQNR inf, max err 0 (the float gamma against itself). Now None ("-"), as a ReLU or an add."""
    m = Graph().eval()
    p = Q.prepare_fx(copy.deepcopy(m), Q.get_default_qconfig_mapping(), example_inputs=(X,))
    p(X)
    rows = {r.name: r for r in compare(m, Q.convert_fx(p), X).rows}
    bn, c = rows["bn"], rows["c"]
    assert bn.module_type == "BNReLU2d" and bn.weight_sqnr_db is None and bn.weight_max_abs_err is None
    assert 30 < bn.act_sqnr_db < float("inf") and c.weight_sqnr_db > 30  # (a conv keeps its weight figures)
    me = Eager().eval()
    f = Q.fuse_modules(copy.deepcopy(me), [["c", "r"], ["c2", "bn2"]])
    f.qconfig = Q.get_default_qconfig()
    pe = Q.prepare(f)
    pe(X)
    result = compare(me, Q.convert(pe), X)
    row = next(r for r in result.rows if r.name == "bn")
    assert row.module_type == "BatchNorm2d" and row.weight_sqnr_db is None and 30 < row.act_sqnr_db < float("inf")
    line = next(ln for ln in str(result).splitlines() if ln.startswith("bn "))
    assert "inf" not in line and line.rstrip().endswith("-")


# ---------------------------------------------------------------- 3. sensitivity


def test_graph_mode_sensitivity_scans_a_standalone_bn_but_not_a_folded_one():
    """Before: rows c, c2 only (every BN skipped). Now the standalone bn (int8 BNReLU2d alone) is a row; bn2, folded
    into c2, is not. Eager mode listed standalone BNs already."""
    table = layer_sensitivity(Graph().eval(), Q.get_default_qconfig_mapping(), X, mode="fx")
    names = {r.name for r in table.rows}
    assert names == {"c", "bn", "c2"}, names
    assert next(r for r in table.rows if r.name == "bn").drop > 0
    eager = layer_sensitivity(Eager().eval(), Q.get_default_qconfig(), X)
    assert {"bn", "bn2"} <= {r.name for r in eager.rows}


# ---------------------------------------------------------------- 4. hostile BNs


@pytest.mark.parametrize("kw", [dict(momentum=None), dict(eps=1e-30), dict(eps=1e6)], ids=["momentum", "tiny", "huge"])
def test_odd_hyperparameters_match_torch_ao_in_both_modes(kw):
    bn = _stats(nn.BatchNorm2d(4, **kw))

    def ao():
        m = Eager(ao=True, bn=bn).eval()
        m.qconfig = _ao_ptq()
        p = tq.prepare(m)
        p(X)
        g = Graph(bn=_stats(nn.BatchNorm2d(8, **kw))).eval()
        pf = tqfx.prepare_fx(g, tq.QConfigMapping().set_global(_ao_ptq()), (X,))
        pf(X)
        q = tq.convert(p)
        return _bn_codes(q, X), q(X), tqfx.convert_fx(pf)(X / 2)
    codes, want, want_fx = _ao(ao)
    m = Eager(bn=bn).eval()
    m.qconfig = _ptq()
    p = Q.prepare(m)
    p(X)
    q = Q.convert(p)
    pf = Q.prepare_fx(Graph(bn=_stats(nn.BatchNorm2d(8, **kw))).eval(), Q.QConfigMapping().set_global(_ptq()),
                      example_inputs=(X,))
    pf(X)
    qf = Q.convert_fx(pf)
    assert type(q.bn) is qn.BatchNorm2d and type(qf.bn) is qn.BNReLU2d
    assert q.bn.momentum == bn.momentum and q.bn.eps == bn.eps  # (momentum None was stored as 0.1)
    assert torch.equal(_bn_codes(q, X), codes) and torch.equal(qf(X / 2), want_fx)
    # (the unfused conv c2 before bn2 gives one code off torch.ao's at one of 576 outputs: a conv tie, not the BN)
    torch.testing.assert_close(q(X), want, atol=float(q.bn2.scale) * 1.01, rtol=0)


def _bn_codes(q: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The codes into and out of ``q.bn``, one tensor (the BN's own map checked on the same input codes)."""
    seen = []
    handle = q.bn.register_forward_hook(lambda mod, i, o: seen.extend([i[0].int_repr(), o.int_repr()]))
    q(x)
    handle.remove()
    return torch.cat([t.to(torch.int32).flatten() for t in seen])


def test_affine_false_bn_equals_torch_ao_with_unit_gamma_and_zero_beta():
    """torch.ao cannot convert it ("Weight must be provided"); lowbit's codes equal torch.ao's BN with weight 1,
    bias 0 (the same map), in eager and graph mode, and the reference model's."""
    plain = _stats(nn.BatchNorm2d(4, affine=False))
    unit = _stats(nn.BatchNorm2d(4))
    unit.weight.data.fill_(1.0)
    unit.bias.data.zero_()

    def ao():
        m = Eager(ao=True, bn=unit).eval()
        m.qconfig = _ao_ptq()
        p = tq.prepare(m)
        p(X)
        with pytest.raises(RuntimeError, match="Weight must be provided"):
            m2 = Eager(ao=True, bn=plain).eval()
            m2.qconfig = _ao_ptq()
            p2 = tq.prepare(m2)
            p2(X)
            tq.convert(p2)(X)
        return tq.convert(p)(X)
    want = _ao(ao)
    m = Eager(bn=plain).eval()
    m.qconfig = _ptq()
    p = Q.prepare(m)
    p(X)
    ref = Q.convert(copy.deepcopy(p), is_reference=True)
    q = Q.convert(p)
    assert type(q.bn) is qn.BatchNorm2d and q.bn.weight is None
    assert torch.equal(q(X), want)
    with torch.no_grad(), kernels.use_backend("reference"):
        assert torch.equal(q(X), ref(X))
    g_plain, g_unit = _stats(nn.BatchNorm2d(8, affine=False)), _stats(nn.BatchNorm2d(8))
    g_unit.weight.data.fill_(1.0)
    g_unit.bias.data.zero_()
    outs = []
    for bn in (g_plain, g_unit):
        pf = Q.prepare_fx(Graph(bn=bn).eval(), Q.QConfigMapping().set_global(_ptq()), example_inputs=(X,))
        pf(X)
        outs.append(Q.convert_fx(pf)(X))
    assert torch.equal(outs[0], outs[1])


def _nan_var(bn: nn.Module) -> None:
    bn.running_var[1] = float("nan")


def _zero_var(bn: nn.Module) -> None:
    bn.eps = 0.0
    bn.running_var[2] = 0.0


def _inf_weight(bn: nn.Module) -> None:
    bn.weight.data[3] = float("inf")


def _negative_eps(bn: nn.Module) -> None:
    bn.eps = -1e-3


@pytest.mark.parametrize("spoil, match", [
    (_nan_var, r"running_var\[1\]=nan is not finite"),
    (_zero_var, r"running_var\[2\]=0 \+ eps=0.0 is not above 0"),
    (_inf_weight, r"weight\[3\]=inf is not finite"),
    (_negative_eps, r"eps=-0.001 must be a finite number >= 0"),
], ids=["nan_var", "zero_var_eps0", "inf_weight", "negative_eps"])
def test_bn_statistics_without_a_finite_int8_map_are_refused_at_convert(spoil, match):
    """Spoiled after calibration (as a QAT run can leave them): before, convert gave clamped codes silently (the NaN
    channel's codes were 0, the float model's NaN / inf); now a ValueError naming the module and the value."""
    m = Eager().eval()
    m.qconfig = _ptq()
    p = Q.prepare(m)
    p(X)
    spoil(p.bn)
    with pytest.raises(ValueError, match=r"convert: module 'bn' \(BatchNorm2d -> BatchNorm2d\): .*" + match):
        Q.convert(p)
    pf = Q.prepare_fx(Graph().eval(), Q.QConfigMapping().set_global(_ptq()), example_inputs=(X,))
    pf(X)
    spoil(pf.bn[0])
    with pytest.raises(ValueError, match=r"convert_fx: module 'bn' \(BNReLU2d -> BNReLU2d\): .*" + match):
        Q.convert_fx(pf)


def test_channel_mismatch_is_a_clear_error_on_codes_and_on_float_inputs():
    m = Eager().eval()
    m.qconfig = _ptq()
    p = Q.prepare(m)
    p(X)
    bn = Q.convert(p).bn
    for x in (torch.randn(2, 6, 4, 4), Q.quantize_per_tensor(torch.randn(2, 6, 4, 4), 0.1, 128, Q.quint8)):
        with pytest.raises(ValueError, match=r"quantized BatchNorm2d\(4\) expects a 4-D input with 4 channels, "
                                             r"got shape \(2, 6, 4, 4\)"):
            bn(x)  # (a float one was torch's RuntimeError "running_mean should contain 4 elements not 6")


def test_batchnorm1d_stays_float_as_in_torch_ao():
    """BatchNorm1d has no int8 module in torch.ao's mapping or lowbit's: graph mode runs it in float between a
    DeQuantize and a Quantize, code for code with torch.ao; eager convert leaves it an nn.BatchNorm1d."""
    assert nn.BatchNorm1d not in Q.get_default_static_quant_module_mappings()
    assert nn.BatchNorm1d not in tq.get_default_static_quant_module_mappings()
    x = X[:, :, 0]

    class G(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.c, self.r, self.bn, self.c2 = nn.Conv1d(3, 4, 3), nn.ReLU(), _stats(nn.BatchNorm1d(4)), nn.Conv1d(4, 4, 1)

        def forward(self, x):
            return self.c2(self.bn(self.r(self.c(x))))

    def ao():
        p = tqfx.prepare_fx(G().eval(), tq.QConfigMapping().set_global(_ao_ptq()), (x,))
        p(x)
        return tqfx.convert_fx(p)(x / 2)
    want = _ao(ao)
    p = Q.prepare_fx(G().eval(), Q.QConfigMapping().set_global(_ptq()), example_inputs=(x,))
    p(x)
    q = Q.convert_fx(p)
    assert type(q.bn) is nn.BatchNorm1d and "bn" in q.lowbit_report.left_float
    assert torch.equal(q(x / 2), want)
    e = nn.Sequential(Q.QuantStub(), nn.Conv1d(3, 4, 3), _stats(nn.BatchNorm1d(4)), Q.DeQuantStub()).eval()
    e.qconfig = _ptq()
    pe = Q.prepare(e)
    pe(x)
    assert type(Q.convert(pe)[2]) is nn.BatchNorm1d
