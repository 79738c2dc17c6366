"""Hostile inputs at the graph-mode configuration, fusion, speed-guard and helper level found by session 23's probes:
each was a silently different model (a mismatched float twin swapped in, a fuser's short result zipped away, a
preserved submodule replacing the graph's own, a truthy ``inplace`` rewriting the caller's model, a self-paired
equalization) or a deep error that named nothing. Each is now a clear error before any change."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.examples import SmallCNN, train
from lowbit.fuse import fuse_known_modules
from lowbit.models.mobilenet import MobileNetV2
from lowbit.report import rows_to_markdown
from lowbit.speed_guard import keep_faster


class _M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2, self.version = nn.Linear(4, 4), nn.Linear(4, 2), 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc(x)))


X = torch.randn(2, 4)


@pytest.mark.parametrize(("twin", "match"), [(nn.Sequential(nn.Linear(8, 3)), "out_features 3 != 8"),
                                             (nn.Sequential(nn.ReLU()), "it has no weight")])
def test_keep_faster_refuses_a_float_twin_that_is_not_the_converted_layer(twin, match):
    f = nn.Sequential(nn.Linear(8, 8))
    q = Q.quantize_dynamic(f)
    with pytest.raises(ValueError, match=rf"float_model's '0' .* is not the layer .*\({match}\)"):
        keep_faster(q, twin, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"timer returned \(0, 0\) for '0'"):
        keep_faster(q, f, torch.randn(4, 8), timer=lambda name, a, b: (0, 0))
    assert keep_faster(q, f, torch.randn(4, 8), timer=lambda name, a, b: (1e-3, 2e-3)).decisions[0].kept


@pytest.mark.parametrize("fuser", [lambda mods, is_qat=False: fuse_known_modules(mods, is_qat=is_qat)[:1],
                                   lambda mods, is_qat=False: ["a", "b"], 5])
def test_fuse_modules_checks_what_a_custom_fuser_returns(fuser):
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with pytest.raises(TypeError, match="fuser_func"):
        Q.fuse_modules(m, [["0", "1"]], fuser_func=fuser)
    assert type(m[1]) is nn.BatchNorm2d  # the input model is untouched


@pytest.mark.parametrize("name", ["fc", "forward"])
def test_preserved_attributes_that_are_submodules_or_methods_are_refused(name):
    cfg = Q.PrepareCustomConfig().set_preserved_attributes([name])
    with pytest.raises(ValueError, match=rf"prepare_fx: preserved attribute '{name}' is a submodule or a method"):
        Q.prepare_fx(_M().eval(), Q.get_default_qconfig_mapping(), (X,), prepare_custom_config=cfg)
    with pytest.raises(ValueError, match=f"fuse_fx: preserved attribute '{name}'"):
        Q.fuse_fx(_M().eval(), {"preserved_attributes": [name]})
    ok = Q.prepare_fx(_M().eval(), Q.get_default_qconfig_mapping(), (X,),
                      prepare_custom_config=Q.PrepareCustomConfig().set_preserved_attributes(["version"]))
    assert ok.version == 3


def test_reference_models_check_inplace_and_an_unused_convert_config():
    p = Q.prepare_fx(_M().eval(), Q.get_default_qconfig_mapping(), (X,))
    p(X)
    ref = Q.convert_to_reference_fx(copy.deepcopy(p))
    code = ref.code
    with pytest.raises(TypeError, match="convert_fx: inplace must be a bool, got 'no'"):
        Q.convert_fx(ref, inplace="no")
    with pytest.raises(TypeError, match="inplace must be a bool, got 'no'"):
        Q.lower_reference(ref, inplace="no")
    with pytest.raises(ValueError, match="a reference model is lowered as it is; convert_custom_config"):
        Q.convert_fx(ref, convert_custom_config={"preserved_attributes": ["nope"]})
    assert ref.code == code  # not rewritten
    assert Q.convert_fx(ref)(X).shape == (2, 2)


def test_quantized_indexes_past_the_inputs_or_outputs_are_refused():
    cfg = Q.PrepareCustomConfig().set_input_quantized_indexes([3])
    with pytest.raises(ValueError, match=r"input_quantized_indexes \[3\] are past the model's 1 inputs"):
        Q.prepare_fx(_M().eval(), Q.get_default_qconfig_mapping(), (X,), prepare_custom_config=cfg)
    # (refused at prepare since session 37, before any calibration or QAT run; convert_fx refused it before)
    with pytest.raises(ValueError, match=r"prepare_fx: output_quantized_indexes \[5\] are past the model's 1 outputs"):
        Q.prepare_fx(_M().eval(), Q.get_default_qconfig_mapping(), (X,),
                     prepare_custom_config=Q.PrepareCustomConfig().set_output_quantized_indexes([5]))


def test_equalize_refuses_a_self_pair_and_a_truthy_inplace():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    w = m[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"the group \['0', '0'\] names a module more than once"):
        Q.equalize(m, [["0", "0"]], progress=False)
    with pytest.raises(TypeError, match="equalize: inplace must be a bool, got 'no'"):
        Q.equalize(m, [["0", "2"]], inplace="no", progress=False)
    assert torch.equal(m[0].weight, w)


@pytest.mark.parametrize("kw", [{"width": -1}, {"width": 0}, {"width": float("nan")}, {"width": "1"}, {"num_classes": 0}])
def test_mobilenet_v2_checks_width_and_classes(kw):
    with pytest.raises(ValueError, match="MobileNetV2: "):
        MobileNetV2(**kw)


def test_helpers_name_their_bad_arguments():
    with pytest.raises(ValueError, match=r"train: x holds no samples"):
        train(SmallCNN(channels=(4, 4), hidden=8), torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))
    for epochs in (float("inf"), "1"):
        with pytest.raises(ValueError, match=rf"epochs={epochs!r} must be a finite number > 0"):
            train(SmallCNN(channels=(4, 4), hidden=8), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)), epochs=epochs)
    row = dict(method="x", accuracy="91", delta=0.0, size_kib=None, size_ratio=1.0, latency_ms=1.0, speedup=1.0)
    with pytest.raises(TypeError, match=r"needs numbers for \['accuracy', 'size_kib'\]"):
        rows_to_markdown([row])
    with pytest.raises(TypeError, match="float_to_observed_custom_module_class must be a dict"):
        Q.PrepareCustomConfig.from_dict({"float_to_observed_custom_module_class": [1, 2]})
    with pytest.raises(TypeError, match="observed_to_quantized_custom_module_class must be a dict"):
        Q.ConvertCustomConfig.from_dict({"observed_to_quantized_custom_module_class": [1]})


def test_empty_data_and_a_custom_from_float_that_returns_no_module_are_named():
    from lowbit.examples import evaluate, predict

    m = SmallCNN(channels=(4, 4), hidden=8)
    with pytest.raises(ValueError, match="predict: x holds no samples"):
        predict(m, torch.zeros(0, 1, 28, 28))
    with pytest.raises(ValueError, match="evaluate: x holds no samples"):
        evaluate(m, torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))

    class Custom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Observed(nn.Module):
        @classmethod
        def from_float(cls, mod: nn.Module) -> int:
            return 5

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.custom = nn.Linear(4, 4), Custom()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.custom(self.fc(x))

    cfg = Q.PrepareCustomConfig().set_float_to_observed_mapping(Custom, Observed)
    with pytest.raises(TypeError, match="Observed.from_float returned int, not an nn.Module"):
        Q.prepare_fx(Net().eval(), Q.get_default_qconfig_mapping(), (X,), prepare_custom_config=cfg)
