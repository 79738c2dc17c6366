"""Session 41 (mpbn41): BatchNorm folding of layers graph mode keeps float, and the fast search's rows.

torch.ao's ``prepare_fx`` fuses conv-BN(-ReLU) / linear-BN whatever the qconfig: an eval-mode run under a ``None``
qconfig becomes the float fused module (``nni.ConvReLU2d`` or the plain layer, the BN folded), and a train-mode
(QAT) one the float ``nni.ConvBnReLU2d`` / ``nni.ConvBn2d``, which ``convert_fx`` leaves as it is. ``lowbit`` left
such a run unfused (conv, BN, ReLU as three float modules), while ``search="fast"``'s float copy of the layer is the
prepared, folded one: about 2.4e-7 apart, which with histogram observers moved a zero point downstream and put the
reported rows up to 0.04 dB off the built model (SmallCNN ``conv1``: 41.444 reported, 41.481 built).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.nn import intrinsic as ao_nni
from torch.ao.quantization import get_default_qat_qconfig_mapping as ao_qat_mapping
from torch.ao.quantization import get_default_qconfig_mapping as ao_mapping
from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx
from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare_qat_fx

import lowbit as Q
from lowbit import kernels
from lowbit.debug import auto_mixed_precision
from lowbit.debug.table import keep_float
from lowbit.examples import SmallCNN
from lowbit.nn import intrinsic as nni
from lowbit.ptq import _sqnr


@pytest.fixture(autouse=True)
def _seed():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


def _random_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics and affine parameters (a fresh BN folds to the identity: nothing to see)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 2 - 1)
            m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(n, generator=g) - 0.5)
    return model


class Net(nn.Module):
    """conv-bn-relu, conv-bn-relu, conv-bn, linear-bn1d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
        self.lin, self.bnl = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        return self.bnl(self.lin(x.mean((2, 3))))


def _types(gm: nn.Module) -> dict[str, type]:
    return {str(n.target): type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes
            if n.op == "call_module" and "post_process" not in str(n.target)}


_EXPECT = {"conv1": (nni.ConvReLU2d, ao_nni.ConvReLU2d), "conv2": (nni.ConvReLU2d, ao_nni.ConvReLU2d),
           "conv3": (nn.Conv2d, nn.Conv2d), "lin": (nn.Linear, nn.Linear)}


def _quiet():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("ignore")
    return w


@pytest.mark.parametrize("name", ["conv1", "conv2", "conv3", "lin"])
def test_eval_float_layer_is_folded_as_torch_ao_folds_it(name):
    """Before: lowbit's prepared model kept ``conv``, ``bn``, ``relu`` as three float modules where torch.ao has one
    fused float module with the BN folded; now the same module kinds, and the converted float layer computes torch.ao's
    converted float layer bit for bit (both fold with the same formula)."""
    model = _random_bn(Net()).eval()
    x = torch.randn(4, 3, 10, 10)
    w = _quiet()
    try:
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping().set_module_name(name, None),
                         example_inputs=(x,))
        ap = ao_prepare_fx(copy.deepcopy(model), ao_mapping("fbgemm").set_module_name(name, None), (x,))
    finally:
        w.__exit__(None, None, None)
    ours, theirs = _types(p)[name], _types(ap)[name]
    assert ours is _EXPECT[name][0] and theirs is _EXPECT[name][1], (ours, theirs)
    assert not {"bn1", "bn2", "bn3", "bnl", "relu1", "relu2"} & set(_types(p))  # every BN folded, every ReLU fused
    p(x)
    ap(x)
    q, aq = Q.convert_fx(p), ao_convert_fx(ap)
    assert type(q.get_submodule(name)) is _EXPECT[name][0]
    assert type(aq.get_submodule(name)) is _EXPECT[name][1]
    mine, theirs_mod = q.get_submodule(name), aq.get_submodule(name)
    inp = torch.randn(4, 3, 10, 10) if name == "conv1" else (torch.randn(4, 8) if name == "lin" else torch.randn(4, 8, 9, 9))
    assert torch.equal(mine(inp), theirs_mod(inp))


