"""``TracedMultiheadAttention``: ``nn.MultiheadAttention`` as torch.fx can trace it, with its projections as Linears.

torch.fx keeps ``nn.MultiheadAttention`` a leaf (its forward's fast-path checks cannot be traced), so graph mode left
all of it float. ``prepare_fx`` swaps each one (``lowbit.fx.transformer.swap_attention``) for this twin, built from
the same weights: ``linear_Q`` / ``linear_K`` / ``linear_V`` (the rows of ``in_proj_weight``, or ``q_proj_weight`` /
``k_proj_weight`` / ``v_proj_weight`` when ``kdim`` / ``vdim`` differ; ``in_proj_bias`` split in three) and
``out_proj`` are plain ``nn.Linear`` modules, quantized like any Linear; the rest is the module's own slow path
(``F.multi_head_attention_forward`` with ``need_weights=True``) in three float functions that the trace keeps whole
(``graph_leaf``, also through pickling): ``attention_probs`` (heads, ``bias_k``, zero attention, masks bool or float, softmax),
``attention_context`` (``bias_v``, zero attention, probabilities times values) and ``attention_weights`` (the
returned weights, averaged over heads or not). Attention dropout is the child ``attn_dropout``. Batch first or not,
unbatched inputs, ``add_bias_kv``, ``add_zero_attn``, bias or not are all kept; the names follow torch.ao's eager
``torch.ao.nn.quantizable.MultiheadAttention`` (``linear_Q`` ...). ``is_causal`` is a hint, as in torch: the mask
given is applied (torch's ``need_weights=False`` path may use the causal kernel instead: the same numbers when the
mask is causal), and ``is_causal=True`` without a mask is refused as torch refuses it.

>>> import torch
>>> from torch import nn
>>> mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
>>> twin = TracedMultiheadAttention.from_float(mha)
>>> x = torch.randn(2, 3, 8)
>>> bool(torch.allclose(twin(x, x, x)[0], mha(x, x, x)[0], atol=1e-6))
True
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compile_state import graph_leaf

__all__ = ["TracedMultiheadAttention", "attention_probs", "attention_context", "attention_weights"]


def _seq_first(x: Tensor, batch_first: bool, batched: bool) -> Tensor:
    """``(L, N, E)`` from the input layout: ``(N, L, E)`` when batch first, ``(L, E)`` unbatched."""
    if not batched:
        return x.unsqueeze(1)
    return x.transpose(0, 1) if batch_first else x


def _to_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(S, N, E)`` -> ``(N * heads, S, E / heads)``, as torch's slow path."""
    s, n, e = x.shape
    return x.reshape(s, n * num_heads, e // num_heads).transpose(0, 1)


def _zeros_row(x: Tensor) -> Tensor:
    return torch.cat([x, torch.zeros((x.shape[0], 1, x.shape[2]), dtype=x.dtype, device=x.device)], dim=1)


def _check_mask(attn_mask: Tensor, tgt_len: int, src_len: int, rows: int) -> Tensor:
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (tgt_len, src_len):
            raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be "
                               f"{(tgt_len, src_len)}.")
        return attn_mask.unsqueeze(0)
    if attn_mask.dim() == 3:
        if tuple(attn_mask.shape) != (rows, tgt_len, src_len):
            raise RuntimeError(f"The shape of the 3D attn_mask is {tuple(attn_mask.shape)}, but should be "
                               f"{(rows, tgt_len, src_len)}.")
        return attn_mask
    raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")


@graph_leaf
def attention_probs(q: Tensor, k: Tensor, bias_k: Tensor | None, key_padding_mask: Tensor | None,
                    attn_mask: Tensor | None, num_heads: int, batch_first: bool, add_zero_attn: bool,
                    is_causal: bool) -> Tensor:
    """Softmax of the scaled scores, ``(N * heads, L, S)``, from the projected queries and keys (input layout)."""
    batched = q.dim() == 3
    q, k = _seq_first(q, batch_first, batched), _seq_first(k, batch_first, batched)
    if not batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = q.shape
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=q.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=q.dtype, check_other=False)
    if attn_mask is not None:
        attn_mask = _check_mask(attn_mask, tgt_len, k.shape[0], bsz * num_heads)
    if bias_k is not None:
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    q, k = _to_heads(q, num_heads), _to_heads(k, num_heads)
    if add_zero_attn:
        k = _zeros_row(k)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src_len = k.shape[1]
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            raise RuntimeError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                               f"{tuple(key_padding_mask.shape)}")
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                            .reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    q_scaled = q * math.sqrt(1.0 / float(q.shape[2]))
    if attn_mask is not None:
        scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
    else:
        scores = torch.bmm(q_scaled, k.transpose(-2, -1))
    return F.softmax(scores, dim=-1)


