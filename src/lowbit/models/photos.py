"""Random 224x224 crops of the real photos bundled in the ``scikit-image`` wheel (offline image data).

The photos (``skimage/data/*.png|jpg``: astronaut, chelsea, coffee, rocket, motorcycle, camera, moon, ...)
are opened as files, so nothing goes through scikit-image's downloader. Each crop is a random square
of side ``u * min(H, W)`` (``u ~ U(0.25, 1)``), randomly mirrored, resized to ``size`` (bilinear,
antialiased). Grey photos are repeated to three channels. Normalisation::

    "imagenet":  (x / 255 - mean) / std      mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225)
    "lite":      (x - 127) / 128               (EfficientNet-Lite's TF preprocessing)

Calibration and evaluation use different seeds, hence different crops. Crops are deterministic
for a given ``seed``.

>>> x = photo_crops(2, seed=0, size=32) if photos_available() else torch.zeros(2, 3, 32, 32)
>>> tuple(x.shape)
(2, 3, 32, 32)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..batches import check_seed

__all__ = ["PHOTOS", "photos_available", "photo_crops", "IMAGENET_MEAN", "IMAGENET_STD"]

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "motorcycle_right.png",
          "hubble_deep_field.jpg", "ihc.png", "retina.jpg", "camera.png", "moon.png", "coins.png", "brick.png",
          "grass.png", "gravel.png", "clock_motion.png", "cell.png", "page.png")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _photo_dir() -> Path | None:
    spec = importlib.util.find_spec("skimage")  # does not import scikit-image
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    return d if d.is_dir() else None


def photos_available() -> bool:
    """True when scikit-image's bundled photos are installed (``pip install scikit-image``)."""
    d = _photo_dir()
    return d is not None and all((d / p).is_file() for p in PHOTOS)


def _load(path: Path) -> torch.Tensor:
    try:
        from PIL import Image  # a scikit-image dependency
    except ImportError as e:  # was a bare "No module named 'PIL'"
        raise ImportError("photo_crops decodes the photos with Pillow, which is not installed: pip install pillow "
                          "(a scikit-image dependency: pip install scikit-image)") from e
    try:
        with Image.open(path) as im:
            img = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # truncated / corrupted: PIL's "image file is truncated" named no file
        raise ValueError(f"photo_crops: cannot decode the scikit-image photo {path} ({type(e).__name__}: {e}); "
                         "reinstall it: pip install --force-reinstall scikit-image") from e
    return torch.from_numpy(img.copy()).permute(2, 0, 1).to(torch.float32)  # (3, H, W) in [0, 255]


def photo_crops(n: int, seed: int = 0, size: int = 224, norm: str = "imagenet", uint8: bool = False) -> torch.Tensor:
    """``n`` random square crops ``(n, 3, size, size)`` of the bundled photos, normalised by ``norm``.

    ``uint8=True`` rounds each resized crop to whole pixel values before normalising, as an 8-bit image
    pipeline (decode, resize to uint8) feeds a model; the default keeps the resampler's fractional values.
    An 8-bit input grid on the pixel grid (``"lite"``: scale 1/128, zero point 127, what min/max calibration
    picks) represents ``uint8`` crops exactly; rounding fractional crops onto it moves EfficientNet-Lite0's
    logits by 23.6 dB SQNR (``docs/design.md``).

    >>> x = photo_crops(2, seed=0, size=32, norm="lite", uint8=True) if photos_available() else torch.zeros(2, 3, 32, 32)
    >>> bool(((x * 128 + 127) == (x * 128 + 127).round()).all())
    True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"photo_crops: n={n!r} must be a positive int")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"photo_crops: size={size!r} must be a positive int (pixels)")
    if not isinstance(uint8, bool):
        raise TypeError(f"photo_crops: uint8={uint8!r} must be True or False")
    seed = check_seed("photo_crops", seed)
    if norm not in ("imagenet", "lite"):
        raise ValueError(f"photo_crops: norm={norm!r} must be 'imagenet' or 'lite'")
    d = _photo_dir()
    if d is None or not photos_available():
        raise RuntimeError("photo_crops: scikit-image's bundled photos are not installed (pip install scikit-image)")
    imgs = [_load(d / p) for p in PHOTOS]
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, 3, size, size)
    for i in range(n):
        img = imgs[int(torch.randint(len(imgs), (1,), generator=g))]
        h, w = img.shape[-2:]
        side = max(16, int(min(h, w) * (0.25 + 0.75 * float(torch.rand((), generator=g)))))
        top = int(torch.randint(h - side + 1, (1,), generator=g))
        left = int(torch.randint(w - side + 1, (1,), generator=g))
        crop = img[:, top:top + side, left:left + side]
        if float(torch.rand((), generator=g)) < 0.5:
            crop = crop.flip(-1)
        out[i] = F.interpolate(crop[None], size=(size, size), mode="bilinear", antialias=True,
                               align_corners=False)[0].clamp(0, 255)
    if uint8:
        out = out.round()
    if norm == "lite":
        return (out - 127.0) / 128.0
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (out / 255.0 - mean) / std
