"""One layer's step of the layer-by-layer pass (``lowbit.algorithms.layerwise``) and the helpers its walks share.

- ``_layer``: round one weighted layer (AdaRound, quadratic codes, or codes given) so that
  ``act(op(x_q; W_hat))`` matches the float ``y = act(op(x; W))``, then correct its bias per output channel,
  ``b_c += mean(op(x; W) - op(x_q; W_hat))`` over batch and positions, and freeze the codes;
- ``_fq``: an observer's calibrated grid as the int8 model rounds, ``(clamp(round(x / s + z), qmin, qmax) - z) s``;
- ``patch_observers``: the whole model run as float (observers the identity) or as the int8 model;
- ``batch_tuples``: calibration batches as positional-argument tuples, checked finite.

>>> import torch
>>> from torch import nn
>>> rec = LayerChange("fc", mse_nearest=0.5, mse_after=0.25)
>>> rec.mse_after < rec.mse_nearest, rec.codes_changed
(True, 0.0)
>>> [tuple(t.shape) for t in batch_tuples([torch.zeros(2, 3), (torch.zeros(2, 3), 1)], "example")[0]]
[(2, 3)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..batches import check_finite_batch, check_seed, iter_batches  # (check_seed re-exported: its old home)
from ..fake_quant import FakeQuantize
from ..functional import fake_quantize
from ..observer import ObserverBase
from .adaround import adaround_codes
from .layers import freeze_weight, layer_forward, layer_sample, rounded_forward, split, weight_codes
from .quadratic import quadratic_codes, supports

__all__ = ["LayerChange", "batch_tuples", "check_seed", "patch_observers"]


@dataclass
class LayerChange:
    """What the pass did to one layer: MSE of its output against the float layer (first calibration batch,
    quantized-model inputs) with round-to-nearest and after the pass."""

    name: str
    mse_nearest: float
    mse_after: float
    codes_changed: float = 0.0  # fraction of weight codes that differ from round-to-nearest
    bias_shift: float = 0.0  # max |correction| added to the bias
    notes: list[str] = field(default_factory=list)


def _fq(obs: nn.Module) -> Any:
    """``x -> (clamp(round(x / s + z), qmin, qmax) - z) s`` on the grid ``obs`` calibrated, the int8 model's
    rounding (None: leave values as they are)."""
    if isinstance(obs, FakeQuantize):
        obs = obs.activation_post_process
    if not isinstance(obs, ObserverBase) or getattr(obs, "is_dynamic", False) or not hasattr(obs, "quant_min"):
        return None
    if not getattr(obs, "is_calibrated", True):
        return None
    s, z = obs.calculate_qparams()
    axis = obs.ch_axis if s.numel() > 1 else None
    # round(x / s + z), zero point added before rounding, as ``quantize`` (the int8 model's Quantize and
    # requantize steps) does; ``fake_quantize``'s default round(x / s) + z differs where the float32 add of z
    # lands on a tie, and one such code at MobileNetV2's input grows to a 22 dB difference in the logits
    zf = z.to(torch.float32)
    return lambda x: fake_quantize(x, s, zf, obs.quant_min, obs.quant_max, axis, float_zero_point=True) \
        if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _layer(name: str, mod: nn.Module, xq: list[torch.Tensor], xf: list[torch.Tensor], adaround: bool,
           bias_correction: bool, iters: int, batch_size: int, g: torch.Generator, window: int = 16,
           target: list[torch.Tensor] | None = None, codes: torch.Tensor | None = None,
           rounding: str = "adaround", freeze: bool = True,
           float_mod: nn.Module | None = None) -> tuple[torch.Tensor, LayerChange]:
    """Round (and bias-correct) one layer; return its simulated weight and the change record.

    ``codes``: weight codes learned elsewhere (block reconstruction) to use instead of rounding here.
    ``rounding``: ``"adaround"``, or ``"quadratic"`` / ``"depthwise"`` (``quadratic.quadratic_codes`` on every
    supported layer / on depthwise convs only; AdaRound on the others). ``freeze=False``: the codes are not
    written into the weight nor pinned (a weight another call already rounded). ``float_mod``: the float layer
    (a copy taken before any rounding) the targets come from, where ``mod``'s own weight may already be rounded."""
    op, act = split(mod)
    float_mod = mod if float_mod is None else float_mod
    q0, s, z, lo, hi = weight_codes(mod)
    if target is None:
        with torch.no_grad():
            target = [layer_forward(float_mod, x) for x in xf]

    def error(w: torch.Tensor) -> float:  # output MSE on the first calibration batch (cost: one batch)
        with torch.no_grad():
            return float((layer_forward(mod, xq[0], w) - target[0]).pow(2).mean())

    rec = LayerChange(name, error((q0 - z) * s), 0.0)
    q = q0 if codes is None else codes
    if codes is not None:
        rec.codes_changed = float((q != q0).float().mean())
    elif adaround and _quadratic(op, rounding):
        lo_hi = None if act is None else (0.0, float(getattr(act, "max_val", float("inf"))))
        q = quadratic_codes(op, op.weight, s, z, lo, hi, xq, xf, act_range=lo_hi, bias=op.bias)
        if error((q - z) * s) > rec.mse_nearest:
            q = q0
        rec.codes_changed = float((q != q0).float().mean())
        rec.notes.append("quadratic")
    elif adaround and iters > 0:
        q = adaround_codes(op.weight, s, z, lo, hi, layer_sample(mod, xq, target, batch_size, window, g), iters=iters)
        if error((q - z) * s) > rec.mse_nearest:  # a short run can end worse than round-to-nearest: keep that
            q = q0
        rec.codes_changed = float((q != q0).float().mean())
    if bias_correction:
        with torch.no_grad():
            w_hat = (q - z) * s
            total, count = torch.zeros(op.weight.shape[0]), 0
            ch = -1 if isinstance(op, nn.Linear) else 1  # a Linear's channels are last: (N, ..., C); a conv's (N, C, ...)
            for x_f, x_q, t in zip(xf, xq, target):
                pre_f = t if act is None else layer_forward(float_mod, x_f, activation=False)
                d = pre_f - layer_forward(mod, x_q, w_hat, activation=False)
                total += d.movedim(ch, 0).reshape(d.shape[ch], -1).sum(1) if d.dim() > 1 else d
                count += d.numel() // d.shape[ch] if d.dim() > 1 else 1
            delta = total / max(1, count)
            if op.bias is None:
                op.bias = nn.Parameter(torch.zeros(op.weight.shape[0], dtype=op.weight.dtype))
            op.bias.add_(delta.to(op.bias.dtype))
            rec.bias_shift = float(delta.abs().max())
    if freeze:
        freeze_weight(mod, q, s, z)
    rec.mse_after = error((q - z) * s)
    return (q - z) * s, rec


