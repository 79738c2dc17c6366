"""A small residual CNN for 28x28 grey images, ready for the eager quantization workflow.

Used by the real-data tests (Fashion-MNIST) and the CLI demo. Shapes for a batch of B images::

    x (B, 1, 28, 28) -> quant -> conv1-bn1-relu1 (B, c1, 28, 28) -> pool (B, c1, 14, 14)
      -> conv2-bn2-relu2 (B, c2, 14, 14) = r
      -> conv3-bn3 (B, c2, 14, 14) -> skip.add_relu(., r)        # residual add: FloatFunctional
      -> pool (B, c2, 7, 7) -> flatten (B, 49 c2) -> fc1-relu (B, hidden) -> fc2 (B, classes) -> dequant

``QuantStub``/``DeQuantStub`` mark the int8 region and the residual add is a ``FloatFunctional``
(it gets its own output observer, so the add runs on int8 after ``convert``). ``fusion_groups()``
lists the ``[conv, bn(, relu)]`` and ``[linear, relu]`` groups for ``fuse_modules``/``fuse_modules_qat``.

>>> import torch
>>> m = SmallCNN().eval()
>>> m(torch.randn(2, 1, 28, 28)).shape
torch.Size([2, 10])
>>> m.fusion_groups()[0]
['conv1', 'bn1', 'relu1']
"""

from __future__ import annotations

import torch
from torch import nn

from .batches import check_seed
from .nn.quantized.functional_modules import FloatFunctional
from .stubs import DeQuantStub, QuantStub

__all__ = ["SmallCNN", "evaluate", "predict", "train"]


def _conv_bn(cin: int, cout: int) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)


class SmallCNN(nn.Module):
    """conv-bn-relu blocks, one residual add, a two-layer Linear head (see the module docstring)."""

    def __init__(self, num_classes: int = 10, channels: tuple[int, int] = (16, 32), hidden: int = 64) -> None:
        super().__init__()
        if (not isinstance(channels, (tuple, list)) or len(channels) != 2
                or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in channels)):
            raise ValueError(f"channels={channels!r} must be two positive ints")
        for name, v in (("num_classes", num_classes), ("hidden", hidden)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        c1, c2 = channels
        self.quant = QuantStub()
        self.conv1, self.bn1 = _conv_bn(1, c1)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = _conv_bn(c1, c2)
        self.relu2 = nn.ReLU()
        self.conv3, self.bn3 = _conv_bn(c2, c2)
        self.skip = FloatFunctional()
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(c2 * 7 * 7, hidden)
        self.relu_fc = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)                                       # (B, 1, 28, 28)
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))      # (B, c1, 14, 14)
        r = self.relu2(self.bn2(self.conv2(x)))                 # (B, c2, 14, 14)
        x = self.skip.add_relu(self.bn3(self.conv3(r)), r)      # (B, c2, 14, 14)
        x = torch.flatten(self.pool(x), 1)                      # (B, c2 * 49)
        x = self.fc2(self.relu_fc(self.fc1(x)))                 # (B, num_classes)
        return self.dequant(x)

    @staticmethod
    def fusion_groups() -> list[list[str]]:
        """Module-name groups for ``fuse_modules(model, groups)`` / ``fuse_modules_qat``."""
        return [["conv1", "bn1", "relu1"], ["conv2", "bn2", "relu2"], ["conv3", "bn3"], ["fc1", "relu_fc"]]


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError("x must be a batch of inputs (N, ...), got a 0-d tensor")
    bad = int((~torch.isfinite(x)).sum())
    if bad:  # training turns every weight NaN; an evaluation's argmax of NaN logits is class 0 (a "correct" guess)
        raise ValueError(f"x of shape {tuple(x.shape)} holds {bad} NaN/Inf values")


def _check_xy(x: torch.Tensor, y: torch.Tensor) -> None:
    _check_x(x)
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.dim() != 1 or len(y) != len(x):
        got = (f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__)
        raise ValueError(f"y must be an int64 vector of length {len(x)}, got {got}")
    if len(y) and int(y.min()) < 0:
        raise ValueError(f"y holds the negative label {int(y.min())}; labels are class indices from 0")


