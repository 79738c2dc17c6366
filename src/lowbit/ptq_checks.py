"""``quantize_ptq``'s checks of what it is given, made before anything is traced or changed.

The float model: float32, finite, on a real device, not yet prepared or converted (``check_model``). The calibration
data: a non-empty iterable of finite, non-empty batches, each a tensor or a tuple / list of model inputs
(``ptq_batches``); a batch that fails in the model is named by its index (``batch_failed``). The ``"accurate"`` and
``"balanced"`` recipes slice samples along dim 0, so their first batch must feed every Linear / ConvNd a leading sample
axis (``check_sample_axis``). Each failure is a ``ValueError`` / ``TypeError`` naming the value. The options only
``"accurate"`` reads (``ACCURATE_ONLY``: AdaRound's, equalization's, the grid search's, ...) given another value than
their default with another recipe are refused, naming option, value and recipe (``ignored_options``): they were
silently ignored. Within ``"accurate"``, an option the others leave unread (``streams`` with ``equalize=False``,
``batch_size`` with ``iters=0``, ``seed`` with ``iters=0, tune=0, distill=0``) is refused the same way, naming both
(``unread_options``).

>>> import torch
>>> [tuple(t.shape) for t in ptq_batches([torch.zeros(2, 3)])[0]]
[(2, 3)]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .algorithms.layerwise import ROUNDINGS
from .algorithms.layerwise_step import check_seed
from .batches import batch_failed as _batch_failed
from .batches import check_finite_batch, input_shapes

__all__ = ["RECIPES", "ACCURATE_ONLY", "batch_failed", "check_model", "check_options", "check_sample_axis",
           "first_failing_batch", "ignored_options", "ptq_batches", "unread_options"]

RECIPES = ("default", "accurate", "balanced")

#: ``quantize_ptq``'s options that only ``recipe="accurate"`` reads, with their defaults (the signature's: a test holds
#: them equal). ``"default"`` runs prepare / calibrate / convert; ``"balanced"`` sets its own rounding (quadratic codes,
#: no AdaRound, no blocks, so no steps, samples or seed), no equalization, no grid search, no float output.
#: ``qconfig_mapping``, ``max_float_layers`` and ``progress`` apply to every recipe.
ACCURATE_ONLY: dict[str, Any] = {"iters": 500, "batch_size": 8, "equalize": "range", "streams": 0.75, "blocks": True,
                                 "learn_grids": True, "tune": 0, "seed": 0, "rounding": "adaround", "refine": 8,
                                 "float_output": True, "distill": 0}


def ignored_options(recipe: str, options: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, value, default)`` of each option in ``options`` that ``recipe`` does not read and that differs from its
    default (an explicit default is fine; the values are already of their option's type, ``check_options``).

    >>> ignored_options("balanced", {"iters": 3, "seed": 0, "streams": None})
    [('iters', 3, 500), ('streams', None, 0.75)]
    >>> ignored_options("accurate", {"iters": 3})
    []
    """
    if recipe == "accurate":
        return []
    return [(k, v, ACCURATE_ONLY[k]) for k, v in options.items() if k in ACCURATE_ONLY and not v == ACCURATE_ONLY[k]]


#: within ``"accurate"``: options a combination of the others leaves unread, as ``(option, read, with, why, fix)``:
#: ``option`` is read only where ``read(options)`` holds; its default, or ``streams=None`` (off: asking for nothing
#: the combination would do), passes silently; another value is refused (``unread_options``).
UNREAD: tuple[tuple[str, Any, str, str, str], ...] = (
    ("streams", lambda o: o["equalize"] is not False, "equalize=False",
     "no equalization runs, residual streams included", "set equalize='range' or True"),
    ("batch_size", lambda o: o["iters"] > 0, "iters=0",
     "AdaRound's samples per step: no AdaRound step runs; tune / distill take 16 samples a step", "set iters > 0"),
    ("seed", lambda o: o["iters"] > 0 or o["tune"] > 0 or o["distill"] > 0, "iters=0, tune=0 and distill=0",
     "it draws the samples of AdaRound's, tune's and distill's steps: none runs", "set iters, tune or distill > 0"),
)


