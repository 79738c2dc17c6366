"""Checks on a quantized module's ``state_dict`` at ``load_state_dict``: no tampered grid loads silently.

A checkpoint's qparams and codes must describe a valid grid, exactly what ``from_float`` would build:

- every ``*scale`` buffer: floating point, finite and ``> 0`` (``input_scale`` may be ``0``: "no
  recorded input grid");
- every integer ``*zero_point`` buffer: finite integers on the grid of the matching dtype (``zero_point`` →
  the module's ``out_qdtype`` / ``qdtype``, ``weight_zero_point`` → ``weight_qdtype``,
  ``input_zero_point`` → ``input_qdtype``); a float one (``per_channel_affine_float_qparams``) finite;
- ``weight_int8`` codes: inside the weight grid (e.g. ``[-127, 127]`` for a narrowed ``qint8``);
- a float ``bias``: finite.

Shapes are torch's own check (``size mismatch for <key>``). A failing module loads nothing (it keeps
its previous state) and ``load_state_dict`` raises ``RuntimeError`` with one line per bad key, naming
the key, the bad values and the module type.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.stubs import Quantize
>>> q = Quantize(0.1, 0)
>>> try:
...     q.load_state_dict({"scale": torch.tensor(float("nan")), "zero_point": torch.tensor(0)})
... except RuntimeError as err:
...     print(str(err).splitlines()[-1].strip())
scale: scale=nan must be finite and > 0 (Quantize)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CheckedQuantState", "check_quantized_state"]

# buffer name -> the module attributes that may hold its grid, first found wins
_GRIDS = {"zero_point": ("out_qdtype", "qdtype"), "weight_zero_point": ("weight_qdtype", "qdtype"),
          "input_zero_point": ("input_qdtype",), "weight_int8": ("weight_qdtype",)}


def _show(t: torch.Tensor) -> str:
    v = t.detach().flatten()[:6].tolist()
    return f"{v if t.dim() else v[0]}{'...' if t.numel() > 6 else ''}"


def check_quantized_state(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """The problems of the incoming values of ``module``'s own buffers (an empty list: all valid)."""
    where, errors = type(module).__name__, []
    for name, buf in module._buffers.items():
        value = state_dict.get(prefix + name)
        if buf is None or not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        key = prefix + name
        if name.endswith("scale") and buf.is_floating_point():
            if not value.is_floating_point():
                errors.append(f"{key}: a scale must be a floating-point tensor, got dtype {value.dtype} ({where})")
                continue
            v = value.detach()
            ok = torch.isfinite(v) & ((v > 0) | (v == 0) if name == "input_scale" else v > 0)
            if not bool(ok.all()):
                errors.append(f"{key}: scale={_show(v)} must be finite and > 0 ({where})")
        elif name == "bias" and value.is_floating_point():
            if not bool(torch.isfinite(value.detach()).all()):
                errors.append(f"{key}: the bias holds NaN/Inf values ({where})")
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
            if name == "weight_int8" and (qdtype is None or getattr(qdtype, "bits", 8) != 8):
                qdtype = None  # packed / non-8-bit storage: the dtype itself bounds the codes
            grid = ""
            if qdtype is not None and hasattr(qdtype, "quant_min"):
                ok &= (v >= qdtype.quant_min) & (v <= qdtype.quant_max)
                grid = f" in [{qdtype.quant_min}, {qdtype.quant_max}] ({qdtype!r})"
            if not bool(ok.all()):
                bad = v[~ok] if v.dim() else v
                what = "codes" if name == "weight_int8" else "zero_point"
                errors.append(f"{key}: {what} {_show(bad)} must be integers{grid} ({where})")
    return errors


class CheckedQuantState(nn.Module):
    """Mixin for quantized modules: ``_load_from_state_dict`` refuses invalid qparams and codes.

    Put it first among the bases (``class Quantize(CheckedQuantState, nn.Module)``)."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        errors = check_quantized_state(self, state_dict, prefix)
        if errors:
            error_msgs.extend(errors)
            return  # load nothing into this module: it keeps its valid state
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
