"""Session 40 hostile sweep (hostile40c): fake-quant switch mirrors under pickling, loading, compile, export and meta,
and the graph-mode shared-grid bilinear blend traced.

Before: a prepare_qat_fx model with a bilinear upsample neither exported (``Eq(u0, 1)``, a data-dependent guard) nor
compiled with ``fullgraph=True`` nor ran on meta (the blend read ``fake_quant_enabled[0]``, not the mirror); a module
pickled before the mirror existed failed to compile or to print on meta until one eager forward; a loaded switch of
2 / 255 / 0.5 loaded silently (off for the module, on for torch's fused kernel: FusedMovingAvgObsFakeQuantize
fake-quantized small CPU float32 inputs and passed larger ones through); LearnableFakeQuantize exported with its
observer on failed deep in torch.export ("fake tensor in the exported program constant's list").
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: one thread)

MAKERS = {
    "FakeQuantize": lambda: Q.FakeQuantize(),
    "per-channel": lambda: Q.FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0),
    "Fused": lambda: Q.FusedMovingAvgObsFakeQuantize(),
    "Learnable": lambda: Q.LearnableFakeQuantize(),
}


def _old_pickle(fq: nn.Module) -> nn.Module:
    """``fq`` as a pickle written before the switch mirror existed (no ``_switch_mirror`` attribute)."""
    fq = copy.deepcopy(fq)
    del fq.__dict__["_switch_mirror"]
    return pickle.loads(pickle.dumps(fq))


@pytest.mark.parametrize("kind", MAKERS)
def test_old_pickle_compiles_before_any_eager_forward(kind):
    """Before: torch.compile(fullgraph=True) of the unpickled module raised ("no Python mirror to trace with")."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    fq = MAKERS[kind]()
    fq(x)
    fq.disable_observer()
    old = _old_pickle(fq)
    assert old._switch_mirror == {k: bool(getattr(fq, k)[0] == 1) for k in old._SWITCHES}
    expected = copy.deepcopy(fq)(x)
    assert torch.equal(torch.compile(old, backend="eager", fullgraph=True)(x), expected)


@pytest.mark.parametrize("kind", MAKERS)
def test_old_pickle_on_meta_prints_and_runs(kind):
    """Before: repr / forward of an old pickle moved to meta raised RuntimeError (no mirror, no values)."""
    x = torch.randn(4, 8)
    fq = MAKERS[kind]()
    fq(x)
    old = _old_pickle(fq).to("meta")
    assert "fake_quant_enabled=1" in repr(old)
    assert old(x.to("meta")).shape == x.shape


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("name", ["observer_enabled", "fake_quant_enabled"])
@pytest.mark.parametrize("value", [torch.tensor([2], dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8),
                                   torch.tensor([-1]), torch.tensor([0.5]), torch.tensor([float("nan")])],
                         ids=["2", "255", "-1", "0.5", "nan"])
def test_a_switch_other_than_0_or_1_is_refused(kind, name, value):
    """Before: loaded silently (the forward's `== 1` read 2 as off, torch's fused kernel as on; 0.5 cast to 0)."""
    fq = MAKERS[kind]()
    fq(torch.randn(4, 8))
    sd = fq.state_dict()
    sd[name] = value
    before = copy.deepcopy(fq.state_dict())
    shown = value.item()
    with pytest.raises(RuntimeError, match=rf"{name}={shown!r} .* is not a switch: expected 0 \(off\) or 1 \(on\)"):
        fq.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in fq.state_dict().items())


@pytest.mark.parametrize("value", [0, 1, 0.0, 1.0, True, False])
def test_switches_0_and_1_of_any_real_dtype_load(value):
    fq = Q.FakeQuantize()
    sd = fq.state_dict()
    sd["observer_enabled"] = torch.tensor([value])
    fq.load_state_dict(sd)
    assert fq.observer_enabled.tolist() == [int(value)] and fq._switch_mirror["observer_enabled"] == bool(value)


@pytest.mark.parametrize("name", ["observer_enabled", "fake_quant_enabled"])
def test_fused_kernel_reads_the_switch_as_the_module_does(name):
    """A switch written to 2 in place: FakeQuantize's `== 1` reads it as off (torch.ao's FakeQuantize too). Before,
    torch's fused kernel (any non-zero is on) observed / fake-quantized there while the composite path (and a compiled
    call) did not: the output depended on the input's size."""
    torch.manual_seed(0)
    x = torch.randn(64) * 3
    fq = Q.FusedMovingAvgObsFakeQuantize()
    fq(torch.randn(64))
    getattr(fq, name)[0] = 2
    kernel, composite = copy.deepcopy(fq), copy.deepcopy(fq)
    composite._use_torch_kernel = False
    y_kernel, y_composite = kernel(x), composite(x)
    assert torch.equal(y_kernel, y_composite)
    assert torch.equal(kernel.scale, composite.scale)
    assert torch.equal(kernel.activation_post_process.min_val, composite.activation_post_process.min_val)
    if name == "fake_quant_enabled":
        assert torch.equal(y_kernel, x)


