"""What graph mode knows about each op: integer kernels, grid-preserving ops, float fallbacks.

Every node of a traced model falls in one of these classes (``lowbit.fx.prepare`` assigns them):

=============  ==========================================  ====================================
class          ops                                         after ``convert_fx``
=============  ==========================================  ====================================
``module``     modules with a ``lowbit.nn.quantized`` twin  the twin (``from_float``), int in/out
               (Linear, Conv*, fused markers, QAT modules,
               ReLU6, Hardswish, Sigmoid, ...)
``functional`` ``+``/``torch.add``/``operator.add``, mul,   a ``QFunctional`` method on the
               cat, matmul/bmm, add-relu, scalar add/mul/div observed output grid, int in/out
               add/sub of two tensors with ``alpha``, ``-``
               (an add; ``classify._alpha``)
``act``        ``F.hardswish``, ``torch.sigmoid``, ...      the quantized activation module
``weighted``   ``F.linear``/``F.conv1d/2d/3d`` whose weight   quantized ``Linear``/``ConvNd``
               and bias are model parameters/buffers        (``lowbit.fx.weighted``), int in/out
``wonly``      ``nn.Embedding``, ``nn.EmbeddingBag``         per-row weight-only quantized table,
                                                            int indices in, float out
``dynamic``    Linear/LSTM/GRU modules, ``F.linear`` on      ``lowbit.nn.quantized.dynamic``
               parameters, under a dynamic qconfig          module, float in/out
``share``      relu, flatten, view/reshape/permute/         runs on the codes of its input
               transpose/(un)squeeze/narrow, chunk/split    (int stays int, float stays float;
               (only indexed), max-pool, dropout,
               identity, size/shape, nearest and
               bilinear interpolation (``F.interpolate``
               / ``nn.Upsample`` in ``"nearest"`` /
               ``"nearest-exact"`` / ``"bilinear"``
               mode, no antialias), roll, repeat,
               expand/expand_as, clamp/clip/hardtanh with
               constant bounds (``is_constant_clamp``),
               ``nn.Hardtanh``,
               zero padding (``F.pad`` value 0,            a zero pad fills the zero point)
               ``nn.ZeroPad*d``, ``nn.ConstantPad*d(0)``)
``float``      everything else (softmax, layer_norm, gelu,  float, a ``DeQuantize`` before it
               avg-pool, unknown modules ...)
=============  ==========================================  ====================================

Fusion (conv-bn-relu runs, add-relu, ``relu(F.linear(...))``) is ``lowbit.fx.fusion``, which builds on these tables.

>>> import operator, torch
>>> canonical_binary("call_function", operator.add), canonical_binary("call_method", "matmul")
('add', 'matmul')
>>> is_relu_target("call_function", torch.relu), is_relu_target("call_method", "relu_")
(True, True)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..compile_state import graph_leaf
from ..mappings import get_default_static_quant_module_mappings
from ..nn import qat as nnqat
from ..nn.quantized import activation as nnq_act

__all__ = ["BINARY_FUNCS", "WEIGHT_ONLY_TYPES", "canonical_binary", "is_relu_target", "add_relu", "FUNC_ACTIVATIONS",
           "func_activation", "is_share_op", "is_constant_clamp", "is_zero_pad", "is_code_resample",
           "is_bilinear_resample", "bilinear_call_args", "is_dropout", "graph_module_types", "as_number"]

# binary ops with a QFunctional twin: target -> method name
BINARY_FUNCS: dict[Any, str] = {
    operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul",
    operator.truediv: "div", torch.div: "div",
    torch.cat: "cat", torch.concat: "cat",
}
_BINARY_METHODS = {"add": "add", "mul": "mul", "matmul": "matmul", "bmm": "matmul", "div": "div"}


def canonical_binary(op: str, target: Any) -> str | None:
    """The ``QFunctional`` op (``add``/``mul``/``matmul``/``div``/``cat``) a node computes, or ``None``."""
    if op == "call_function":
        return BINARY_FUNCS.get(target)
    if op == "call_method":
        return _BINARY_METHODS.get(target)
    return None


@graph_leaf
def add_relu(a: Any, b: Any) -> Any:
    """``relu(a + b)``: the float form of a fused add-relu node in a prepared graph."""
    return torch.relu(a + b)


BINARY_FUNCS[add_relu] = "add_relu"

_RELU_FUNCS = {F.relu, torch.relu, torch.relu_}


def is_relu_target(op: str, target: Any, mod: nn.Module | None = None) -> bool:
    """Whether a node is a ReLU (module, function or method form)."""
    if op == "call_function":
        return target in _RELU_FUNCS
    if op == "call_method":
        return target in ("relu", "relu_")
    return op == "call_module" and type(mod) is nn.ReLU


# functional activations with a quantized module twin (built on the observed output grid)
FUNC_ACTIVATIONS: dict[Any, type[nn.Module]] = {
    F.hardswish: nnq_act.Hardswish, F.hardsigmoid: nnq_act.Hardsigmoid, torch.sigmoid: nnq_act.Sigmoid,
    F.sigmoid: nnq_act.Sigmoid, torch.tanh: nnq_act.Tanh, F.tanh: nnq_act.Tanh, F.elu: nnq_act.ELU,
    F.leaky_relu: nnq_act.LeakyReLU, F.relu6: nnq_act.ReLU6,
}
_METHOD_ACTIVATIONS = {"sigmoid": nnq_act.Sigmoid, "tanh": nnq_act.Tanh}

# ops that run on QTensor codes (grid-preserving) or produce no tensor
# (the view ops as functions too: torchvision's channel shuffle is `torch.transpose(x, 1, 2)`)
_SHARE_FUNCS = {F.relu, torch.relu, torch.flatten, F.max_pool1d, F.max_pool2d, F.max_pool3d,
                F.adaptive_max_pool2d, F.dropout, torch.dropout, operator.getitem, getattr, len,
                torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.narrow,
                torch.roll, operator.neg, torch.neg, torch.negative}  # (-x: the codes mirrored, QTensor's torch.neg)
# (code selections: each output code is an input code, as QTensor runs them; expand_as / repeat as torch.ao's "repeat")
_SHARE_METHODS = {"relu", "view", "reshape", "flatten", "permute", "transpose", "contiguous", "size",
                  "dim", "numel", "detach", "squeeze", "unsqueeze", "narrow", "roll", "repeat", "expand", "expand_as",
                  "neg", "negative"}
# resampling on the codes: nearest neighbour selects codes (QTensor's exact `F.interpolate`), bilinear runs torch's
# quantized kernel on them (qtensor/resample.py): a UNet's / FPN's decoder upsampling; bicubic, linear, trilinear and
# antialiased bilinear have no quantized kernel (torch.ao's neither) and stay float
_NEAREST = ("nearest", "nearest-exact")
_ON_CODES = (*_NEAREST, "bilinear")
_INTERPOLATE_FUNCS = {F.interpolate: 3, F.upsample: 3, F.upsample_nearest: None,
                      F.upsample_bilinear: None}  # -> position of `mode`
# ops giving a tuple of views (ShuffleNetV2's `x.chunk(2, dim=1)`): shared when only indexed (`a, b = ...`)
_SPLIT_FUNCS = {torch.chunk, torch.split, torch.tensor_split}
_SPLIT_METHODS = {"chunk", "split", "tensor_split"}
_SHARE_MODULES = (nn.ReLU, nn.Identity, nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.Dropout,
                  nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d)
_CONSTANT_PADS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)


def as_number(v: Any) -> float | None:
    """A node argument that is a plain int / float constant, as a float; ``None`` for anything else (a node, a bool)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def is_zero_pad(node: fx.Node, mod: nn.Module | None) -> bool:
    """Constant padding with 0 (``F.pad`` in ``"constant"`` mode with value 0/None, ``nn.ZeroPad*d``,
    ``nn.ConstantPad*d(..., 0)``): exact on any affine grid, it pads the codes with the zero point.

    A non-zero constant is not known to lie on the grid before calibration: that pad stays float.
    """
    if node.op == "call_module":
        return type(mod) in (nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d) or (
            type(mod) in _CONSTANT_PADS and float(mod.value) == 0.0)  # type: ignore[union-attr]
    if node.op != "call_function" or node.target is not F.pad:
        return False
    rest, kw = list(node.args[2:]), dict(node.kwargs)
    mode = rest[0] if rest else kw.get("mode", "constant")
    value = rest[1] if len(rest) > 1 else kw.get("value", None)
    return mode == "constant" and (value is None or (as_number(value) == 0.0))


