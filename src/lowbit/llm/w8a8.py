"""W8A8 for LLMs: dynamic per-token int8 activations x per-channel int8 weights, SmoothQuant migration.

``DynamicInt8Linear`` computes, for ``x`` ``(M, K)`` (after the optional per-channel ``input_scale``)::

    s_x[m] = max_k |x[m, k]| / 127,   q_x = clamp(round(x / s_x), -127, 127)            # per token, int8
    y[m, n] = s_x[m] s_w[n] · Σ_k q_x[m, k] q_w[n, k]  + bias[n]                         # exact int32 sum

with ``q_w`` int8 per output channel (symmetric, ``s_w = max|w[n]| / 127``) and the int32 sum from
``torch._int_mm`` (VNNI / AMX on x86; a scalar loop on CPUs without VNNI — exact, but slow there).

``quantize_w8a8`` first migrates activation outliers into the weights (SmoothQuant, Xiao et al. 2022):
per input channel ``k`` of each group of Linears reading one tensor::

    s_k = a_k^α / max|W_{:,k}|^(1-α),     x' = x / s,   W' = W · s      (α = 0.5)
    a_k = max(max_t |x_tk|, 0.05 · max_j max_t |x_tj|)    (a channel silent on the calibration tokens is not blown up)

``1 / s`` is folded into the producer (RMSNorm weight, or ``up_proj`` rows for ``down_proj``, see
``lowbit.llm.awq.scale_source``, checked to leave the float block unchanged); where none can absorb it (``o_proj``
under grouped-query attention, post-norm or parallel blocks) it stays as
``input_scale`` in the module (one multiply per call).

>>> import torch
>>> lin = torch.nn.Linear(64, 32)
>>> q = DynamicInt8Linear.from_float(lin)
>>> x = torch.randn(5, 64)
>>> bool((q(x) - lin(x)).abs().max() < 0.05 * lin(x).abs().max())
True
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import int_mm
from ..nn.quantized._utils import check_finite_linears, check_finite_weight, check_not_meta
from .awq import awq_fold, scale_source
from .blocks import _call, check_has_linears, check_llm_calib, decoder_layers, linear_groups, linear_rows, token_mask

__all__ = ["DynamicInt8Linear", "quantize_w8a8", "activation_absmax"]


class DynamicInt8Linear(nn.Module):
    """Dynamic per-token int8 x per-channel int8 ``Linear``; see the module docstring."""

    weight: torch.Tensor  # (N, K) int8
    weight_scale: torch.Tensor  # (N,) float32
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None  # (K,) float32: x is multiplied by it first (un-folded smoothing)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_scale: bool = False) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DynamicInt8Linear: {name}={v!r} must be a positive int")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.register_buffer("input_scale", torch.ones(in_features) if input_scale else None)

    @classmethod
    @torch.no_grad()
    def from_float(cls, mod: nn.Module, input_scale: torch.Tensor | None = None) -> DynamicInt8Linear:
        """Quantize ``mod.weight`` per output channel; ``input_scale`` ``(K,)``: x is multiplied by it first."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"DynamicInt8Linear.from_float expects an nn.Linear, got {type(mod).__name__}")
        check_not_meta(mod.weight, "DynamicInt8Linear.from_float")
        check_finite_weight(mod.weight, "DynamicInt8Linear.from_float")  # a NaN row max: NaN scale, every output NaN
        if input_scale is not None and (not isinstance(input_scale, torch.Tensor) or input_scale.shape != (mod.in_features,)
                                        or not bool(torch.isfinite(input_scale).all())):
            raise ValueError(f"DynamicInt8Linear.from_float: input_scale must be a finite ({mod.in_features},) tensor, got "
                             + (f"shape {tuple(input_scale.shape)}" if isinstance(input_scale, torch.Tensor)
                                else type(input_scale).__name__))
        q = cls(mod.in_features, mod.out_features, mod.bias is not None, input_scale is not None)
        w = mod.weight.detach().float()
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        q.weight = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        q.weight_scale = s
        if mod.bias is not None:
            q.bias = mod.bias.detach().float().clone()
        if input_scale is not None:
            q.input_scale = input_scale.detach().float().clone()
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape[-1:] != (self.in_features,):
            raise ValueError(f"DynamicInt8Linear: input must be a float tensor ending in in_features="
                             f"{self.in_features}, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features).float()  # (M, K)
        if self.input_scale is not None:
            x2 = x2 * self.input_scale
        sx = x2.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127  # (M, 1)
        q = torch.round(x2 / sx).clamp_(-127, 127).to(torch.int8)
        if x.device.type == "cpu" and q.shape[0] > 0:
            acc = int_mm.cpu_int_mm(q, self.weight.t())  # (M, N) int32 (exact where torch's _int_mm is not: K = 1)
        else:  # exact in float32 while |acc| < 2^24 (K < 1040 at full range); CUDA _int_mm needs padding
            acc = F.linear(q.float(), self.weight.float())
        y = acc.float() * (sx * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", input_scale=True" if self.input_scale is not None else ""))


