"""``convert_fx``: turn a calibrated prepared graph into an integer one.

For each observer node of the prepared graph (``lowbit.fx.prepare``):

- after a ``module`` node: the module becomes ``mapping[type].from_float(mod)`` (the eager
  ``convert`` path: the observer is its ``activation_post_process``; a QAT conv-BN is folded first);
- after a ``functional`` node: the op becomes a method call on a new ``QFunctional`` holding the
  observed grid (``qfunctional_<i>.add(a, b)``, ``add_relu``, ``mul``, ``matmul``, ``cat``,
  ``add_scalar``, ``mul_scalar``: ``x - c`` is ``add_scalar(x, -c)``, ``c - x`` ``add_scalar`` of the mirrored codes,
  ``x / c`` ``mul_scalar(x, 1 / c)``, see ``lowbit.fx.scalar_ops``);
- after an ``act`` node (``F.hardswish`` ...): a quantized activation module on the observed grid;
- after a ``weighted`` node (``F.linear``/``F.conv*`` on model parameters): a quantized
  ``Linear``/``ConvNd`` module built from a float stand-in (``lowbit.fx.weighted``), its weight
  grid from the ``weight_post_process`` observer of the weight edge; the float weight and bias
  attributes no other node reads are deleted;
- an input observer (a float value read by int ops) becomes a ``Quantize`` node.

Weight-only nodes (embeddings: a quantized table, float output) and dynamic nodes (``Linear``/``LSTM``/
``GRU``/``F.linear`` with a dynamic qconfig: float in, float out, no calibration needed) are swapped by
``lowbit.fx.convert_dynamic``.

Then a shared ``DeQuantize`` is inserted after every int value read by a float op or the graph
output, dropout becomes the identity, and observers and ``.qconfig`` attributes are removed. Every
prepared graph in the model is converted (the children of untraceable modules have their own).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torch import fx, nn

from ..custom_config import ConvertCustomConfig
from ..fake_quant.base import holds_grid
from ..observer.ddp import drop_removed
from ..observer.distributed import sync_pending
from . import convert_dynamic as float_out
from .call import plain_call
from .classify import drop_grid_blends
from .converter import _Converter
from .observed_rules import apply_observed_rules
from .padding import detach
from .custom import check_preservable, preserved_value
from .state import STATE_KEY, check_prepared, uncarry
from .report import FxReport
from ..state_check import guard_loading

__all__ = ["convert_fx"]


def _observers(gm: fx.GraphModule, share: bool = False) -> list[tuple[fx.Node, nn.Module]]:
    kinds = ("obs_out", "obs_in", "obs_w") + (("obs_share",) if share else ())
    return [(n, gm.get_submodule(n.target)) for n in gm.graph.nodes if n.meta.get("lowbit_kind") in kinds]


def _unobserve(gm: fx.GraphModule) -> None:
    """A prepared child graph back to its float computation: every observer node bypassed and removed."""
    drop_grid_blends(gm)
    for node, _ in _observers(gm, share=True):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.meta[STATE_KEY] = {**gm.meta[STATE_KEY], "converted": True}


def _convert_graph(gm: fx.GraphModule, report: FxReport, custom: dict[type, type],
                   custom_dynamic: dict[type, type]) -> None:
    drop_grid_blends(gm)  # (the QTensor upsample runs the kernel on the codes)
    conv = _Converter(gm, report, gm.meta[STATE_KEY].get("prefix", ""), custom)
    float_out.custom_dynamic(conv, custom_dynamic)
    apply_observed_rules(conv)  # (a scalar product's collapsed range, a child's mask without example: observed_rules)
    conv.observers()
    float_out.dynamic(conv)
    float_out.weight_only(conv)
    conv.drop_float_attrs()
    conv.identities()
    conv.dequantize()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.meta[STATE_KEY] = {**gm.meta[STATE_KEY], "converted": True}


def convert_fx(model: nn.Module, inplace: bool = False, convert_custom_config: Any = None) -> nn.Module:
    """Convert a calibrated (or QAT-trained) ``prepare_fx`` / ``prepare_qat_fx`` model to int8; eval mode.

    The result's quantized nodes are ``lowbit.nn.quantized`` modules and ``QFunctional`` calls;
    ``Quantize``/``DeQuantize`` nodes sit where int8 regions begin and end, so the model takes and
    returns float tensors. ``model.lowbit_report`` says what was quantized and what stayed float.
    An observer that saw no data raises ``RuntimeError`` naming the op. ``convert_custom_config``
    (a ``lowbit.custom_config.ConvertCustomConfig``, torch.ao's, or its dict form): observed custom
    modules become ``Quantized.from_observed(mod)``; its preserved attributes are kept (as are
    those ``prepare_custom_config`` preserved).
    A reference model (``convert_to_reference_fx``) is lowered to the same int8 model
    (``lowbit.reference.lower_reference_fx``).
    """
    cfg = ConvertCustomConfig.coerce(convert_custom_config, "convert_fx")
    check_prepared(model, "convert_fx")
    top = model.meta[STATE_KEY] if isinstance(model, fx.GraphModule) else model.__dict__[STATE_KEY]
    if top.get("converted"):
        raise ValueError("convert_fx: this model was already converted")
    if not isinstance(inplace, bool):
        raise TypeError(f"convert_fx: inplace must be a bool, got {inplace!r}")
    if top.get("reference"):  # a convert_to_reference_fx model: lower it (same tier; it builds on this module)
        from ..reference.fx import lower_reference_fx

        if convert_custom_config is not None and cfg.to_dict():
            raise ValueError("convert_fx: a reference model is lowered as it is; convert_custom_config "
                             f"{cfg.to_dict()} would not be applied (pass it to convert_to_reference_fx)")
        return lower_reference_fx(model, inplace=inplace)
    source = model
    if not inplace:
        model = copy.deepcopy(model)
    top = model.meta[STATE_KEY] if isinstance(model, fx.GraphModule) else model.__dict__[STATE_KEY]
    report: FxReport = top["report"]
    sync_pending(model)  # under torch.distributed: the ranks agree on the observers' paths, then reduce (one pass)
    graphs = [m for m in model.modules() if isinstance(m, fx.GraphModule) and STATE_KEY in m.meta
              and not m.meta[STATE_KEY].get("converted")]
    custom, custom_dynamic = cfg.mapping(), cfg.mapping(dynamic=True)
    # per graph: did any activation observer see data (None: it has none, e.g. only weight-only or dynamic layers)
    acts = {id(gm): [obs for n, obs in _observers(gm) if n.meta.get("lowbit_kind") != "obs_w"] for gm in graphs}
    ran = {k: (any(holds_grid(o) for o in v) if v else None) for k, v in acts.items()}
    for gm in graphs:
        state = gm.meta[STATE_KEY]
        if state.get("prefix") and ran[id(gm)] is False and any(ran.values()) and not state.get("is_qat"):
            # a child graph of an untraceable parent that never ran while others did (a branch the calibration
            # data did not take): float as it was, as eager convert keeps such a module
            path = state["prefix"]
            warnings.warn(f"convert_fx: '{path}' never ran during calibration; it is left float", stacklevel=2)
            report.left_float[path] = "never ran during calibration"
            _unobserve(gm)
            continue
        _convert_graph(gm, report, custom, custom_dynamic)
    for m in model.modules():
        m.__dict__.pop("qconfig", None)
        uncarry(m)  # (a converted graph pickles as it is)
    top["converted"] = True
    for name in [*top.get("preserved", []), *cfg.preserved_attributes]:  # a GraphModule copy drops them
        if not hasattr(source, name):
            raise ValueError(f"convert_fx: preserved attribute {name!r} is not an attribute of the prepared model")
        check_preservable(source, model, name, "convert_fx")
        setattr(model, name, preserved_value(source, model, name))
    model.lowbit_report = report
    detach(model)  # prepare_fx's attention_mask hooks: no observer is left to read them
    drop_removed(model, source)  # DDP's ignore list (a GraphModule copy lost it): the user's names, no observer's
    return guard_loading(plain_call(model)).eval()  # (run-time errors reach a compiled model's caller: fx/call.py)
