"""lowbit.llm: GPTQ scale refinement (refine.py) and AWQ's statistics-based search (awq.py) against their math."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q
from lowbit.llm.awq import _rtn, awq_search_stats
from lowbit.llm.refine import output_error, refine_scales
from lowbit.nn.quantized.weight_only import gptq_quantize, quantize_groups, weight_qdtype

torch.set_num_threads(1)


def problem(seed, loud, n=256, k=64, rows=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) @ torch.randn(k, k, generator=g) * 0.3
    x[:, :4] *= loud  # outlier channels, as in LLM activations
    return x, torch.randn(rows, k, generator=g)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), loud=st.floats(1.0, 30.0), sym=st.booleans(), gptq=st.booleans())
def test_refine_scales_never_raises_the_output_error(seed, loud, sym, gptq):
    x, w = problem(seed, loud)
    H, qd = x.T @ x, weight_qdtype(4, sym)
    q, s, z = gptq_quantize(w, H, 16, qd, sym, act_order=True) if gptq else quantize_groups(w, 16, qd, sym)
    s2, f = refine_scales(w, H, q, s, z, 16)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(f, f[1:])), f
    assert bool((s2 > 0).all()) and s2.shape == s.shape
    # the tracked objective is the true one of the new scales
    assert output_error(w, H, q, s2, z, 16) == pytest.approx(f[-1], rel=1e-6)
    assert f[0] == pytest.approx(output_error(w, H, q, s, z, 16), rel=1e-9)


def test_refine_scales_rejects_mismatched_shapes():
    x, w = problem(0, 1.0)
    q, s, z = quantize_groups(w, 16, weight_qdtype(4, True), True)
    with pytest.raises(ValueError, match="refine_scales"):
        refine_scales(w, x.T @ x, q, s[:, :2], z, 16)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), loud=st.floats(1.0, 30.0), sym=st.booleans())
def test_awq_statistics_give_the_sample_output_error(seed, loud, sym):
    x, w = problem(seed, loud)
    qd = weight_qdtype(4, sym)
    s, alpha, errs = awq_search_stats(w, x.T @ x, x.abs().sum(0), x.shape[0], 16, qd, sym, n_grid=4)
    direct = float(((x / s) @ _rtn(w * s, 16, qd, sym).T - x @ w.T).pow(2).mean())
    assert errs[alpha] == pytest.approx(direct, rel=1e-3, abs=1e-6)
    assert errs[alpha] == min(errs.values())


def test_quantize_llm_refine_keeps_the_first_codes_and_moves_scales():
    m = Q.llm.toy_llama(layers=1, hidden=64)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 128, (1, 48), generator=g) for _ in range(3)]
    kw = dict(bits=4, group_size=32, head=None, damp=0.01, progress=False, awq=False)
    a, b = Q.quantize_llm(m, calib, **kw), Q.quantize_llm(m, calib, refine=True, **kw)
    qa, qb = a.model.layers[0].self_attn.q_proj, b.model.layers[0].self_attn.q_proj
    assert torch.equal(qa.qweight, qb.qweight) and torch.equal(qa.zero_points, qb.zero_points)
    assert not torch.equal(qa.scales, qb.scales)


def test_float_target_fits_the_float_model_better_and_starts_from_the_same_codes():
    m = Q.llm.toy_llama(layers=3, hidden=64)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 128, (1, 64), generator=g) for _ in range(6)]
    kw = dict(bits=4, group_size=32, head=None, damp=0.01, progress=False, awq=False)
    a, b = Q.quantize_llm(m, calib, float_target=False, **kw), Q.quantize_llm(m, calib, float_target=True, **kw)
    # block 0's first group reads the embedding in both streams: X_f = X_q, so V = W and the codes agree
    qa, qb = a.model.layers[0].self_attn.q_proj, b.model.layers[0].self_attn.q_proj
    assert torch.equal(qa.qweight, qb.qweight) and torch.equal(qa.scales, qb.scales)
    with torch.no_grad():
        err = [sum(float((q(x).logits - m(x).logits).pow(2).mean()) for x in calib) for q in (a, b)]
    assert err[1] < 0.5 * err[0], err  # later layers fit X_f Wᵀ: far closer to the float model on its data
