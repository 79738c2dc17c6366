"""Checks on a quantized module's ``state_dict`` at ``load_state_dict``: no tampered grid loads silently.

A checkpoint's qparams and codes must describe a valid grid, exactly what ``from_float`` would build:

- every ``*scale`` buffer: floating point, finite and ``> 0`` (``input_scale`` may be ``0``: "no
  recorded input grid");
- every integer ``*zero_point`` buffer: finite integers on the grid of the matching dtype (``zero_point`` →
  the module's ``out_qdtype`` / ``qdtype``, ``weight_zero_point`` → ``weight_qdtype``,
  ``input_zero_point`` → ``input_qdtype``); a float one (``per_channel_affine_float_qparams``) finite;
- ``weight_int8`` codes: inside the weight grid (e.g. ``[-127, 127]`` for a narrowed ``qint8``);
- a float ``bias``: finite;
- with ``load_state_dict(..., assign=True)`` (the buffers are replaced, not copied into): each buffer's dtype.

- shapes (``size mismatch for <key>``, torch's words); the grids' dtypes where the checkpoint's metadata names them.

A failing module loads nothing (it keeps its previous state) and ``load_state_dict`` raises
``state_check.StateDictError`` (a ``ValueError`` and a ``RuntimeError``) with one line per bad key, naming the key,
the bad values and the module type; a model a workflow returned (``guard_loading``) checks every module first, so a
refused checkpoint leaves all of it as it was.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.stubs import Quantize
>>> q = Quantize(0.1, 0)
>>> try:
...     q.load_state_dict({"scale": torch.tensor(float("nan")), "zero_point": torch.tensor(0)})
... except ValueError as err:
...     print(str(err).splitlines()[-1].strip())
scale: scale=nan must be finite and > 0 (Quantize)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...fx_leaves import FxLeaf
from ...functional import check_quantized_state
from ...state_check import GRIDS_KEY, grid_names, key_errors, refuse_state

__all__ = ["CheckedQuantState", "check_quantized_state"]


def _on_meta(mod: nn.Module) -> bool:
    return any(b is not None and b.is_meta for b in mod._buffers.values())


def _refuse_meta(mod: nn.Module, args: Any) -> None:
    """Forward pre-hook of a quantized module moved to ``meta``: a clear error instead of one deep in its kernels."""
    if not _on_meta(mod):  # given values since (load_state_dict(assign=True), to_empty): the hook goes
        mod.__dict__.pop("_meta_hook").remove()
        return
    raise RuntimeError(f"{type(mod).__name__}: this module is on the meta device (moved with .to('meta')): its grid "
                       "and codes have no values to compute with; lowbit's quantized modules run on cpu / cuda (infer "
                       "shapes on the float model)")


class CheckedQuantState(FxLeaf, nn.Module):
    """Mixin for quantized modules: ``_load_from_state_dict`` refuses invalid qparams and codes.

    Put it first among the bases (``class Quantize(CheckedQuantState, nn.Module)``).

    ``.half()`` / ``.double()`` / ``.to(dtype)`` move its buffers (device) but keep their dtypes: a grid's
    float32 scales and float32 bias are part of the int8 contract (a ``float16`` scale is another grid); the
    module computes in float32 and returns its input's dtype. A class that follows the model's float dtype
    sets ``_keep_buffer_dtypes = False``."""

    _keep_buffer_dtypes = True
    _keys_load_together = True  # (state_check.key_errors: codes and grids load together or not at all)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        before = {n: b for n, b in self._buffers.items() if b is not None} if self._keep_buffer_dtypes else {}
        out = super()._apply(fn, *args, **kwargs)
        for name, old in before.items():
            t = self._buffers.get(name)
            if t is not None and t.dtype != old.dtype:  # the values as they were (a cast back would keep fp16's rounding)
                self._buffers[name] = old.to(device=t.device)
        if _on_meta(self) and "_meta_hook" not in self.__dict__:  # (only a model moved to meta pays for it)
            self.__dict__["_meta_hook"] = self.register_forward_pre_hook(_refuse_meta)
        return out

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        meta = getattr(destination, "_metadata", None)  # (torch put this module's entry there just before)
        if isinstance(meta, dict) and isinstance(meta.get(prefix[:-1]), dict):
            meta[prefix[:-1]][GRIDS_KEY] = grid_names(self)  # the grids the tensors do not name (qint8 vs quint8)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _state_errors(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> list[str]:
        """The problems of the incoming values of this module's buffers (``check_quantized_state``; shapes as torch
        checks them; with ``assign=True`` the dtypes) — pure: ``guard_loading`` runs it on a whole checkpoint first."""
        errors = key_errors(self, state_dict, prefix) + check_quantized_state(self, state_dict, prefix, local_metadata)
        assign = bool((local_metadata or {}).get("assign_to_params_buffers"))
        for name, buf in self._buffers.items():
            value = state_dict.get(prefix + name)
            if buf is None or not isinstance(value, torch.Tensor) or name in self._non_persistent_buffers_set:
                continue
            if value.shape != buf.shape and not (buf.dim() == 0 and value.shape == (1,)):  # (torch's 0-d rule)
                errors.append(f"size mismatch for {prefix + name}: copying a param with shape {tuple(value.shape)} "
                              f"from checkpoint, the shape in current model is {tuple(buf.shape)} ({type(self).__name__})")
            elif assign and value.dtype != buf.dtype:  # assign=True replaces buffers: no cast to ours
                errors.append(f"{prefix + name}: expected dtype {buf.dtype}, got {value.dtype} with assign=True "
                              f"({type(self).__name__})")
        return errors

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        errors = self._state_errors(state_dict, prefix, local_metadata)
        if errors:  # load nothing into this module: it keeps its valid state
            refuse_state(self, errors)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if _on_meta(self) and "_meta_hook" not in self.__dict__:  # meta values assigned: forward refuses clearly
            self.__dict__["_meta_hook"] = self.register_forward_pre_hook(_refuse_meta)
