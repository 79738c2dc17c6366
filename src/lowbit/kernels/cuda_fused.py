"""Fused CUDA epilogues for the ``int_mm`` backend: the float work around ``torch._int_mm`` in one kernel each.

On CUDA the int8 GEMM (cuBLAS through ``torch._int_mm``) is fast, but the torch-op epilogue around it read and wrote
the ``(M, N)`` result 8-12 times (measured on an H200: a static 4096×4096×14336 Linear 2.2 ms against 0.54 ms for
the GEMM alone; dynamic 7.4 ms). Here each epilogue is one small function compiled once per process by
``torch.compile`` (dynamic shapes; Inductor emits one Triton kernel for it), so the Linear costs the GEMM plus one
pass. The functions are also plain torch code: called uncompiled (``compiled=False``) they give the same values, which
is how the CPU tests check them.

Static Linear (``int_mm.linear`` on CUDA), with ``acc = Σ_k (q_x - 128·[u8]) q_w`` from ``_int_mm``::

    y = (acc - z'_x Σ_k q_w) · (s_x s_w[n]) + bias[n]                       # float32, z'_x the shifted zero point
    q = clamp(round(y · (1 / s_out) + z_out), lo, q_max)                     # lo = max(q_min, z_out) with ReLU

(ReLU before rounding equals raising the low clamp to ``z_out``: a negative ``y`` rounds to at most ``z_out``.)

Dynamic Linear (per-token ``quint8`` activations, as ``quantize_per_token``: the same codes bit for bit)::

    s_x = max((max(hi, 0) - min(lo, 0)) / 255, 1e-8),  -z_x = round(min(lo, 0) / s_x)
    q_x - 128 = clamp(round(x · (1 / s_x) - (-z_x)), 0, 255) - 128            # int8 into _int_mm
    y = (acc + (128 + (-z_x)) Σ_k q_w) · (s_x s_w[n]) + bias[n]               # exact int32 correction, then float

The reference backend's float conv on CUDA requantizes its output with ``requant`` (the same rounding in one pass).
``LOWBIT_CUDA_FUSED=0`` switches the compiled epilogues off (the torch-op epilogue runs); a compile that fails
warns once and does the same.

>>> import torch
>>> from lowbit.kernels import cuda_fused
>>> q, s, nz = cuda_fused.token_codes(torch.tensor([[0.0, 1.0, -1.0]]), compiled=False)
>>> q.tolist(), round(float(s), 6), float(nz)
([[-1, 126, -128]], 0.007843, -127.0)
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

__all__ = ["enabled", "token_codes", "dynamic_epilogue", "static_codes", "static_float", "requant", "grid_tensors"]

_COMPILED: dict[str, Callable[..., Any]] = {}
_FAILED: list[str] = []


def enabled(device: torch.device) -> bool:
    """Whether the compiled epilogues serve ``device`` (CUDA, torch.compile usable, not switched off)."""
    if device.type != "cuda" or _FAILED:
        return False
    switch = os.environ.get("LOWBIT_CUDA_FUSED", "").strip()
    if switch not in ("", "0", "1"):  # ("off", "false": the compiled epilogues ran on, silently)
        raise ValueError(f"LOWBIT_CUDA_FUSED={switch!r}: set it to 0 (the torch-op epilogue) or 1 (the default)")
    return switch != "0"


def _token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo = torch.amin(x, 1, keepdim=True).clamp(max=0.0)
    hi = torch.amax(x, 1, keepdim=True).clamp(min=0.0)
    scale = torch.div(hi - lo, 255.0).clamp(min=1e-8)
    neg_zp = torch.round(lo / scale)
    q = torch.clamp(torch.round(x * torch.reciprocal(scale) - neg_zp), 0.0, 255.0) - 128.0
    return q.to(torch.int8), scale, neg_zp


def _dynamic_epilogue(acc: torch.Tensor, neg_zp: torch.Tensor, sx: torch.Tensor, wsum: torch.Tensor, ws: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    exact = acc + (neg_zp + 128.0).to(torch.int32) * wsum  # Σ_k (q_x - z_x) q_w: |.| <= 255·128·K, exact in int32
    return exact.to(torch.float32) * (sx * ws) + bias


def _affine(acc: torch.Tensor, zx: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor) -> torch.Tensor:
    return (acc - zx * wsum).to(torch.float32) * scale + bias


def _requant(y: torch.Tensor, inv_out: torch.Tensor, zp_out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    return torch.clamp(torch.round(y * inv_out + zp_out), lo, hi).to(dtype)


def _static_float(acc: torch.Tensor, zx: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                  lo: torch.Tensor) -> torch.Tensor:
    return torch.maximum(_affine(acc, zx, wsum, scale, bias), lo)


def _static_codes(acc: torch.Tensor, zx: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                  inv_out: torch.Tensor, zp_out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    return _requant(_affine(acc, zx, wsum, scale, bias), inv_out, zp_out, lo, hi, dtype)


def _run(name: str, fn: Callable[..., Any], compiled: bool, *args: Any) -> Any:
    if not compiled:
        return fn(*args)
    f = _COMPILED.get(name)
    if f is None:
        f = _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        return f(*args)
    except Exception as e:  # an unusable compiler (no Triton, a broken toolchain): the torch-op path from now on
        if not _FAILED:
            warnings.warn(f"lowbit: the compiled CUDA epilogue failed ({type(e).__name__}: {str(e)[:200]}); "
                          "falling back to the torch-op epilogue", RuntimeWarning, stacklevel=3)
        _FAILED.append(name)
        return None


def token_codes(x: torch.Tensor, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per-row ``quint8`` codes of float32 ``x`` ``(M, K)`` shifted to int8, with ``(s_x, -z_x)`` ``(M, 1)``."""
    return _run("token_codes", _token_codes, compiled, x)


