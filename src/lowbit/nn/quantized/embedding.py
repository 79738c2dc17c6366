"""Weight-only quantized ``Embedding`` and ``EmbeddingBag``: one grid per table row, 8 or 4 bits.

Row ``i`` of the ``(N, D)`` table is stored as codes ``q[i]`` with its own ``(s_i, z_i)``
(per-row affine by default, so an off-centre row keeps its full resolution)::

    ŵ[i, :] = (q[i, :] - z_i) * s_i                      # q: (N, D) codes, s, z: (N,)
    Embedding(idx)      = ŵ[idx]                         # (*idx, D) float32
    (with ``max_norm``: each looked-up row r scaled by max_norm / (‖r‖_p + 1e-7) where ‖r‖_p > max_norm, as
    nn.Embedding's forward, on the copy: the codes are not changed; torch.ao's quantized tables ignore max_norm)
    EmbeddingBag(idx)   = reduce_{j in bag b} psw_j * ŵ[idx_j]     # (B, D) float32; sum / mean / max

With ``per_channel_affine_float_qparams`` (torch.ao's embedding recipe, ``get_embedding_qconfig(
float_qparams=True)``) ``z_i = qmin - min_i / s_i`` (``-min_i / s_i`` on quint8 / quint4, as torch.ao) is a
float32 and the codes are ``round(w / s_i + z_i)``;
the formula for ``ŵ`` is the same.

Only the gathered rows are dequantized (never the whole table). 4-bit rows (``qdtype=quint4`` or
``qint4``) are packed two codes per byte, low nibble first: ``weight_q`` is ``(N, ceil(D/2))``
uint8. The output is float, as in ``torch.ao`` (rows have different grids, so there is no
common output grid to requantize onto).

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.embedding import Embedding, EmbeddingBag
>>> table = torch.nn.Embedding(10, 4)
>>> qe = Embedding.from_float(table)
>>> idx = torch.tensor([[1, 2], [3, 9]])
>>> qe(idx).shape, bool((qe(idx) - table(idx)).abs().max() < 0.02)
(torch.Size([2, 2, 4]), True)
>>> bag = EmbeddingBag.from_float(torch.nn.EmbeddingBag(10, 4, mode="sum"), dtype=Q.quint4)
>>> bag(torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2])).shape
torch.Size([2, 4])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...compile_state import deferring, refuse, tracing
from ...functional import quantize
from ...observer.distributed import local_statistics
from ...qparams import calculate_qparams
from ...qscheme import QDtype, QScheme, as_qdtype, as_qscheme, quint8
from ...qtensor import QTensor
from ._state import CheckedQuantState
from ._utils import check_finite_weight, check_precomputed_flag, precomputed_source

__all__ = ["Embedding", "EmbeddingBag"]

_MODES = ("sum", "mean", "max")


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` 4-bit codes -> ``(N, ceil(D/2))`` uint8, element ``2k`` in the low nibble."""
    u = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    if u.shape[1] % 2:
        u = F.pad(u, (0, 1))
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack4(packed: torch.Tensor, dim: int, signed: bool) -> torch.Tensor:
    """Inverse of ``_pack4``: ``(n, ceil(D/2))`` uint8 -> ``(n, D)`` codes (int8 if ``signed``, else uint8)."""
    u = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])[:, :dim]
    if signed:
        return (u.to(torch.int8) ^ 8) - 8  # sign-extend the nibble: 8..15 -> -8..-1
    return u


