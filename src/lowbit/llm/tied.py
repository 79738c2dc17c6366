"""Quantized output projection (``lm_head``) and an embedding that shares its codes (the tie kept).

A causal LM with tied embeddings stores one ``(V, D)`` matrix ``E`` used twice: rows are looked up
(``embed(ids) = E[ids]``) and the logits are ``h @ Eᵀ``. ``quantize_head`` turns ``lm_head`` into a
``WeightOnlyLinear`` (int8 per row: ``ŵ[v] = q[v] · s_v``; or int4 groups) and, when tied, replaces the
embedding by a ``TiedEmbedding`` that holds *the same* module, dequantizing only the looked-up rows::

    embed(ids)[t] = (q[ids_t] - z[ids_t]) * s[ids_t]        # row-wise, groups of g columns

so the checkpoint holds one copy (the codes are in the ``state_dict`` once, under the head's name) and decoding reads
the quantized matrix for the logits. An untied embedding is left float (it is a lookup: it costs
memory, not time).

>>> import torch
>>> from torch import nn
>>> emb = nn.Embedding(64, 32); head = nn.Linear(32, 64, bias=False); head.weight = emb.weight
>>> model = nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
>>> _ = quantize_head(model, bits=8)
>>> e = model["embed_tokens"]
>>> e.head is model["lm_head"], bool((e(torch.tensor([3])) - emb.weight[3]).abs().max() < 0.02)
(True, True)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.quantized.embedding import _unpack4
from ..nn.quantized.weight_only import WeightOnlyLinear, fit_group_size

__all__ = ["TiedEmbedding", "quantize_head", "find_head"]


class TiedEmbedding(nn.Module):
    """An embedding lookup on the codes of a ``WeightOnlyLinear`` ``head`` ``(V, D)`` (shared, not copied)."""

    def __init__(self, head: WeightOnlyLinear, padding_idx: int | None = None, dtype: torch.dtype = torch.float32
                 ) -> None:
        super().__init__()
        if not isinstance(head, WeightOnlyLinear):
            raise TypeError(f"TiedEmbedding: head must be a WeightOnlyLinear, got {type(head).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"TiedEmbedding: dtype={dtype!r} must be a floating-point torch.dtype")
        # the head is the model's lm_head module, held here as a plain reference, not a submodule: a state dict with
        # its codes under two names shares storages, which safetensors and HF save_pretrained refuse (the tied
        # checkpoint could not be saved); it has them once, under the head's own name
        object.__setattr__(self, "head", head)
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        # the dtype of the vectors looked up, as nn.Embedding's weight gives it: an empty float buffer, so that
        # .half() / .to(torch.bfloat16) of the model change it (the lookups were float32 whatever the model's dtype,
        # and ran the whole residual stream of a half model in float32); not in the state_dict
        self.register_buffer("_out", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            raise TypeError(f"TiedEmbedding: ids must be an integer tensor, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        h, flat = self.head, ids.reshape(-1)
        rows = F.embedding(flat, h.qweight)  # (T, D/2) packed or (T, D)
        q = _unpack4(rows, h.in_features, h.qdtype.signed) if h.bits == 4 else rows
        s, z = h.scales[flat], h.zero_points[flat].float()  # (T, G)
        # (the group count spelled out: a -1 is ambiguous for no ids, and an empty batch raised in reshape)
        e = (q.float().reshape(flat.numel(), h.in_features // h._g, h._g) - z[..., None]) * s[..., None]
        return e.reshape(*ids.shape, h.in_features).to(self._out.dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> TiedEmbedding:
        # .to() / .half() of the embedding alone move the head it reads too (in a model the head gets them as lm_head)
        if recurse:
            self.head._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # checkpoints written while the head was a submodule hold its codes under "<prefix>head." too: the same
        # tensors as the head's own keys, which load them; dropped here rather than reported as unexpected
        for key in [k for k in state_dict if k.startswith(prefix + "head.")]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to a {self.head.bits}-bit head"


def find_head(model: nn.Module) -> tuple[str, str | None]:
    """``(lm_head name, tied embedding name or None)`` of a causal LM."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    if out is None:
        out = next((m for n, m in model.named_modules() if n.split(".")[-1] == "lm_head"), None)
    if emb is None:
        emb = next((m for n, m in model.named_modules() if n.split(".")[-1] in ("embed_tokens", "wte")), None)
    if isinstance(out, WeightOnlyLinear):
        raise ValueError(f"lowbit.llm: the output projection of {type(model).__name__} is a {out.bits}-bit "
                         "WeightOnlyLinear: the model is quantized already; pass the float model")
    if not isinstance(out, nn.Linear):
        raise ValueError(f"lowbit.llm: no nn.Linear output projection (lm_head) found in {type(model).__name__}")
    tied = isinstance(emb, nn.Embedding) and emb.weight is out.weight
    return names[id(out)], names[id(emb)] if tied else None


@torch.no_grad()
def quantize_head(model: nn.Module, bits: int = 8, group_size: int | None = None, symmetric: bool = True) -> nn.Module:
    """``lm_head`` -> ``WeightOnlyLinear`` (``bits=8``: per row; 4: groups), a tied embedding -> ``TiedEmbedding``.

    ``group_size`` (4 bits): a given size must divide ``in_features`` (else ``ValueError``); ``None`` is 128, or the
    largest ``128 / 2^j >= 8`` dividing ``in_features``, or per channel, with a warning when it is not 128."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):  # (4.0 passed "in (4, 8)")
        raise ValueError(f"quantize_head: bits={bits!r} must be 4 or 8")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or not (group_size == -1 or group_size >= 1)):
        raise ValueError(f"quantize_head: group_size={group_size!r} must be an int >= 1, or -1 (one group per row)")
    head_name, emb_name = find_head(model)
    lin = model.get_submodule(head_name)
    k = lin.in_features
    if bits == 8:
        g = -1
    elif group_size is None:  # (a halving loop of its own went down to groups of 2 or 1: a scale per 1-2 int4 codes)
        g = fit_group_size(k, 128)
        if g != 128:
            warnings.warn(f"quantize_head: the default group size 128 does not divide {head_name}'s {k} features; "
                          f"using {'per channel' if g == -1 else f'group size {g}'}", stacklevel=3)
    elif group_size != -1 and k % group_size:
        raise ValueError(f"quantize_head: group_size={group_size} does not divide {head_name}'s in_features={k} "
                         "(pass a divisor, -1 for per channel, or None to adapt 128 with a warning)")
    else:
        g = group_size
    q = WeightOnlyLinear.from_float(lin, bits, g, symmetric if bits == 4 else True, "rtn" if bits == 8 else "mse")
    emb = model.get_submodule(emb_name) if emb_name else None
    for name, new in ((head_name, q), *(((emb_name, TiedEmbedding(q, emb.padding_idx, emb.weight.dtype)),)
                                        if emb is not None else ())):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if emb_name and hasattr(model, "config"):  # HF would re-tie a float embedding on save/resize: the tie is ours now
        model.config.tie_word_embeddings = False
    return model
