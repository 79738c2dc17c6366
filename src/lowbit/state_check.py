"""Validity of a quantized module's incoming state (``check_quantized_state``, for ``load_state_dict``).

A checkpoint is user input: a scale of 0 or NaN, a zero point off its grid or a code past its storage would load
silently and compute garbage later. For each of the module's own buffers present in ``state_dict``:

- scales finite and ``> 0`` (``input_scale`` may be 0: "no static input grid"); a grid's ``scale`` / ``input_scale``
  also has a finite float32 reciprocal (``>= 2**-128``: codes are ``x * (1 / scale)``);
- zero points and codes integers inside the module's grid (``qdtype``-like attributes name it; packed 4-bit codes
  are bytes), a symmetric signed grid's zero points 0; float zero points (``float_qparams`` rows) finite;
- a float ``bias`` / norm ``weight`` finite, a ``histogram`` finite and ``>= 0``, ``min_val`` / ``max_val`` not NaN
  (``±inf`` means "nothing observed yet");
- the grids the tensors do not name (the module's ``QDtype`` attributes: ``out_qdtype``, ``qdtype``, ...), where the
  checkpoint's metadata records them (``grid_names``, saved by the quantized modules): a ``qint8`` output grid's zero
  point 14 is another grid on ``quint8``, so a checkpoint of another recipe is refused rather than loaded. A weight
  grid (the module's ``_weight_grids``) only needs the same kind (``qint8``, ``quint4``, ...): its codes are saved
  as they are and checked against the module's range, so 7-bit ``qint8[-64, 63]`` codes load into a ``qint8`` layer.

A value on the ``meta`` device (a meta checkpoint, ``load_state_dict(meta_sd, assign=True)`` into a model built on
meta) has no values: its value checks are skipped (shapes, and dtypes with ``assign=True``, are still checked by the
modules); torch then assigns it, or refuses to copy it into a real buffer ("Cannot copy out of meta tensor").

>>> import torch
>>> from torch import nn
>>> m = nn.Module()
>>> m.register_buffer("scale", torch.tensor(1.0))
>>> check_quantized_state(m, {"scale": torch.tensor(0.0)}, "")
['scale: scale=0.0 must be finite and > 0 (Module)']
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .qscheme import QDtype

__all__ = ["check_quantized_state", "grid_names", "guard_loading", "key_errors", "own_keys", "StateDictError"]

# convert's "saw no data" errors: the way to build the model a converted checkpoint loads into
LOAD_HINT = ("to build a model only to load a saved state_dict into, one batch of any data of the input's shape is "
             "enough: load_state_dict replaces every grid and code")
GRIDS_KEY = "lowbit_grids"  # a module's entry in a state_dict's ``_metadata``: its grid_names at save


def _show(t: torch.Tensor) -> str:
    """A short rendering of a qparam tensor for an error message."""
    v = t.flatten()[:8].tolist()
    return f"{v if t.dim() else v[0]}{'...' if t.numel() > 8 else ''}"


# buffer name -> the module attributes that may hold its grid, first found wins
_GRIDS = {"zero_point": ("out_qdtype", "qdtype"), "weight_zero_point": ("weight_qdtype", "qdtype", "dtype"),
          "input_zero_point": ("input_qdtype",), "weight_int8": ("weight_qdtype", "dtype"),
          "zero_points": ("qdtype",), "qweight": ("qdtype",), "weight_q": ("qdtype",)}
_CODES = ("weight_int8", "qweight", "weight_q")  # code buffers: an 8-bit grid bounds them; packed 4-bit ones, a byte


def grid_names(module: torch.nn.Module) -> dict[str, str]:
    """``module``'s ``QDtype`` attributes as their reprs (``{'out_qdtype': 'lowbit.quint8', ...}``): the grids its
    zero points and codes are on, which the tensors themselves do not say."""
    return {k: repr(v) for k, v in vars(module).items() if isinstance(v, QDtype)}


def check_quantized_state(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                          metadata: Any = None) -> list[str]:
    """The problems of the incoming values of ``module``'s own buffers for ``load_state_dict`` (an empty
    list: all valid): scales finite and > 0, zero points and codes integers on the module's grid, a
    float ``bias`` finite, a BatchNorm's ``running_mean`` finite and ``running_var`` finite and >= 0, a ``histogram``
    finite and >= 0, ``min_val``/``max_val`` not NaN; with the module's
    ``metadata`` entry of the checkpoint (``load_state_dict``'s ``local_metadata``), grids as ``grid_names``
    saved them. Used by the quantized modules (``nn/quantized/_state.py``), ``FakeQuantize`` and every observer."""
    where, errors = type(module).__name__, []
    saved = metadata.get(GRIDS_KEY) if isinstance(metadata, dict) else None
    if isinstance(saved, dict):
        weights = getattr(module, "_weight_grids", ("weight_qdtype",))  # codes saved as they are: only the kind counts
        for attr, mine in grid_names(module).items():
            theirs = saved.get(attr, mine)
            if theirs != mine if attr not in weights else str(theirs).split("[")[0] != mine.split("[")[0]:
                errors.append(f"{prefix}{attr}: the checkpoint is on {saved[attr]}, this module on {mine} ({where}): "
                              "a checkpoint of another recipe (its zero points and codes mean other values here)")
    for name, buf in module._buffers.items():
        value = state_dict.get(prefix + name)
        if buf is None or not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_meta:
            continue  # (a meta value has no values to check: a meta checkpoint loads as torch loads it)
        key = prefix + name
        if name.endswith(("scale", "scales")) and buf.is_floating_point():
            if not value.is_floating_point():
                errors.append(f"{key}: a scale must be a floating-point tensor, got dtype {value.dtype} ({where})")
                continue
            v = value.detach()
            ok = torch.isfinite(v) & ((v > 0) | (v == 0) if name == "input_scale" else v > 0)
            if not bool(ok.all()):
                errors.append(f"{key}: scale={_show(v)} must be finite and > 0 ({where})")
            elif name in ("scale", "input_scale") and not bool((torch.isfinite(v.float().reciprocal()) | (v == 0)).all()):
                errors.append(f"{key}: scale={_show(v)} has no finite float32 reciprocal (must be >= 2**-128) "
                              f"({where})")
        elif name in ("min_val", "max_val") and value.is_floating_point():  # ±inf: "nothing observed yet"
            if bool(torch.isnan(value.detach()).any()):
                errors.append(f"{key}: the observed range holds NaN ({where})")
        elif name == "histogram" and value.is_floating_point():
            v = value.detach()
            if not bool((torch.isfinite(v) & (v >= 0)).all()):
                errors.append(f"{key}: histogram counts must be finite and >= 0 ({where})")
        elif name in ("running_mean", "running_var") and value.is_floating_point():  # (a quantized BatchNorm)
            v = value.detach()
            ok = torch.isfinite(v) & (v >= 0) if name == "running_var" else torch.isfinite(v)
            if not bool(ok.all()):
                errors.append(f"{key}: {_show(v[~ok])} must be finite{' and >= 0' if name == 'running_var' else ''} "
                              f"({where}: every code would come out NaN, then clamped)")
        elif name in ("bias", "weight") and value.is_floating_point():  # (a quantized norm's affine weight)
            if not bool(torch.isfinite(value.detach()).all()):
                errors.append(f"{key}: the {name} holds NaN/Inf values ({where})")
        elif name in _GRIDS or name.endswith("zero_point"):
            if value.is_complex() or value.dtype == torch.bool:
                errors.append(f"{key}: expected integers, got dtype {value.dtype} ({where})")
                continue
            v = value.detach()
            if buf.is_floating_point() and v.is_floating_point():  # float zero points (float_qparams rows)
                if not bool(torch.isfinite(v).all()):
                    errors.append(f"{key}: zero_point {_show(v[~torch.isfinite(v)])} must be finite ({where})")
                continue
            ok = torch.isfinite(v) & (v == torch.round(v)) if v.is_floating_point() else torch.ones_like(v, dtype=torch.bool)
            qdtype = next((getattr(module, a) for a in _GRIDS.get(name, ()) if hasattr(module, a)), None)
            grid = ""
            if name in _CODES and (qdtype is None or getattr(qdtype, "bits", 8) != 8):
                qdtype = None  # packed / non-8-bit storage: each element is a byte of codes
                lo, hi = (-128, 127) if buf.dtype == torch.int8 else (0, 255)
                ok &= (v >= lo) & (v <= hi)
                grid = f" in [{lo}, {hi}] (bytes of packed codes)"
            if qdtype is not None and hasattr(qdtype, "quant_min"):
                ok &= (v >= qdtype.quant_min) & (v <= qdtype.quant_max)
                grid = f" in [{qdtype.quant_min}, {qdtype.quant_max}] ({qdtype!r})"
                if name == "zero_points" and getattr(module, "symmetric", False) and qdtype.signed:
                    ok &= v == 0  # a symmetric signed grid is centred on 0 (an affine checkpoint's zero points are not)
                    grid = f" equal to 0 (symmetric {qdtype!r})"
            if not bool(ok.all()):
                bad = v[~ok] if v.dim() else v
                what = "codes" if name in _CODES else "zero_point"
                errors.append(f"{key}: {what} {_show(bad)} must be integers{grid} ({where})")
    return errors


def own_keys(module: torch.nn.Module) -> list[str]:
    """The names ``module`` saves its own tensors under in a ``state_dict`` (parameters and persistent buffers that
    are not ``None``; children excluded), in registration order."""
    names = [n for n, p in module._parameters.items() if p is not None]
    return names + [n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set]


def key_errors(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, strict: bool = False) -> list[str]:
    """The key problems of a checkpoint for a quantized ``module`` whose tensors (codes, their scales and zero points,
    the grids they are read on) only mean something together, so they load together or not at all:

    - a float ``weight`` where the module holds codes (the checkpoint of the float model: with ``strict=False`` torch
      skipped it and loaded the float ``bias`` next to the old codes);
    - some of the module's keys but not all (``strict=False`` loaded them next to the other state's grid);
    - with ``strict``: none of its keys (missing), or a key of its own level it does not have (unexpected); torch
      reports those after it has loaded every other module, so ``guard_loading`` raises them before.

    >>> import torch
    >>> m = torch.nn.Module()
    >>> m.register_buffer("weight_int8", torch.zeros(2, 2, dtype=torch.int8))
    >>> m.register_buffer("weight_scale", torch.ones(2))
    >>> print(key_errors(m, {"fc.weight_int8": torch.zeros(2, 2, dtype=torch.int8)}, "fc.")[0][:63])
    fc: the checkpoint holds fc.weight_int8 but not fc.weight_scale
    """
    own, where = own_keys(module), type(module).__name__
    present = [k for k in own if prefix + k in state_dict]
    weight = state_dict.get(prefix + "weight")
    if "weight" not in own and isinstance(weight, torch.Tensor) and weight.is_floating_point():
        codes = ", ".join(prefix + k for k in own if "weight" in k or k in ("scales", "zero_points"))
        return [f"{prefix}weight: a float weight of shape {tuple(weight.shape)} where this quantized {where} holds "
                f"{codes}: the checkpoint of a float model (load it into the float model, then quantize)"]
    if present and len(present) < len(own):
        return [f"{prefix[:-1] or '<model>'}: the checkpoint holds {', '.join(prefix + k for k in present)} but not "
                f"{', '.join(prefix + k for k in own if k not in present)} ({where}): a quantized module loads its codes "
                "and grids together"]
    if not strict:
        return []
    errors = [] if present or not own else [f"Missing key(s) in state_dict: {', '.join(repr(prefix + k) for k in own)} "
                                            f"({where})"]
    children = set(module._modules)
    extra = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]
             and k[len(prefix):] not in own and k[len(prefix):] not in children and k[len(prefix):] != "_extra_state"]
    if extra:
        errors.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, extra))} ({where})")
    return errors


class StateDictError(ValueError, RuntimeError):
    """A checkpoint refused by lowbit's checks at ``load_state_dict``: a ``ValueError`` (a bad value, named with its
    key) that is also the ``RuntimeError`` torch's ``load_state_dict`` raises, so code catching either sees it."""