@pytest.mark.parametrize("name", ["conv1", "conv3"])
def test_qat_float_layer_keeps_a_live_bn_as_torch_ao(name):
    """torch.ao's prepare_qat_fx makes an excluded train-mode conv-BN(-ReLU) the float ``nni.ConvBn(ReLU)2d`` (the BN
    trains on batch statistics) and convert_fx keeps it; lowbit now does the same, with the same outputs."""
    model = _random_bn(Net()).train()
    x = torch.randn(4, 3, 10, 10)
    w = _quiet()
    try:
        p = Q.prepare_qat_fx(copy.deepcopy(model), Q.get_default_qat_qconfig_mapping().set_module_name(name, None),
                             example_inputs=(x,))
        ap = ao_prepare_qat_fx(copy.deepcopy(model), ao_qat_mapping("fbgemm").set_module_name(name, None), (x,))
    finally:
        w.__exit__(None, None, None)
    want = {"conv1": (nni.ConvBnReLU2d, ao_nni.ConvBnReLU2d), "conv3": (nni.ConvBn2d, ao_nni.ConvBn2d)}[name]
    assert (_types(p)[name], _types(ap)[name]) == want
    inp = torch.randn(4, 3, 10, 10) if name == "conv1" else torch.randn(4, 8, 6, 6)
    mine, theirs = copy.deepcopy(p.get_submodule(name)), copy.deepcopy(ap.get_submodule(name))
    assert torch.equal(mine(inp), theirs(inp))  # train mode: batch statistics, which both update
    assert torch.equal(mine.eval()(inp), theirs.eval()(inp))
    p.eval()  # (calibrated in eval: the running statistics stay those of the model)
    ap.eval()
    p(x)
    ap(x)
    q, aq = Q.convert_fx(p), ao_convert_fx(ap)
    assert (type(q.get_submodule(name)), type(aq.get_submodule(name))) == want
    assert torch.equal(q.get_submodule(name)(inp), aq.get_submodule(name)(inp))


def test_excluded_run_with_relu6_keeps_the_clamp_float():
    """torch.ao does not fuse ReLU6: the float conv-BN folds, the ReLU6 stays a float module (no qconfig), which the
    mixed-precision equalization of a float clamp pair reads."""
    model = _random_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU6(), nn.Conv2d(8, 4, 1))).eval()
    x = torch.randn(4, 3, 8, 8)
    w = _quiet()
    try:
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping().set_module_name("0", None),
                         example_inputs=(x,))
    finally:
        w.__exit__(None, None, None)
    types = _types(p)
    assert types["0"] is nn.Conv2d and types["2"] is nn.ReLU6 and "1" not in types
    assert p.get_submodule("2").qconfig is None
    p(x)
    q = Q.convert_fx(p)
    assert torch.allclose(q(x), model(x), atol=0.05)


def _built(model, x, ref, names, op_keys):
    mapping = Q.get_default_qconfig_mapping()
    for n in names:
        keep_float(mapping, n, op_keys)
    w = _quiet()
    try:
        with torch.no_grad():
            p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
            p(x)
            return _sqnr(ref, Q.convert_fx(p)(x))
    finally:
        w.__exit__(None, None, None)


def test_fast_search_rows_with_bn_are_the_built_models():
    """Before: SmallCNN (conv-BN-ReLU blocks) with histogram observers, the ``conv1`` row 41.444 dB against 41.481 for
    the model built with ``conv1`` float; now every row and the final metric are the built model's."""
    model = _random_bn(SmallCNN()).eval()
    x = torch.randn(32, 1, 28, 28)
    ref = model(x).detach()
    with kernels.use_backend("reference"):
        _, table = auto_mixed_precision(model, Q.get_default_qconfig_mapping(), [x], lambda m: _sqnr(ref, m(x)),
                                        max_float_layers=3, mode="fx", search="fast", progress=False)
        rows = {r.name: r.metric for r in table.rows}
        assert {"conv1", "conv2", "conv3"} <= set(rows)
        for name in ("conv1", "conv2", "conv3", "fc1"):
            assert rows[name] == pytest.approx(_built(model, x, ref, [name], table.op_keys), abs=1e-6), name
        assert table.final_metric == pytest.approx(_built(model, x, ref, table.float_layers, table.op_keys), abs=1e-6)


def test_quantize_ptq_max_float_layers_report_is_the_built_model_with_bn():
    model = _random_bn(SmallCNN()).eval()
    x = torch.randn(32, 1, 28, 28)
    ref = model(x).detach()
    with kernels.use_backend("reference"):
        q, report = Q.quantize_ptq(model, [x], recipe="default", max_float_layers=2, progress=False)
        with torch.no_grad():
            returned = _sqnr(ref, q(x))
        assert report.sqnr_db == pytest.approx(returned, abs=1e-6)
        assert report.sqnr_db == pytest.approx(_built(model, x, ref, report.float_layers, report.op_keys), abs=1e-6)


@pytest.mark.parametrize("kind", ["conv", "linear", "convtranspose"])
def test_eager_fold_is_torch_aos_bit_for_bit(kind):
    """The eval fold computes ``gamma * rsqrt(var + eps)`` in torch.ao's order (it divided by ``sqrt``: weights one
    float32 ulp off torch.ao's, which can move a weight code)."""
    from torch.ao.quantization import fuse_modules as ao_fuse_modules

    layer, bn = {"conv": (nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), "linear": (nn.Linear(5, 8), nn.BatchNorm1d(8)),
                 "convtranspose": (nn.ConvTranspose2d(3, 8, 3), nn.BatchNorm2d(8))}[kind]
    model = _random_bn(nn.Sequential(layer, bn)).eval()
    ours, theirs = Q.fuse_modules(copy.deepcopy(model), [["0", "1"]]), ao_fuse_modules(copy.deepcopy(model), [["0", "1"]])
    assert torch.equal(ours[0].weight, theirs[0].weight) and torch.equal(ours[0].bias, theirs[0].bias)
