"""Hostile inputs at the LLM, export and state helpers found by session 23's probes: NaN calibration activations
that SmoothQuant folded into every norm (all outputs NaN), non-finite weights quantized silently, calibration
batches that are not token ids of the model's vocabulary, ``damp`` NaN, models ``to_onnx`` cannot export failing
deep inside torch, ``load_observer_state_dict`` writing some observers before it refused, and junk to the
registries. Each is now an error naming the value, before any work or any write."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import to_onnx
from lowbit.llm.tied import quantize_head
from lowbit.llm.w8a8 import DynamicInt8Linear


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return Q.llm.toy_llama(layers=1, hidden=32, vocab=64), torch.randint(0, 64, (1, 8))


def test_w8a8_refuses_nan_calibration_activations(toy):
    m, ids = toy
    e = m.model.embed_tokens(ids).detach().clone()
    e[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="quantize_w8a8: calib batch 1: inputs_embeds hold 1 NaN/Inf values"):
        Q.quantize_w8a8(m, [ids, {"inputs_embeds": e}])
    assert torch.isfinite(Q.quantize_w8a8(m, [ids])(ids).logits).all()


@pytest.mark.parametrize("fn", ["quantize_llm", "quantize_w8a8"])
def test_a_non_finite_decoder_weight_is_an_error_naming_the_layer(toy, fn):
    m, ids = toy
    bad = copy.deepcopy(m)
    bad.model.layers[0].mlp.down_proj.weight.data[0, 0] = float("inf")
    call = (lambda: Q.quantize_llm(bad, [ids], method="rtn", awq=False, group_size=16, progress=False)) \
        if fn == "quantize_llm" else (lambda: Q.quantize_w8a8(bad, [ids]))
    with pytest.raises(ValueError, match=rf"{fn}: layer '0.mlp.down_proj' has 1 NaN/Inf weight values"):
        call()


@pytest.mark.parametrize(("batch", "exc", "match"), [
    (torch.rand(1, 8), TypeError, "calib batch 0: token ids must be an integer tensor, got dtype torch.float32"),
    (torch.full((1, 8), 999), ValueError, r"token ids span \[999, 999\], outside the model's vocabulary \[0, 64\)"),
    (torch.full((1, 8), -1), ValueError, r"token ids span \[-1, -1\]"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, r"at least one token, got shape \(1, 0\)"),
    ({"input_ids": torch.full((1, 8), 64)}, ValueError, "calib batch 0 input_ids: token ids span"),
])
@pytest.mark.parametrize("fn", ["quantize_llm", "quantize_w8a8"])
def test_calibration_batches_must_be_token_ids_of_the_vocabulary(toy, fn, batch, exc, match):
    m, _ = toy
    call = getattr(Q, fn)
    kwargs = {"group_size": 16, "progress": False} if fn == "quantize_llm" else {}
    with pytest.raises(exc, match=match):
        call(m, [batch], **kwargs)
    with pytest.raises(TypeError, match="got a single tensor of shape"):
        call(m, torch.randint(0, 64, (1, 8)), **kwargs)


@pytest.mark.parametrize("damp", [float("nan"), float("inf"), (0.01, float("nan")), True])
def test_quantize_llm_damp_must_be_positive_and_finite(toy, damp):
    m, ids = toy
    with pytest.raises(ValueError, match=r"quantize_llm: damp=.* must be a positive float"):
        Q.quantize_llm(m, [ids], damp=damp, group_size=16, progress=False)


@pytest.mark.parametrize("group_size", [0, -2, "x", True])
def test_quantize_head_checks_group_size(toy, group_size):
    m, _ = toy
    with pytest.raises(ValueError, match=rf"quantize_head: group_size={group_size!r}"):
        quantize_head(copy.deepcopy(m), 4, group_size)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.lm_head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed_tokens(ids))


def test_to_onnx_names_llm_modules_it_cannot_export(tmp_path):
    with pytest.raises(TypeError, match="module '0' of type lowbit.llm.w8a8.DynamicInt8Linear has no ONNX export"):
        to_onnx(nn.Sequential(DynamicInt8Linear.from_float(nn.Linear(8, 4))), torch.randn(2, 8), tmp_path / "w8.onnx")
    with pytest.raises(TypeError, match="module 'embed_tokens' of type lowbit.llm.tied.TiedEmbedding has no ONNX export"):
        to_onnx(quantize_head(_TiedLM().eval(), 8), torch.tensor([[1, 2, 3]]), tmp_path / "tied.onnx")
    assert not list(tmp_path.iterdir())


def test_load_observer_state_dict_loads_nothing_when_it_refuses():
    mm = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.Linear(4, 4), Q.DeQuantStub()).eval()
    done = Q.prepare(copy.deepcopy(mm), Q.get_default_qconfig())
    done(torch.randn(8, 4))
    saved = Q.get_observer_state_dict(done)
    fresh = Q.prepare(copy.deepcopy(mm), Q.get_default_qconfig())
    before = {k: v.clone() for k, v in Q.get_observer_state_dict(fresh).items()}
    for bad, match in (({**saved, "zzz.min_val": torch.tensor(1.0)}, "name no observer"),
                       ({k: v for k, v in saved.items() if not k.startswith("1.")}, "no saved statistics")):
        with pytest.raises(RuntimeError, match=match):
            Q.load_observer_state_dict(fresh, bad)
        assert all(torch.equal(before[k], v) for k, v in Q.get_observer_state_dict(fresh).items())  # untouched
    Q.load_observer_state_dict(fresh, saved)
    assert all(torch.equal(saved[k], v) for k, v in Q.get_observer_state_dict(fresh).items())


@pytest.mark.parametrize("pattern", ["ab", 5, [nn.Linear, nn.ReLU]])
def test_registries_and_propagate_name_junk(pattern):
    with pytest.raises(TypeError, match="unregister_fusion_pattern: pattern=.* must be a tuple of module classes"):
        Q.unregister_fusion_pattern(pattern)
    with pytest.raises(TypeError, match="propagate_qconfig_: model must be an nn.Module, got NoneType"):
        Q.propagate_qconfig_(None, Q.get_minmax_qconfig())


def test_small_helpers_name_their_bad_arguments(tmp_path):
    from lowbit.export import run_onnx
    from lowbit.llm.awq import awq_search

    w, x = torch.randn(8, 16), torch.randn(32, 16)
    for kw, match in (({"n_grid": 0}, "n_grid=0 must be an int >= 1"), ({"n_grid": -1}, "n_grid=-1"),
                      ({"g": 0}, "g=0 must be -1"), ({"g": 5}, "g=5 must be -1 .* dividing in_features 16")):
        args = {"g": 8, "n_grid": 4, **kw}
        with pytest.raises(ValueError, match=match):
            awq_search(w, x, args["g"], Q.qint4, True, args["n_grid"])
    with pytest.raises(ValueError, match=r"input_scale must be a finite \(4,\) tensor, got shape \(7,\)"):
        DynamicInt8Linear.from_float(nn.Linear(4, 2), torch.ones(7))
    lin = nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval()
    p = Q.prepare(lin, Q.get_default_qconfig())
    p(torch.randn(8, 4))
    with pytest.raises(TypeError, match=r"to_onnx: input_names=\[1\] must be a list of strings"):
        to_onnx(Q.convert(p), torch.randn(2, 4), tmp_path / "m.onnx", input_names=[1])
    path = to_onnx(Q.convert(p), torch.randn(2, 4), tmp_path / "m.onnx")
    with pytest.raises(TypeError, match="run_onnx: inputs must be tensors, got list"):
        run_onnx(path, [[1.0] * 4])
    with pytest.raises(TypeError, match=r"smooth_quant: layers='0' must be an iterable of module names"):
        Q.smooth_quant(nn.Sequential(nn.Linear(4, 4)), [torch.randn(2, 4)], layers="0")
