"""Per-layer numeric comparison of a float model and its quantized twin (torch.ao's numeric suite, in one call).

For every quantized module (a class of ``lowbit.nn.quantized``, ``DeQuantize`` excepted) whose
name also exists in the float model, ``compare`` reports over all ``inputs``

    SQNR = 10·log10(Σ x² / Σ (x - x̂)²)  dB        max abs error = max |x - x̂|

for the **activation** (its output, dequantized, against the float module's output) and for the
**weight** (``weight()`` dequantized against the float weight). ``x`` is the float value, ``x̂``
the quantized one; the sums run over every element of every batch (float64). An exact match gives
``inf`` dB. As a rule of thumb 8-bit layers sit at 30-45 dB; every 6 dB lost is one bit. A layer without an
int8 weight (an activation, ``QFunctional``, an int8 BatchNorm / LayerNorm / GroupNorm / InstanceNorm, whose
affine ``weight`` stays float) has ``None`` weight cells (``-`` in the table); its activation is still compared.

Matching is by module name (forward hooks; ``FloatFunctional``/``QFunctional`` by their methods).
Fused models: a quantized module at ``N`` followed, in its parent, by ``nn.Identity`` siblings
``M1..Mk`` that exist in the float model (the BN/ReLU that ``fuse_modules`` folded away) is compared
with the float output at ``Mk``; its weight is compared with the float weight with the BN at ``M1``
folded in. A float model fused beforehand works too (same names; its ``Identity`` passes the fused
output on). Graph-mode models (``convert_fx``) say in ``lowbit_report.absorbed`` which BN/ReLU each
fused layer absorbed: the layer is compared with the float output of the last of them (a functional
ReLU applied to the float output before it) and its weight with the BN folded in, as in eager mode.
A quantized model built from ``QuantWrapper(float_model)`` matches ``module.<name>``. Layers whose channels
``quantize_ptq``'s equalization rescaled (``lowbit_report.rescaled``) no longer compute the float model's
values: their output (and weight) cells, or only the weight cell of a layer whose inputs were rescaled, are
``None`` (``-`` in the table, "rescaled" in ``compared_with``) rather than a figure that measures the rescale.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> fp = nn.Sequential(Q.QuantStub(), nn.Linear(8, 4), nn.ReLU(), Q.DeQuantStub()).eval()
>>> prepared = Q.prepare(Q.fuse_modules(fp, [["1", "2"]]), Q.get_minmax_qconfig())
>>> _ = prepared(torch.randn(64, 8))
>>> result = compare(fp, Q.convert(prepared), torch.randn(32, 8))
>>> [(r.name, r.compared_with) for r in result.rows]
[('0', '0'), ('1', '2')]
>>> result.rows[1].act_sqnr_db > 30 and result.rows[1].weight_sqnr_db > 30
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..batches import batch_failed, check_module, flatten_outputs, iter_batches, run_batch  # noqa: F401 (re-exported)
from .checks import check_float_model, model_kind
from .result import CompareResult, LayerComparison, _Stats, sqnr
from ..nn.intrinsic.fold import fold_bn_weights
from ..nn.quantized.functional_modules import FloatFunctional, QFunctional
from ..nn.quantized.stubs import DeQuantize
from ..qtensor import QTensor

__all__ = ["CompareResult", "LayerComparison", "compare", "sqnr"]

_FUNCTIONAL_METHODS = ("add", "add_scalar", "mul", "mul_scalar", "cat", "add_relu", "matmul")


# ---------------------------------------------------------------- matching


def _is_quantized(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("lowbit.nn.quantized") and not isinstance(mod, DeQuantize)


def _float_name(name: str, float_names: dict[str, nn.Module]) -> str | None:
    if name in float_names:
        return name
    if name.startswith("module.") and name[len("module."):] in float_names:  # QuantWrapper(float_model)
        return name[len("module."):]
    return None


@dataclass
class _Pair:
    name: str                 # quantized module
    qmod: nn.Module
    float_name: str           # float module at the same name
    ref: str                  # float module whose output is compared
    fused: list[str]          # float names of the fused-away modules M1..Mk
    relu: bool = False        # a functional ReLU was absorbed after ``ref`` (graph mode): apply it
    clamp_max: float | None = None  # ... a functional [0, t] clamp (F.relu6): apply clamp(0, t) instead


def _pairs(float_model: nn.Module, quantized_model: nn.Module) -> list[_Pair]:
    f_named = dict(float_model.named_modules())
    q_named = dict(quantized_model.named_modules())
    absorbed = getattr(getattr(quantized_model, "lowbit_report", None), "absorbed", None) or {}
    pairs = []
    for name, qmod in q_named.items():
        fname = _float_name(name, f_named) if _is_quantized(qmod) else None
        if fname is None:
            continue
        fused: list[str] = []
        if name and name not in absorbed:  # (graph mode deleted the BN: the user's own Identity after it was taken
            # for the fused run, the weight compared unfolded: 17 dB on a depthwise conv + BN + Identity)
            parent_name, _, child = name.rpartition(".")
            siblings = list(q_named[parent_name]._modules.items())
            idx = [k for k, _ in siblings].index(child)
            for sib_name, sib in siblings[idx + 1:]:
                full = f"{parent_name}.{sib_name}" if parent_name else sib_name
                fsib = _float_name(full, f_named)
                if not isinstance(sib, nn.Identity) or fsib is None:
                    break
                fused.append(fsib)
        relu, clamp_max = False, None
        if name in absorbed:  # graph mode: the fused run recorded by prepare_fx
            fused = [f for f in absorbed[name] if f != "relu" and f in f_named]
            last = absorbed[name][-1]
            relu = last == "relu" or last.startswith("clamp:")
            clamp_max = float(last[len("clamp:"):]) if last.startswith("clamp:") else None
        pairs.append(_Pair(name, qmod, fname, fused[-1] if fused else fname, fused, relu, clamp_max))
    return pairs


def _act_suffix(p: _Pair) -> str:
    if not p.relu:
        return ""
    return " + relu" if p.clamp_max is None else f" + clamp(0, {p.clamp_max:g})"


def _float_weight(fmod: nn.Module, bn: nn.Module | None) -> torch.Tensor | None:
    core = fmod[0] if isinstance(fmod, nn.Sequential) and len(fmod) else fmod  # fused marker: (op, relu)
    w = getattr(core, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    w = w.detach().float()
    if isinstance(bn, nn.modules.batchnorm._BatchNorm):
        b = getattr(core, "bias", None)
        w, _ = fold_bn_weights(w, None if b is None else b.detach().float(), bn,
                               transpose=isinstance(core, nn.modules.conv._ConvTransposeNd),
                               groups=getattr(core, "groups", 1), rsqrt=True)
    return w


def _weight_pairs(fmod: nn.Module, qmod: nn.Module, bn: nn.Module | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(float weight, dequantized weight)`` pairs of a layer: one, or for a (dynamic) RNN / RNN cell every
    ``weight_ih*`` / ``weight_hh*`` by torch's parameter name (their ``weight(name)``: a ``TypeError`` before)."""
    if isinstance(fmod, (nn.RNNBase, nn.RNNCellBase)) and callable(getattr(qmod, "weight", None)):
        names = [n for n, _ in fmod.named_parameters(recurse=False) if n.startswith("weight_")]
        return [(getattr(fmod, n).detach().float(), _dequantized(qmod.weight(n))) for n in names]
    w_hat = _quantized_weight(qmod)
    w = _float_weight(fmod, bn) if w_hat is not None else None
    return [] if w is None or w_hat is None else [(w, w_hat)]