def is_code_resample(node: fx.Node, mod: nn.Module | None) -> bool:
    """``F.interpolate`` / ``F.upsample`` in a nearest mode (the default) or ``"bilinear"`` without ``antialias``,
    ``F.upsample_nearest`` / ``F.upsample_bilinear``, or an ``nn.Upsample`` (``nn.UpsamplingNearest2d`` /
    ``nn.UpsamplingBilinear2d``) in such a mode: the op runs on the codes and keeps the input's grid (nearest: each
    output code is an input code; bilinear: torch's quantized kernel, as torch.ao's converted model runs it)."""
    if node.op == "call_module":
        return type(mod) in (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d) and (
            mod.mode in _ON_CODES)  # type: ignore[union-attr]
    if node.op != "call_function" or node.target not in _INTERPOLATE_FUNCS:
        return False
    at = _INTERPOLATE_FUNCS[node.target]
    if at is None:
        return True
    mode = node.args[at] if len(node.args) > at else node.kwargs.get("mode", "nearest")
    antialias = node.args[6] if len(node.args) > 6 else node.kwargs.get("antialias", False)
    return mode in _NEAREST or (mode == "bilinear" and antialias is False)


def is_bilinear_resample(node: fx.Node, mod: nn.Module | None) -> bool:
    """A ``is_code_resample`` node that averages (bilinear): its float output is off the grid, so the prepared model
    rounds it onto its input's grid (the input's observer called again, as torch.ao's shared observers)."""
    if not is_code_resample(node, mod):
        return False
    if node.op == "call_module":
        return mod.mode == "bilinear"  # type: ignore[union-attr]
    at = _INTERPOLATE_FUNCS[node.target]
    if at is None:
        return node.target is F.upsample_bilinear
    return (node.args[at] if len(node.args) > at else node.kwargs.get("mode", "nearest")) == "bilinear"


