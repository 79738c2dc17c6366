"""Traceable twins of torch's transformer modules, swapped in by ``prepare_fx`` (``swap_attention``).

torch.fx keeps ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, ``nn.TransformerEncoder``
/ ``Decoder`` and ``nn.Transformer`` leaves (torch modules; the forwards' fast-path checks cannot be traced anyway), so
their Linears stayed float. ``swap_attention`` replaces each module of exactly these types that has a qconfig
(bottom-up) by a twin running the module's own slow path: the attention as
``lowbit.fx.attention.TracedMultiheadAttention``, the layers and stacks with the *same* children (``linear1``,
``norm1``, ``layers.0`` ...) and forwards traceable by torch.fx. The graph machinery then quantizes the projections
and FFN Linears as any Linear (a ReLU activation fused into ``linear1``); softmax, LayerNorm, GELU and the residual
adds stay float. The swap runs before the qconfigs are propagated: the twin gets the qconfig its module resolves to (an
``nn.MultiheadAttention`` type setting too), its new Linears resolve theirs from the mapping (module names such as
``mha.linear_Q``, the ``nn.Linear`` type) or inherit it. Modules of these types that stay as they were (a subclass, a declared
non-traceable or custom module, qconfig ``None``) are float; the first two are named in a warning.

State-dict keys: a layer's keys are kept but for its attention: ``in_proj_weight`` / ``in_proj_bias`` (or
``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``) become ``linear_Q`` / ``linear_K`` / ``linear_V``
``.weight`` / ``.bias`` (torch.ao's quantizable MHA's names); ``out_proj``, ``bias_k``, ``bias_v`` keep theirs. Load a
float checkpoint into the float model before ``prepare_fx``.

Departure: a ``TransformerEncoder`` whose fast path ran on a nested tensor (eval, a padding mask) returns zeros at the
padded positions; the twin computes them like the module's own path (valid positions agree).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor, nn

from ..qconfig import QConfigMapping
from .attention import TracedMultiheadAttention

__all__ = ["TracedEncoderLayer", "TracedDecoderLayer", "TracedEncoder", "TracedDecoder", "TracedTransformer",
           "swap_attention"]


def _adopt(twin: nn.Module, mod: nn.Module, attrs: tuple[str, ...]) -> nn.Module:
    """``twin`` holding ``mod``'s children (same objects, same names and order) and the plain ``attrs``."""
    for name, child in mod._modules.items():  # (a None child, an encoder's absent norm, too)
        twin.add_module(name, child)
    for a in attrs:
        if a in mod.__dict__ or hasattr(mod, a):
            value = getattr(mod, a)
            if not isinstance(value, nn.Module):
                setattr(twin, a, value)
    twin.train(mod.training)
    return twin


class TracedEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer``'s slow path (``norm_first`` either way; activation relu / gelu / callable)."""

    @classmethod
    def from_float(cls, mod: nn.TransformerEncoderLayer) -> TracedEncoderLayer:
        return _adopt(cls(), mod, ("norm_first", "activation"))  # type: ignore[return-value]

    def _sa_block(self, x: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        return self.dropout1(self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                            need_weights=False, is_causal=is_causal)[0])

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))


class TracedDecoderLayer(nn.Module):
    """``nn.TransformerDecoderLayer``'s forward (self attention, attention on ``memory``, feed-forward)."""

    @classmethod
    def from_float(cls, mod: nn.TransformerDecoderLayer) -> TracedDecoderLayer:
        return _adopt(cls(), mod, ("norm_first", "activation"))  # type: ignore[return-value]

    def _sa_block(self, x: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        return self.dropout1(self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                            is_causal=is_causal, need_weights=False)[0])

    def _mha_block(self, x: Tensor, mem: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        return self.dropout2(self.multihead_attn(x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                                 is_causal=is_causal, need_weights=False)[0])

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                tgt_is_causal: bool = False, memory_is_causal: bool = False) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
        return self.norm3(x + self._ff_block(x))


class TracedEncoder(nn.Module):
    """``nn.TransformerEncoder``'s slow path: each of ``layers``, then ``norm``. ``is_causal`` is a hint (the mask is
    applied)."""

    @classmethod
    def from_float(cls, mod: nn.TransformerEncoder) -> TracedEncoder:
        return _adopt(cls(), mod, ("num_layers", "norm"))  # type: ignore[return-value]

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, is_causal=bool(is_causal), src_key_padding_mask=src_key_padding_mask)
        return out if self.norm is None else self.norm(out)


