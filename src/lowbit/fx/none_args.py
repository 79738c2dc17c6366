"""An argument traced as ``None`` (``prepare_fx``'s ``concrete_args``: ``forward(x, mask=None)`` traced with
``mask=None``, so ``if mask is None`` branches follow the example call): the check the graph keeps for it.

torch.fx's own check, ``_assert_is_none``, is a ``torch.fx.wrap``-ed function: the code a GraphModule generates for it
re-runs that registration under a dotted name when the module is unpickled (``pickle`` / ``torch.load``), which failed
the load (``KeyError: 'torch.fx._symbolic_trace._assert_is_none'``) and every torch.fx trace after it in the process
(``prepare_fx`` then left whole models float, only warned). ``name_specialised`` puts ``none_only`` in its place, with a
message naming the model and the argument: ``none_only(mask, msg)`` returns on ``None`` (the call of every forward, as
cheap as torch.fx's check), raises ``ValueError(msg)`` on a value, and is recorded, not run, on a ``Proxy`` (a
re-trace, the unpickling).

>>> import torch
>>> from torch import fx, nn
>>> class M(nn.Module):
...     def forward(self, x, mask=None):
...         return x if mask is None else x * mask
>>> g = fx.symbolic_trace(M(), concrete_args={"mask": None})
>>> name_specialised(g.graph, "M"); _ = g.recompile()
>>> g(torch.ones(1)).tolist()
[1.0]
>>> g(torch.ones(1), torch.ones(1))  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: M was prepared with mask=None (traced as that constant, so `if mask is None` branches follow it), ...
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch.fx._symbolic_trace import _assert_is_none

__all__ = ["none_only", "name_specialised"]


@fx.node.has_side_effect  # (kept by dead-code elimination, as torch.fx's own check)
def none_only(value: Any, msg: str) -> None:
    """``ValueError(msg)`` when ``value`` is not ``None``: the check of an argument traced as ``None``.

    It stands for torch.fx's ``_assert_is_none``, whose ``wrap`` registration the generated code re-runs with a dotted
    name when a GraphModule is unpickled (``torch.load``): that load failed (``KeyError:
    'torch.fx._symbolic_trace._assert_is_none'``) and every torch.fx trace after it in the process failed the same way
    (``prepare_fx`` then left whole models float). On a ``Proxy`` (a re-trace, the unpickling) it is recorded, not run.

    >>> none_only(None, "no")
    """
    if value is None:  # (first: the call of every forward, as cheap as torch.fx's check)
        return
    if isinstance(value, fx.Proxy):
        value.tracer.create_proxy("call_function", none_only, (value, msg), {})
        return
    raise ValueError(msg)


def name_specialised(graph: fx.Graph, owner: str) -> None:
    """Replace torch.fx's check of an argument traced as ``None`` (``concrete_args``) by ``none_only``, with a message
    saying what happened and what to do: torch.fx's, "mask has been specialized to have value None but got another
    value", was all a call with ``mask=tensor`` got, from deep in the generated forward."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _assert_is_none and len(n.args) == 2:
            arg = n.args[0].target if isinstance(n.args[0], fx.Node) else "argument"
            arg = arg.rpartition("_")[0] if arg.rpartition("_")[2].isdigit() else arg
            n.target = none_only
            n.meta.pop("is_wrapped", None)
            n.args = (n.args[0], f"{owner} was prepared with {arg}=None (traced as that constant, so `if {arg} is "
                      f"None` branches follow it), and this model takes {arg}=None only; to quantize the path with a "
                      f"{arg}, give prepare_fx example_inputs that pass one")
