"""``quantize_llm``: block-by-block weight-only quantization of a causal LM (GPTQ, AWQ, clip search).

Per decoder block ``i`` (inputs: the hidden states of the already quantized blocks ``0..i-1``):

1. ``awq``: AWQ per-channel scales for each Linear group whose producer can absorb them (see
   ``lowbit.llm.awq``), searched on the statistics ``(Σ_t w_t x_t x_tᵀ, Σ|x|)`` of every group's input, gathered in
   one pass of the float block over all calibration tokens, and folded in. ``w_t = 1 / mean(y_t²)`` of the float
   block's output ``y``: the next norm divides token ``t``'s residual by its RMS, so the search weighs each token's
   error as the norm will (``_residual_weights``; one more float pass of the block).
2. For each group of Linears in call order (``[q, k, v] -> [o] -> [gate, up] -> [down]``: true-sequential),
   the block runs on all calibration batches with the earlier groups already quantized, and
   ``H = Σ_b X_bᵀ X_b`` of the group's input is accumulated (distributed: summed over ranks in the
   global batch order, bit-identical to one process; see ``lowbit.llm.dist``).
3. The group's weights (stacked by rows) are quantized by GPTQ (``method="gptq"``; act-order with
   static groups; group qparams by ``clip``; the damping ``damp``, default 0.01 — a tuple is searched,
   the value with the least ``tr(ΔW H ΔWᵀ)`` kept) or by rounding (``method="rtn"``), and the Linears become
   ``WeightOnlyLinear``. With several ranks, group ``j`` is quantized on rank ``j % W`` and broadcast.
   ``refine``: after GPTQ, the group scales are re-fitted to ``tr(ΔW H ΔWᵀ)`` with the codes fixed
   (``lowbit.llm.refine``). ``float_target``: a float copy of the block runs on the float model's own
   hidden states beside it, and GPTQ quantizes ``V = W + W (C - H) H⁻¹`` (``C = X_fᵀX_q``) instead of
   ``W``: since ``||X_f Wᵀ - X_q Ŵᵀ||² = ||X_q (V - Ŵ)ᵀ||² + const``, the codes then fit the float
   model's outputs and undo part of the error the quantized predecessors put into ``X_q``.
4. The quantized block runs once more to give block ``i + 1`` its inputs.

``head`` quantizes the output projection too (``"int8"``: per-row int8; ``"int4"``: groups); with tied
embeddings (``lm_head.weight is embed_tokens.weight``) the embedding becomes a ``TiedEmbedding`` on the
same codes, so the tie and its single copy in the file are kept.

>>> import torch, lowbit as Q
>>> from lowbit.llm.blocks import decoder_layers
>>> model = Q.llm.toy_llama()                          # a 2-block Llama with random weights (tests/docs)
>>> calib = [torch.randint(0, 128, (1, 96)) for _ in range(2)]   # 192 tokens: more rows than down_proj's 160 inputs
>>> qm = Q.quantize_llm(model, calib, bits=4, group_size=32, progress=False)
>>> type(decoder_layers(qm)[0].mlp.down_proj).__name__, type(qm.model.embed_tokens).__name__
('WeightOnlyLinear', 'TiedEmbedding')
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..nn.quantized._utils import check_finite_linears
from ..nn.quantized.group_codes import warn_few_rows
from ..nn.quantized.weight_only import (WeightOnlyLinear, check_recipe, fit_group_size, gptq_quantize, quantize_groups,
                                       weight_qdtype)
from .awq import awq_fold, awq_search_stats, scale_source
from .blocks import (StopForward, capture_block_inputs, check_has_linears, check_llm_calib, decoder_layers,
                     linear_groups, linear_rows, run_block, token_mask)
from .dist import agree_calibration, broadcast_tensors, ordered_sum, rank_and_world
from .refine import output_error, refine_scales
from .plan import check_shapes, resolve_group_size
from .tied import find_head, quantize_head

__all__ = ["quantize_llm", "METHODS", "CLIPS"]

METHODS = ("gptq", "rtn")
CLIPS = ("hmse", "mse", "rtn")


def _progress(it: Iterable[Any], desc: str, total: int, on: bool) -> Iterable[Any]:
    if not on:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, total=total, leave=False)


class _Terms:
    """Per-batch statistic terms: summed as they come on one process, kept for ``ordered_sum`` on several."""

    def __init__(self, world: int) -> None:
        self.world, self.terms, self.total = world, [], None

    def add(self, t: torch.Tensor) -> None:
        if self.world > 1:
            self.terms.append(t)
        elif self.total is None:  # ((0 + t_0) + t_1) + ...: the same bits as ordered_sum of the list
            self.total = torch.zeros_like(t).add_(t)
        else:
            self.total += t

    def sum(self, group: Any) -> torch.Tensor:
        return ordered_sum(self.terms, group) if self.world > 1 else self.total


@torch.no_grad()
def _input_stats(block: nn.Module, firsts: list[str], last: str | None, inps: list[tuple[torch.Tensor, dict[str, Any]]],
                 masks: list[torch.Tensor | None], world: int, group: Any, abs_sum: bool = False,
                 weights: list[torch.Tensor] | None = None) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per Linear in ``firsts``: ``(XᵀX,)`` (and ``Σ_t |x_t|`` with ``abs_sum``) of its input over all batches,
    the rows ``x_t`` of real tokens only (``masks[b]``: batch ``b``'s attention mask; ``None``: no padding).
    ``weights[b]`` (one per real token of batch ``b``): ``XᵀX`` becomes ``Σ_t w_t x_t x_tᵀ`` (``Σ|x|`` stays plain)
    for a Linear that reads one row per token (one that reads another row count, such as an expert, gets ``w = 1``).

    The forward stops after Linear ``last`` (``None``: runs the whole block).
    """
    acc = {n: (_Terms(world), _Terms(world)) for n in firsts}
    cur: list[torch.Tensor | None] = [None]
    wcur: list[torch.Tensor | None] = [None]

    def grab(name: str):
        def fn(_m: nn.Module, args: tuple[Any, ...]) -> None:
            x = linear_rows(args[0].detach(), cur[0]).float()
            w = wcur[0]
            acc[name][0].add((x if w is None or w.shape[0] != x.shape[0] else x * w[:, None]).T @ x)
            if abs_sum:
                acc[name][1].add(x.abs().sum(0))
        return fn

    def stop(*_a: Any) -> None:
        raise StopForward

    hs = [block.get_submodule(n).register_forward_pre_hook(grab(n)) for n in firsts]
    if last is not None:
        hs.append(block.get_submodule(last).register_forward_hook(stop))
    try:
        for b, ((x, kw), mask) in enumerate(zip(inps, masks)):
            cur[0], wcur[0] = mask, None if weights is None else weights[b]
            run_block(block, x, kw)
    finally:
        for h in hs:
            h.remove()
    return {n: (a.sum(group), b.sum(group)) if abs_sum else (a.sum(group),) for n, (a, b) in acc.items()}


