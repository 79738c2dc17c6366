"""Integer codes ``clamp(round(v + z), lo, hi)`` of float32 ``v`` in one vectorised pass: torch's quantize at scale 1.

lowbit quantizes ``x`` as ``round(fl(fl(x · inv) + z))`` (two float32 roundings, then round half to even,
DESIGN §2), and requantizes a kernel's float output the same way. After ``v = x · inv``, the rest —
add, round, clamp, cast to 8 bits — is four elementwise passes (the float → uint8 cast a scalar loop in
torch's CPU kernels). ``torch.quantize_per_tensor(v, 1.0, z)`` does it in one: it computes
``round(fma(v, 1/1, z))``, and with a scale of exactly 1 the fused multiply-add rounds ``v · 1 + z = v + z``
once, which *is* the float32 addition ``fl(v + z)``; it rounds half to even, clamps to the 8-bit storage
range and stores. The codes leave the quantized tensor through ``int_repr`` (a copy, itself a scalar loop:
up to 4096 codes) or as a plain tensor on its storage (no copy)::

    codes(v, z, lo, hi)  =  quantize_per_tensor(clamp(v, lo - z, hi - z), 1.0, z).int_repr()
                         =  clamp(round_half_even(fl(v + z)), lo, hi)          (bit for bit)

The clamp runs only on a side where ``[lo, hi]`` is narrower than the storage (a 7-bit grid, a ReLU floor);
clamping ``v`` before adding ``z`` is the same as clamping the codes after (``round(fl(v + z))`` is monotone
in ``v`` and ``lo - z``, ``hi - z`` are exact). With a *real* scale torch's one rounding of ``fma(x, 1/s, z)``
differs from lowbit's two next to ties (``functional``), which is why ``v = x · inv`` stays lowbit's own op.

A build whose ``quantize_per_tensor`` rounds ``v`` before adding ``z`` (fbgemm's non-legacy ``Quantize``,
ATen's generic ``quantize_val``: ``round(v) + z``) would give other codes at ties: ``exact()`` checks, once
per process, ties, their float32 neighbours, infinities and values past int32 on vector bodies and tails,
and ``codes`` adds ``z`` itself where ``z`` must not be fused, and falls back to the four float ops where
even that fails. NaN is not handled (callers check for it or cannot produce it).

>>> import torch
>>> codes(torch.tensor([-0.5, 0.5, 1.5, 2.5, 300.0]), 3, 0, 255, torch.uint8).tolist()
[2, 4, 4, 6, 255]
>>> codes(torch.tensor([-0.5, 0.5, 1.5, 200.0]), 3, 0, 127, torch.uint8).tolist()
[2, 4, 4, 127]
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["codes", "exact", "plain"]

_TORCH_Q = {torch.uint8: (torch.quint8, 0, 255), torch.int8: (torch.qint8, -128, 127)}
_QUIET = [False]  # torch warns once per process about quantized tensors: keep it from users


def _qpt(v: torch.Tensor, z: int, dtype: torch.dtype) -> torch.Tensor:
    if _QUIET[0]:
        return torch.quantize_per_tensor(v, 1.0, z, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.quantize_per_tensor(v, 1.0, z, dtype)
    _QUIET[0] = True
    return t


def _probe() -> torch.Tensor:
    """Ties ``k + 0.5``, their float32 neighbours, random values, infinities and values past int32."""
    half = torch.arange(-700, 700, dtype=torch.float32) / 2
    g = torch.Generator().manual_seed(0)
    far = torch.tensor([3e9, -3e9, 1e20, -1e20, float("inf"), -float("inf"), 2.0**31, -(2.0**31), 0.0, -0.0])
    return torch.cat([half, torch.nextafter(half, torch.tensor(1e9)), torch.nextafter(half, torch.tensor(-1e9)),
                      torch.randn(4000, generator=g) * 200, far])


@functools.lru_cache(maxsize=None)
def exact(fused: bool) -> bool:
    """Whether ``quantize_per_tensor(v, 1.0, z)`` (``fused``) or ``quantize_per_tensor(fl(v + z), 1.0, 0)`` gives
    ``clamp(round_half_even(fl(v + z)))`` for every probe value, zero point and length here (checked once)."""
    with torch.inference_mode(False):
        v = _probe()
        for storage, (dtype, lo, hi) in _TORCH_Q.items():
            for z in (0, 1, 3, 64, 127) + ((128, 255) if storage == torch.uint8 else (-128, -3)):
                want = torch.add(v, float(z)).round_().clamp_(lo, hi).to(storage)
                for n in (v.numel(), 1, 7, 9, 17, 33):
                    u = v[-n:] if n < v.numel() else v  # tails: the far values sit at the end
                    got = _qpt(u, z, dtype) if fused else _qpt(torch.add(u, float(z)), 0, dtype)
                    if not torch.equal(got.int_repr(), want[-n:] if n < v.numel() else want):
                        return False
    return True


def codes(v: torch.Tensor, z: int, lo: int, hi: int, storage: torch.dtype, native: bool = False) -> torch.Tensor:
    """``clamp(round_half_even(fl(v + z)), lo, hi)`` in ``storage``; ``v`` (float32) may be overwritten.

    ``z`` an int in ``storage``'s range and ``[lo, hi]`` inside it for the one-pass route (8-bit CPU storage);
    anything else takes ``v + z``, ``round``, ``clamp`` and a cast, the same codes. ``native``: on the fused
    one-pass route with ``v`` contiguous, the torch quantized tensor itself (scale 1, zero point ``z``; a
    ``QTensor``'s ``tu``), not its plain codes.
    """
    spec = _TORCH_Q.get(storage)
    if spec is None or not v.is_cpu or not spec[1] <= z <= spec[2]:
        return _slow(v, z, lo, hi, storage)
    dtype, smin, smax = spec
    if lo > smin or hi < smax:
        v = v.clamp_(lo - z if lo > smin else None, hi - z if hi < smax else None)
    perm = None
    if not v.is_contiguous():  # e.g. a channels-last conv output: store in its own memory order (as .to() does)
        perm = sorted(range(v.dim()), key=lambda i: -v.stride(i))
        v = v.permute(perm)
        if not v.is_contiguous():
            return _slow(v, z, lo, hi, storage).permute(_inverse(perm))
    if exact(True):
        if native and perm is None:
            return _qpt(v, z, dtype)
        q = plain(_qpt(v, z, dtype), storage)
    elif exact(False):
        q = plain(_qpt(v.add_(z), 0, dtype), storage)
    else:
        q = _slow(v, z, lo, hi, storage)
    return q if perm is None else q.permute(_inverse(perm))


_VIEW_ABOVE = 4096  # codes above which the storage view (~3 µs flat) beats int_repr's copy (a scalar loop)


def plain(qt: torch.Tensor, storage: torch.dtype, shared: bool = False) -> torch.Tensor:
    """The codes of a contiguous 8-bit torch quantized tensor (e.g. an fbgemm output) as a plain ``storage``
    tensor: ``int_repr`` (a copy) when small, else (or ``shared``) the same memory (``set_`` on its storage)."""
    if qt.numel() <= _VIEW_ABOVE and not shared:
        return qt.int_repr()
    return torch.empty(0, dtype=storage).set_(qt.untyped_storage(), qt.storage_offset(), qt.shape, qt.stride())


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _slow(v: torch.Tensor, z: int, lo: int, hi: int, storage: torch.dtype) -> torch.Tensor:
    return v.add_(z).round_().clamp_(lo, hi).to(storage)