def _row_qparams(weight: torch.Tensor, mod: nn.Module | None, qdtype: QDtype | None,
                 qscheme: QScheme = QScheme.PER_CHANNEL_AFFINE, precomputed: bool = False,
                 where: str = "") -> tuple[torch.Tensor, torch.Tensor, QDtype]:
    """Per-row ``(scale (N,), zero_point (N,), qdtype)`` for a float table.

    Priority: an explicit ``qdtype`` (per-row min/max on ``qscheme``), else the module's QAT
    ``weight_fake_quant``, else its ``qconfig.weight()`` observer, else per-row affine quint8.
    A per-tensor observer's qparams are broadcast to every row. Zero points are int64, or float32
    for ``per_channel_affine_float_qparams``. ``precomputed``: the ``weight_fake_quant``'s grid as it stands, not fed
    the table again (``_utils.precomputed_source``, errors naming ``where``).
    """
    w = weight.detach().to(torch.float32)
    source = None
    if qdtype is None and mod is not None and precomputed:
        source = precomputed_source(mod, where)
    if qdtype is None and mod is not None and source is None:
        source = getattr(mod, "weight_fake_quant", None)
        qconfig = getattr(mod, "qconfig", None)
        if source is None and qconfig is not None and getattr(qconfig, "weight", None) is not None:
            source = qconfig.weight()
        if source is not None:
            source(w)
    if source is None:
        qdtype = qdtype or quint8
        scale, zp = calculate_qparams(w.amin(1), w.amax(1), qscheme, qdtype)
        return scale, zp, qdtype
    with local_statistics():  # a replicated table: no collective
        scale, zp = source.calculate_qparams()
    qdtype = as_qdtype(source.qdtype)
    if scale.numel() == 1:
        scale, zp = scale.reshape(1).expand(w.shape[0]), zp.reshape(1).expand(w.shape[0])
    elif getattr(source, "ch_axis", 0) not in (0, -2):
        raise ValueError(f"embedding weight observer has ch_axis={source.ch_axis}; rows need ch_axis=0")
    zp_dtype = torch.float32 if getattr(source, "qscheme", None) is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS else torch.int64
    return scale.to(w.device, torch.float32).contiguous(), zp.to(w.device, zp_dtype).contiguous(), qdtype


def _check_max_norm(name: str, max_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    """``max_norm`` None or a finite number > 0, ``norm_type`` a number > 0, ``inf`` included (the max norm, as
    ``nn.Embedding`` takes it) (as floats)."""
    for arg, v in (("max_norm", max_norm), ("norm_type", norm_type)):
        if v is None and arg == "max_norm":
            continue
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
              and (math.isfinite(v) or (arg == "norm_type" and v == math.inf)))
        if not ok:
            raise ValueError(f"{name}: {arg}={v!r} must be " + ("a finite number > 0 or None" if arg == "max_norm"
                                                                  else "a number > 0 (inf: the max norm)"))
    return (None if max_norm is None else float(max_norm)), float(norm_type)


