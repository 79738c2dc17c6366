"""Tiny random HF decoders for the LLM tests (no download): norms perturbed so that a wrong fold into them shows."""

from __future__ import annotations

import torch


def random_norms(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` in eval mode, frozen, its 1-d parameters (norm weights) moved by N(0, 0.2²): they start at 0 (Gemma's
    ``1 + w``) or 1, where a fold's mistakes would not show."""
    torch.manual_seed(1)
    for p in m.parameters():
        if p.dim() == 1:
            p.data.add_(torch.randn_like(p) * 0.2)
    return m.eval().requires_grad_(False)


def gemma3() -> torch.nn.Module:
    """A 2-layer Gemma-3 text model (hidden 64, sliding window 16)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, sliding_window=16)
    return random_norms(transformers.Gemma3ForCausalLM(cfg))


def block_input_stats(m: torch.nn.Module, calib: list) -> object:
    """The first decoder block's Linear input statistics as GPTQ collects them (padding masked by ``token_mask``)."""
    from lowbit.llm import blocks as B
    from lowbit.llm.sequential import _input_stats

    layers = B.decoder_layers(m)
    calib = B.check_llm_calib(m, calib, "t")
    inps = B.capture_block_inputs(m, layers, calib)
    names = [g[0] for g in B.linear_groups(layers[0], *inps[0])]
    return _input_stats(layers[0], names, None, inps, [B.token_mask(b) for b in calib], 1, None, True)
