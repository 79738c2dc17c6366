"""Session 38 integration: int8 standalone BatchNorm and int8 ConvTranspose against the rest of lowbit.

A converted DenseNet-style block (BN → ReLU → conv, cat) and a tiny UNet (conv → ConvTranspose2d → cat → BN → conv)
through ``torch.export`` with a dynamic batch → save → load: the program's outputs equal the eager int8 model's
(``torch.equal``), and the eager int8 BN still equals torch.ao's ``quantized::batch_norm2d`` code for code.
Before: the quantized BatchNorm read its grids with ``float()`` / ``int()`` on buffers, a data-dependent guard
``torch.export`` refuses (``GuardOnDataDependentSymNode`` at ``float(self.scale)``).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim

import lowbit as Q
from helpers import one_thread, randomize_bn  # noqa: F401  (autouse: one thread)
from lowbit import kernels
from lowbit.nn.quantized import normalization as qn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


_init = randomize_bn


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c0 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1, self.r1, self.c1 = nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 3, padding=1)
        self.bn2, self.c2 = nn.BatchNorm2d(10), nn.Conv2d(10, 4, 1)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c0(x)
        return self.c2(self.bn2(torch.cat([a, self.c1(self.r1(self.bn1(a)))], 1)))  # bn2 without a ReLU


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.bn, self.d = nn.BatchNorm2d(8), nn.Conv2d(8, 2, 3, padding=1)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.e1(x)
        return self.d(torch.relu(self.bn(torch.cat([a, self.up(self.down(a))], 1))))


def _batches(n: int, seed: int, batch: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 8, 8, generator=g) for _ in range(n)]


def _convert(model: nn.Module) -> nn.Module:
    x = _batches(1, 9)[0]
    p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    for b in _batches(4, 0):
        p(b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Q.convert_fx(p)


@pytest.mark.parametrize("make", [Dense, UNet], ids=["dense", "unet"])
def test_export_dynamic_batch_int8_bn_and_convt(make: type) -> None:
    qm = _convert(make())
    kinds = {type(m) for m in qm.modules()}
    assert kinds & {qn.BatchNorm2d, qn.BNReLU2d}, kinds  # the BN really is int8
    x = _batches(1, 9)[0]
    ep = torch.export.export(qm, (x,), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    kernels.counts.clear()
    for xb in (x, _batches(1, 5, batch=5)[0]):
        assert torch.equal(loaded(xb), qm(xb))
    if make is UNet:
        assert kernels.counts[("onednn", "conv_transpose")] > 0 or kernels.counts[("reference", "conv_transpose")] > 0


@pytest.mark.parametrize("relu", [False, True])
def test_int8_bn_tensor_grids_match_torch_ao(relu: bool) -> None:
    """The tensor-grid rewrite keeps torch.ao's codes: ``quantized::batch_norm2d(_relu)`` on the same codes."""
    bn = _init(nn.Sequential(nn.BatchNorm2d(5))).eval()[0]
    cls = qn.BNReLU2d if relu else qn.BatchNorm2d
    src = Q.nn.intrinsic.BNReLU2d(bn, nn.ReLU()) if relu else bn
    src.activation_post_process = Q.MinMaxObserver()
    src.activation_post_process(torch.linspace(-2.0, 3.0, 11))
    q = cls.from_float(src)
    x = torch.randn(3, 5, 4, 4, generator=torch.Generator().manual_seed(2)) * 2
    qx = Q.quantize_per_tensor(x, 0.03, 117, Q.quint8)
    tx = torch.quantize_per_tensor(x, 0.03, 117, torch.quint8)
    op = torch.ops.quantized.batch_norm2d_relu if relu else torch.ops.quantized.batch_norm2d
    ref = op(tx, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, float(q.scale), int(q.zero_point))
    got = q(qx).int_repr()
    assert (got.int() - ref.int_repr().int()).abs().max() <= 1  # torch's float32 FMA ties (module doc)
    assert (got.int() == ref.int_repr().int()).float().mean() > 0.99
