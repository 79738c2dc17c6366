"""Converted graphs called without torch.fx's error wrapper, so that their run-time errors reach the caller of a
``torch.compile``-d model as they are.

A ``GraphModule``'s ``__call__`` goes through ``torch.fx``'s ``_WrappedCall``, whose ``except`` clause walks the
traceback (a generator) to print the generated code's line. Under ``torch.compile(..., fullgraph=True)`` an exception
raised at run time inside the compiled graph (lowbit's NaN check at a ``Quantize``, a custom op refusing its input)
sends dynamo into that clause, and the caller gets ``Unsupported: Attempt to trace generator`` instead of the
error; a plain ``torch.fx.symbolic_trace`` model behaves the same (torch's bug, torch 2.13). ``plain_call(model)``
gives every ``GraphModule`` in ``model`` a call that is ``nn.Module.__call__`` itself: the same forward, the same
results, errors as raised (in eager mode too, without torch.fx's printout of the generated line). It survives
``recompile()`` (which keeps a class's own ``_wrapped_call``) and ``copy.deepcopy``; a pickled and reloaded module
gets torch.fx's wrapper back.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(nn.Linear(4, 2)).eval()
>>> x = torch.randn(3, 4)
>>> p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), (x,)); _ = p(x)
>>> q = Q.convert_fx(p)
>>> type(type(q).__dict__["_wrapped_call"]).__name__
'_PlainCall'
>>> bad = x.clone(); bad[0, 0] = float("nan")
>>> try:
...     torch.compile(q, fullgraph=True)(bad)
... except RuntimeError as e:
...     print(str(e).split(";")[0])
Quantize: the float input of shape (3, 4) holds 1 NaN values
"""

from __future__ import annotations

import types
from typing import Any

from torch import fx, nn

__all__ = ["plain_call"]


class _PlainCall:
    """Stands where ``torch.fx`` keeps its ``_WrappedCall`` (a class attribute called as ``f(module, *args)``):
    ``nn.Module.__call__``, looked up at each call (as torch.fx's ``super().__call__``, so tracing's patch applies)."""

    __slots__ = ()

    def __call__(self, obj: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return nn.Module.__call__(obj, *args, **kwargs)


def _fresh_plain_call() -> _PlainCall:
    """A ``_PlainCall`` whose ``__call__`` has a code object of its own. dynamo compiles this frame (it is not
    torch's) and keeps its compiled graphs per code object, guarded on the module's class, which torch.fx makes per
    instance: one shared code object collected a cache entry per converted model and, at the 9th model compiled in a
    process, hit ``recompile_limit`` (``fullgraph=True`` raised ``FailOnRecompileLimitHit``, otherwise the model ran
    uncompiled). torch.fx's own wrapper has no such frame: dynamo starts at each instance's generated ``forward``."""
    code = _PlainCall.__call__.__code__
    fn = types.FunctionType(code.replace(co_name=code.co_name), _PlainCall.__call__.__globals__, "__call__")
    return type("_PlainCall", (_PlainCall,), {"__slots__": (), "__call__": fn})()


def _deepcopy(self: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    res = fx.GraphModule.__deepcopy__(self, memo)  # (a fresh per-instance class: torch.fx's wrapper again)
    _plain(res)
    return res


def _plain(gm: fx.GraphModule) -> None:
    cls = type(gm)  # GraphModule makes one class per instance: this changes no other module
    cls._wrapped_call = _fresh_plain_call()  # type: ignore[attr-defined]
    cls.__deepcopy__ = _deepcopy  # type: ignore[method-assign]


def plain_call(model: nn.Module) -> nn.Module:
    """``model`` with every ``GraphModule`` in it (itself included) called as ``nn.Module.__call__`` (see the module
    docstring); returns ``model``."""
    for m in model.modules():
        if isinstance(m, fx.GraphModule) and type(m).__qualname__.endswith("GraphModuleImpl"):
            _plain(m)
    return model

