"""Decoder blocks of a causal LM, run one at a time on cached calibration inputs.

Sequential (block-by-block) calibration quantizes block ``i`` on the hidden states that the
*already quantized* blocks ``0..i-1`` produce, so each block's rounding compensates for its
predecessors' (GPTQ paper §"Step 3"; AWQ does the same). The pieces:

- ``decoder_layers(model)``: the ``nn.ModuleList`` of blocks (``model.layers`` of HF Llama/Mistral/
  Qwen, ``transformer.h`` of GPT-2, ...).
- ``capture_block_inputs(model, layers, calib)``: for every calibration batch, the hidden states
  entering block 0 and the keyword arguments the model passes to its blocks (rotary embeddings,
  attention mask). Only the embedding runs; a pre-hook on block 0 stops the forward.
- ``linear_groups(block, inp, kw)``: the block's ``nn.Linear``s in call order, grouped by the
  tensor they read (``[q, k, v], [o], [gate, up], [down]`` for Llama): the true-sequential order.

>>> import torch
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__(); self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
...     def forward(self, x, scale=1.0):
...         return self.c(self.a(x) * self.b(x)) * scale
>>> linear_groups(Block(), torch.randn(2, 8), {})
[['a', 'b'], ['c']]
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..batches import real_rows

__all__ = ["decoder_layers", "capture_block_inputs", "linear_groups", "run_block", "StopForward", "check_llm_calib",
           "check_has_linears", "token_mask", "linear_rows", "generation_positions"]

_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "layers")


class StopForward(Exception):
    """Raised by a hook to end a forward pass early (caught by the runners here)."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder blocks of a causal LM (first match of ``_LAYER_PATHS``)."""
    for path in _LAYER_PATHS:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, nn.ModuleList) and len(m):
            return m
    raise ValueError(f"lowbit.llm: {type(model).__name__} has no decoder block list at any of {_LAYER_PATHS}")


def check_has_linears(model: nn.Module, layers: nn.ModuleList, fn: str) -> None:
    """``ValueError`` when ``layers`` hold no ``nn.Linear`` (GPT-2's ``Conv1D``): the result would be the float model."""
    if any(type(m) is nn.Linear for m in layers.modules()):
        return
    done = sorted({type(m).__name__ for m in layers.modules() if type(m).__module__.startswith("lowbit.")
                   and hasattr(m, "in_features")})
    if done:  # (a second quantize_llm / quantize_w8a8 on its own output said only "no nn.Linear to quantize")
        raise ValueError(f"{fn}: the decoder blocks of {type(model).__name__} are quantized already (their Linears "
                         f"are {', '.join(done)}); pass the float model")
    kinds = sorted({type(m).__name__ for m in layers.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                    and m.weight.dim() == 2})
    raise ValueError(f"{fn}: the decoder blocks of {type(model).__name__} hold no nn.Linear to quantize"
                     + (f" (their matrices are in {', '.join(kinds)})" if kinds else "")
                     + "; nothing would change")


