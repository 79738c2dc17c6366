"""What ``lowbit quantize`` measures: accuracy, checkpoint size, latency ratios, and the printed table.

Latency: every model runs on the same batch, rounds interleaved (alternating order), three calls a
round; the reported speed-up is the median over rounds of ``t_fp32 / t_method`` measured side by side.

>>> import torch
>>> m = torch.nn.Linear(4, 3)
>>> state_bytes(m) > 4 * (4 * 3 + 3)
True
"""

from __future__ import annotations

import io
import statistics
import time
from typing import Any

import torch
from torch import nn

from ..report import rows_to_markdown
from .common import progress

__all__ = ["accuracy", "latency_ratios", "state_bytes", "table"]

table = rows_to_markdown      # the table the CLI prints is the report's, cell for cell


def state_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, quiet: bool, desc: str) -> float:
    """Top-1 accuracy (%) of ``model`` on ``(x, y)``, in chunks of 500."""
    model.eval()
    hits = 0
    with torch.no_grad():
        chunks = range(0, len(x), 500)
        for i in progress(chunks, f"eval {desc}", len(chunks), quiet):
            hits += int((model(x[i: i + 500]).argmax(-1) == y[i: i + 500]).sum())
    return 100.0 * hits / len(x)


def latency_ratios(models: dict[str, nn.Module], x: torch.Tensor, rounds: int = 7,
                   quiet: bool = False) -> dict[str, dict[str, Any]]:
    """Median ms per call and median of per-round ratios fp32/method, methods interleaved."""
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for m in models.values():
            m(x)
        for r in progress(range(rounds), "latency", rounds, quiet):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for k in order:
                t = time.perf_counter()
                for _ in range(3):
                    models[k](x)
                times[k].append((time.perf_counter() - t) / 3)
    base = times["fp32"]
    return {k: {"ms": 1e3 * statistics.median(v), "ratio": statistics.median(b / t for b, t in zip(base, v))}
            for k, v in times.items()}
