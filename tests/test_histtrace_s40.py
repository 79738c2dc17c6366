"""Histogram-family observers under PyTorch 2 (session 40): a calibrating model compiles with ``fullgraph=True`` and
exports, its histograms bit-equal to eager's; a QAT FakeQuantize on a histogram observer breaks the graph once per step
(its range search, eager only) and refuses ``torch.export`` with an error naming the observer and the fix.

Before: ``HistogramObserver.forward`` read the batch range on the host (``tolist()``, 2 graph breaks per observer, 16
in a 3-observer prepared model; export: ``GuardOnDataDependentSymNode ... zuf2 < zuf0``); the clip-range observers
(Percentile, MSE, Entropy, per channel) branched on ``bool(finite.all())`` / ``torch.equal`` (3 breaks each; export:
``Could not guard on data-dependent expression Eq(u0, 1)``); a QAT step with a histogram FakeQuantize had 39 breaks.
"""

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fake_quant import FakeQuantize, disable_observer
from lowbit.stubs import DeQuantStub, QuantStub
from lowbit.workflow import prepare

torch._dynamo.config.cache_size_limit = 64
torch._logging.set_logs(dynamo=logging.CRITICAL)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(1, 4, 3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 3)
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(self.fc(self.relu(self.conv(self.quant(x))).mean((2, 3))))


def _batches(shape=(4, 3, 16)):
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(shape, generator=g) * s + m for s, m in [(1, 0), (3, 1), (0.5, -2), (10, 5), (1, 0)]]
    out[2][0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # dropped / weight 0: same counts
    return out


OBSERVERS = {
    "histogram": lambda: Q.HistogramObserver(),
    "histogram_symmetric_64": lambda: Q.HistogramObserver(bins=64, qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8),
    "percentile": lambda: Q.PercentileObserver(),
    "mse": lambda: Q.MSEObserver(),
    "entropy": lambda: Q.EntropyObserver(),
    "percentile_per_channel": lambda: Q.PercentileObserver(qscheme=Q.per_channel_affine, ch_axis=1),
    "mse_per_channel": lambda: Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0),
}


def _same_buffers(a, b):
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_compiled_observation_equals_eager_bit_for_bit(name):
    """fullgraph compile (aot_eager) of the observer's forward: the same histogram, range and qparams as eager."""
    torch._dynamo.reset()
    eager, traced = OBSERVERS[name](), OBSERVERS[name]()
    batches = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (eager warns once about the NaN / Inf)
        eager(batches[0])
        traced(batches[0])  # (per channel: the first batch sizes the (C,) buffers, eagerly)
        compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
        for x in batches[1:]:
            eager(x)
            assert compiled(x) is not None
        _same_buffers(eager, traced)
        for u, v in zip(eager.calculate_qparams(), traced.calculate_qparams()):
            assert torch.equal(u, v)


def test_inductor_compiled_histogram_equals_eager():
    """The real compiler (inductor) too: no float contraction or reordering changes a bin."""
    torch._dynamo.reset()
    eager, traced = Q.HistogramObserver(), Q.HistogramObserver()
    compiled = torch.compile(traced, fullgraph=True)
    for x in _batches()[:2] + _batches()[3:]:
        eager(x)
        compiled(x)
    _same_buffers(eager, traced)


def test_prepared_default_qconfig_model_traces_and_exports():
    """``prepare(model, get_default_qconfig())`` (HistogramObserver activations) calibrating: no graph break, and the
    exported program observes exactly what eager does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 8)
    model = prepare(Net().eval(), Q.get_default_qconfig())
    model(x)
    explained = torch._dynamo.explain(copy.deepcopy(model))(x * 2)
    assert explained.graph_break_count == 0, explained.break_reasons
    ep = torch.export.export(copy.deepcopy(model), (x,))
    exported = ep.module()
    for seed in (1, 2):
        batch = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * seed
        assert torch.equal(exported(batch), model(batch))
    ours = {k: v for k, v in exported.state_dict().items() if "histogram" in k or k.endswith(("min_val", "max_val"))}
    theirs = model.state_dict()
    assert ours and all(torch.equal(v, theirs[k]) for k, v in ours.items())


def test_prepared_fx_default_qconfig_model_exports():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 8)
    model = Q.prepare_fx(Net().eval(), Q.get_default_qconfig_mapping(), (x,))
    model(x)
    ep = torch.export.export(model, (x,))
    assert torch.equal(ep.module()(x * 3), model(x * 3))


def _hist_fq():
    torch.manual_seed(0)
    return FakeQuantize(observer=Q.HistogramObserver.with_args(bins=128))


def test_qat_histogram_fake_quant_compiles_with_one_break_per_step():
    """The observation runs in the graph; the per-step range search is the one graph break; same as eager."""
    torch._dynamo.reset()
    eager, traced = _hist_fq(), _hist_fq()
    x0 = torch.randn(64, 8)
    eager(x0)
    traced(x0)
    explained = torch._dynamo.explain(copy.deepcopy(traced))(x0 * 2)
    assert explained.graph_break_count == 1
    assert "calculate_qparams" in str(explained.break_reasons[0].reason)
    compiled = torch.compile(traced, backend="aot_eager")
    for i in range(1, 4):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(i)) * i
        assert torch.equal(compiled(x), eager(x))
    _same_buffers(eager.activation_post_process, traced.activation_post_process)
    assert torch.equal(eager.scale, traced.scale) and torch.equal(eager.zero_point, traced.zero_point)


def test_qat_histogram_fake_quant_export_refuses_clearly_then_exports_with_observer_off():
    fq = _hist_fq()
    x = torch.randn(64, 8)
    fq(x)
    with pytest.raises(RuntimeError, match=r"FakeQuantize with HistogramObserver: .*calculate_qparams.*disable_observer"):
        torch.export.export(fq, (x,))
    fq.apply(disable_observer)
    ep = torch.export.export(fq, (x,))
    assert torch.equal(ep.module()(x * 2), fq(x * 2))


def test_per_channel_first_batch_under_export_and_compile():
    """The first batch sizes the (C,) buffers: export names it; compile (no fullgraph) breaks once and matches."""
    x = torch.randn(4, 3, 8)
    fresh = Q.PercentileObserver(qscheme=Q.per_channel_affine, ch_axis=1)
    with pytest.raises(RuntimeError, match=r"PercentileObserver \(per channel, ch_axis=1\): the first batch sizes"):
        torch.export.export(fresh, (x,))
    torch._dynamo.reset()
    eager, traced = (Q.PercentileObserver(qscheme=Q.per_channel_affine, ch_axis=1) for _ in range(2))
    compiled = torch.compile(traced, backend="aot_eager")
    for i in range(3):
        batch = x * (i + 1) + i
        eager(batch)
        compiled(batch)
    _same_buffers(eager, traced)