def dynamic_epilogue(acc: torch.Tensor, neg_zp: torch.Tensor, sx: torch.Tensor, wsum: torch.Tensor, ws: torch.Tensor,
                     bias: torch.Tensor, compiled: bool = True) -> torch.Tensor | None:
    """Float32 ``(M, N)`` of a dynamic Linear from the shifted codes' int32 ``acc`` (module doc)."""
    return _run("dynamic_epilogue", _dynamic_epilogue, compiled, acc, neg_zp, sx, wsum, ws, bias)


def static_float(acc: torch.Tensor, zx: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                 lo: torch.Tensor, compiled: bool = True) -> torch.Tensor | None:
    """``max((acc - z_x Σ q_w) · scale + bias, lo)`` float32 (``lo`` 0 with ReLU, else -inf)."""
    return _run("static_float", _static_float, compiled, acc, zx, wsum, scale, bias, lo)


def static_codes(acc: torch.Tensor, zx: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                 grid: tuple[torch.Tensor, ...], dtype: torch.dtype, compiled: bool = True) -> torch.Tensor | None:
    """Output codes of a static Linear on ``grid = grid_tensors(...)`` (module doc), stored as ``dtype``."""
    return _run("static_codes", _static_codes, compiled, acc, zx, wsum, scale, bias, *grid, dtype)


def requant(y: torch.Tensor, grid: tuple[torch.Tensor, ...], dtype: torch.dtype, compiled: bool = True) -> torch.Tensor | None:
    """Codes of float ``y`` on ``grid = grid_tensors(...)`` (ReLU as its low clamp), stored as ``dtype``: the
    reference backend's requantize on CUDA (its float conv / Linear output), one pass instead of five."""
    return _run("requant", _requant, compiled, y, *grid, dtype)


_GRIDS: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}


def grid_tensors(scale: float, zero_point: int, qmin: int, qmax: int, relu: bool,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(1 / s_out, z_out, lo, hi)`` as 0-d float32 tensors on ``device``, made once per grid (no per-call copies)."""
    key = (scale, zero_point, qmin, qmax, relu, device)
    hit = _GRIDS.get(key)
    if hit is None:
        lo = max(qmin, zero_point) if relu else qmin
        vals = (torch.reciprocal(torch.tensor(scale, dtype=torch.float32)), torch.tensor(float(zero_point)),
                torch.tensor(float(lo)), torch.tensor(float(qmax)))
        with torch.inference_mode(False):
            hit = _GRIDS[key] = tuple(v.to(device) for v in vals)
        if len(_GRIDS) > 4096:  # a bounded cache: many distinct grids only cost the copies again
            _GRIDS.clear()
    return hit
