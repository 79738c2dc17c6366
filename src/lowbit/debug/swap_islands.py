"""The float islands of ``search="fast"``: convert's own rule, and the activations it keeps float with them.

Once some layers or ops are float, ``prepare_fx`` keeps float the int8 adds / muls / cats / matmuls / activations that
no int8 op reads any more (``fx.islands``; attention masks and the sums they enter are float whatever the qconfigs,
``fx.masks``). The fast search swaps layers of one converted model instead of preparing again, so it asks the same
rule: ``IslandRule`` runs ``fx.islands.islands_under`` on the prepared graphs with the candidates' nodes float and
names what it demotes by call-order key (``"module:function#index"``, the rows of the ops). An int8 activation called
as a function (``torch.sigmoid(g)``, ``F.hardswish``) is no row, but the rule may keep it float with its group: its
``_ActTwin`` (``act_twins``) then runs it in float, as the built model does. An op made of a method call
(``h.add(y)``: no call-order key, no row) is named ``"module:Tensor.add#i"`` (``island_name``) and followed the same
way (``method_ops``: an ``_OpTwin``).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> class Res(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b, self.ln = nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)
...     def forward(self, x):
...         h = torch.sigmoid(self.a(x)) + x
...         return self.b(h), self.ln(h)
>>> p = Q.prepare_fx(Res().eval(), Q.get_minmax_qconfig(), example_inputs=(torch.randn(2, 4),))
>>> rule = IslandRule(p)
>>> sorted(rule(set())), sorted(rule({"b"}))                # b float: nothing int8 reads the add and the sigmoid
([], ['b', 'operator.add#0', 'torch.sigmoid#0'])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..fx.islands import INT_KINDS, islands_under
from ..nn.quantized import activation as nnq_act
from ..nn.quantized.functional_modules import QFunctional
from ..nn.quantized.stubs import Quantize
from ..qtensor import QTensor
from ..speed_guard import requant_grid
from ..workflow.propagate import join_name
from .table import call_order_name

__all__ = ["IslandRule", "act_twins", "island_name", "method_ops"]


class IslandRule:
    """``rule(floats)``: ``floats`` (candidate names: layer paths, op rows) and the names of the int ops the model
    ``prepare_fx`` builds with them float keeps float too (``fx.islands.islands_under`` on each graph of the prepared
    model ``prepared``, which is not changed). Answers are cached per graph and set of float nodes."""

    def __init__(self, prepared: nn.Module) -> None:
        self.graphs: list[tuple[fx.GraphModule, dict[fx.Node, str]]] = []
        for gpath, gm in prepared.named_modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            names = {}
            for n in gm.graph.nodes:
                if n.meta.get("lowbit_kind") not in (*INT_KINDS, "float"):
                    continue
                if n.op == "call_module":
                    names[n] = join_name(gpath, str(n.target))
                elif (name := island_name(n.meta)) is not None:
                    names[n] = name
            if names:
                self.graphs.append((gm, names))
        self._cache: dict[tuple[int, frozenset[fx.Node]], set[fx.Node]] = {}

    def __call__(self, floats: set[str]) -> set[str]:
        out = set(floats)
        for gm, names in self.graphs:
            nodes = frozenset(n for n, name in names.items() if name in floats)
            if not nodes:  # (the model prepared as it is: its islands are float in the converted model already)
                continue
            key = (id(gm), nodes)
            if key not in self._cache:
                self._cache[key] = islands_under(gm, nodes)
            out |= {names[n] for n in self._cache[key] if n in names}
        return out


class _ActTwin(nn.Module):
    """An int8 activation module ``convert_fx`` made of a function call (``quantized_act_N``) kept float: the float
    activation (``float_mod``: ``nn.Sigmoid``, ``nn.ELU(alpha)``, ...) on the dequantized input, float out (``grid``:
    the int8 module's output grid, for the gates)."""

    def __init__(self, qact: nn.Module) -> None:
        super().__init__()
        self.float_mod = _float_act(qact)
        grid = (float(qact.scale), int(qact.zero_point), qact.qdtype) if hasattr(qact, "scale") else None
        self.add_module("requant", None if grid is None else Quantize(*grid))

    @property
    def grid(self) -> tuple[float, int, Any] | None:
        """The int8 activation's output grid ``(scale, zero_point, qdtype)``, or None (it keeps its input's)."""
        return requant_grid(self.requant)

    def forward(self, x: Any) -> torch.Tensor:
        return self.float_mod(x.dequantize() if isinstance(x, QTensor) else x)


def _float_act(qact: nn.Module) -> nn.Module | None:
    """The float module of an int8 activation (its ``_float_type`` with its parameters), or None (no such type)."""
    cls = getattr(qact, "_float_type", None)
    if isinstance(qact, nnq_act.ReLU6):
        return nn.ReLU6()
    if cls is nn.ELU:
        return nn.ELU(qact.alpha)
    if cls is nn.LeakyReLU:
        return nn.LeakyReLU(qact.negative_slope)
    return cls() if cls in (nn.Sigmoid, nn.Tanh, nn.Hardsigmoid, nn.Hardswish) else None


def act_twins(qmodel: nn.Module) -> dict[str, tuple[str, _ActTwin]]:
    """``{path of a quantized_act_N: (name by call-order key, its float twin)}`` for every int8 activation of a
    ``convert_fx`` model that was a function call (its node carries ``meta["lowbit_call_order"]``)."""
    out = {}
    for gpath, gm in qmodel.named_modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.meta.get("lowbit_kind") == "act" and island_name(n.meta) is not None \
                    and _float_act(qact := gm.get_submodule(str(n.target))) is not None:
                out[join_name(gpath, str(n.target))] = (island_name(n.meta), _ActTwin(qact))
    return out


def island_name(meta: dict[str, Any]) -> str | None:
    """The name the search gives an int op node: its row name (``call_order_name`` of its call-order key), or for a
    method call (``x.add(y)``: no torch.ao key, no row) ``"module:Tensor.add#i"`` from ``meta["lowbit_method_order"]``
    (``fx.classify.apply_call_order``); None for neither.

    >>> island_name({"lowbit_method_order": ("block", "Tensor.add", 1)}), island_name({})
    ('block:Tensor.add#1', None)
    """
    if "lowbit_call_order" in meta:
        return call_order_name(meta["lowbit_call_order"])
    if "lowbit_method_order" not in meta:
        return None
    path, method, index = meta["lowbit_method_order"]
    return f"{path}:{method}#{index}" if path else f"{method}#{index}"


def method_ops(qmodel: nn.Module) -> dict[str, str]:
    """``{path of a qfunctional_N: its name}`` for every graph-mode int8 op of a ``convert_fx`` model made of a method
    call (``x.add(y)``, ``x.mul(y)``): no row (a mapping cannot name it), but the island rule may keep it float."""
    out = {}
    for gpath, gm in qmodel.named_modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
        for n in gm.graph.nodes:
            if n.op == "call_module" and "lowbit_call_order" not in n.meta and "lowbit_method_order" in n.meta \
                    and isinstance(gm.get_submodule(str(n.target)), QFunctional) and targets.count(str(n.target)) == 1:
                out[join_name(gpath, str(n.target))] = island_name(n.meta)
    return out
