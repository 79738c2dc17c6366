"""``prepare_custom_config`` in graph mode: custom observed modules, declared non-traceable modules, preserved attributes.

- ``swap_custom(gm, {Float: Observed})``: each ``call_module`` of an exact type ``Float`` with a static qconfig becomes
  ``Observed.from_float(mod)`` (keeping the qconfig); an error of ``from_float`` is re-raised naming the module.
- ``declare_non_traceable(model, ctx, cfg)``: the named modules and instances of the named classes become leaves of
  the trace with qconfig ``None`` inside (float), listed in the report.
- ``preserve(src, dst, names, fn)``: ``setattr(dst, n, getattr(src, n))`` for plain attributes; a submodule or a name
  the ``GraphModule`` defines itself is refused (``check_preservable``), as it would replace the graph's own. A method
  of the model (``predict``) is bound to the result (``preserved_value``): bound to the float model, as torch.ao leaves
  it, ``prepared.predict(x)`` ran the float layers and calibrated nothing, ``quantized.predict(x)`` ran float.
"""

from __future__ import annotations

import types
from typing import Any

from torch import fx, nn

from ..custom_config import PrepareCustomConfig
from ..workflow import is_dynamic_qconfig

__all__ = ["swap_custom", "declare_non_traceable", "check_preservable", "preserved_value", "preserve"]


def swap_custom(gm: fx.GraphModule, custom: dict[type, type]) -> None:
    """Replace custom float modules (``prepare_custom_config``'s float → observed classes) in the graph."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        qc = getattr(mod, "qconfig", None)
        if type(mod) in custom and qc is not None and not is_dynamic_qconfig(qc):
            try:  # (named as eager prepare names it; it was the bare error of the user's from_float)
                new = custom[type(mod)].from_float(mod)
            except (ValueError, TypeError, RuntimeError) as err:
                raise type(err)(f"prepare_fx: custom module '{node.target}' ({type(mod).__name__} -> "
                                f"{custom[type(mod)].__name__}.from_float): {err}") from err
            if not isinstance(new, nn.Module):  # (as eager prepare checks)
                raise TypeError(f"prepare_fx: {custom[type(mod)].__name__}.from_float returned "
                                f"{type(new).__name__}, not an nn.Module, for {node.target!r}")
            new.qconfig = qc
            parent, _, name = node.target.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, name, new)


def declare_non_traceable(model: nn.Module, ctx: Any, cfg: PrepareCustomConfig) -> None:
    """Make the declared non-traceable modules float leaves: no qconfig inside, listed in the report."""
    found: dict[str, nn.Module] = {}
    for name in cfg.non_traceable_module_names:
        try:
            found[name] = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{ctx.fn}: prepare_custom_config names non-traceable module {name!r}, which "
                             f"{type(model).__name__} does not have") from None
    classes = tuple(cfg.non_traceable_module_classes)
    if classes:
        found.update({n: m for n, m in model.named_modules() if isinstance(m, classes) and n})
    for name, mod in found.items():
        ctx.leaves[0].add(id(mod))
        for m in mod.modules():
            m.qconfig = None
        ctx.report.untraceable[name] = "declared non-traceable (prepare_custom_config): left float"


def check_preservable(src: nn.Module, dst: nn.Module, name: str, fn: str) -> None:
    """A preserved attribute is data the graph does not run: a submodule (the graph holds its own, fused or observed,
    twin) or a name of the GraphModule itself (``forward``, ``graph``, ...) would be overwritten by the float original."""
    if isinstance(getattr(src, name, None), nn.Module) or name in getattr(dst, "_modules", {}) or hasattr(type(dst), name):
        raise ValueError(f"{fn}: preserved attribute {name!r} is a submodule or a method of the model; setting it on "
                         "the result would replace the graph's own (fused / quantized) module or code. Preserve plain "
                         "attributes (numbers, strings, tensors, configs) only")


def preserved_value(src: nn.Module, dst: nn.Module, name: str) -> Any:
    """``getattr(src, name)`` for ``dst``: a method bound to ``src`` is bound to ``dst`` instead."""
    value = getattr(src, name)
    if isinstance(value, types.MethodType) and value.__self__ is src:
        return types.MethodType(value.__func__, dst)
    return value


def preserve(src: nn.Module, dst: nn.Module, names: list[str], fn: str) -> None:
    for name in names:
        if not hasattr(src, name):
            raise ValueError(f"{fn}: preserved attribute {name!r} is not an attribute of {type(src).__name__}")
        check_preservable(src, dst, name, fn)
        setattr(dst, name, preserved_value(src, dst, name))

