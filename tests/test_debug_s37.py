"""Session 37 sweep of the numeric debugger and reports (``lowbit.debug``, ``lowbit.report``): the numbers
``compare`` / ``sqnr`` give (float64 math the oracle), the models ``eval_fn`` sees, the rankings, the tables."""

from __future__ import annotations

import copy
import math
import unicodedata
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, compare, layer_sensitivity, sensitivity, sqnr
from lowbit.debug.table import SensitivityRow, SensitivityTable


def text_width(text: str) -> int:
    """Screen columns: East Asian wide / full-width characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """The oracle: 10·log10(Σx² / Σ(x - x̂)²) in float64."""
    x, x_hat = x.double(), x_hat.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - x_hat) ** 2).sum()))


class _ConvAct(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 8, 3), act  # a clamp module under the name "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


@pytest.mark.parametrize("act", [nn.ReLU6(), nn.Hardtanh(0.0, 2.0)], ids=["relu6", "hardtanh"])
def test_graph_mode_compare_clamps_a_relu6_module_named_relu(act):
    """prepare_fx recorded the module's name "relu", which compare read as F.relu: the reference lacked the clamp
    (8.5 dB reported for a 38.9 dB layer). The layer is the whole model, so its SQNR is the output's."""
    torch.manual_seed(0)
    model = _ConvAct(act).eval()
    with torch.no_grad():
        model.conv.weight.mul_(10.0)  # pre-activations far past the clamp
    x = torch.randn(16, 3, 10, 10)
    prepared = Q.prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), example_inputs=(x,))
    prepared(x)
    qmodel = Q.convert_fx(prepared)
    (row,) = compare(model, qmodel, x).rows
    with torch.no_grad():
        y, y_hat = model(x), qmodel(x)
    assert row.act_sqnr_db == pytest.approx(_db(y, y_hat), abs=1e-9) and row.act_sqnr_db > 30
    assert row.act_max_abs_err == pytest.approx(float((y - y_hat).abs().max()), abs=1e-6)
    assert row.compared_with == f"conv + clamp(0, {act.max_val:g})"


def test_compare_dynamic_lstm_and_gru_cell_weights():
    """A dynamic LSTM's ``weight`` takes torch's parameter name: compare called it with none (TypeError)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.cell = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.GRUCell(16, 8)

        def forward(self, x):
            y, _ = self.lstm(x)
            return self.cell(y[:, -1])

    model = Net().eval()
    x = torch.randn(4, 5, 8)
    qmodel = Q.quantize_dynamic(copy.deepcopy(model))
    rows = {r.name: r for r in compare(model, qmodel, x).rows}
    assert set(rows) == {"lstm", "cell"}
    for name in ("lstm", "cell"):
        fmod, qmod = getattr(model, name), getattr(qmodel, name)
        names = [n for n, _ in fmod.named_parameters() if n.startswith("weight_")]
        w = torch.cat([getattr(fmod, n).detach().flatten() for n in names])
        w_hat = torch.cat([qmod.weight(n).dequantize().flatten() for n in names])
        assert rows[name].weight_sqnr_db == pytest.approx(_db(w, w_hat), abs=1e-9)
        assert rows[name].weight_max_abs_err == pytest.approx(float((w - w_hat).abs().max()), abs=1e-7)
    with torch.no_grad():
        (y, (h, c)), (y_hat, (h_hat, c_hat)) = model.lstm(x), qmodel.lstm(x)
    assert rows["lstm"].act_sqnr_db == pytest.approx(
        _db(torch.cat([y.flatten(), h.flatten(), c.flatten()]), torch.cat([y_hat.flatten(), h_hat.flatten(),
                                                                            c_hat.flatten()])), abs=1e-9)


def test_sqnr_edges_inf_nan_complex():
    x = torch.tensor([float("inf"), 1.0, -2.0])
    assert sqnr(x, x.clone()) == math.inf  # identical outputs (an inf included): inf - inf was NaN
    assert sqnr(torch.zeros(3), torch.zeros(3)) == math.inf and sqnr(torch.zeros(3), torch.ones(3)) == -math.inf
    assert sqnr(torch.tensor([3, 4]), torch.tensor([3, 5])) == pytest.approx(10 * math.log10(25.0))  # int outputs
    assert math.isnan(sqnr(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")])))
    with pytest.raises(TypeError, match="complex"):  # the imaginary part was dropped, warned, and the rest scored
        sqnr(torch.tensor([1 + 1j]), torch.tensor([1 + 2j]))


def test_compare_nan_output_is_reported_not_hidden_and_is_the_worst_row():
    """Python's ``max(0.0, nan)`` is 0.0: a layer whose output held NaN read "max abs err 0"."""
    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), Q.DeQuantStub()).eval()
    x = torch.randn(16, 8)
    prepared = Q.prepare(copy.deepcopy(model), Q.get_minmax_qconfig())
    prepared(x)
    qmodel = Q.convert(prepared)
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad[3].bias[0] = float("nan")  # the float reference of layer '3' holds NaN
    result = compare(bad, qmodel, x)
    rows = {r.name: r for r in result.rows}
    assert math.isnan(rows["3"].act_sqnr_db) and math.isnan(rows["3"].act_max_abs_err)
    assert rows["1"].act_sqnr_db > 30 and math.isfinite(rows["1"].act_max_abs_err)
    assert result.worst().name == "3"  # min() over keys holding NaN returned whichever came first


