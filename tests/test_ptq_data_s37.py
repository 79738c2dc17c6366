"""Session 37: ``quantize_ptq`` and its algorithms swept on the data and options side — calibration data as a list,
tuple, generator, DataLoader (with and without labels), dict / nested / multi-input batches, batches of other sizes,
dtypes, memory formats, NaN / Inf / zero / huge values, train-mode models, dict / tuple outputs, frozen parameters,
options of the wrong type or range, determinism. Each test here failed before its fix.

Found: a model with a second forward argument read after the first one's cut crashed the ``"accurate"`` recipe
(``IndexError`` deep in the block walk: the graph input sat inside a residual span); ``equalize_prepared`` drained a
generator in its first pass (the ReLU6 stretch then saw no data and silently did nothing) and passed a list batch as
one argument, as ``equalize_streams`` did; the eager ``lowbit.equalize`` updated a training model's BatchNorm running
statistics while it looked for pairs; ``best_of_ranges`` / ``smooth_quant`` put every module back in the root's mode
(a frozen BatchNorm of a training model came back training), ``smooth_quant`` left the model in eval mode when it
refused a layer name; a seed past torch's generator range failed deep inside; a labelled DataLoader's ``(x, y)``
batches gave only "takes 2 positional arguments but 3 were given"; a NaN inside a nested input was not named; the
``"balanced"`` recipe's rounding bar said "adaround"."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.algorithms.block import find_blocks
from lowbit.algorithms.best_of import best_of_ranges
from lowbit.algorithms.equalize import equalize_prepared
from lowbit.algorithms.equalize_stream import equalize_streams
from lowbit.algorithms.layerwise import reconstruct
from lowbit.algorithms.smoothquant import smooth_quant

from helpers import one_thread  # noqa: F401  (autouse)


def _sqnr64(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return 10 * math.log10(float(ref.pow(2).sum()) / float((ref - out).pow(2).sum()))


class _TwoIn(nn.Module):
    """``y`` enters the graph after ``x``'s observer, the only live value then: a cut before a graph input."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2, self.o = nn.Linear(6, 8), nn.Linear(3, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.o(torch.relu(self.l(x) + self.l2(y)))


def _two_in_calib() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(2)]


def test_two_input_model_accurate_recipe_rounds_layer_by_layer():
    torch.manual_seed(0)
    model, calib = _TwoIn().eval(), _two_in_calib()
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=calib[0])
    assert find_blocks(list(p.graph.nodes), dict(p.named_modules()), True) == {}  # was {1: 9}: `y` inside a span
    q, r = Q.quantize_ptq(model, calib, recipe="accurate", iters=5, refine=2, progress=False)
    q2, _ = Q.quantize_ptq(model, calib, recipe="accurate", iters=5, refine=2, blocks=False, progress=False)
    with torch.no_grad():
        ref, out = model(*calib[0]), q(*calib[0])
        assert torch.equal(out, q2(*calib[0]))  # no residual block here: the same codes as layer by layer
    assert r.sqnr_db == pytest.approx(_sqnr64(ref, out), abs=1e-6)
    assert r.sqnr_db > 30
    assert [c.name for c in r.layers] == ["l", "l2", "o"]


def _clamp_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU6(), nn.Conv2d(8, 8, 3, groups=8),
                         nn.Flatten(), nn.Linear(8 * 36, 4)).eval()


def _images(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(8, 3, 8, 8, generator=g) for _ in range(n)]


@pytest.mark.parametrize("form", ["generator", "list batches"])
def test_equalize_prepared_reads_every_pass_of_calib(form):
    calib = _images()
    runs = {}
    for kind in ("list", form):
        p = Q.prepare_fx(_clamp_net(), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
        data = calib if kind == "list" else (x for x in calib) if kind == "generator" else [[x] for x in calib]
        recs = equalize_prepared(p, data, relu6="range", weights=True)
        runs[kind] = ([(e.first, e.stretched) for e in recs], {k: v.clone() for k, v in p.state_dict().items()})
    assert runs["list"][0] == [("0", 0), ("2", 8)]  # the bias absorption pass, then the ReLU6 stretch of all 8
    assert runs[form][0] == runs["list"][0]  # a generator: 0 stretched (drained by the absorption pass)
    assert all(torch.equal(runs[form][1][k], v) for k, v in runs["list"][1].items())


class _Stream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 4, 1)
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-1, 1, 6).view(6, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.c(y + self.b(y))


def test_equalize_streams_takes_list_batches_as_positional_inputs():
    calib = _images()
    out = []
    for data in (calib, [[x] for x in calib]):  # [x]: lowbit.batches' convention, positional inputs
        torch.manual_seed(0)
        net = _Stream().eval()
        p = Q.prepare_fx(net, Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
        out.append([(s.writers, s.spread_before, s.spread_after) for s in equalize_streams(p, data)])
        with torch.no_grad():
            assert torch.allclose(p(calib[0]), net(calib[0]), atol=1e-5)
    assert out[0] == out[1] and out[0][0][1] > out[0][0][2]


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, groups=8), nn.Flatten(), nn.Linear(8 * 36, 4))