class _QuantizedTable(CheckedQuantState):
    """The shared table storage: buffers ``weight_q``, ``weight_scale`` (N,), ``weight_zero_point`` (N,)."""

    _weight_grids = ("qdtype",)  # (a checkpoint's metadata: the weight grid's kind must match, its range may be narrower)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None,
                 qdtype: QDtype | str | torch.dtype, qscheme: QScheme | str = QScheme.PER_CHANNEL_AFFINE,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
        super().__init__()
        name = type(self).__name__
        self.max_norm, self.norm_type = _check_max_norm(name, max_norm, norm_type)
        for arg, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: {arg}={v!r} must be a positive int")
        if padding_idx is not None:
            ok = isinstance(padding_idx, int) and not isinstance(padding_idx, bool)
            if not ok or not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx={padding_idx!r} is out of range for {num_embeddings} embeddings")
            padding_idx %= num_embeddings
        self.qdtype, self.qscheme = as_qdtype(qdtype), as_qscheme(qscheme)
        if self.qscheme not in (QScheme.PER_CHANNEL_AFFINE, QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS):
            raise ValueError(f"{name}: qscheme={self.qscheme.value} must be per_channel_affine or "
                             "per_channel_affine_float_qparams (one grid per row)")
        if self.qdtype.bits not in (4, 8):
            raise ValueError(f"{name}: qdtype={self.qdtype!r} must be an 8-bit or 4-bit dtype")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        cols = (embedding_dim + 1) // 2 if self.qdtype.bits == 4 else embedding_dim
        storage = torch.uint8 if self.qdtype.bits == 4 else self.qdtype.storage
        self.register_buffer("weight_q", torch.zeros(num_embeddings, cols, dtype=storage))
        self.register_buffer("weight_scale", torch.ones(num_embeddings, dtype=torch.float32))
        zp_dtype = torch.float32 if self.qscheme.has_float_zero_point else torch.int64
        self.register_buffer("weight_zero_point", torch.zeros(num_embeddings, dtype=zp_dtype))
        # the dtype of the vectors looked up: from_float takes the float table's (a bf16 / fp16 model's next layer
        # refused float32 rows); rows are dequantized and reduced in float32. Like the grid, .half() / .float() of the
        # converted model leave it as it is (CheckedQuantState); not in the state_dict
        self.out_dtype = torch.float32
        self.set_weight(torch.zeros(num_embeddings, embedding_dim))

    def set_weight(self, weight: torch.Tensor | QTensor) -> None:
        """Store a float ``(N, D)`` table (per-row affine on ``self.qdtype``) or a per-row QTensor."""
        shape = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{type(self).__name__}.set_weight: weight shape {tuple(weight.shape)} != {shape}")
        if isinstance(weight, QTensor):
            if weight.axis not in (0, None) or weight.qdtype.bits != self.qdtype.bits:
                raise ValueError(f"{type(self).__name__}.set_weight: need a per-row (axis 0) {self.qdtype.bits}-bit "
                                 f"QTensor, got axis={weight.axis}, qdtype={weight.qdtype!r}")
            codes, n = weight.int_repr(), self.num_embeddings
            scale, zp = weight.scale.expand(n) if weight.axis is None else weight.scale, weight.zero_point
            zp = zp.expand(n) if weight.axis is None else zp
            self.qdtype = weight.qdtype
            self.qscheme = (QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS if zp.is_floating_point()
                            else QScheme.PER_CHANNEL_AFFINE)
        else:
            if not weight.is_floating_point():
                raise TypeError(f"{type(self).__name__}.set_weight: weight must be float, got {weight.dtype}")
            check_finite_weight(weight, f"{type(self).__name__}.set_weight")
            scale, zp, _ = _row_qparams(weight, None, self.qdtype, self.qscheme)
            codes = quantize(weight.detach(), scale, zp, self.qdtype, ch_axis=0)
        self.weight_q = _pack4(codes) if self.qdtype.bits == 4 else codes.to(self.qdtype.storage).contiguous()
        self.weight_scale = scale.to(torch.float32).contiguous()
        self.weight_zero_point = zp.to(torch.float32 if zp.is_floating_point() else torch.int64).contiguous()

    def _codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.weight_q if rows is None else self.weight_q.index_select(0, rows)
        if self.qdtype.bits == 4:
            return _unpack4(packed, self.embedding_dim, self.qdtype.signed)
        return packed

    def weight(self) -> QTensor:
        """The table as a per-row (axis 0) QTensor of unpacked codes: copies, as torch.ao's unpacked weight (writing
        to them leaves the table as it is)."""
        codes = self._codes()
        return QTensor(codes.clone() if self.qdtype.bits != 4 else codes, self.weight_scale.clone(),
                       self.weight_zero_point.clone(), self.qdtype, axis=0)

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``(n, D)`` float32 for a flat index tensor ``idx`` (n,)."""
        name = type(self).__name__
        if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            bad = f"{name}: indices must be an integer tensor, got " + (
                f"dtype {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__)
            if isinstance(idx, torch.Tensor) and deferring():  # torch.compile: raised by the compiled program
                return refuse(TypeError, bad, self._rows(torch.zeros(idx.shape, dtype=torch.int64, device=idx.device)),
                              idx)
            raise TypeError(bad)
        # (while torch.compile / torch.export trace, the values are symbolic: under torch.compile the program checks
        # them (lowbit::checked_ids, eager's IndexError); an exported program's index_select bounds-checks at run time)
        idx = torch.ops.lowbit.checked_ids(idx, self.num_embeddings, name) if deferring() else idx.to(torch.int64)
        if not tracing() and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_embeddings):
            bad = idx[(idx < 0) | (idx >= self.num_embeddings)][0].item()
            raise IndexError(f"{name}: index {bad} is out of range for {self.num_embeddings} embeddings")
        codes = self._codes(idx).to(torch.float32)
        z = self.weight_zero_point.index_select(0, idx).to(torch.float32)
        rows = (codes - z[:, None]) * self.weight_scale.index_select(0, idx)[:, None]
        if self.max_norm is not None:  # as nn.Embedding's forward (and the QAT module's, on its fake-quantized table):
            with torch.no_grad():  # rows longer than max_norm scaled to it, on this copy, not the stored codes
                torch.embedding_renorm_(rows, torch.arange(rows.shape[0], device=rows.device), self.max_norm,
                                        self.norm_type)
        return rows

    def _adopt_zero_points(self, state_dict: dict[str, Any], prefix: str) -> tuple[torch.Tensor, QScheme]:
        """Take the checkpoint's zero-point dtype (a float-qparams table keeps float zero points); return what to
        restore when the load is refused."""
        zp = state_dict.get(prefix + "weight_zero_point")
        old = self.weight_zero_point, self.qscheme
        if isinstance(zp, torch.Tensor) and zp.dtype != self.weight_zero_point.dtype:
            self.weight_zero_point = torch.zeros_like(self.weight_zero_point, dtype=zp.dtype)
            self.qscheme = (QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS if zp.is_floating_point()
                            else QScheme.PER_CHANNEL_AFFINE)
        return old

    def _state_errors(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> list[str]:
        old = self._adopt_zero_points(state_dict, prefix)
        try:
            return super()._state_errors(state_dict, prefix, local_metadata)
        finally:
            self.weight_zero_point, self.qscheme = old

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        old = self._adopt_zero_points(state_dict, prefix)
        n = len(error_msgs)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        except ValueError:  # refused: the table keeps its own zero points and scheme, not the swapped ones
            self.weight_zero_point, self.qscheme = old
            raise
        if len(error_msgs) > n:
            self.weight_zero_point, self.qscheme = old

    def _check_float(self, mod: nn.Module, want: type) -> None:
        if not isinstance(mod, want):
            raise TypeError(f"{type(self).__name__}.from_float expects an nn.{want.__name__}, got {type(mod).__name__}")

    def extra_repr(self) -> str:
        kind = "per_row_float_qparams" if self.qscheme.has_float_zero_point else "per_row_affine"
        s = f"{self.num_embeddings}, {self.embedding_dim}, qdtype={self.qdtype!r}, qscheme={kind}"
        s += f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        s += f", max_norm={self.max_norm}, norm_type={self.norm_type}" if self.max_norm is not None else ""
        return s + (f", out_dtype={self.out_dtype}" if self.out_dtype != torch.float32 else "")


class Embedding(_QuantizedTable):
    """``ŵ[indices]``: ``(*)`` int indices -> ``(*, embedding_dim)`` float32 from a per-row quantized table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 qdtype: QDtype | str | torch.dtype = quint8, qscheme: QScheme | str = QScheme.PER_CHANNEL_AFFINE,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, qdtype, qscheme, max_norm, norm_type)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = self._rows(indices.reshape(-1) if isinstance(indices, torch.Tensor) else indices)
        return rows.reshape(*indices.shape, self.embedding_dim).to(self.out_dtype)

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype | None = None,
                   use_precomputed_fake_quant: bool = False) -> Embedding:
        """Quantize ``mod.weight`` per row (``dtype`` overrides the module's qconfig / fake-quant)."""
        if not isinstance(mod, nn.Embedding):
            raise TypeError(f"Embedding.from_float expects an nn.Embedding, got {type(mod).__name__}")
        check_finite_weight(mod.weight, "Embedding.from_float")  # observers skip NaN: a silent wrong row
        pre = check_precomputed_flag(use_precomputed_fake_quant, "Embedding.from_float")
        scale, zp, qdtype = _row_qparams(mod.weight, mod, None if dtype is None else as_qdtype(dtype), precomputed=pre,
                                         where="Embedding.from_float")
        q = cls(mod.num_embeddings, mod.embedding_dim, mod.padding_idx, qdtype, max_norm=mod.max_norm,
                norm_type=mod.norm_type)
        q.set_weight(QTensor(quantize(mod.weight.detach().float(), scale, zp, qdtype, 0), scale, zp, qdtype, 0))
        q.out_dtype = mod.weight.dtype
        return q


