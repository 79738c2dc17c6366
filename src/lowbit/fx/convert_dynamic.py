"""``convert_fx``'s float-in, float-out swaps: dynamic nodes, dynamic custom modules, weight-only tables.

None of these needs an output observer. A **dynamic** node (a dynamic qconfig on an ``nn.Linear`` /
``LSTM`` / ``GRU`` module, or ``F.linear`` on parameters through its float stand-in) becomes
``get_default_dynamic_quant_module_mappings()[type].from_float(mod, dtype=qconfig.weight().qdtype)``:
its weight is quantized once, from ``qconfig.weight()``, and each call quantizes its input on the grid
of that input's own min/max::

    acc = Σ (q_x - z_x) · q_w[c]          # int32;  y = acc · s_x s_w[c] + b[c]   (float out)

(a fused ``linear_relu`` is followed by ``F.relu``). A leaf whose type has a dynamic class in
``convert_custom_config`` becomes ``Dynamic.from_float(mod)``. A **weight-only** node
(``nn.Embedding`` / ``nn.EmbeddingBag`` or their QAT twin) is swapped for its ``lowbit.nn.quantized``
table (a per-row grid from ``qconfig.weight()``), unless a node still reads its float table.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 3)).eval()
>>> mapping = Q.QConfigMapping().set_global(Q.get_dynamic_qconfig())
>>> qmodel = Q.convert_fx(Q.prepare_fx(model, mapping, (torch.randn(2, 4),)))   # no calibration needed
>>> sorted(qmodel.lowbit_report.converted.values())
['Linear -> lowbit.nn.quantized.dynamic.linear.Linear']
>>> x = torch.randn(5, 4)
>>> bool((qmodel(x) - model(x)).abs().max() < 0.05)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import fx, nn

from ..nn.intrinsic import FusedModule
from ..nn.intrinsic.fold import carry_linear_bn_check
from .weighted import arg_of, input_of

if TYPE_CHECKING:
    from .converter import _Converter

__all__ = ["set_module", "what", "custom_dynamic", "dynamic", "weight_only"]


def set_module(gm: fx.GraphModule, path: str, mod: nn.Module) -> None:
    """Put ``mod`` at the dotted ``path`` of ``gm`` (a Linear replacing one with a BatchNorm1d folded in keeps its
    2-d input check: ``carry_linear_bn_check``)."""
    parent, _, name = path.rpartition(".")
    owner = gm.get_submodule(parent) if parent else gm
    old = getattr(owner, name, None)
    setattr(owner, name, carry_linear_bn_check(old, mod) if isinstance(old, nn.Module) else mod)


def what(node: fx.Node, gm: fx.GraphModule) -> str:
    """The op a node runs, for messages and the report: the module's class name or the function's name."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))


def custom_dynamic(conv: _Converter, table: dict[type, type]) -> None:
    """Swap float leaves whose type has a dynamic custom class (``from_observed``): float in, float out."""
    for node in conv.graph.nodes:
        if node.op != "call_module" or node.target in conv.swapped:
            continue
        mod = conv.gm.get_submodule(node.target)
        if type(mod) not in table:
            continue
        new = table[type(mod)].from_float(mod)
        set_module(conv.gm, node.target, new)
        conv.swapped.add(node.target)
        conv.report.converted[conv._key(node)] = f"{type(mod).__name__} -> {type(new).__name__} (dynamic custom)"


def dynamic(conv: _Converter) -> None:
    """Swap dynamic nodes (module or ``F.linear`` stand-in) for ``lowbit.nn.quantized.dynamic`` modules."""
    graph, gm = conv.graph, conv.gm
    for node in list(graph.nodes):
        if node.meta.get("lowbit_kind") != "dynamic" or node.target in conv.swapped:
            continue
        qconfig, src = node.meta["lowbit_qconfig"], conv.standins.get(node)
        mod = gm.get_submodule(node.target) if src is None else src
        if isinstance(src, FusedModule):  # linear_relu: the marker's Linear
            mod = src[0]
        qcls, name_of = conv.dynamic_mapping[type(mod)], what(node, gm)
        mod.qconfig = qconfig  # the weight grid comes from qconfig.weight(), as in quantize_dynamic
        try:
            new: Any = qcls.from_float(mod, dtype=getattr(qconfig.weight(), "qdtype", None))
        except (ValueError, TypeError, RuntimeError) as err:
            raise type(err)(f"convert_fx: '{node.name}' ({name_of} -> dynamic {qcls.__name__}): {err}") from err
        conv.report.converted[conv._key(node)] = f"{name_of} -> {qcls.__module__}.{qcls.__name__}"
        if src is None:
            set_module(gm, node.target, new)
            conv.swapped.add(node.target)
            continue
        name = conv._new_name(f"dynamic_{name_of}")
        gm.add_submodule(name, new)
        weight, bias = arg_of(node, "weight"), arg_of(node, "bias")
        with graph.inserting_before(node):
            out = graph.call_module(name, (input_of(node),))
            if mod is not src:  # fused linear_relu: the ReLU runs in float after the layer
                out = graph.call_function(F.relu, (out,))
        conv._replace(node, out)
        for attr in (weight, bias):  # float weight / bias reads no other node needs
            if attr is not None and not attr.users:
                conv.dropped.add(attr.target)
                graph.erase_node(attr)


def weight_only(conv: _Converter) -> None:
    """Swap embeddings for their quantized tables, unless a node still reads the float table."""
    read = {n.meta.get("lowbit_attr", n.target) for n in conv.graph.nodes if n.op == "get_attr"}  # (under an alias)
    for node in conv.graph.nodes:
        if node.meta.get("lowbit_kind") != "wonly" or node.target in conv.swapped:
            continue
        if any(t.startswith(f"{node.target}.") for t in read):  # type: ignore[union-attr]
            name_of = type(conv.gm.get_submodule(node.target)).__name__  # type: ignore[arg-type]
            conv.report.left_float[conv._key(node)] = f"{name_of} (its table is also read as a float tensor)"
            continue
        conv.swapped.add(node.target)
        conv.module(node, None)
