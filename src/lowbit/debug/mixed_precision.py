"""Automatic mixed precision: keep the fewest layers float that bring the model within a budget.

``auto_mixed_precision(model, qconfig_mapping, calib, eval_fn, tolerance=..., max_float_layers=...)``
builds on ``sensitivity``: it ranks the layers by the metric drop each causes when quantized alone
(worst first), quantizes everything, and then walks the ranking greedily::

    metric = eval_fn(all quantized)
    for L in ranking (worst first), while baseline - metric > tolerance and len(float) < max_float_layers:
        m = eval_fn(quantized with float ∪ {L} kept float)
        if m > metric: float ∪= {L}, metric = m            # a layer that does not help stays int8

so every layer kept float pays for itself. ``tolerance`` (``>= 0``) is the largest acceptable drop
``baseline - metric`` (``eval_fn``: higher is better); ``max_float_layers`` caps the float layers;
give either or both. ``mode="eager"`` (``prepare``/``convert``, optional ``fuse`` groups) or ``"fx"``
(``prepare_fx``/``convert_fx`` with ``example_inputs``). Costs ``L + 1`` quantizations for the
ranking plus one per greedy step (``search="exact"``, the default).

``search="fast"`` quantizes **once** and then swaps layers of that one converted model back to float
(no new calibration): the ranking is one evaluation per layer with *only that layer float*
(``metric_L``, best first: the layer whose float twin helps most), the greedy walk keeps a layer float
if that improves the metric and stops at the budget or at the first layer whose own gain
``metric_L - metric_all`` is not positive. ``L + 1`` evaluations plus a few, one calibration. A layer
kept float computes in float from its dequantized input; its output goes back onto the layer's
calibrated output grid when the quantized layer had one (the grid its int8 consumers read), and stays
float while every reader of it (through zero pads, flatten, ...) is a layer kept float too, so the search
sees what ``prepare`` with ``set_module_name(L, None)`` then does, up to that rounding (eager mode, with no graph
to read: a layer whose output the model returns as it is, a classifier head, outputs float). The ranking sorts
by ``metric_L`` itself (an SQNR-vs-float metric scores the float model ``inf``: every drop is ``inf``). A layer
alone in its own graph (an untraceable parent's child) is swapped for the float module itself.
``finalize(qmodel)`` (e.g. ``lowbit.fuse_dequantize``) runs on every converted model before it is
scored, in either search; use it again on the model built from the returned mapping.

>>> import torch, lowbit as Q
>>> from lowbit.debug import auto_mixed_precision
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
>>> x = torch.randn(128, 8)
>>> x[0, 0] = 200.0                                       # one outlier input: layer 0's input grid suffers
>>> ref = model(x).detach()
>>> score = lambda m: -float(((m(x) - ref) ** 2).mean())  # higher is better
>>> mapping, table = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=1,
...                                       mode="fx", progress=False)
>>> table.float_layers, table.final_metric > 2 * table.all_quantized_metric
(['0'], True)
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from ..qconfig import QConfigMapping
from ..nn.quantized.stubs import Quantize
from ..qtensor import QTensor
from ..speed_guard import requant_grid, run_in_own_dtype
from ..workflow.propagate import join_name
from .checks import check_float_model
from .compare import check_module, iter_batches
from .sensitivity import (
    SensitivityRow,
    SensitivityTable,
    _dequantize_output,
    _fused,
    _quantize,
    _quiet_float_fallback,
    _score,
    check_calib,
    example_inputs_of,
    metric_drop,
    sensitivity,
    warn_if_lower_is_better,
)

__all__ = ["auto_mixed_precision"]

_MODES = ("eager", "fx")
_SEARCHES = ("exact", "fast")


def auto_mixed_precision(model: nn.Module, qconfig_mapping: Any, calib: Any, eval_fn: Callable[[nn.Module], Any],
                         *, tolerance: float | None = None, max_float_layers: int | None = None,
                         mode: str = "eager", example_inputs: tuple[Any, ...] | None = None,
                         fuse: Any = None, progress: bool = True, search: str = "exact",
                         finalize: Callable[[nn.Module], Any] | None = None) -> tuple[QConfigMapping, SensitivityTable]:
    """Quantize ``model`` keeping float the fewest layers that meet ``tolerance`` / ``max_float_layers``.

    Returns ``(mapping, table)``: ``mapping`` is the user's mapping plus ``set_module_name(L, None)``
    for every layer kept float (use it with ``prepare`` or ``prepare_fx`` as ``mode`` says); ``table``
    is ``sensitivity``'s ranking (worst first) with ``float_layers``, ``final_metric`` and, when given,
    ``tolerance``. ``model`` is not modified.
    """
    check_float_model(check_module(model, "auto_mixed_precision: model"), "auto_mixed_precision")
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"auto_mixed_precision: mode={mode!r} must be 'eager' or 'fx'")
    if tolerance is None and max_float_layers is None:
        raise ValueError("auto_mixed_precision: give a budget: tolerance (largest acceptable metric drop) "
                         "and/or max_float_layers")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                                  or not 0 <= tolerance < math.inf):
        raise ValueError(f"auto_mixed_precision: tolerance={tolerance!r} must be a finite number >= 0")
    if max_float_layers is not None and (isinstance(max_float_layers, bool) or not isinstance(max_float_layers, int)
                                         or max_float_layers < 0):
        raise ValueError(f"auto_mixed_precision: max_float_layers={max_float_layers!r} must be an int >= 0")
    if not isinstance(search, str) or search not in _SEARCHES:
        raise ValueError(f"auto_mixed_precision: search={search!r} must be 'exact' or 'fast'")
    if finalize is not None and not callable(finalize):
        raise TypeError(f"auto_mixed_precision: finalize={finalize!r} must be callable (converted model -> None)")
    if not callable(eval_fn):
        raise TypeError(f"auto_mixed_precision: eval_fn={eval_fn!r} must be callable (model -> score, higher is better)")
    method = "fx" if mode == "fx" else "ptq"
    batches = list(iter_batches(calib, "auto_mixed_precision: calib"))
    check_calib(batches, "auto_mixed_precision")
    if mode == "fx" and example_inputs is None:
        example_inputs = example_inputs_of(batches[0], "auto_mixed_precision")
    if search == "fast":
        return _fast(model, qconfig_mapping, batches, eval_fn, tolerance, max_float_layers, method, example_inputs,
                     fuse, progress, finalize)
    mapping, table = sensitivity(model, qconfig_mapping, batches, eval_fn, fuse=fuse, method=method,
                                 example_inputs=example_inputs, progress=progress, who="auto_mixed_precision")
    table.tolerance = tolerance
    base = _fused(model, fuse, method)
    budget = len(table.rows) if max_float_layers is None else max_float_layers
    limit = -math.inf if tolerance is None else tolerance  # no tolerance: only the layer budget stops

    def measure(m: QConfigMapping, what: str) -> float:
        qmodel = _quantize(base, m, batches, method, None, example_inputs)
        if finalize is not None:
            finalize(qmodel)
        return _score(eval_fn, qmodel, what, "auto_mixed_precision")

    with _quiet_float_fallback(), torch.no_grad():
        metric = measure(mapping, "the fully quantized model")
        table.all_quantized_metric = metric
        steps = tqdm(table.rows, desc="auto_mixed_precision", disable=not progress, leave=False)
        for row in steps:
            if metric_drop(table.baseline, metric) <= limit or len(table.float_layers) >= budget:
                break
            trial = copy.deepcopy(mapping).set_module_name(row.name, None)
            m = measure(trial, f"the model with {[*table.float_layers, row.name]} float")
            if m > metric:
                mapping, metric = trial, m
                table.float_layers.append(row.name)
    table.final_metric = metric
    return mapping, table


# ---------------------------------------------------------------- search="fast"


class _FloatTwin(nn.Module):
    """A quantized layer's float form: float compute on its (dequantized) input, back on the layer's output
    grid when it had one that int8 consumers read (``grid`` None: float output). ``keep`` is cleared while
    every reader of the output is itself kept float (``_regrid``): the model built from the mapping does
    not round between two float layers.

    The output grid is a ``Quantize`` child (``requant``: scale and zero point are buffers), so it travels in
    ``state_dict`` like every int8 layer's grid (a Python tuple stayed behind: a loaded checkpoint kept the
    fresh model's grid). The float layer runs in its own parameters' dtype (a model moved with ``.double()`` /
    ``.half()``) and gives back its input's dtype, as the int8 layers around it keep float32."""

    def __init__(self, float_mod: nn.Module, qmod: nn.Module, float_out: bool) -> None:
        super().__init__()
        self.float_mod = float_mod
        qdtype = getattr(qmod, "out_qdtype", None)
        float_out = float_out or type(qmod).__name__.endswith("FloatOut")
        self.add_module("requant", None if float_out or qdtype is None
                        else Quantize(float(qmod.scale), int(qmod.zero_point), qdtype))
        self.keep = True

    @property
    def grid(self) -> tuple[float, int, Any] | None:
        """The output grid ``(scale, zero_point, qdtype)``, or None (float output)."""
        return requant_grid(self.requant)

    def forward(self, x: Any) -> Any:
        y = run_in_own_dtype(self.float_mod, x.dequantize() if isinstance(x, QTensor) else x)
        return y if self.requant is None or not self.keep else self.requant(y)