def test_learnable_export_with_the_observer_on_names_the_fix():
    """Before: torch.export failed deep inside ("We found a fake tensor in the exported program constant's list")."""
    x = torch.randn(4, 8)
    fq = Q.LearnableFakeQuantize()
    fq(x)
    with pytest.raises(RuntimeError, match=r"LearnableFakeQuantize: torch.export with the observer on.*disable_observer"):
        torch.export.export(fq, (x,))
    fq.disable_observer()
    assert torch.equal(torch.export.export(fq, (x,)).module()(x), copy.deepcopy(fq)(x))


class _Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 5, 3, padding=1), nn.Conv2d(5, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.interpolate(self.c1(x), scale_factor=2, mode="bilinear"))


def _qat_up(x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_qat_fx(_Up().train(), Q.get_default_qat_qconfig_mapping(), example_inputs=(x,))
    p(x)
    return p


@pytest.mark.parametrize("observe", [True, False])
def test_qat_graph_with_shared_grid_upsample_exports_and_compiles(observe):
    """The grid_blend node read ``fake_quant_enabled[0]`` (a data-dependent branch): before, torch.export raised
    GuardOnDataDependentSymNode (Eq(u0, 1)) and torch.compile(fullgraph=True) 'Data-dependent branching'. Now both
    equal the eager prepared model (state included), and flipping the switch recompiles."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 7)
    p = _qat_up(x)
    if not observe:
        p.apply(Q.disable_observer)
    eager, exported, compiled = copy.deepcopy(p), copy.deepcopy(p), copy.deepcopy(p)
    y = eager(x)
    assert torch.equal(torch.export.export(exported, (x,)).module()(x), y)
    c = torch.compile(compiled, backend="eager", fullgraph=True)
    assert torch.equal(c(x), y)
    compiled.apply(Q.disable_fake_quant)
    eager.apply(Q.disable_fake_quant)
    assert torch.equal(c(x), eager(x))


def test_qat_graph_with_shared_grid_upsample_runs_on_meta():
    """Before: Tensor.item() cannot be called on meta tensors (the blend's switch read)."""
    x = torch.randn(2, 3, 6, 7)
    p = _qat_up(x).to("meta")
    assert p(x.to("meta")).shape == (2, 4, 12, 14)


@pytest.mark.parametrize("scale, zero_point, match", [
    (0.0, 0, r"scale=0.0 must be a positive finite number"),
    (float("nan"), 0, r"scale=nan must be a positive finite number"),
    (-0.1, 0, r"scale=-0.1 must be a positive finite number"),
    (0.1, 300, r"zero_point=300 must be an integer in \[0, 255\]"),
    (0.1, 0.5, r"zero_point=0.5 must be an integer in \[0, 255\]"),
    (torch.tensor([0.1, 0.2]), 0, r"scale of shape \(2,\) is not per tensor"),
    (0.1, torch.tensor([0, 0]), r"zero_point of shape \(2,\) is not per tensor"),
])
def test_bilinear_per_tensor_refuses_a_bad_grid_as_quantize_per_tensor_does(scale, zero_point, match):
    """Before: scale 0 / -0.1 gave all zeros, NaN gave NaN, zero points 300 / 0.5 values off the grid (silently), a
    (2,) grid 'shape [] is invalid for input of size 2'; quantize_per_tensor refuses each, naming the value."""
    from lowbit.reference.ops import bilinear_per_tensor

    x = torch.rand(1, 2, 3, 3)
    y = F.interpolate(x, scale_factor=2, mode="bilinear")
    with pytest.raises(ValueError, match=match):
        bilinear_per_tensor(x, y, scale, zero_point, 0, 255, None, 2)


class _EagerUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 5, 3, padding=1), nn.Conv2d(5, 4, 1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.up(self.c1(x)))


def test_eager_qat_shared_grid_upsample_exports_and_runs_on_meta():
    """The eager shared-grid mode reads the same switch: before, torch.export raised GuardOnDataDependentSymNode
    (Eq(u0, 1)) and a meta forward 'Tensor.item() cannot be called on meta tensors'."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 7)
    m = _EagerUp().train()
    m.qconfig = Q.get_default_qat_qconfig()
    p = Q.prepare_qat(m)
    p(x)
    assert torch.equal(torch.export.export(copy.deepcopy(p), (x,)).module()(x), copy.deepcopy(p)(x))
    assert copy.deepcopy(p).to("meta")(x.to("meta")).shape == (2, 4, 12, 14)


def test_convert_fx_of_a_pickled_prepared_graph_says_what_was_lost():
    """Before: 'expects a model returned by prepare_fx or prepare_qat_fx, got GraphModule' for the model prepare_fx
    returned, pickled (the GraphModule is rebuilt from its code); now the message names the cause and the way out,
    and that way out converts to the same model."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(_Up().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        p(x)
        old = copy.deepcopy(p)  # (session 41: a pickle carries the prepare state; one from before did not)
        from lowbit.fx.state import uncarry
        uncarry(old)
        with pytest.raises(TypeError, match=r"got GraphModule: a GraphModule with observers but no prepare state"):
            Q.convert_fx(pickle.loads(pickle.dumps(old)))
        fresh = Q.prepare_fx(_Up().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        fresh.load_state_dict(pickle.loads(pickle.dumps(p)).state_dict())
        assert torch.equal(Q.convert_fx(fresh)(x), Q.convert_fx(copy.deepcopy(p))(x))
