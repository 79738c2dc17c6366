"""Session 49 (pt2py49): the compiled ``lowbit::qlinear`` takes the fast entry ``qconv_cfg`` has (``pt2.fast_entry``,
shared): after a call the Linear plan's lane served, the next calls with the same grid strings and ``relu`` check the
identities and versions of the layer's tensors and hand the input to the lane, skipping ``checked_weight``,
``check_linear`` and the plan key. Every change that made the full body take another route or raise still does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit.compile_state import qdtype_key
from lowbit.nn.quantized import Linear, LinearReLU
from lowbit.pt2 import kernel_ops

from helpers import STEP_ASIDE_EDITS, stepped_aside

torch.set_num_threads(1)
XQ = qdtype_key(Q.quint8)
# where the op takes the layer's tensors (helpers.stepped_aside)
LINEAR_AT = {"weight": 4, "w_scale": 5, "bias": 8, "scale": 9, "zero_point": 10}


def _layer(relu: bool = True, seed: int = 3) -> Linear:
    k, n = 32, 16
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-64, 64, (n, k), generator=g, dtype=torch.int8)  # (saturation_safe: planned on AVX2 too)
    w = Q.QTensor(codes, torch.rand(n, generator=g) / 50 + 1e-3, torch.zeros(n, dtype=torch.long), Q.qint8, 0)
    mod = (LinearReLU if relu else Linear)(k, n)
    mod.set_weight_bias(w, torch.randn(n, generator=g))
    mod.set_output_grid(0.05, 100, Q.quint8)
    return mod


def _args(mod: Linear, rows: int = 2, zp: int = 131) -> list[Any]:
    """``qlinear``'s arguments (the module's buffers themselves, as a compiled program passes them)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (rows, 32), generator=g, dtype=torch.uint8)
    return [x, torch.tensor(0.02), torch.tensor(zp), XQ, mod.weight_int8, mod.weight_scale, mod.weight_zero_point,
            qdtype_key(mod.weight_qdtype), mod.bias, mod.scale, mod.zero_point, qdtype_key(mod.out_qdtype), mod._relu]


def _full(args: list[Any]) -> torch.Tensor:
    """The op's full body on clones (a fresh weight cache): what a cold call gives, or its error."""
    return kernel_ops.qlinear(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])


class _Spy:
    """Counts the op's full-body calls on ``weight`` (its ``checked_weight``; not ``_full``'s clones)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, weight: torch.Tensor) -> None:
        self.n, orig = 0, kernel_ops.checked_weight

        def counted(*a: Any, **k: Any) -> Any:
            self.n += a[1] is weight
            return orig(*a, **k)
        monkeypatch.setattr(kernel_ops, "checked_weight", counted)


def _skip_without_lane(weight: torch.Tensor) -> None:
    hit = kernel_ops._CACHES.get(id(weight))
    plan = None if hit is None else hit[1].get("pt2.linear_plan")
    if plan is None or plan[1] is None or not plan[1].lane.armed():
        pytest.skip("the Linear plan's lane does not serve here (no fbgemm engine or native build)")


def _armed(monkeypatch: pytest.MonkeyPatch, relu: bool = True) -> tuple[Linear, list[Any], torch.Tensor, _Spy]:
    mod = _layer(relu)
    args = _args(mod)
    want = _full(args)
    for _ in range(3):  # (run arms the lane, the lane's call arms the fast entry)
        assert torch.equal(kernel_ops.qlinear(*args), want)
    _skip_without_lane(args[4])
    return mod, args, want, _Spy(monkeypatch, args[4])


@pytest.mark.parametrize("relu", [True, False])
def test_fast_entry_serves_without_the_full_body(monkeypatch: pytest.MonkeyPatch, relu: bool) -> None:
    """After arming, ``qlinear`` calls never enter the full body (on int49 every call did: fails there), and give the
    full body's codes and the eager module's."""
    mod, args, want, spy = _armed(monkeypatch, relu)
    for _ in range(4):
        y = kernel_ops.qlinear(*args)
        assert torch.equal(y, want) and y.is_contiguous()
    assert spy.n == 0, spy.n
    x = Q.QTensor(args[0], args[1], args[2], Q.quint8)
    assert torch.equal(mod(x).int_repr(), want)


@pytest.mark.parametrize("edit", STEP_ASIDE_EDITS + ("x_qdtype", "relu", "x_scale_f64", "x_scale_1d"))
def test_fast_entry_steps_aside_for_every_change(monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    """Each change the full body would see is seen (the full body runs) and the codes are a cold call's. Pins of
    behaviour int49 already had, as its full body ran on every call; they fail if the entry skips a check."""
    mod, args, want, spy = _armed(monkeypatch)
    with torch.no_grad():
        if edit == "x_qdtype":
            args[3] = qdtype_key(Q.quint8.with_range(0, 127))
            args[0] = args[0] // 2
        elif edit == "relu":
            args[12] = not args[12]
        elif edit == "x_scale_f64":  # (.data swaps, no version bump: the full body's lane needs a float32 0-d scale)
            args[1].data = args[1].double()
        elif edit == "x_scale_1d":
            args[1].data = args[1].reshape(1).clone()
    with stepped_aside(args, edit if edit in STEP_ASIDE_EDITS else None, LINEAR_AT, monkeypatch):
        cold = _full(args)
        y = kernel_ops.qlinear(*args)
        assert spy.n == 1, (edit, spy.n)  # the full body ran
        assert torch.equal(y, cold), edit
        for _ in range(3):
            assert torch.equal(kernel_ops.qlinear(*args), cold)


def test_errors_after_arming_are_a_cold_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin: bad inputs to an armed op raise the full body's very errors."""
    mod, args, want, spy = _armed(monkeypatch)
    x = args[0]
    bad = {"k": x[:, :16], "rank": x[0, 0], "dtype": x.to(torch.int8), "wide": x.to(torch.int16), "x_scale": None}
    for name, xb in bad.items():
        a = list(args)
        if xb is None:
            a[1] = torch.tensor([0.02, 0.03])
        else:
            a[0] = xb
        with pytest.raises((ValueError, TypeError)) as cold:
            _full(a)
        with pytest.raises(cold.type) as got:
            kernel_ops.qlinear(*a)
        assert str(got.value) == str(cold.value), name
    assert torch.equal(kernel_ops.qlinear(*args), want)


