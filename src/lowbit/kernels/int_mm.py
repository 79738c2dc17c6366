"""Portable backend: ``torch._int_mm`` (int8 × int8 → int32) on CPU and CUDA, epilogue in torch ops.

For ``x`` reshaped to ``(M, K)`` and the weight ``(N, K)``::

    acc[m, n] = Σ_k q_x q_w  -  z_x Σ_k q_w[n]  -  z_w[n] Σ_k q_x[m]  +  K z_x z_w[n]
              = Σ_k (q_x - z_x)(q_w - z_w)                               # exact int32
    y         = acc · s_x s_w[n] + bias[n]  (→ relu)  →  requantize onto the output grid

Per-channel weight zero points are supported (the ``z_w`` terms vanish when they are 0). The
weight is kept ``(N, K)`` contiguous and passed as ``w.t()`` (column-major: the fast layout at small
M); on CUDA, where ``_int_mm`` needs int8 inputs, ``M > 16`` and ``K, N`` multiples of 8, u8
activations are shifted to s8 and the operands are zero-padded (padding adds nothing to ``acc``).
Convolutions are declined (im2col + ``_int_mm`` is slower than float on CPU; see DESIGN §4).
On x86 CPUs without VNNI, torch's CPU ``_int_mm`` is a scalar loop (~30x slower than fp32 at
128×768×768), so there it is only the exact fallback for affine (non-zero zero point) weights.

>>> import torch, lowbit as Q
>>> from lowbit.kernels import int_mm
>>> x = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0]]), 0.1, 3, Q.quint8)
>>> w = Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> int_mm.linear(x, w, None, None).tolist()
[[-1.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from ..compile_state import tensor_version
from ..functional import quantize
from ..qtensor import QTensor
from . import cuda_fused
from .spec import ConvSpec, OutGrid

__all__ = ["NAME", "STRICT_DEVICES", "linear", "conv", "cpu_int_mm", "dynamic_linear"]

NAME = "int_mm"
STRICT_DEVICES = {"cuda"}  # device types whose _int_mm needs s8 A, M > 16 and K, N multiples of 8


_CAPPED: list[bool] = []


def _onednn_capped() -> bool:
    """A VNNI CPU whose oneDNN is capped below VNNI (``ONEDNN_MAX_CPU_ISA``): read once, as oneDNN reads its cap once
    and ``onednn.has_vnni`` caches it (``cpu_int_mm`` asks on every call). Traced code reads it as a constant (marked
    as ``torch.compiler.assume_constant_result`` does, without importing dynamo): dynamo traces through an
    ``lru_cache``, and reading ``/proc/cpuinfo`` inside a trace stopped ``torch.compile(fullgraph=True)`` of every
    ``quantize_w8a8`` model."""
    if not _CAPPED:
        from .onednn import cpu_has_vnni, isa_capped

        _CAPPED.append(cpu_has_vnni() and isa_capped())
    return _CAPPED[0]


_onednn_capped._dynamo_marked_constant = True  # type: ignore[attr-defined]


_U8: list[bool] = []  # whether this torch's CPU _int_mm takes uint8 activations (probed once)


def cpu_int_mm(q: torch.Tensor, w_t: torch.Tensor, w_sum: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_k q[m, k] w[k, n]`` exact int32 on CPU for int8 or uint8 ``q`` ``(M, K)``; ``w_sum`` is ``Σ_k w[k, n]``
    (needed for uint8 ``q`` only).

    torch before 2.12 or so takes only int8 activations there ("Expected self dtype to be of type int8"): then
    ``u8 - 128`` goes in as int8 and ``128 Σ_k w`` is added back (exact in int32). Where torch's ``_int_mm`` is wrong,
    an int32 matmul gives the sums: ``K == 1`` with ``N > 1`` (its sums are wrong on AVX-512 VNNI, either weight layout;
    every other shape of a 225-shape grid is exact), and a VNNI CPU whose oneDNN is capped below VNNI
    (``ONEDNN_MAX_CPU_ISA``: torch still routes ``_int_mm`` to oneDNN, whose AVX2 kernel saturates; sums off by up to
    ~6e5 measured). Other operands (float or int32 codes, not 2-D, ``K`` not matching) are a ``TypeError`` /
    ``ValueError`` naming them (the int32 route would truncate float codes silently).
    """
    if (q.dtype not in _CODE_DTYPES or w_t.dtype != torch.int8 or q.dim() != 2 or w_t.dim() != 2
            or q.shape[1] != w_t.shape[0]):
        _refuse_operands(q, w_t)
    if q.shape[1] == 1 or _onednn_capped():
        return q.to(torch.int32) @ w_t.to(torch.int32)
    if q.dtype == torch.uint8:
        if not _U8:
            try:
                torch._int_mm(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.int8))
                _U8.append(True)
            except RuntimeError:
                _U8.append(False)
        if not _U8[0]:
            if w_sum is None:
                raise ValueError("cpu_int_mm: uint8 codes on this torch need w_sum (Σ_k w[k, n])")
            return torch._int_mm(q.view(torch.int8).bitwise_xor(-128), w_t).add_(w_sum, alpha=128)
    return torch._int_mm(q, w_t)


