"""Numeric debugging of quantized models: where does a quantized model lose accuracy?

``compare(float_model, quantized_model, inputs)`` measures each layer's activation and weight
SQNR against the float model; ``sensitivity(model, qconfig_mapping, calib, eval_fn)`` quantizes one
layer at a time and ranks layers by the metric drop, and with ``tolerance`` keeps the worst layers
in float until the drop is acceptable. ``layer_sensitivity(model, qconfig_mapping, calib)`` is the
"quantize only this layer" view with no metric to write (the output's noise-to-signal ratio), worst
first; ``auto_mixed_precision`` keeps the fewest layers float within a budget (eager or graph mode).
``activation_ranges(prepared_model)`` reads the calibrated
observers (observed range, histogram, chosen clipping range) for ``lowbit.report``.

>>> from lowbit.debug import compare, sensitivity
"""

from .compare import CompareResult, LayerComparison, compare, sqnr
from .mixed_precision import auto_mixed_precision
from .ranges import ActivationRange, activation_ranges
from .sensitivity import SensitivityRow, SensitivityTable, layer_sensitivity, sensitivity

__all__ = ["auto_mixed_precision", "ActivationRange", "CompareResult", "LayerComparison", "SensitivityRow", "SensitivityTable",
           "activation_ranges", "compare", "layer_sensitivity", "sensitivity", "sqnr"]
