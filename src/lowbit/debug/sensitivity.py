"""Layer-wise sensitivity: which layers cost the accuracy, and which to keep in float.

``sensitivity(model, qconfig_mapping, calib, eval_fn)`` measures ``baseline = eval_fn(float model)``
and, for every layer ``L`` the mapping would quantize, quantizes ``L`` **alone** (a mapping whose
only setting is ``set_module_name(L, qconfig_L)``; the rest, stubs included, stays float), calibrates
on ``calib``, converts and records ``drop_L = baseline - eval_fn(model_L)``. ``eval_fn`` scores a
model, **higher is better** (accuracy; pass ``lambda m: -loss(m)`` for a loss). Rows come worst first.

With ``tolerance`` it then quantizes everything (the user's mapping) and, while
``baseline - metric > tolerance``, sets the worst remaining layer to ``None`` (kept float) and
re-quantizes, so the returned mapping is the user's plus those exclusions.

``method`` picks the recipe each candidate goes through: ``"ptq"`` (default: ``prepare``, calibrate
on ``calib``, ``convert``), ``"qat"`` (``prepare_qat``, observers warmed on ``calib`` in eval mode
if it is given, then ``train_fn(prepared)`` fine-tunes in place, then ``convert``; the default
mapping is ``get_default_qat_qconfig_mapping()``, ``fuse`` groups go through ``fuse_modules_qat``)
or ``"dynamic"`` (``quantize_dynamic`` of the layers the mapping targets — Linear, RNN/LSTM/GRU and their cells —
with the per-layer qconfigs; default ``get_dynamic_qconfig()``; ``calib`` may be ``None``), or ``"fx"``
(graph mode: ``prepare_fx`` with ``example_inputs`` — default: the first calibration batch —, calibrate,
``convert_fx``; layers are the original model's module names, BN folding is automatic, ``fuse`` must be
``None``).

Models without ``QuantStub`` work: a quantized layer quantizes its float input on the grid observed
during calibration, and a float layer given a ``QTensor`` runs on its dequantized values (the
warning that says so is silenced here). ``eval_fn`` always sees float outputs (a ``QTensor``
returned by the model is dequantized). ``.qconfig`` attributes on ``model`` are ignored: pass
everything through ``qconfig_mapping``. ``fuse``: a list of ``fuse_modules`` groups, or a callable
``model -> fused model``; layer names are then the fused model's.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
>>> x = torch.randn(64, 8)
>>> ref = model(x).detach()
>>> score = lambda m: -float(((m(x) - ref) ** 2).mean())
>>> mapping, table = sensitivity(model, Q.get_minmax_qconfig(), x, score)
>>> sorted(r.name for r in table.rows), table.baseline == 0.0, all(r.drop > 0 for r in table.rows)
(['0', '2'], True, True)
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..fuse import fuse_modules, fuse_modules_qat
from ..fx import convert_fx, prepare_fx
from ..mappings import (
    get_default_dynamic_quant_module_mappings,
    get_default_qat_module_mappings,
    get_default_static_quant_module_mappings,
)
from ..qconfig import QConfig, QConfigMapping, get_default_qat_qconfig_mapping, get_dynamic_qconfig
from ..quantize_dynamic import quantize_dynamic
from ..stubs import DeQuantStub, QuantStub
from ..workflow import convert, prepare, prepare_qat, propagate_qconfig_
from .. import qtensor as _qtensor
from ..batches import check_finite_batch, first_failing
from ..qtensor import QTensor
from .checks import check_calib, check_float_model, example_inputs_of  # noqa: F401 (re-exported)
from .compare import _flatten, check_module, iter_batches, run_batch
from .graph_swap import prepared_ops
from .table import SensitivityRow, SensitivityTable, by_drop, keep_float, metric_drop

__all__ = ["SensitivityRow", "SensitivityTable", "layer_sensitivity", "sensitivity"]


# ---------------------------------------------------------------- helpers


@contextmanager
def _quiet_float_fallback() -> Iterator[None]:
    """Silence lowbit's "ran on dequantized float values" warnings without using up their warn-once."""
    seen = set(_qtensor._warned_ops)  # read through the module: the set is looked up there at warn time
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"lowbit: .* has no integer implementation")
        try:
            yield
        finally:
            _qtensor._warned_ops.intersection_update(seen)


