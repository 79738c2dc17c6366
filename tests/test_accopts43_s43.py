"""Session 43 (accopts43): options ``recipe="accurate"`` ignored given others; the 8-bit weight-only overflow.

- Inside ``quantize_ptq(recipe="accurate")`` three options were read only with others and silently ignored without
  them: ``streams`` with ``equalize=False`` (``equalize_streams`` runs inside the ``equalize`` step), ``batch_size``
  with ``iters=0`` (AdaRound's samples per step; ``tune`` / ``distill`` take 16), ``seed`` with ``iters=0, tune=0,
  distill=0`` (it seeds only AdaRound's, tune's and distill's sampling). Another value than the default is now a
  ``ValueError`` naming both options (``ptq_checks.unread_options``); the default passed explicitly, and
  ``streams=None`` (off, as ``equalize=False`` does), stay silent. ``rounding`` is read with ``iters=0`` (quadratic
  codes, no AdaRound), and ``blocks=False`` / ``learn_grids=False`` ask for what an ``iters=0`` / block-less run
  does: accepted.
- ``WeightOnlyLinear`` 8 bits per channel computed ``(x @ qᵀ)·s``, which overflowed to inf for |x| ≳ 2.7e36 / K
  where the float layer ``x @ ŵᵀ`` is finite (both the ``_weight_int8pack_mm`` decode path and the ``F.linear``
  path, float32 and bf16). A non-finite result is now computed again dequantized.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.nn.quantized import WeightOnlyLinear
from lowbit.ptq_checks import check_options, unread_options


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _calib() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(8, 8) for _ in range(2)]


_DEFAULTS = dict(iters=500, batch_size=8, seed=0, blocks=True, rounding="adaround", learn_grids=True, distill=0, tune=0,
                 float_output=True, refine=8, max_float_layers=0, streams=0.75, equalize="range", progress=False)


@pytest.mark.parametrize("kw, match", [
    (dict(iters=0, batch_size=16), r"batch_size=16 is ignored with iters=0 .*pass batch_size=8 \(the default\)"),
    (dict(iters=0, seed=3), r"seed=3 is ignored with iters=0, tune=0 and distill=0 .*pass seed=0 \(the default\)"),
    (dict(equalize=False, streams=0.5), r"streams=0.5 is ignored with equalize=False .*pass streams=0.75 \(the "
                                        r"default\) or streams=None"),
    (dict(equalize=False, streams=0.0), r"streams=0.0 is ignored with equalize=False"),
])
def test_accurate_refuses_an_option_its_other_options_leave_unread(kw, match):
    """These ran and ignored the option (e.g. ``iters=0, batch_size=16`` gave the ``batch_size=8`` model)."""
    with pytest.raises(ValueError, match=f"^quantize_ptq: {match}"):
        Q.quantize_ptq(_net(), _calib(), recipe="accurate", progress=False, **kw)


@pytest.mark.parametrize("kw", [
    dict(iters=0, batch_size=8, seed=0),  # the defaults, passed explicitly
    dict(iters=0, seed=3, tune=2), dict(iters=0, seed=3, distill=2), dict(iters=2, seed=3, batch_size=4),
    dict(equalize=False, streams=None), dict(equalize=False, streams=0.75), dict(equalize=True, streams=0.5),
    dict(iters=0, blocks=False, learn_grids=False, rounding="quadratic"),  # off, as iters=0 is; rounding is read
    dict(blocks=False, learn_grids=False),
])
def test_accurate_accepts_options_that_are_read_or_default_or_off(kw):
    check_options("accurate", **{**_DEFAULTS, **kw})


def test_other_recipes_keep_their_own_rule_and_unread_options_is_accurate_only():
    opts = dict(iters=0, batch_size=16, seed=0, tune=0, distill=0, equalize="range", streams=0.75)
    assert unread_options("balanced", opts) == [] and [o[0] for o in unread_options("accurate", opts)] == ["batch_size"]
    with pytest.raises(ValueError, match=r"iters=0, batch_size=16 apply to recipe='accurate' only, not "
                                         r"recipe='balanced'"):
        check_options("balanced", **{**_DEFAULTS, "iters": 0, "batch_size": 16})


def test_accurate_iters0_with_explicit_defaults_runs():
    q, rep = Q.quantize_ptq(_net(), _calib(), recipe="accurate", iters=0, batch_size=8, seed=0, refine=0,
                            equalize=False, streams=None, progress=False)
    assert "to nearest" in dict(rep.steps)["round"] and rep.sqnr_db > 20


# ---- 8-bit per-channel weight-only: (x @ qᵀ)·s overflowed where x @ ŵᵀ is finite ----

def _wo8() -> WeightOnlyLinear:
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    with torch.no_grad():
        lin.weight.mul_(1e-3)  # small scales: x @ qᵀ is ~1000x x @ ŵᵀ
    return WeightOnlyLinear.from_float(lin, bits=8, group_size=-1)


@pytest.mark.parametrize("rows", [1, 64])  # 1: _weight_int8pack_mm (decode), 64: F.linear(x, q) * s
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_int8_large_input_matches_the_float_layer(rows, dtype):
    q = _wo8()
    x = torch.zeros(rows, 16, dtype=dtype)
    x[:, 3] = 3e36
    x[:, 5] = -1e36
    ref = F.linear(x.double(), q.dequantize_weight().double(), q.bias.double())
    assert bool(torch.isfinite(ref).all()) and ref.abs().max() < 1e36
    y = q(x)
    assert y.dtype == dtype and bool(torch.isfinite(y).all()), y  # was inf
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=0)
    y_op = torch.ops.lowbit.weight_only_linear(x, q.qweight, q.scales, q.zero_points, q.bias,
                                               [16, 4, 8, -1, 1, 0], "auto")  # compiled / exported programs' op
    assert torch.equal(y_op, y)


@pytest.mark.parametrize("rows", [1, 64])
def test_weight_only_int8_common_path_unchanged_and_nan_input_stays_nan(rows):
    q = _wo8()
    torch.manual_seed(2)
    x = torch.randn(rows, 16)
    fast = (F.linear(x, q.qweight.float()) * q.scales[:, 0] if rows > 32 else
            torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q.qweight,
                                               torch.ones(4, dtype=torch.bfloat16)).float() * q.scales[:, 0])
    assert torch.equal(q(x), fast + q.bias)  # still (x @ qᵀ)·s, bit for bit
    x[0, 0] = float("nan")
    assert bool(q(x)[0].isnan().all()) and bool(torch.isfinite(q(x)[1:]).all())
