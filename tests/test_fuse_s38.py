"""Fusion and BatchNorm folding (session 38 sweep): eager fuse_modules / fuse_modules_qat and graph-mode fusion on
unusual layers, BatchNorms and hooks. Oracles: the unfused model in float64 ("fusion keeps the float function") and
torch.ao's fuse_modules; each test failed before its fix."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fx import fuse_fx, prepare_fx, prepare_qat_fx


def _bn(bn: nn.Module) -> nn.Module:
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2.0)
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return bn


def _float64(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return copy.deepcopy(model).double()(x.double())


def test_fold_keeps_the_layer_dtype_as_torch_ao():
    """An fp16 conv / Linear followed by an fp32 BN: the folded weight became fp32 (weight · scale promotes) and the
    fused layer refused its fp16 input ("Input type (c10::Half) and bias type (float) should be the same")."""
    torch.manual_seed(0)
    for layer, bn, x in ((nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), torch.randn(2, 3, 7, 7)),
                         (nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6), torch.randn(2, 3, 7, 7)),
                         (nn.ConvTranspose2d(4, 6, 3, groups=2), nn.BatchNorm2d(6), torch.randn(2, 4, 5, 5)),
                         (nn.Linear(4, 6), nn.BatchNorm1d(6), torch.randn(5, 4))):
        m = nn.Sequential(layer.half(), _bn(bn)).eval()
        ours = Q.fuse_modules(m, [["0", "1"]])
        assert ours[0].weight.dtype == ours[0].bias.dtype == torch.float16
        if not isinstance(layer, nn.ConvTranspose2d):  # (torch.ao's transposed fold breaks on groups)
            theirs = tq.fuse_modules(m, [["0", "1"]])
            torch.testing.assert_close(ours[0].weight, theirs[0].weight)  # (fp16 tolerances: fp32 steps differ)
            torch.testing.assert_close(ours[0].bias, theirs[0].bias)
        if not isinstance(layer, nn.Linear):  # (no fp16 addmm on every CPU build)
            y = ours(x.half())
            assert y.dtype == torch.float16
            torch.testing.assert_close(y.double(), _float64(m, x), atol=2e-2, rtol=2e-2)


def test_fold_keeps_requires_grad():
    """A frozen layer came out of the fold trainable (torch.ao keeps the flags). Departure: a bias the fold creates
    follows the weight (torch.ao freezes it, so fine-tuning the fused model left the folded BN shift fixed)."""
    m = nn.Sequential(nn.Conv2d(3, 6, 3), _bn(nn.BatchNorm2d(6))).eval().requires_grad_(False)
    f, t = Q.fuse_modules(m, [["0", "1"]]), tq.fuse_modules(m, [["0", "1"]])
    assert (f[0].weight.requires_grad, f[0].bias.requires_grad) == (t[0].weight.requires_grad,
                                                                     t[0].bias.requires_grad) == (False, False)
    m = nn.Sequential(nn.Linear(4, 6, bias=False), _bn(nn.BatchNorm1d(6))).eval()
    f = Q.fuse_modules(m, [["0", "1"]])
    assert f[0].weight.requires_grad and f[0].bias.requires_grad
    m[0].weight.requires_grad_(False)
    f = Q.fuse_modules(m, [["0", "1"]])
    assert not f[0].weight.requires_grad and not f[0].bias.requires_grad


@pytest.mark.parametrize("layer", [nn.Conv2d(3, 6, 3), nn.Linear(4, 6)])
def test_fuse_modules_qat_refuses_a_bn_of_another_width_at_fuse_time(layer):
    """The QAT markers took a BN whose num_features is not the layer's width; only prepare_qat failed, later
    (torch.ao asserts at fuse time)."""
    m = nn.Sequential(layer, nn.BatchNorm2d(5) if isinstance(layer, nn.Conv2d) else nn.BatchNorm1d(5))
    with pytest.raises(ValueError, match=r"fuse_modules_qat: BatchNorm[12]d\(5\) cannot follow .* 6 output channels"):
        Q.fuse_modules_qat(m, [["0", "1"]])
    with pytest.raises(AssertionError):
        tq.fuse_modules_qat(m, [["0", "1"]])


def test_a_hardtanh_subclass_is_not_fused_as_a_clamp():
    """A user's Hardtanh subclass with its own forward was replaced by the plain [0, t] clamp (wrong values)."""

    class Doubled(nn.Hardtanh):
        def __init__(self) -> None:
            super().__init__(0.0, 1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    m = nn.Sequential(nn.Conv2d(3, 6, 3), Doubled()).eval()
    with pytest.raises(ValueError, match=r"cannot fuse \(Conv2d, Doubled\)"):
        Q.fuse_modules(m, [["0", "1"]])
    m = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Hardtanh(0.0, 1.0)).eval()  # the class itself still fuses
    assert isinstance(Q.fuse_modules(m, [["0", "1"]])[0][1], Q.nn.intrinsic.ClampedReLU)


