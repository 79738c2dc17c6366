"""The static Linear's fast lane (``kernels.lane``): once ``run_qt`` took a native route for an input grid, later calls
on that grid repeat the native call with fewer checks. It must give the very codes the full path gives, serve only
what it was armed for, and step aside whenever the layer, the input grid, the thread's kernels or the backend change.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit as Q
from lowbit import kernels, native

pytestmark = pytest.mark.skipif(not native.available(), reason="lowbit.native not built (no C compiler)")


def _model(qconfig: Q.QConfig, k: int = 96, n: int = 80) -> torch.nn.Module:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.dq = Q.QuantStub(), Q.DeQuantStub()
            self.l, self.r, self.l2 = torch.nn.Linear(k, n), torch.nn.ReLU(), torch.nn.Linear(n, 40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dq(self.l2(self.r(self.l(self.q(x)))))

    torch.manual_seed(0)
    m = Net().eval()
    m.qconfig = qconfig
    m = Q.fuse_modules(m, [["l", "r"]])
    Q.prepare(m, inplace=True)
    m(torch.randn(256, k))
    return Q.convert(m)


def _reference(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with kernels.use_backend("reference"):
        return m(x)


RECIPES = {"default": Q.get_default_qconfig(), "x86": Q.get_default_qconfig("x86")}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_lane_serves_and_gives_the_full_paths_codes(recipe: str, rows: int) -> None:
    m = _model(RECIPES[recipe])
    x = torch.randn(rows, 96)
    ref = _reference(m, x)
    for _ in range(3):  # the full path: it arms the lane, the next call registers it (a first call in the process
        assert torch.equal(m(x), ref)  # may take the route's other branch while torch's warning is not yet silenced)
    assert "lane" in m.l._cache and "lane" in m.l2._cache  # armed by the first call, registered by the second
    plan = m.l._cache["plan"][2]

    def no_full_path(*_a, **_k):
        raise AssertionError("run_qt ran: the lane did not serve")

    full = plan.qt
    plan.qt = no_full_path
    try:
        before = kernels.counts[("onednn", "linear")]
        for _ in range(3):
            assert torch.equal(m(x), ref)
        assert kernels.counts[("onednn", "linear")] - before == 6  # two layers, three calls: tallied as the plan is
    finally:
        plan.qt = full


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_lane_steps_aside_when_the_layer_changes(recipe: str) -> None:
    m = _model(RECIPES[recipe])
    x = torch.randn(16, 96)
    for _ in range(3):
        m(x)
    assert "lane" in m.l._cache
    edits = [lambda: m.l.bias.add_(0.25), lambda: m.l.weight_scale.mul_(1.5), lambda: m.l.scale.mul_(2.0),
             lambda: m.l2.zero_point.add_(3)]
    for edit in edits:
        with torch.no_grad():
            edit()
        ref = _reference(m, x)
        assert torch.equal(m(x), ref)
        assert torch.equal(m(x), ref)  # (the re-armed lane too)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        state["l.bias"] += 1.0
    m.load_state_dict(state)
    assert "lane" not in m.l._cache  # (load_state_dict clears the cache)
    ref = _reference(m, x)
    assert torch.equal(m(x), ref) and torch.equal(m(x), ref)


def test_lane_steps_aside_for_other_input_grids_and_inputs() -> None:
    m = _model(RECIPES["x86"])
    x = torch.randn(16, 96)
    for _ in range(3):
        m(x)
    # the stub's grid changed in place: the Linear's input grid tensors are the same objects at a new version
    with torch.no_grad():
        m.q.scale.mul_(1.25)
    ref = _reference(m, x)
    assert torch.equal(m(x), ref) and torch.equal(m(x), ref)
    # a QTensor on another grid, a 3-d input, a per-call float input: each the full path's codes
    qx = Q.quantize_per_tensor(x, 0.05, 64, Q.quint8)
    with kernels.use_backend("reference"):
        want = m.l(qx).int_repr()
    assert torch.equal(m.l(qx).int_repr(), want)
    x3 = torch.randn(2, 8, 96)
    assert torch.equal(m(x3), _reference(m, x3))


def test_lane_follows_the_threads_kernels_and_the_pinned_backend() -> None:
    m = _model(RECIPES["default"])
    x = torch.randn(16, 96)
    ref = _reference(m, x)
    for _ in range(3):
        m(x)
    with native.force_avx2():
        assert torch.equal(m(x), ref)
    with native.disabled():
        before = native.counts.copy() if hasattr(native, "counts") else None
        assert torch.equal(m(x), ref)
        if before is not None:
            assert native.counts == before  # no native call while switched off
    with kernels.use_backend("reference"):
        before = kernels.counts[("reference", "linear")]
        assert torch.equal(m(x), ref)
        assert kernels.counts[("reference", "linear")] - before == 2


def test_lane_not_armed_on_inference_tensors() -> None:
    """A model converted under ``inference_mode`` holds inference buffers (no version counter): the lane is not
    registered (it could not see an in-place change), and the full path still gives the codes."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = _model(RECIPES["x86"])
        x = torch.randn(16, 96)
        ref = _reference(m, x)
        for _ in range(3):
            assert torch.equal(m(x), ref)
    assert "lane" not in m.l._cache


def test_lane_large_outputs_are_made_without_a_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs above ``_TEMPLATE_CODES`` codes are allocated per call (no large template held): the same codes."""
    from lowbit.kernels import lane as lane_mod

    monkeypatch.setattr(lane_mod, "_TEMPLATE_CODES", 0)
    for recipe in sorted(RECIPES):
        m = _model(RECIPES[recipe])
        x = torch.randn(16, 96)
        ref = _reference(m, x)
        for _ in range(4):
            assert torch.equal(m(x), ref)
        assert "lane" in m.l._cache and not m.l._cache["lane"][0]._tmpl