_CODE_DTYPES = (torch.int8, torch.uint8)


def _refuse_operands(q: torch.Tensor, w_t: torch.Tensor) -> None:
    """The ``TypeError`` / ``ValueError`` for ``cpu_int_mm`` operands it does not take."""
    if q.dtype not in _CODE_DTYPES or w_t.dtype != torch.int8:
        raise TypeError(f"cpu_int_mm: q must be int8 or uint8 codes and w_t int8 codes, got dtypes {q.dtype} and "
                        f"{w_t.dtype}")
    raise ValueError(f"cpu_int_mm: q (M, K) and w_t (K, N) must be 2-D with the same K, got shapes "
                     f"{tuple(q.shape)} and {tuple(w_t.shape)}")


def _strict_mm(q: torch.Tensor, w_t: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``_int_mm`` in the strict layout (int8 ``q`` padded to ``M >= 17`` rows and ``K``, ``N`` multiples of 8), the
    ``(m, n)`` corner of the sums; on a CPU (a layout tests force there) through ``cpu_int_mm``'s guards."""
    a = _pad_to(_pad_to(q, 1, 8), 0, 1, 17).contiguous()
    return (cpu_int_mm(a, w_t) if a.device.type == "cpu" else torch._int_mm(a, w_t))[:m, :n]


def _pad_to(t: torch.Tensor, dim: int, multiple: int, minimum: int = 0) -> torch.Tensor:
    n = t.shape[dim]
    target = max(-(-n // multiple) * multiple, minimum)
    if target == n:
        return t
    shape = list(t.shape)
    shape[dim] = target - n
    return torch.cat([t, t.new_zeros(shape)], dim)


def _prepare(weight: QTensor, cache: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(w_t, Σ_k q_w per n, z_w or None)``, cached per weight version."""
    w = weight.int_repr()
    version = (w.data_ptr(), tensor_version(w), w.device)
    hit = cache.get("int_mm.linear") if cache is not None else None
    if hit is not None and hit[0] == version:
        return hit[1]
    wq = w.to(torch.int8).contiguous()
    if w.device.type in STRICT_DEVICES:
        wq = _pad_to(_pad_to(wq, 0, 8), 1, 8)  # (N8, K8)
    zw = weight.zero_point.to(torch.int32)
    entry = (wq.t(), w.to(torch.int32).sum(1), zw if bool(zw.any()) else None)
    if cache is not None:
        cache["int_mm.linear"] = (version, entry)
    return entry


def linear(x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None,
           relu: bool = False, cache: dict[str, Any] | None = None) -> Any:
    """Exact int32 ``Σ (q_x - z_x)(q_w - z_w)`` from ``torch._int_mm``, float epilogue; any device."""
    if x.int_repr().element_size() != 1 or weight.int_repr().dtype != torch.int8 or x.numel() == 0:
        return NotImplemented
    w_t, w_sum, zw = _prepare(weight, cache)
    q = x.int_repr()
    lead, k = q.shape[:-1], q.shape[-1]
    q = q.reshape(-1, k)                                              # (M, K)
    m, n = q.shape[0], weight.shape[0]
    if q.device.type in STRICT_DEVICES:
        u8 = q.dtype == torch.uint8
        if u8:
            q = q.view(torch.int8).bitwise_xor(-128)                  # u8 - 128 as s8
        acc = _strict_mm(q, w_t, m, n)
        if zw is None and cuda_fused.enabled(q.device):               # one compiled epilogue, no host reads
            y = _fused_epilogue(acc, x, weight, w_sum, bias, out, relu, u8, cache)
            if y is not None:
                return y.reshape(*lead, n) if out is None else out.wrap(y.reshape(*lead, n))
        zx = int(x.zero_point) - (128 if u8 else 0)
    else:
        zx = int(x.zero_point)
        acc = cpu_int_mm(q, w_t, w_sum)                               # (M, N) int32, exact (its guards)
    acc = acc - zx * w_sum                                            # Σ (q_x - z_x) q_w
    if zw is not None:
        acc = acc - zw * (q.to(torch.int32).sum(1, keepdim=True)[:m] - k * zx)
    y = acc.to(torch.float32) * (x.scale * weight.scale)
    if bias is not None:
        y = y + bias
    if relu:
        y = torch.relu_(y)
    y = y.reshape(*lead, n)
    if out is None:
        return y
    return out.wrap(quantize(y, out.scale, out.zero_point, out.qdtype, validate=False))  # a module's checked grid


def dynamic_linear(xf: torch.Tensor, weight: QTensor, bias: torch.Tensor | None,
                   cache: dict[str, Any] | None) -> torch.Tensor | None:
    """A per-token dynamic Linear on CUDA in three kernels: ``cuda_fused.token_codes`` (the ``quint8`` codes of each
    row, as ``quantize_per_token``, shifted to int8), ``_int_mm``, ``cuda_fused.dynamic_epilogue``; float32 ``(M, N)``
    for float32 ``xf`` ``(M, K)``. ``None``: not taken (affine weights, or no compiled epilogue)."""
    if weight.int_repr().dtype != torch.int8 or not cuda_fused.enabled(xf.device):
        return None
    w_t, w_sum, zw = _prepare(weight, cache)
    if zw is not None:
        return None
    codes = cuda_fused.token_codes(xf)
    if codes is None:
        return None
    q, sx, neg_zp = codes
    m, n = xf.shape[0], weight.shape[0]
    acc = _strict_mm(q, w_t, m, n)
    b = bias if bias is not None else _zeros(n, acc.device, cache)
    return cuda_fused.dynamic_epilogue(acc, neg_zp, sx, w_sum, weight.scale, b)


def _fused_epilogue(acc: torch.Tensor, x: QTensor, weight: QTensor, w_sum: torch.Tensor, bias: torch.Tensor | None,
                    out: OutGrid | None, relu: bool, u8: bool, cache: dict[str, Any] | None) -> torch.Tensor | None:
    """``cuda_fused``'s static epilogue on ``_int_mm``'s ``acc``: float32 ``(M, N)``, or the output codes."""
    n = acc.shape[1]
    zx = x.zero_point - 128 if u8 else x.zero_point
    scale = x.scale * weight.scale
    b = bias if bias is not None else _zeros(n, acc.device, cache)
    if out is None:
        lo = _zeros(1, acc.device, cache, 0.0 if relu else float("-inf"))  # (1,): broadcast by torch.maximum
        return cuda_fused.static_float(acc, zx, w_sum, scale, b, lo)
    qd = out.qdtype
    if qd.storage not in (torch.uint8, torch.int8):  # (a 32-bit grid's bounds are not exact in float32)
        return None
    grid = cuda_fused.grid_tensors(out.scale, out.zero_point, qd.quant_min, qd.quant_max, relu, acc.device)
    return cuda_fused.static_codes(acc, zx, w_sum, scale, b, grid, qd.storage)


def _zeros(n: int, device: torch.device, cache: dict[str, Any] | None, value: float = 0.0) -> torch.Tensor:
    """A float32 ``(n,)`` tensor of ``value`` on ``device``, kept in the weight's cache (the fused epilogue's no-bias)."""
    key = ("int_mm.fill", n, device, value)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        hit = torch.full((n,), value, dtype=torch.float32, device=device)
        if cache is not None:
            cache[key] = hit
    return hit


def conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None,
         relu: bool = False, cache: dict[str, Any] | None = None) -> Any:
    """Declined: the dispatcher falls back to the reference conv."""
    return NotImplemented
