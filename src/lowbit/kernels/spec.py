"""Plain-data descriptions shared by every kernel backend: the output grid and the conv geometry.

>>> import lowbit as Q
>>> from lowbit.kernels import OutGrid, ConvSpec
>>> OutGrid(0.1, 3, Q.quint8).torch_storage
torch.uint8
>>> ConvSpec(2, (1, 1), (1, 1), (1, 1), 1).transposed
False
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..qscheme import QDtype

__all__ = ["OutGrid", "ConvSpec"]


@dataclass(frozen=True)
class OutGrid:
    """A per-tensor output grid: ``q = clamp(round(y / scale) + zero_point, qmin, qmax)``."""

    scale: float
    zero_point: int
    qdtype: QDtype

    @property
    def torch_storage(self) -> torch.dtype:
        return self.qdtype.storage

    @property
    def full_range(self) -> bool:
        """Whether the grid spans its whole 8-bit storage (no extra clamp needed after a kernel)."""
        info = torch.iinfo(self.qdtype.storage)
        return (self.qdtype.quant_min, self.qdtype.quant_max) == (info.min, info.max)


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
