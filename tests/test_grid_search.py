"""``algorithms.grid_search.refine_grids``: activation steps searched on the model's output error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.algorithms.grid_search import refine_grids
from lowbit.observer.fixed import FixedQParamsObserver

from helpers import observer_output_error


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.a(x))
        y = y + self.b(y)
        return self.fc(y.mean((2, 3)))


def _prepared(seed: int = 0):
    torch.manual_seed(seed)
    model = Net().eval()
    with torch.no_grad():
        # one channel of large values that nothing downstream reads: the tensor's MSE range serves it, the output
        # wants the other channels' resolution
        model.a.weight[0] *= 8
        model.b.weight[:, 0] = 0
        model.b.weight[0] = 0
        model.fc.weight[:, 0] = 0
    x = torch.randn(16, 3, 8, 8)
    p = Q.prepare_fx(model, Q.QConfigMapping().set_global(Q.get_accurate_qconfig()), example_inputs=(x,))
    with torch.no_grad():
        p(x)
    return model, p, x


def test_searched_errors_match_the_whole_model_and_the_grids_are_pinned():
    _, p, x = _prepared()
    qparams = {n: tuple(float(v) for v in m.calculate_qparams()) for n, m in p.named_modules()
               if isinstance(m, Q.ObserverBase) and not isinstance(m, FixedQParamsObserver)}
    changes = refine_grids(p, [x], top=3, progress=False)
    assert len(changes) == 3
    mods = dict(p.named_modules())
    for c in changes:
        s0, z = qparams[c.name]
        assert c.scale_before == pytest.approx(s0)
        # the suffix reruns agree with the whole model run with only this grid quantizing
        assert c.error_before == pytest.approx(observer_output_error(p, x, c.name, s0, int(z)), rel=1e-6)
        assert c.error_after == pytest.approx(observer_output_error(p, x, c.name, c.scale_after, int(z)), rel=1e-6)
        assert c.error_after <= c.error_before
        if c.scale_after != c.scale_before:
            obs = mods[c.name]
            assert isinstance(obs, FixedQParamsObserver)
            assert float(obs.scale) == pytest.approx(c.scale_after) and int(obs.zero_point) == int(z)
    assert any(c.scale_after < c.scale_before for c in changes)


def test_samples_span_batches_and_only_restricts_the_grids():
    _, p, x = _prepared()
    everything = [c.source for c in refine_grids(_prepared()[1], [x], top=10, mults=(1.0,), progress=False)]
    assert len(everything) >= 3
    scales = {n: float(m.calculate_qparams()[0]) for n, m in p.named_modules() if isinstance(m, Q.ObserverBase)}
    # 12 samples from batches of 5: the first two batches and two samples of the third, as one search batch
    changes = refine_grids(p, list(x.split(5)), top=10, samples=12, only=everything[1:], progress=False)
    assert [c.source for c in changes] == everything[1:]
    for c in changes:
        assert c.scale_before == pytest.approx(scales[c.name])
        z = int(dict(p.named_modules())[c.name].calculate_qparams()[1])
        assert c.error_after == pytest.approx(observer_output_error(p, x[:12], c.name, c.scale_after, z), rel=1e-6)


def test_quantize_ptq_refine_runs_the_step_and_converts():
    model, _, x = _prepared(1)
    calib = list(x.split(8))
    q, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=5, refine=2, progress=False)
    assert [s for s, _ in report.steps][:4] == ["fuse", "equalize", "calibrate", "refine grids"]
    with torch.no_grad():
        ref, out = model(x), q(x)
    assert 10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()) > 15


@pytest.mark.parametrize("kw, match", [(dict(top=-1), "top=-1"), (dict(top=True), "top=True"),
                                       (dict(mults=(0.5, 1.5)), "1.5"), (dict(mults=()), "mults"),
                                       (dict(samples=-1), "samples=-1")])
def test_bad_arguments_name_the_value(kw, match):
    _, p, x = _prepared()
    with pytest.raises(ValueError, match=match):
        refine_grids(p, [x], progress=False, **kw)
    with pytest.raises(TypeError, match="only='a'"):
        refine_grids(p, [x], only="a", progress=False)


def test_bad_model_and_batches():
    model, p, x = _prepared()
    with pytest.raises(TypeError, match="Net"):
        refine_grids(model, [x], progress=False)
    with pytest.raises(ValueError, match="empty"):
        refine_grids(p, [], progress=False)
    with pytest.raises(ValueError, match="refine=-2"):
        Q.quantize_ptq(model, [x], recipe="accurate", refine=-2, progress=False)


@pytest.mark.parametrize("samples, pulled", [(0, 1), (5, 1), (6, 2), (12, 3), (100, 4)])
def test_reads_only_the_batches_it_searches(samples: int, pulled: int):
    """A generator of batches is read only as far as the search needs (the first batch, or enough for ``samples``),
    and what it reads gives the same search as the list."""
    _, p, x = _prepared()
    seen: list[int] = []

    def gen():
        for i, b in enumerate(x[:20].split(5)):
            seen.append(i)
            yield b

    changes = refine_grids(_prepared()[1], gen(), top=3, samples=samples, progress=False)
    assert len(seen) == pulled
    assert changes == refine_grids(p, list(x[:20].split(5)), top=3, samples=samples, progress=False)