def _check_ids(ids: Any, where: str, vocab: int | None) -> None:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{where}: token ids must be an integer tensor, got "
                        + (f"dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__))
    if ids.dtype not in (torch.int64, torch.int32):  # uint8 / int16 ids failed inside the embedding's index check
        raise TypeError(f"{where}: token ids must be int64 or int32 (the index types of an embedding), got dtype "
                        f"{ids.dtype}; convert them with .long()")
    if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"{where}: token ids must be (batch, tokens) or (tokens,) with at least one token, "
                         f"got shape {tuple(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"{where}: token ids span [{lo}, {hi}], outside the model's vocabulary [0, {vocab})")


def _check_mask(b: dict[str, Any], where: str) -> None:
    """A dict batch's ``attention_mask``: 0/1 values of the batch's ``(batch, tokens)`` shape, one real token at least."""
    m = b.get("attention_mask")
    if m is None:
        return
    ref = b.get("input_ids", b.get("inputs_embeds"))
    shape = tuple(ref.shape[:2]) if isinstance(ref, torch.Tensor) and ref.dim() >= 2 else None
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or (shape is not None and tuple(m.shape) != shape):
        raise ValueError(f"{where}: attention_mask must be a (batch, tokens) tensor"
                         + (f" of the input's shape {shape}" if shape else "") + ", got "
                         + (f"shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__))
    if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):
        raise ValueError(f"{where}: attention_mask must hold 1 (real token) and 0 (padding) only")
    if not bool(m.any()):
        raise ValueError(f"{where}: attention_mask is all 0: the batch has no real token to calibrate on")


def token_mask(batch: Any) -> torch.Tensor | None:
    """``(batch, tokens)`` bool, True at real tokens: a dict batch's ``attention_mask`` (``None``: all are real)."""
    m = batch.get("attention_mask") if isinstance(batch, dict) else None
    return None if m is None or bool(m.all()) else m.bool()


def linear_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A Linear's input ``x`` ``(..., K)`` as ``(n, K)`` rows for its statistics: all of them without a ``mask``, those
    of real tokens (``lowbit.batches.real_rows``, ``x`` known to hold token rows) with a ``(batch, tokens)`` one.

    A Linear whose input has neither the batch's ``(batch, tokens)`` leading shape nor its ``batch * tokens`` rows
    flattened (OPT's MLP reads those) is a ``ValueError`` (a routed MoE expert): its padding cannot be told.

    >>> mask = torch.tensor([[True, False], [True, True]])
    >>> linear_rows(torch.ones(2, 2, 3), mask).shape, linear_rows(torch.ones(2, 2, 3), None).shape
    (torch.Size([3, 3]), torch.Size([4, 3]))
    """
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    rows = real_rows(x, mask, token_rows=True)
    if rows is None:
        raise ValueError(f"lowbit.llm: a Linear's input of shape {tuple(x.shape)} does not match the attention_mask "
                         f"{tuple(mask.shape)}: padding cannot be told from real tokens there; calibrate with "
                         "unpadded batches")
    return rows


def check_llm_calib(model: nn.Module, calib: Iterable[Any], fn: str) -> list[Any]:
    """``calib`` as a list after checking every batch: a token-id tensor (integers, ``(batch, tokens)`` or
    ``(tokens,)``, at least one token, ids inside the input embedding's vocabulary) or a dict of model inputs whose
    ``input_ids`` pass the same checks, whose ``attention_mask`` (if any) is 0/1 of their shape with a real token, and
    whose ``inputs_embeds`` are finite; ``ValueError``/``TypeError`` naming
    the batch. A bare tensor for ``calib`` is refused (it would be iterated row by row)."""
    if isinstance(calib, torch.Tensor):
        raise TypeError(f"{fn}: calib must be an iterable of batches (e.g. a list of token-id tensors), got a single "
                        f"tensor of shape {tuple(calib.shape)}; wrap it: [ids]")
    try:
        batches = list(calib)
    except TypeError as e:
        raise TypeError(f"{fn}: calib must be an iterable of batches, got {type(calib).__name__}") from e
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    for i, b in enumerate(batches):
        where = f"{fn}: calib batch {i}"
        if isinstance(b, dict):
            if "input_ids" in b:
                _check_ids(b["input_ids"], where + " input_ids", vocab)
                if b["input_ids"].dim() != 2:  # its other inputs (masks, positions) would need the batch axis too
                    raise ValueError(f"{where}: input_ids of a dict batch must be (batch, tokens), got shape "
                                     f"{tuple(b['input_ids'].shape)}")
            _check_mask(b, where)
            e = b.get("inputs_embeds")
            if isinstance(e, torch.Tensor) and e.is_floating_point() and not bool(torch.isfinite(e).all()):
                raise ValueError(f"{where}: inputs_embeds hold {int((~torch.isfinite(e)).sum())} NaN/Inf values")
        elif isinstance(b, torch.Tensor):
            _check_ids(b, where, vocab)
            if b.dim() == 1:  # (tokens,): one sequence; the decoders' rotary / mask code needs (1, tokens)
                batches[i] = b.unsqueeze(0)
    return batches


def generation_positions(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with the ``position_ids`` HF's ``generate`` gives a padded batch, where it has a mask and none.

    A model's own forward numbers the tokens ``0..T-1`` whatever the ``attention_mask`` (Llama, GPT-BigCode ...),
    so with left padding a real token sits at its padded position; ``generate`` (and so deployment) numbers real
    tokens from the mask: ``cumsum(mask) - 1``, padding at 0. Rotary attention cannot tell (it sees position
    differences), but learned absolute positions (GPT-BigCode's ``wpe``) gave every statistic other activations than
    the model's. Left as they are: batches with ``position_ids``, no mask, or a forward with no ``position_ids``.
    """
    m = batch.get("attention_mask")
    if "position_ids" in batch or not isinstance(m, torch.Tensor) or bool(m.all()):
        return batch
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return batch
    if "position_ids" not in params or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return batch
    pos = m.long().cumsum(-1) - 1  # (batch, tokens), as transformers' _prepare_position_ids_for_generation
    return {**batch, "position_ids": pos.masked_fill(m == 0, 0)}


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``use_cache`` (by name or ``**kwargs``): a forward of one's own without it
    raised "forward() got an unexpected keyword argument 'use_cache'" from inside the capture."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _call(model: nn.Module, batch: Any) -> None:
    cache = {"use_cache": False} if _takes_use_cache(model) else {}
    if isinstance(batch, dict):
        model(**{**cache, **generation_positions(model, batch)})
    elif isinstance(batch, torch.Tensor):
        model(batch, **cache)
    else:
        raise TypeError(f"lowbit.llm: a calibration batch must be a token-id tensor or a dict of model inputs, "
                        f"got {type(batch).__name__}")


@torch.no_grad()
def capture_block_inputs(model: nn.Module, layers: nn.ModuleList, calib: Iterable[Any]
                         ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """``[(hidden_states, block_kwargs)]``, one per batch of ``calib``, as they enter ``layers[0]``."""
    store: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kw = dict(kwargs)
        x = args[0] if args else kw.pop("hidden_states")
        store.append((x.detach(), kw))
        raise StopForward

    h = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in calib:
            try:
                _call(model, batch)
            except StopForward:
                pass
    finally:
        h.remove()
    return store


def run_block(block: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    """``block(x, **kw)`` as a tensor (blocks that return tuples give their first element)."""
    try:
        out = block(x, **kw)
    except StopForward:
        return x
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def linear_groups(block: nn.Module, x: torch.Tensor, kw: dict[str, Any]) -> list[list[str]]:
    """Names of ``block``'s ``nn.Linear`` modules in call order, consecutive readers of one tensor grouped."""
    order: list[tuple[str, torch.Tensor]] = []
    lins = {n: m for n, m in block.named_modules() if type(m) is nn.Linear}

    def hook(name: str):
        def fn(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if all(n != name for n, _ in order):
                order.append((name, args[0]))
        return fn

    hs = [m.register_forward_pre_hook(hook(n)) for n, m in lins.items()]
    try:
        run_block(block, x, kw)
    finally:
        for h in hs:
            h.remove()
    groups: list[list[str]] = []
    prev: torch.Tensor | None = None
    for n, t in order:
        if prev is not None and t is prev:
            groups[-1].append(n)
        else:
            groups.append([n])
        prev = t
    return groups
