"""Cross-layer equalization with bias absorption (Nagel et al. 2019, "Data-Free Quantization").

For a pair of weighted layers ``A -> act -> B`` where ``A``'s output feeds only ``B`` and ``act`` is
the identity, ReLU or a ``[0, t]`` clamp (ReLU6), output channel ``i`` of ``A`` and input channel
``i`` of ``B`` are rescaled by ``s_i`` (positive scaling commutes with ReLU)::

    W_A[i] /= s_i,  b_A[i] /= s_i,  W_B[:, i] *= s_i,   s_i = sqrt(r_A[i] / r_B[i])

with ``r_A[i] = max|W_A[i]|`` and ``r_B[i] = max|W_B[:, i]|`` (for a depthwise ``B``, its own channel
``i``), which makes both ranges ``sqrt(r_A r_B)``. ``sweeps`` passes over all pairs let chains
(expand -> depthwise -> project) settle. Grouped convs on either side (``lowbit.algorithms.equalize_pairs``):
``A``'s rows are independent whatever its groups; a grouped ``B`` (ResNeXt) reads input channel ``i`` at column
``i % (in / g)`` of group ``i // (in / g)``'s filters, a depthwise ``B`` with channel multiplier ``k`` in its ``k``
filters of channel ``i``, and ``W_B[:, i]`` stands for those weights.

ReLU6 is not scale-equivariant: ``clamp(x / s, 0, 6) != clamp(x, 0, 6) / s``. The bound would have
to become ``6 / s_i`` per channel, which a per-tensor output grid cannot clamp. ``relu6="skip"``
(default) leaves such pairs alone; ``relu6="replace"`` does what the paper does — replaces the clamp
by a plain ReLU (this changes the float function; the report names each such layer). Measured on a
depthwise test net with per-channel weights, the replacement cost 4–8 dB of output SQNR.

``relu6="range"`` equalizes such pairs on the *activation* side and keeps the clamp: with ``m_i`` the
largest pre-activation of ``A``'s channel ``i`` on the calibration data and ``t`` the clamp bound,

    s_i = h m_i / t   if 0 < h m_i < t,   else 1          (so s_i <= 1; h = headroom, default 1.5)

``clamp(x / s_i, 0, t) = clamp(x, 0, h m_i) / s_i``, which equals ``clamp(x, 0, t) / s_i`` wherever
``x <= h m_i`` — everywhere on the calibration data, with room for later inputs up to ``h`` times the
calibrated maximum. Every channel that does not reach the clamp is stretched to fill ``[0, t / h]``,
so the per-tensor output grid spends its codes on all channels alike (MobileNetV2's first conv:
channels peaking at 0.05 and at 6 share one grid). Done only when ``B`` is depthwise (with or without a
channel multiplier: each filter reads one input channel): its per-channel weight grid absorbs ``s_i``
exactly. For a dense (or grouped) ``B`` the stretch would come back as weight error — the column
``W_B[:, i] s_i`` meets an input ``x_i / s_i`` on a row grid set by the other columns (measured on
MobileNetV2: weights-only SQNR 16.0 → 10.2 dB) — so such pairs are left alone.
Channels that clip (``h m_i >= t``) or never fire keep ``s_i = 1``. Needs ``calib``.
``dense=α`` (``0 < α <= 1``; default 0: left alone) stretches the dense-``B`` clamp pairs part of the way,
the pair's ``s_i`` becomes ``(h m_i / t)^α``: channel ``i`` then fills ``t (h m_i / t)^(1-α)`` of the clamp
(the full stretch: ``t``) and ``B``'s column ``i`` shrinks by ``(h m_i / t)^α``, the range disparity split between
``A``'s per-tensor output grid and ``B``'s row grids as SmoothQuant splits it.
The float function is kept as above. MobileNetV2's 17 depthwise → projection pairs at α = 0.5 (the
accurate recipe, 192 calibration crops, 1 thread, two disjoint sets of 480 evaluation crops): logit SQNR
21.59 / 21.52 → 21.87 / 21.85 dB; α = 0.25: 21.88 / 21.87, α = 0.75: 21.53 / 21.35 (``docs/design.md``).
ReLU / identity pairs still get the weight-range equalization above. On MobileNetV2 (48 crops,
activations-only simulation): 13.5 → 15.4 dB logit SQNR; float function kept to 39.9 dB on other crops.
Mixed precision (a layer with no qconfig) keeps the stretch. A float ``A`` (a float conv, an optional
float ``BatchNorm2d``, then a ``[0, t]`` clamp module) feeding an int8 depthwise ``B`` takes ``1 / s_i``
in the BN's ``γ, β``, or in the conv's rows. An int8 ``A`` feeding a float ``Conv2d`` / ``Linear`` ``B``
(dense or not) pays ``s_i`` in ``B``'s input channels, exactly, since ``B`` has no weight grid.

Bias absorption (``absorb=True``): when ``A``'s pre-activation output is at least ``c_i > 0`` on all
calibration data, ``relu(y_i - c_i) = relu(y_i) - c_i`` there, so ``b_A[i] -= c_i`` and ``B`` gets
``b_B += sum_k W_B[:, i, k] c_i`` (a grouped ``B``: each filter sums over its own group's inputs). It
shrinks ``A``'s output range without changing the function on the calibration data;
done only when ``B`` has no zero padding (the sum would be wrong at borders)
and ``act`` is a plain ReLU (after equalization).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> m = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
>>> with torch.no_grad(): _ = m[0].weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
>>> x = torch.randn(4, 3, 5, 5); y = m(x)
>>> p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(x,))
>>> pairs = equalize_prepared(p, [(x,)])
>>> [(e.first, e.second) for e in pairs]
[('0', '2')]
>>> bool(torch.allclose(p(x), y, atol=1e-4))
True
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..nn.intrinsic import ClampedReLU
from ..observer import ObserverBase
# pair discovery and the channel maps (``equalize_pairs``), importable from here as before
from .equalize_pairs import (_depthwise, _float_clamp_pairs, _float_second, _in_ranges, _pairs, _scale_in, _spread,
                             groups_of)
from .equalize_pairs import _same_axis as _same_axis
from .layers import split
from .layerwise_step import batch_tuples

__all__ = ["EqualizedPair", "equalize_prepared"]


@dataclass
class EqualizedPair:
    """One equalized pair: spread of ``r_A[i] / r_B[i]`` over channels (max / min) before and after, whether a
    ReLU6 clamp was replaced by ReLU, and how many channels' bias was absorbed."""

    first: str
    second: str
    ratio_before: float
    ratio_after: float
    relu6_replaced: bool = False
    absorbed: int = 0  # channels whose bias was absorbed into the second layer
    stretched: int = 0  # relu6="range": channels stretched to fill the clamp's range
    power: float = 1.0  # the stretch's exponent α (1: the full stretch; a dense reader's pair: ``dense``)