def _hook_double(mod, inp, out):
    return out * 2


def _pre_hook_double(mod, inp):
    return (inp[0] * 2,)


@pytest.mark.parametrize("act", [nn.ReLU6(), nn.Hardtanh(0.0, 1.5)])
def test_a_clamp_activations_forward_hook_moves_to_the_fused_module(act):
    """ReLU6 / Hardtanh(0, t) become a new ClampedReLU inside the marker, and their forward hooks went with the old
    module, silently (a ReLU's moved): eager and graph mode gave other values than the model."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3), _bn(nn.BatchNorm2d(6)), act).eval()
    m[2].register_forward_hook(_hook_double)
    x = torch.randn(2, 3, 7, 7)
    ref = _float64(m, x)
    eager = Q.fuse_modules(m, [["0", "1", "2"]])
    graph = fuse_fx(m)
    assert isinstance(eager[0], Q.nn.intrinsic.ConvReLU2d)
    assert [type(graph.get_submodule(n.target)) for n in graph.graph.nodes if n.op == "call_module"] == [
        Q.nn.intrinsic.ConvReLU2d]
    for fused in (eager, graph):
        torch.testing.assert_close(fused(x).double(), ref, atol=1e-5, rtol=1e-5)
    m[2]._forward_hooks.clear()
    m[2].register_forward_pre_hook(_pre_hook_double)  # cannot move: eager says so (it was silent)
    with pytest.warns(UserWarning, match=r"forward pre-hooks are not moved"):
        Q.fuse_modules(m, [["0", "1", "2"]])


@pytest.mark.parametrize("where", ["conv forward hook", "bn forward hook", "bn pre-hook", "relu6 pre-hook"])
def test_graph_mode_leaves_a_run_whose_hooks_cannot_move_unfused(where):
    """Graph mode fuses on its own: a forward hook on the conv (it ran on the BN-folded output) or on the BN (dropped),
    a pre-hook on the BN or the activation (dropped) changed the model's values (a warning at most); torch.ao too.
    The run now stops before the hook: the model's values, the rest fused."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3), _bn(nn.BatchNorm2d(6)), nn.ReLU6()).eval()
    part, kind = {"conv forward hook": (0, "post"), "bn forward hook": (1, "post"), "bn pre-hook": (1, "pre"),
                  "relu6 pre-hook": (2, "pre")}[where]
    if kind == "post":
        m[part].register_forward_hook(_hook_double)
    else:
        m[part].register_forward_pre_hook(_pre_hook_double)
    x = torch.randn(2, 3, 7, 7)
    ref = _float64(m, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: no hook left behind
        graph = fuse_fx(m)
    torch.testing.assert_close(graph(x).double(), ref, atol=1e-5, rtol=1e-5)
    kept = {"conv forward hook": ["Conv2d", "BNReLU2d"], "bn forward hook": ["Conv2d", "ReLU6"],
            "bn pre-hook": ["Conv2d", "BNReLU2d"], "relu6 pre-hook": ["Conv2d", "ReLU6"]}[where]
    assert [type(graph.get_submodule(n.target)).__name__ for n in graph.graph.nodes if n.op == "call_module"] == kept
    p = prepare_fx(m, Q.get_default_qconfig(), example_inputs=(x,))
    torch.testing.assert_close(p(x).double(), ref, atol=1e-5, rtol=1e-5)


def test_graph_mode_leaves_a_bn_without_running_stats_unfused():
    """A conv followed by a BN with track_running_stats=False (batch statistics even in eval: nothing to fold) made
    fuse_fx / prepare_fx / prepare_qat_fx refuse the whole model, naming fuse_modules; the BN now stays a float op,
    as in eager mode when the pair is not fused."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6, track_running_stats=False), nn.ReLU())
    x = torch.randn(4, 3, 7, 7)
    for training in (False, True):
        m.train(training)
        graph = fuse_fx(m)
        assert isinstance(graph.get_submodule("0"), nn.Conv2d)
        torch.testing.assert_close(graph(x).double(), _float64(m, x), atol=1e-5, rtol=1e-5)
    p = prepare_fx(m.eval(), Q.get_default_qconfig(), example_inputs=(x,))
    torch.testing.assert_close(p(x).double(), _float64(m, x), atol=1e-5, rtol=1e-5)
    qat = prepare_qat_fx(m.train(), Q.get_default_qat_qconfig(), example_inputs=(x,))
    assert qat(x).shape == (4, 6, 5, 5)
    with pytest.raises(ValueError, match="track_running_stats=False"):  # asked for by name: still refused
        Q.fuse_modules(m.eval(), [["0", "1"]])
