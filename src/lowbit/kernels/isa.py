"""What this CPU and torch's build offer the int8 kernels, read once: oneDNN's quantized ops, VNNI / AMX, an ISA cap
(``ONEDNN_MAX_CPU_ISA``), torch's quantized engine, and whether ``vpmaddubsw`` is exact for a weight.

CPUs without VNNI multiply u8 × s8 pairs into a saturating int16 (``vpmaddubsw``); ``saturation_safe`` says when
that is exact. ``has_vnni`` is what the routes read: the CPU's own flags unless oneDNN is capped below VNNI.

>>> import torch
>>> saturation_safe(torch.tensor([[64, 64, -64, -64]], dtype=torch.int8)), saturation_safe(torch.tensor([[127, 2]]))
(True, False)
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["available", "has_vnni", "cpu_has_vnni", "has_amx", "shares_routes", "isa_capped", "saturation_safe",
           "fbgemm_engine"]

_FBGEMM = ("x86", "fbgemm")  # torch's quantized engines whose fbgemm ops the small-M path may use


def fbgemm_engine() -> bool:
    """Whether torch's quantized engine is one of ``_FBGEMM``: its id read from C++ (~0.1 µs; the
    ``torch.backends.quantized.engine`` property maps it to a name in Python, ~1.3 µs per call here)."""
    return torch._C._get_qengine() in _engine_ids(_FBGEMM)


@functools.lru_cache(maxsize=8)
def _engine_ids(names: tuple[str, ...]) -> frozenset[int]:
    return frozenset(torch.backends.quantized._get_qengine_id(n) for n in names)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether torch was built with the oneDNN quantized ops (x86 builds)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.lru_cache(maxsize=None)
def has_vnni() -> bool:
    """Whether this CPU has a non-saturating u8×s8 dot product (AVX512-VNNI, AVX-VNNI or AMX) that
    oneDNN may use: ``ONEDNN_MAX_CPU_ISA=AVX2`` (or any cap below VNNI) makes oneDNN run its
    saturating AVX2 kernels on a VNNI CPU, so the cap counts as no VNNI (``isa_capped``)."""
    return cpu_has_vnni() and not isa_capped()


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_vnni() -> bool:
    """Whether the CPU itself reports VNNI/AMX int8 (``/proc/cpuinfo`` flags)."""
    return bool(_cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.lru_cache(maxsize=None)
def has_amx() -> bool:
    """Whether oneDNN may run its AMX int8 kernels here: the CPU reports ``amx_int8`` and ``ONEDNN_MAX_CPU_ISA`` /
    ``DNNL_MAX_CPU_ISA`` is unset, ``ALL``/``DEFAULT`` or an AMX / AVX10 ISA. Geometries oneDNN gets wrong only with
    those kernels (``spec.wide_multiplier``'s several input channels a group) key on it."""
    if "amx_int8" not in _cpu_flags():
        return False
    cap = _cap()
    return cap in ("", "ALL", "DEFAULT") or "AMX" in cap or cap.startswith("AVX10")


def _cap() -> str:
    """oneDNN's ISA cap as set (``ONEDNN_MAX_CPU_ISA``, else ``DNNL_MAX_CPU_ISA``), upper case; ``""`` when unset."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def shares_routes() -> bool:
    """Whether a VNNI CPU's few-row Linears take the routes of a CPU without VNNI (``small_m.VNNI_M``): where it has
    AVX-512 VNNI, which lowbit.native's VNNI kernels use. A CPU with AVX-VNNI only (no AVX-512) keeps oneDNN's call."""
    return {"avx512_vnni", "avx512vl", "avx512f"} <= _cpu_flags()


def isa_capped() -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` keeps oneDNN below any VNNI ISA
    (``SSE41``, ``AVX``, ``AVX2``, ``AVX512_CORE``, ...); ``ALL``/``DEFAULT``/unset: no cap."""
    cap = _cap()
    if cap in ("", "ALL", "DEFAULT"):
        return False
    return not ("VNNI" in cap or "AMX" in cap or "BF16" in cap or "FP16" in cap or cap.startswith("AVX10"))


def saturation_safe(weight_codes: torch.Tensor) -> bool:
    """Whether ``vpmaddubsw`` (u8 × s8 pairs into a saturating int16) is exact for these weights.

    For every output channel (dim 0), the two largest positive codes and the two most negative
    codes must each sum to at most 128 in magnitude: ``255 · 128 = 32640 ≤ 32767``.
    """
    w = weight_codes.reshape(weight_codes.shape[0], -1).to(torch.int32)
    if w.shape[1] < 2:
        return True
    pos = w.clamp(min=0).topk(2, dim=1).values.sum(1)
    neg = (-w).clamp(min=0).topk(2, dim=1).values.sum(1)
    return bool((pos <= 128).all() and (neg <= 128).all())
