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

>>> import copy, lowbit as Q
>>> from lowbit.algorithms.end_to_end import example
>>> model, calib, p, err = example()             # a calibrated MLP; err: its output error against the float model
>>> before = err(Q.convert_fx(copy.deepcopy(p)))
>>> r = tune_biases(p, model, calib, iters=50, batch_size=16, progress=False)
>>> r.kept and err(Q.convert_fx(p)) < before
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .end_to_end import EndToEnd, check_args

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


def tune_biases(prepared: nn.Module, float_model: nn.Module, calib: Iterable[Any], iters: int = 100,
                batch_size: int = 16, lr: float = 1e-3, grids: bool = False, grid_lr: float = 1e-3, seed: int = 0,
                progress: bool = True) -> TuneResult:
    """Tune the biases (and with ``grids`` the activation step sizes) of a calibrated, rounded graph-mode
    ``prepared`` model on its whole output against ``float_model``'s; see the module docstring.

    ``prepared`` is changed in place (biases; learned grids replace their observers) when the error over all
    of ``calib`` goes down, else left as it was, byte for byte (a zero bias given to a bias-less layer removed
    again). Nested outputs are flattened; the error sums over their tensors. The learning rates stay constant.
    """
    check_args("tune_biases", prepared, float_model, iters, batch_size, seed, {"grids": grids, "progress": progress},
               {"lr": lr, "grid_lr": grid_lr})
    e = EndToEnd(prepared, float_model, calib, "tune_biases", seed)
    kept = False
    try:
        e.freeze(grids)
        biases = e.biases()
        groups = [{"params": biases, "lr": lr}]
        if e.learn:
            groups.append({"params": [gr.t for gr in e.learn.values()], "lr": grid_lr})
        before, after = e.fit(groups, iters, batch_size, cosine=False, desc="tune biases", progress=progress)
        kept = after < before
    finally:
        e.finish(kept)
    return TuneResult(before, after, kept, len(biases), len(e.learn) if kept else 0)