def _channel_dim(layer: nn.Module, out: torch.Tensor) -> int:
    """The dim of ``out`` (``layer``'s output) that holds its channels: last for a Linear (``(N, ..., C)``),
    ``out.dim() - k - 1`` for a ``ConvNd`` with ``k`` spatial dims (1 batched, 0 unbatched), else 1 (a BatchNorm)."""
    if isinstance(layer, nn.Linear) or out.dim() < 2:
        return out.dim() - 1
    k = getattr(layer, "kernel_size", None)
    return out.dim() - len(k) - 1 if isinstance(k, tuple) else 1


def _per_channel(layer: nn.Module, out: torch.Tensor, stat: str) -> torch.Tensor:
    """``amin`` / ``amax`` of ``layer``'s output ``out`` per channel (every other dim reduced)."""
    dims = [d for d in range(out.dim()) if d != _channel_dim(layer, out)]
    return (out.detach().amin(dim=dims) if stat == "amin" else out.detach().amax(dim=dims)) if dims else out.detach()


def equalize_prepared(prepared: fx.GraphModule, calib: Iterable[Any] | None = None, sweeps: int = 2,
                      absorb: bool = True, relu6: str = "skip", headroom: float = 1.5,
                      weights: bool = True, dense: float = 0.0) -> list[EqualizedPair]:
    """Equalize every eligible pair of a graph-mode prepared model (before calibration), in place.

    ``calib`` (batches of the model's inputs, ``lowbit.batches``' convention: a tensor or a tuple / list of
    positional inputs per batch; read into a list first) is needed for bias absorption and ``relu6="range"``.
    ``weights=False`` skips the weight-range equalization of ReLU / identity pairs (with
    ``relu6="range"``: only the clamp pairs are stretched). ``dense`` (with ``relu6="range"``): the exponent α of
    the partial stretch of clamp pairs whose second layer is dense, ``0 <= α <= 1`` (0: left alone; module
    docstring). Returns one record per pair, in model order.
    """
    if not isinstance(prepared, fx.GraphModule):
        raise TypeError(f"equalize_prepared: expects a prepare_fx model (fx.GraphModule), got {type(prepared).__name__}")
    if relu6 not in ("skip", "replace", "range"):
        raise ValueError(f"equalize_prepared: relu6={relu6!r} must be 'skip', 'replace' or 'range'")
    if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 1:
        raise ValueError(f"equalize_prepared: sweeps={sweeps!r} must be an int >= 1")
    mods = dict(prepared.named_modules())
    pairs = _pairs(prepared, relu6)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not headroom >= 1:
        raise ValueError(f"equalize_prepared: headroom={headroom!r} must be a number >= 1")
    clamped = [(an, bn) for an, bn in pairs if isinstance(split(mods[an])[1], ClampedReLU)] if relu6 == "range" else []
    pairs = [pr for pr in pairs if pr not in clamped and weights]
    if isinstance(dense, bool) or not isinstance(dense, numbers.Real) or not 0 <= dense <= 1:  # (NumPy, Fraction)
        raise ValueError(f"equalize_prepared: dense={dense!r} must be a number in [0, 1] (the stretch's exponent "
                         "for a dense second layer; 0: none)")
    if dense and relu6 != "range":
        raise ValueError(f"equalize_prepared: dense={dense!r} needs relu6='range' (got relu6={relu6!r})")
    # a dense B: the stretch comes back as weight error, so only part of it (``dense``; 0: left alone; docstring)
    power = {bn: 1.0 if _depthwise(mods[bn]) else float(dense) for _, bn in clamped}
    clamped = [(an, bn) for an, bn in clamped if power[bn] > 0]
    if relu6 == "range":
        clamped += _float_second(prepared, mods)
    if clamped and calib is None:
        raise ValueError("equalize_prepared: relu6='range' needs calib (the clamp pairs are scaled by activation maxima)")
    if calib is not None:  # several passes read it (absorb, stretch): a generator would be drained by the first
        calib = batch_tuples(calib, "equalize_prepared")
    records = {}
    with torch.no_grad():
        for sweep in range(max(1, sweeps)):
            for an, bn in pairs:
                a, act = split(mods[an])
                b, _ = split(mods[bn])
                r_a = a.weight.detach().abs().reshape(a.weight.shape[0], -1).amax(1)
                r_b = _in_ranges(b)
                assert r_b is not None
                ok = (r_a > 0) & (r_b > 0)
                s = torch.where(ok, torch.sqrt(r_a / r_b.clamp_min(1e-12)), torch.ones_like(r_a))
                if sweep == 0:
                    records[an] = EqualizedPair(an, bn, _spread(r_a, r_b), 1.0)
                a.weight.div_(s.view(-1, *[1] * (a.weight.dim() - 1)))
                if a.bias is not None:
                    a.bias.div_(s)
                _scale_in(b, s)
                if isinstance(act, ClampedReLU):  # not scale-equivariant: the paper's replacement
                    mods[an][1] = nn.ReLU()
                    records[an].relu6_replaced = True
        for an, bn in pairs:
            a, _ = split(mods[an])
            b, _ = split(mods[bn])
            r_a = a.weight.abs().reshape(a.weight.shape[0], -1).amax(1)
            records[an].ratio_after = _spread(r_a, _in_ranges(b))  # type: ignore[arg-type]
        if absorb and calib is not None:
            _absorb(prepared, mods, pairs, records, calib)
        if clamped:
            _stretch(prepared, mods, clamped, records, calib, headroom, power)  # type: ignore[arg-type]
        if relu6 == "range" and calib is not None:
            _stretch_float(prepared, mods, records, calib, headroom)
    order = {n: i for i, n in enumerate(mods)}
    return sorted(records.values(), key=lambda r: order.get(r.first, 0))


