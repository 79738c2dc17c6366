"""What calibration saw and what it kept: activation ranges of a prepared model's observers.

For each calibrated per-tensor activation observer (``activation_post_process`` of a module, or a
``FakeQuantize``'s inner observer after ``prepare_qat``; also ``input_activation_post_process``,
named ``"<module> (input)"``; in a graph-mode model, each ``activation_post_process_N`` observer named by the
value it observes: the module's target, a function node's name, ``"<input> (input)"`` for a model input) this reads

- the observed range ``[min_val, max_val]`` and, for a ``HistogramObserver``, its ``histogram``
  (``bins`` equal-width bins over that range),
- the chosen grid ``(scale, zero_point)`` from ``calculate_qparams()`` and its representable
  (clipping) range ``[(qmin - zp)·s, (qmax - zp)·s]``.

Values outside the clipping range saturate; a clipping range much wider than the observed one
wastes resolution.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> prepared = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2)), Q.get_minmax_qconfig())
>>> _ = prepared(torch.tensor([[-1.0, 0.0, 1.0, 2.0]]))
>>> r = activation_ranges(prepared)[0]
>>> r.name, r.observed, [round(v, 4) for v in r.clip]
('0', (-1.0, 2.0), [-1.0, 2.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..observer import ObserverBase
from .compare import check_module

__all__ = ["ActivationRange", "activation_ranges"]


@dataclass(frozen=True)
class ActivationRange:
    """One observer: observed range, optional histogram, chosen grid and its clipping range."""

    name: str
    observer: str                           # observer class name
    observed: tuple[float, float]           # (min_val, max_val)
    clip: tuple[float, float]               # ((qmin - zp)·s, (qmax - zp)·s)
    scale: float
    zero_point: int
    histogram: torch.Tensor | None = None   # (bins,) counts over ``observed``; None for min/max observers

    def bin_edges(self) -> torch.Tensor | None:
        """``bins + 1`` edges of ``histogram`` over the observed range."""
        if self.histogram is None:
            return None
        return torch.linspace(self.observed[0], self.observed[1], self.histogram.numel() + 1)


def _read(name: str, obs: nn.Module) -> ActivationRange | None:
    inner = obs.activation_post_process if isinstance(obs, FakeQuantize) else obs
    if not isinstance(inner, ObserverBase) or not getattr(inner, "is_calibrated", False):
        return None
    lo, hi = getattr(inner, "min_val", None), getattr(inner, "max_val", None)
    if not isinstance(lo, torch.Tensor) or not isinstance(hi, torch.Tensor) or lo.numel() != 1:
        return None  # placeholder or per-channel observer
    scale, zero_point = obs.calculate_qparams()  # type: ignore[operator]  # observer or FakeQuantize
    if scale.numel() != 1:
        return None
    s, z = float(scale), int(zero_point)
    qmin, qmax = int(inner.quant_min), int(inner.quant_max)
    hist = getattr(inner, "histogram", None)
    return ActivationRange(name, type(inner).__name__, (float(lo), float(hi)), ((qmin - z) * s, (qmax - z) * s),
                           s, z, hist.detach().cpu().clone() if isinstance(hist, torch.Tensor) else None)


def activation_ranges(prepared_model: nn.Module) -> list[ActivationRange]:
    """Every calibrated per-tensor activation observer of ``prepared_model``, in module order."""
    check_module(prepared_model, "activation_ranges: prepared_model")
    out = []
    if isinstance(prepared_model, fx.GraphModule):  # prepare_fx: observers are the root's children, one per value
        mods = dict(prepared_model.named_modules())
        for node in prepared_model.graph.nodes:
            obs = mods.get(str(node.target)) if node.op == "call_module" else None
            src = node.args[0] if node.args else None
            if not isinstance(obs, (ObserverBase, FakeQuantize)) or not isinstance(src, fx.Node):
                continue
            label = (str(src.target) if src.op == "call_module" else
                     f"{src.name} (input)" if src.op == "placeholder" else src.name)
            r = _read(label, obs)
            if r is not None:
                out.append(r)
    for name, mod in prepared_model.named_modules():
        if isinstance(mod, (ObserverBase, FakeQuantize)):
            continue
        for attr, label in (("input_activation_post_process", f"{name or '<root>'} (input)"),
                            ("activation_post_process", name or "<root>")):
            obs = mod._modules.get(attr)
            r = _read(label, obs) if isinstance(obs, (ObserverBase, FakeQuantize)) else None
            if r is not None:
                out.append(r)
    if not out:
        raise ValueError(f"activation_ranges: {type(prepared_model).__name__} has no calibrated activation "
                         "observer; pass a model from prepare()/prepare_qat()/prepare_fx() after calibration batches")
    return out