def _dequantized(w: Any) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QTensor) else w.detach().float()


_FLOAT_AFFINE_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def _quantized_weight(qmod: nn.Module) -> torch.Tensor | None:
    if isinstance(qmod, _FLOAT_AFFINE_NORMS):  # an int8 norm's weight is its float γ: no int8 weight ("inf" dB before)
        return None
    w = getattr(qmod, "weight", None)
    if callable(w) and not isinstance(w, (nn.Module, torch.Tensor)):
        w = w()
    return _dequantized(w) if isinstance(w, (QTensor, torch.Tensor)) else None


# ---------------------------------------------------------------- recording


_flatten = flatten_outputs


class _Recorder:
    """Records the outputs of named modules (hooks, or patched FloatFunctional/QFunctional methods)."""

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        self.outputs: dict[str, list[list[torch.Tensor]]] = {}
        self._undo: list[Callable[[], None]] = []
        named = dict(model.named_modules())
        for name in set(names):
            self._attach(named[name], name)

    def _record(self, name: str, out: Any) -> None:
        self.outputs.setdefault(name, []).append(_flatten(out))

    def _recording(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            self._record(name, out)
            return out
        return wrapped

    def _attach(self, mod: nn.Module, name: str) -> None:
        if isinstance(mod, (FloatFunctional, QFunctional)):
            patched = [m for m in _FUNCTIONAL_METHODS if hasattr(mod, m)]
            for meth in patched:
                object.__setattr__(mod, meth, self._recording(name, getattr(mod, meth)))

            def unpatch(mod: nn.Module = mod, patched: list[str] = patched) -> None:
                for meth in patched:
                    mod.__dict__.pop(meth, None)
            self._undo.append(unpatch)
        else:
            handle = mod.register_forward_hook(lambda _m, _i, out: self._record(name, out))
            self._undo.append(handle.remove)

    def close(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()


# ---------------------------------------------------------------- compare


def compare(float_model: nn.Module, quantized_model: nn.Module, inputs: Any) -> CompareResult:
    """Per-layer activation and weight SQNR / max abs error of ``quantized_model`` against ``float_model``.

    ``inputs``: one batch (a tensor) or an iterable of batches (a batch that is a tuple/list is
    unpacked into positional arguments, a dict into keywords). Both models run in eval mode under
    ``no_grad`` (their modes are restored afterwards); no model is modified.
    """
    check_float_model(check_module(float_model, "compare: float_model"), "compare", "float_model")  # (its observers
    check_module(quantized_model, "compare: quantized_model")  # learned from the inputs, changing its grids in place)
    pairs = _pairs(float_model, quantized_model)
    found = model_kind(quantized_model)
    if not pairs and found is not None and found[0] != "quantized":  # (it said "pass the float model")
        raise TypeError(f"compare: quantized_model is {found[0]} but not converted ({found[1]}); calibrate or train it "
                        "and call convert / convert_fx first")
    if not pairs:
        raise ValueError(
            f"compare: no quantized module of quantized_model ({type(quantized_model).__name__}) has a float "
            "counterpart of the same name in float_model; pass the float model the quantized one was converted from"
        )
    act = {p.name: _Stats() for p in pairs}
    modes = [(m, m.training) for model in (float_model, quantized_model) for m in model.modules()]
    rec_f = _Recorder(float_model, [p.ref for p in pairs])
    rec_q = _Recorder(quantized_model, [p.name for p in pairs])
    try:
        float_model.eval()
        quantized_model.eval()
        with torch.no_grad():
            for i, batch in enumerate(iter_batches(inputs, "compare")):
                parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) \
                    else (batch,)
                empty = [tuple(t.shape) for t in parts if isinstance(t, torch.Tensor) and t.numel() == 0]
                if empty:  # no sample: every layer would compare nothing (an empty table)
                    raise ValueError(f"compare: batch {i} holds an empty tensor (shape {empty[0]}); give at least one "
                                     "sample")
                try:
                    run_batch(float_model, batch)
                except Exception as e:  # (the float model's bare error, e.g. "mat1 and mat2 shapes cannot be ...")
                    raise batch_failed("compare (float_model)", f"inputs batch {i}", tuple(parts), e) from e
                run_batch(quantized_model, batch)
                for p in pairs:
                    calls_f, calls_q = rec_f.outputs.get(p.ref, []), rec_q.outputs.get(p.name, [])
                    for outs_f, outs_q in zip(calls_f, calls_q):
                        for x, x_hat in zip(outs_f, outs_q):
                            if p.relu:
                                x = x.relu() if p.clamp_max is None else x.clamp(0.0, p.clamp_max)
                            act[p.name].add(x, x_hat, f"compare: layer '{p.name or '<root>'}' vs float '{p.ref}'")
                rec_f.outputs.clear()
                rec_q.outputs.clear()
    finally:
        rec_f.close()
        rec_q.close()
        for m, training in modes:
            m.training = training

    f_named = dict(float_model.named_modules())
    rescaled = getattr(getattr(quantized_model, "lowbit_report", None), "rescaled", None) or {}
    rows = []
    for p in pairs:
        if act[p.name].count == 0:  # never called in the forward pass (or its float twin was not)
            continue
        what = rescaled.get(p.name)
        if what is not None:  # equalization changed this layer's output or weight: the float model is no reference
            a_sqnr, a_err = (None, None) if what == "output" else (act[p.name].sqnr_db, act[p.name].max_err)
            rows.append(LayerComparison(p.name, type(p.qmod).__name__, p.ref + _act_suffix(p) + f" ({what} rescaled)",
                                        a_sqnr, a_err, None, None))
            continue
        w_sqnr = w_err = None
        pairs_w = _weight_pairs(f_named[p.float_name], p.qmod, f_named[p.fused[0]] if p.fused else None)
        if pairs_w:
            stats = _Stats()
            for w, w_hat in pairs_w:
                stats.add(w, w_hat, f"compare: weight of '{p.name}'")
            w_sqnr, w_err = stats.sqnr_db, stats.max_err
        rows.append(LayerComparison(p.name, type(p.qmod).__name__, p.ref + _act_suffix(p),
                                    act[p.name].sqnr_db,
                                    act[p.name].max_err, w_sqnr, w_err))
    return CompareResult(rows)
