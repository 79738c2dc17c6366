"""Twins of the fake-quant and observer modules of prepared / QAT models (``build_twin``'s second pass).

An activation ``FakeQuantize`` (or observer) becomes ``QuantizeLinear -> DequantizeLinear`` on the grid its forward
applies: ``y = (clamp(round(x / s) + z, qmin, qmax) - z) s`` with ``(s, z)`` its buffers (``LearnableFakeQuantize``:
the learned ``(max(s, eps), round(z))``). A ``weight_fake_quant`` freezes the weight it is given into integer codes
``q = clamp(round(w / s) + z)`` and one DequantizeLinear, on the grid ``convert`` builds: a fake-quant whose observer
is on observes that weight first (as ``convert`` and the QAT forward do), one whose observer is off keeps its grid.
A fake-quant or observer that holds no grid (its observer saw no data, an LSQ module never learned nor loaded) is
harmless while unused (a weighted layer's ``input_activation_post_process`` when its input is quantized already)
and a ``RuntimeError`` naming it once the exported forward reaches it (it exported scale 1.0 before, silently).

>>> import torch, lowbit as Q
>>> fq = Q.FakeQuantize(Q.MinMaxObserver, qdtype=Q.quint8)
>>> _ = fq(torch.tensor([0.0, 2.55])); twin = activation_twin(fq, "fq", "activation_post_process", "auto")
>>> type(twin).__name__, twin.grid[:2]
('QDQ', (0.009999999776482582, 0))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..fake_quant import FakeQuantize, LearnableFakeQuantize
from ..fake_quant.base import holds_grid
from ..functional import fake_quantize
from ..observer import NoopObserver, ObserverBase, PlaceholderObserver
from .qdq import QDQ, ConstDQ, ConstWeight, _storage, weight_dq

__all__ = ["FrozenWeightTwin", "Uncalibrated", "activation_twin", "fake_quant_grid"]


def fake_quant_grid(fq: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(scale, zero_point)`` a ``FakeQuantize``'s forward applies: the buffers, or for LSQ the
    learned grid (scale clamped to eps, zero point rounded), which its parameters only approximate."""
    if isinstance(fq, LearnableFakeQuantize):
        return fq.calculate_qparams()
    return fq.scale.detach(), fq.zero_point.detach()


class Uncalibrated(nn.Module):
    """Stands in for an observer or fake-quant without a grid: harmless until the traced forward reaches it."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def forward(self, x: Any) -> Any:
        raise RuntimeError(self.message)


def _no_grid(kind: str, path: str, mod: nn.Module) -> str:
    return (f"to_onnx: {kind} '{path}' ({type(mod).__name__}) holds no grid (its observer saw no data"
            + (", its scale was neither learned nor loaded" if isinstance(mod, LearnableFakeQuantize) else "")
            + ") but the exported forward uses it; calibrate (or train) the model before exporting")


class FrozenWeightTwin(ConstWeight):
    """Twin of a QAT ``weight_fake_quant``: the first weight it sees is frozen into integer codes.

    The input is ignored afterwards (in the ONNX graph the float weight and its fake-quant vanish;
    only the codes and a DequantizeLinear remain). ``fq`` (the export copy's own module) observes that
    weight first when its observer is on, as ``convert`` does.
    """

    def __init__(self, fq: Any, weight_dtype: str, path: str = "weight_fake_quant") -> None:
        super().__init__()
        if getattr(getattr(fq, "qscheme", None), "has_float_zero_point", False):
            raise ValueError("to_onnx: a QAT weight fake-quant with float zero points (per_channel_affine_float_qparams) "
                             "cannot become an ONNX DequantizeLinear; train with get_embedding_qat_qconfig() "
                             "(integer zero points) to export")
        self._fq = [fq]  # (a list: not a submodule, the traced graph never sees it)
        self.axis, self.qdtype, self.weight_dtype, self.path = fq.ch_axis, fq.qdtype, weight_dtype, path

    def _grid(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fq = self._fq[0]
        if int(fq.observer_enabled[0]) == 1:  # as convert (weight_qparams) and the QAT forward: this weight observed
            with torch.no_grad():
                fq(w.detach())
        if not holds_grid(fq):
            raise RuntimeError(_no_grid("weight fake-quant", self.path, fq))
        return fake_quant_grid(fq)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.dq is None:
            scale, zero_point = self._grid(w)
            axis = 0 if self.axis is None else self.axis
            n = w.shape[axis]
            s, z = scale.detach().reshape(-1).expand(n).cpu(), zero_point.detach().reshape(-1).expand(n).cpu()
            shape = [-1 if i == axis else 1 for i in range(w.dim())]
            d = self.qdtype
            v = fake_quantize(w.detach().cpu().float(), s, z, d.quant_min, d.quant_max, axis)  # as the QAT forward
            q = torch.round(v / s.reshape(shape)) + z.reshape(shape)
            storage = _storage(self.qdtype, "weight_fake_quant")
            if storage == torch.int8:
                self.dq = weight_dq(q.to(torch.int8), s, z, axis, self.weight_dtype)
            else:
                self.dq = ConstDQ(q.to(torch.uint8), s, z, axis)
        return super().forward(w)


def activation_twin(mod: nn.Module, path: str, name: str, weight_dtype: str) -> nn.Module | None:
    """Twin of an observer or FakeQuantize (prepared / QAT models), or None for other modules."""
    if isinstance(mod, FakeQuantize):
        if int(mod.fake_quant_enabled[0]) == 0:
            return nn.Identity()
        if name == "weight_fake_quant":
            return FrozenWeightTwin(mod, weight_dtype, path)
        if not holds_grid(mod):  # fine while unused (e.g. the input fake-quant of a layer fed fake-quantized values)
            return Uncalibrated(_no_grid("fake-quant", path, mod))
        scale, zero_point = fake_quant_grid(mod)
    elif isinstance(mod, ObserverBase):
        if isinstance(mod, (PlaceholderObserver, NoopObserver)):
            return nn.Identity()
        if not getattr(mod, "is_calibrated", True):  # fine while unused (e.g. an input observer of a layer fed int8)
            return Uncalibrated(f"to_onnx: observer '{path}' ({type(mod).__name__}) saw no calibration data but "
                                "the exported forward uses it; calibrate the model before exporting")
        scale, zero_point = mod.calculate_qparams()
    else:
        return None
    if scale.numel() != 1:
        raise ValueError(f"to_onnx: '{path}' ({type(mod).__name__}) is per-channel on an activation "
                         f"(scale shape {tuple(scale.shape)}); only weights may be per-channel in ONNX QDQ")
    return QDQ(float(scale.reshape(())), int(zero_point.reshape(())), mod.qdtype)
