"""Converted models whose tensors were made under ``torch.inference_mode`` (e.g. deep-copied there).

Inference tensors keep no version counter; the eager caches keyed on ``_version`` raised
``RuntimeError: Inference tensors do not track version counter`` (static and dynamic eager, and
every kind under ``torch.compile``). They must run and give the same outputs as the original model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lowbit as Q


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    float_model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    x = torch.randn(4, 64)
    static = Q.QuantWrapper(copy.deepcopy(float_model))
    static.qconfig = Q.get_default_qconfig()
    prepared = Q.prepare(static)
    prepared(x)
    return {"static": Q.convert(prepared), "dynamic": Q.quantize_dynamic(copy.deepcopy(float_model)),
            "weight_only": Q.quantize_weight_only(copy.deepcopy(float_model), bits=4, group_size=32)}


@pytest.mark.parametrize("kind", ["static", "dynamic", "weight_only"])
def test_model_copied_in_inference_mode_runs_eager(kind):
    model, x = _models()[kind], torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    with torch.inference_mode():
        twin = copy.deepcopy(model)
        assert next(twin.buffers()).is_inference() or any(p.is_inference() for p in twin.parameters())
        out = twin(x)
        out_again = twin(x)  # second call: the cache hit path
    assert torch.equal(out, ref) and torch.equal(out_again, ref)


def test_weight_only_copied_in_inference_mode_compiles():
    model, x = _models()["weight_only"], torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    with torch.inference_mode():
        twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(twin, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(out, ref)
