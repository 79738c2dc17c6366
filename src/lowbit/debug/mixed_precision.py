"""Automatic mixed precision: keep the fewest layers float that bring the model within a budget.

``auto_mixed_precision(model, qconfig_mapping, calib, eval_fn, tolerance=..., max_float_layers=...)``
builds on ``sensitivity``: it ranks the layers by the metric drop each causes when quantized alone
(worst first), quantizes everything, and then walks the ranking greedily::

    metric = eval_fn(all quantized)
    for L in ranking (worst first), while baseline - metric > tolerance and len(float) < max_float_layers:
        m = eval_fn(quantized with float ∪ {L} kept float)
        if m > metric: float ∪= {L}, metric = m            # a layer that does not help stays int8

so every layer kept float pays for itself. ``tolerance`` (``>= 0``) is the largest acceptable drop
``baseline - metric`` (``eval_fn``: higher is better); ``max_float_layers`` caps the float layers;
give either or both. ``mode="eager"`` (``prepare``/``convert``, optional ``fuse`` groups) or ``"fx"``
(``prepare_fx``/``convert_fx`` with ``example_inputs``). Costs ``L + 1`` quantizations for the
ranking plus one per greedy step.

>>> import torch, lowbit as Q
>>> from lowbit.debug import auto_mixed_precision
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
>>> x = torch.randn(128, 8)
>>> x[0, 0] = 200.0                                       # one outlier input: layer 0's input grid suffers
>>> ref = model(x).detach()
>>> score = lambda m: -float(((m(x) - ref) ** 2).mean())  # higher is better
>>> mapping, table = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=1,
...                                       mode="fx", progress=False)
>>> table.float_layers, table.final_metric > 2 * table.all_quantized_metric
(['0'], True)
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..qconfig import QConfigMapping
from .compare import check_module, iter_batches
from .sensitivity import (
    SensitivityTable,
    _fused,
    _quantize,
    _quiet_float_fallback,
    _score,
    example_inputs_of,
    sensitivity,
)

__all__ = ["auto_mixed_precision"]

_MODES = ("eager", "fx")


def auto_mixed_precision(model: nn.Module, qconfig_mapping: Any, calib: Any, eval_fn: Callable[[nn.Module], Any],
                         *, tolerance: float | None = None, max_float_layers: int | None = None,
                         mode: str = "eager", example_inputs: tuple[Any, ...] | None = None,
                         fuse: Any = None, progress: bool = True) -> tuple[QConfigMapping, SensitivityTable]:
    """Quantize ``model`` keeping float the fewest layers that meet ``tolerance`` / ``max_float_layers``.

    Returns ``(mapping, table)``: ``mapping`` is the user's mapping plus ``set_module_name(L, None)``
    for every layer kept float (use it with ``prepare`` or ``prepare_fx`` as ``mode`` says); ``table``
    is ``sensitivity``'s ranking (worst first) with ``float_layers``, ``final_metric`` and, when given,
    ``tolerance``. ``model`` is not modified.
    """
    check_module(model, "auto_mixed_precision: model")
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"auto_mixed_precision: mode={mode!r} must be 'eager' or 'fx'")
    if tolerance is None and max_float_layers is None:
        raise ValueError("auto_mixed_precision: give a budget: tolerance (largest acceptable metric drop) "
                         "and/or max_float_layers")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                                  or not 0 <= tolerance < math.inf):
        raise ValueError(f"auto_mixed_precision: tolerance={tolerance!r} must be a finite number >= 0")
    if max_float_layers is not None and (isinstance(max_float_layers, bool) or not isinstance(max_float_layers, int)
                                         or max_float_layers < 0):
        raise ValueError(f"auto_mixed_precision: max_float_layers={max_float_layers!r} must be an int >= 0")
    method = "fx" if mode == "fx" else "ptq"
    batches = list(iter_batches(calib, "auto_mixed_precision: calib"))
    if mode == "fx" and example_inputs is None:
        example_inputs = example_inputs_of(batches[0], "auto_mixed_precision")
    mapping, table = sensitivity(model, qconfig_mapping, batches, eval_fn, fuse=fuse, method=method,
                                 example_inputs=example_inputs)
    table.tolerance = tolerance
    base = _fused(model, fuse, method)
    budget = len(table.rows) if max_float_layers is None else max_float_layers
    limit = -math.inf if tolerance is None else tolerance  # no tolerance: only the layer budget stops

    def measure(m: QConfigMapping, what: str) -> float:
        return _score(eval_fn, _quantize(base, m, batches, method, None, example_inputs), what)

    with _quiet_float_fallback(), torch.no_grad():
        metric = measure(mapping, "the fully quantized model")
        table.all_quantized_metric = metric
        steps = tqdm(table.rows, desc="auto_mixed_precision", disable=not progress, leave=False)
        for row in steps:
            if table.baseline - metric <= limit or len(table.float_layers) >= budget:
                break
            trial = copy.deepcopy(mapping).set_module_name(row.name, None)
            m = measure(trial, f"the model with {[*table.float_layers, row.name]} float")
            if m > metric:
                mapping, metric = trial, m
                table.float_layers.append(row.name)
    table.final_metric = metric
    return mapping, table
