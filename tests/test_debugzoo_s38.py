"""Session 38: lowbit.debug on real-model code patterns (ShuffleNetV2's conv + BN + ``nn.Identity`` unit, classifier
heads in eager mode's fast mixed-precision search, progress / error naming of the exact search)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, compare, sqnr
from lowbit.nn.intrinsic.fold import fold_bn_weights


def _bn(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    for b in m.modules():
        if isinstance(b, nn.BatchNorm2d):
            b.running_mean.copy_(torch.randn(b.num_features, generator=g) * 0.1)
            b.running_var.copy_(torch.rand(b.num_features, generator=g) + 0.5)
            b.weight.data.copy_(torch.rand(b.num_features, generator=g) * 3 + 0.2)
    return m.eval()


class _DepthwiseUnit(nn.Module):
    """ShuffleNetV2 / MobileNet style: a depthwise conv + BN with no activation, written as ``nn.Identity``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(4), nn.Identity())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dw(self.stem(x)))


def test_graph_mode_compare_folds_the_bn_before_a_users_identity():
    """prepare_fx deletes the BN: the sibling walk took the user's ``nn.Identity`` for the fused run, so the weight
    was compared unfolded (17 dB on ShuffleNetV2's depthwise conv) and the BN name was never shown."""
    torch.manual_seed(0)
    model = _bn(_DepthwiseUnit())
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(torch.randn(2, 3, 8, 8),))
    for _ in range(2):
        p(torch.randn(2, 3, 8, 8))
    q = Q.convert_fx(p)
    row = {r.name: r for r in compare(model, q, torch.randn(2, 3, 8, 8)).rows}["dw.0"]
    assert row.compared_with == "dw.1"
    conv, bn = model.dw[0], model.dw[1]
    w, _ = fold_bn_weights(conv.weight.detach().double(), None, bn, transpose=False, groups=4)
    expected = sqnr(w.float(), q.get_submodule("dw.0").weight())
    assert row.weight_sqnr_db == pytest.approx(expected, rel=1e-6) and row.weight_sqnr_db > 35


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    return model, torch.randn(64, 8)


def test_exact_search_honours_progress_false_and_names_itself(capsys):
    model, x = _mlp()
    ref = model(x).detach()
    mapping, table = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, lambda m: -float((m(x) - ref).pow(2).mean()),
                                          max_float_layers=1, mode="fx", progress=False)
    assert len(table.float_layers) == 1
    assert capsys.readouterr().err == ""  # sensitivity's bar showed anyway
    with pytest.raises(TypeError, match=r"^auto_mixed_precision: eval_fn must return a real number.*nan"):
        auto_mixed_precision(model, None, x, lambda m: float("nan"), tolerance=0.1, progress=False)


def test_eager_fast_search_sees_a_float_classifier_head_as_the_mapping_builds_it():
    """Eager mode (no graph): a head kept float was requantized onto its int8 output grid, so keeping it float
    gained nothing in the search (``[]`` chosen) while the model built from the mapping returns float values."""
    model, x = _mlp()
    with torch.no_grad():
        model[4].weight.mul_(20.0)  # a wide output range: a coarse output grid on the head
        model[4].weight[:, :4].mul_(0.01)
    ref = model(x).detach()

    def score(m: nn.Module) -> float:
        return -float((m(x) - ref).pow(2).mean())

    mapping, table = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=1,
                                          mode="eager", search="fast", progress=False)
    assert table.float_layers == ["4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare(copy.deepcopy(model), mapping)
        with torch.no_grad():
            p(x)
            built_out = Q.convert(p)(x)  # the float head returns float values
    assert isinstance(built_out, torch.Tensor)
    assert table.final_metric == pytest.approx(-float((built_out - ref).pow(2).mean()), rel=1e-4)
    assert table.final_metric > 2 * table.all_quantized_metric