def _quadratic(op: nn.Module, rounding: str) -> bool:
    """Whether ``rounding`` takes ``quadratic_codes`` for this layer."""
    if rounding == "adaround" or not supports(op):
        return False
    return rounding == "quadratic" or (isinstance(op, nn.Conv2d) and op.groups > 1)


def batch_tuples(calib: Any, where: str) -> list[tuple[Any, ...]]:
    """``calib`` (``lowbit.batches``' convention: a tensor is one batch, a tuple/list batch holds positional
    inputs) as a list of positional-argument tuples, for the walks that feed graph placeholders in order;
    errors name ``where``. A dict batch (keywords) has no such order: a ``TypeError``. A NaN/Inf in a float input
    is refused here, before any weight or bias is changed (it would reach every bias through the correction)."""
    out = []
    for i, b in enumerate(iter_batches(calib, f"{where}: calib")):
        if isinstance(b, dict):
            raise TypeError(f"{where}: calib batch {i} is a dict; give positional inputs (a tensor or a tuple/list)")
        out.append(b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,))
        check_finite_batch(out[-1], where, f"calib batch {i}", "the layers' targets need finite data",
                           masks=True)
    return out


def _check_steps(where: str, iters: Any, batch_size: Any, seed: Any) -> int:
    """``iters`` an int >= 0, ``batch_size`` an int >= 1, ``seed`` an int (``check_seed``; returned as a Python int):
    else an error naming the value."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"{where}: iters={iters!r} must be an int >= 0")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{where}: batch_size={batch_size!r} must be an int >= 1 (samples per rounding step)")
    return check_seed(where, seed)


def patch_observers(model: nn.Module, mode: str) -> list[nn.Module]:
    """Make every activation observer the identity (``float``) or a fake-quantizer (``quant``); no statistics.
    ``quant`` also runs every layer ``convert`` gives int8 weights that no pass rounds (a transposed conv) on those
    weights (``layers.rounded_forward``), so the model computes what the int8 model does. Undo: pop ``forward``
    from each returned module's ``__dict__``."""
    patched = []
    for m in model.modules():
        if isinstance(m, (ObserverBase, FakeQuantize)):
            fq = _fq(m) if mode == "quant" else None
            m.forward = fq if fq is not None else (lambda x, *a, **k: x)  # type: ignore[method-assign]
            patched.append(m)
        elif mode == "quant" and (run := rounded_forward(m)) is not None:
            m.forward = run  # type: ignore[method-assign]
            patched.append(m)
    return patched
