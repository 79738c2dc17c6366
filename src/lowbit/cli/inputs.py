"""Reading and checking what the user hands ``lowbit quantize``: the model, its data and labels.

Every check runs before any quantization work and fails with a one-line ``CLIError`` naming the
flag and the file. Data must be a non-empty float-convertible tensor with finite values only
(calibrating on NaN/Inf gives no usable range); labels must be a 1-D tensor of integer class
indices in ``[0, C)``, ``C`` being the size of the model's last output dimension.

>>> check_labels(torch.tensor([0, 2, 1]), "--labels y.pt", n=3, classes=3).tolist()
[0, 2, 1]
>>> check_labels(torch.tensor([0, 3]), "--labels y.pt", n=2, classes=3)
Traceback (most recent call last):
...
lowbit.cli.common.CLIError: --labels y.pt: label 3 is outside [0, 3) (the model has 3 outputs)
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .common import CLIError, one_line

__all__ = ["load_array", "check_data", "check_labels", "check_spec", "load_model", "check_runs", "builtin_data"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
_KEYS = ("x", "inputs", "data")   # the array a .pt dict / .npz names for inputs
_LABEL_KEYS = ("y", "labels")      # ... and for labels


def load_array(path: str, what: str, labels: bool = False) -> torch.Tensor:
    """The tensor in ``path`` (.pt tensor or dict, .npz, .npy, or a folder of images). A .pt dict or an .npz gives
    its array named ``x``/``inputs``/``data`` (``labels``: ``y``/``labels``), or its only array; several arrays
    under none of those names are refused, not guessed between."""
    keys = _LABEL_KEYS if labels else _KEYS
    p = Path(path)
    if not p.exists():
        raise CLIError(f"{what} file not found: {path}")
    if p.is_dir():
        return _load_images(p, what)
    suffix = p.suffix.lower()
    if suffix not in (".pt", ".npz", ".npy"):
        raise CLIError(f"{what} {path}: unsupported format {suffix!r} (use .pt, .npz, .npy or a folder of images)")
    try:
        if suffix == ".pt":
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = obj[_pick(list(obj), keys, what, path)]
            if not isinstance(obj, torch.Tensor):
                raise CLIError(f"{what} {path}: expected a tensor (or a dict with key {'/'.join(map(repr, keys))}), "
                               f"got {type(obj).__name__}")
            if obj.is_quantized:  # torch's quantized dtypes: .float() / .long() raise deep inside torch
                raise CLIError(f"{what} {path}: holds a torch quantized tensor (dtype {obj.dtype}); save plain "
                               + ("integer class indices" if labels else "float values (x.dequantize())"))
            return obj
        if suffix == ".npz":
            with np.load(p) as z:
                return torch.from_numpy(_native(np.array(z[_pick(list(z.files), keys, what, path)])))
        return torch.from_numpy(_native(np.load(p)))
    except CLIError:
        raise
    except Exception as e:  # corrupt file, object arrays, ...: one clear line
        raise CLIError(f"{what} {path}: {torch_load_problem(e) if suffix == '.pt' else f'cannot read ({one_line(e)})'}"
                       ) from e


def _native(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order (a big-endian .npy is valid numpy; torch.from_numpy refuses it)."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def torch_load_problem(e: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in a few words: a pickled object (named), or not a torch file.

    torch's own message is a paragraph about the ``weights_only`` default; only its last line says what happened.
    """
    text = one_line(e)
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if found:
        return (f"holds a pickled Python object ({found[1]}), not tensors; torch.load(weights_only=True) does not "
                "run pickled code: save tensors (model.state_dict(), a tensor or a dict of tensors)")
    if "Weights only load failed" in text or isinstance(e, pickle.UnpicklingError):
        detail = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
        return f"is not a file torch.save wrote ({detail[1].strip() if detail else type(e).__name__})"
    return f"cannot read ({text})"


def _pick(names: list[Any], keys: tuple[str, ...], what: str, path: str) -> Any:
    """The entry of a .pt dict / .npz to read: the first of ``keys`` present, else the only entry."""
    hit = next((k for k in keys if k in names), None)
    if hit is not None:
        return hit
    if len(names) == 1:
        return names[0]
    held = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    if not names:
        raise CLIError(f"{what} {path}: holds no array")
    raise CLIError(f"{what} {path}: holds {len(names)} arrays ({held}), none named {'/'.join(map(repr, keys))}; "
                   "save the one to use under one of those names")