def unread_options(recipe: str, options: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """``(name, value, default, message)`` of each ``"accurate"`` option in ``options`` that the others leave unread
    (``UNREAD``) and that is neither its default nor its off value (``streams=None`` with ``equalize=False`` asks for
    what happens). ``blocks=False`` / ``learn_grids=False`` are their off values: never refused (with ``iters=0`` no
    block is rounded, and no grid is learned without ``blocks`` nor ``tune`` / ``distill``, as they ask). Other
    recipes: ``ignored_options``.

    >>> opts = dict(iters=0, batch_size=16, seed=0, tune=0, distill=0, equalize="range", streams=0.75)
    >>> [(k, v) for k, v, *_ in unread_options("accurate", opts)]
    [('batch_size', 16)]
    >>> unread_options("accurate", dict(opts, iters=5, equalize=False, streams=None))
    []
    """
    if recipe != "accurate":
        return []
    return [(k, v, d, f"quantize_ptq: {k}={v!r} is ignored with {given} ({why}); pass {k}={d!r} (the default)"
             f"{' or streams=None' if k == 'streams' else ''}, or leave it out, or {fix}")
            for k, read, given, why, fix in UNREAD
            for v, d in [(options[k], ACCURATE_ONLY[k])] if not (v == d or (k == "streams" and v is None) or read(options))]


def check_options(recipe: Any, *, iters: Any, batch_size: Any, seed: Any, blocks: Any, rounding: Any,
                  learn_grids: Any, distill: Any, tune: Any, float_output: Any, refine: Any, max_float_layers: Any,
                  streams: Any, equalize: Any, progress: Any) -> None:
    """``quantize_ptq``'s options, each of its type and range, else an error naming the value; an option only
    ``"accurate"`` reads (``ACCURATE_ONLY``) given another value than its default with another recipe is a
    ``ValueError`` naming option, value and recipe (it would be ignored); within ``"accurate"``, so is an option the
    others leave unread (``unread_options``), naming both.

    >>> check_options("balanced", iters=500, batch_size=8, seed=0, blocks=True, rounding="adaround", learn_grids=True,
    ...               distill=5, tune=0, float_output=True, refine=8, max_float_layers=0, streams=0.75,
    ...               equalize="range", progress=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: quantize_ptq: distill=5 applies to recipe='accurate' only, not recipe='balanced' (it would be ...
    """
    if not isinstance(recipe, str) or recipe not in RECIPES:  # (an array's == is elementwise: `in` raised)
        raise ValueError(f"quantize_ptq: recipe={recipe!r}; choose one of {list(RECIPES)}")
    # step and sample counts are int64 where torch reads them (tune_biases / distill check the same bounds): past
    # 2**63 one overflowed deep in torch or ran forever (iters=2**70)
    if isinstance(iters, bool) or not isinstance(iters, int) or not 0 <= iters < 2 ** 63:
        raise ValueError(f"quantize_ptq: iters={iters!r} must be an int in [0, 2**63) (AdaRound steps per layer)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size < 2 ** 63:
        raise ValueError(f"quantize_ptq: batch_size={batch_size!r} must be an int in [1, 2**63) (samples per rounding "
                         "step)")
    check_seed("quantize_ptq", seed)
    if not isinstance(blocks, bool):
        raise TypeError(f"quantize_ptq: blocks={blocks!r} must be True or False")
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"quantize_ptq: rounding={rounding!r}; choose one of {list(ROUNDINGS)}")
    if not isinstance(learn_grids, bool):
        raise TypeError(f"quantize_ptq: learn_grids={learn_grids!r} must be True or False")
    if isinstance(distill, bool) or not isinstance(distill, int) or not 0 <= distill < 2 ** 63:
        raise ValueError(f"quantize_ptq: distill={distill!r} must be an int in [0, 2**63) (steps of end-to-end "
                         "distillation)")
    if isinstance(tune, bool) or not isinstance(tune, int) or not 0 <= tune < 2 ** 63:
        raise ValueError(f"quantize_ptq: tune={tune!r} must be an int in [0, 2**63) (steps of end-to-end bias tuning)")
    if not isinstance(float_output, bool):
        raise TypeError(f"quantize_ptq: float_output={float_output!r} must be True or False")
    if isinstance(refine, bool) or not isinstance(refine, int) or not 0 <= refine < 2 ** 63:
        raise ValueError(f"quantize_ptq: refine={refine!r} must be an int in [0, 2**63) (activation grids searched on "
                         "the output)")
    if isinstance(max_float_layers, bool) or not isinstance(max_float_layers, int) or max_float_layers < 0:
        raise ValueError(f"quantize_ptq: max_float_layers={max_float_layers!r} must be an int >= 0")
    if streams is not None and (isinstance(streams, bool) or not isinstance(streams, (int, float))
                                or not 0 <= streams <= 1):
        raise ValueError(f"quantize_ptq: streams={streams!r} must be None or an alpha in [0, 1]")
    if not (isinstance(equalize, bool) or (isinstance(equalize, str) and equalize == "range")):  # (1 == True)
        raise ValueError(f"quantize_ptq: equalize={equalize!r} must be True, False or 'range'")
    if not isinstance(progress, bool):
        raise TypeError(f"quantize_ptq: progress={progress!r} must be True or False")
    options = dict(iters=iters, batch_size=batch_size, equalize=equalize, streams=streams, blocks=blocks,
                   learn_grids=learn_grids, tune=tune, seed=seed, rounding=rounding, refine=refine,
                   float_output=float_output, distill=distill)
    ignored = ignored_options(recipe, options)
    if ignored:
        one = len(ignored) == 1
        given = ", ".join(f"{k}={v!r}" for k, v, _ in ignored)
        dflt = ", ".join(f"{k}={d!r}" for k, _, d in ignored)
        raise ValueError(f"quantize_ptq: {given} appl{'ies' if one else 'y'} to recipe='accurate' only, not "
                         f"recipe={recipe!r} (it would be ignored); pass {dflt} (the default{'' if one else 's'}) or "
                         f"leave {'it' if one else 'them'} out, or use recipe='accurate'")
    unread = unread_options(recipe, options)  # the options ``"accurate"`` reads only with others (``UNREAD``)
    if unread:
        raise ValueError(unread[0][3])


def ptq_batches(calib: Iterable[Any]) -> list[tuple[Any, ...]]:
    if isinstance(calib, torch.Tensor):
        raise TypeError("quantize_ptq: calib must be an iterable of batches (e.g. a list of tensors or a "
                        "DataLoader), got a single tensor; wrap it: [x]")
    try:
        out = [b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,) for b in calib]
    except TypeError as e:
        raise TypeError(f"quantize_ptq: calib must be an iterable of batches, got {type(calib).__name__}") from e
    for i, b in enumerate(out):
        if len(b) == 1 and isinstance(b[0], dict):
            raise TypeError(f"quantize_ptq: calib batch {i} is a dict; graph mode feeds inputs by position: give a "
                            "tensor or a tuple/list of the forward's arguments")
    if not out:
        raise ValueError("quantize_ptq: calib is empty; pass at least one calibration batch")
    for i, batch in enumerate(out):
        for j, t in enumerate(batch):
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_meta:
                raise ValueError(f"quantize_ptq: calib batch {i}, input {j} is a meta tensor (shape {tuple(t.shape)}, "
                                 "no data); calibration needs real values")
            if t.dim() > 0 and t.shape[0] == 0:
                raise ValueError(f"quantize_ptq: calib batch {i}, input {j} is empty (shape {tuple(t.shape)}); "
                                 "every calibration batch needs at least one sample")
        check_finite_batch(batch, "quantize_ptq", f"calib batch {i}", "calibration ranges need finite data", masks=True)
    return out