_INTERPOLATE_PARAMS = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


def bilinear_call_args(node: fx.Node, mod: nn.Module | None) -> tuple[Any, Any, Any, Any, Any]:
    """``(input, size, scale_factor, align_corners, recompute_scale_factor)`` of an ``is_bilinear_resample`` node as
    ``F.interpolate`` receives them (``F.upsample_bilinear``: ``align_corners=True``; a module: its attributes)."""
    if node.op == "call_module":
        x = node.args[0] if node.args else node.kwargs["input"]
        return (x, mod.size, mod.scale_factor, mod.align_corners,  # type: ignore[union-attr]
                mod.recompute_scale_factor)  # type: ignore[union-attr]
    a = {**dict(zip(_INTERPOLATE_PARAMS, node.args)), **node.kwargs}  # (F.upsample's first five are interpolate's)
    align = True if node.target is F.upsample_bilinear else a.get("align_corners")
    return a["input"], a.get("size"), a.get("scale_factor"), align, a.get("recompute_scale_factor")


_CLAMP_FUNCS = {torch.clamp: ("min", "max"), torch.clip: ("min", "max"), F.hardtanh: ("min_val", "max_val")}


def is_constant_clamp(node: fx.Node) -> bool:
    """``torch.clamp`` / ``torch.clip`` / ``x.clamp`` / ``x.clip`` / ``F.hardtanh`` of a tensor with constant number
    bounds (``None`` for one clamp bound; hardtanh ``min_val <= max_val``, not in place): ``clamp(q, code(min),
    code(max))`` on the input's grid, exact (``qtensor/ops.py``), as torch.ao runs them on the quantized tensor."""
    if node.op == "call_function" and node.target in _CLAMP_FUNCS:
        names = _CLAMP_FUNCS[node.target]
    elif node.op == "call_method" and node.target in ("clamp", "clip"):
        names = ("min", "max")
    else:
        return False
    hard = names[0] == "min_val"
    params = (*names, "inplace") if hard else names
    if len(node.args) > len(params) + 1 or set(node.kwargs) - set(params):
        return False
    vals: dict[str, Any] = dict(zip(params, (-1.0, 1.0, False) if hard else (None, None)))
    vals.update(zip(params, node.args[1:]))
    vals.update(node.kwargs)
    lo, hi = vals[names[0]], vals[names[1]]
    if vals.get("inplace", False) is not False or any(v is not None and (as_number(v) is None or v != v) for v in (lo, hi)):
        return False
    return (lo, hi) != (None, None) and not (hard and lo > hi)