@torch.no_grad()
def activation_absmax(model: nn.Module, linears: dict[str, nn.Linear], calib: Iterable[Any]) -> dict[str, torch.Tensor]:
    """``{name: max_t |x_t|}`` ``(K,)`` of each Linear's input over ``calib`` (token-id tensors or input dicts),
    over real tokens only (a dict batch's ``attention_mask`` 0 marks padding, left out)."""
    out = {n: torch.zeros(m.in_features) for n, m in linears.items()}
    cur: list[torch.Tensor | None] = [None]

    def hook(name: str):
        def fn(_m: nn.Module, args: tuple[Any, ...]) -> None:
            x = linear_rows(args[0].detach(), cur[0]).abs().amax(0).float().cpu()
            torch.maximum(out[name], x, out=out[name])
        return fn

    hs = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for b in calib:
            cur[0] = token_mask(b)
            _call(model, b)
    finally:
        for h in hs:
            h.remove()
    return out


@torch.no_grad()
def quantize_w8a8(model: nn.Module, calib: Iterable[Any], alpha: float | None = 0.5, inplace: bool = False) -> nn.Module:
    """Every Linear of the decoder blocks -> ``DynamicInt8Linear``, after SmoothQuant (``alpha=None``: none)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_w8a8: model must be an nn.Module, got {type(model).__name__}")
    if alpha is not None and (isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1)):
        raise ValueError(f"quantize_w8a8: alpha={alpha!r} must be in [0, 1] or None")
    if not isinstance(inplace, bool):
        raise TypeError(f"quantize_w8a8: inplace={inplace!r} must be True or False")
    if not inplace:
        model = copy.deepcopy(model)
    layers = decoder_layers(model)
    check_has_linears(model, layers, "quantize_w8a8")
    check_finite_linears(((n, m) for n, m in layers.named_modules() if isinstance(m, nn.Linear)), "quantize_w8a8")
    calib = check_llm_calib(model, calib, "quantize_w8a8")
    if not calib:
        raise ValueError("quantize_w8a8: calib yielded no batches")
    modes = [(m, m.training) for m in model.modules()]  # put back if the calibration data is refused (inplace=True)
    model.eval()
    groups: list[tuple[int, list[str]]] = []
    probe: dict[str, Any] = {}
    probes: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}  # block i's input: scale_source checks its folds

    def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        probe.setdefault("x", (args[0] if args else kwargs["hidden_states"], {k: v for k, v in kwargs.items()
                                                                               if k != "hidden_states"}))
    for i, block in enumerate(layers):
        h = block.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            _call(model, calib[0][..., :8] if isinstance(calib[0], torch.Tensor) else calib[0])
        finally:
            h.remove()
        x, kw = probe.pop("x")
        groups += [(i, g) for g in linear_groups(block, x, kw)]
        probes[i] = (x, kw)
    lins = {f"{i}.{n}": layers[i].get_submodule(n) for i, g in groups for n in g}
    amax = activation_absmax(model, lins, calib) if alpha is not None else {}
    bad = [n for n, a in amax.items() if not bool(torch.isfinite(a).all())]
    if bad:  # a NaN channel max would fold NaN smoothing scales into the norms: every output NaN, on clean inputs too
        for m, training in modes:
            m.training = training
        raise ValueError(f"quantize_w8a8: the calibration activations reaching {len(bad)} layer(s) ({', '.join(bad[:3])}"
                         f"{', ...' if len(bad) > 3 else ''}) hold NaN/Inf; SmoothQuant needs finite calibration data")
    unfolded: dict[tuple[int, str], torch.Tensor] = {}
    for i, names in groups:  # all migrations first: a later group's producer (up_proj) must still be float
        block = layers[i]
        if alpha is not None:
            w_max = torch.stack([block.get_submodule(n).weight.detach().abs().amax(0).float() for n in names]).amax(0)
            a = amax[f"{i}.{names[0]}"]
            # a channel quiet on every calibration token (a ReLU unit that never fired on a few tokens: max 0) got
            # s ~ 1e-3, and the first token that fires there swamped the per-token scale (10-18 dB from under 16
            # tokens, 49 dB from 16): its max is floored at 5% of the layer's loudest channel (43-46 dB from 1-8)
            a = a.clamp_min(max(1e-5, 0.05 * float(a.max())))
            s = (a.pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)
            src = scale_source(block, names, probes[i])
            if src is not None:
                awq_fold(block, src, names, s)
            else:  # no producer to absorb 1/s: W' = W s here, x / s in the module
                for n in names:
                    block.get_submodule(n).weight.mul_(s[None, :])
                    unfolded[i, n] = 1.0 / s
    for i, names in groups:
        block = layers[i]
        for n in names:
            parent, _, child = n.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, child,
                    DynamicInt8Linear.from_float(block.get_submodule(n), unfolded.get((i, n))))
    return model
