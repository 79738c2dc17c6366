"""Attention masks in graph mode: values that are masks stay float, and so does a sum they are added into.

An additive attention mask ``m`` holds ``0`` and one huge negative ``v`` (BERT's ``(1 - mask) · -10000``,
``finfo.min``, ``-inf``). On a per-tensor int8 grid ``s = (max - min) / 255`` the sum ``scores + m`` gets
``s ≥ |v| / 255`` (``-1e4``: ``s ≈ 39``), so every unmasked score rounds to a few codes and softmax sees noise
(11 dB against fp32 where nothing else rounds it). ``keep_masks_float`` therefore sets ``lowbit_kind="float"`` on

- a *mask node*: a float tensor whose value on the example inputs is an additive mask (``is_additive_mask``: a
  float input ``ext`` of a child graph included), or one computed by functions / methods only from integer / bool
  tensors with a number ``|c| ≥ 1e3`` (``-10000.0``, ``finfo.min``) on the way (``(1.0 - mask.to(x.dtype)) * -1e4``:
  a padding-free example's all-zero mask too), with the nodes before it in that chain (``mask.to``, ``1.0 - m``);
- an ``add`` / ``sub`` of two tensors where one operand is a mask node (through shape ops): ``scores + ext`` is computed
  in float, as ``softmax`` reads it (an int8 reader still quantizes the sum at its input, as any float value).

A mask smaller than ``1e3`` counts when it dwarfs what it is added to (``mask_size``): an add / sub whose operand holds
``0`` and one ``c < 0`` on the example (or is all zeros there and computed from integer / bool tensors with a number
``c`` on the way) with ``|c| ≥ 2 · max|other operand|`` (``RATIO``): a ``-100`` mask over scores of ``|s| ≤ 8`` spans
a grid ~7x coarser than the scores' own (34.6 dB per child on the encoder of ``tests/test_graphacc_s46.py``, 43.9 now).

In a child graph (prepared on its own because its parent does not trace) a float input that is all zeros on the
example counts as a mask node too: a padding-free batch's ``ext``, whose chain ``(1 - mask) · -1e4`` lies in the
untraced parent (an int8 ``scores + ext`` there got a grid of scale ~40 from the padded calibration batches: 25.3 dB).
An add reading such an input is float; nothing else changes (the input itself is no op).

It needs ``meta["lowbit_rank"]`` / ``["lowbit_mask"]`` ... from a run on example inputs (``record_tensor_kinds``,
``mask_facts``); without them ``convert_fx`` decides a child graph's mask inputs from the calibration ranges
(``fx.observed_rules``).

>>> import torch
>>> is_additive_mask(torch.tensor([0.0, -10000.0, 0.0])), is_additive_mask(torch.tensor([0.0, 1.0]))
(True, False)
>>> is_additive_mask(torch.tensor([[0.0, float("-inf")]])), is_additive_mask(torch.zeros(3))
(True, False)
>>> mask_facts(torch.tensor([0.0, -100.0])), mask_facts(torch.tensor([0.5, -2.0]))["lowbit_level"]
({'lowbit_mask': False, 'lowbit_level': -100.0, 'lowbit_absmax': 100.0}, None)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..workflow.propagate import join_name as join
from .report import FxReport

__all__ = ["is_additive_mask", "keep_masks_float", "mask_facts", "RATIO"]

HUGE = 1e3  # |v| from which a 0 / v tensor counts as an additive mask (a grid over it keeps < 1 code per 4 units)
RATIO = 2.0  # |v| / max|other operand| from which a smaller 0 / v operand of an add counts as one (module doc)


def is_additive_mask(value: Any) -> bool:
    """Whether ``value`` is a float tensor whose values are ``0`` and one ``v ≤ -1e3`` (both present)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() < 2:
        return False
    with torch.no_grad():
        if value.amax() != 0:  # (an activation: one reduction, then out)
            return False
        lo = value.amin()
        return bool(lo <= -HUGE) and bool(((value == 0) | (value == lo)).all())


def mask_facts(value: torch.Tensor) -> dict[str, Any]:
    """What ``fx.masks`` reads of a value on the example run (``record_tensor_kinds``): ``lowbit_mask``
    (``is_additive_mask``), ``lowbit_level`` (``c`` when the values are ``0`` and one ``c < 0``, ``0.0`` when all
    zeros, else ``None``; float tensors of ≥ 2 elements only) and ``lowbit_absmax`` (the largest finite ``|v|``)."""
    if not value.is_floating_point() or value.numel() == 0:
        return {"lowbit_mask": False, "lowbit_level": None}
    with torch.no_grad():
        absmax = float(value.abs().nan_to_num(0.0, 0.0, 0.0).amax())
        level = None
        if value.numel() > 1 and value.amax() == 0:
            lo = value.amin()
            level = float(lo) if bool(((value == 0) | (value == lo)).all()) else None
    return {"lowbit_mask": is_additive_mask(value), "lowbit_level": level, "lowbit_absmax": absmax}