@torch.no_grad()
def _residual_weights(block: nn.Module, inps: list[tuple[torch.Tensor, dict[str, Any]]],
                      masks: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Per batch, ``w_t = 1 / mean_c(y_tc²)`` over the real tokens ``t`` of the float block's output ``y`` (the
    denominator floored at 1% of the batch's median).

    The next norm divides each token's residual stream by its RMS, so an error ``e_t`` added there costs
    ``||e_t||² w_t`` downstream. AWQ's search weighs its output error so: with plain MSE, the tokens whose residual
    carries a huge outlier (one weight row ×1e4) dominated the search, which moved error into the other tokens and
    channels (block output 21.0 dB against RTN's 19.8, but 0.4 dB at the logits against RTN's 14.4).
    """
    out = []
    for (x, kw), mask in zip(inps, masks):
        ms = linear_rows(run_block(block, x, kw).detach(), mask).float().pow(2).mean(-1)
        # a token whose output is near 0 weighs at most 100x a typical one (it alone would set the scales)
        out.append(1.0 / ms.clamp_min(max(1e-2 * float(ms.median()) if ms.numel() else 0.0, 1e-12)))
    return out


@torch.no_grad()
def _cross_stats(block: nn.Module, fblock: nn.Module, first: str, last: str,
                 inps: list[tuple[torch.Tensor, dict[str, Any]]], finps: list[tuple[torch.Tensor, dict[str, Any]]],
                 masks: list[torch.Tensor | None], world: int, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X_qᵀX_q, X_fᵀX_q)`` of Linear ``first``'s input in ``block`` (quantized stream) and ``fblock`` (float),
    over the real tokens' rows (``masks``, as in ``_input_stats``)."""
    H, C, cur = _Terms(world), _Terms(world), {}

    def grab(key: str):
        def fn(_m: nn.Module, args: tuple[Any, ...]) -> None:
            cur[key] = linear_rows(args[0].detach(), cur["mask"]).float()
        return fn

    def stop(*_a: Any) -> None:
        raise StopForward

    hs = [block.get_submodule(first).register_forward_pre_hook(grab("q")),
          fblock.get_submodule(first).register_forward_pre_hook(grab("f")),
          block.get_submodule(last).register_forward_hook(stop), fblock.get_submodule(last).register_forward_hook(stop)]
    try:
        for (x, kw), (xf, kwf), mask in zip(inps, finps, masks):
            cur["mask"] = mask
            run_block(fblock, xf, kwf)
            run_block(block, x, kw)
            H.add(cur["q"].T @ cur["q"])
            C.add(cur["f"].T @ cur["q"])
    finally:
        for h in hs:
            h.remove()
    return H.sum(group), C.sum(group)


def _float_target(w: torch.Tensor, H: torch.Tensor, C: torch.Tensor, damp: float) -> torch.Tensor:
    """``V = W + W (C - H) (H + λI)⁻¹``: the least-squares weight for ``X_q Vᵀ ≈ X_f Wᵀ`` (``V = W`` when X_q = X_f)."""
    Hd = H.double() + damp * torch.diag(H).double().mean().clamp_min(1e-12) * torch.eye(H.shape[0], dtype=torch.float64)
    corr = torch.linalg.solve(Hd, (C.double() - H.double()).T @ w.double().T).T  # (N, K) = W (C - H) Hd⁻¹
    return (w.double() + corr).float()


def _gptq_best(w: torch.Tensor, H: torch.Tensor, g: int, bits: int, symmetric: bool, act_order: bool, clip: str,
               damps: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qd = weight_qdtype(bits, symmetric)
    best: tuple[float, Any] = (float("inf"), None)
    for d in damps:
        q, s, z = gptq_quantize(w, H, g, qd, symmetric, damp=d, group_method=clip, act_order=act_order)
        err = output_error(w, H, q, s, z, g)
        if err < best[0]:
            best = (err, (q, s, z))
    return best[1]


def _replace(block: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, child, new)


def _warn_few_rows(model: nn.Module, layers: nn.ModuleList, inps: list[tuple[torch.Tensor, Any]],
                   masks: list[torch.Tensor | None], group: Any) -> None:
    """``quantize_weight_only``'s warning (``warn_few_rows``) for the block Linears whose ``in_features`` exceed the
    calibration's real tokens (all ranks together): GPTQ's ``H`` there has rank below ``K``."""
    rows = int(ordered_sum([torch.tensor(float(x.shape[:-1].numel() if m is None else m.sum()))
                            for (x, _), m in zip(inps, masks)], group))
    inside = {id(m) for m in layers.modules()}
    few = {n: (rows, m.in_features) for n, m in model.named_modules()
           if isinstance(m, nn.Linear) and id(m) in inside and rows < m.in_features}
    warn_few_rows("quantize_llm", few, "method='rtn'", stacklevel=4)  # _warn_few_rows, quantize_llm, no_grad, caller


@torch.no_grad()
def quantize_llm(model: nn.Module, calib: Iterable[Any], bits: int = 4, group_size: int | None = None,
                 method: str = "gptq", awq: bool = True, clip: str = "hmse", act_order: bool = True,
                 damp: float | Sequence[float] = 0.01, symmetric: bool = False,
                 head: str | None = "int8", refine: bool = False, float_target: bool = False, inplace: bool = False,
                 progress: bool = True,
                 group: Any = None) -> nn.Module:
    """Quantize every ``nn.Linear`` of a causal LM's decoder blocks, block by block; see the module docstring.

    ``calib``: token-id tensors ``(1, T)`` (or dicts of model inputs; a dict's ``attention_mask`` zeros mark padding,
    left out of every statistic); with ``torch.distributed`` each rank passes its shard (``lowbit.llm.shard``; equal
    counts). ``group_size``: weight columns per scale; a given size (or -1, per channel) must divide every quantized
    layer's ``in_features`` (else ``ValueError`` before any work); ``None``: 128, halved per layer where it does not
    divide (to 8, else per channel), the layers it changed named in a warning (``lowbit.llm.plan``).
    ``method``: ``"gptq"`` or ``"rtn"``;
    ``clip``: group qparams by ``"hmse"`` (clip search weighted by ``diag(XᵀX)``), ``"mse"`` or ``"rtn"``
    (min/max); ``awq``: AWQ scaling first; ``refine``: re-fit the group scales after GPTQ (codes
    fixed); ``float_target``: GPTQ fits the float model's outputs ``X_f Wᵀ`` rather than ``X_q Wᵀ`` (the
    quantized stream's inputs times the float weight), correcting the earlier layers' error; ``head``:
    ``"int8"``, ``"int4"`` or ``None`` (keep the float output projection / embedding).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_llm: model must be an nn.Module, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"quantize_llm: method={method!r} must be one of {METHODS}")
    if clip not in CLIPS:
        raise ValueError(f"quantize_llm: clip={clip!r} must be one of {CLIPS}")
    if head not in ("int8", "int4", None):
        raise ValueError(f"quantize_llm: head={head!r} must be 'int8', 'int4' or None")
    damps = (damp,) if isinstance(damp, (int, float)) else tuple(damp)
    if not damps or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < math.inf for d in damps):
        raise ValueError(f"quantize_llm: damp={damp!r} must be a positive float or a tuple of them")
    check_recipe(bits, 128 if group_size is None else group_size, "quantize_llm", symmetric)
    for flag, value in (("inplace", inplace), ("awq", awq), ("act_order", act_order), ("refine", refine),
                        ("float_target", float_target), ("progress", progress)):
        if not isinstance(value, bool):  # read by truthiness below: awq="no" ran AWQ
            raise TypeError(f"quantize_llm: {flag}={value!r} must be True or False")
    extra = [f for f, on in (("refine", refine), ("float_target", float_target)) if on]
    if method == "rtn" and extra:  # (were skipped without a word: both work on GPTQ's statistics)
        raise ValueError(f"quantize_llm: {' and '.join(f'{f}=True' for f in extra)} with method='rtn': "
                         "GPTQ's calibration statistics, which rounding does not collect, are what "
                         f"{'they work' if len(extra) > 1 else 'it works'} on; use method='gptq'")
    check_shapes(model, bits, head)
    group_size = resolve_group_size(model, group_size, bits, head, "quantize_llm")  # refused / adapted with a warning
    if not inplace:
        model = copy.deepcopy(model)
    rank, world = rank_and_world(group)
    layers = decoder_layers(model)
    check_has_linears(model, layers, "quantize_llm")
    check_finite_linears(((n, m) for n, m in layers.named_modules() if isinstance(m, nn.Linear)), "quantize_llm")
    calib = agree_calibration("quantize_llm", lambda: check_llm_calib(model, calib, "quantize_llm"), group)
    model.eval()  # after the checks: a refused argument leaves the caller's model (inplace=True) in its mode
    inps = capture_block_inputs(model, layers, calib)
    if not inps:
        raise ValueError("quantize_llm: calib yielded no batches")
    masks = [token_mask(b) for b in calib]  # padding (attention_mask 0) is left out of every statistic
    if method == "gptq":  # every block Linear reads every real token: fewer rows than in_features over-fit
        _warn_few_rows(model, layers, inps, masks, group)
    qd = weight_qdtype(bits, symmetric)
    job = 0
    float_target = float_target and method == "gptq"
    finps = inps  # the float model's block inputs (float_target)
    for block in _progress(layers, "quantize_llm blocks", len(layers), progress and rank == 0):
        groups = linear_groups(block, *inps[0])
        srcs = {names[0]: scale_source(block, names, inps[0]) for names in groups} if awq else {}
        if any(srcs.values()):  # the folds leave every group's float input as it was: one pass for all
            n_tok = int(ordered_sum([torch.tensor(float(x.shape[:-1].numel() if m is None else m.sum()))
                                     for (x, _), m in zip(inps, masks)], group))
            stats = _input_stats(block, [n for n, src in srcs.items() if src], None, inps, masks, world, group, True,
                                 _residual_weights(block, inps, masks))
            for names in groups:
                if srcs[names[0]] is None:
                    continue
                w = torch.cat([block.get_submodule(n).weight.float() for n in names])
                H, a = stats[names[0]]
                s, _, _ = awq_search_stats(w, H, a, n_tok, fit_group_size(w.shape[1], group_size), qd, symmetric)
                awq_fold(block, srcs[names[0]], names, s)
        fblock = copy.deepcopy(block) if float_target else None  # after the AWQ folds: the same float W
        for names in groups:
            lins = [block.get_submodule(n) for n in names]
            k = lins[0].in_features
            g = fit_group_size(k, group_size)  # group_size itself when the caller gave it (resolve_group_size)
            qs = [WeightOnlyLinear(k, m.out_features, m.bias is not None, bits, g, symmetric) for m in lins]
            w = torch.cat([m.weight.detach().float().cpu() for m in lins])
            n, G = w.shape[0], qs[0].scales.shape[1]
            codes, s, z = torch.zeros(n, k, dtype=torch.int64), torch.zeros(n, G), torch.zeros(n, G, dtype=torch.int64)
            if method == "gptq":
                if fblock is None:
                    H = _input_stats(block, names[:1], names[-1], inps, masks, world, group)[names[0]][0]
                else:
                    H, C = _cross_stats(block, fblock, names[0], names[-1], inps, finps, masks, world, group)
                if job % world == rank:
                    if fblock is not None:
                        w = _float_target(w, H, C, min(damps))
                    codes, s, z = _gptq_best(w, H, qs[0]._g, bits, symmetric, act_order, clip, damps)
                    if refine:
                        s = refine_scales(w, H, codes, s, z, qs[0]._g)[0]
                broadcast_tensors([codes, s, z], job % world, group)
                job += 1
            else:
                codes, s, z = quantize_groups(w, qs[0]._g, qd, symmetric, "rtn" if clip == "rtn" else "mse")
            split = [m.out_features for m in lins]
            for name, q, m, c, si, zi in zip(names, qs, lins, codes.split(split), s.split(split), z.split(split)):
                q.set_codes(c, si, zi)
                if m.bias is not None:
                    q.bias = m.bias.detach().float().cpu().clone()
                _replace(block, name, q.to(m.weight.device))
        if method == "gptq" or awq:  # plain rounding needs no activations
            if fblock is not None:
                finps = [(run_block(fblock, x, kw), kw) for x, kw in finps]
            inps = [(run_block(block, x, kw), kw) for x, kw in inps]
    if head is not None:
        k = model.get_submodule(find_head(model)[0]).in_features  # (the default's size for it was said above)
        quantize_head(model, 8 if head == "int8" else 4, fit_group_size(k, group_size), symmetric)
    return model
