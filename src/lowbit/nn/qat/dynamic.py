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
>>> Linear(4, 3, qconfig=get_dynamic_qat_qconfig())(torch.randn(2, 4)).shape
torch.Size([2, 3])
>>> Linear(4, 3, qconfig=Q.get_default_qat_qconfig())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: Dynamic QAT requires a memoryless observer...averaging_constant=0.01
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...fake_quant import FakeQuantize
from ...observer.minmax import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
from ...qconfig import QConfig, get_default_qat_qconfig
from . import modules as _qat

__all__ = ["Linear", "get_dynamic_qat_qconfig", "is_memoryless"]


def is_memoryless(qconfig: Any) -> bool:
    """Whether ``qconfig``'s activation keeps no state across batches: a moving-average min/max with
    ``averaging_constant=1`` (inside a ``FakeQuantize`` or bare) or a dynamic placeholder."""
    if not isinstance(qconfig, QConfig):
        return False
    act = qconfig.activation()
    obs = getattr(act, "activation_post_process", act)  # a FakeQuantize wraps its observer
    moving = isinstance(obs, (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver))
    return getattr(obs, "is_dynamic", False) is True or (moving and obs.averaging_constant == 1)


def _check_memoryless(qconfig: Any) -> None:
    if not isinstance(qconfig, QConfig) or is_memoryless(qconfig):
        return  # not a QConfig: init_weight_fake_quant names the problem
    act = qconfig.activation()
    obs = getattr(act, "activation_post_process", act)
    const = getattr(obs, "averaging_constant", None)
    got = type(obs).__name__ + ("" if const is None else f" with averaging_constant={const}")
    # torch.ao's wording (its tests match it), then lowbit's detail
    raise ValueError("Dynamic QAT requires a memoryless observer.This means a MovingAverage observer with averaging "
                     f"constant equal to 1 (lowbit.nn.qat.dynamic.Linear; or a dynamic placeholder); got {got}")


def get_dynamic_qat_qconfig() -> QConfig:
    """Dynamic QAT (torch.ao's ``default_dynamic_qat_qconfig``): a memoryless moving-average ``FakeQuantize`` on
    the activation (each batch's own range) and the default QAT weight fake-quant.

    >>> get_dynamic_qat_qconfig().activation().activation_post_process.averaging_constant
    1.0
    """
    return QConfig(activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, averaging_constant=1.0),
                   weight=get_default_qat_qconfig().weight)


class Linear(_qat.Linear):
    """``lowbit.nn.qat.Linear`` whose qconfig's activation is memoryless; converts to a dynamic ``Linear``.

    ``prepare_qat`` puts its ``activation_post_process`` on the *input* (a forward pre-hook, as
    torch.ao does for memoryless qconfigs): the layer trains on inputs fake-quantized on each batch's
    own range, as the dynamic layer quantizes them at run time (lowbit's per token, which is finer),
    and its output stays float.
    """

    _FLOAT_TYPES: tuple[type, ...] = (nn.Linear,)
    _observe_input = True  # prepare_qat: the activation fake-quant goes on the input, not the output

    def __init__(self, in_features: int, out_features: int, bias: bool = True, qconfig: QConfig | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        _check_memoryless(qconfig)
        super().__init__(in_features, out_features, bias, qconfig=qconfig, device=device, dtype=dtype)