def _tensor(n: fx.Node) -> bool:
    return "lowbit_rank" in n.meta  # (set for every tensor value by record_tensor_kinds' run)


def _numbers(n: fx.Node) -> float:
    """The largest ``|c|`` of the numbers ``n`` takes (a traced number: its value from the example run,
    ``meta["lowbit_number"]``), 0 without any."""
    nums = [a.meta.get("lowbit_number", 0.0) if isinstance(a, fx.Node) else a for a in (*n.args, *n.kwargs.values())]
    return max([abs(c) for c in nums if isinstance(c, (int, float)) and not isinstance(c, bool)], default=0.0)


def _huge(n: fx.Node) -> bool:
    """Whether ``n`` takes a number ``|c| ≥ 1e3`` or ±inf: ``m * -10000.0``, ``m * torch.finfo(x.dtype).min``."""
    return _numbers(n) >= HUGE


def _additive_masks(gm: fx.GraphModule, child: bool = False) -> set[fx.Node]:
    """The mask nodes (module doc) that are additive masks or compute one: those whose value on the example is one,
    and those computed from integer / bool tensors with a number ``|c| ≥ 1e3`` on the way, with their mask inputs
    (a ``uint8`` image's ``x.float() / 255`` is no such node: CNNs keep their int8 arithmetic); in a ``child`` graph
    also its float inputs that are all zeros on the example (module doc)."""
    masks: dict[fx.Node, bool] = {}  # mask node -> additive
    size: dict[fx.Node, float] = {}  # a node computed from integer / bool tensors -> the largest |number| on the way
    for n in gm.graph.nodes:
        if not n.meta.get("lowbit_ftensor", False):
            continue
        if n.meta.get("lowbit_mask") or (child and n.op == "placeholder" and n.meta.get("lowbit_level") == 0.0):
            masks[n] = True
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        ins = [a for a in n.all_input_nodes if _tensor(a)]
        if ins and all(a in masks or not a.meta.get("lowbit_ftensor", False) for a in ins):
            masks[n] = _huge(n) or any(masks.get(a, False) for a in ins)
            size[n] = max([_numbers(n), *(size.get(a, 0.0) for a in ins)])
    out = {n for n, additive in masks.items() if additive}
    for n in gm.graph.nodes:  # (smaller masks, RATIO: by what they are added to)
        ops = [_source(a) for a in n.args[:2] if isinstance(a, fx.Node)] if n.meta.get("lowbit_qop") == "add" else []
        for m, other in (ops, ops[::-1]) if len(ops) == 2 else ():
            level = m.meta.get("lowbit_level")
            c = 0.0 if level is None else max(-level, size.get(m, 0.0) if m in masks else 0.0)
            if c > 0 and c >= RATIO * other.meta.get("lowbit_absmax", float("inf")):
                out.add(m)
    todo = list(out)
    while todo:  # (the chain that computes an additive mask: `1.0 - m` before `* -1e4`)
        for a in todo.pop().all_input_nodes:
            if a in masks and a not in out:
                out.add(a)
                todo.append(a)
    return out


def _source(arg: Any) -> Any:
    """``arg`` or, through shape ops (``share``: a view / expand of a mask), the value it passes on."""
    while isinstance(arg, fx.Node) and arg.meta.get("lowbit_kind") == "share" and arg.args:
        arg = arg.args[0]
    return arg


def keep_masks_float(gm: fx.GraphModule, report: FxReport, prefix: str) -> None:
    """Set the mask nodes and the adds reading one (module doc) that classify made int ops to ``float``, each
    named in ``report.left_float``; ``prefix``: the graph's path in the model (not empty: a child graph)."""
    masks = _additive_masks(gm, child=bool(prefix))
    for n in gm.graph.nodes:
        if n.meta.get("lowbit_kind") not in ("functional", "act"):
            continue
        what = getattr(n.target, "__name__", str(n.target))
        if n in masks:
            why = ("an attention mask: 0 / -1e4-scale values (or 0 / c, |c| ≥ 2x what it is added to), or computed from "
                   "integer / bool tensors with such a number")
        elif n.meta.get("lowbit_qop") == "add" and (m := next(
                (_source(a) for a in n.args if _source(a) in masks), None)) is not None:
            why = f"adds the mask {m.name!r}: one int8 grid over the sum would span the mask's range"
            if m.op == "placeholder" and m.meta.get("lowbit_level") == 0.0:
                why = (f"adds {m.name!r}, an input of this child graph that is all zeros on the example: an attention "
                       "mask without padding, whose int8 grid over the sum would span the mask's range")
        else:
            continue
        n.meta.update(lowbit_kind="float", lowbit_qop=None)
        n.meta.pop("lowbit_scalar_op", None)
        n.meta.pop("lowbit_alpha", None)
        report.left_float[join(prefix, n.name)] = f"{what} (kept float: {why})"
