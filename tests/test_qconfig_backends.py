"""``get_default_qconfig(backend)`` / ``get_default_qat_qconfig(backend, version)`` / the mappings: torch.ao's
signatures and recipes (torch.ao's qconfigs are the oracle: observer classes, grids, schemes, and the
qparams they compute on the same data), the no-argument defaults unchanged, bad arguments named."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.quantization as aoq
from torch.ao.quantization.utils import calculate_qmin_qmax

import lowbit as Q

BACKENDS = ["x86", "fbgemm", "onednn", "qnnpack"]
pytestmark = pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")  # torch.ao's own reduce_range


def _ao(factory):
    with warnings.catch_warnings():  # torch.ao's onednn recipe warns on CPUs without VNNI
        warnings.simplefilter("ignore")
        return factory()


def _ao_range(obs) -> tuple[int, int]:
    if obs.has_customized_qrange:  # torch.ao already applied reduce_range to a given quant_min/quant_max
        return obs.quant_min, obs.quant_max
    return calculate_qmin_qmax(obs.quant_min, obs.quant_max, obs.has_customized_qrange, obs.dtype, obs.reduce_range)


def _same_observer(lb, ao, data: list[torch.Tensor], exact: bool = True) -> None:
    """Same class, grid, scheme, axis and averaging constant; with ``exact`` the same qparams on ``data``."""
    assert type(lb).__name__ == type(ao).__name__
    assert (lb.qdtype.quant_min, lb.qdtype.quant_max) == _ao_range(ao)
    assert lb.qdtype.storage == {torch.quint8: torch.uint8, torch.qint8: torch.int8}[ao.dtype]
    assert lb.qscheme.value == str(ao.qscheme).removeprefix("torch.")
    if "per_channel" in lb.qscheme.value:
        assert lb.ch_axis == ao.ch_axis
    if hasattr(ao, "averaging_constant"):
        assert lb.averaging_constant == ao.averaging_constant
    if exact:
        for x in data:
            lb(x)
            ao(x)
        (s1, z1), (s2, z2) = lb.calculate_qparams(), ao.calculate_qparams()
        torch.testing.assert_close(s1.float().reshape(-1), s2.float().reshape(-1), rtol=0, atol=0)
        assert torch.equal(z1.long().reshape(-1), z2.long().reshape(-1))


def _data(weight: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    if weight:
        return [torch.randn(16, 8, generator=g) * torch.rand(16, 1, generator=g)]
    return [torch.randn(4, 8, generator=g) * 3 + 1 for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_qconfig_matches_torch_ao(backend):
    lb, ao = Q.get_default_qconfig(backend), _ao(lambda: aoq.get_default_qconfig(backend))
    # HistogramObserver: same class and grid; lowbit's range search is its own (tests/test_observer_histogram.py)
    _same_observer(lb.activation(), ao.activation(), _data(False), exact=False)
    _same_observer(lb.weight(), ao.weight(), _data(True))


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_qat_qconfig_matches_torch_ao(backend, version):
    lb, ao = Q.get_default_qat_qconfig(backend, version), _ao(lambda: aoq.get_default_qat_qconfig(backend, version))
    for side, weight in (("activation", False), ("weight", True)):
        fl, fa = getattr(lb, side)(), getattr(ao, side)()
        assert type(fl).__name__ == type(fa).__name__
        _same_observer(fl.activation_post_process, fa.activation_post_process, _data(weight))


def test_no_argument_defaults_are_unchanged():
    # lowbit's own recipes (8-bit activations), not torch.ao's no-argument x86 default
    assert repr(Q.get_default_qconfig()) == (
        "QConfig(activation=HistogramObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8), "
        "weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8))")
    assert repr(Q.get_default_qat_qconfig()) == (
        "QConfig(activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine, "
        "qdtype=quint8), weight=FakeQuantize.with_args(observer=PerChannelMinMaxObserver, ch_axis=0, "
        "qscheme=per_channel_symmetric, qdtype=qint8))")
    assert repr(Q.get_default_qconfig_mapping().global_qconfig) == repr(Q.get_default_qconfig())
    assert repr(Q.get_default_qat_qconfig_mapping().global_qconfig) == repr(Q.get_default_qat_qconfig())
    assert Q.get_default_qconfig("onednn").activation().qdtype == Q.quint8


def test_mappings_take_the_backend():
    assert Q.get_default_qconfig_mapping("x86").global_qconfig.activation().qdtype == Q.quint8.with_range(0, 127)
    fq = Q.get_default_qat_qconfig_mapping("fbgemm", 0).global_qconfig.activation()
    assert type(fq).__name__ == "FakeQuantize" and fq.qdtype.quant_max == 127


@pytest.mark.parametrize("call, match", [
    (lambda: Q.get_default_qconfig("avx2"), "get_default_qconfig: backend='avx2' is not supported"),
    (lambda: Q.get_default_qconfig("X86"), "backend='X86'"),
    (lambda: Q.get_default_qconfig(86), "backend=86"),
    (lambda: Q.get_default_qconfig("x86", 1), "get_default_qconfig: version=1 is not supported"),
    (lambda: Q.get_default_qconfig(None, 2), "version=2"),
    (lambda: Q.get_default_qat_qconfig("arm"), "get_default_qat_qconfig: backend='arm'"),
    (lambda: Q.get_default_qat_qconfig("x86", 2), "get_default_qat_qconfig: version=2"),
    (lambda: Q.get_default_qat_qconfig("x86", True), "version=True"),
    (lambda: Q.get_default_qconfig_mapping("tpu"), "backend='tpu'"),
    (lambda: Q.get_default_qat_qconfig_mapping("x86", 7), "version=7"),
])
def test_bad_backend_or_version_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_x86_recipe_converts_to_one_call_grid():
    # the x86 recipe's activations land on the 7-bit grid the onednn backend runs in one exact call
    torch.manual_seed(0)
    m = torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(8, 4), Q.DeQuantStub()).eval()
    prep = Q.prepare(m, Q.get_default_qconfig("x86"))
    prep(torch.randn(16, 8))
    q = Q.convert(prep)
    assert q[0].qdtype.quant_max == 127 and q[1].out_qdtype.quant_max == 127
