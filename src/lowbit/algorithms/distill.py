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

>>> import copy, torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
>>> calib = [torch.randn(32, 8) + 2 for _ in range(2)]
>>> p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
>>> for b in calib: _ = p(b)
>>> err = lambda m: sum(float((m(b) - model(b)).pow(2).sum().detach()) for b in calib)
>>> before = err(Q.convert_fx(copy.deepcopy(p)))
>>> r = distill(p, model, calib, iters=60, batch_size=16, progress=False)
>>> r.kept and err(Q.convert_fx(p)) < before
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant.base import holds_grid
from .block import install_grid, learnable_grids
from ..rounding import round_codes
from .layers import freeze_weight, is_weighted, split, weight_codes
from .layerwise_step import batch_tuples, patch_observers
from .tune import _error, _subsample, _tensors, check_outputs

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


def _layers(prepared: fx.GraphModule) -> list[nn.Module]:
    """The weighted layers the graph calls, each once, in graph order."""
    mods = dict(prepared.named_modules())
    out: list[nn.Module] = []
    for node in prepared.graph.nodes:
        m = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        if m is not None and is_weighted(m) and all(m is not k for k in out):
            out.append(m)
    return out


def _check_calibrated(prepared: fx.GraphModule) -> None:
    """``ValueError`` naming the first activation observer that saw no data (``convert_fx`` refuses the model then;
    distilling it would fit observers that run as the identity)."""
    for node in prepared.graph.nodes:
        if node.op == "call_module" and node.meta.get("lowbit_kind") in ("obs_out", "obs_in"):
            obs = prepared.get_submodule(node.target)  # type: ignore[arg-type]
            if not holds_grid(obs) and getattr(getattr(obs, "activation_post_process", obs), "is_calibrated", True) \
                    is False:
                raise ValueError(f"distill: the observer after '{node.args[0]}' ({node.target}) saw no data; run "
                                 "calibration batches through the prepared model first")


