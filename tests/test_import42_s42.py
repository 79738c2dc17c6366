"""``import lowbit`` start-up: no dynamo, no optional package; the lazily made ``torch.compiler.disable`` still works.

Before: two module-level ``torch.compiler.disable`` calls (``observer/channel_histogram.py``, ``fake_quant/base.py``)
imported ``torch._dynamo`` (and with it inductor, sympy's solvers...) at every ``import lowbit``: ~1.5 s of a
~2.1 s import on 1 thread (with compiled ``.pyc``s), paid by every CLI call, test subprocess and user script.
``compile_state.compiler_disabled`` makes the genuine wrapper at the first call once dynamo is loaded; dynamo
graph-breaks at the call as before (same frames, graphs and breaks as ``torch.compiler.disable``).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lowbit as Q
from lowbit import compile_state
from helpers import fresh_python

HEAVY = ("torch._dynamo", "torch._inductor", "onnx", "onnxruntime", "transformers", "gguf", "matplotlib", "scipy")

_IMPORT_SCRIPT = """
import json, sys
import torch
import lowbit, lowbit.cli
from torch._library.simple_registry import singleton
ops = [n for n in ("quantize", "dequantize", "qlinear", "qconv", "qfunctional") if hasattr(torch.ops.lowbit, n)]
fakes = [n for n in ops if singleton.find("lowbit::" + n).fake_impl.kernel is not None]
print(json.dumps({"loaded": [m for m in sys.argv[1:] if m in sys.modules], "ops": ops, "fakes": fakes}))
"""


def test_fresh_import_loads_no_dynamo_nor_optional_packages_and_registers_the_ops():
    done = fresh_python(_IMPORT_SCRIPT, *HEAVY)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], f"import lowbit loaded {got['loaded']}"
    # the custom ops (and their fake implementations) are still there before any use: torch.export / torch.load
    assert got["ops"] == ["quantize", "dequantize", "qlinear", "qconv", "qfunctional"]
    assert got["fakes"] == got["ops"]


def _inner(x: torch.Tensor, seen: list[bool]) -> torch.Tensor:
    seen.append(torch.compiler.is_compiling())  # never True: nothing under a disabled call is compiled
    return x.sin() + 1


def _compile_stats(disabled) -> tuple:
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    seen: list[bool] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return disabled(x.cos(), seen) * 2

    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounter()
    g = torch.compile(f, backend=cnt)
    x = torch.linspace(-1, 1, 5)
    outs = [g(x), g(x)]
    explained = torch._dynamo.explain(f)(x)
    stats = (dict(counters["frames"]), sum(counters["graph_break"].values()), cnt.frame_count, cnt.op_count,
             explained.graph_count, explained.graph_break_count, explained.op_count)
    assert all(torch.equal(o, f(x)) for o in outs)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="reason: lowbit s42: eager only"):
        torch._dynamo.reset()
        torch.compile(f, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    return stats, seen, str(explained.break_reasons[0].reason)


def test_compiler_disabled_breaks_the_graph_exactly_as_torch_compiler_disable():
    """Same frames / graphs / breaks / ops as the genuine decorator; the reason is in the break; the function's
    own frame is not compiled (without the skipped code object: 3 frames and 2 breaks instead of 2 and 1)."""
    import torch._dynamo  # noqa: F401  (the test process may not have it yet)

    ours = compile_state.compiler_disabled(_inner, reason="lowbit s42: eager only")
    ref = torch.compiler.disable(_inner, reason="lowbit s42: eager only")
    got, seen, reason = _compile_stats(ours)
    want, seen_ref, _ = _compile_stats(ref)
    assert got == want
    assert got[5] == 1  # explain: the one break, at the call
    assert "lowbit s42: eager only" in reason
    assert seen == seen_ref and not any(seen)
    assert ours.__name__ == "_inner" and ours._torchdynamo_disable_msg == "lowbit s42: eager only"


_FRESH_COMPILE = """
import copy, sys
import torch
import lowbit as Q
from lowbit.fake_quant import FakeQuantize
assert "torch._dynamo" not in sys.modules, "import lowbit loaded dynamo"
torch.manual_seed(0)
eager = FakeQuantize(observer=Q.HistogramObserver.with_args(bins=128))
traced = copy.deepcopy(eager)
x0 = torch.randn(64, 8)
eager(x0), traced(x0)  # the disabled range search called eagerly, dynamo still not imported
assert "torch._dynamo" not in sys.modules, "an eager step loaded dynamo"
import torch._dynamo
ex = torch._dynamo.explain(copy.deepcopy(traced))(x0 * 2)
assert ex.graph_break_count == 1 and "calculate_qparams" in str(ex.break_reasons[0].reason), ex.break_reasons
compiled = torch.compile(traced, backend="eager")
for i in range(1, 3):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(i)) * i
    assert torch.equal(compiled(x), eager(x)), i
assert torch.equal(eager.scale, traced.scale) and torch.equal(eager.zero_point, traced.zero_point)
# per channel: the first batch sizes the (C,) buffers in the one disabled call
obs_e, obs_c = (Q.PercentileObserver(qscheme=Q.per_channel_affine, ch_axis=1) for _ in range(2))
ex = torch._dynamo.explain(copy.deepcopy(obs_c))(x0)
assert ex.graph_break_count == 1 and "sizes its (C,)" in str(ex.break_reasons[0].reason), ex.break_reasons
f = torch.compile(obs_c, backend="eager")
for i in range(3):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 + i)) * (i + 1)
    f(x), obs_e(x)
for a, b in zip(obs_e.buffers(), obs_c.buffers()):
    assert torch.equal(a, b)
print("ok")
"""


def test_fresh_process_compiles_histogram_fake_quant_and_per_channel_observer_after_a_lazy_import():
    """The real use sites: dynamo is first imported after ``import lowbit`` (and after an eager step), then the
    range search and the per-channel first batch are still one graph break each, with eager's results."""
    done = fresh_python(_FRESH_COMPILE)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_eager_calls_before_dynamo_return_the_function_result():
    calls = []
    f = compile_state.compiler_disabled(lambda a, b=1: calls.append((a, b)) or a + b, reason="r")
    assert f(2, b=3) == 5 and calls == [(2, 3)]
    fq = Q.FakeQuantize(observer=Q.HistogramObserver.with_args(bins=64))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(fq)
    assert torch.equal(fq(x), ref(x)) and torch.equal(fq(x * 2), ref(x * 2))