Out = namedtuple("Out", ["logits", "feat"])


class _DictNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(8, 8), nn.Linear(8, 4), kind

    def forward(self, x):
        h = self.a(x)
        return {"logits": self.b(h), "feat": [h]} if self.kind == "dict" else Out(self.b(h), h)


@pytest.mark.parametrize("kind", ["dict", "namedtuple"])
def test_sensitivity_eval_fn_sees_float_outputs_in_dicts_and_namedtuples(kind):
    """Dict values reached eval_fn as QTensors; a namedtuple output raised inside the dequantizing hook."""
    torch.manual_seed(0)
    model = _DictNet(kind).eval()
    x = torch.randn(32, 8)
    ref = model(x)
    ref_logits = ref["logits"] if kind == "dict" else ref.logits
    seen = []

    def score(m):
        out = m(x)
        logits, feat = (out["logits"], out["feat"][0]) if kind == "dict" else (out.logits, out.feat)
        seen.append((type(out), type(logits), type(feat)))
        return -float(((logits - ref_logits) ** 2).mean())

    _, table = sensitivity(model, Q.get_minmax_qconfig(), x, score)
    assert sorted(r.name for r in table.rows) == ["a", "b"]
    assert all(t is torch.Tensor and f is torch.Tensor for _, t, f in seen), seen
    assert all(o is (dict if kind == "dict" else Out) for o, _, _ in seen)


def test_tables_escape_markdown_and_align_wide_names():
    name = "층|α`<b>\nx" + "y" * 120
    table = SensitivityTable(0.0, [SensitivityRow(name, "Linear", -0.5, 0.5), SensitivityRow("🙂", "Linear", -0.25, 0.25)])
    md = table.to_markdown().splitlines()
    assert md[2].count(" | ") == 4 and "\\|" in md[2] and "\\`" in md[2] and "\\<" in md[2]  # 5 cells, not 6
    lines = str(table).splitlines()
    starts = {text_width(line[:line.index("Linear")]) for line in lines[2:4]}
    assert len(starts) == 1, lines  # the type column starts at one screen column (wide chars count two)
    assert len(lines) == 5  # header, rule, two rows, footer: the newline in the name does not break a row

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q", Q.QuantStub())
    model.add_module("层`<x>", nn.Linear(8, 8))
    model.add_module("dq", Q.DeQuantStub())
    model.eval()
    prepared = Q.prepare(copy.deepcopy(model), Q.get_minmax_qconfig())
    prepared(torch.randn(8, 8))
    result = compare(model, Q.convert(prepared), torch.randn(8, 8))
    assert "| 层\\`\\<x> | Linear | 层\\`\\<x> |" in result.to_markdown()
    rows = str(result).splitlines()[2:]
    assert len({text_width(r[:r.index("Linear") if "Linear" in r else r.index("Quantize")]) for r in rows}) == 1