def _run_hooked(gm: fx.GraphModule, hooks: list[Any], calib: Iterable[Any],
                stop: type[Exception] | None = None) -> None:
    """Run ``calib`` through ``gm`` with its observers inert (they record nothing), then remove ``hooks``;
    a hook that raises ``stop`` ends that batch's forward early."""
    obs = [m for m in gm.modules() if isinstance(m, (ObserverBase, FakeQuantize))]
    for m in obs:
        m.forward = lambda x, *a, **k: x  # type: ignore[method-assign]
    try:
        for batch in calib:
            try:
                gm(*(batch if isinstance(batch, tuple) else (batch,)))
            except Exception as e:
                if stop is None or not isinstance(e, stop):
                    raise
    finally:
        for h in hooks:
            h.remove()
        for m in obs:
            m.__dict__.pop("forward", None)


def _measure(gm: fx.GraphModule, layers: dict[str, nn.Module], stat: str, calib: Iterable[Any]) -> dict[str, torch.Tensor]:
    """Per output channel ``amin`` / ``amax`` of each ``layers[name]``'s output over ``calib``, observers inert."""
    got: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in layers.items():
        def hook(m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
            v = _per_channel(m, out, stat)
            got[name] = v if name not in got else torch.minimum(got[name], v) if stat == "amin" \
                else torch.maximum(got[name], v)
        hooks.append(m.register_forward_hook(hook))
    _run_hooked(gm, hooks, calib)
    return got


def _stretch(gm: fx.GraphModule, mods: dict[str, nn.Module], pairs: list[tuple[str, str]],
             records: dict[str, EqualizedPair], calib: Iterable[Any], headroom: float,
             power: dict[str, float] | None = None) -> None:
    """``relu6="range"``: stretch every channel of ``A`` that stays below the clamp to fill it (module docstring);
    ``power[B]``: the exponent α of the pair's stretch (default 1, the full stretch)."""
    highs = _measure(gm, {an: split(mods[an])[0] for an, _ in pairs}, "amax", calib)
    for an, bn in pairs:
        a, act = split(mods[an])
        b, _ = split(mods[bn])
        r_b = _in_ranges(b)
        assert r_b is not None and isinstance(act, ClampedReLU)
        r_a = a.weight.detach().abs().reshape(a.weight.shape[0], -1).amax(1)
        rec = EqualizedPair(an, bn, _spread(r_a, r_b), 1.0)
        m = highs.get(an)
        if m is not None:
            m = m * headroom
            ok = (m > 0) & (m < act.max_val)
            s = torch.where(ok, m / act.max_val, torch.ones_like(m)).to(a.weight.dtype)
            rec.power = (power or {}).get(bn, 1.0)
            if rec.power != 1.0:  # s <= 1, so s^α lies between s and 1
                s = s.pow(rec.power)
            a.weight.div_(s.view(-1, *[1] * (a.weight.dim() - 1)))
            if a.bias is not None:
                a.bias.div_(s)
            _scale_in(b, s)
            rec.stretched = int(ok.sum())
        rec.ratio_after = _spread(a.weight.abs().reshape(a.weight.shape[0], -1).amax(1), _in_ranges(b))  # type: ignore[arg-type]
        records[an] = rec


def _stretch_float(gm: fx.GraphModule, mods: dict[str, nn.Module], records: dict[str, EqualizedPair],
                   calib: Iterable[Any], headroom: float) -> None:
    """``relu6="range"`` for a float first layer (``_float_clamp_pairs``): the same ``s_i = h m_i / t`` on the clamp's
    input, divided out of the BN's ``γ, β`` (``γ_i (x - μ_i) / σ_i + β_i`` scales by ``1 / s_i`` exactly) or the
    conv's rows and bias; ``B``'s channel × ``s_i``. The float layer itself stays float."""
    pairs = _float_clamp_pairs(gm, mods)
    if not pairs:
        return
    highs = _measure(gm, {sc: mods[sc] for _, sc, _, _ in pairs}, "amax", calib)
    for layer, sc, bn, t in pairs:
        b, _ = split(mods[bn])
        rec = records[layer] = EqualizedPair(layer, bn, 1.0, 1.0)  # (a float layer's weight range is not the question)
        m = highs.get(sc)
        if m is None:
            continue
        m = m * headroom
        ok = (m > 0) & (m < t)
        target = mods[sc]
        s = torch.where(ok, m / t, torch.ones_like(m)).to(target.weight.dtype)
        target.weight.div_(s.view(-1, *[1] * (target.weight.dim() - 1)))
        if target.bias is not None:
            target.bias.div_(s)
        _scale_in(b, s)
        rec.stretched = int(ok.sum())


def _absorb(gm: fx.GraphModule, mods: dict[str, nn.Module], pairs: list[tuple[str, str]],
            records: dict[str, EqualizedPair], calib: Iterable[Any]) -> None:
    lows: dict[str, torch.Tensor] = {}
    hooks = []
    for an, bn in pairs:
        a, act = split(mods[an])
        b, _ = split(mods[bn])
        if type(act) is not nn.ReLU or a.bias is None or any(p != 0 for p in getattr(b, "padding", (0,))):
            continue

        def hook(m: nn.Module, args: Any, out: Any, an: str = an) -> None:
            pre = nn.functional.linear(args[0], m.weight, m.bias) if isinstance(m, nn.Linear) else \
                m._conv_forward(args[0], m.weight, m.bias)  # type: ignore[operator]
            lo = _per_channel(m, pre, "amin")
            lows[an] = torch.minimum(lows[an], lo) if an in lows else lo
        hooks.append(a.register_forward_hook(hook))
    if not hooks:
        return
    _run_hooked(gm, hooks, calib)
    for an, bn in pairs:
        if an not in lows:
            continue
        a, _ = split(mods[an])
        b, _ = split(mods[bn])
        c = lows[an].clamp_min(0)
        if not bool((c > 0).any()):
            continue
        a.bias.sub_(c)
        w = b.weight.reshape(b.weight.shape[0], b.weight.shape[1], -1).sum(-1)  # (out, in / groups)
        if b.bias is None:
            b.bias = nn.Parameter(torch.zeros(b.weight.shape[0], dtype=b.weight.dtype, device=b.weight.device))
        g = groups_of(b)  # filter o of group j reads inputs j·(in/g) .. (j+1)·(in/g) - 1
        b.bias.add_(w @ c if g == 1 else torch.bmm(w.view(g, -1, w.shape[1]), c.view(g, -1, 1)).reshape(-1))
        records[an].absorbed = int((c > 0).sum())
