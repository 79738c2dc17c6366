"""ONNX twins of 4-bit ``Embedding`` and of ``EmbeddingBag`` (8- and 4-bit rows), loop-free.

Table: the per-row codes become one integer initializer and a ``DequantizeLinear(axis=0)``::

    ŵ = DequantizeLinear(q (N, D), s (N,), z (N,), axis=0)        Embedding(idx) = Gather(ŵ, idx)

4-bit rows are unpacked to one code per byte (UINT8 for ``quint4``, INT8 for ``qint4``, same
values). The TorchScript exporter stops at opset 20; with ``to_onnx(..., opset_version=21)`` the
file is relabelled opset 21 and ``to_int4`` re-stores those codes and zero points as UINT4/INT4
(two codes per byte; ONNX Runtime >= 1.18 dequantizes them). Below opset 21 they stay one per
byte, so the file is no smaller than an 8-bit one (a 1000 x 64 table, measured: 69.5 kB at
opset 17, the size of the 8-bit file; 37.0 kB at opset 21).

EmbeddingBag, with ``seg[j]`` the bag of flat entry ``j`` (``n`` entries, ``B`` bags)::

    2-D input (B, L):  seg[j] = j // L
    1-D input + offsets: seg = CumSum(ScatterElements(zeros(n+1), offsets, 1, add))[:n] - 1
    padding_idx entries, and entries past the last offset with include_last_offset, go to a
    dummy bag B that is dropped; rows r_j = Gather(ŵ, idx)[j] (* per_sample_weights[j]);
    sum  = ScatterElements(zeros(B+1, D), seg, r, add)[:B]
    mean = sum / max(count, 1),  count = ScatterElements(zeros(B+1), seg, 1, add)
    max  = where(count > 0, ScatterElements(-inf, seg, r, max), 0)     (opset >= 18)

so an empty bag gives 0, as in torch. Bag and entry counts stay dynamic. A table with ``max_norm`` scales each
looked-up row longer than it (``qdq.renorm_rows``: ReduceL1 / L2 / a power sum, Where), as the module does.

>>> import torch
>>> from lowbit.nn.quantized.embedding import EmbeddingBag
>>> bag = EmbeddingBag.from_float(torch.nn.EmbeddingBag(10, 4, mode="max"))
>>> x, off = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 2])
>>> torch.equal(EmbeddingBagTwin(bag)(x, off), bag(x, off))
True
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from .qdq import ConstDQ, check_integer_zero_points, renorm_rows

__all__ = ["EmbeddingBagTwin", "EmbeddingTableTwin", "table_dq", "to_int4"]

MAX_OPSET_MODE = {"sum": 16, "mean": 16, "max": 18}  # ScatterElements reduction add (16), max (18)


class _ScatterFn(torch.autograd.Function):
    """``data`` with ``src`` reduced into rows ``index`` (axis 0, self included); ONNX: one ScatterElements."""

    @staticmethod
    def forward(ctx: Any, data: torch.Tensor, index: torch.Tensor, src: torch.Tensor,  # type: ignore[override]
                reduction: str) -> torch.Tensor:
        return data.scatter_reduce(0, index, src, reduce="amax" if reduction == "max" else "sum", include_self=True)

    @staticmethod
    def symbolic(g: Any, data: Any, index: Any, src: Any, reduction: str) -> Any:
        return g.op("ScatterElements", data, index, src, axis_i=0, reduction_s=reduction)


def table_dq(mod: Any) -> ConstDQ:
    """The quantized table of ``mod`` as a ``ConstDQ`` (axis 0); 4-bit codes unpacked one per byte."""
    check_integer_zero_points(mod)
    codes = mod._codes().detach().cpu()
    if mod.qdtype.bits == 4:
        codes = codes.to(torch.int8 if mod.qdtype.signed else torch.uint8)
    return ConstDQ(codes, mod.weight_scale.detach().cpu(), mod.weight_zero_point.detach().cpu(), 0)


class EmbeddingTableTwin(nn.Module):
    """Twin of an 8- or 4-bit ``Embedding``: ``Gather(DequantizeLinear(table, axis=0), indices)``."""

    def __init__(self, mod: Any) -> None:
        super().__init__()
        self.table, self.bits = table_dq(mod), mod.qdtype.bits
        self.max_norm, self.norm_type = mod.max_norm, mod.norm_type

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return renorm_rows(F.embedding(indices, self.table()), self.max_norm, self.norm_type)


class EmbeddingBagTwin(nn.Module):
    """Twin of ``EmbeddingBag`` (sum / mean / max, offsets or 2-D input, per-sample weights, padding)."""

    def __init__(self, mod: Any) -> None:
        super().__init__()
        self.table, self.bits = table_dq(mod), mod.qdtype.bits
        self.mode, self.include_last_offset, self.padding_idx = mod.mode, mod.include_last_offset, mod.padding_idx
        self.embedding_dim, self.max_norm, self.norm_type = mod.embedding_dim, mod.max_norm, mod.norm_type

    def check_opset(self, opset: int, path: str) -> None:
        """Raise ``ValueError`` when ``opset`` lacks the ScatterElements reduction this bag's mode needs."""
        need = MAX_OPSET_MODE[self.mode]
        if opset < need:
            raise ValueError(f"to_onnx: EmbeddingBag '{path}' with mode={self.mode!r} needs opset_version >= {need} "
                             f"(ScatterElements reduction), got opset_version={opset}")

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        flat = input.reshape(-1)
        n = flat.shape[0]
        if input.dim() == 2:
            bags = input.shape[0]
            seg = torch.div(torch.arange(n), input.shape[1], rounding_mode="floor")
        else:
            assert offsets is not None  # the converted module rejected this call when the twin was built
            offsets = offsets.to(torch.int64)
            bags = offsets.shape[0] - 1 if self.include_last_offset else offsets.shape[0]
            marks = _ScatterFn.apply(torch.zeros(n + 1, dtype=torch.int64), offsets, torch.ones_like(offsets), "add")
            seg = torch.cumsum(marks, 0)[:n] - 1
        dummy = torch.ones(bags, dtype=torch.int64).sum()  # = bags, traced from the input's shape (not a constant)
        if input.dim() != 2:
            seg = torch.minimum(seg, dummy)  # past the last offset (include_last_offset): the dummy bag
        if self.padding_idx is not None:
            seg = torch.where(flat == self.padding_idx, dummy, seg)
        rows = renorm_rows(F.embedding(flat, self.table()), self.max_norm, self.norm_type)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.reshape(-1, 1).to(torch.float32)
        index = seg.reshape(-1, 1).expand(-1, self.embedding_dim)
        count = _ScatterFn.apply(torch.zeros(bags + 1), seg, torch.ones(n), "add")
        if self.mode == "max":
            init = torch.full((bags + 1, self.embedding_dim), float("-inf"))
            out = _ScatterFn.apply(init, index, rows, "max")
            out = torch.where(count.reshape(-1, 1) > 0, out, torch.zeros_like(out))
        else:
            out = _ScatterFn.apply(torch.zeros(bags + 1, self.embedding_dim), index, rows, "add")
            if self.mode == "mean":
                out = out / torch.clamp(count, min=1.0).reshape(-1, 1)
        return out[:bags]


