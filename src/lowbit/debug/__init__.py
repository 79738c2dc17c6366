"""Numeric debugging of quantized models: where does a quantized model lose accuracy?

``compare(float_model, quantized_model, inputs)`` measures each layer's activation and weight
SQNR against the float model; ``sensitivity(model, qconfig_mapping, calib, eval_fn)`` quantizes one
layer at a time and ranks layers by the metric drop, and with ``tolerance`` keeps the worst layers
in float until the drop is acceptable. ``activation_ranges(prepared_model)`` reads the calibrated
observers (observed range, histogram, chosen clipping range) for ``lowbit.report``.

>>> from lowbit.debug import compare, sensitivity
"""

from .compare import CompareResult, LayerComparison, compare, sqnr
from .ranges import ActivationRange, activation_ranges
from .sensitivity import SensitivityRow, SensitivityTable, sensitivity

__all__ = ["ActivationRange", "CompareResult", "LayerComparison", "SensitivityRow", "SensitivityTable",
           "activation_ranges", "compare", "sensitivity", "sqnr"]