def _set(root: nn.Module, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, mod)


def _node_of(qmodel: nn.Module, path: str) -> tuple[str, fx.GraphModule, fx.Node] | None:
    """The innermost graph holding the call of module ``path``, and that node."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        gpath = ".".join(parts[:i])
        gm = qmodel.get_submodule(gpath) if gpath else qmodel
        if isinstance(gm, fx.GraphModule):
            rel = ".".join(parts[i:])
            for node in gm.graph.nodes:
                if node.op == "call_module" and node.target == rel:
                    return gpath, gm, node
            return None
    return None


def _readers(gm: fx.GraphModule, gpath: str, node: fx.Node) -> tuple[set[str], bool]:
    """The modules (paths) that read ``node``'s value through grid-sharing ops (zero pads, flatten, ...), and
    whether anything else reads it (``x.shape`` reads do not count)."""
    from ..fx.patterns import is_share_op
    from ..nn.quantized.stubs import DeQuantize, Quantize

    mods, other, todo, seen = set(), False, list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        mod = gm.get_submodule(str(u.target)) if u.op == "call_module" else None
        if (u.op == "call_function" and (u.target is len or (u.target is getattr and u.args[1] in ("shape", "device")))) \
                or (u.op == "call_method" and u.target in ("size", "dim", "numel")):
            continue
        if mod is not None and not isinstance(mod, (Quantize, DeQuantize)) and callable(getattr(mod, "weight", None)):
            mods.add(join_name(gpath, str(u.target)))
        elif u.op != "output" and not isinstance(mod, (Quantize, DeQuantize)) and is_share_op(u, mod):
            todo.extend(u.users)
        else:
            other = True
    return mods, other


def _returned_layers(qmodel: nn.Module, batch: Any) -> set[str]:
    """Eager mode (no graph to read): the quantized layers whose output the model returns as it is (a classifier
    head). Kept float, such a layer gives a float model output, as the model built from the mapping does; its
    twin requantized it onto the int8 layer's output grid, so the search never saw the gain."""
    from ..batches import output_tensors, run_batch

    seen: dict[int, Any] = {}
    handles = [mod.register_forward_hook(lambda _m, _i, out, p=path: seen.__setitem__(id(out), p))
               for path, mod in qmodel.named_modules()
               if type(mod).__module__.startswith("lowbit.nn.quantized") and callable(getattr(mod, "weight", None))]
    handles.append(qmodel.register_forward_hook(  # before _dequantize_output makes new tensors
        lambda _m, _i, out: seen.__setitem__(-1, {seen[id(o)] for o in output_tensors(out) if id(o) in seen}),
        prepend=True))
    try:
        run_batch(qmodel, batch)
    finally:
        for h in handles:
            h.remove()
    return seen.get(-1, set())


