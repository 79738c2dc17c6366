"""Whether a model came from ``prepare_fx`` / ``prepare_qat_fx``: the mark it carries, and the refusal of one that
does not (split from ``prepare.py`` / ``convert.py``).

``prepare_fx`` marks the graph it returns with ``gm.meta[STATE_KEY]`` (a container of prepared children: its
``__dict__``). ``pickle`` / ``torch.save`` rebuild a ``GraphModule`` from its code and drop ``meta``, so a pickled
prepared graph holds observers but no mark: ``check_prepared`` names that and the way out.

>>> import torch
>>> from torch import fx
>>> is_prepared(fx.symbolic_trace(torch.nn.Linear(2, 2)))
False
>>> check_prepared(torch.nn.Linear(2, 2), "convert_fx")
Traceback (most recent call last):
    ...
TypeError: convert_fx: expects a model returned by prepare_fx or prepare_qat_fx, got Linear
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

__all__ = ["STATE_KEY", "check_prepared", "is_prepared"]

STATE_KEY = "lowbit_fx"  # gm.meta key marking a graph prepared by prepare_fx / prepare_qat_fx

_REBUILT = (": a GraphModule with observers but no prepare state (pickle / torch.save rebuild a GraphModule from its "
            "code and drop it); load the prepared model's state_dict into a fresh prepare_fx / prepare_qat_fx model")


def is_prepared(model: Any) -> bool:
    """Whether ``model`` came from ``prepare_fx`` / ``prepare_qat_fx`` (a GraphModule or a container)."""
    if isinstance(model, fx.GraphModule):
        return STATE_KEY in model.meta
    return isinstance(model, nn.Module) and STATE_KEY in model.__dict__


def check_prepared(model: Any, who: str) -> None:
    """A ``TypeError`` naming what ``model`` is unless ``is_prepared(model)`` (a pickled prepared graph: why, and
    the way out)."""
    if is_prepared(model):
        return
    from ..fake_quant.base import FakeQuantize
    from ..observer.base import ObserverBase

    observed = isinstance(model, fx.GraphModule) and any(isinstance(m, (ObserverBase, FakeQuantize))
                                                         for m in model.modules())
    raise TypeError(f"{who}: expects a model returned by prepare_fx or prepare_qat_fx, got {type(model).__name__}"
                    + ("" if isinstance(model, nn.Module) else " (not an nn.Module)") + (_REBUILT if observed else ""))