def refuse_state(owner: torch.nn.Module, errors: list[str]) -> None:
    """Raise ``StateDictError`` listing ``errors`` (one line per bad key) for a load into ``owner``."""
    raise StateDictError(f"Error(s) in loading state_dict for {type(owner).__name__}:\n\t" + "\n\t".join(errors))


def guard_loading(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.load_state_dict`` all-or-nothing for lowbit's checks: a pre-hook on ``model`` (registered once;
    the workflows call this on the model they return) runs every submodule's ``_state_errors`` (quantized modules,
    observers, fake-quants) on the whole checkpoint before anything loads, and raises ``StateDictError`` naming each
    bad key; without it torch loads module by module, so the modules before a refused one had already loaded."""
    if not any(getattr(h, "hook", None) is _check_all for h in model._load_state_dict_pre_hooks.values()):
        model.register_load_state_dict_pre_hook(_check_all)
    return model


def _load_is_strict() -> bool:
    """The ``strict`` of the ``nn.Module.load_state_dict`` call running this hook: torch hands its hooks
    ``strict=True`` always and applies the caller's only after every module has loaded, so it is read from that call's
    frame (``False`` when no such frame is found: ``_load_from_state_dict`` called directly, no early key errors)."""
    frame, code = sys._getframe(1), torch.nn.Module.load_state_dict.__code__
    for _ in range(256):  # (each nesting level of the model adds two frames: load and _load_from_state_dict)
        if frame is None:
            break
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return False


def _check_all(model: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
               *_: Any) -> None:
    """``guard_loading``'s pre-hook: each submodule's ``_state_errors`` on the incoming ``state_dict``."""
    meta = getattr(state_dict, "_metadata", None) or {}
    if not isinstance(meta, dict) or not isinstance(local_metadata or {}, dict):  # (torch's load: 'int' object has
        bad, what = (meta, "_metadata") if not isinstance(meta, dict) else (local_metadata, "_metadata entry")
        refuse_state(model, [f"{prefix[:-1] or '<model>'}: the checkpoint's {what} must be a dict (torch's "  # no
                             f"per-module metadata), got {type(bad).__name__} {bad!r}"[:300]])  # attribute 'get')
    assign = bool((local_metadata or {}).get("assign_to_params_buffers"))
    errors: list[str] = []
    strict = _load_is_strict()
    for name, mod in model.named_modules(remove_duplicate=False):  # (a shared module loads under each of its names)
        check = getattr(mod, "_state_errors", None)
        if check is None:
            continue
        p = prefix + (name + "." if name else "")
        entry = meta.get(p[:-1], {}) if isinstance(meta, dict) else {}
        if not isinstance(entry, dict):  # (torch's load reads it as a dict too, deeper down)
            errors.append(f"{p[:-1] or '<model>'}: the checkpoint's _metadata entry must be a dict (torch's per-module "
                          f"metadata: version, lowbit_grids), got {type(entry).__name__} {entry!r}"[:300])
            continue
        md = dict(entry)
        if assign:
            md["assign_to_params_buffers"] = True
        errors += check(state_dict, p, md)
        if strict and getattr(mod, "_keys_load_together", False):  # (the rest of key_errors: in _state_errors)
            errors += [e for e in key_errors(mod, state_dict, p, strict=True) if e.startswith(("Missing", "Unexp"))]
    if strict and any(e.startswith("Missing") for e in errors):  # (torch's message would list these too)
        known = {prefix + (n + "." if n else "") + k for n, m in model.named_modules(remove_duplicate=False)
                 for k in own_keys(m) + ["_extra_state"]}
        extra = [k for k in state_dict if k.startswith(prefix) and k not in known and not any(k in e for e in errors)]
        if extra:
            errors.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, extra[:10]))}"
                          f"{f' (and {len(extra) - 10} more)' if len(extra) > 10 else ''}")
    if errors:
        refuse_state(model, errors)
