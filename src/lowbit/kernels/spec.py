"""Plain-data descriptions shared by every kernel backend: the output grid and the conv geometry.

>>> import lowbit as Q
>>> from lowbit.kernels import OutGrid, ConvSpec
>>> OutGrid(0.1, 3, Q.quint8).torch_storage
torch.uint8
>>> ConvSpec(2, (1, 1), (1, 1), (1, 1), 1).transposed
False
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from ..qscheme import QDtype
from ..qtensor import QTensor

__all__ = ["OutGrid", "ConvSpec"]


@dataclass(frozen=True)
class OutGrid:
    """A per-tensor output grid: ``q = clamp(round(y / scale) + zero_point, qmin, qmax)``."""

    scale: float
    zero_point: int
    qdtype: QDtype
    # optional 0-d tensors of scale / zero_point on the output device, reused by every output QTensor
    scale_t: torch.Tensor | None = field(default=None, compare=False, repr=False)
    zero_point_t: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def wrap(self, codes: torch.Tensor, tq: torch.Tensor | None = None) -> QTensor:
        """``codes`` (already on this grid) as a ``QTensor``; ``tq``: a torch quantized tensor on this grid whose
        storage holds ``codes`` (a kernel's output viewed by ``qstore.plain``), kept on the QTensor."""
        if self.scale_t is not None and self.zero_point_t is not None and self.scale_t.device == codes.device:
            return QTensor._trusted(codes, self.scale_t, self.zero_point_t, self.qdtype, None, tq)  # checked in __post_init__
        scale = self.scale if self.scale_t is None else self.scale_t
        zp = self.zero_point if self.zero_point_t is None else self.zero_point_t
        return QTensor(codes, scale, zp, self.qdtype)

    def wrap_store(self, t: torch.Tensor) -> QTensor:
        """``qstore.codes(..., native=True)``'s result as a ``QTensor``: a torch quantized tensor on scale 1 and this
        zero point kept as it is (``tu``: its plain codes made only when read), or plain codes (``wrap``)."""
        if not t.is_quantized:
            return self.wrap(t)
        if self.scale_t is not None and self.zero_point_t is not None and self.scale_t.device == t.device:
            return QTensor._trusted(None, self.scale_t, self.zero_point_t, self.qdtype, None, None, t)
        return self.wrap(t.int_repr())

    def __post_init__(self) -> None:
        for t, dtype, name in ((self.scale_t, torch.float32, "scale_t"), (self.zero_point_t, torch.int64, "zero_point_t")):
            if t is not None and (t.dim() != 0 or t.dtype != dtype):
                raise ValueError(f"OutGrid: {name} must be a 0-d {dtype} tensor, got {t.dtype} of shape {tuple(t.shape)}")

    @property
    def torch_storage(self) -> torch.dtype:
        return self.qdtype.storage

    @functools.cached_property
    def full_range(self) -> bool:
        """Whether the grid spans its whole 8-bit storage (no extra clamp needed after a kernel)."""
        info = torch.iinfo(self.qdtype.storage)
        return (self.qdtype.quant_min, self.qdtype.quant_max) == (info.min, info.max)

    def onednn_post(self, relu: bool) -> tuple[str, list[float], bool]:
        """oneDNN's post-op for a u8 output on this grid: ``(post, scalars, clamp_after)``. A grid narrower than the u8
        storage (a 7-bit grid) is clamped by the ``hardtanh`` post-op at ``((q_min - z) s, (q_max - z) s)`` (with ReLU
        the lower bound at least 0) instead of a second pass over the codes: the requantization ``round(y / s + z)`` is
        monotone in ``y`` and maps the bounds to within float rounding (≤ 255 · 3 · 2⁻²⁴ ≪ ½) of ``q_min`` / ``q_max``,
        so clamping before it gives the codes clamping after it gives. ``clamp_after``: the clamp stays a pass after
        the call (an int8 output, or a zero point above the grid's top with ReLU, where every code is ``q_max``).

        >>> import lowbit as Q
        >>> OutGrid(0.5, 10, Q.quint8.with_range(0, 127)).onednn_post(False)
        ('hardtanh', [-5.0, 58.5], False)
        >>> OutGrid(0.5, 10, Q.quint8).onednn_post(True)
        ('relu', [], False)
        """
        post = "relu" if relu else "none"
        if self.full_range:
            return post, [], False
        if self.qdtype.storage != torch.uint8:
            return post, [], True
        qd, s, z = self.qdtype, self.scale, self.zero_point
        lo, hi = (qd.quant_min - z) * s, (qd.quant_max - z) * s
        lo = max(lo, 0.0) if relu else lo
        return ("hardtanh", [lo, hi], False) if lo <= hi else (post, [], True)


@dataclass(frozen=True)
class ConvSpec:
    """Geometry of an N-d (transposed) convolution with explicit, symmetric integer padding."""

    dim: int
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: tuple[int, ...] = ()


def padded_windows(weight_shape: torch.Size | tuple[int, ...], spec: ConvSpec) -> bool:
    """Whether oneDNN's int8 conv gives wrong codes for this geometry: one input channel per group, several output
    channels per group (a depthwise conv with a channel multiplier), and a padding at least the dilated kernel's extent
    (output pixels whose window lies wholly in the padding). torch's own x86 / onednn engines return run-to-run
    different codes there (off by up to 200, session 36); fbgemm's and lowbit's native kernels do not."""
    if spec.transposed or spec.groups <= 1 or weight_shape[1] != 1 or weight_shape[0] == spec.groups:
        return False
    return any(p >= d * (k - 1) + 1 for p, d, k in zip(spec.padding, spec.dilation, weight_shape[2:]))


def odd_windows(in_shape: torch.Size | tuple[int, ...], weight_shape: torch.Size | tuple[int, ...], spec: ConvSpec) -> bool:
    """Whether oneDNN's int8 conv reads past its input for an input of ``in_shape`` ``(N, C, *spatial)``: along some
    spatial axis the padding is at least the input's extent, or an output window's taps all fall in the padding (a
    padding past the dilated kernel, or dilation gaps around a small input). torch's x86 / onednn engines crash there
    (SIGSEGV) or return run-to-run different sums (off by up to ~1.5e6 codes), dense, grouped and depthwise, 1-d to 3-d
    (session 37: 236 of ~10,600 random small geometries, every one inside this rule; the same codes padded with
    ``z_x`` first were right in all). Includes ``padded_windows``'s geometry at every input size.

    >>> spec = ConvSpec(1, (3,), (4,), (3,), 1)
    >>> odd_windows((1, 1, 1), (1, 1, 1), spec), odd_windows((1, 1, 9), (1, 1, 1), spec)   # window 0 reads padding only
    (True, True)
    >>> odd_windows((1, 8, 5, 5), (8, 8, 3, 3), ConvSpec(2, (1, 1), (1, 1), (1, 1), 1))
    False
    """
    if spec.transposed:
        return False
    for n, k, s, d, p in zip(in_shape[2:], weight_shape[2:], spec.stride, spec.dilation, spec.padding):
        ext = d * (k - 1) + 1
        if p == 0 or (d <= n and p < min(n, ext)):  # every window's span meets the input, taps ≤ d apart: a tap in it
            continue
        if p >= n:
            return True
        out = (n + 2 * p - ext) // s + 1
        first_inner = -(-p // s)  # windows from here to (p + n - ext) // s lie inside the input and meet it
        border = [*range(min(first_inner, out)), *range(max(first_inner, (p + n - ext) // s + 1), out)]
        if any(not any(p <= o * s + t * d < p + n for t in range(k)) for o in border):
            return True
    return False


def strided_column(in_shape: torch.Size | tuple[int, ...], weight_shape: torch.Size | tuple[int, ...],
                   spec: ConvSpec) -> bool:
    """Whether oneDNN's int8 conv may give wrong sums for an input of ``in_shape``: an output one element wide along the
    last spatial axis (W), read with a stride past 1 there. Session 37 found it for one input channel and several output
    channels a group (torch's x86 / onednn engines: run-to-run different sums, off by ~10-60 codes, 13 of 100 such
    random 2-d geometries); on an AMX Xeon (oneDNN's ``brg_conv_fwd:avx10_1_512_amx``, session 47) dense, grouped and
    depthwise convs, 1-d to 3-d, fail too (18 of 480 random one-wide strided geometries, off by up to 255 codes; none
    of 625 others). The same window read with stride 1 (``one_column``) was right in all, so every such geometry
    takes it, on every CPU (a one-wide output: a copy of at most the window's columns).

    >>> strided_column((1, 8, 9, 5), (8, 8, 4, 4), ConvSpec(2, (1, 2), (0, 0), (1, 1), 1))   # (5 - 4) // 2 == 0
    True
    >>> strided_column((1, 8, 9, 6), (8, 8, 4, 4), ConvSpec(2, (1, 2), (0, 0), (1, 1), 1))   # two columns
    False
    """
    if spec.transposed or spec.stride[-1] == 1:
        return False
    ext = spec.dilation[-1] * (weight_shape[-1] - 1) + 1
    return (in_shape[-1] + 2 * spec.padding[-1] - ext) // spec.stride[-1] == 0


MULTIPLIER_CHUNK = 32  # output channels a group per oneDNN call where one input channel a group feeds more


def wide_multiplier(weight_shape: torch.Size | tuple[int, ...], spec: ConvSpec, amx: bool = False) -> bool:
    """Whether oneDNN's int8 conv gives wrong sums for this weight: several groups and more than ``MULTIPLIER_CHUNK``
    output channels a group, with one input channel a group (a depthwise conv with a channel multiplier past 32) or,
    where oneDNN runs its AMX kernels (``amx``: ``isa.has_amx()``), any number. On an AVX-512 VNNI CPU torch's
    ``qconv_pointwise`` returned sums off by ~3e4 to ~2e9 (uninitialised reads) for multipliers 33-48 and 65-79
    (session 38, 1-d to 3-d; 49-64 and ≤ 32 right; none under ``ONEDNN_MAX_CPU_ISA=AVX2``). On an AMX Xeon (session
    47) grouped convs with 2-16 input channels a group were wrong too (codes off by up to 234) at 40, 48, 72 and 200
    outputs a group (22 of 600 random grouped geometries; none at ≤ 32, 64 or 128, none ungrouped); the transposed
    convs' phase-stacked convs (``conv_transpose``) meet it. Such a conv runs in calls of at most ``MULTIPLIER_CHUNK``
    channels a group (``onednn.conv``), the same sums.

    >>> wide_multiplier((72, 1, 3, 3), ConvSpec(2, (1, 1), (0, 0), (1, 1), 2)), wide_multiplier((64, 1, 3, 3),
    ...     ConvSpec(2, (1, 1), (0, 0), (1, 1), 2))
    (True, False)
    >>> wide_multiplier((80, 2, 3, 3), ConvSpec(2, (1, 1), (0, 0), (1, 1), 2), amx=True), wide_multiplier(
    ...     (80, 2, 3, 3), ConvSpec(2, (1, 1), (0, 0), (1, 1), 2))
    (True, False)
    """
    return (not spec.transposed and spec.groups > 1 and (weight_shape[1] == 1 or amx)
            and weight_shape[0] > MULTIPLIER_CHUNK * spec.groups)


def one_column(x: QTensor, weight_shape: torch.Size | tuple[int, ...], spec: ConvSpec) -> tuple[QTensor, ConvSpec]:
    """A conv one output wide along the last axis (``strided_column``) as the same sums read with stride 1 there: ``x``
    padded with its zero point (``pad_codes``) and cropped to the one window's extent along the last axis, the spec
    unpadded with a unit last stride."""
    ext = spec.dilation[-1] * (weight_shape[-1] - 1) + 1
    x = pad_codes(x, spec) if any(spec.padding) else x
    codes = x.int_repr()[..., :ext]
    return (QTensor(codes, x.scale, x.zero_point, x.qdtype),
            replace(spec, padding=(0,) * spec.dim, stride=(*spec.stride[:-1], 1)))


def unpadded(spec: ConvSpec) -> ConvSpec:
    """``spec`` with no padding (its input padded by ``pad_codes``)."""
    return replace(spec, padding=(0,) * spec.dim)


def pad_codes(x: QTensor, spec: ConvSpec) -> QTensor:
    """A per-tensor ``x`` padded by ``spec.padding`` with its zero point's code: ``(z_x - z_x) w = 0``, the conv's zero
    padding, so the conv of the result with ``unpadded(spec)`` has the same sums."""
    pad = [p for p in reversed(spec.padding) for _ in (0, 1)]
    codes = torch.nn.functional.pad(x.int_repr(), pad, value=int(x.zero_point.item()))
    return QTensor(codes, x.scale, x.zero_point, x.qdtype)
