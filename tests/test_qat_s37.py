"""QAT sweep (session 37): eager / graph-mode QAT against torch.ao.quantization; each defect's test fails before its fix."""

import copy
import warnings

import pytest
import torch
import torch.ao.nn.intrinsic.qat as tnniqat
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic.qat as nniqat
from helpers import one_thread, sgd_steps  # noqa: F401  (one_thread: autouse, this module runs on 1 thread)
from lowbit.custom_config import PrepareCustomConfig


class _TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.relu(self.bn(self.conv(x)))
        return self.head(z), z


@pytest.mark.parametrize("fn", [Q.prepare_qat_fx, Q.prepare_fx])
def test_output_quantized_index_past_the_outputs_is_refused_at_prepare(fn):
    """An output_quantized_idxs typo was refused only by convert_fx, after the whole QAT run / calibration; the input
    indexes were already checked at prepare."""
    torch.manual_seed(0)
    ex = (torch.randn(2, 3, 6, 6),)
    model = _TwoOut().train(fn is Q.prepare_qat_fx)
    bad = PrepareCustomConfig().set_output_quantized_indexes([0, 2])
    with pytest.raises(ValueError, match=rf"{fn.__name__}: output_quantized_indexes \[2\] are past the model's 2 outputs"):
        fn(model, None, ex, prepare_custom_config=bad)
    p = fn(model, None, ex, prepare_custom_config=PrepareCustomConfig().set_output_quantized_indexes([1]))
    p(*ex)
    head, z = Q.convert_fx(p.eval())(*ex)
    assert isinstance(z, Q.QTensor) and not isinstance(head, Q.QTensor)


def _direct(qc: Q.QConfig) -> nn.Module:
    torch.manual_seed(0)
    conv_bn_relu = nniqat.ConvBnReLU2d(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), qconfig=qc)  # fused by the user
    return nn.Sequential(Q.QuantStub(), conv_bn_relu, nn.Identity(), nn.Identity(), nn.Flatten(), nn.Linear(8 * 16, 4),
                         Q.DeQuantStub()).train()


def test_prepare_qat_keeps_a_directly_built_conv_bn_module_whole():
    """prepare_qat recursed into a QAT ConvBn module built directly (or prepared before) and swapped its float `conv`
    for a QAT Conv2d with a second, unused weight_fake_quant: extra state_dict keys, so a checkpoint of the
    fuse_modules_qat model did not load (torch.ao stops at fused modules)."""
    qc = Q.get_default_qat_qconfig()
    direct = Q.prepare_qat(_direct(qc), qc)
    assert type(direct[1].conv) is nn.Conv2d and not any("conv.weight_fake_quant" in k for k in direct.state_dict())
    torch.manual_seed(0)
    fused = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 16, 4), Q.DeQuantStub()).train()
    fused = Q.prepare_qat(Q.fuse_modules_qat(fused, [["1", "2", "3"]]), qc)
    x = torch.randn(8, 3, 6, 6)
    fused(x)
    direct.load_state_dict(fused.state_dict())  # strict: the same keys
    fused.eval(), direct.eval()
    assert torch.equal(direct(x), fused(x))
    assert torch.equal(Q.convert(direct)(x), Q.convert(fused)(x))


def test_preparing_a_prepared_model_again_warns_that_its_grids_are_replaced():
    """prepare_qat (or prepare) on a model whose fake-quants already recorded grids (a re-run notebook cell) replaced
    them with fresh ones, silently, as torch.ao does: the trained activation grids were lost without a word."""
    qc = Q.get_default_qat_qconfig()
    p = Q.prepare_qat(_direct(qc), qc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Q.prepare_qat(p, qc)  # nothing recorded yet: nothing lost, no warning
    p(torch.randn(8, 3, 6, 6))
    for fn in (Q.prepare_qat, Q.prepare):
        with pytest.warns(UserWarning, match=rf"{fn.__name__}\(\): the model was prepared before: the recorded output "
                                             r"grids of '0' \(QuantStub\), '1' \(ConvBnReLU2d\), '5' \(Linear\)"):
            again = fn(p, qc)
        assert not again[5].activation_post_process.activation_post_process.is_calibrated
    assert p[5].activation_post_process.activation_post_process.is_calibrated  # (a deep copy: p keeps its grids)


def test_bn_switches_and_toggles_match_torch_ao_step_by_step(monkeypatch):
    """train -> eval -> train, freeze_bn / update_bn, observer and fake-quant switches mid-training, BN momentum=None,
    grouped conv, LinearBn1d: outputs, BN statistics and converted weight codes equal torch.ao's. Departure:
    lowbit's `freeze_bn_stats` / `update_bn_stats` (model.apply) also act on LinearBn1d, which torch.ao's module-level
    functions skip (its `LinearBn1d.freeze_bn_stats()` method is called directly here)."""
    monkeypatch.setattr(torch.backends.quantized, "engine", "x86")  # (the previous engine comes back)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2),
                      nn.BatchNorm2d(8, momentum=None), nn.Flatten(), nn.Linear(8 * 9, 6), nn.BatchNorm1d(6)).train()
    groups = [["0", "1", "2"], ["3", "4"], ["6", "7"]]
    a = tq.QuantWrapper(tq.fuse_modules_qat(copy.deepcopy(m), groups))
    a.qconfig = tq.get_default_qat_qconfig("x86", 0)
    a = tq.prepare_qat(a)
    b = Q.prepare_qat(Q.QuantWrapper(Q.fuse_modules_qat(copy.deepcopy(m), groups)), Q.get_default_qat_qconfig("x86", 0))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    ao_freeze = lambda k: (k.apply(tnniqat.freeze_bn_stats), k.module[6].freeze_bn_stats())
    ao_update = lambda k: (k.apply(tnniqat.update_bn_stats), k.module[6].update_bn_stats())
    steps = {1: (lambda k: k.eval(),) * 2, 2: (lambda k: k.train(),) * 2,
             3: (ao_freeze, lambda k: k.apply(nniqat.freeze_bn_stats)),
             5: (ao_update, lambda k: k.apply(nniqat.update_bn_stats)),
             6: (lambda k: k.apply(tq.disable_observer), lambda k: k.apply(Q.disable_observer)),
             7: (lambda k: k.apply(tq.disable_fake_quant), lambda k: k.apply(Q.disable_fake_quant)),
             8: (lambda k: k.apply(tq.enable_fake_quant), lambda k: k.apply(Q.enable_fake_quant)),
             9: (ao_freeze, lambda k: k.apply(nniqat.freeze_bn_stats))}
    bns = list(zip([p for p in a.modules() if isinstance(p, nn.modules.batchnorm._BatchNorm)],
                   [q for q in b.modules() if isinstance(q, nn.modules.batchnorm._BatchNorm)]))
    torch.manual_seed(1)
    for step in range(11):
        x = torch.randn(8, 3, 7, 7)
        if step in steps:
            steps[step][0](a), steps[step][1](b)
        ya, yb = a(x), b(x)
        assert torch.equal(ya, yb), step
        if a.training:
            sgd_steps((ya, oa), (yb, ob))
        for p, q in bns:
            assert torch.equal(p.running_mean, q.running_mean) and torch.equal(p.running_var, q.running_var), step
    a.eval(), b.eval()
    ca, cb = tq.convert(copy.deepcopy(a)), Q.convert(copy.deepcopy(b))
    for name in ("module.0", "module.3", "module.6"):
        assert torch.equal(ca.get_submodule(name).weight().int_repr(), cb.get_submodule(name).weight().int_repr())
    x = torch.randn(4, 3, 7, 7)
    assert torch.equal(ca(x), cb(x))