@pytest.mark.parametrize("which", [1, 2, 9, 10])
def test_grid_data_swap_after_arming_raises_the_cold_error(monkeypatch: pytest.MonkeyPatch, which: int) -> None:
    """Pin: a ``.data`` swap of an input or output grid tensor to two values (no version bump, same object) raises the
    full body's per-tensor error (the shared entry's numel checks)."""
    mod, args, want, spy = _armed(monkeypatch)
    with torch.no_grad():
        args[which].data = args[which].reshape(1).repeat(2)
    with pytest.raises((ValueError, TypeError)) as cold:
        _full(args)
    with pytest.raises(cold.type) as got:
        kernel_ops.qlinear(*args)
    assert str(got.value) == str(cold.value)


def test_fast_entry_with_inference_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer built under ``inference_mode`` (tensors without version counters) is served too (fails on int49: the
    full body ran), with the full body's codes; its input grid is an ordinary tensor (the lane arms only those)."""
    with torch.inference_mode():
        mod = _layer(False, seed=5)
    args = _args(mod, rows=3, zp=0)
    want = _full(args)
    for _ in range(3):
        kernel_ops.qlinear(*args)
    _skip_without_lane(args[4])
    spy = _Spy(monkeypatch, args[4])
    assert torch.equal(kernel_ops.qlinear(*args), want)
    assert spy.n == 0


def test_compiled_smallcnn_bit_identical_to_eager_and_full_body() -> None:
    """Compiled SmallCNN b1 and b3 give eager's output with the Linear fast entries armed (none on int49: fails there)
    and with them dropped."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from compiled_overhead import build

    from lowbit.nn.quantized.conv import _ConvNd
    m, x = build("smallcnn")
    for mod in m.modules():
        if isinstance(mod, (_ConvNd, Linear)):
            mod.weight_int8.clamp_(-64, 63)  # (saturation_safe: planned on AVX2-only CPUs too)
    with torch.inference_mode():
        c = torch.compile(m, fullgraph=True, dynamic=False)
        for b in (1, 3):
            xb = x[:b]
            ref = m(xb)
            for _ in range(4):
                assert torch.equal(c(xb), ref)
            _skip_without_lane(m.fc1.weight_int8)
            n = sum(isinstance(k, tuple) for _, cache in kernel_ops._CACHES.values() for k in cache)
            assert n >= 1  # (SmallCNN's Linears armed)
            for _, cache in list(kernel_ops._CACHES.values()):
                for k in [k for k in cache if isinstance(k, tuple)]:
                    del cache[k]
            assert torch.equal(c(xb), ref)