def _load_images(folder: Path, what: str) -> torch.Tensor:
    files = sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
    if not files:
        raise CLIError(f"{what} folder {folder} holds no .png/.jpg/.bmp images")
    try:
        from PIL import Image
    except ImportError as e:
        raise CLIError("reading an image folder needs Pillow: pip install pillow") from e
    arrs = []
    with_colour = False
    for f in files:  # a folder holding any colour image is read as RGB (C = 3), else as grayscale (C = 1)
        try:
            with Image.open(f) as im:
                with_colour = with_colour or im.mode not in ("1", "L", "LA", "I", "F") and not im.mode.startswith("I;16")
        except Exception:  # named by the read below
            pass
    for f in files:
        try:
            with Image.open(f) as im:
                mode, wide = im.mode, None
                if with_colour:
                    arrs.append(np.asarray(im.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0)
                elif mode.startswith("I;16") or mode in ("I", "F"):  # convert("L") would clip everything above 255
                    wide = np.asarray(im, dtype=np.float64)
                else:
                    arrs.append(np.asarray(im.convert("L"), dtype=np.float32)[None] / 255.0)
        except Exception as e:  # truncated / not an image despite its suffix
            raise CLIError(f"{what} folder {folder}: cannot read image {f.name} ({one_line(e)})") from e
        if wide is not None:  # 16-bit grayscale (older Pillow reads 16-bit PNGs as "I"): its own range
            if mode == "F" or not (wide.size and 0 <= wide.min() and wide.max() <= 65535):
                raise CLIError(f"{what} folder {folder}: image {f.name} ({mode!r} mode) holds values outside 16-bit "
                               "pixels; save it as 8- or 16-bit, or pass the tensor as .pt / .npz")
            arrs.append((wide / 65535.0).astype(np.float32)[None])
    shapes = {a.shape[1:] for a in arrs}
    if len(shapes) != 1:
        raise CLIError(f"{what} folder {folder}: images differ in size ({', '.join(map(str, sorted(shapes)))})")
    return torch.from_numpy(np.stack(arrs))


def check_data(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` as float32 after checking it holds samples, numbers, and finite values only."""
    if x.layout != torch.strided:  # a sparse / nested tensor: torch.isfinite and the models' ops refuse it deep inside
        raise CLIError(f"{what}: expected a dense tensor, got layout {x.layout} (save x.to_dense())")
    if x.dtype == torch.bool or x.is_complex():
        raise CLIError(f"{what}: expected real numbers, got dtype {x.dtype}")
    if x.dim() == 0 or len(x) == 0 or x.numel() == 0:
        raise CLIError(f"{what}: holds no samples (shape {tuple(x.shape)})")
    x = x.float()
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        kind = "all" if bad == x.numel() else f"{bad} of {x.numel()}"
        raise CLIError(f"{what}: {kind} values are NaN or Inf (calibration needs finite data; clean it first)")
    return x


def check_labels(y: torch.Tensor, what: str, n: int, classes: int | None) -> torch.Tensor:
    """``y`` as int64 class indices after checking shape ``(n,)``, integer values and range ``[0, classes)``."""
    if y.dim() != 1:
        raise CLIError(f"{what}: expected a 1-D tensor of class indices, got shape {tuple(y.shape)}")
    if len(y) != n:
        raise CLIError(f"{what}: has {len(y)} labels for {n} samples")
    if y.dtype == torch.bool or y.is_complex():
        raise CLIError(f"{what}: expected integer class indices, got dtype {y.dtype}")
    if y.is_floating_point():
        if not bool(torch.isfinite(y).all()) or not torch.equal(y, y.round()):
            raise CLIError(f"{what}: expected integer class indices, got non-integer values (dtype {y.dtype})")
    # the range is checked before the int64 cast: 1e30 (float) and 2**63 + 5 (uint64) wrapped to negative labels
    wide = y.double() if y.is_floating_point() or y.dtype == torch.uint64 else y.long()
    lo, hi = int(wide.min()), int(wide.max())
    if lo < 0 or (classes is not None and hi >= classes) or hi > torch.iinfo(torch.int64).max:
        bad: Any = lo if lo < 0 else hi
        bad = f"{float(wide.min() if lo < 0 else wide.max()):g}" if y.is_floating_point() else bad
        limit = f"[0, {classes}) (the model has {classes} outputs)" if classes is not None else "[0, 2**63)"
        raise CLIError(f"{what}: label {bad} is outside {limit}")
    return y.long()


def check_spec(spec: str) -> tuple[str, str]:
    """``(module, factory)`` of a ``package.module:factory`` spec."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise CLIError(f"--model {spec!r}: expected 'package.module:factory'")
    return mod_name, attr


def load_model(spec: str, weights: str | None) -> nn.Module:
    """``factory()`` from ``package.module:factory``, with ``weights`` loaded (weights_only), in eval mode."""
    mod_name, attr = check_spec(spec)
    if weights is not None and not Path(weights).is_file():
        raise CLIError(f"--weights file not found: {weights}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise CLIError(f"--model {spec!r}: cannot import {mod_name!r} ({one_line(e)})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"--model {spec!r}: {mod_name} has no callable {attr!r}")
    try:
        model = factory()
    except Exception as e:
        raise CLIError(f"--model {spec!r}: the factory raised {one_line(e)}") from e
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {spec!r}: the factory returned {type(model).__name__}, not an nn.Module")
    if weights is not None:
        try:
            sd = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as e:
            found = re.search(r"GLOBAL (\S+) was not an allowed global", one_line(e))
            if found:  # a pickled object, e.g. a whole model
                raise CLIError(f"--weights {weights}: holds a pickled Python object (a whole model?), not a state_dict "
                               f"(it pickles {found[1]}); save model.state_dict() instead") from e
            raise CLIError(f"--weights {weights}: {torch_load_problem(e)}") from e
        sd = _unwrap_state_dict(sd, model)
        try:
            model.load_state_dict(sd)
        except Exception as e:
            raise CLIError(f"--weights {weights}: does not load into the model ({one_line(e)})") from e
    return model.eval()


def _unwrap_state_dict(sd: Any, model: nn.Module) -> Any:
    """The common checkpoint wrappers around a state dict: ``{"state_dict": sd}`` / ``{"model": sd}`` (training
    scripts) and the ``module.`` prefix of ``DataParallel`` / DDP, removed when the model's own keys lack them."""
    if not isinstance(sd, dict):
        return sd
    own = set(model.state_dict())
    for key in ("state_dict", "model", "model_state_dict"):
        inner = sd.get(key)
        if isinstance(inner, dict) and not (set(sd) & own) and inner and all(isinstance(k, str) for k in inner):
            sd = inner
            break
    if sd and all(isinstance(k, str) and k.startswith("module.") for k in sd) and not any(k.startswith("module.")
                                                                                         for k in own):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def check_runs(model: nn.Module, x: torch.Tensor, what: str) -> torch.Tensor:
    """The model's output on ``x[:2]``; a ``CLIError`` when the data does not fit the model."""
    try:
        with torch.no_grad():
            out = model(x[:2])
    except Exception as e:
        raise CLIError(f"{what} of shape {tuple(x.shape)} does not fit the model ({one_line(e)})") from e
    if not isinstance(out, torch.Tensor):
        raise CLIError(f"{what}: the model returns {type(out).__name__}; lowbit quantize needs a tensor output")
    if not bool(torch.isfinite(out).all()):
        raise CLIError(f"{what}: the float model already returns NaN/Inf on it (check --weights and the data)")
    return out


def builtin_data(n_train: int, seed: int) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(name, x_train, y_train, x_test, y_test): Fashion-MNIST, else scikit-learn's digits upscaled."""
    from .. import data

    if data.fashion_mnist_available():
        try:  # a truncated / corrupted idx file: load_fashion_mnist names it (the run had no stage yet)
            xtr, ytr = data.load_fashion_mnist("train")
            xte, yte = data.load_fashion_mnist("test")
        except (OSError, ValueError) as e:
            raise CLIError(f"built-in example: {one_line(e)}") from e
        idx = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(seed))[:n_train]
        return "Fashion-MNIST", data.normalize_images(xtr[idx]), ytr[idx], data.normalize_images(xte), yte
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise CLIError("no built-in dataset: install Debian's dataset-fashion-mnist or scikit-learn") from e
    d = load_digits()
    x = torch.nn.functional.interpolate(torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0,
                                        size=(28, 28), mode="bilinear", align_corners=False)
    x, y = (x - x.mean()) / x.std(), torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = min(int(0.75 * len(x)), n_train)
    return ("sklearn digits (8x8 upscaled)", x[perm[:cut]], y[perm[:cut]], x[perm[int(0.75 * len(x)):]],
            y[perm[int(0.75 * len(x)):]])