def to_int4(proto: Any, twins: list[Any]) -> int:
    """Re-store the 4-bit tables of ``twins`` (``EmbeddingTableTwin``/``EmbeddingBagTwin``) in ``proto``
    as UINT4/INT4 initializers (codes and zero points of their ``DequantizeLinear``); return how many.

    A table is recognised by its codes' bytes and shape; the graph must be opset >= 21.
    """
    from onnx import TensorProto, numpy_helper

    wanted = {(tuple(t.table.codes.t.shape), t.table.codes.t.numpy().tobytes()): t.table.codes.t.dtype
              for t in twins if t.bits == 4}
    inits = {t.name: t for t in proto.graph.initializer}
    done = 0
    for node in proto.graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 3 or node.input[0] not in inits:
            continue
        codes = inits[node.input[0]]
        arr = numpy_helper.to_array(codes)
        dtype = wanted.get((tuple(arr.shape), arr.tobytes()))
        if dtype is None:
            continue
        kind = TensorProto.INT4 if dtype == torch.int8 else TensorProto.UINT4
        for i in (0, 2):
            src = numpy_helper.to_array(inits[node.input[i]])
            name = f"{node.input[i]}_4bit"
            if name not in inits:
                t = proto.graph.initializer.add()
                t.CopyFrom(_make4(name, src, kind))
                inits[name] = t
            node.input[i] = name
        done += 1
    used = {i for n in proto.graph.node for i in n.input}
    keep = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    return done


def _make4(name: str, values: Any, kind: int) -> Any:
    """A 4-bit initializer: two codes per byte, element ``2k`` in the low nibble (ONNX's packing)."""
    from onnx import helper

    u = (values.reshape(-1).astype("int16") & 0xF).astype("uint8")
    if u.size % 2:
        u = numpy.concatenate([u, numpy.zeros(1, "uint8")])
    packed = (u[0::2] | (u[1::2] << 4)).astype("uint8")
    return helper.make_tensor(name, kind, list(values.shape), packed.tobytes(), raw=True)
