"""Helpers shared by the ONNX export tests (not a test module)."""

from __future__ import annotations

import onnx
import torch
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx


def quantized(model: nn.Module, batches: list[torch.Tensor], groups: list[list[str]] | None = None) -> nn.Module:
    """(fuse ->) prepare -> calibrate -> convert, in eval mode."""
    model = model.eval()
    if groups:
        model = Q.fuse_modules(model, groups)
    model.qconfig = Q.get_default_qconfig()
    prepared = Q.prepare(model)
    with torch.no_grad():
        for b in batches:
            prepared(b)
    return Q.convert(prepared)


def within_one_quantum(a: torch.Tensor, b: torch.Tensor, quantum: float) -> float:
    """Fraction of elements where |a - b| <= one output quantum (float slack for float ops after it)."""
    return ((a - b).abs() <= quantum * (1 + 1e-3)).double().mean().item()


def ort_ops(path, x: torch.Tensor, tmp_path) -> tuple[torch.Tensor, set[str]]:
    """ORT's output on ``x`` and the op types of the graph ORT optimised (what actually executes)."""
    opt = tmp_path / "optimized.onnx"
    out = run_onnx(path, x, optimized_model_path=str(opt))[0]
    return out, {n.op_type for n in onnx.load(str(opt)).graph.node}
