"""ONNX twin of ``WeightOnlyLinear`` (group-wise int4 / int8 weights, float activations).

Row ``n`` of the ``(N, K)`` weight has ``G = K / g`` groups with their own ``(s, z)``; the module
computes ``y = x @ ŵᵀ + b (-> relu)`` with ``ŵ[n, k] = (q[n, k] - z[n, k//g]) * s[n, k//g]``.

Opset < 21 (per-axis DequantizeLinear only): the codes, one per byte (INT8 for ``qint4``/``qint8``,
UINT8 for ``quint4``), are viewed as ``(N·G, g)`` so each group is one "channel" of axis 0::

    ŵ = Reshape(DequantizeLinear(q (N·G, g), s (N·G,), z (N·G,), axis=0), (N, K))
    y = MatMul(x, Transpose(ŵ)) + b  (-> Relu)

Exact, but no smaller than an int8 file. Opset 21: blocked quantization on the transposed codes,
packed INT4/UINT4 (two per byte) for 4-bit weights::

    ŵᵀ = DequantizeLinear(qᵀ (K, N), sᵀ (G, N), zᵀ (G, N), axis=0, block_size=g)
    y  = MatMul(x, ŵᵀ) + b  (-> Relu)

the pattern ONNX Runtime rewrites into its ``com.microsoft.MatMulNBits`` kernel (bias folded in for
inputs of rank > 2). For 2-D inputs the bias is subtracted negated, ``Sub(y, -b)``: ORT 1.32 turns a
2-D ``MatMul -> Add -> Relu`` (followed by more nodes) into a float ``FusedGemm`` on the dequantized
weight before its MatMulNBits fusion sees it (measured; a ``Sub`` is not fused). The TorchScript
exporter stops at opset 20, so the blocked node is first written as ``lowbit::BlockDequantizeLinear``
and ``to_blocked`` turns it into the standard node once ``to_onnx`` has relabelled the file 21.
Leading (batch) dimensions of ``x`` stay dynamic.

>>> import torch
>>> from lowbit.nn.quantized import WeightOnlyLinear
>>> q = WeightOnlyLinear.from_float(torch.nn.Linear(64, 16), bits=4, group_size=32, kernel="reference")
>>> x = torch.randn(2, 3, 64)
>>> torch.allclose(WeightOnlyTwin(q)(x), q(x), atol=1e-5)
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .embedding import _make4
from .qdq import ConstDQ, _Const

__all__ = ["WeightOnlyTwin", "to_blocked"]

_DOMAIN = "lowbit"
_OP = "BlockDequantizeLinear"


class _BlockDQFn(torch.autograd.Function):
    """Constant codes ``(K, N)`` dequantized in blocks of ``block`` rows; ONNX: ``lowbit::BlockDequantizeLinear``."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, codes: _Const, scale: _Const, zp: _Const,  # type: ignore[override]
                block: int, bits: int) -> torch.Tensor:
        s = scale.t.repeat_interleave(block, 0)
        z = zp.t.to(torch.float32).repeat_interleave(block, 0)
        return ((codes.t.to(torch.float32) - z) * s).to(anchor.device)

    @staticmethod
    def symbolic(g: Any, anchor: Any, codes: _Const, scale: _Const, zp: _Const, block: int, bits: int) -> Any:
        c, s, z = (g.op("Constant", value_t=v.t) for v in (codes, scale, zp))
        out = g.op(f"{_DOMAIN}::{_OP}", c, s, z, block_size_i=block, bits_i=bits)
        out.setType(anchor.type().with_dtype(torch.float32).with_sizes(list(codes.t.shape)))
        return out


class WeightOnlyTwin(nn.Module):
    """Export twin of a ``WeightOnlyLinear``; ``opset`` (set by ``to_onnx``) picks the ONNX form (module doc)."""

    bias: torch.Tensor | None

    def __init__(self, mod: Any, opset: int = 17) -> None:
        super().__init__()
        codes = mod.codes().detach().cpu()
        codes = codes.to(torch.int8 if mod.qdtype.signed else torch.uint8)  # (N, K), one code per byte
        scales = mod.scales.detach().cpu().to(torch.float32)  # (N, G)
        zps = mod.zero_points.detach().cpu().to(codes.dtype)  # (N, G)
        self.out_features, self.in_features, self.g = mod.out_features, mod.in_features, mod._g
        self.bits, self.relu, self.opset = mod.bits, bool(mod.relu), opset
        self.rows = ConstDQ(codes.reshape(-1, self.g), scales.reshape(-1), zps.reshape(-1), 0)
        self.codes_t, self.scales_t, self.zps_t = _Const(codes.t()), _Const(scales.t()), _Const(zps.t())
        bias = None if mod.bias is None else mod.bias.detach().cpu().to(torch.float32).clone()
        self.register_buffer("bias", bias)
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.opset >= 21:
            w_t = _BlockDQFn.apply(self.anchor, self.codes_t, self.scales_t, self.zps_t, self.g, self.bits)
            y = torch.matmul(x, w_t)
        else:
            w = self.rows().reshape(self.out_features, self.in_features)
            y = torch.matmul(x, w.t())
        if self.bias is not None and self.opset >= 21 and x.dim() == 2:
            y = y - (-self.bias)  # (exact) a 2-D MatMul + Add (+ Relu) would become a float Gemm in ORT
        elif self.bias is not None:
            y = y + self.bias
        return torch.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.g}, relu={self.relu}, opset={self.opset}")


def to_blocked(proto: Any) -> int:
    """Turn every ``lowbit::BlockDequantizeLinear`` of ``proto`` (an opset-21 graph) into a standard
    ``DequantizeLinear(axis=0, block_size=g)``, 4-bit codes and zero points re-stored as INT4/UINT4;
    drop the ``lowbit`` domain. Return how many nodes changed.
    """
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    done = 0
    for node in proto.graph.node:
        if node.domain != _DOMAIN or node.op_type != _OP:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs["bits"] == 4:
            kind = TensorProto.INT4 if inits[node.input[0]].data_type == TensorProto.INT8 else TensorProto.UINT4
            for i in (0, 2):
                name = f"{node.input[i]}_4bit"
                if name not in inits:
                    t = proto.graph.initializer.add()
                    t.CopyFrom(_make4(name, numpy_helper.to_array(inits[node.input[i]]), kind))
                    inits[name] = t
                node.input[i] = name
        node.domain, node.op_type = "", "DequantizeLinear"
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", attrs["block_size"])])
        done += 1
    used = {i for n in proto.graph.node for i in n.input}
    keep = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    keep_imports = [o for o in proto.opset_import if o.domain != _DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(keep_imports)
    return done
