"""LLM quantization: block-by-block GPTQ/AWQ (``quantize_llm``), tied int8/int4 heads, W8A8, distributed calibration.

Modules: ``blocks`` (decoder blocks, cached inputs, true-sequential groups), ``awq`` (activation-aware
scales), ``sequential`` (``quantize_llm``), ``refine`` (scale re-fit after GPTQ), ``tied`` (``lm_head`` +
tied embedding), ``dist`` (exact multi-rank statistics), ``w8a8`` (dynamic per-token int8 activations with
SmoothQuant migration).
"""

from __future__ import annotations

from torch import nn

from .awq import awq_fold, awq_search, awq_search_stats
from .blocks import capture_block_inputs, decoder_layers, linear_groups
from .dist import shard
from .refine import refine_scales
from .sequential import quantize_llm
from .tied import TiedEmbedding, quantize_head
from .w8a8 import DynamicInt8Linear, quantize_w8a8

__all__ = ["quantize_llm", "quantize_head", "TiedEmbedding", "awq_search", "awq_search_stats", "awq_fold",
           "refine_scales", "decoder_layers", "capture_block_inputs", "linear_groups", "shard", "toy_llama",
           "DynamicInt8Linear", "quantize_w8a8"]


def toy_llama(layers: int = 2, hidden: int = 64, vocab: int = 128, seed: int = 0) -> nn.Module:
    """A small random ``LlamaForCausalLM`` (tied embeddings, grouped-query attention) for tests and examples."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError(f"toy_llama needs transformers: pip install transformers ({e})") from e
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + hidden // 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()