@graph_leaf
def attention_context(probs: Tensor, v: Tensor, bias_v: Tensor | None, num_heads: int, batch_first: bool,
                      add_zero_attn: bool, batched_like: Tensor) -> Tensor:
    """``probs @ values`` with the heads merged back, in the input layout (``batched_like``: the query)."""
    batched = batched_like.dim() == 3
    v = _seq_first(v, batch_first, batched)
    bsz, embed_dim = v.shape[1], v.shape[2]
    if bias_v is not None:
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
    v = _to_heads(v, num_heads)
    if add_zero_attn:
        v = _zeros_row(v)
    out = torch.bmm(probs, v).transpose(0, 1).reshape(probs.shape[1], bsz, embed_dim)
    if not batched:
        return out.squeeze(1)
    return out.transpose(0, 1) if batch_first else out


@graph_leaf
def attention_weights(probs: Tensor, need_weights: bool, num_heads: int, average: bool,
                      batched_like: Tensor) -> Tensor | None:
    """The weights ``nn.MultiheadAttention`` returns: ``(N, heads, L, S)``, or averaged over the heads; ``None``
    without ``need_weights`` (a call argument: a model calling the twin as its root passes it as an input)."""
    if not need_weights:
        return None
    rows, tgt_len, src_len = probs.shape
    weights = probs.view(rows // num_heads, num_heads, tgt_len, src_len)
    if average:
        weights = weights.mean(dim=1)
    return weights if batched_like.dim() == 3 else weights.squeeze(0)


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    return lin


class TracedMultiheadAttention(nn.Module):
    """See the module docstring. ``forward`` takes ``nn.MultiheadAttention.forward``'s arguments."""

    def __init__(self, linear_q: nn.Linear, linear_k: nn.Linear, linear_v: nn.Linear, out_proj: nn.Linear,
                 num_heads: int, dropout: float = 0.0, batch_first: bool = False, add_zero_attn: bool = False,
                 bias_k: Tensor | None = None, bias_v: Tensor | None = None) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = linear_q.out_features, num_heads
        self.kdim, self.vdim = linear_k.in_features, linear_v.in_features
        self.head_dim = self.embed_dim // num_heads
        self.batch_first, self.add_zero_attn, self.dropout = batch_first, add_zero_attn, dropout
        self.linear_Q, self.linear_K, self.linear_V, self.out_proj = linear_q, linear_k, linear_v, out_proj
        self.bias_k = None if bias_k is None else nn.Parameter(bias_k.detach().clone(), bias_k.requires_grad)
        self.bias_v = None if bias_v is None else nn.Parameter(bias_v.detach().clone(), bias_v.requires_grad)
        self.attn_dropout = nn.Dropout(dropout)

    @classmethod
    def from_float(cls, mod: nn.MultiheadAttention) -> TracedMultiheadAttention:
        """The twin of ``mod`` (its weights copied; ``mod`` is left as it was)."""
        if (mod.bias_k is None) != (mod.bias_v is None):
            raise ValueError("prepare_fx: nn.MultiheadAttention with only one of bias_k / bias_v set cannot be "
                             "traced (torch's forward refuses it too)")
        e = mod.embed_dim
        if mod._qkv_same_embed_dim:
            w_q, w_k, w_v = mod.in_proj_weight[:e], mod.in_proj_weight[e:2 * e], mod.in_proj_weight[2 * e:]
        else:
            w_q, w_k, w_v = mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight
        b = [None] * 3 if mod.in_proj_bias is None else list(mod.in_proj_bias.chunk(3))
        twin = cls(_linear(w_q, b[0]), _linear(w_k, b[1]), _linear(w_v, b[2]),
                   _linear(mod.out_proj.weight, mod.out_proj.bias), mod.num_heads, float(mod.dropout),
                   bool(mod.batch_first), bool(mod.add_zero_attn), mod.bias_k, mod.bias_v)
        twin.train(mod.training)
        return twin

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Any]:
        q, k, v = self.linear_Q(query), self.linear_K(key), self.linear_V(value)
        probs = attention_probs(q, k, self.bias_k, key_padding_mask, attn_mask, self.num_heads, self.batch_first,
                                self.add_zero_attn, is_causal)
        probs = self.attn_dropout(probs)
        out = self.out_proj(attention_context(probs, v, self.bias_v, self.num_heads, self.batch_first,
                                              self.add_zero_attn, query))
        return out, attention_weights(probs, need_weights, self.num_heads, average_attn_weights, query)