def _dequantize_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: every ``QTensor`` in the output dequantized, in tuples, lists, namedtuples and dicts (a dict's
    values reached ``eval_fn`` as QTensors, a namedtuple raised inside the hook)."""
    return _dequantized(output)


def _dequantized(out: Any) -> Any:
    if isinstance(out, QTensor):
        return out.dequantize()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple takes its fields as arguments
        return type(out)(*(_dequantized(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_dequantized(o) for o in out)
    if isinstance(out, dict):
        new = copy.copy(out)  # the dict's own type (OrderedDict, a model-output class) with its values replaced
        for k, v in out.items():
            new[k] = _dequantized(v)
        return new
    return out


def _score(eval_fn: Callable[[nn.Module], Any], model: nn.Module, what: str, who: str = "sensitivity") -> float:
    try:
        value = eval_fn(model)
    except Exception as err:  # the user's own error, as raised; the note says which of the many candidates it was
        err.add_note(f"(raised by eval_fn on {what})")
        raise
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(float(value)):
        got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)  # (not its values: one line)
               else repr(value) if len(repr(value)) <= 80 else f"a {type(value).__name__}")
        raise TypeError(f"{who}: eval_fn must return a real number (higher is better), got {got} for {what}")
    return float(value)


def warn_if_lower_is_better(baseline: float, metrics: list[float], who: str) -> None:
    """Warn when every quantized candidate (at least two) scored strictly higher than the float model: the mark of
    a loss passed as ``eval_fn``, which reverses the ranking (the worst layer was ranked last, silently)."""
    if len(metrics) >= 2 and all(m > baseline for m in metrics):
        warnings.warn(f"{who}: every quantized candidate scored higher than the float model (baseline "
                      f"{baseline:.4g}, candidates {min(metrics):.4g} to {max(metrics):.4g}); eval_fn must be higher "
                      "is better: for a loss pass lambda m: -loss(m), else the ranking is reversed", stacklevel=3)


_METHODS = ("ptq", "qat", "dynamic", "fx")


def _quantizable(method: str) -> set[type]:
    if method == "dynamic":
        return set(get_default_dynamic_quant_module_mappings())
    if method == "qat":
        return set(get_default_qat_module_mappings()) | set(get_default_static_quant_module_mappings())
    return set(get_default_static_quant_module_mappings())


def _layers(model: nn.Module, mapping: QConfigMapping, method: str,
            keep_none: bool = False) -> list[tuple[str, str, QConfig | None]]:
    """``(name, type, qconfig)`` of each module ``method`` would quantize (stubs excluded), in order;
    ``keep_none`` also lists the targeted types whose qconfig resolves to ``None``."""
    probe = propagate_qconfig_(copy.deepcopy(model), mapping)
    quantizable = _quantizable(method)
    out: list[tuple[str, str, QConfig | None]] = []

    def walk(mod: nn.Module, name: str) -> None:
        qc = getattr(mod, "qconfig", None)
        if type(mod) in quantizable and (qc is not None or keep_none):
            if not isinstance(mod, (QuantStub, DeQuantStub)):
                out.append((name, type(mod).__name__, qc))
            return
        for cname, child in mod.named_children():
            walk(child, f"{name}.{cname}" if name else cname)

    walk(probe, "")
    return out


def _fx_folded(base: nn.Module, mapping: QConfigMapping, example_inputs: tuple[Any, ...]) -> tuple[set[str], list]:
    """Names of the modules graph mode absorbs into a fused layer (a conv / linear's BN and ReLU, a BN's ReLU:
    ``lowbit_report.absorbed`` of ``prepare_fx`` under the user's mapping): no layer of their own. A standalone BN
    (after a ReLU, a cat, an add) absorbs nothing into anything: it is one (int8 in graph mode since session 38).
    And the int8 ops a call-order key reaches (``graph_swap.prepared_ops``: adds, mul, cat)."""
    with warnings.catch_warnings():  # (the candidates' own prepare_fx warns, once per candidate)
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(base), mapping, example_inputs=example_inputs)
    return {n for names in prepared.lowbit_report.absorbed.values() for n in names}, prepared_ops(prepared)


def _fused(model: nn.Module, fuse: Any, method: str) -> nn.Module:
    """A deep copy without ``.qconfig`` attributes, fused; eval mode (train mode for QAT, BN unfolded)."""
    qat = method == "qat"
    base = copy.deepcopy(model).train(qat)
    for m in base.modules():
        m.__dict__.pop("qconfig", None)
    if fuse is None:
        return base
    if callable(fuse):
        fused = fuse(base)
        if not isinstance(fused, nn.Module):
            raise TypeError(f"sensitivity: fuse(model) must return an nn.Module, got {type(fused).__name__}")
        return fused.train(qat)
    if isinstance(fuse, (list, tuple)):
        return fuse_modules_qat(base, fuse) if qat else fuse_modules(base, fuse)
    raise TypeError(f"sensitivity: fuse={fuse!r} must be None, a list of fuse_modules groups or a callable")


def _dynamic_spec(base: nn.Module, mapping: QConfigMapping) -> dict[str, QConfig | None]:
    """The mapping as a ``quantize_dynamic`` spec: every targeted module by name (``None``: stays float)."""
    return {name: qc for name, _, qc in _layers(base, mapping, "dynamic", keep_none=True)}


def _quantize(base: nn.Module, mapping: QConfigMapping, calib: list[Any], method: str,
              train_fn: Callable[[nn.Module], Any] | None, example_inputs: tuple[Any, ...] | None = None) -> nn.Module:
    """``base`` quantized by ``method`` under ``mapping`` (a new model; ``base`` is not modified)."""
    if method == "fx":
        with warnings.catch_warnings():  # untraceable children are reported by prepare_fx itself
            warnings.filterwarnings("ignore", message=r".*cannot be traced")
            # a candidate's mapping names only its layer: the ReLU it fuses with resolves to None, and prepare_fx
            # warned about the parts' qconfigs on every "only this layer int8" candidate, a mapping the user never wrote
            warnings.filterwarnings("ignore", message=r"fuse: the parts of this .* disagree on \.qconfig")
            warnings.filterwarnings("ignore", message=r"prepare_fx\(\): no quantizable op")  # an add alone: float
            prepared = prepare_fx(copy.deepcopy(base), mapping, example_inputs=example_inputs)
        with torch.no_grad():
            for batch in calib:
                run_batch(prepared, batch)
        qmodel = convert_fx(prepared)
        qmodel.register_forward_hook(_dequantize_output)
        return qmodel
    if method == "dynamic":
        with warnings.catch_warnings():  # a mapping that targets nothing is a legal candidate (all float)
            warnings.filterwarnings("ignore", message=r"quantize_dynamic\(\): no module")
            qmodel = quantize_dynamic(base, _dynamic_spec(base, mapping))
    else:
        prepared = prepare_qat(base, mapping) if method == "qat" else prepare(base, mapping)  # deep copies
        if calib:
            prepared.eval()  # QAT: observers warm up on calib, BN statistics untouched
            with torch.no_grad():
                for batch in calib:
                    run_batch(prepared, batch)
        if method == "qat":
            assert train_fn is not None
            prepared.train()
            with torch.enable_grad():
                train_fn(prepared)
            prepared.eval()
        qmodel = convert(prepared, inplace=True)
    qmodel.register_forward_hook(_dequantize_output)
    return qmodel


# ---------------------------------------------------------------- sensitivity


def sensitivity(model: nn.Module, qconfig_mapping: Any, calib: Any, eval_fn: Callable[[nn.Module], Any],
                tolerance: float | None = None, fuse: Any = None, method: str = "ptq",
                train_fn: Callable[[nn.Module], Any] | None = None,
                example_inputs: tuple[Any, ...] | None = None, *, progress: bool = True,
                who: str = "sensitivity") -> tuple[QConfigMapping, SensitivityTable]:
    """Quantize one layer at a time and rank layers by metric drop; optionally keep the worst ones float.

    ``qconfig_mapping``: a ``QConfigMapping``, a ``QConfig`` (global), a qconfig dict or ``None``
    (the default recipe). ``calib``: a calibration tensor or an iterable of batches (as ``compare``'s
    inputs). ``tolerance``: the largest acceptable ``baseline - metric`` (``>= 0``), or ``None``.
    ``method``: ``"ptq"``, ``"qat"`` (needs ``train_fn(prepared_model)``, which fine-tunes in place;
    ``calib`` may be ``None``) or ``"dynamic"`` (``calib`` may be ``None``).
    Returns ``(mapping, table)``: ``mapping`` is a copy of the user's mapping (with ``tolerance``:
    plus ``set_module_name(layer, None)`` for every layer kept float), usable with
    ``prepare(fused_model, mapping)`` (``prepare_qat`` for QAT, ``quantize_dynamic(model, mapping)``
    for dynamic); ``table`` is a ``SensitivityTable``. ``model`` is not modified. ``progress=False`` hides the
    progress bar; ``who`` names the caller in eval_fn's errors.
    """
    check_float_model(check_module(model, "sensitivity: model"), "sensitivity")
    if not callable(eval_fn):
        raise TypeError(f"sensitivity: eval_fn={eval_fn!r} must be callable (model -> score, higher is better)")
    if tolerance is not None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
            raise TypeError(f"sensitivity: tolerance={tolerance!r} must be a number >= 0 or None")
        if not tolerance >= 0 or math.isinf(tolerance):
            raise ValueError(f"sensitivity: tolerance={tolerance!r} must be a finite number >= 0")
    if not isinstance(method, str) or method not in _METHODS:
        raise ValueError(f"sensitivity: method={method!r} must be one of {', '.join(map(repr, _METHODS))}")
    if method == "qat" and not callable(train_fn):
        raise TypeError(f"sensitivity: method='qat' needs train_fn (prepared model -> None, fine-tunes in place), "
                        f"got {train_fn!r}")
    if method != "qat" and train_fn is not None:
        raise ValueError(f"sensitivity: train_fn is only used with method='qat' (method={method!r})")
    if method == "fx" and fuse is not None:
        raise ValueError("sensitivity: method='fx' fuses by itself; fuse must be None")
    default = {"ptq": None, "fx": None, "qat": get_default_qat_qconfig_mapping(),
               "dynamic": get_dynamic_qconfig()}[method]
    user_mapping = copy.deepcopy(QConfigMapping.from_qconfig(qconfig_mapping, default))
    optional_calib = method in ("qat", "dynamic") and calib is None
    batches = [] if optional_calib else list(iter_batches(calib, "sensitivity: calib"))
    if method != "dynamic":  # the dynamic method reads no calibration data
        check_calib(batches, "sensitivity")
    base = _fused(model, fuse, method)
    layers = _layers(base, user_mapping, method)
    if not layers:
        raise ValueError(f"{who}: qconfig_mapping quantizes no layer of the model for method={method!r} "
                         "(every quantizable module resolves to None)")

    if method == "fx" and example_inputs is None:
        example_inputs = example_inputs_of(batches[0], "sensitivity")
    op_keys: dict[str, tuple[str, Any, int]] = {}
    if method == "fx":  # a BN folded into the conv before it is not a layer (a standalone one was skipped too)
        folded, ops = _fx_folded(base, user_mapping, example_inputs)
        layers = [lay for lay in layers if lay[0] not in folded] + [(name, op, qc) for name, op, qc, _ in ops]
        op_keys = {name: key for name, _, _, key in ops}  # graph mode's adds / muls / cats, by call-order key

    def quantized(mapping: QConfigMapping, what: str) -> float:
        return _score(eval_fn, _quantize(base, mapping, batches, method, train_fn, example_inputs), what, who)

    with _quiet_float_fallback(), torch.no_grad():
        baseline = _score(eval_fn, copy.deepcopy(base).eval(), "the float model", who)
        rows = []
        for name, type_name, qc in tqdm(layers, desc=f"{who} (one layer int8 at a time)", leave=False,
                                        disable=not progress):
            alone = (QConfigMapping().set_module_name_object_type_order(*op_keys[name], qc) if name in op_keys
                     else QConfigMapping().set_module_name(name, qc))
            metric = quantized(alone, f"layer '{name}' quantized alone")
            rows.append(SensitivityRow(name, type_name, metric, metric_drop(baseline, metric)))
        rows.sort(key=by_drop)
        warn_if_lower_is_better(baseline, [r.metric for r in rows], "sensitivity")
        table = SensitivityTable(baseline, rows, tolerance, op_keys=op_keys)
        if tolerance is not None:
            metric = quantized(user_mapping, "the fully quantized model")
            for row in rows:
                if metric_drop(baseline, metric) <= tolerance:
                    break
                keep_float(user_mapping, row.name, op_keys)
                table.float_layers.append(row.name)
                metric = quantized(user_mapping, f"the model with {table.float_layers} float")
            table.final_metric = metric
    return user_mapping, table


def layer_sensitivity(model: nn.Module, qconfig_mapping: Any, calib: Any, inputs: Any = None, mode: str = "eager",
                      example_inputs: tuple[Any, ...] | None = None, fuse: Any = None) -> SensitivityTable:
    """"Quantize only this layer", for every layer, scored by the model output's error: worst first.

    No metric needed: ``metric = -Σ(y - ŷ)² / Σ y²`` over ``inputs`` (default: ``calib``), ``y`` the float
    model's outputs, ``ŷ`` those of the model with only that layer int8; so ``drop`` is the
    noise-to-signal ratio that layer alone causes and ``-10·log10(drop)`` its output SQNR in dB.
    ``mode``: ``"eager"`` (``prepare``/``convert``, optional ``fuse`` groups) or ``"fx"`` (graph mode).

    >>> import torch, lowbit as Q
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    >>> x = torch.randn(64, 8)
    >>> x[0, 0] = 100.0                                     # an outlier input: layer '0' costs most
    >>> table = layer_sensitivity(model, Q.get_minmax_qconfig(), x, mode="fx")
    >>> [r.name for r in table.rows]
    ['0', '2']
    """
    if mode not in ("eager", "fx"):
        raise ValueError(f"layer_sensitivity: mode={mode!r} must be 'eager' or 'fx'")
    check_float_model(check_module(model, "layer_sensitivity: model"), "layer_sensitivity")
    batches = list(iter_batches(calib, "layer_sensitivity: calib"))
    evals = batches if inputs is None else list(iter_batches(inputs, "layer_sensitivity: inputs"))
    for what, bs in (("calib", batches), ("inputs", evals)):
        for i, b in enumerate(bs):
            check_finite_batch(b, "layer_sensitivity", f"{what} batch {i}", "the output error needs finite data",
                               masks=True)
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            refs = [[t.double() for t in _flatten(run_batch(model.eval(), b))] for b in evals]
    except Exception as e:  # (the float model's bare error, e.g. "mat1 and mat2 shapes cannot be multiplied")
        failed = first_failing("layer_sensitivity", "calib" if inputs is None else "inputs", model, evals)
        if failed is None:
            raise
        raise failed from e
    finally:
        for m, training in modes:  # the caller's model keeps its mode
            m.training = training
    bad = [i for i, ts in enumerate(refs) if not all(bool(torch.isfinite(t).all()) for t in ts)]
    if bad:  # (it said "eval_fn must return a real number", and layer_sensitivity takes no eval_fn)
        raise ValueError(f"layer_sensitivity: the float model's output on {'calib' if inputs is None else 'inputs'} "
                         f"batch {bad[0]} holds NaN/Inf; the output error needs a finite float reference")
    signal = sum(float((t * t).sum()) for ts in refs for t in ts)

    def score(m: nn.Module) -> float:
        noise = 0.0
        for b, ts in zip(evals, refs):
            for t, t_hat in zip(ts, _flatten(run_batch(m, b))):
                noise += float(((t - t_hat.double()) ** 2).sum())
        return -noise / max(signal, 1e-30)

    try:
        _, table = sensitivity(model, qconfig_mapping, batches, score, fuse=fuse,
                               method="fx" if mode == "fx" else "ptq", example_inputs=example_inputs)
    except Exception as e:  # a calib batch the float model cannot run: named (it was the model's bare error)
        failed = first_failing("layer_sensitivity", "calib", model, batches) if inputs is not None else None
        if failed is None:
            raise
        raise failed from e
    return table


