"""Hostile inputs found by session 33's second sweep (graph mode, converted models at run time, the CLI, PT2).
Each case was silent garbage, a deep traceback or a misleading message; each test failed before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q


class _Mixed(nn.Module):
    """Linear, fixed-grid and LUT activations, a quantized add and mul, a second Quantize (after a float op)."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.hs, self.elu, self.l2 = nn.Linear(8, 8), nn.Hardswish(), nn.ELU(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        z = (self.hs(y) + self.elu(y)) * y
        return self.l2(torch.flatten(z, 1))


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e, self.eb, self.lstm, self.cell = nn.Embedding(10, 8), nn.EmbeddingBag(10, 8), nn.LSTM(8, 8), nn.GRUCell(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a = self.e(ids)
        return self.lstm(a)[0].sum() + self.eb(ids).sum() + self.cell(a[0]).sum()


def _converted_models() -> list[tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    p = Q.prepare_fx(_Mixed().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    p(x)
    ids = torch.randint(0, 10, (3, 4))
    t = Q.quantize_dynamic(_Tables().eval(), {nn.LSTM: Q.get_dynamic_qconfig(), nn.GRUCell: Q.get_dynamic_qconfig()})
    emb = Q.get_embedding_qconfig()
    t = Q.convert(Q.prepare(t, Q.QConfigMapping().set_object_type(nn.Embedding, emb).set_object_type(nn.EmbeddingBag, emb)))
    return [(Q.convert_fx(p), x), (t, ids)]


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_float_casts_keep_a_converted_models_grids(cast):
    # was: Quantize / QFunctional / activation scales cast to fp16 (another grid: outputs moved by up to a quantum),
    # the weighted layers' scales cast there and back (fp16-rounded), Embedding's "weight scales should be dtype Float"
    for q, x in _converted_models():
        ref = q(x)
        dtypes = {k: v.dtype for k, v in q.state_dict().items()}
        getattr(q, cast)()
        assert {k: v.dtype for k, v in q.state_dict().items()} == dtypes
        assert torch.equal(q(x), ref)


def test_a_model_moved_to_meta_names_the_device_and_runs_again_once_loaded():
    # was: "Tensor.item() cannot be called on meta tensors" from deep in Quantize / the kernels
    (q, x), (t, ids) = _converted_models()
    dyn = Q.quantize_dynamic(nn.Sequential(nn.Linear(8, 8)))
    for model, inp, first in ((q, x, "Quantize"), (t, ids, "Embedding"), (dyn, x, "Linear")):
        ref, sd = model(inp), model.state_dict()
        meta = copy.deepcopy(model).to("meta")
        with pytest.raises(RuntimeError, match=rf"^{first}: this module is on the meta device \(moved with .to\('meta'\)\)"):
            meta(inp)
        meta.load_state_dict(sd, assign=True)
        assert torch.equal(meta(inp), ref)
        assert not any("_meta_hook" in m.__dict__ for m in meta.modules())  # the hook went on the first call


def test_eager_prepare_and_convert_name_a_graph_mode_model():
    # was: convert() warned "no prepared module found (run prepare() or prepare_qat() and calibrate first)" and left
    # the observed graph float; prepare() said nothing. torch.ao accepts both silently: a warning, not an error
    x = torch.randn(4, 8)
    p = Q.prepare_fx(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), None, example_inputs=(x,))
    p(x)
    for fn, needle in ((Q.convert, "convert(): this Sequential comes from prepare_fx"),
                       (lambda m: Q.prepare(m, Q.get_default_qconfig()), "prepare(): this Sequential comes from prepare_fx")):
        with pytest.warns(UserWarning, match=r"calibrate it and call convert_fx") as caught:
            fn(p)
        assert needle in str(caught[0].message) and not any("no prepared module" in str(w.message) for w in caught)
    q = Q.convert_fx(p)
    with pytest.warns(UserWarning, match=r"prepare\(\): this \w+ was converted by convert_fx"):
        Q.prepare(q, Q.get_default_qconfig())


def test_custom_config_dicts_refuse_an_unknown_quant_type_with_an_empty_mapping():
    from lowbit.custom_config import ConvertCustomConfig, PrepareCustomConfig

    # was accepted and ignored when its mapping was empty (torch.ao's from_dict refuses the name)
    with pytest.raises(ValueError, match=r"PrepareCustomConfig.from_dict: quant_type='weird' is not supported"):
        PrepareCustomConfig.from_dict({"float_to_observed_custom_module_class": {"weird": {}}})
    with pytest.raises(ValueError, match=r"ConvertCustomConfig.from_dict: quant_type='statc' is not supported"):
        ConvertCustomConfig.from_dict({"observed_to_quantized_custom_module_class": {"statc": {}}})
    PrepareCustomConfig.from_dict({"float_to_observed_custom_module_class": {"static": {}}})
    ConvertCustomConfig.from_dict({"observed_to_quantized_custom_module_class": {"dynamic": {}, "qat": {}}})