def batch_failed(i: int, batch: tuple[Any, ...], err: BaseException) -> ValueError:
    """The error for calibration batch ``i`` failing in the model: its input shapes and the model's first line."""
    hint = ""
    if isinstance(err, TypeError) and len(batch) > 1 and "positional argument" in str(err):
        hint = (f"; a tuple / list batch is the forward's positional arguments (these {len(batch)} values went in "
                "as its inputs): for (inputs, labels) pairs from a labelled DataLoader pass (x for x, _ in loader)")
    return _batch_failed("quantize_ptq", f"calib batch {i}", batch, err, hint)


def first_failing_batch(float_model: nn.Module, batches: list[tuple[Any, ...]]) -> ValueError | None:
    """``batch_failed`` for the first of ``batches`` that ``float_model`` cannot run (eval, no_grad), else ``None``:
    a step before calibration (equalization runs every batch first) failed, and this says whether the data did it.

    >>> first_failing_batch(nn.Linear(2, 1).eval(), [(torch.zeros(1, 2),), (torch.zeros(1, 3),)]).args[0][:51]
    'quantize_ptq: calib batch 1 (input shapes [(1, 3)])'
    """
    with torch.no_grad():
        for i, b in enumerate(batches):
            try:
                float_model(*b)
            except Exception as e:  # (any error of the user's model on this batch)
                return batch_failed(i, b, e)
    return None


