"""Session 51 (hostile51): a sweep of the surfaces swept least — the quantized tensor API, FakeQuantize switches and
state, state-dict round trips of prepared / converted / QAT models, ONNX export, torch.export / compile of converted
models with odd inputs, the observers' distributed helpers and ``lowbit.debug`` (/tmp/s51/hostile51). Each test
failed before its fix:

- a checkpoint holding a finite ``min_val > max_val`` loaded into a ``FakeQuantize`` (or an observer): the min/max
  fake quants' step read it as a grid and fake-quantized every later batch onto ``[0, ~1]``; now refused, naming
  the key;
- a per-channel observer / QAT weight fake quant given a calibrated per-tensor range (a checkpoint of a model
  prepared with a per-tensor weight recipe): taken as the unsized seed, so the per-channel model converted with
  one grid for every channel; now refused, naming the key;
- ``observer.sync_statistics(group="x")`` kept the junk group on one process (it failed in the first collective of
  a distributed run); now ``TypeError`` naming it, as ``sync_observers`` does;
- ``to_onnx`` of a model with an op ONNX cannot express raised torch's error whose text holds the whole TorchScript
  graph; now one line naming the op and the opset. A model moved to meta failed in ``deepcopy`` ("Cannot copy out
  of meta tensor"); now named;
- ``debug.compare`` / ``debug.layer_sensitivity`` on inputs the float model cannot run raised the model's bare
  ``mat1 and mat2 shapes cannot be multiplied``; now the batch and its shapes are named.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (one_thread: autouse fixture, this module runs on 1 thread)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Mlp().eval()


X = torch.rand(16, 8)


def _converted() -> nn.Module:
    p = Q.prepare_fx(_mlp(), Q.get_default_qconfig_mapping(), example_inputs=(X,))
    p(X)
    return Q.convert_fx(p)


def test_fake_quantize_refuses_a_loaded_min_above_max() -> None:
    """Before: loaded; the next training step fake-quantized onto ``[0, ~1]`` (a grid from ``min 5 > max 1``)."""
    x = torch.randn(64, 8)
    fq = Q.FakeQuantize()
    fq(x)
    state = {**fq.state_dict(), "activation_post_process.min_val": torch.tensor(5.0),
             "activation_post_process.max_val": torch.tensor(1.0)}
    fresh = Q.FakeQuantize()
    with pytest.raises(RuntimeError, match=r"activation_post_process.min_val=5 exceeds activation_post_process.max_val=1"):
        fresh.load_state_dict(state)
    assert torch.equal(fresh.activation_post_process.min_val, torch.tensor(float("inf")))  # (kept its state)
    obs = Q.PerChannelMinMaxObserver(ch_axis=1)
    obs(x)
    state = obs.state_dict()
    state["min_val"][3] = 9.0
    with pytest.raises(RuntimeError, match=r"min_val=9 exceeds max_val=.* \(channel 3\)"):
        Q.PerChannelMinMaxObserver(ch_axis=1).load_state_dict(state)


@pytest.mark.parametrize("cls", [Q.MinMaxObserver, Q.MovingAveragePerChannelMinMaxObserver, Q.HistogramObserver])
def test_observer_states_that_observers_write_still_load(cls: type) -> None:
    """Pin: the ``±inf`` seeds of a fresh observer and a calibrated state load as before."""
    Q.FakeQuantize(observer=cls).load_state_dict(Q.FakeQuantize(observer=cls).state_dict())
    obs = cls()
    obs(torch.randn(16, 4))
    twin = cls()
    twin.load_state_dict(obs.state_dict())
    assert torch.equal(twin.calculate_qparams()[0], obs.calculate_qparams()[0])


def _qat(per_channel: bool) -> nn.Module:
    torch.manual_seed(0)
    weight = (Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver.with_args(
        qdtype=Q.qint8, qscheme=Q.per_channel_symmetric), qscheme=Q.per_channel_symmetric, ch_axis=0) if per_channel
        else Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver.with_args(
            qdtype=Q.qint8, qscheme=Q.per_tensor_symmetric)))
    qconfig = Q.QConfig(activation=Q.FakeQuantize, weight=weight)
    return Q.prepare_qat_fx(_mlp().train(), Q.QConfigMapping().set_global(qconfig), example_inputs=(X,))


def test_per_channel_qat_model_refuses_a_per_tensor_checkpoint() -> None:
    """Before: loaded (the range taken as the unsized seed); converted, every channel had one weight scale."""
    src = _qat(per_channel=False)
    src(X)
    with pytest.raises(RuntimeError, match=r"a\.weight_fake_quant\.activation_post_process\.min_val=.*: a "
                                           r"per-channel observer keeps a \(C,\) range, got one finite range"):
        _qat(per_channel=True).load_state_dict(src.state_dict())
    same = _qat(per_channel=True)  # (pin: a per-channel checkpoint still loads)
    same(X)
    _qat(per_channel=True).load_state_dict(same.state_dict())


@pytest.mark.parametrize("cls", [Q.MinMaxObserver, Q.HistogramObserver, Q.MovingAveragePerChannelMinMaxObserver])
def test_sync_statistics_refuses_a_junk_group(cls: type) -> None:
    obs = cls()
    obs(torch.rand(4, 3))
    with pytest.raises(TypeError, match=rf"{cls.__name__}.sync_statistics: group='world' must be None"):
        obs.sync_statistics(group="world")
    obs.sync_statistics()  # (pin: the default group on one process is a no-op)


class _Svd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.svd(self.a(x))[1]


def test_to_onnx_names_an_op_onnx_cannot_express(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before: torch's ``UnsupportedOperatorError`` whose text went on with the whole TorchScript graph."""
    pytest.importorskip("onnx")
    from lowbit.export import to_onnx

    p = Q.prepare_fx(_Svd().eval(), Q.get_default_qconfig_mapping(), example_inputs=(X,))
    p(X)
    with pytest.raises(NotImplementedError, match=r"^to_onnx: Exporting the operator 'aten::linalg_svd' to ONNX "
                                                  r"opset version 17 is not supported") as e:
        to_onnx(Q.convert_fx(p), (X,), tmp_path / "m.onnx")
    assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


