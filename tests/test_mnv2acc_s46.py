"""Session 46 (mnv2acc46): the clamp stretch into a dense reader, part of the way (``equalize_prepared(dense=)``).

A depthwise conv + ReLU6 feeding a 1x1 projection (MobileNetV2's every block): before, ``relu6="range"`` left such
pairs alone (a full stretch comes back as the projection's weight error); now ``dense=α`` scales channel ``i`` by
``s_i^α`` with ``s_i = h m_i / t``, and the accurate recipe uses ``α = 0.5`` (``ptq_steps.DENSE``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.algorithms.equalize import equalize_prepared
from lowbit import ptq_steps


class DwProject(nn.Module):
    """expand 1x1 + ReLU6 -> depthwise 3x3 + ReLU6 -> project 1x1: channels of unlike range after the depthwise."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(4, 8, 1), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6())
        self.project = nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.dw[0].weight.mul_(torch.logspace(-2, -0.5, 8).view(8, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.dw(self.expand(x)))


def _prepared(x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = DwProject().eval()
    mapping = Q.QConfigMapping().set_global(Q.get_accurate_qconfig())
    return model, Q.prepare_fx(model, mapping, example_inputs=(x,))


def _x() -> torch.Tensor:
    return torch.randn(8, 4, 10, 10, generator=torch.Generator().manual_seed(1))


def test_dense_reader_stretched_by_the_power_and_function_kept():
    x = _x()
    model, p = _prepared(x)
    ref = model(x)
    with torch.no_grad():  # the depthwise pre-activation maxima per channel, the stretch's m_i (headroom 1.5)
        pre = model.dw[0](model.expand(x)).amax((0, 2, 3)) * 1.5
    w0 = dict(p.named_modules())["project"].weight.detach().clone()
    recs = {r.first: r for r in equalize_prepared(p, [(x,)], relu6="range", weights=False, dense=0.5)}
    assert set(recs) == {"expand.0", "dw.0"}  # before: the dense pair dw -> project was left alone
    rec = recs["dw.0"]
    ok = (pre > 0) & (pre < 6)
    assert rec.power == 0.5 and rec.stretched == int(ok.sum()) > 0
    s = torch.where(ok, (pre / 6).sqrt(), torch.ones_like(pre))
    torch.testing.assert_close(dict(p.named_modules())["project"].weight, w0 * s.view(1, -1, 1, 1))
    with torch.no_grad():
        y = p(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


def test_dense_zero_leaves_the_dense_pair_alone_bit_for_bit():
    x = _x()
    _, p0 = _prepared(x)
    _, p1 = _prepared(x)
    r0 = equalize_prepared(p0, [(x,)], relu6="range", weights=False)
    r1 = equalize_prepared(p1, [(x,)], relu6="range", weights=False, dense=0.0)
    assert [r.first for r in r0] == [r.first for r in r1] == ["expand.0"]
    for (n, a), (_, b) in zip(p0.state_dict().items(), p1.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("bad", [-0.5, 1.5, float("nan"), True, "0.5"])
def test_bad_dense_named(bad):
    x = _x()
    _, p = _prepared(x)
    with pytest.raises(ValueError, match=r"dense=" + repr(bad).replace("(", r"\(").replace(".", r"\.")):
        equalize_prepared(p, [(x,)], relu6="range", dense=bad)


def test_dense_needs_range():
    x = _x()
    _, p = _prepared(x)
    with pytest.raises(ValueError, match=r"dense=0\.5 needs relu6='range'.*relu6='skip'"):
        equalize_prepared(p, [(x,)], relu6="skip", dense=0.5)


def test_accurate_recipe_stretches_the_dense_pair():
    x = _x()
    torch.manual_seed(0)
    model = DwProject().eval()
    qmodel, report = Q.quantize_ptq(model, [x[:4], x[4:]], recipe="accurate", iters=5, progress=False)
    pairs = {e.first: e for e in report.equalized if hasattr(e, "first")}
    assert "dw.0" in pairs, sorted(pairs)  # before: only expand.0 (the dense pair was left alone)
    assert pairs["dw.0"].power == ptq_steps.DENSE == 0.5 and pairs["dw.0"].stretched > 0
    assert "with a dense reader stretched by s^0.5" in dict(report.steps)["equalize"]
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
    assert float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())) > 20
