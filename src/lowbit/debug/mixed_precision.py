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
ranking plus one per greedy step (``search="exact"``, the default).

``search="fast"`` quantizes **once** and then swaps layers of that one converted model back to float
(no new calibration): the ranking is one evaluation per layer with *only that layer float*
(``metric_L``, best first: the layer whose float twin helps most), the greedy walk keeps a layer float
if that improves the metric and stops at the budget or at the first layer whose own gain
``metric_L - metric_all`` is not positive. ``L + 1`` evaluations plus a few, one calibration. The
candidates are the converted model's int8 modules the user's model names: weighted layers, standalone
BatchNorm / BNReLU, quantized activations and (eager) ``QFunctional`` (``float_swap.py``); in graph mode (either
search) also the int8 adds / muls / cats a call-order key reaches, named ``"module:function#index"``
(``"features.3:operator.add#0"``, ``"torch.cat#0"`` at the root; ``table.op_keys`` holds the key, the mapping gets
``set_module_name_object_type_order(module, function, index, None)``). A layer kept float computes in float from its
dequantized input. Graph mode: its output stays float, rounded onto the layer's calibrated grid only on the edges an
int8 op reads (a reused layer: per call, on the grid of that call's own outputs), and the int8 ops ``prepare_fx`` then
leaves float as islands are float too: each score is the one of the model ``prepare_fx`` builds. Eager mode: its
output is float, and every int8 weighted layer that reads it (directly, through ``flatten`` / ``view`` / an add,
or a reused layer) quantizes it on the input grid the calibration recorded for that case, so the score is the
one of the model ``prepare`` builds with ``L`` float, code for code (a layer called several times with only some
calls reading float layers: up to its grid, which covers all its calls). The ranking sorts
by ``metric_L`` itself (an SQNR-vs-float metric scores the float model ``inf``: every drop is ``inf``). A layer
alone in its own graph (an untraceable parent's child) is swapped for the float module itself.
``finalize(qmodel)`` (e.g. ``lowbit.fuse_dequantize``) runs on every converted model before it is
scored, in either search; use it again on the model built from the returned mapping.

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
from .checks import check_float_model
from .compare import check_module, iter_batches
from .float_swap import _search, _swaps, keep_float_layers
from .float_twins import _FloatTwin, give_input_grids, record_tagged_inputs
from .graph_swap import record_call_outputs
from .swap_edges import record_share_ends
from .sensitivity import (
    SensitivityTable,
    _dequantize_output,
    _fused,
    _quantize,
    _quiet_float_fallback,
    _score,
    check_calib,
    example_inputs_of,
    metric_drop,
    sensitivity,
)
from .table import keep_float

__all__ = ["auto_mixed_precision", "keep_float_layers"]
_REEXPORTED = (_FloatTwin,)  # export.twin finds it here (no import of lowbit.debug), ptq imports keep_float_layers

_MODES = ("eager", "fx")
_SEARCHES = ("exact", "fast")


def auto_mixed_precision(model: nn.Module, qconfig_mapping: Any, calib: Any, eval_fn: Callable[[nn.Module], Any],
                         *, tolerance: float | None = None, max_float_layers: int | None = None,
                         mode: str = "eager", example_inputs: tuple[Any, ...] | None = None,
                         fuse: Any = None, progress: bool = True, search: str = "exact",
                         finalize: Callable[[nn.Module], Any] | None = None) -> tuple[QConfigMapping, SensitivityTable]:
    """Quantize ``model`` keeping float the fewest layers that meet ``tolerance`` / ``max_float_layers``.

    Returns ``(mapping, table)``: ``mapping`` is the user's mapping plus ``set_module_name(L, None)``
    for every layer kept float (use it with ``prepare`` or ``prepare_fx`` as ``mode`` says); ``table``
    is ``sensitivity``'s ranking (worst first) with ``float_layers``, ``final_metric`` and, when given,
    ``tolerance``. ``model`` is not modified.
    """
    check_float_model(check_module(model, "auto_mixed_precision: model"), "auto_mixed_precision")
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
    if not isinstance(search, str) or search not in _SEARCHES:
        raise ValueError(f"auto_mixed_precision: search={search!r} must be 'exact' or 'fast'")
    if finalize is not None and not callable(finalize):
        raise TypeError(f"auto_mixed_precision: finalize={finalize!r} must be callable (converted model -> None)")
    if not callable(eval_fn):
        raise TypeError(f"auto_mixed_precision: eval_fn={eval_fn!r} must be callable (model -> score, higher is better)")
    method = "fx" if mode == "fx" else "ptq"
    batches = list(iter_batches(calib, "auto_mixed_precision: calib"))
    check_calib(batches, "auto_mixed_precision")
    if mode == "fx" and example_inputs is None:
        example_inputs = example_inputs_of(batches[0], "auto_mixed_precision")
    if search == "fast":
        return _fast(model, qconfig_mapping, batches, eval_fn, tolerance, max_float_layers, method, example_inputs,
                     fuse, progress, finalize)
    mapping, table = sensitivity(model, qconfig_mapping, batches, eval_fn, fuse=fuse, method=method,
                                 example_inputs=example_inputs, progress=progress, who="auto_mixed_precision")
    table.tolerance = tolerance
    base = _fused(model, fuse, method)
    budget = len(table.rows) if max_float_layers is None else max_float_layers
    limit = -math.inf if tolerance is None else tolerance  # no tolerance: only the layer budget stops

    def measure(m: QConfigMapping, what: str) -> float:
        qmodel = _quantize(base, m, batches, method, None, example_inputs)
        if finalize is not None:
            finalize(qmodel)
        return _score(eval_fn, qmodel, what, "auto_mixed_precision")

    with _quiet_float_fallback(), torch.no_grad():
        metric = measure(mapping, "the fully quantized model")
        table.all_quantized_metric = metric
        steps = tqdm(table.rows, desc="auto_mixed_precision", disable=not progress, leave=False)
        for row in steps:
            if metric_drop(table.baseline, metric) <= limit or len(table.float_layers) >= budget:
                break
            trial = keep_float(copy.deepcopy(mapping), row.name, table.op_keys)
            m = measure(trial, f"the model with {[*table.float_layers, row.name]} float")
            if m > metric:
                mapping, metric = trial, m
                table.float_layers.append(row.name)
    table.final_metric = metric
    return mapping, table


# ---------------------------------------------------------------- search="fast" (machinery: float_swap.py)


def _fast(model: nn.Module, qconfig_mapping: Any, batches: list[Any], eval_fn: Callable[[nn.Module], Any],
          tolerance: float | None, max_float_layers: int | None, method: str,
          example_inputs: tuple[Any, ...] | None, fuse: Any, progress: bool,
          finalize: Callable[[nn.Module], Any] | None) -> tuple[QConfigMapping, SensitivityTable]:
    from ..fx import convert_fx, prepare_fx
    from ..workflow import convert, prepare
    from .compare import run_batch

    mapping = copy.deepcopy(QConfigMapping.from_qconfig(qconfig_mapping, None))
    base = _fused(model, fuse, method)
    with _quiet_float_fallback(), torch.no_grad():
        baseline = _score(eval_fn, copy.deepcopy(base).eval(), "the float model", "auto_mixed_precision")
        if method == "fx":
            import warnings
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*cannot be traced")
                prepared = prepare_fx(copy.deepcopy(base), mapping, example_inputs=example_inputs)
        else:
            prepared = prepare(base, mapping)
        observers, handles = record_tagged_inputs(prepared) if method != "fx" else ({}, [])
        calls, call_handles = record_call_outputs(prepared) if method == "fx" else ({}, [])
        ends, end_handles = record_share_ends(prepared) if method == "fx" else ({}, [])
        handles += call_handles + end_handles
        try:
            for b in tqdm(batches, desc="auto_mixed_precision: calibrate", disable=not progress, leave=False):
                run_batch(prepared, b)
        finally:
            for h in handles:
                h.remove()
        qmodel = convert_fx(copy.deepcopy(prepared)) if method == "fx" else convert(copy.deepcopy(prepared))
        give_input_grids(qmodel, observers)
        qmodel.register_forward_hook(_dequantize_output)
        if finalize is not None:
            finalize(qmodel)
        plan = _swaps(base, prepared, qmodel, eager=method != "fx", ops=True, call_outputs=calls, share_ends=ends)
        if not plan.swaps:
            raise ValueError("auto_mixed_precision: the quantized model has no int8 layer to keep float "
                             "(the mapping quantizes none of its modules)")
        table = _search(qmodel, plan, eval_fn, baseline, tolerance, max_float_layers, progress, "auto_mixed_precision")
        for name in table.float_layers:
            keep_float(mapping, name, plan.op_keys)
    return mapping, table