def test_eager_equalize_does_not_update_batchnorm_statistics():
    m = _bn_net().train()
    m[5].eval()  # a module in its own mode keeps it
    stats = {k: v.clone() for k, v in m.state_dict().items() if "running" in k or "num_batches" in k}
    out = Q.equalize(m, example_inputs=(_images(1)[0],), progress=False)
    assert out is m and out[0].weight.abs().sum() != _bn_net()[0].weight.abs().sum()  # the pair was equalized
    assert all(torch.equal(m.state_dict()[k], v) for k, v in stats.items())  # num_batches_tracked 0 -> 2 before
    assert [x.training for x in m.modules()] == [True] * 6 + [False] + [True] * 2


def _frozen_bn_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).train()
    m[1].eval()  # frozen BatchNorm while fine-tuning
    return m


def test_best_of_ranges_restores_each_modules_mode():
    m = _frozen_bn_model()
    modes = [x.training for x in m.modules()]
    best_of_ranges(m, [torch.randn(16, 6)], activations=("minmax",), weights=("minmax",), progress=False)
    assert [x.training for x in m.modules()] == modes  # the frozen BN came back training


def test_smooth_quant_restores_each_modules_mode():
    m = _frozen_bn_model()
    x = torch.randn(16, 6)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        smooth_quant(m, [x], layers=["1"], inplace=True)
    assert m.training and not m[1].training  # was left in eval mode
    ref = m.eval()(x)
    m.train()
    m[1].eval()
    out, rep = smooth_quant(m, [x], inplace=True)
    assert out is m and rep.layers
    assert m.training and not m[1].training and m[3].training  # the frozen BN came back training
    with torch.no_grad():
        assert torch.allclose(m.eval()(x), ref, atol=1e-5)


def test_seed_outside_the_generator_range_is_named():
    calib = _two_in_calib()
    with pytest.raises(ValueError, match=r"quantize_ptq: seed=18446744073709551616 must be in"):
        Q.quantize_ptq(_TwoIn(), calib, recipe="accurate", seed=2 ** 64, progress=False)
    p = Q.prepare_fx(_TwoIn().eval(), Q.get_default_qconfig_mapping(), example_inputs=calib[0])
    with pytest.raises(ValueError, match=r"reconstruct: seed=-9223372036854775809 must be in"):
        reconstruct(p, calib, seed=-2 ** 63 - 1, progress=False)


def test_labelled_dataloader_batches_get_a_hint():
    ds = torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    with pytest.raises(ValueError, match=r"calib batch 0 .*positional arguments.*\(x for x, _ in loader\)"):
        Q.quantize_ptq(_clamp_net(), loader, recipe="default", progress=False)
    q, r = Q.quantize_ptq(_clamp_net(), (x for x, _ in loader), recipe="default", progress=False)
    assert r.steps[1] == ("calibrate", "2 batches observed")


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 4)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.l(xs[0] + xs[1])


def test_nan_inside_a_nested_input_is_named_before_any_work():
    x = torch.randn(8, 6)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"quantize_ptq: calib batch 1, input 0 holds 1 NaN/Inf values of 48"):
        Q.quantize_ptq(_Nested(), [((x, x),), ((x, bad),)], recipe="default", progress=False)


def test_balanced_rounding_bar_names_the_quadratic_search(capsys):
    Q.quantize_ptq(_clamp_net(), _images(), recipe="balanced", progress=True)
    err = capsys.readouterr().err
    assert "quadratic rounding" in err and "adaround" not in err
