"""``build_twin``: a lowbit model (converted, or prepared / QAT) as its float QDQ twin, the module
``to_onnx`` traces. Each quantized piece is swapped for its twin (``lowbit.export.qdq`` and the
sibling modules); the grid of each quantized layer's input is read by running ``example_inputs``
once (``_record_input_grids``). See ``lowbit.export.onnx`` for what each module becomes.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub())
>>> m = Q.prepare(m, Q.get_minmax_qconfig()); _ = m(torch.randn(8, 4)); m = Q.convert(m)
>>> [type(t).__name__ for t in build_twin(m, torch.randn(2, 4))]
['QDQ', 'WeightedTwin', 'Identity']
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..fake_quant import FakeQuantize
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..nn.quantized import (
    ELU,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    DeQuantize,
    Embedding,
    EmbeddingBag,
    FloatFunctional,
    Hardsigmoid,
    Hardswish,
    LeakyReLU,
    Linear,
    QFunctional,
    Quantize,
    ReLU6,
    Sigmoid,
    Tanh,
    WeightOnlyLinear,
)
from ..nn.quantized._utils import quantize_weight, weight_qparams
from ..nn.quantized.normalization import BatchNorm2d as QBatchNorm2d
from ..nn.quantized.normalization import BatchNorm3d as QBatchNorm3d
from ..nn.quantized.functional_modules import QF_METHODS
from ..observer import ObserverBase
from ..qscheme import quint8
from ..qtensor import QTensor, quantize_per_tensor
from ..reference import modules as ref_modules, ops as ref_ops
from ..speed_guard import FloatFallback
from .dynamic import dynamic_twin
from .embedding import EmbeddingBagTwin, EmbeddingTableTwin
from .exact import ExactQDQ, exact_twin, qdq_reason
from .exact_ops import ExactBatchNormTwin, ExactFunctionalTwin
from .qdq import (
    QDQ,
    WEIGHT_DTYPES,
    ActivationTwin,
    ConstWeight,
    EmbeddingTwin,
    FunctionalTwin,
    Grid,
    weight_dq,
)
from .weighted import WeightedTwin
from .codes import ResampleOnCodes, install, share_grid_bilinear
from .qat import activation_twin
from .weight_only import WeightOnlyTwin

__all__ = ["build_twin"]

_CONV = (Conv1d, Conv2d, Conv3d)
_CONV_T = (ConvTranspose1d, ConvTranspose2d, ConvTranspose3d)
_LUT = (ELU, Hardswish, Hardsigmoid, LeakyReLU, Sigmoid, Tanh)
_QBN = (QBatchNorm2d, QBatchNorm3d)
_NEEDS_INPUT_GRID = (Linear, *_CONV, *_CONV_T, ReLU6, *_QBN)
_MIXED = "mixed"  # a quantized BatchNorm's input grid where its call sites differ (exported as QDQ)
_RELU6_FLOAT_GRID: Grid = (6.0 / 255, 0, quint8)


def _check_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("to_onnx: example_inputs must be a tensor or a non-empty tuple of tensors, got "
                        f"{type(example_inputs).__name__}")
    for i, t in enumerate(inputs):
        if t.is_meta:
            raise ValueError(f"to_onnx: example_inputs[{i}] (shape {tuple(t.shape)}) is a meta tensor; the export runs "
                             "the model on it: give real values")
        if t.is_floating_point() and t.dtype != torch.float32:  # the twin's float32 weights and QDQ nodes
            raise TypeError(f"to_onnx: example_inputs[{i}] has dtype {t.dtype}; the exported graph takes float32 "
                            "inputs (QuantizeLinear, float32 weights): pass it as .float()")
    return tuple(inputs)


def _bn_folded(mod: nn.Module) -> nn.Module | None:
    """A QAT conv/linear-BN module as its BN-folded QAT layer (what ``convert`` builds from), hooks kept."""
    if not isinstance(mod, BnFoldedBase):
        return None
    out = mod.fold().eval()
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks_with_kwargs"):
        getattr(out, hooks).update(getattr(mod, hooks))
    if hasattr(mod, "input_activation_post_process"):
        out.input_activation_post_process = mod.input_activation_post_process
    return out


def _quantize_observed_weights(model: nn.Module, weight_dtype: str) -> None:
    """In a prepared (PTQ) model, give each observed Linear/Conv the int8 weight ``convert`` would build.

    The weight is observed with ``qconfig.weight()`` and quantized per channel; a parametrization
    makes ``layer.weight`` that constant (so the ONNX file holds codes + DQ, not float weights).
    """
    inside_float = {id(m) for f in model.modules() if isinstance(f, FloatLayerTwin) for m in f.modules()}
    for path, mod in list(model.named_modules()):
        if id(mod) in inside_float or \
                not isinstance(getattr(mod, "activation_post_process", None), (ObserverBase, FakeQuantize)):
            continue
        core = mod[0] if isinstance(mod, nn.Sequential) and len(mod) else mod
        if not isinstance(core, (nn.Linear, nn.modules.conv._ConvNd)) or hasattr(core, "weight_fake_quant"):
            continue
        axis = 1 if isinstance(core, nn.modules.conv._ConvTransposeNd) else 0
        owner = mod if getattr(mod, "qconfig", None) is not None else core
        if getattr(owner, "qconfig", None) is None:
            continue
        q = quantize_weight(core.weight, weight_qparams(core.weight, owner, axis, f"to_onnx '{path}'"), axis)
        dq = weight_dq(q.int_repr(), q.scale, q.zero_point, axis, weight_dtype)
        parametrize.register_parametrization(core, "weight", ConstWeight(dq), unsafe=True)


class FloatLayerTwin(nn.Module):
    """A float layer left in an int8 model: ``y = module(x̂)``, then Q/DQ onto ``grid`` (None: float output).

    Stands in for ``quantize_ptq(max_float_layers=...)``'s float twins (``debug.mixed_precision``) and
    ``keep_faster``'s ``FloatFallback``. While input grids are recorded (``recording``) it returns the
    ``QTensor`` the original returns, so the int8 layer reading it sees that grid; in the file the float
    op's output gets QuantizeLinear -> DequantizeLinear on the same grid.
    """

    def __init__(self, module: nn.Module, grid: Grid | None, path: str) -> None:
        super().__init__()
        for sub in module.modules():  # a prepared float module: its observers return their input unchanged
            if isinstance(getattr(sub, "weight_fake_quant", None), FakeQuantize) or any(
                    isinstance(c, FakeQuantize) for c in sub.children()):
                raise TypeError(f"to_onnx: float layer '{path}' holds a FakeQuantize ({type(sub).__name__}); "
                                "a layer kept float must be a float module (give it the float module)")
            for name, c in list(sub.named_children()):
                if isinstance(c, ObserverBase):
                    setattr(sub, name, nn.Identity())
            cls = type(sub)
            if cls.__module__.startswith("lowbit.nn.quantized"):
                raise TypeError(f"to_onnx: float layer '{path}' holds a quantized {cls.__qualname__}; a layer kept "
                                "float must be a float module")
        self.module, self.grid, self.recording = module, grid, True
        self.out_qdq: nn.Module = nn.Identity() if grid is None else QDQ(*grid)

    def forward(self, x: Any) -> Any:
        y = self.module(x.dequantize() if isinstance(x, QTensor) else x)
        if self.grid is not None and self.recording:
            return quantize_per_tensor(y, *self.grid)
        return self.out_qdq(y)


def _float_layer(mod: nn.Module, path: str) -> nn.Module | None:
    """``FloatLayerTwin`` of a float layer kept in an int8 model (``FloatLayerTwin`` itself: left alone)."""
    if isinstance(mod, FloatLayerTwin):
        return mod
    if isinstance(mod, FloatFallback):
        return FloatLayerTwin(mod.module, mod.out, path)
    mp = sys.modules.get("lowbit.debug.mixed_precision")  # no import: no instance exists unless it is loaded
    if mp is not None and isinstance(mod, mp._FloatTwin):
        return FloatLayerTwin(mod.float_mod, mod.grid if mod.keep else None, path)
    return None


def _quantized_twin(mod: nn.Module, path: str, grids: dict[Any, Any], weight_dtype: str,
                    exact: bool = False, qdq: list[str] | None = None) -> nn.Module | None:
    """Twin of a converted lowbit module, or None for modules that stay as they are (``exact``: integer Conv / Linear
    forms with lowbit's own requantization, ``lowbit.export.exact``; ``qdq`` collects the layers that stay QDQ)."""
    m: Any = mod
    grid = grids.get(id(mod), getattr(mod, "input_grid", None))
    qdq = [] if qdq is None else qdq

    def weighted(mod: Any, kind: str, grid: Any, weight_dtype: str) -> nn.Module:
        why = qdq_reason(mod, kind, grid) if exact else None
        if why is not None:
            qdq.append(f"'{path}' ({type(mod).__name__}: {why})")
        return (exact_twin if exact else WeightedTwin)(mod, kind, grid, weight_dtype)
    if isinstance(mod, Quantize):
        return (ExactQDQ if exact else QDQ)(float(m.scale), int(m.zero_point), m.qdtype)
    if isinstance(mod, DeQuantize):
        return nn.Identity()
    if isinstance(mod, Linear):
        return weighted(mod, "linear", grid, weight_dtype)
    if isinstance(mod, _CONV):
        return weighted(mod, "conv", grid, weight_dtype)
    if isinstance(mod, _CONV_T):
        return weighted(mod, "conv_transpose", grid, weight_dtype)
    if isinstance(mod, QFunctional):
        ft = (ExactFunctionalTwin if exact else FunctionalTwin)(
            mod, {op: grids[(id(mod), op)] for op in QF_METHODS if (id(mod), op) in grids})
        qdq += [f"'{path}' (QFunctional.{op}: a float or per-channel input)" for op in getattr(ft, "qdq_ops", list)()]
        return ft
    if isinstance(mod, _LUT):
        return ActivationTwin(m._f, (float(m.scale), int(m.zero_point), m.qdtype))
    if isinstance(mod, ReLU6):
        return ActivationTwin(F.relu6, grids.get(id(mod), _RELU6_FLOAT_GRID))
    if isinstance(mod, _QBN):  # (BNReLU2d/3d too)
        if exact and isinstance(grid, tuple):  # (not None: a float input; not _MIXED: call sites on other grids)
            return ExactBatchNormTwin(mod, grid)
        if exact:
            qdq.append(f"'{path}' ({type(mod).__name__}: " + ("a float input)" if grid is None else
                                                              "its call sites see different input grids)"))
        return ActivationTwin(_float_batchnorm(mod), (float(m.scale), int(m.zero_point), m.qdtype))
    if isinstance(mod, Embedding):
        return EmbeddingTwin(mod) if m.qdtype.bits == 8 else EmbeddingTableTwin(mod)
    if isinstance(mod, EmbeddingBag):
        return EmbeddingBagTwin(mod)
    if isinstance(mod, WeightOnlyLinear):
        return WeightOnlyTwin(mod)
    try:
        twin = dynamic_twin(mod, weight_dtype)
    except ValueError as e:  # (a recipe without a twin: name the layer, as the other refusals do)
        raise ValueError(f"{e} [module '{path}']") from None
    if twin is not None:
        return twin
    cls = type(mod)
    if cls.__module__.startswith("lowbit.llm"):  # W8A8's DynamicInt8Linear (torch's _int_mm), a tied int head's table
        raise TypeError(f"to_onnx: module '{path}' of type {cls.__module__}.{cls.__qualname__} has no ONNX export "
                        "(quantize_llm(head=None) keeps a tied head float; W8A8 models run in PyTorch)")
    if cls.__module__.startswith("lowbit.nn.quantized") and not isinstance(mod, FloatFunctional):
        raise TypeError(f"to_onnx: module '{path}' of type {cls.__module__}.{cls.__qualname__} has no ONNX QDQ "
                        "export (supported: Quantize, DeQuantize, Linear, Conv/ConvTranspose 1-3d (+ReLU), "
                        "BatchNorm2d/3d (+ReLU), QFunctional, quantized activations, 8/4-bit Embedding and EmbeddingBag, "
                        "dynamic Linear/RNN/LSTM/GRU and their cells, WeightOnlyLinear, "
                        "FakeQuantize, observers)")
    return None


def _float_batchnorm(mod: Any) -> nn.Module:
    """The float eval ``BatchNorm2d/3d`` (+ ``ReLU``) of a quantized one: ONNX BatchNormalization (+ Relu) between QDQ nodes."""
    bn = mod._float_type(mod.num_features, mod.eps).eval()
    with torch.no_grad():
        bn.running_mean.copy_(mod.running_mean)
        bn.running_var.copy_(mod.running_var)
        bn.weight.copy_(torch.ones(mod.num_features) if mod.weight is None else mod.weight)
        bn.bias.copy_(torch.zeros(mod.num_features) if mod.bias is None else mod.bias)
    return nn.Sequential(bn, nn.ReLU()) if mod._relu else bn


def _swap(parent: nn.Module, prefix: str, make: Any) -> None:
    """Replace every descendant ``c`` of ``parent`` for which ``make(c, path, name)`` gives a module."""
    for name, child in list(parent.named_children()):
        path = f"{prefix}.{name}" if prefix else name
        twin = make(child, path, name)
        if twin is not None:
            setattr(parent, name, twin)
        else:
            _swap(child, path, make)




def _grid_of(x: Any) -> Grid | None:
    return (float(x.scale), int(x.zero_point), x.qdtype) if isinstance(x, QTensor) and x.axis is None else None


def _record_input_grids(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[Any, Any]:
    """Run ``model`` once and note the grid of each quantized layer's inputs.

    Keys: ``id(layer)`` -> its input grid (``None``: float input quantized per call);
    ``(id(qfunctional), method)`` -> one grid (or ``None`` for float) per tensor input; ``"bilinear"`` -> the output
    grid of each ``F.interpolate`` call in run order (``None``: not a bilinear resample of a QTensor; ``codes.py``).
    """
    grids: dict[Any, Any] = {}
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

    def note(key: Any, mod: nn.Module, grid: Any) -> None:
        if key in grids and grids[key] != grid and isinstance(mod, _QBN):  # (only exact=True reads it)
            grid = _MIXED
        elif key in grids and grids[key] != grid:
            raise ValueError(f"to_onnx: '{names[id(mod)]}' ({type(mod).__name__}) is called on inputs with different "
                             f"grids ({grids[key]} and {grid}); give each call site its own module")
        grids[key] = grid

    def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, QTensor) and x.axis is not None:
            raise ValueError(f"to_onnx: '{names[id(mod)]}' receives a per-channel QTensor; ONNX QDQ needs "
                             "per-tensor activations")
        grid = _grid_of(x) if isinstance(x, QTensor) else (
            _RELU6_FLOAT_GRID if isinstance(mod, ReLU6) else getattr(mod, "input_grid", None))
        note(id(mod), mod, grid)

    def spy(mod: nn.Module, op: str) -> None:
        method = getattr(mod, op)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            xs = list(args[0]) if op == "cat" else args[:1] if op.endswith("_scalar") else args[:2]
            note((id(mod), op), mod, [_grid_of(x) for x in xs])
            return method(*args, **kwargs)

        setattr(mod, op, wrapped)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, _NEEDS_INPUT_GRID)]
    spied = [m for m in model.modules() if isinstance(m, QFunctional)]
    for m in spied:
        for op in QF_METHODS:
            spy(m, op)
    try:
        with torch.no_grad(), ResampleOnCodes() as resample:
            model(*inputs)
        grids["on_codes"] = resample.records
    finally:
        for h in handles:
            h.remove()
        for m in spied:
            for op in QF_METHODS:
                delattr(m, op)
    return grids


