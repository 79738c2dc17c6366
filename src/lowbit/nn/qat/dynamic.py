"""Dynamic QAT ``Linear`` (torch.ao's ``nn.qat.dynamic.Linear``): train for per-call activation grids.

The weight passes through ``qconfig.weight()`` (a ``FakeQuantize``) as in ``lowbit.nn.qat.Linear``::

    y = x @ wfq(W).T + b

and the qconfig's activation must be *memoryless* — a moving-average observer with
``averaging_constant=1`` (each batch's own range, as a dynamic layer computes at run time) or a
dynamic placeholder (``get_dynamic_qconfig()``'s): a stateful activation grid would train for a
grid the dynamic layer never uses. ``convert`` (with ``get_default_dynamic_quant_module_mappings()``
or ``mapping={lowbit.nn.qat.dynamic.Linear: lowbit.nn.quantized.dynamic.Linear}``) turns it into a
dynamic int8 ``Linear`` on the trained weight grid.

>>> import torch, lowbit as Q
>>> from lowbit.nn.qat.dynamic import Linear
>>> qc = Q.QConfig(activation=Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver, averaging_constant=1),
...                weight=Q.get_default_qat_qconfig().weight)
>>> Linear(4, 3, qconfig=qc)(torch.randn(2, 4)).shape
torch.Size([2, 3])
>>> Linear(4, 3, qconfig=Q.get_default_qat_qconfig())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: lowbit.nn.qat.dynamic.Linear needs a memoryless activation observer ... averaging_constant=0.01
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...qconfig import QConfig
from . import modules as _qat

__all__ = ["Linear"]


def _check_memoryless(qconfig: Any) -> None:
    if not isinstance(qconfig, QConfig):
        return  # init_weight_fake_quant names the problem
    act = qconfig.activation()
    obs = getattr(act, "activation_post_process", act)  # a FakeQuantize wraps its observer
    if getattr(obs, "is_dynamic", False) is True or getattr(obs, "averaging_constant", None) == 1:
        return
    const = getattr(obs, "averaging_constant", None)
    got = type(obs).__name__ + ("" if const is None else f" with averaging_constant={const}")
    raise ValueError("lowbit.nn.qat.dynamic.Linear needs a memoryless activation observer (a moving average with "
                     f"averaging_constant=1, or a dynamic placeholder); got {got}")


class Linear(_qat.Linear):
    """``lowbit.nn.qat.Linear`` whose qconfig's activation is memoryless; converts to a dynamic ``Linear``."""

    _FLOAT_TYPES: tuple[type, ...] = (nn.Linear,)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, qconfig: QConfig | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        _check_memoryless(qconfig)
        super().__init__(in_features, out_features, bias, qconfig=qconfig, device=device, dtype=dtype)
