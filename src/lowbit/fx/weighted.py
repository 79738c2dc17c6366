"""Functional layers on the model's own parameters: ``F.linear`` / ``F.conv1d/2d/3d`` in graph mode.

A node ``F.linear(x, self.w, self.b)`` (or ``F.conv2d(x, self.w, self.b, stride, padding,
dilation, groups)``) whose weight and bias are ``get_attr`` nodes (parameters or buffers of the
model) computes exactly what an ``nn.Linear`` / ``nn.Conv2d`` holding that weight would, so graph
mode quantizes it like one: the weight per output channel with ``qconfig.weight()`` (an observer
or, in QAT, a ``FakeQuantize`` inserted on the weight edge), the input and output with
``qconfig.activation()``; ``convert_fx`` then replaces the node by a ``lowbit.nn.quantized``
``Linear``/``ConvNd`` built from a float stand-in module (``standin``), so the same int8 kernels run::

    acc = Σ (q_x - z_x)(q_w - z_w)        # int32;  y = acc · s_x s_w[c] + b[c];  q_y on the output grid

``relu(F.linear(...))`` becomes one ``linear_relu`` node (likewise ``convNd_relu``), converted to
``LinearReLU``/``ConvReLUNd`` (the ReLU runs in the kernel epilogue, on the full output grid).
``parse`` says whether a node is such a layer (and returns its arguments); a weight that is
computed in the graph (``self.w.t()``, ``w * 2``), a non-constant stride, or a weight of the wrong
rank leaves the node float, with the reason.

>>> import torch
>>> import torch.nn.functional as F
>>> from torch import fx, nn
>>> class Head(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.zeros(3))
...     def forward(self, x):
...         return F.linear(x, self.w, self.b)
>>> gm = fx.symbolic_trace(Head())
>>> for n in gm.graph.nodes:            # prepare_fx records this by running example inputs
...     n.meta["lowbit_ftensor"] = n.op != "output"
>>> node = [n for n in gm.graph.nodes if n.op == "call_function"][0]
>>> spec, why = parse(node, gm)
>>> spec.weight, spec.bias, why
('w', 'b', None)
>>> lin = standin(spec, gm)
>>> type(lin).__name__, torch.equal(lin.weight, gm.w)
('Linear', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..compile_state import graph_leaf
from ..nn import intrinsic as nni

__all__ = ["WEIGHTED_FUNCS", "WITH_RELU", "WeightedSpec", "parse", "standin", "fetch", "arg_of", "input_of",
           "linear_relu", "conv1d_relu", "conv2d_relu", "conv3d_relu"]


def _relu(y: Any, relu_max: float | None) -> Any:
    return F.relu(y) if relu_max is None else torch.clamp(y, 0.0, relu_max)


@graph_leaf
def linear_relu(input: Any, weight: Any, bias: Any = None, relu_max: float | None = None) -> Any:
    """``relu(F.linear(...))`` (``clamp(., 0, relu_max)`` when given): a fused functional linear-relu node."""
    return _relu(F.linear(input, weight, bias), relu_max)


@graph_leaf
def conv1d_relu(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                groups: int = 1, relu_max: float | None = None) -> Any:
    """``relu(F.conv1d(...))`` (``clamp(., 0, relu_max)`` when given): a fused functional conv-relu node."""
    return _relu(F.conv1d(input, weight, bias, stride, padding, dilation, groups), relu_max)


@graph_leaf
def conv2d_relu(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                groups: int = 1, relu_max: float | None = None) -> Any:
    """``relu(F.conv2d(...))`` (``clamp(., 0, relu_max)`` when given): a fused functional conv-relu node."""
    return _relu(F.conv2d(input, weight, bias, stride, padding, dilation, groups), relu_max)


@graph_leaf
def conv3d_relu(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                groups: int = 1, relu_max: float | None = None) -> Any:
    """``relu(F.conv3d(...))`` (``clamp(., 0, relu_max)`` when given): a fused functional conv-relu node."""
    return _relu(F.conv3d(input, weight, bias, stride, padding, dilation, groups), relu_max)


# functional layer -> the float module it is equivalent to
WEIGHTED_FUNCS: dict[Any, type[nn.Module]] = {
    F.linear: nn.Linear, F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d,
}
# functional layer -> its fused-relu form (``lowbit.fx.fusion.fuse_graph`` rewrites ``relu(layer(...))``)
WITH_RELU: dict[Any, Any] = {F.linear: linear_relu, F.conv1d: conv1d_relu, F.conv2d: conv2d_relu,
                             F.conv3d: conv3d_relu}
_WITHOUT_RELU = {v: k for k, v in WITH_RELU.items()}
_RELU_MARKER = {nn.Linear: nni.LinearReLU, nn.Conv1d: nni.ConvReLU1d, nn.Conv2d: nni.ConvReLU2d,
                nn.Conv3d: nni.ConvReLU3d}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


@dataclass
class WeightedSpec:
    """A functional layer node's float twin type, ``weight``/``bias`` attribute paths and conv options.

    Only plain data (no ``fx.Node``: node metadata is copied shallowly with the graph); the nodes
    are found again with ``arg_of``.
    """

    module_type: type[nn.Module]
    weight: str
    bias: str | None
    relu: bool = False  # a fused ``linear_relu`` / ``convNd_relu`` node
    options: dict[str, Any] = field(default_factory=dict)  # stride, padding, dilation, groups (conv only)
    relu_max: float | None = None  # its clamp's upper bound (a folded ReLU6 / [0, t] clamp)


def arg_of(node: fx.Node, name: str) -> Any:
    """The node's current argument ``name`` (``input``, ``weight``, ``bias``), positional or keyword."""
    i = _CONV_ARGS.index(name)
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name)


