"""Helpers shared by the ONNX export tests (not a test module)."""

from __future__ import annotations

import onnx
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx
from helpers import threads


one_thread = threads(1, "function")  # importing it into a test module runs every test there on one torch thread


def quantized(model: nn.Module, batches: list[torch.Tensor] | list[tuple[torch.Tensor, ...]],
              groups: list[list[str]] | None = None) -> nn.Module:
    """(fuse ->) prepare -> calibrate -> convert, in eval mode (a tuple batch: the model's several inputs)."""
    model = model.eval()
    if groups:
        model = Q.fuse_modules(model, groups)
    model.qconfig = Q.get_default_qconfig()
    prepared = Q.prepare(model)
    with torch.no_grad():
        for b in batches:
            prepared(*b) if isinstance(b, tuple) else prepared(b)
    return Q.convert(prepared)


def within_one_quantum(a: torch.Tensor, b: torch.Tensor, quantum: float) -> float:
    """Fraction of elements where |a - b| <= one output quantum (float slack for float ops after it)."""
    return ((a - b).abs() <= quantum * (1 + 1e-3)).double().mean().item()


def ort_ops(path, x: torch.Tensor, tmp_path) -> tuple[torch.Tensor, set[str]]:
    """ORT's output on ``x`` and the op types of the graph ORT optimised (what actually executes)."""
    opt = tmp_path / "optimized.onnx"
    out = run_onnx(path, x, optimized_model_path=str(opt))[0]
    return out, {n.op_type for n in onnx.load(str(opt)).graph.node}


def dynamic_quantum(qlin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-element tolerance of a dynamic (per-token) Linear's output: one activation code step in the row's
    grid times the channel's largest weight, ``s_x[m] · max_k |ŵ[n, k]|`` (M, N), float slack added."""
    from lowbit.nn.quantized.dynamic import quantize_per_token
    s_x = quantize_per_token(x.reshape(-1, qlin.in_features)).scale
    w = qlin.weight().dequantize().abs().amax(1)
    return (s_x[:, None] * w[None, :] * (1 + 1e-3) + 1e-6).reshape(*x.shape[:-1], -1)


def ort_graph(path, inputs: tuple[torch.Tensor, ...], tmp_path) -> tuple[list[torch.Tensor], onnx.GraphProto]:
    """ORT's outputs on ``inputs`` and the graph ORT optimised (what actually executes)."""
    opt = tmp_path / "optimized.onnx"
    out = run_onnx(path, *inputs, optimized_model_path=str(opt))
    return out, onnx.load(str(opt)).graph


def float_weight_matmuls(graph: onnx.GraphProto) -> list[str]:
    """Names of float MatMul / Gemm / FusedMatMul nodes fed directly by a 2-D initializer (a float weight)."""
    weights = {t.name for t in graph.initializer if len(t.dims) == 2}
    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul") and set(n.input) & weights]
