"""One-line eager workflows, as ``torch.ao.quantization.quantize`` / ``quantize_qat``.

::

    quantize(model, run_fn, run_args)      = convert(calibrate(prepare(model.eval())))
    quantize_qat(model, run_fn, run_args)  = convert(train(prepare_qat(model.train())))

where the middle step is ``run_fn(prepared, *run_args)``: a calibration loop (PTQ) or a training
loop (QAT) the caller supplies. ``run_args`` is a list or tuple of positional arguments, as in
``torch.ao`` (``quantize(model, calibrate, [loader])``).

Which modules are quantized, and how, follows ``prepare`` / ``prepare_qat``: the ``.qconfig``
attributes set on the model, or — with none set anywhere — lowbit's default recipe (torch.ao's
``quantize`` then quantizes nothing; see docs/design.md "Migrating from torch.ao").

The top-level ``lowbit.quantize`` stays the seeds' tensor function (codes of a tensor), so the
workflow is ``lowbit.quantize_api.quantize``; ``quantize_qat`` is also ``lowbit.quantize_qat``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> from lowbit.quantize_api import quantize
>>> model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), Q.DeQuantStub())
>>> model.qconfig = Q.get_minmax_qconfig()
>>> def calibrate(m, batches):
...     for x in batches:
...         m(x)
>>> qmodel = quantize(model, calibrate, [[torch.randn(8, 4) for _ in range(2)]])
>>> type(qmodel[1]).__module__, type(model[1]).__name__      # model itself is untouched
('lowbit.nn.quantized.linear', 'Linear')
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .workflow import convert, prepare, prepare_qat

__all__ = ["quantize", "quantize_qat"]


def _check(fn: str, model: Any, run_fn: Any, run_args: Any, inplace: Any) -> tuple[Any, ...]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    if not callable(run_fn):
        raise TypeError(f"{fn}: run_fn={run_fn!r} must be callable as run_fn(model, *run_args)")
    if not isinstance(inplace, bool):
        raise TypeError(f"{fn}: inplace must be a bool, got {inplace!r}")
    if isinstance(run_args, (list, tuple)):
        return tuple(run_args)
    raise TypeError(f"{fn}: run_args={run_args!r} must be a list or tuple of positional arguments for run_fn "
                    "(e.g. [data_loader])")


def quantize(model: nn.Module, run_fn: Callable[..., Any], run_args: Sequence[Any],
             mapping: dict[type, type] | None = None, inplace: bool = False) -> nn.Module:
    """Post-training static quantization in one call: ``prepare`` → ``run_fn(prepared, *run_args)`` → ``convert``.

    ``mapping`` (default ``get_default_static_quant_module_mappings()``) is used by both ``prepare``
    (which types get observers) and ``convert``. ``inplace=False`` leaves ``model`` untouched. Returns
    the quantized model (eval mode); use the return value, the root itself may be swapped.
    """
    args = _check("quantize", model, run_fn, run_args, inplace)
    if not inplace:
        model = copy.deepcopy(model)
    prepared = prepare(model.eval(), inplace=True, mapping=mapping)
    run_fn(prepared, *args)
    return convert(prepared, mapping=mapping, inplace=True)


def quantize_qat(model: nn.Module, run_fn: Callable[..., Any], run_args: Sequence[Any],
                 inplace: bool = False) -> nn.Module:
    """Quantization-aware training in one call: ``prepare_qat`` → ``run_fn(prepared, *run_args)`` → ``convert``.

    ``run_fn`` trains the prepared (fake-quantized, train-mode) model. Returns the quantized model
    (eval mode); ``inplace=False`` leaves ``model`` untouched.
    """
    args = _check("quantize_qat", model, run_fn, run_args, inplace)
    if not inplace:
        model = copy.deepcopy(model)
    prepared = prepare_qat(model.train(), inplace=True)
    run_fn(prepared, *args)
    return convert(prepared, inplace=True)