class _Unbatched(Exception):
    """A weighted layer read an input without a leading sample axis (``check_sample_axis``)."""


def check_sample_axis(float_model: nn.Module, batch: tuple[Any, ...], recipe: str) -> None:
    """Run ``batch`` through ``float_model`` (eval, no_grad) and raise ``ValueError`` naming the first Linear / ConvNd
    whose input has no leading sample axis (a 1-D input to a Linear, an unbatched conv input): the rounding, the
    bias correction and the grid search slice samples along dim 0 and failed deep inside on such inputs. A batch
    the model itself refuses is left to ``prepare_fx``, which names it."""
    from .algorithms.layers import WEIGHTED

    ranks = {nn.Linear: 2, nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5}

    def hook(name: str, need: int, exact: bool):
        def fn(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and (x.dim() != need if exact else x.dim() < need):
                raise _Unbatched(f"layer {name!r} ({type(mod).__name__}) reads an input of shape {tuple(x.shape)}")
        return fn

    handles = [m.register_forward_pre_hook(hook(n, ranks[t], t is not nn.Linear))
               for n, m in float_model.named_modules() for t in (type(m),) if t in WEIGHTED]
    try:
        with torch.no_grad():
            float_model(*batch)
    except _Unbatched as e:
        raise ValueError(f"quantize_ptq: recipe={recipe!r} needs calibration batches with a leading sample axis "
                         f"(samples along dim 0), but {e} (calib batch 0 input shapes "
                         f"{input_shapes(batch)}); "
                         "add the batch dimension (x.unsqueeze(0)) or use recipe='default'") from None
    except Exception:  # noqa: BLE001 - the model refuses the batch: prepare_fx names it
        pass
    finally:
        for h in handles:
            h.remove()


def check_model(model: nn.Module) -> None:
    """A float32 model with finite parameters and buffers, not yet prepared or converted, or a
    ``ValueError``/``TypeError`` naming the tensor or module."""
    from .fake_quant import FakeQuantize
    from .nn.quantized import FloatFunctional
    from .observer import ObserverBase

    for name, mod in model.named_modules():
        where = f"module {name!r}" if name else "the model itself"
        if isinstance(mod, (ObserverBase, FakeQuantize)):
            raise TypeError(f"quantize_ptq: model is already prepared ({where} is a {type(mod).__name__}); pass the "
                            "float model, or calibrate this one and call convert / convert_fx")
        kind = type(mod).__module__
        if kind.startswith(("lowbit.nn.qat", "lowbit.nn.intrinsic.qat")):
            raise TypeError(f"quantize_ptq: model is already prepared for QAT ({where} is {kind}.{type(mod).__name__}); "
                            "pass the float model, or train this one and call convert")
        if kind.startswith(("lowbit.nn.quantized", "lowbit.llm")) and not isinstance(mod, FloatFunctional):
            raise TypeError(f"quantize_ptq: model is already quantized ({where} is {kind}.{type(mod).__name__}); "
                            "pass the float model")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(f"quantize_ptq: model {kind} {name!r} is on the meta device (no data to calibrate or "
                                 "quantize); load the weights first (e.g. load_state_dict(..., assign=True))")
            if not t.is_floating_point():
                continue
            if t.dtype != torch.float32:
                raise TypeError(f"quantize_ptq: model {kind} {name!r} is {t.dtype}; lowbit quantizes float32 "
                                "models: call model.float() first")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"quantize_ptq: model {kind} {name!r} holds NaN/Inf values; the int8 model "
                                 "would not represent them")