def _check_labels(y: torch.Tensor, logits: torch.Tensor, fn: str) -> None:
    """Labels are class indices below the model's output width (``(B, classes)`` logits)."""
    if logits.dim() != 2:
        raise ValueError(f"{fn}: the model's outputs must be (batch, classes) logits, got shape {tuple(logits.shape)}")
    top = int(y.max()) if len(y) else -1
    if top >= logits.shape[1]:  # evaluate scored such labels 0 % silently; train raised torch's IndexError
        raise ValueError(f"{fn}: y holds the label {top}, but the model scores {logits.shape[1]} classes "
                         f"(labels are class indices 0..{logits.shape[1] - 1})")


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: float = 1.0,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    weight_decay: float = 0.0,
    on_step: object = None,
) -> nn.Module:
    """Train ``model`` in place with Adam and cross-entropy on ``(x, y)``; return it (in train mode).

    ``epochs`` may be fractional (``0.5`` = half a shuffled pass). The cosine learning-rate schedule
    goes from ``lr`` to 0 over all steps; data order depends only on ``seed``. ``on_step(model, step,
    total_steps)``, if given, runs before each step (e.g. to freeze BN or observers near the end of QAT).

    >>> m = SmallCNN(channels=(4, 4), hidden=8)
    >>> _ = train(m, torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)), epochs=1, batch_size=16)
    """
    _check_xy(x, y)
    if len(x) == 0:
        raise ValueError(f"train: x holds no samples (shape {tuple(x.shape)})")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < float("inf"):
        raise ValueError(f"epochs={epochs!r} must be a finite number > 0")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    seed = check_seed("train", seed)  # (the one rule: numpy / 0-d tensor ints taken, bools and floats refused)
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step={on_step!r} must be callable or None")
    gen = torch.Generator().manual_seed(seed)
    n = len(x)
    steps_per_epoch = (n + batch_size - 1) // batch_size
    if n > batch_size and n % batch_size == 1:  # a last batch of one sample (BatchNorm cannot train on it): merged
        steps_per_epoch -= 1
    total = max(1, round(epochs * steps_per_epoch))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    model.train()
    step, perm = 0, torch.randperm(n, generator=gen)
    while step < total:
        i = (step % steps_per_epoch) * batch_size
        if i == 0 and step > 0:
            perm = torch.randperm(n, generator=gen)
        if on_step is not None:
            on_step(model, step, total)
        last = step % steps_per_epoch == steps_per_epoch - 1
        idx = perm[i:] if last else perm[i : i + batch_size]
        logits = model(x[idx])
        if step == 0:
            _check_labels(y, logits, "train")
        loss = nn.functional.cross_entropy(logits, y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
    return model


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
    """Arg-max class ``(N,)`` of ``model`` on ``x`` (batched; does not change the model's mode)."""
    _check_x(x)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    if len(x) == 0:
        raise ValueError(f"predict: x holds no samples (shape {tuple(x.shape)})")
    return _classes(model, x, batch_size)


@torch.no_grad()
def _classes(model: nn.Module, x: torch.Tensor, batch_size: int, y: torch.Tensor | None = None) -> torch.Tensor:
    """``predict``'s loop; with labels ``y``, checked against the model's output width on the first batch."""
    out = []
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size])
        if y is not None and i == 0:
            _check_labels(y, logits, "evaluate")
        out.append(logits.argmax(1))
    return torch.cat(out)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)`` in percent; puts the model in eval mode.

    >>> m = SmallCNN(channels=(4, 4), hidden=8)
    >>> 0.0 <= evaluate(m, torch.randn(8, 1, 28, 28), torch.zeros(8, dtype=torch.long)) <= 100.0
    True
    """
    _check_xy(x, y)
    if len(x) == 0:
        raise ValueError(f"evaluate: x holds no samples (shape {tuple(x.shape)})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    model.eval()
    return 100.0 * (_classes(model, x, batch_size, y) == y).double().mean().item()