def func_activation(op: str, target: Any) -> type[nn.Module] | None:
    """The quantized activation class for a functional/method activation node, or ``None``."""
    if op == "call_function":
        return FUNC_ACTIVATIONS.get(target)
    if op == "call_method":
        return _METHOD_ACTIVATIONS.get(target)
    return None


def is_share_op(node: fx.Node, mod: nn.Module | None) -> bool:
    """Ops that keep their input's domain: int codes stay int on the same grid, float stays float."""
    if (node.op == "call_function" and node.target in _SPLIT_FUNCS) or (
            node.op == "call_method" and node.target in _SPLIT_METHODS):
        return bool(node.users) and all(u.op == "call_function" and u.target is operator.getitem
                                        and isinstance(u.args[1], int) for u in node.users)  # (a slice: a tuple)
    if node.op == "call_function":
        if node.target is getattr:
            return node.args[1] in ("shape", "device")
        if node.target is F.max_pool2d or node.target is F.max_pool1d or node.target is F.max_pool3d:
            return not node.kwargs.get("return_indices", False)
        return (node.target in _SHARE_FUNCS or is_zero_pad(node, mod) or is_code_resample(node, mod)
                or is_constant_clamp(node))
    if node.op == "call_method":
        return node.target in _SHARE_METHODS or is_constant_clamp(node)
    if node.op == "call_module":
        from ..stubs import DeQuantStub, QuantStub  # identity markers a user may have left in
        if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)) and mod.return_indices:
            return False
        return (type(mod) in _SHARE_MODULES or type(mod) in (QuantStub, DeQuantStub) or is_zero_pad(node, mod)
                or is_code_resample(node, mod) or (type(mod) is nn.Hardtanh and not mod.inplace))
    return False


def is_dropout(node: fx.Node, mod: nn.Module | None) -> bool:
    """Dropout (module or function): the identity in an inference graph."""
    if node.op == "call_function":
        return node.target in (F.dropout, torch.dropout)
    return node.op == "call_module" and isinstance(mod, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d))


# modules quantized weight-only (float output, no activation observer); QAT embeddings too
WEIGHT_ONLY_TYPES: frozenset[type] = frozenset({nn.Embedding, nn.EmbeddingBag, nnqat.Embedding, nnqat.EmbeddingBag})


def graph_module_types() -> set[type]:
    """Module types graph mode converts (the eager static mapping, minus stubs, embeddings, FloatFunctional)."""
    from ..nn.quantized.functional_modules import FloatFunctional
    from ..stubs import DeQuantStub, QuantStub
    skip = {QuantStub, DeQuantStub, FloatFunctional, *WEIGHT_ONLY_TYPES}
    return {t for t in get_default_static_quant_module_mappings() if t not in skip}