def _refuse_reference(model: nn.Module) -> None:
    """A reference model (``convert_to_reference_fx`` / ``convert(is_reference=True)``) simulates int8 in float with
    torch's quantized tensors, which TorchScript's ONNX exporter cannot write (``aten::int_repr``, deep in its trace):
    name the module and the step that makes it exportable."""
    for name, m in model.named_modules():
        if isinstance(m, (ref_modules._WeightQDQ, ref_modules.QuantDeQuant)):
            raise TypeError(f"to_onnx: module '{name or '<root>'}' ({type(m).__name__}) is part of a reference model; "
                            "lower it first (lowbit.lower_reference(model)) and export the int8 model")
        graph = getattr(m, "graph", None)
        for node in getattr(graph, "nodes", ()):
            if node.op == "call_function" and getattr(node.target, "__module__", None) == ref_ops.__name__:
                raise TypeError(f"to_onnx: graph '{name or '<root>'}' calls the reference op {node.target.__name__} "
                                f"(node '{node.name}'): it is a reference model; lower it first "
                                "(lowbit.lower_reference(model)) and export the int8 model")


def build_twin(model: nn.Module, example_inputs: Any, weight_dtype: str = "auto", exact: bool = False) -> nn.Module:
    """The float QDQ twin of ``model`` (a copy in eval mode; ``model`` is not changed); ``exact``: see ``to_onnx``."""
    inputs = tuple(t.cpu() for t in _check_inputs(example_inputs))
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"to_onnx: weight_dtype={weight_dtype!r} must be one of {WEIGHT_DTYPES}")
    if not isinstance(exact, bool):
        raise TypeError(f"to_onnx: exact={exact!r} must be True or False")
    _refuse_reference(model)
    twin = copy.deepcopy(model).cpu().eval()  # an ONNX file is device-agnostic: trace on CPU, in inference mode
    holder = nn.Module()  # so that the root itself can be swapped
    holder.root = twin

    def rel(p: str) -> str:
        return p[len("root."):] if p != "root" else "<root>"

    _swap(holder, "", lambda m, p, n: _float_layer(m, rel(p)))  # first: later passes leave float layers alone
    _swap(holder, "", lambda m, p, n: m if isinstance(m, FloatLayerTwin) else _bn_folded(m))
    _quantize_observed_weights(holder.root, weight_dtype)
    _swap(holder, "", lambda m, p, n: m if isinstance(m, FloatLayerTwin) else activation_twin(m, rel(p), n,
                                                                                               weight_dtype))
    share_grid_bilinear(holder.root)  # prepared / QAT graphs: a shared-grid bilinear upsample on the codes (codes.py)
    grids = _record_input_grids(holder.root, inputs)
    for m in holder.root.modules():
        if isinstance(m, FloatLayerTwin):
            m.recording = False
    qdq: list[str] = []
    _swap(holder, "", lambda m, p, n: m if isinstance(m, FloatLayerTwin) else _quantized_twin(m, rel(p), grids,
                                                                                              weight_dtype, exact, qdq))
    if qdq:  # one warning per export, naming every layer exact=True could not write as lowbit computes it
        warnings.warn(f"to_onnx(exact=True): {len(qdq)} quantized layer(s) stay QDQ, where ONNX Runtime may round "
                      f"codes differently from lowbit: {'; '.join(qdq)}", stacklevel=2)
    if any(r is not None for rs in grids["on_codes"].values() for r in rs):  # bilinear, averages of QTensors:
        install(holder.root, grids["on_codes"])                                # on the codes (codes.py)
    return holder.root