def input_of(node: fx.Node) -> fx.Node:
    """The node's current activation input (observers inserted since ``parse`` are seen)."""
    return arg_of(node, "input")


def fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    """The tensor a ``get_attr`` node reads (``"block.weight"`` -> ``gm.block.weight``)."""
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _is_int_tuple(v: Any) -> bool:
    if isinstance(v, int) and not isinstance(v, bool):
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def parse(node: fx.Node, gm: fx.GraphModule) -> tuple[WeightedSpec | None, str | None]:
    """``(spec, None)`` for a quantizable functional layer node, ``(None, reason)`` for one that is not,
    ``(None, None)`` for any other node."""
    base = _WITHOUT_RELU.get(node.target, node.target) if node.op == "call_function" else None
    if base not in WEIGHTED_FUNCS:
        return None, None
    mtype = WEIGHTED_FUNCS[base]
    names = _CONV_ARGS if mtype is not nn.Linear else _CONV_ARGS[:3]
    fused_kw = {"relu_max"} if base is not node.target else set()
    if len(node.args) > len(names) or set(node.kwargs) - set(names) - fused_kw:
        return None, "unexpected arguments"
    bound = {**{k: v for k, v in _CONV_DEFAULTS.items() if k in names}, **dict(zip(names, node.args)),
             **node.kwargs}
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not isinstance(x, fx.Node) or not x.meta.get("lowbit_ftensor", False):
        return None, "its input is not a float tensor"
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return None, "its weight is computed in the graph, not a parameter/buffer of the model"
    if b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr"):
        return None, "its bias is computed in the graph, not a parameter/buffer of the model"
    weight = fetch(gm, w.target)  # type: ignore[arg-type]
    rank = 2 if mtype is nn.Linear else int(mtype.__name__[-2]) + 2
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != rank:
        return None, f"its weight is not a float tensor of rank {rank}"
    if b is not None:
        bias = fetch(gm, b.target)  # type: ignore[arg-type]
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            return None, f"its bias is not a float tensor of shape ({weight.shape[0]},)"
    options = {k: bound[k] for k in names[3:]}
    pad = options.get("padding", 0)
    if not all(_is_int_tuple(options[k]) for k in ("stride", "dilation") if k in options) or not (
            _is_int_tuple(pad) or pad in ("same", "valid")):
        return None, "its stride/padding/dilation are not constants"
    groups = options.get("groups", 1)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or weight.shape[0] % groups:
        return None, f"groups={groups!r} is not a positive int dividing the output channels"
    return WeightedSpec(mtype, w.target, None if b is None else b.target, base is not node.target,  # type: ignore
                        options, node.kwargs.get("relu_max")), None


def standin(spec: WeightedSpec, gm: fx.GraphModule) -> nn.Module:
    """A float ``nn.Linear``/``nn.ConvNd`` computing the node (sharing the model's weight and bias tensors);
    for a fused-relu node, the ``lowbit.nn.intrinsic`` marker (``LinearReLU`` ...) holding it."""
    weight = fetch(gm, spec.weight)
    bias = None if spec.bias is None else fetch(gm, spec.bias)
    if spec.module_type is nn.Linear:
        mod: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    else:
        groups = spec.options["groups"]
        mod = spec.module_type(weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]),
                               bias=bias is not None, device="meta", **spec.options)
    mod.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        mod.bias = nn.Parameter(bias.detach(), requires_grad=False)
    if spec.relu:
        act = nn.ReLU() if spec.relu_max is None else nni.ClampedReLU(float(spec.relu_max))
        mod = _RELU_MARKER[spec.module_type](mod, act)
    return mod.eval()
