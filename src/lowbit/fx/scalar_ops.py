"""Graph mode's arithmetic of a float tensor ``x`` and a number ``c``: which nodes run on int8 codes, and the
``QFunctional`` call ``convert_fx`` makes of each.

``scalar_op(node)`` gives ``(qop, why)``: ``qop`` is ``"add_scalar"``, ``"mul_scalar"`` or ``"div_scalar"`` for a node
that runs on the codes (``meta["lowbit_scalar_op"]`` then holds ``(i_x, i_c, mirror, factor)``), else ``None`` with
``why`` (empty when the node is no such arithmetic). ``scalar_call`` builds the call on the observed output grid
``(s, z)``; every form is one requantization of ``x``'s codes ``q`` (grid ``(s_x, z_x)``)::

    x + c, c + x, torch.add(x, c, alpha=k), x.add(c)   add_scalar(x, k·c):  q' = round((q - z_x)·s_x/s + k·c/s) + z
    x - c, torch.sub(x, c, alpha=k), x.sub(c), x -= c  add_scalar(x, -k·c)
    c - x, torch.rsub(x, c)                             add_scalar(-x, c), -x the mirrored codes (exact, below)
    x * c, c * x, torch.mul(x, c), x.mul(c)            mul_scalar(x, c):    q' = round((q - z_x)·s_x·c/s) + z
    x / c, torch.div(x, c), x.div(c)                   mul_scalar(x, 1 / c)

so ``x - c`` is ``x + (-c)`` as IEEE arithmetic has it (float subtraction adds the negation). ``k·c`` is folded only
where the float32 product is exact (torch adds ``k·c`` in one fused step). ``-x`` (``torch.neg``, ``x.neg()``) is a
share op: the codes mirrored, ``q' = qmin + qmax - q`` on ``(s_x, qmin + qmax - z_x)``, exactly ``-x``, no
requantization (``QTensor``'s ``torch.neg``). Left float, with the reason: a divisor of 0 (the result is ±inf / NaN,
which no grid holds), a non-finite number, an ``alpha`` that is not a number or whose product is inexact,
``torch.rsub`` with an ``alpha`` other than 1.

>>> import operator, torch
>>> from torch import fx
>>> gm = fx.symbolic_trace(lambda x: (2.0 - x, x / 0.0))
>>> for n in gm.graph.nodes:
...     n.meta["lowbit_ftensor"], n.meta["lowbit_scalar"] = n.op not in ("output",), False
>>> [scalar_op(n) for n in gm.graph.nodes if n.op == "call_function"]
[('add_scalar', ''), (None, 'division by 0.0: the result is ±inf / NaN, which no int8 grid holds')]
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch
from torch import fx

from ..nn.quantized.functional_modules import scaled_operand
from .patterns import as_number

__all__ = ["scalar_op", "scalar_call"]

_FAMILIES: dict[tuple[str, Any], str] = {
    **{("call_function", f): "add" for f in (operator.add, torch.add)}, ("call_method", "add"): "add",
    **{("call_function", f): "sub" for f in (operator.sub, torch.sub, torch.subtract)},
    ("call_method", "sub"): "sub", ("call_method", "subtract"): "sub", ("call_function", torch.rsub): "rsub",
    **{("call_function", f): "mul" for f in (operator.mul, torch.mul, torch.multiply)},
    ("call_method", "mul"): "mul", ("call_method", "multiply"): "mul",
    **{("call_function", f): "div" for f in (operator.truediv, torch.div, torch.divide, torch.true_divide)},
    ("call_method", "div"): "div", ("call_method", "divide"): "div", ("call_method", "true_divide"): "div",
}
_REFLECTED = (operator.add, operator.sub, operator.mul)  # c + x, c - x, c * x: the number first


def _ftensor(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and bool(arg.meta.get("lowbit_ftensor", False))


def _is_scalar(arg: Any) -> bool:
    if isinstance(arg, fx.Node):
        return bool(arg.meta.get("lowbit_scalar", False))
    return isinstance(arg, numbers.Real) and not isinstance(arg, bool)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _exact_product(c: float, k: float) -> float | None:
    """``c·k`` as torch's float32 ``add(x, c, alpha=k)`` adds it (one fused multiply-add), when that product of the
    float32 operands is itself a float32 number (else ``None``: folding it would round once more)."""
    p = _f32(c) * _f32(k)  # (exact in float64: two 24-bit significands)
    return p if _f32(p) == p else None


def _argument_number(c: Any) -> str | None:
    """The name of the forward argument (not a tensor) that the number ``c`` is computed from, if any: a
    ``forward(x, scale=1.0)`` calibrated with one ``scale`` and run with another put ``x * scale`` on the first one's
    grid (10.7 dB at ``scale=2.0``, silently). Not an input of a child graph (an untraceable parent's call of its child,
    ``self.inner(x, scale=2.0)``: the parent's code gives that number, not the user)."""
    seen, todo = set(), [c] if isinstance(c, fx.Node) else []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        tensor = n.meta.get("lowbit_rank") is not None or n.meta.get("lowbit_ftensor", False)
        if n.op == "placeholder" and not tensor and not n.meta.get("lowbit_child_input", False):
            return str(n.target).lstrip("*")  # (a number, or a dict / list holding one: ``kw.get("k", 1.0)``)
        if not tensor:  # (a number read from a tensor, ``x.shape[-1]``, is the tensor's: not followed further)
            todo.extend(n.all_input_nodes)
    return None


def scalar_op(node: fx.Node) -> tuple[str | None, str]:
    """``(qop, why)`` for ``node`` (module doc); sets ``node.meta["lowbit_scalar_op"]`` when ``qop`` is not ``None``."""
    try:
        family = _FAMILIES.get((node.op, node.target))
    except TypeError:  # an unhashable target
        return None, ""
    if family is None or not node.meta.get("lowbit_ftensor", False) or len(node.args) != 2:
        return None, ""
    kwargs = dict(node.kwargs)
    raw_alpha = kwargs.pop("alpha", 1) if family in ("add", "sub", "rsub") else 1
    a, b = node.args
    if _ftensor(a) and _is_scalar(b) and not _ftensor(b):
        ix = 0
    elif _is_scalar(a) and _ftensor(b) and node.op == "call_function" and node.target in _REFLECTED:
        ix = 1
    else:
        return None, ""
    if kwargs:  # (rounding_mode, out=: no integer form)
        return None, ""
    c = node.args[1 - ix]
    arg = _argument_number(c)
    if arg is not None:
        return None, (f"its number comes from the forward's argument {arg!r}, and an int8 output grid holds only "
                      "the values calibration gave it")
    cv = as_number(c)
    if cv is not None and not math.isfinite(cv):
        return None, f"the number {c!r} is not finite"
    k = as_number(raw_alpha)
    if k is None or not math.isfinite(k):
        return None, f"alpha={raw_alpha!r} is not a finite number"
    if family == "div" and cv == 0.0:
        return None, f"division by {c!r}: the result is ±inf / NaN, which no int8 grid holds"
    if family in ("mul", "div"):
        node.meta["lowbit_scalar_op"] = (ix, 1 - ix, False, 1.0)
        return f"{family}_scalar", ""
    mirror = family == "rsub" or (family == "sub" and ix == 1)  # c - x = (-x) + c
    if family == "rsub" and k != 1.0:
        return None, f"torch.rsub with alpha={raw_alpha!r} (c - alpha·x) has no exact int8 form"
    factor = -k if family == "sub" and ix == 0 else k
    if factor not in (1.0, -1.0):
        if cv is None:
            return None, f"alpha={raw_alpha!r} times a traced number has no exact int8 form"
        if _exact_product(cv, factor) is None:
            return None, f"alpha={raw_alpha!r} times {c!r} is not exact in float32"
    node.meta["lowbit_scalar_op"] = (ix, 1 - ix, mirror, factor)
    return "add_scalar", ""


def scalar_call(graph: fx.Graph, node: fx.Node, owner: str) -> tuple[str, tuple[Any, ...]]:
    """``(QFunctional method, its operands)`` for a node ``scalar_op`` accepted, inserting the nodes it needs (a
    mirrored operand, ``1 / c`` or ``-c`` of a traced number) where the graph inserts; ``owner``: the target of the
    ``QFunctional`` called, which keeps a mirrored operand's grid (``scaled_operand``)."""
    ix, ic, mirror, factor = node.meta["lowbit_scalar_op"]
    x, c = node.args[ix], node.args[ic]
    qop = node.meta["lowbit_qop"]
    if qop == "div_scalar":
        c = graph.call_function(operator.truediv, (1.0, c)) if isinstance(c, fx.Node) else 1.0 / c
        return "mul_scalar", (x, c)
    if qop == "mul_scalar":
        return "mul_scalar", (x, c)
    if factor == -1.0:
        c = graph.call_function(operator.neg, (c,)) if isinstance(c, fx.Node) else -c
    elif factor != 1.0:
        c = _exact_product(c, factor)  # (a number: scalar_op checked it)
    if mirror:
        x = graph.call_function(scaled_operand, (x, -1.0, graph.get_attr(owner)))  # (its grid kept on owner)
        x.meta.update(lowbit_kind="share", lowbit_domain="int", lowbit_ftensor=True)
    return "add_scalar", (x, c)
