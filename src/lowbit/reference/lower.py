"""``lower_reference``: a reference model (eager or graph mode) → the lowbit int8 model.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> p = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(3, 3), Q.DeQuantStub()), Q.get_minmax_qconfig())
>>> _ = p(torch.randn(8, 3))
>>> type(Q.lower_reference(Q.convert(p, is_reference=True))[1]).__module__
'lowbit.nn.quantized.linear'
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .convert import lower_reference_eager
from .fx import is_reference_fx, lower_reference_fx

__all__ = ["lower_reference"]


def lower_reference(model: nn.Module, mapping: dict[type, type] | None = None, inplace: bool = False,
                    return_report: bool = False, convert_custom_config_dict: Any = None) -> Any:
    """``convert(prepared)`` rebuilt from ``convert(prepared, is_reference=True)`` or from
    ``convert_to_reference_fx(prepared)``: the same int8 modules, codes and grids.

    ``mapping`` / ``return_report`` / ``convert_custom_config_dict`` apply to eager models (graph mode
    reports in ``model.lowbit_report``).
    """
    if is_reference_fx(model):
        if mapping is not None or return_report or convert_custom_config_dict is not None:
            raise ValueError("lower_reference: mapping / return_report / convert_custom_config_dict apply to eager "
                         "reference models; a graph-mode "
                             "one reports in model.lowbit_report")
        return lower_reference_fx(model, inplace=inplace)
    return lower_reference_eager(model, mapping=mapping, inplace=inplace, return_report=return_report,
                                 convert_custom_config_dict=convert_custom_config_dict)