def check_quantizes_something(prepared: nn.Module, model: nn.Module) -> None:
    """Refuse a ``prepare_fx``-prepared model in which nothing got a qconfig (no observer, no weight-only or dynamic
    layer): ``convert_fx`` would hand back the float model and the report an output SQNR of ``inf`` dB, as if the
    int8 model were exact. The error names the model and its module types.

    >>> import torch, lowbit as Q
    >>> from torch import nn
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     p = Q.prepare_fx(nn.Sequential(nn.Flatten()), Q.get_default_qconfig_mapping(), example_inputs=(torch.ones(2, 3),))
    >>> check_quantizes_something(p, nn.Sequential(nn.Flatten()))
    Traceback (most recent call last):
    ...
    ValueError: quantize_ptq: nothing to quantize in Sequential (modules: Flatten): no layer or op runs in int8 ...
    """
    from torch import fx

    graphs = [m for m in prepared.modules() if isinstance(m, fx.GraphModule)]
    if any(str(n.meta.get("lowbit_kind", "")).startswith("obs_") or n.meta.get("lowbit_kind") in ("wonly", "dynamic")
           for gm in graphs for n in gm.graph.nodes):
        return
    types = sorted({type(m).__name__ for m in model.modules() if m is not model}) or ["none"]
    left = dict(getattr(getattr(prepared, "lowbit_report", None), "left_float", None) or {})
    kept = "; ".join(f"{k}: {v}" for k, v in list(left.items())[:4]) + (" ..." if len(left) > 4 else "")
    raise ValueError(f"quantize_ptq: nothing to quantize in {type(model).__name__} (modules: {', '.join(types)}): "
                     "no layer or op runs in int8 (the mapping quantizes none of them, or the model has no Linear, "
                     "conv, add, ... that runs in int8"
                     + (f"; kept float by prepare_fx: {kept}" if kept else "")
                     + "); the result would be the float model itself, scored inf dB")


def whole_graph_skip(prepared: nn.Module, model: nn.Module) -> str | None:
    """Why ``prepared`` is not one traced graph of the whole model (``None``: it is), for the report.

    A model whose own ``forward`` torch.fx cannot trace (control flow on a shape or on data: ``if x.shape[1] == 1``,
    an early exit) comes back from ``prepare_fx`` as itself with its children prepared one by one: ``"accurate"``'s
    equalization, grid refinement and rounding then run per child graph (``lowbit.ptq_steps``,
    ``lowbit.algorithms.children``), ``tune`` / ``distill`` on the whole model run eagerly with every child graph's
    layers (``algorithms.end_to_end``); the returned reason names the model and the trace error.

    >>> import torch
    >>> from torch import nn, fx
    >>> whole_graph_skip(fx.symbolic_trace(nn.Linear(2, 2)), nn.Linear(2, 2)) is None
    True
    """
    from torch import fx

    if isinstance(prepared, fx.GraphModule):
        return None
    cause = str(getattr(getattr(prepared, "lowbit_report", None), "untraceable", {}).get("<root>", ""))
    cause = cause.split("torch.fx could not trace its forward: ", 1)[-1].strip().splitlines()[0][:200] if cause else ""
    return f"{type(model).__name__}.forward cannot be traced by torch.fx" + (f" ({cause})" if cause else "")