def _targets(float_model: nn.Module, batches: list[tuple[Any, ...]]) -> list[list[torch.Tensor]]:
    """``float_model``'s float output tensors on every batch, in eval mode (its modes restored); a batch with no
    samples or one the model fails on is refused naming it."""
    for i, b in enumerate(batches):
        if any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 0 for t in b):
            raise ValueError(f"distill: calib batch {i} has no samples (input shapes "
                             f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in b]})")
    modes = [(m, m.training) for m in float_model.modules()]
    float_model.eval()
    out = []
    try:
        with torch.no_grad():
            for i, b in enumerate(batches):
                try:
                    y = float_model(*b)
                except Exception as e:
                    raise ValueError(f"distill: float_model failed on calib batch {i} (input shapes "
                                     f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in b]}"
                                     f"): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
                out.append([t.detach() for t in _tensors(y)])
    finally:
        for m, mode in modes:
            m.training = mode
    return out


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
    if not isinstance(prepared, fx.GraphModule):
        raise TypeError(f"distill: prepared must be a graph-mode prepared model (prepare_fx), "
                        f"got {type(prepared).__name__}")
    if not isinstance(float_model, nn.Module):
        raise TypeError(f"distill: float_model must be an nn.Module, got {type(float_model).__name__}")
    for name, v in (("iters", iters), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not (0 if name == "iters" else 1) <= v < 2 ** 63:
            raise ValueError(f"distill: {name}={v!r} must be an int in [{0 if name == 'iters' else 1}, 2**63)")
    for name, v in (("lr", lr), ("bias_lr", bias_lr), ("grid_lr", grid_lr)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"distill: {name}={v!r} must be a finite number >= 0")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"distill: seed={seed!r} must be an int")
    if not -2 ** 63 <= seed < 2 ** 64:  # torch.Generator's range
        raise ValueError(f"distill: seed={seed!r} must be in [-2**63, 2**64)")
    for name, v in (("grids", grids), ("progress", progress)):
        if not isinstance(v, bool):
            raise TypeError(f"distill: {name}={v!r} must be True or False")
    _check_calibrated(prepared)
    from tqdm.auto import tqdm
    from torch.nn.utils import parametrize

    batches, g = batch_tuples(calib, "distill"), torch.Generator().manual_seed(seed)
    mods = dict(prepared.named_modules())
    targets = _targets(float_model, batches)
    layers = _layers(prepared)
    saved = {k: v.detach().clone() for k, v in prepared.state_dict().items()}
    qconfigs = [(m, m.qconfig, split(m)[0].qconfig if split(m)[0] is not m else None) for m in layers]
    starts, offsets, biases, added = [], [], [], []
    for m in layers:
        q, s, z, qmin, qmax = weight_codes(m)
        freeze_weight(m, q, s, z)  # pin the codes (a no-op on layers the rounding pass froze)
        op = split(m)[0]
        off = _Offset(q, s, z, qmin, qmax)
        order = list(op._parameters)
        parametrize.register_parametrization(op, "weight", off, unsafe=True)
        starts.append((m, op, q, s, z, order, qmin, qmax))
        offsets.append(off.u)
        if op.bias is None:
            op.bias = nn.Parameter(torch.zeros(q.shape[0], dtype=torch.float32))
            added.append(op)
        if all(op.bias is not b for b in biases):
            biases.append(op.bias)
    learn = learnable_grids(list(prepared.graph.nodes), mods) if grids else {}
    flags = {p: p.requires_grad for p in prepared.parameters()}
    patched = patch_observers(prepared, "quant")
    for node, gr in learn.items():
        mods[node.target].forward = gr  # type: ignore[index]

    def total() -> float:
        with torch.no_grad():
            outs = [(prepared(*b), t) for b, t in zip(batches, targets)]
        for i, (o, t) in enumerate(outs):
            check_outputs(o, t, "distill", i)
        return sum(float(_error(o, t)) for o, t in outs)

    moved, kept = 0, False
    try:
        for p in prepared.parameters():
            p.requires_grad_(False)
        tuned = offsets + biases + [gr.t for gr in learn.values()]
        for p in tuned:
            p.requires_grad_(True)
        before = after = total()
        if tuned and iters:
            groups = [{"params": offsets, "lr": lr}, {"params": biases, "lr": bias_lr}]
            if learn:
                groups.append({"params": [gr.t for gr in learn.values()], "lr": grid_lr})
            opt = torch.optim.Adam([gr for gr in groups if gr["params"]])
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iters)
            scale = None
            for _ in tqdm(range(iters), desc="distill", disable=not progress):
                k = int(torch.randint(len(batches), (1,), generator=g))
                args, target = _subsample(batches[k], targets[k], batch_size, g)
                loss = _error(prepared(*args), target)
                if not loss.requires_grad:  # nothing learnable reaches the output
                    break
                if scale is None:
                    scale = float(loss.detach()) + 1e-12
                opt.zero_grad()
                (loss / scale).backward()
                opt.step()
                sched.step()
            after = total()
        kept = after < before
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
        with torch.no_grad():
            for m, op, q, s, z, order, qmin, qmax in starts:
                parametrize.remove_parametrizations(op, "weight", leave_parametrized=True)
                params = op._parameters  # the weight back in its place (state_dict order as before)
                op._parameters = type(params)((k, params[k]) for k in [*order, *params] if k in params)
                if kept:
                    q2 = round_codes(op.weight, s, z, qmin, qmax)  # the codes convert reads off the weight
                    moved += int((q2 != q).sum())
                    freeze_weight(m, q2, s, z)
        for p, f in flags.items():
            p.requires_grad_(f)
            p.grad = None
        if not kept:  # the weights, biases and qconfigs as they were (biases it added removed)
            for op in added:
                op.bias = None
            for m, qc, opqc in qconfigs:
                m.qconfig = qc
                if opqc is not None:
                    split(m)[0].qconfig = opqc
            with torch.no_grad():
                state = prepared.state_dict()
                for k, v in saved.items():
                    state[k].copy_(v)
    if kept:
        with torch.no_grad():
            for node, gr in learn.items():
                install_grid(prepared, mods, node, gr)
    return DistillResult(before, after, kept, len(layers), sum(int(st[2].numel()) for st in starts), moved,
                         len(learn) if kept else 0)
