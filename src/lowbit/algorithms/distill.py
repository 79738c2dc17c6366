"""End-to-end distillation of a rounded prepared model: weight codes, biases and activation steps learn together on
the whole model's output against the float model's (label-free, calibration data only).

The layer- and block-wise passes (``lowbit.algorithms.layerwise``, ``block``) fit every layer or residual block to its
own float target; their leftover errors meet at the output, and the bias tuning of ``lowbit.algorithms.tune`` can
move only one number per channel. Here every weight code moves too. A weighted layer's weight is held as its codes
plus a learned offset ``u`` in grid steps, its grid ``(s, z)`` per output channel fixed::

    W(u) = (clamp(round(q - z + u), qmin - z, qmax - z)) * s           (straight-through: dW/du = s inside the clamp)

with ``q`` the codes the rounding passes chose (round to nearest where none ran), ``u = 0`` at the start, so step 0
runs exactly the rounded model. With the biases ``b`` and, with ``grids=True``, the step sizes ``s_a = s_a0 exp(t)``
of the per-tensor activation grids (``block.LearnedGrid``), Adam minimises on random samples of the calibration
batches::

    || M_q(x; u, b, t) - M(x) ||^2                      (summed over the output's dim 1, averaged over samples)

``M`` the float model, ``M_q`` the prepared model run as the int8 model runs (every activation observer
fake-quantizes on its grid, ``layerwise_step.patch_observers(model, "quant")``). The learning rates follow a cosine
schedule to 0. The result is kept only if the output error over all calibration batches went down; the new codes are
then pinned (``layers.freeze_weight``) and the tuned grids replace their observers, so ``convert_fx`` runs exactly
what was optimised. This is quantization-aware fine-tuning by distillation, with the grids and most codes already
good: MobileNetV2 after the accurate recipe (100 AdaRound steps, 192 calibration crops, 150 steps of 16 crops, 1
thread, 1440 evaluation crops): 0.899 / 21.30 dB -> 0.913 / 22.42 dB top-1 agreement / logit SQNR
(``docs/design.md``).

>>> import copy, lowbit as Q
>>> from lowbit.algorithms.end_to_end import example
>>> model, calib, p, err = example()             # a calibrated MLP; err: its output error against the float model
>>> before = err(Q.convert_fx(copy.deepcopy(p)))
>>> r = distill(p, model, calib, iters=60, batch_size=16, progress=False)
>>> r.kept and err(Q.convert_fx(p)) < before
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fake_quant.base import holds_grid
from ..rounding import round_codes
from .end_to_end import EndToEnd, check_args, graphs
from .layers import freeze_weight

__all__ = ["distill", "DistillResult"]


@dataclass
class DistillResult:
    """What ``distill`` did: the output error over the calibration batches before and after (after: of the learned
    values, also when they were not kept), whether they were kept, how many layers / weight codes / grids learned
    and how many codes moved from where they started (0 when not kept)."""

    error_before: float
    error_after: float
    kept: bool
    n_layers: int
    n_codes: int
    codes_moved: int
    n_grids: int


class _Offset(nn.Module):
    """The parametrization ``W(u)`` of the module doc: the layer's codes plus ``u`` steps, straight-through."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int) -> None:
        super().__init__()
        self.register_buffer("v0", q - z)
        self.register_buffer("s", s)
        self.register_buffer("lo", qmin - z)
        self.register_buffer("hi", qmax - z)
        self.u = nn.Parameter(torch.zeros_like(q))

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        v = self.v0 + self.u
        return torch.minimum(torch.maximum(v + (torch.round(v) - v).detach(), self.lo), self.hi) * self.s


def _check_calibrated(prepared: nn.Module) -> None:
    """``ValueError`` naming the first activation observer that saw no data (``convert_fx`` refuses the model then;
    distilling it would fit observers that run as the identity). A child graph of an untraceable forward whose
    observers all saw nothing (a branch no calibration batch takes) is left as it is, as ``convert_fx`` does."""
    for gm in graphs(prepared):  # the model's graph and its child graphs (an untraceable forward)
        observers = [(node, gm.get_submodule(node.target)) for node in gm.graph.nodes  # type: ignore[arg-type]
                     if node.op == "call_module" and node.meta.get("lowbit_kind") in ("obs_out", "obs_in")]
        idle = [node for node, obs in observers if not holds_grid(obs) and getattr(
            getattr(obs, "activation_post_process", obs), "is_calibrated", True) is False]
        if idle and not (gm is not prepared and len(idle) == len(observers)):
            raise ValueError(f"distill: the observer after '{idle[0].args[0]}' ({idle[0].target}) saw no data; run "
                             "calibration batches through the prepared model first")


def distill(prepared: nn.Module, float_model: nn.Module, calib: Iterable[Any], iters: int = 200,
            batch_size: int = 16, lr: float = 1e-2, bias_lr: float = 1e-4, grids: bool = True,
            grid_lr: float = 1e-4, seed: int = 0, progress: bool = True) -> DistillResult:
    """Distill a calibrated (usually rounded) graph-mode ``prepared`` model into ``float_model``'s outputs: weight codes
    (``lr`` in grid steps per Adam step), biases (``bias_lr``) and, with ``grids``, the per-tensor activation steps
    (``grid_lr``) learn for ``iters`` steps of ``batch_size`` random samples of one calibration batch; see the module
    docstring. ``prepared`` is changed in place when the error over all of ``calib`` goes down, else left as it was.
    The targets are ``float_model``'s outputs in eval mode (a model in training mode is switched to eval for them and
    back: no batch-norm statistics updated, no dropout); its outputs must match ``prepared``'s, tensor for tensor.
    """
    check_args("distill", prepared, float_model, iters, batch_size, seed, {"grids": grids, "progress": progress},
               {"lr": lr, "bias_lr": bias_lr, "grid_lr": grid_lr})
    _check_calibrated(prepared)
    from torch.nn.utils import parametrize

    e = EndToEnd(prepared, float_model, calib, "distill", seed)
    starts, offsets = [], []
    moved, kept = 0, False
    try:
        for m, op, q, s, z, qmin, qmax in e.freeze(grids):
            off = _Offset(q, s, z, qmin, qmax)
            order = list(op._parameters)
            parametrize.register_parametrization(op, "weight", off, unsafe=True)
            starts.append((m, op, q, s, z, order, qmin, qmax))
            offsets.append(off.u)
        groups = [{"params": offsets, "lr": lr}, {"params": e.biases(), "lr": bias_lr}]
        if e.learn:
            groups.append({"params": [gr.t for gr in e.learn.values()], "lr": grid_lr})
        before, after = e.fit(groups, iters, batch_size, cosine=True, desc="distill", progress=progress)
        kept = after < before
    finally:
        with torch.no_grad():
            for m, op, q, s, z, order, qmin, qmax in starts:
                parametrize.remove_parametrizations(op, "weight", leave_parametrized=True)
                params = op._parameters  # the weight back in its place (state_dict order as before)
                op._parameters = type(params)((k, params[k]) for k in [*order, *params] if k in params)
                if kept:
                    q2 = round_codes(op.weight, s, z, qmin, qmax)  # the codes convert reads off the weight
                    moved += int((q2 != q).sum())
                    freeze_weight(m, q2, s, z)
        e.finish(kept)
    return DistillResult(before, after, kept, len(e.layers), sum(int(st[2].numel()) for st in starts), moved,
                         len(e.learn) if kept else 0)
