"""QAT and the eager workflow around it, with torch.ao.quantization as the oracle (session 24)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.fake_quant import enable_param_learning


def test_lsq_grid_learned_without_an_observer_phase_converts():
    torch.manual_seed(0)
    lfq = Q.LearnableFakeQuantize
    qc = Q.QConfig(activation=lfq.with_args(qdtype=Q.quint8, scale=0.05, zero_point=128),
                   weight=lfq.with_args(qdtype=Q.qint8, qscheme=Q.per_tensor_symmetric, scale=0.05))
    x = torch.randn(64, 8)
    y = x[:, :2].argmax(1)
    qat = Q.prepare_qat(nn.Sequential(Q.QuantStub(), nn.Linear(8, 2), Q.DeQuantStub()), qc)
    qat.apply(enable_param_learning)
    opt = torch.optim.Adam(qat.parameters(), lr=1e-2)
    for _ in range(5):
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    ref = qat(x).detach()
    c = Q.convert(qat)  # was "has an observer that saw no data"
    assert type(c[1]).__module__.startswith("lowbit.nn.quantized") and torch.allclose(c(x), ref, atol=1e-6)


def test_placeholder_activation_on_a_static_layer_is_named():
    qc = Q.QConfig(activation=Q.PlaceholderObserver.with_args(), weight=Q.PerChannelMinMaxObserver.with_args())
    for prep in (Q.prepare, Q.prepare_qat):
        p = prep(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()), qc)
        p(torch.randn(8, 4))
        with pytest.raises(RuntimeError, match="module '0' .* has a PlaceholderObserver activation"):
            Q.convert(p.eval())  # was "saw no data; run calibration" / QAT modules left in place


class _FlatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dq = Q.QuantStub(), Q.DeQuantStub()
        self.conv, self.relu, self.fc = nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Linear(8 * 6 * 6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.fc(torch.flatten(self.relu(self.conv(self.quant(x))), 1)))  # torchvision's flatten


def test_qat_model_and_its_converted_twin_agree_through_torch_flatten():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 8, 8)
    m = Q.prepare_qat(_FlatNet().train(), Q.get_default_qat_qconfig())
    for _ in range(3):
        m(x)
    m.apply(Q.disable_observer)
    m.eval()
    ref = m(x)
    err = (Q.convert(m)(x) - ref).abs() / m.fc.activation_post_process.scale
    assert float(err.max()) < 1e-3  # 14.6 % of outputs were a quantum off: the fc input fake-quantized twice
    seen = m.fc.input_activation_post_process.activation_post_process.min_val  # a view of a quantized output is
    assert torch.isinf(seen).all()  # not a float input: its observer saw nothing


def test_conv_bn_qat_with_a_zero_gamma_stays_finite():
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(2, 4, 3, bias=False), nn.BatchNorm2d(4), Q.DeQuantStub()).train()
    nn.init.zeros_(m[2].weight)  # torchvision's zero_init_residual
    m[2].weight.data[0] = 1.0
    q = Q.prepare_qat(Q.fuse_modules_qat(m, [["1", "2"]]), Q.get_default_qat_qconfig("x86"))
    x = torch.randn(8, 2, 6, 6)
    for _ in range(3):
        y = q(x)
    assert torch.isfinite(y).all() and torch.isfinite(q[1].bn.running_mean).all()  # were all NaN (torch.ao too)
    q.eval()
    ref = q(x)
    scale = float(q[1].activation_post_process.scale)
    assert float((Q.convert(q)(x) - ref).abs().max()) <= scale * 1.01


def test_fusing_a_bn_without_running_stats_is_refused_and_named():
    m = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, track_running_stats=False))
    for fuse, mode in ((Q.fuse_modules_qat, m.train), (Q.fuse_modules, m.eval)):
        mode()
        with pytest.raises(ValueError, match=r"track_running_stats=False; .* \(fusing \['0', '1'\]\)"):
            fuse(m, [["0", "1"]])


def test_prepare_qat_names_a_module_whose_swap_fails_and_leaves_the_model_unchanged():
    qc = Q.QConfig(activation=Q.FakeQuantize, weight=Q.FakeQuantize.with_args(ch_axis=0))
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), nn.Sequential(nn.Linear(2, 2)), Q.DeQuantStub())
    with pytest.raises(TypeError, match=r"prepare_qat: module '1' \(Linear\): .*qconfig.weight\(\) failed"):
        Q.prepare_qat(m, qc, inplace=True)
    assert type(m[1]) is nn.Linear and type(m[2][0]) is nn.Linear


def test_torch_ao_observer_keywords_get_the_lowbit_spelling():
    for kw, hint in (({"reduce_range": True}, "with_range(0, 127)"), ({"dtype": torch.quint8}, "qdtype="),
                     ({"quant_min": 0, "quant_max": 127}, "with_range(lo, hi)")):
        with pytest.raises(TypeError, match=r"QConfig activation=MinMaxObserver.with_args.*" + re.escape(hint)):
            Q.QConfig(activation=Q.MinMaxObserver.with_args(**kw), weight=Q.PerChannelMinMaxObserver)


def test_root_type_rule_does_not_override_the_global_as_in_torch_ao():
    import torch.ao.quantization as ao

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, tq in (("ao", ao), ("lowbit", Q)):
            m = nn.Sequential(tq.QuantStub(), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), tq.DeQuantStub())
            tq.propagate_qconfig_(m, {"": tq.get_default_qat_qconfig("x86"), nn.Sequential: None})
            got[name] = {n: getattr(x, "qconfig", None) is not None for n, x in m.named_modules()}
    assert got["lowbit"] == got["ao"] and got["lowbit"][""] and not got["lowbit"]["2"]


def test_convert_keeps_qconfigs_with_remove_qconfig_false_and_mappings_round_trip_dicts():
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), nn.Softmax(-1), Q.DeQuantStub()).eval()
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(torch.randn(4, 4))
    kept = Q.convert(p, remove_qconfig=False)  # was "unexpected keyword argument"
    assert all("qconfig" in x.__dict__ for x in kept.modules())
    assert not any("qconfig" in x.__dict__ for x in Q.convert(p).modules())
    mapping = (Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_object_type(nn.Linear, None)
               .set_module_name_regex("a.*", None).set_module_name("b", Q.get_minmax_qconfig()))
    assert repr(Q.QConfigMapping.from_dict(mapping.to_dict())) == repr(mapping)


def test_lsq_learning_before_any_observer_batch_says_what_to_do():
    q = Q.prepare_qat(nn.Sequential(Q.QuantStub(), nn.Linear(8, 2), Q.DeQuantStub()), Q.get_lsq_qat_qconfig())
    q.apply(enable_param_learning)
    with pytest.raises(ValueError, match="run one batch with the observer on .* or build it with channel_len"):
        q(torch.randn(4, 8))


def test_every_view_of_a_quantized_output_stays_quantized_so_no_layer_is_left_without_a_grid():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).narrow(1, 0, 4))  # a view QTensor keeps as codes (it fell back to float)

    torch.manual_seed(0)
    p = Q.prepare(M().eval(), Q.get_default_qconfig())
    p(torch.randn(64, 8))
    c = Q.convert(p)
    x = torch.randn(8, 8)
    assert torch.equal(c(x)[:1].dequantize(), c(x[:1]).dequantize())  # no per-call grid: a row's output is its own
    a = Q.quantize_per_tensor(torch.randn(2, 3, 4), 0.05, 10, Q.quint8)
    for name, args in [("narrow", (1, 0, 2)), ("select", (1, 1)), ("unflatten", (2, (2, 2))), ("movedim", (0, 2)),
                       ("expand", (2, 2, 3, 4)), ("diagonal", ()), ("unfold", (2, 2, 1))]:
        r = getattr(a, name)(*args)
        assert isinstance(r, Q.QTensor) and torch.equal(r.dequantize(), getattr(a.dequantize(), name)(*args)), name


def test_a_root_type_rule_applies_when_no_global_is_set():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    qc = Q.get_minmax_qconfig()
    b = Q.propagate_qconfig_(Block(), Q.QConfigMapping().set_object_type(Block, qc))
    assert b.qconfig is qc and b.fc.qconfig is qc  # torch.ao: {Block: qc} quantizes the block


def test_the_new_migration_arguments_refuse_wrong_types():
    with pytest.raises(TypeError, match="QConfigMapping.from_dict: expects a dict, got list"):
        Q.QConfigMapping.from_dict([("", Q.get_default_qconfig())])
    p = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval(), Q.get_default_qconfig())
    p(torch.randn(4, 4))
    with pytest.raises(TypeError, match="convert: remove_qconfig must be a bool, got 'no'"):
        Q.convert(p, remove_qconfig="no")