def _swaps(base: nn.Module, prepared: nn.Module, qmodel: nn.Module, returned: set[str] | None = None
           ) -> tuple[dict[str, list[tuple[str, nn.Module]]], dict[str, tuple[_FloatTwin, set[str]]]]:
    """``{layer name: [(path in qmodel, float replacement), ...]}`` for every quantized weighted layer, and
    ``{layer name: (its float twin, the layers that alone read its output)}`` for ``_regrid``."""
    from ..nn.quantized.stubs import DeQuantize, Quantize

    out: dict[str, list[tuple[str, nn.Module]]] = {}
    readers: dict[str, tuple[_FloatTwin, set[str], bool]] = {}
    base_mods = dict(base.named_modules())
    prep_mods = dict(prepared.named_modules())
    for path, qmod in qmodel.named_modules():
        if not type(qmod).__module__.startswith("lowbit.nn.quantized") or not callable(getattr(qmod, "weight", None)):
            continue
        if ".dynamic" in type(qmod).__module__ or path not in prep_mods:
            continue
        parent, _, last = path.rpartition(".")
        if last == "module" and parent in base_mods and type(base_mods[parent]) is type(prep_mods[path]):
            out[parent] = [(parent, copy.deepcopy(base_mods[parent]))]  # a one-layer graph: the float module
            continue
        found = _node_of(qmodel, path)
        swaps: list[tuple[str, nn.Module]] = []
        float_out = path in (returned or ())
        mods: set[str] = set()
        other = True
        if found is not None:  # the layer's own input Quantize goes too: a float layer reads float
            gpath, gm, node = found
            arg = node.args[0] if node.args else None
            if isinstance(arg, fx.Node) and arg.op == "call_module" and len(arg.users) == 1 and \
                    isinstance(gm.get_submodule(arg.target), Quantize):
                swaps.append((join_name(gpath, str(arg.target)), nn.Identity()))
            float_out = bool(node.users) and all(
                u.op == "call_module" and isinstance(gm.get_submodule(u.target), DeQuantize) for u in node.users)
            mods, other = _readers(gm, gpath, node)
        twin = _FloatTwin(copy.deepcopy(prep_mods[path]), qmod, float_out)
        swaps.append((path, twin))
        out[path] = swaps
        readers[path] = (twin, mods, other)
    # a twin may drop its grid only when every reader is a layer that has a float twin too
    twins = {name: (twin, mods) for name, (twin, mods, other) in readers.items()
             if not other and mods and all(m in readers for m in mods)}
    return out, twins