def _mlp_with_a_crushed_layer() -> tuple[nn.Module, torch.Tensor]:
    """Layer '2' has one weight column 1000x the rest, fed a feature that is always 0: its output is unchanged in
    float, but its weight grid (per tensor or per row) has no room left for the other weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    with torch.no_grad():
        model[0].weight[0].zero_()
        model[0].bias[0] = -1.0  # feature 0 after the ReLU is always 0
        model[2].weight[:, 0] = 1000.0
    return model, torch.randn(128, 16)


def test_the_known_worst_layer_is_ranked_first_and_rankings_are_repeatable():
    model, x = _mlp_with_a_crushed_layer()
    ref = model(x).detach()

    def score(m):
        return sqnr(ref, m(x))

    for mode in ("eager", "fx"):
        a, b = (layer_sensitivity(model, Q.get_default_qconfig(), x, mode=mode) for _ in range(2))
        assert a.rows[0].name == "2" and a.rows == b.rows, (mode, a.rows)
    _, t = sensitivity(model, Q.get_default_qconfig(), x, score)
    assert t.rows[0].name == "2"
    for search in ("exact", "fast"):
        _, t = auto_mixed_precision(model, Q.get_default_qconfig(), x, score, max_float_layers=1, search=search,
                                    progress=False)
        assert t.float_layers == ["2"] and t.final_metric > t.all_quantized_metric + 10, (search, t)
        for budget in (0, 3, 10):  # none, every layer, more than the layers
            _, t = auto_mixed_precision(model, Q.get_default_qconfig(), x, score, max_float_layers=budget,
                                        search=search, progress=False)
            assert len(t.float_layers) <= min(budget, 3) and (budget == 0) == (t.float_layers == [])


def test_a_loss_passed_as_eval_fn_is_warned():
    """Lower-is-better metrics reverse the ranking silently (the worst layer came last)."""
    model, x = _mlp_with_a_crushed_layer()
    ref = model(x).detach()

    def mse(m):
        return float(((m(x) - ref) ** 2).mean())

    with pytest.warns(UserWarning, match="higher is better"):
        sensitivity(model, Q.get_default_qconfig(), x, mse)
    with pytest.warns(UserWarning, match="higher is better"):
        auto_mixed_precision(model, Q.get_default_qconfig(), x, mse, max_float_layers=1, search="fast",
                             progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, t = sensitivity(model, Q.get_default_qconfig(), x, lambda m: -mse(m))
    assert t.rows[0].name == "2"


def test_an_eval_fn_error_names_the_candidate():
    model, x = _mlp_with_a_crushed_layer()
    calls = []

    def flaky(m):
        calls.append(m)
        if len(calls) == 3:
            raise RuntimeError("metric broke")
        return 1.0

    with pytest.raises(RuntimeError, match="metric broke") as info:
        sensitivity(model, Q.get_default_qconfig(), x, flaky)
    assert info.value.__notes__ == ["(raised by eval_fn on layer '2' quantized alone)"]


def test_graph_mode_candidates_do_not_warn_about_a_mapping_the_user_never_wrote():
    """"Only this layer int8" names the Linear alone; prepare_fx warned, per candidate, that its fused ReLU's
    qconfig (None) disagreed with it."""
    model, x = _mlp_with_a_crushed_layer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = layer_sensitivity(model, Q.get_default_qconfig(), x, mode="fx")
    assert [str(w.message) for w in caught if "disagree on .qconfig" in str(w.message)] == []
    assert table.rows[0].name == "2"
