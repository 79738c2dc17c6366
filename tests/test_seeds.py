"""Every example of the seed documents (/work/shared/seeds), run on torch tensors in place of ``lucid``,
asserting the values the seeds print. One test per seed example, in the seeds' order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# ---- 000: PerChannelMinMaxObserver ----
def test_per_channel_observer_one_scale_per_output_channel():
    obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    _ = obs(torch.randn(16, 8))  # 16 output channels
    scale, zero_point = obs.calculate_qparams()
    assert tuple(scale.shape) == (16,)
    assert bool((zero_point == 0).all().item()) is True  # symmetric => zero_point pinned to 0


def test_per_channel_observer_small_range_row_gets_smaller_step():
    w = torch.stack([torch.ones(4) * 0.001, torch.ones(4) * 1.0])
    obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    _ = obs(w)
    s, _ = obs.calculate_qparams()
    assert bool(s[0].item() < s[1].item()) is True


def test_per_channel_observer_signature_defaults():
    obs = Q.PerChannelMinMaxObserver()
    assert (obs.ch_axis, obs.qscheme, obs.qdtype, obs.eps) == (0, Q.per_channel_symmetric, Q.qint8, 1e-8)


# ---- 001: ObserverBase ----
def test_observer_base_forward_is_identity_and_qparams_are_scalars():
    obs = Q.MinMaxObserver()  # a concrete ObserverBase subclass
    x = torch.randn(64, 128)
    assert obs(x) is x  # forward observes and returns x unchanged
    scale, zero_point = obs.calculate_qparams()
    assert (tuple(scale.shape), tuple(zero_point.shape)) == ((), ())


def test_observer_base_with_args_factory():
    factory = Q.PerChannelMinMaxObserver.with_args(ch_axis=0)
    obs2 = factory()  # zero-arg factory builds a fresh observer
    assert type(obs2).__name__ == "PerChannelMinMaxObserver"
    assert factory() is not obs2 and isinstance(obs2, Q.ObserverBase)


def test_observer_base_is_abstract():
    with pytest.raises(NotImplementedError):
        Q.ObserverBase(Q.per_tensor_affine, Q.quint8).calculate_qparams()


# ---- 002: FixedQParamsObserver ----
def test_fixed_qparams_observer_needs_no_calibration():
    obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    scale, zero_point = obs.calculate_qparams()  # valid with no calibration
    assert (round(scale.item(), 6), int(zero_point.item())) == (0.003906, 0)


def test_fixed_qparams_observer_ignores_data():
    obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    before = obs.scale.item()
    _ = obs(torch.randn(4, 4))
    assert obs.scale.item() == before


# ---- 003: QConfig ----
def test_qconfig_built_by_hand_from_with_args_factories():
    from lowbit.observer import HistogramObserver, PerChannelMinMaxObserver

    qcfg = Q.QConfig(
        activation=HistogramObserver.with_args(qscheme=Q.per_tensor_affine, qdtype=Q.quint8),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=Q.per_channel_symmetric, qdtype=Q.qint8),
    )
    act_observer = qcfg.activation()  # fresh observer for one insertion site
    wt_observer = qcfg.weight()  # independent observer, no shared state
    assert type(act_observer).__name__ == "HistogramObserver"
    assert wt_observer is not qcfg.weight() and act_observer is not qcfg.activation()
    activation, weight = qcfg  # unpacks positionally
    assert (activation, weight) == (qcfg.activation, qcfg.weight)


def test_qconfig_default_recipes():
    qcfg = Q.get_default_qconfig()  # static-PTQ recipe
    qat = Q.get_default_qat_qconfig()  # QAT recipe (FakeQuantize-wrapped)
    assert type(qcfg.activation()).__name__ == "HistogramObserver"
    assert type(qcfg.weight()).__name__ == "PerChannelMinMaxObserver"
    assert [type(f()).__name__ for f in qat] == ["FakeQuantize", "FakeQuantize"]


# ---- 004: torch.Tensor.q_per_channel_scales ----
def test_q_per_channel_scales_one_per_channel():
    w = torch.randn(8, 4)
    obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    obs(w)
    quantized_weights = Q.quantize_per_channel(w, *obs.calculate_qparams(), 0, Q.qint8)
    scales = quantized_weights.q_per_channel_scales()
    assert scales.dim() == 1 and scales.numel() == w.shape[quantized_weights.q_per_channel_axis()]
    # the scales recover the float values: |dequantize - w| <= s/2 per channel
    err = (quantized_weights.dequantize() - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        x = self.fc1(x)
        x = torch.relu(x)
        x = self.fc2(x)
        return x


def test_q_per_channel_scales_of_a_converted_linear():
    # the seed's PTQ flow (prepare -> calibrate -> convert), then the first layer's per-channel weight scales
    model = MyModel().eval()
    prepared = Q.prepare(model, Q.get_default_qconfig())
    dummy_input = torch.randn(1, 4)
    prepared(dummy_input)  # calibrate
    model_quantized = Q.convert(prepared)
    model_quantized(dummy_input)  # run inference with the quantized model
    scales = model_quantized.fc1.weight().q_per_channel_scales()
    assert tuple(scales.shape) == (8,) and bool((scales > 0).all())
    expected = model.fc1.weight.detach().abs().amax(1) / 127.5
    torch.testing.assert_close(scales, expected, rtol=1e-6, atol=0)