def _regrid(twins: dict[str, tuple[_FloatTwin, set[str]]], floats: set[str]) -> None:
    """A float layer whose every reader is float too outputs float (no rounding between float layers)."""
    for name, (twin, mods) in twins.items():
        twin.keep = not (name in floats and mods <= floats)


def _apply(qmodel: nn.Module, swaps: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Put the replacements in; return what to put back."""
    undo = [(path, qmodel.get_submodule(path)) for path, _ in swaps]
    for path, mod in swaps:
        _set(qmodel, path, mod)
    return undo


def _fast(model: nn.Module, qconfig_mapping: Any, batches: list[Any], eval_fn: Callable[[nn.Module], Any],
          tolerance: float | None, max_float_layers: int | None, method: str,
          example_inputs: tuple[Any, ...] | None, fuse: Any, progress: bool,
          finalize: Callable[[nn.Module], Any] | None) -> tuple[QConfigMapping, SensitivityTable]:
    from ..fx import convert_fx, prepare_fx
    from ..workflow import convert, prepare
    from .compare import run_batch

    mapping = copy.deepcopy(QConfigMapping.from_qconfig(qconfig_mapping, None))
    base = _fused(model, fuse, method)
    with _quiet_float_fallback(), torch.no_grad():
        baseline = _score(eval_fn, copy.deepcopy(base).eval(), "the float model", "auto_mixed_precision")
        if method == "fx":
            import warnings
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*cannot be traced")
                prepared = prepare_fx(copy.deepcopy(base), mapping, example_inputs=example_inputs)
        else:
            prepared = prepare(base, mapping)
        for b in tqdm(batches, desc="auto_mixed_precision: calibrate", disable=not progress, leave=False):
            run_batch(prepared, b)
        qmodel = convert_fx(copy.deepcopy(prepared)) if method == "fx" else convert(copy.deepcopy(prepared))
        qmodel.register_forward_hook(_dequantize_output)
        if finalize is not None:
            finalize(qmodel)
        returned = _returned_layers(qmodel, batches[0]) if method != "fx" else None
        swaps, twins = _swaps(base, prepared, qmodel, returned)
        if not swaps:
            raise ValueError("auto_mixed_precision: the quantized model has no int8 weighted layer to keep float")
        table = _search(qmodel, swaps, twins, eval_fn, baseline, tolerance, max_float_layers, progress, "auto_mixed_precision")
        for name in table.float_layers:
            mapping.set_module_name(name, None)
    return mapping, table


def _search(qmodel: nn.Module, swaps: dict[str, list[tuple[str, nn.Module]]],
            twins: dict[str, tuple[_FloatTwin, set[str]]], eval_fn: Callable[[nn.Module], Any], baseline: float,
            tolerance: float | None, max_float_layers: int | None, progress: bool, who: str) -> SensitivityTable:
    """Rank (one layer float each) and walk greedily; ``qmodel`` is left with the chosen layers swapped in."""
    table = SensitivityTable(baseline, tolerance=tolerance, view="float")
    metric = table.all_quantized_metric = _score(eval_fn, qmodel, "the fully quantized model", who)
    rows = []
    for name, sw in tqdm(swaps.items(), desc=f"{who}: rank (one layer float)", disable=not progress, leave=False):
        undo = _apply(qmodel, sw)
        m = _score(eval_fn, qmodel, f"the model with '{name}' float", who)
        _apply(qmodel, undo)
        rows.append(SensitivityRow(name, type(undo[-1][1]).__name__, m, metric_drop(baseline, m)))
    rows.sort(key=lambda r: -r.metric)  # not by drop: an infinite baseline (SQNR vs float) makes every drop inf
    warn_if_lower_is_better(baseline, [metric, *(r.metric for r in rows)], who)
    table.rows = rows
    budget = len(rows) if max_float_layers is None else max_float_layers
    limit = -math.inf if tolerance is None else tolerance
    for row in tqdm(rows, desc=f"{who}: greedy", disable=not progress, leave=False):
        if (metric_drop(baseline, metric) <= limit or len(table.float_layers) >= budget
                or row.metric <= table.all_quantized_metric):
            break
        undo = _apply(qmodel, swaps[row.name])
        _regrid(twins, {*table.float_layers, row.name})
        m = _score(eval_fn, qmodel, f"the model with {[*table.float_layers, row.name]} float", who)
        if m > metric:
            metric = m
            table.float_layers.append(row.name)
        else:
            _apply(qmodel, undo)
            _regrid(twins, set(table.float_layers))
    table.final_metric = metric
    return table


def keep_float_layers(float_model: nn.Module, prepared: nn.Module, qmodel: nn.Module,
                      eval_fn: Callable[[nn.Module], Any], max_float_layers: int, *, progress: bool = True,
                      who: str = "keep_float_layers") -> SensitivityTable:
    """Swap up to ``max_float_layers`` int8 layers of the converted ``qmodel`` back to float, in place, picked as
    ``search="fast"`` picks them (ranked by ``eval_fn`` with only that layer float, then greedily while the
    metric improves). ``prepared`` is the calibrated model ``qmodel`` came from (its modules give the float
    twins), ``float_model`` the float original. Every other layer stays on the int8 kernels.
    """
    with _quiet_float_fallback(), torch.no_grad():
        baseline = _score(eval_fn, float_model, "the float model", who)
        swaps, twins = _swaps(float_model, prepared, qmodel)
        if not swaps:
            return SensitivityTable(baseline, view="float")
        return _search(qmodel, swaps, twins, eval_fn, baseline, None, max_float_layers, progress, who)
