"""End-to-end bias tuning (AdaQuant's "bias tuning", Hubara et al. 2021) of a rounded prepared model.

After the layer- and block-wise passes (``lowbit.algorithms.layerwise``) every layer matches its own
float target; what is judged is the model's output, where the leftover errors of all layers meet.
With the weight codes fixed, the biases ``b`` of every weighted layer (and, with ``grids=True``, the
step sizes ``s = s0 exp(t)`` of the per-tensor activation grids after weighted layers and residual
adds, ``block.LearnedGrid``) minimise on the calibration data::

    || M_q(x; b, t) - M(x) ||^2 / || M_q(x; b0, t0) - M(x) ||^2

``M`` the float model, ``M_q`` the prepared model run as the int8 model runs (every activation observer
fake-quantizes on its grid with the straight-through gradient, weights on their frozen codes), the
error summed over the output's dim 1 and averaged over samples, normalised by its value before tuning
(on the first mini-batch). Adam, ``iters`` steps of ``batch_size`` random samples of one calibration
batch. Few parameters (one per output channel) for many targets, so little room to overfit. The tuned
values are kept only if the error over all the calibration batches went down; tuned grids replace
their observers (``FixedQParamsObserver``), so ``convert_fx`` uses exactly what was tuned.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
>>> calib = [torch.randn(32, 8) + 2 for _ in range(2)]
>>> p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
>>> for b in calib: _ = p(b)
>>> err = lambda m: sum(float((m(b) - model(b)).pow(2).sum().detach()) for b in calib)
>>> before = err(Q.convert_fx(__import__("copy").deepcopy(p)))
>>> r = tune_biases(p, model, calib, iters=50, batch_size=16, progress=False)
>>> r.kept and err(Q.convert_fx(p)) < before
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..batches import output_tensors
from .block import install_grid, learnable_grids
from .layers import freeze_weight, is_weighted, split, weight_codes
from .layerwise_step import batch_tuples, patch_observers

__all__ = ["tune_biases", "TuneResult"]


@dataclass
class TuneResult:
    """What ``tune_biases`` did: the output error over the calibration batches before and after tuning
    (after: of the tuned values, also when they were not kept), whether they were kept."""

    error_before: float
    error_after: float
    kept: bool
    n_biases: int
    n_grids: int


def _tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) output, in order, gradients kept."""
    return [t for t in output_tensors(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _error(out: Any, target: list[torch.Tensor]) -> torch.Tensor:
    """Squared error summed over dim 1 and averaged over the rest, summed over the output's tensors."""
    total = torch.zeros(())
    for o, t in zip(_tensors(out), target):
        d = (o - t).pow(2)
        total = total + (d.sum(1).mean() if d.dim() > 1 else d.mean())
    return total


def check_outputs(out: Any, target: list[torch.Tensor], where: str, i: int) -> None:
    """``ValueError`` unless the prepared model's output ``out`` on calibration batch ``i`` holds as many
    floating-point tensors as the float model's (``target``), each of the same shape: a float model of another output
    structure was compared element by element (``zip`` stopped at the shorter, a ``(N, 1)`` target broadcast)."""
    got = _tensors(out)
    if len(got) != len(target) or any(o.shape != t.shape for o, t in zip(got, target)):
        raise ValueError(f"{where}: on calib batch {i} the prepared model returned float tensors of shapes "
                         f"{[tuple(o.shape) for o in got]}, float_model {[tuple(t.shape) for t in target]}; "
                         "float_model must be the model that was prepared (the same outputs)")


def _subsample(batch: tuple[Any, ...], target: list[torch.Tensor], batch_size: int,
               g: torch.Generator) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """``batch_size`` random samples of a batch and its targets (the whole batch where the inputs and
    outputs do not share one leading batch dimension)."""
    sizes = {a.shape[0] for a in (*batch, *target) if isinstance(a, torch.Tensor) and a.dim() > 0}
    if len(sizes) != 1 or not all(t.dim() > 0 for t in target):
        return batch, target
    n = sizes.pop()
    idx = torch.randint(n, (min(batch_size, n),), generator=g)
    return tuple(a[idx] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in batch), [t[idx] for t in target]


def tune_biases(prepared: nn.Module, float_model: nn.Module, calib: Iterable[Any], iters: int = 100,
                batch_size: int = 16, lr: float = 1e-3, grids: bool = False, grid_lr: float = 1e-3, seed: int = 0,
                progress: bool = True) -> TuneResult:
    """Tune the biases (and with ``grids`` the activation step sizes) of a calibrated, rounded graph-mode
    ``prepared`` model on its whole output against ``float_model``'s; see the module docstring.

    ``prepared`` is changed in place (biases; learned grids replace their observers) when the error over all
    of ``calib`` goes down, else left as it was. Nested outputs are flattened; the error sums over their tensors.
    """
    if not isinstance(prepared, fx.GraphModule):
        raise TypeError(f"tune_biases: prepared must be a graph-mode prepared model (prepare_fx), "
                        f"got {type(prepared).__name__}")
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"tune_biases: iters={iters!r} must be an int >= 0")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"tune_biases: batch_size={batch_size!r} must be an int >= 1")
    from tqdm.auto import tqdm

    batches, g = batch_tuples(calib, "tune_biases"), torch.Generator().manual_seed(seed)
    mods = dict(prepared.named_modules())
    biases = []
    for node in prepared.graph.nodes:  # the layers the graph calls (a fused marker's op carries a qconfig too)
        m = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        if m is None or not is_weighted(m):
            continue
        q, s, z, _, _ = weight_codes(m)
        freeze_weight(m, q, s, z)  # pin the codes (a no-op on layers the rounding pass froze)
        op = split(m)[0]
        if op.bias is None:
            op.bias = nn.Parameter(torch.zeros(op.weight.shape[0], dtype=op.weight.dtype))
        if all(op.bias is not b for b in biases):
            biases.append(op.bias)
    learn = learnable_grids(list(prepared.graph.nodes), mods) if grids else {}
    with torch.no_grad():
        targets = [[t.detach() for t in _tensors(float_model(*b))] for b in batches]
    flags = {p: p.requires_grad for p in prepared.parameters()}
    saved = [b.detach().clone() for b in biases]
    patched = patch_observers(prepared, "quant")
    for node, gr in learn.items():
        mods[node.target].forward = gr  # type: ignore[index]

    def total() -> float:
        with torch.no_grad():
            outs = [(prepared(*b), t) for b, t in zip(batches, targets)]
        for i, (o, t) in enumerate(outs):
            check_outputs(o, t, "tune_biases", i)
        return sum(float(_error(o, t)) for o, t in outs)

    try:
        for p in prepared.parameters():
            p.requires_grad_(False)
        for b in biases:
            b.requires_grad_(True)
        before = total()
        groups = [{"params": biases, "lr": lr}] if biases else []
        if learn:
            groups.append({"params": [gr.t for gr in learn.values()], "lr": grid_lr})
        # nothing to tune (a model without weighted layers or learnable grids: no bias reaches the output)
        opt = torch.optim.Adam(groups) if groups else None
        scale = None
        for _ in tqdm(range(iters if opt is not None else 0), desc="tune biases", disable=not progress):
            k = int(torch.randint(len(batches), (1,), generator=g))
            args, target = _subsample(batches[k], targets[k], batch_size, g)
            loss = _error(prepared(*args), target)
            if not loss.requires_grad:  # the output does not depend on what is tuned (e.g. only float ops)
                break
            if scale is None:
                scale = float(loss.detach()) + 1e-12
            opt.zero_grad()
            (loss / scale).backward()
            opt.step()
        after = total()
        kept = after < before
        with torch.no_grad():
            if not kept:
                for b, s in zip(biases, saved):
                    b.copy_(s)
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
        for p, f in flags.items():
            p.requires_grad_(f)
            p.grad = None
    if kept:
        with torch.no_grad():
            for node, gr in learn.items():
                install_grid(prepared, mods, node, gr)
    return TuneResult(before, after, kept, len(biases), len(learn) if kept else 0)
