"""Activation-aware per-channel scaling (AWQ, Lin et al. 2023) before weight rounding.

For Linears ``W`` ``(N, K)`` reading ``x`` ``(n, K)``, scaling input channel ``k`` by ``s_k`` and the
weight column by the same factor leaves the float product unchanged, ``x W^T = (x / s)(W s)^T``, but
moves rounding error away from the channels that carry large activations. AWQ searches::

    s(α) = m^α / sqrt(max(m^α) · min(m^α)),   m_k = mean_t |x_tk|,     α ∈ {0, 1/n_grid, ..., 1}
    α*   = argmin_α || x W^T - (x / s) Q(W s)^T ||²          (Q: round to nearest on the group grid)

``α = 0`` is plain rounding, so the result never scores worse than RTN on the sample. The error is
computed from the statistics ``H = xᵀx`` and ``m`` (``awq_search_stats``), not from ``x`` itself:
``||x Dᵀ||² = tr(D H Dᵀ)`` with ``D = Q(W s) diag(1/s) - W``, so every calibration token counts at a
cost of ``N K²`` per grid point whatever the token count (the AWQ paper searches on a sample of ``x``). ``H`` may
weigh the tokens (``Σ_t w_t x_t x_tᵀ``: ``quantize_llm`` divides by each token's residual power). ``1 / s`` is
folded into the op that produces ``x`` — an RMSNorm/LayerNorm weight (q/k/v after ``input_layernorm``,
gate/up after ``post_attention_layernorm``) or the output rows of ``up_proj`` (for ``down_proj``,
since ``down(act(gate) * up)``) — so the model gains no op. ``o_proj`` is scaled through ``v_proj``
only without grouped-query attention (``v`` out == ``o`` in). A norm that multiplies by ``1 + weight`` (Gemma,
Gemma-2/3) takes the fold as ``weight' = (1 + weight) / s - 1`` (``norm_offset`` finds the 1 by probing the norm);
Gemma-2/3's MLP reads ``pre_feedforward_layernorm``, tried before ``post_attention_layernorm``. A producer found by
these names is used only where folding a test scale into it leaves the float block's output unchanged
(``fold_keeps_block``); elsewhere (post-norm or parallel blocks) that group gets no AWQ scaling.

>>> import torch
>>> from lowbit.qscheme import qint4
>>> x = torch.randn(256, 32) * torch.linspace(0.1, 8, 32)     # a few loud channels
>>> w = torch.randn(16, 32)
>>> s, alpha, errs = awq_search(w, x, 16, qint4, True)
>>> s.shape, errs[alpha] <= errs[0.0]
(torch.Size([32]), True)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..nn.quantized.weight_only import quantize_groups
from ..qscheme import QDtype
from .blocks import run_block

__all__ = ["awq_search", "awq_search_stats", "awq_fold", "scale_source", "fold_keeps_block", "norm_offset"]


def _rtn(w: torch.Tensor, g: int, qdtype: QDtype, symmetric: bool) -> torch.Tensor:
    q, s, z = quantize_groups(w, g, qdtype, symmetric, "rtn")
    N, K = w.shape
    return ((q.float().reshape(N, s.shape[1], -1) - z.float()[..., None]) * s[..., None]).reshape(N, K)


@torch.no_grad()
def awq_search(w: torch.Tensor, x: torch.Tensor, g: int, qdtype: QDtype, symmetric: bool, n_grid: int = 20
               ) -> tuple[torch.Tensor, float, dict[float, float]]:
    """``(s (K,), α*, {α: mean squared output error})`` for weight ``w`` ``(N, K)`` and sample inputs ``x`` ``(n, K)``."""
    w, x = w.detach().float(), x.detach().float()
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"awq_search: inputs of shape {tuple(x.shape)} do not match a weight {tuple(w.shape)}")
    return awq_search_stats(w, x.T @ x, x.abs().sum(0), x.shape[0], g, qdtype, symmetric, n_grid)


@torch.no_grad()
def awq_search_stats(w: torch.Tensor, H: torch.Tensor, abs_sum: torch.Tensor, n: int, g: int, qdtype: QDtype,
                     symmetric: bool, n_grid: int = 20) -> tuple[torch.Tensor, float, dict[float, float]]:
    """``awq_search`` from ``H = xᵀx`` ``(K, K)``, ``abs_sum = Σ_t |x_t|`` ``(K,)`` and the token count ``n``."""
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"awq_search_stats: n_grid={n_grid!r} must be an int >= 1")
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or (g >= 1 and w.shape[1] % g == 0)):
        raise ValueError(f"awq_search_stats: g={g!r} must be -1 (per row) or an int >= 1 dividing in_features {w.shape[1]}")
    w, H = w.detach().float(), H.detach().float()
    K = w.shape[1]
    if H.shape != (K, K) or abs_sum.shape != (K,) or n < 1:
        raise ValueError(f"awq_search_stats: H {tuple(H.shape)}, abs_sum {tuple(abs_sum.shape)}, n={n} do not match "
                         f"a weight {tuple(w.shape)}")
    m = (abs_sum.float() / n).clamp_min(1e-6)
    errs: dict[float, float] = {}
    best: tuple[float, float, torch.Tensor] = (float("inf"), 0.0, torch.ones_like(m))
    for i in range(n_grid + 1):
        a = i / n_grid
        s = m.pow(a).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        d = _rtn(w * s, g, qdtype, symmetric) / s - w  # (N, K): the effective weight error
        err = float(((d @ H) * d).sum()) / (n * w.shape[0])
        errs[a] = err
        if err < best[0]:
            best = (err, a, s)
    return best[2], best[1], errs


def scale_source(block: nn.Module, names: list[str], probe: tuple[torch.Tensor, dict[str, Any]] | None = None
                 ) -> str | None:
    """Name of the module in ``block`` whose output feeds the Linears ``names`` and can absorb ``1 / s``.

    The candidates are found by the Llama (and Gemma-2/3) names; with ``probe`` (a block input ``(x, kwargs)``) the
    first one that ``fold_keeps_block`` confirms (folding into it leaves the float block's output as it was) is
    returned, ``None`` if none is; without ``probe``, the first candidate.
    """
    cands = _named_sources(block, names)
    if probe is None:
        return cands[0] if cands else None
    return next((src for src in cands if fold_keeps_block(block, src, names, *probe)), None)


@torch.no_grad()
def fold_keeps_block(block: nn.Module, src: str, names: list[str], x: torch.Tensor, kw: dict[str, Any]) -> bool:
    """Whether ``awq_fold(block, src, names, s)`` leaves ``block(x, **kw)`` unchanged (checked on a copy).

    The names alone do not say that ``src``'s output is the Linears' input scaled per channel: Gemma-3 / OLMo-2
    apply ``post_attention_layernorm`` to the attention output, not to
    the MLP input; Phi / Cohere feed one norm to attention and MLP in parallel; Nemotron's MLP is ``down(relu²(up))``.
    A fold there changed the float model (8-bit AWQ on a random OLMo-2: 17.7 dB against 31.5 without; W8A8's
    SmoothQuant: 3.5 dB). The test scales are powers of two, exact in every float dtype, so a faithful fold gives
    the same output up to the order of float sums.
    """
    k = block.get_submodule(names[0]).in_features
    s = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat(k // 4 + 1)[:k]
    ref = run_block(block, x, kw)
    twin = copy.deepcopy(block)
    awq_fold(twin, src, names, s)
    out = run_block(twin, x, kw)
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return False
    err, scale = float((out.float() - ref.float()).norm()), float(ref.float().norm())
    return err <= 1e-3 * scale + 1e-6  # exact but for subnormals and sum order; a wrong fold moves it by O(1)


def _named_sources(block: nn.Module, names: list[str]) -> list[str]:
    """The producers the names suggest for the Linears ``names``, the likelier first (``[]``: none)."""
    def has(n: str) -> bool:
        try:
            block.get_submodule(n)
            return True
        except AttributeError:
            return False
    first = names[0]
    pre, _, leaf = first.rpartition(".")
    mlp = ["pre_feedforward_layernorm", "post_attention_layernorm"]  # Gemma-2/3: the MLP reads the first
    cands = {"q_proj": ["input_layernorm"], "gate_proj": mlp, "up_proj": mlp,
             "down_proj": [pre + ".up_proj" if pre else "up_proj"]}
    if leaf == "o_proj" and pre and has(pre + ".v_proj"):
        v, o = block.get_submodule(pre + ".v_proj"), block.get_submodule(first)
        return [pre + ".v_proj"] if v.weight.shape[0] == o.weight.shape[1] else []
    return [src for src in cands.get(leaf, []) if has(src)]


@torch.no_grad()
def norm_offset(norm: nn.Module) -> float:
    """``c`` in a norm's ``y = x̂ · (c + weight) (+ bias)``: 1.0 for Gemma's RMSNorm, 0.0 for Llama's and LayerNorm.

    Probed on a copy: with ``weight = 0`` (and ``bias = 0``) the output is ``c · x̂``; with ``weight = 1`` it is
    ``(c + 1) · x̂``. A norm that fits neither (or cannot be called on one tensor) gives 0.0, the plain fold, which
    ``fold_keeps_block`` then judges.
    """
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return 0.0
    twin = copy.deepcopy(norm)
    x = torch.randn(2, w.shape[0], generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    try:
        if getattr(twin, "bias", None) is not None:
            twin.bias.zero_()
        twin.weight.zero_()
        y0 = twin(x).float()
        twin.weight.fill_(1.0)
        y1 = twin(x).float()
    except Exception:  # noqa: BLE001 (not a per-channel norm of one tensor: the plain fold, judged by the block check)
        return 0.0
    if not bool(y0.any()):
        return 0.0
    return 1.0 if bool(torch.allclose(y1, 2 * y0, rtol=1e-2, atol=1e-3)) else 0.0


@torch.no_grad()
def awq_fold(block: nn.Module, src: str, names: list[str], s: torch.Tensor) -> None:
    """Divide ``src``'s output channels by ``s`` and multiply the input columns of ``names`` by it (exact in float
    but for the rounding of ``(1 + w) / s - 1`` in a Gemma norm)."""
    prev = block.get_submodule(src)
    s = s.to(device=prev.weight.device)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
    else:  # a norm: y = (c + weight) * x_hat (+ bias), c = 1 for Gemma's: weight' = (c + weight) / s - c
        c = norm_offset(prev)
        if c:
            prev.weight.copy_(((prev.weight.float() + c) / s.float() - c).to(prev.weight.dtype))
        else:
            prev.weight.div_(s.to(prev.weight.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    for n in names:
        lin = block.get_submodule(n)
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))