class TracedDecoder(nn.Module):
    """``nn.TransformerDecoder``'s forward: each of ``layers`` on ``memory``, then ``norm``."""

    @classmethod
    def from_float(cls, mod: nn.TransformerDecoder) -> TracedDecoder:
        return _adopt(cls(), mod, ("num_layers", "norm"))  # type: ignore[return-value]

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                tgt_is_causal: bool | None = None, memory_is_causal: bool = False) -> Tensor:
        out = tgt
        for layer in self.layers:
            out = layer(out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
        return out if self.norm is None else self.norm(out)


class TracedTransformer(nn.Module):
    """``nn.Transformer``'s forward: ``encoder`` on ``src``, ``decoder`` on ``tgt`` and its memory."""

    @classmethod
    def from_float(cls, mod: nn.Transformer) -> TracedTransformer:
        return _adopt(cls(), mod, ("d_model", "nhead", "batch_first"))  # type: ignore[return-value]

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                src_is_causal: bool | None = None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False) -> Tensor:
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


TWINS: dict[type, Any] = {nn.MultiheadAttention: TracedMultiheadAttention,
                          nn.TransformerEncoderLayer: TracedEncoderLayer, nn.TransformerDecoderLayer: TracedDecoderLayer,
                          nn.TransformerEncoder: TracedEncoder, nn.TransformerDecoder: TracedDecoder,
                          nn.Transformer: TracedTransformer}
_FAMILY = tuple(TWINS)


def _resolved(model: nn.Module, mapping: QConfigMapping) -> dict[int, Any]:
    """Each module's qconfig as ``propagate_qconfig_`` will set it (own attribute > mapping > parent), by id."""
    out: dict[int, Any] = {}
    exact = mapping.resolution == "exact"

    def walk(mod: nn.Module, name: str, inherited: Any) -> None:
        qc = mod.__dict__.get("qconfig", _MISSING) if not exact else _MISSING
        if qc is _MISSING and name == "" and not exact and (mapping.global_qconfig is not None
                                                            or "" in mapping.module_name_qconfigs):
            qc = mapping.module_name_qconfigs.get("", mapping.global_qconfig)
        if qc is _MISSING:
            qc = mapping.resolve(name, type(mod), inherited)
        out[id(mod)] = qc
        for cname, child in mod.named_children():
            walk(child, f"{name}.{cname}" if name else cname, qc)

    walk(model, "", mapping.global_qconfig)
    return out


_MISSING = object()


def swap_attention(model: nn.Module, mapping: QConfigMapping, leaves: tuple[set[int], set[type]],
                   fn: str) -> nn.Module:
    """``model`` with its transformer modules swapped for their twins (in place; a swapped root is returned), before
    ``propagate_qconfig_`` (so ``set_module_name`` may name the twins' Linears, ``mha.linear_Q``): each twin gets the
    qconfig its module resolves to as its own. ``leaves``: the ids and classes the user declared non-traceable or
    custom (kept as they are)."""
    qconfigs = _resolved(model, mapping)
    kept: list[str] = []

    def walk(mod: nn.Module, path: str) -> nn.Module:
        for name, child in list(mod.named_children()):
            new = walk(child, f"{path}.{name}" if path else name)
            if new is not child:
                mod._modules[name] = new
        declared = id(mod) in leaves[0] or type(mod) in leaves[1]
        if not isinstance(mod, _FAMILY) or declared or qconfigs[id(mod)] is None:
            return mod
        if type(mod) not in TWINS:
            kept.append(f"'{path or '<root>'}' ({type(mod).__name__})")
            return mod
        twin = TWINS[type(mod)].from_float(mod)
        twin.qconfig = qconfigs[id(mod)]
        return twin

    out = walk(model, "")
    if kept:
        warnings.warn(f"{fn}: {', '.join(kept)} stay float: only modules of exactly torch's types "
                      f"({', '.join(t.__name__ for t in TWINS)}) are traced into (a subclass may change the forward)",
                      stacklevel=4)
    return out
