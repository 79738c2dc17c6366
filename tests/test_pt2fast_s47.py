"""Session 47 (#10, PT2): what a compiled program's ``lowbit::`` ops cost per call beyond the eager modules.

- ``lowbit::qlinear`` enters the eager module's plan by its own entry (``run_qt``), so the plan's lane
  (``kernels.lane``) serves the compiled calls after the first, as it serves the eager module's;
- an eager call that arms a Linear's lane no longer recompiles a compiled program of the same model (the traced
  forward read the module's ``_cache`` before asking whether it was tracing: a guard on the cache's keys);
- ``lowbit::qfunctional``'s fast add keeps its grids' numbers per output grid (the op's ``_Grid`` is made afresh on
  every call: its memo was empty on every call);
- ``quant_ops.like`` makes no full-size comparison tensor when the result already has the promised strides.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import native
from lowbit.compile_state import qdtype_key
from lowbit.kernels import onednn
from lowbit.nn.quantized import QFunctional
from lowbit.nn.quantized import functional_modules
from lowbit.pt2 import quant_ops

needs_native = pytest.mark.skipif(not native.available(), reason="the lane is lowbit.native's call")


def _static_linear(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, torch.Tensor]:
    """Quantize -> Linear 64 -> 32 -> DeQuantize on the default qconfig, the plan pinned to the routes without VNNI
    (the same on an AVX2 and an AVX-512 VNNI CPU)."""
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    monkeypatch.setattr(onednn, "shares_routes", lambda: True)
    torch.backends.quantized.engine = "x86"
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(64, 32), Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(16, 64))
    return Q.convert(p), torch.randn(4, 64)


@needs_native
def test_compiled_qlinear_takes_the_plans_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _static_linear(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)  # (the ops run as under inductor)
    with torch.no_grad():
        ref = model(x)
        outs = [compiled(x) for _ in range(2)]
    run = Q.pt2.weight_cache(model[1].weight_int8)["pt2.linear_plan"][1]
    assert run is not None and run.lane.armed(), "the op never entered the plan by run_qt (its lane unarmed)"
    calls = []
    qt = run.qt
    monkeypatch.setattr(run, "qt", lambda xq: calls.append(1) or qt(xq))
    with torch.no_grad():
        outs += [compiled(x) for _ in range(3)]
    assert not calls, f"run_qt ran {len(calls)} times: the lane served no compiled call"
    for got in outs:
        assert torch.equal(got, ref)


@needs_native
def test_eager_call_arming_the_lane_does_not_recompile(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.testing import CompileCounter

    model, x = _static_linear(monkeypatch)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        first = compiled(x)
        eager = [model(x) for _ in range(2)]  # (the second call arms the module's lane: "lane" in its _cache)
        assert "lane" in model[1]._cache
        again = compiled(x)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations: the traced forward guarded on _cache"
    assert torch.equal(first, eager[0]) and torch.equal(again, eager[1])


def test_qfunctional_op_reads_its_grids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    if not functional_modules._fbgemm_dequantize():
        pytest.skip("the fast add needs torch's fbgemm dequantization")
    torch.manual_seed(0)
    cl = torch.channels_last
    a = Q.quantize_per_tensor(torch.randn(2, 8, 5, 5).contiguous(memory_format=cl), 0.05, 128, Q.quint8)
    b = Q.quantize_per_tensor(torch.randn(2, 8, 5, 5).contiguous(memory_format=cl), 0.04, 120, Q.quint8)
    qf = QFunctional()
    qf.scale, qf.zero_point = torch.tensor(0.07), torch.tensor(100)
    ref = qf.add_relu(a, b).int_repr()
    k = qdtype_key(Q.quint8)
    args = ("add_relu", a.int_repr(), a._scale, a._zero_point, k, b.int_repr(), b._scale, b._zero_point, k, 0.0,
            qf.scale, qf.zero_point, k)
    calls = []
    numbers = functional_modules._add_numbers
    monkeypatch.setattr(functional_modules, "_add_numbers", lambda *a: calls.append(1) or numbers(*a))
    outs = [torch.ops.lowbit.qfunctional(*args) for _ in range(3)]
    assert len(calls) == 1, f"the grids' numbers were read {len(calls)} times in 3 calls"
    for got in outs:
        assert torch.equal(got, ref) and got.stride() == ref.stride()
    qf.scale.fill_(0.08)  # (an in-place change of the output grid: read again, as the module's memo does)
    got = torch.ops.lowbit.qfunctional(*args)
    assert len(calls) == 2
    assert torch.equal(got, qf.add_relu(a, b).int_repr())


def test_like_makes_no_comparison_tensor_when_strides_match(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: made.append(1) or empty_like(*a, **k))
    cl = torch.channels_last
    ref = torch.zeros(2, 3, 4, 5, dtype=torch.float32).contiguous(memory_format=cl)
    y = torch.arange(120, dtype=torch.uint8).reshape(2, 3, 4, 5).contiguous(memory_format=cl)
    assert quant_ops.like(y, ref) is y and not made
    flat = y.contiguous()  # (NCHW strides: a channels-last copy, as the fake promises)
    got = quant_ops.like(flat, ref)
    assert got.stride() == ref.stride() and torch.equal(got, flat) and len(made) == 1
    odd = torch.zeros(3, 4)[:, ::2]  # (not dense: empty_like's own strides, compared)
    got = quant_ops.like(torch.ones(3, 2), odd)
    assert got.stride() == torch.empty_like(odd).stride()