def test_to_onnx_names_a_model_on_meta(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before: ``NotImplementedError: Cannot copy out of meta tensor; no data!`` from ``deepcopy``."""
    pytest.importorskip("onnx")
    from lowbit.export import to_onnx

    q = copy.deepcopy(_converted()).to("meta")
    with pytest.raises(RuntimeError, match=r"to_onnx: buffer 'a.weight_int8' is on the meta device"):
        to_onnx(q, (X,), tmp_path / "m.onnx")
    with pytest.raises(RuntimeError, match=r"to_onnx: parameter 'a.weight' is on the meta device"):
        to_onnx(_mlp().to("meta"), (X,), tmp_path / "m.onnx")


def test_compare_names_the_batch_the_float_model_cannot_run() -> None:
    from lowbit.debug import compare

    q = _converted()
    with pytest.raises(ValueError, match=r"compare \(float_model\): inputs batch 1 \(input shapes \[\(2, 5\)\]\) "
                                         r"failed in the model: RuntimeError: mat1 and mat2 shapes"):
        compare(_mlp(), q, [X, torch.rand(2, 5)])
    with pytest.raises(ValueError, match=r"inputs batch 0 .* must have the same dtype"):
        compare(_mlp(), q, X.double())
    with pytest.raises(RuntimeError, match="NaN"):  # (pin: the quantized model's own errors pass unchanged)
        compare(_mlp(), q, torch.full((2, 8), float("nan")))


@pytest.mark.parametrize("mode", ["eager", "fx"])
def test_layer_sensitivity_names_the_batch_the_float_model_cannot_run(mode: str) -> None:
    from lowbit.debug import layer_sensitivity

    kw = {"mode": mode, "example_inputs": (X,) if mode == "fx" else None}
    qm = Q.get_default_qconfig_mapping()
    with pytest.raises(ValueError, match=r"layer_sensitivity: calib batch 0 \(input shapes \[\(2, 5\)\]\) failed in "
                                         r"the model: RuntimeError: mat1 and mat2 shapes"):
        layer_sensitivity(_mlp(), qm, [torch.rand(2, 5)], X, **kw)
    with pytest.raises(ValueError, match=r"layer_sensitivity: inputs batch 1 \(input shapes \[\(2, 5\)\]\)"):
        layer_sensitivity(_mlp(), qm, [X], [X, torch.rand(2, 5)], **kw)