def _check_offsets(offsets: torch.Tensor, n: int, include_last: bool) -> None:
    """Bag offsets torch's kernel can take: integers, starting at 0, non-decreasing, none past ``n`` inputs (with
    ``include_last_offset``: at least two, the last one ``n``). torch reads out of bounds (or crashes) otherwise."""
    if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
        raise TypeError(f"EmbeddingBag: offsets must be an integer tensor, got dtype {offsets.dtype}")
    if include_last and offsets.numel() < 2:
        raise ValueError(f"EmbeddingBag: include_last_offset needs at least 2 offsets (start and end), got {offsets.numel()}")
    if offsets.numel() == 0:
        raise ValueError("EmbeddingBag: offsets is empty; give the start of each bag")
    if tracing():  # (values are symbolic while torch.compile / torch.export trace)
        return
    o = offsets.detach().to(torch.int64).cpu()
    if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n or (include_last and int(o[-1]) != n):
        raise ValueError(f"EmbeddingBag: offsets {o.tolist()[:8]}{' ...' if o.numel() > 8 else ''} must start at 0, "
                         f"never decrease and stay within the {n} inputs" + (" (the last one = the input count, with "
                                                                              "include_last_offset)" if include_last else ""))


class EmbeddingBag(_QuantizedTable):
    """Pooled bags of rows: ``(B, L)`` indices, or ``(n,)`` indices + ``(B,)`` offsets -> ``(B, embedding_dim)``.

    ``mode`` is ``'sum'``, ``'mean'`` or ``'max'``; ``per_sample_weights`` (``'sum'`` only) scale
    each row; ``padding_idx`` rows are left out of their bag (and of the mean's count); an empty
    bag gives zeros. ``include_last_offset`` as in ``nn.EmbeddingBag``. Reduction is float32.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", padding_idx: int | None = None,
                 include_last_offset: bool = False, qdtype: QDtype | str | torch.dtype = quint8,
                 qscheme: QScheme | str = QScheme.PER_CHANNEL_AFFINE, max_norm: float | None = None,
                 norm_type: float = 2.0) -> None:
        if mode not in _MODES:
            raise ValueError(f"EmbeddingBag: mode={mode!r} must be one of {_MODES}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, qdtype, qscheme, max_norm, norm_type)
        self.mode, self.include_last_offset = mode, bool(include_last_offset)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"EmbeddingBag: input must be an integer tensor, got {type(input).__name__}")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"EmbeddingBag: per_sample_weights need mode='sum', this bag has mode={self.mode!r}")
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
                raise TypeError("EmbeddingBag: per_sample_weights must be a floating-point tensor, got "
                                + (f"dtype {per_sample_weights.dtype}" if isinstance(per_sample_weights, torch.Tensor)
                                   else type(per_sample_weights).__name__))
            if per_sample_weights.shape != input.shape:
                raise ValueError(f"EmbeddingBag: per_sample_weights shape {tuple(per_sample_weights.shape)} "
                                 f"!= input shape {tuple(input.shape)}")
            per_sample_weights = per_sample_weights.reshape(-1).to(torch.float32)
        include_last = self.include_last_offset
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("EmbeddingBag: offsets must be None for a 2-D input (each row is a bag)")
            bags, length = input.shape
            offsets = torch.arange(bags, device=input.device) * length  # (B, 0): B empty bags, zeros
            include_last = False
        elif input.dim() == 1:
            if offsets is None or not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
                raise ValueError("EmbeddingBag: a 1-D input needs 1-D offsets (the start of each bag)")
            _check_offsets(offsets, input.numel(), include_last)
        else:
            bad = "EmbeddingBag: input must be 1-D (with offsets) or 2-D, got shape {shape}"
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), on one bag's stand-in
                return refuse(ValueError, bad, self(torch.zeros(1, 1, dtype=torch.int64, device=input.device)), input)
            raise ValueError(bad.format(shape=tuple(input.shape)))
        flat = input.reshape(-1)
        rows = self._rows(flat)  # (n, D): only the gathered rows are dequantized
        local = torch.arange(flat.numel(), device=flat.device)
        pad = None
        if self.padding_idx is not None:  # route padding entries to an extra zero row that torch skips
            pad = flat.numel()
            local = torch.where(flat == self.padding_idx, pad, local)
            rows = torch.cat([rows, rows.new_zeros(1, self.embedding_dim)])
        return F.embedding_bag(local, rows, offsets.to(torch.int64), mode=self.mode,
                               per_sample_weights=per_sample_weights, include_last_offset=include_last,
                               padding_idx=pad).to(self.out_dtype)

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype | None = None,
                   use_precomputed_fake_quant: bool = False) -> EmbeddingBag:
        """Quantize ``mod.weight`` per row; copies ``mode``, ``padding_idx``, ``include_last_offset``, ``max_norm``."""
        if not isinstance(mod, nn.EmbeddingBag):
            raise TypeError(f"EmbeddingBag.from_float expects an nn.EmbeddingBag, got {type(mod).__name__}")
        check_finite_weight(mod.weight, "EmbeddingBag.from_float")
        pre = check_precomputed_flag(use_precomputed_fake_quant, "EmbeddingBag.from_float")
        scale, zp, qdtype = _row_qparams(mod.weight, mod, None if dtype is None else as_qdtype(dtype), precomputed=pre,
                                         where="EmbeddingBag.from_float")
        q = cls(mod.num_embeddings, mod.embedding_dim, mod.mode, mod.padding_idx, mod.include_last_offset, qdtype,
                max_norm=mod.max_norm, norm_type=mod.norm_type)
        q.set_weight(QTensor(quantize(mod.weight.detach().float(), scale, zp, qdtype, 0), scale, zp, qdtype, 0))
        q.out_dtype = mod.weight.dtype
        return q

    def extra_repr(self) -> str:
        last = ", include_last_offset=True" if self.include_last_offset else ""
        return super().extra_repr() + f", mode={self.mode!r}" + last
