"""Session 43: small real-model code patterns through ``quantize_ptq``, graph mode and eager mode, as written.

A forward with control flow on a shape (``if x.shape[1] == 1``) under the ``"accurate"`` recipe; old-style in-place
ops (``x.relu_()``, ``y.add_(x)``, ``z.clamp_(0, 6)``) in graph mode; an eager ``QuantWrapper`` around a model that
returns a dict or a tuple. Oracles: the float model (SQNR), the same model written out of place (exact codes).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


# ---- "accurate" on a model whose own forward torch.fx cannot trace ----
class _ShapeBranch(nn.Module):
    """grayscale-to-RGB on the input's channel count: control flow on a shape, so the root is not traceable."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.repeat(1, 3, 1, 1)
        return self.fc(self.body(x).mean((2, 3)))


def _shape_branch() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return _ShapeBranch().eval(), [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]


def test_accurate_recipe_runs_on_a_model_whose_forward_cannot_be_traced():
    # before: TypeError "equalize_prepared: expects a prepare_fx model (fx.GraphModule), got _ShapeBranch"
    # (with equalize=False: "refine_grids: needs a graph-mode prepared model"), an internal function's name
    model, calib = _shape_branch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=2, refine=2, progress=False)
        out = q(calib[0])
    steps = dict(report.steps)
    # (session 44: both steps run on each child graph instead of being skipped; the report names why)
    assert steps["equalize"].startswith("per child graph (_ShapeBranch.forward cannot be traced by torch.fx")
    assert "if x.shape[1] == 1" in steps["equalize"] and steps["refine grids"].startswith("per child graph")
    assert "round" in steps and "convert" in steps
    assert _sqnr(model(calib[0]), out) > 30


@pytest.mark.parametrize("opt", ["tune", "distill"])
def test_tune_and_distill_on_an_untraceable_forward_run_on_every_child(opt):
    # before: TypeError "tune_biases: prepared must be a graph-mode prepared model (prepare_fx), got _ShapeBranch";
    # session 43 refused them by name; session 44: they run on the whole model eagerly, every child graph's layers
    model, calib = _shape_branch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=2, progress=False, **{opt: 2})
    step = dict(report.steps)["tune biases" if opt == "tune" else "distill"]
    assert step.startswith("3 layers'"), step


# ---- old-style in-place ops in graph mode ----
class _OldStyle(nn.Module):
    """``.relu_()``, ``y.add_(x)``, ``torch.relu_``, ``.sigmoid_()``, ``F.hardtanh_`` (or their out-of-place forms)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c3, self.c4 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            x = self.bn1(self.c1(x)).relu_()
            y = self.bn2(self.c2(x))
            y.add_(x)
            y = torch.relu_(y)
            z = F.hardtanh_(self.c3(y), 0.0, 6.0)
            return self.c4(z).sigmoid_()
        x = self.bn1(self.c1(x)).relu()
        y = self.bn2(self.c2(x))
        y = y + x
        y = torch.relu(y)
        z = F.hardtanh(self.c3(y), 0.0, 6.0)
        return self.c4(z).sigmoid()


def test_in_place_ops_are_quantized_as_their_out_of_place_forms():
    # before: add_ / relu_ / sigmoid_ / hardtanh_ were left float ("add_ (no integer implementation in graph mode)"),
    # each a DeQuantize + float op + Quantize, and the outputs differed from the out-of-place model's
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(2, 3, 8, 8, generator=g) for _ in range(3)]
    torch.manual_seed(0)
    state = _OldStyle(False).state_dict()
    outs, reports = [], []
    for inplace in (False, True):
        model = _OldStyle(inplace)
        model.load_state_dict(state)
        p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
        for c in calib:
            p(c)
        q = Q.convert_fx(p)
        outs.append(q(calib[0]))
        reports.append(q.lowbit_report)
    assert reports[1].left_float == reports[0].left_float == {}
    assert len(reports[1].converted) == len(reports[0].converted)
    assert torch.equal(outs[1], outs[0])


class _ViewBefore(nn.Module):
    """a view taken before the in-place op sees its change in eager mode: the op stays in place."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        v = y.view(y.size(0), -1)
        y.relu_()
        return v + 1


def test_an_in_place_op_on_a_tensor_with_an_earlier_view_stays_in_place():
    x = torch.randn(2, 3, 4, 4)
    model = _ViewBefore().eval()
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    assert torch.equal(p(x), model(x))  # observers are the identity: the prepared graph computes the float model
    assert "relu_" in [n.target for n in p.graph.nodes]


# ---- eager QuantWrapper around a model that returns several outputs ----
class _TwoHeads(nn.Module):
    """a detector's tuple / a multi-task dict of heads."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.box, self.cls = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> object:
        f = self.body(x)
        return {"box": self.box(f), "cls": self.cls(f)} if self.as_dict else (self.box(f), self.cls(f))


@pytest.mark.parametrize("as_dict", [False, True])
def test_quant_wrapper_around_a_model_with_tuple_or_dict_outputs(as_dict):
    # before: TypeError "DeQuantize expects a QTensor or a tensor, got dict" (tuple) on the first converted run
    torch.manual_seed(0)
    model = _TwoHeads(as_dict).eval()
    calib = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    w = Q.QuantWrapper(model)
    w.qconfig = Q.get_default_qconfig()
    p = Q.prepare(w)
    for c in calib:
        p(c)
    q = Q.convert(p)
    out, ref = q(calib[0]), model(calib[0])
    assert type(out) is type(ref)
    items = zip(out.values(), ref.values()) if as_dict else zip(out, ref)
    for o, r in items:
        assert type(o) is torch.Tensor and o.shape == r.shape and _sqnr(r, o) > 30


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1))


def test_quant_wrapper_around_a_token_model_names_the_stub():
    # before: TypeError "HistogramObserver observes floating-point tensors, got dtype torch.int64", naming no module
    w = Q.QuantWrapper(_Tokens().eval())
    w.qconfig = Q.get_default_qconfig()
    p = Q.prepare(w)
    with pytest.raises(TypeError, match=r"module 'quant' \(QuantStub\) gives a torch.int64 tensor of shape \(2, 5\) "
                                        r"to its HistogramObserver.*after the Embedding"):
        p(torch.randint(0, 20, (2, 5)))
