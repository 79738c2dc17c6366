"""Cross-layer equalization of eager models (``lowbit.algorithms.equalize_eager``): torch.ao parity,
depthwise pairs, pairs found by hooks and checked on the example inputs, bad input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms.equalize_eager import channel_ranges, equalize, find_pairs


@pytest.fixture(autouse=True)
def _seed():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.r1 = nn.Conv2d(3, 8, 3), nn.ReLU()
        self.c2, self.r2 = nn.Conv2d(8, 6, 1), nn.ReLU()
        self.c3 = nn.Conv2d(6, 4, 1)
        self.l1, self.l2 = nn.Linear(4 * 5 * 5, 16), nn.Linear(16, 5)
        with torch.no_grad():  # channels on very different scales: what equalization is for
            self.c1.weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
            self.l1.weight.mul_(torch.logspace(-1, 1, 16).view(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c3(self.r2(self.c2(self.r1(self.c1(x)))))
        return self.l2(self.l1(y.flatten(1)))


def test_same_weights_as_torch_ao():
    from torch.ao.quantization._equalize import equalize as ao_equalize

    model = Net().eval()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    ao_equalize(theirs, [["c1", "c2", "c3"], ["l1", "l2"]], 1e-4, inplace=True)
    out = equalize(ours, [["c1", "c2", "c3"], ["l1", "l2"]], 1e-4, progress=False)
    assert out is ours
    for name in ("c1", "c2", "c3", "l1", "l2"):
        a, b = ours.get_submodule(name), theirs.get_submodule(name)
        assert torch.allclose(a.weight, b.weight, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(a.bias, b.bias, rtol=1e-5, atol=1e-6), name
    assert not torch.equal(ours.c1.weight, model.c1.weight)  # it did something
    x = torch.randn(2, 3, 7, 7)
    assert torch.allclose(ours(x), model(x), rtol=1e-4, atol=1e-5)


def test_modules_as_pairs_and_not_inplace():
    model = Net().eval()
    out = equalize(model, [[model.l1, model.l2]], inplace=False, progress=False)
    assert out is not model and not torch.equal(out.l1.weight, model.l1.weight)
    r1, r2 = channel_ranges(out.l1.weight, 0), channel_ranges(out.l2.weight, 1)
    assert torch.allclose(r1, r2, rtol=1e-3)  # converged: both sides of every channel have one range


def test_depthwise_pair_absmax_equal_ranges():
    model = nn.Sequential(nn.Conv2d(4, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 2, 1)).eval()
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
    x = torch.randn(2, 4, 6, 6)
    ref = model(x)
    equalize(model, [["0", "2", "3"]], ranges="absmax", progress=False)
    assert torch.allclose(model(x), ref, rtol=1e-4, atol=1e-5)
    r_a, r_b = channel_ranges(model[0].weight, 0, "absmax"), channel_ranges(model[2].weight, 0, "absmax")
    assert float(r_a.max() / r_a.min()) < 30 and torch.allclose(r_a, r_b, rtol=0.05)  # spread was ~1000x


class Residual(nn.Module):
    """c1 -> ReLU -> c2 is a pair; c2's output is also added to the input (invisible to hooks): not a pair;
    c3 -> ReLU6 -> c4 is not scale-equivariant: not a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.r1, self.c2 = nn.Conv2d(4, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1)
        self.c3, self.r6, self.c4 = nn.Conv2d(4, 8, 1), nn.ReLU6(), nn.Conv2d(8, 4, 1)
        self.c5 = nn.Conv2d(4, 4, 1)
        with torch.no_grad():
            for c in (self.c1, self.c3):
                c.weight.mul_(torch.logspace(-1, 1, 8).view(8, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.c2(self.r1(self.c1(x)))
        z = self.c4(self.r6(self.c3(y)))
        return self.c5(z) + z


def test_found_pairs_keep_the_function():
    model = Residual().eval()
    x = torch.randn(2, 4, 5, 5)
    ref, c1, c4 = model(x), model.c1.weight.clone(), model.c4.weight.clone()
    assert find_pairs(model, (x,)) == [("c1", "c2"), ("c4", "c5")]  # candidates; c4 -> c5 fails the check
    equalize(model, example_inputs=(x,), progress=False)
    assert torch.allclose(model(x), ref, rtol=1e-4, atol=1e-5)
    assert not torch.equal(model.c1.weight, c1) and torch.equal(model.c4.weight, c4)  # c1 -> c2 only


def test_fused_model_equalize_then_quantize_is_more_accurate():
    """Per-tensor weight grids (where equalization pays): the quantized output gets closer to float."""
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 8, 1), Q.DeQuantStub()).eval()
    with torch.no_grad():
        d = torch.logspace(-2, 1, 16)  # a badly conditioned but equivalent form of a plain net
        model[1].weight.mul_(d.view(16, 1, 1, 1))
        model[1].bias.mul_(d)
        model[3].weight.div_(d.view(1, 16, 1, 1))
    x = torch.randn(16, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    qc = Q.QConfig(activation=Q.MinMaxObserver.with_args(qdtype=Q.quint8), weight=Q.MinMaxObserver.with_args(
        qdtype=Q.qint8, qscheme=Q.per_tensor_symmetric))

    def sqnr(m: nn.Module) -> float:
        m = copy.deepcopy(m)
        m.qconfig = qc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = Q.prepare(m)
            p(x)
            q = Q.convert(p)
        with kernels.use_backend("reference"), torch.no_grad():
            out = q(x)
        return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))

    fused = Q.fuse_modules(copy.deepcopy(model), [["1", "2"]])
    assert find_pairs(fused, (x,)) == [("1", "3")]
    eq = equalize(fused, example_inputs=(x,), inplace=False, progress=False)
    assert torch.allclose(eq(x), ref, rtol=1e-4, atol=1e-4)
    before, after = sqnr(fused), sqnr(eq)
    assert after > before + 3, (before, after)


def test_bad_input():
    model = Net().eval()
    with pytest.raises(ValueError, match="no module named 'nope'"):
        equalize(model, [["c1", "nope"]])
    with pytest.raises(ValueError, match="at least two"):
        equalize(model, [["c1"]])
    with pytest.raises(ValueError, match="output channels"):
        equalize(model, [["c1", "c3"]])
    with pytest.raises(TypeError, match="r1 is a ReLU"):
        equalize(model, [["r1", "c2"]])
    with pytest.raises(ValueError, match="threshold"):
        equalize(model, [["c1", "c2"]], threshold=-1.0)
    with pytest.raises(ValueError, match="example_inputs"):
        equalize(model)
    with pytest.raises(ValueError, match="ranges"):
        equalize(model, [["c1", "c2"]], ranges="mean")
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        find_pairs(model, torch.randn(1, 3, 7, 7))
    fused = Q.fuse_modules(nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU6(), nn.Conv2d(4, 2, 1)).eval(), [["0", "1"]])
    with pytest.raises(ValueError, match="not scale-equivariant"):
        equalize(fused, [["0", "2"]])
