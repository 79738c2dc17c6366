"""Session 38: small local versions of torchvision's architectures through eager and graph mode, as written.

torchvision's quantizable ResNet50 / MobileNetV3 ``fuse_model`` (modules registered in another order than they run),
ShuffleNetV2's channel shuffle (``torch.transpose``, ``x.chunk(2, dim=1)``), a Bottleneck's shared
``ReLU(inplace=True)`` in ``quantize_ptq``'s block reconstruction, empty ``nn.Sequential`` branches.
Oracles: torch.ao's ``fuse_modules`` and the float model (the fused function), the graph-mode reference model
(``convert_to_reference_fx``: the int8 model within one output quantum), the layer-by-layer recipe.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _bn(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    for b in m.modules():
        if isinstance(b, nn.BatchNorm2d):
            b.running_mean.copy_(torch.randn(b.num_features, generator=g) * 0.1)
            b.running_var.copy_(torch.rand(b.num_features, generator=g) + 0.5)
    return m.eval()


# ---- fuse_modules judges the run order, not the registration order ----
class _Bottleneck(nn.Module):
    """torchvision's Bottleneck as its quantizable subclass extends it: relu1 / relu2 registered after downsample."""

    def __init__(self, c: int = 8, w: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, w, 1, bias=False), nn.BatchNorm2d(w)
        self.conv2, self.bn2 = nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)
        self.conv3, self.bn3 = nn.Conv2d(w, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu, self.downsample = nn.ReLU(inplace=True), None
        self.skip_add_relu = nnq.FloatFunctional()
        self.relu1, self.relu2 = nn.ReLU(inplace=False), nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        return self.skip_add_relu.add_relu(self.bn3(self.conv3(out)), x)


class _SqueezeExcitation(nn.Module):
    """torchvision's SqueezeExcitation: fc2 registered before activation, which runs between fc1 and fc2."""

    def __init__(self, c: int = 8, s: int = 4) -> None:
        super().__init__()
        self.avgpool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, s, 1), nn.Conv2d(s, c, 1)
        self.activation, self.scale_activation = nn.ReLU(), nn.Hardsigmoid()
        self.skip_mul = nnq.FloatFunctional()

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip_mul.mul(self._scale(x), x)


@pytest.mark.parametrize(("make", "groups"), [
    (_Bottleneck, [["conv1", "bn1", "relu1"], ["conv2", "bn2", "relu2"], ["conv3", "bn3"]]),
    (_SqueezeExcitation, [["fc1", "activation"]]),
])
def test_torchvision_fuse_model_groups_registered_out_of_run_order_fuse_as_torch_ao(make, groups):
    torch.manual_seed(0)
    model, x = _bn(make()), torch.randn(2, 8, 5, 5)
    ours = Q.fuse_modules(model, groups)  # raised "['conv2', 'bn2', ...] sits between them" / "['fc2'] ..."
    theirs = tq.fuse_modules(model, groups)
    assert [type(m).__name__ for m in ours.children()] == [type(m).__name__ for m in theirs.children()]
    torch.testing.assert_close(ours(x), model(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


class _PlainBasicBlock(nn.Module):
    """torchvision's (non-quantizable) BasicBlock: one ReLU module run after bn1 and after the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += x
        return self.relu(out)


class _ReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


def test_fusing_a_module_run_twice_or_an_output_read_twice_is_refused():
    """torch.ao fuses both silently: the second ReLU call becomes the identity, the skip reads BN(conv(x))."""
    x = torch.randn(2, 4, 5, 5)
    block = _bn(_PlainBasicBlock())
    assert (tq.fuse_modules(block, ["conv1", "bn1", "relu"])(x) - block(x)).abs().max() > 0.1  # (what lowbit did)
    with pytest.raises(ValueError, match=r"'relu' runs 2 times in _PlainBasicBlock.forward"):
        Q.fuse_modules(block, ["conv1", "bn1", "relu"])
    with pytest.raises(ValueError, match=r"the output of 'conv' is also read by \['add'\]"):
        Q.fuse_modules(_bn(_ReadTwice()), ["conv", "bn"])
    # the adjacent groups of that block still fuse
    fused = Q.fuse_modules(block, [["conv2", "bn2"]])
    torch.testing.assert_close(fused(x), block(x), atol=1e-5, rtol=0)


# ---- empty containers are not layers left float ----
class _EmptyBranches(nn.Module):
    """ShuffleNetV2's stride-1 unit keeps ``branch1 = nn.Sequential()`` (never called); CIFAR ResNets call an empty
    ``shortcut = nn.Sequential()`` as the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv, self.branch1, self.shortcut = nn.Conv2d(3, 4, 3), nn.Sequential(), nn.Sequential()
        self.extra = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.shortcut(self.conv(self.quant(x))))


def test_empty_sequential_and_module_list_are_not_reported_as_float_layers():
    torch.manual_seed(0)
    model, x = _EmptyBranches().eval(), torch.randn(2, 3, 8, 8)
    model.qconfig = Q.get_default_qconfig()
    prepared = Q.prepare(model)
    prepared(x)
    q, report = Q.convert(prepared, return_report=True)
    assert report.left_float == {}  # listed 'branch1', 'shortcut', 'extra' as "(no quantized mapping)"
    assert sorted(report.converted) == ["conv", "dequant", "quant"]
    assert _sqnr(model(x), q(x)) > 30


# ---- graph mode: the view ops as functions, chunk / split ----
class _ShuffleUnit(nn.Module):
    """ShuffleNetV2's stride-1 unit, as torchvision writes it."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        b = c // 2
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.branch2 = nn.Sequential(nn.Conv2d(b, b, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU(),
                                     nn.Conv2d(b, b, 3, padding=1, groups=b, bias=False), nn.BatchNorm2d(b),
                                     nn.Conv2d(b, b, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU())
        self.head = nn.Conv2d(c, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x1, x2 = x.chunk(2, dim=1)
        out = torch.cat((x1, self.branch2(x2)), dim=1)
        n, c, h, w = out.size()
        out = torch.transpose(out.view(n, 2, c // 2, h, w), 1, 2).contiguous().view(n, -1, h, w)
        out = torch.unsqueeze(torch.permute(out, (0, 2, 3, 1)), 1)           # (N, 1, H, W, C)
        out = torch.permute(torch.squeeze(out, 1), (0, 3, 1, 2))
        return self.head(torch.reshape(out, (n, c, h, w)))


def test_channel_shuffle_and_chunk_stay_on_the_codes_in_graph_mode():
    torch.manual_seed(0)
    model, x = _bn(_ShuffleUnit()), torch.randn(2, 3, 8, 8)
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    for _ in range(3):
        p(torch.randn(2, 3, 8, 8))
    ref = Q.convert_to_reference_fx(copy.deepcopy(p))
    q = Q.convert_fx(p)
    # one Quantize (the input) and one DeQuantize (the output): the chunk was dequantized and each half quantized
    # again (not reported), torch.transpose / permute / squeeze / unsqueeze / reshape ran float (reported)
    stubs = [type(q.get_submodule(n.target)).__name__ for n in q.graph.nodes if n.op == "call_module"
             and isinstance(q.get_submodule(n.target), (nnq.Quantize, nnq.DeQuantize))]
    assert stubs == ["Quantize", "DeQuantize"]
    assert q.lowbit_report.left_float == {}
    y, step = q(x), q.head.scale
    assert float((y - ref(x)).abs().max()) <= float(step) + 1e-6  # the reference model, within one quantum
    assert _sqnr(model(x), y) > 30


# ---- quantize_ptq "accurate": block reconstruction ----
class _ShuffleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unit, self.fc = _ShuffleUnit(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.unit(x).mean((2, 3)))


def test_accurate_recipe_runs_on_a_chunked_block():
    """A cut of the residual-block search was the ``x.chunk(2, dim=1)`` tuple: AttributeError ('tuple' ... 'shape')."""
    torch.manual_seed(0)
    model = _bn(_ShuffleNet())
    calib = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=2, refine=0, progress=False)
    assert any("per residual block" in s and not s.startswith("0 ") for _, s in report.steps if "rounded" in s)
    assert report.sqnr_db > 30 and _sqnr(model(calib[1]), q(calib[1])) > 30


class _SharedReLUNet(nn.Module):
    """torchvision's Bottleneck (not the quantizable one): one ``ReLU(inplace=True)`` run three times."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(16, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv3, self.bn3 = nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x
        return self.fc(torch.flatten(self.relu(out).mean((2, 3)), 1))


def test_block_bias_correction_targets_survive_a_shared_in_place_relu():
    """The float block run kept each layer's output as its bias-correction target, and the in-place ReLU after
    the layer's observer rewrote it: biases shifted by ~0.5 toward ReLU'd means (report 30 dB where the
    layer-by-layer recipe gives 45)."""
    torch.manual_seed(0)
    model = _bn(_SharedReLUNet())
    calib = [torch.randn(8, 3, 8, 8) for _ in range(2)]
    kw = dict(recipe="accurate", iters=2, refine=0, equalize=False, learn_grids=False, float_output=False,
              progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, blocks = Q.quantize_ptq(model, calib, blocks=True, **kw)
        _, layers = Q.quantize_ptq(model, calib, blocks=False, **kw)
    in_block = [c for c in blocks.layers if any(n.startswith("block ") for n in c.notes)]
    assert len(in_block) == 3
    assert max(c.bias_shift for c in blocks.layers) < 5 * max(c.bias_shift for c in layers.layers)
    assert all(c.mse_nearest < 10 * c2.mse_nearest for c, c2 in zip(blocks.layers, layers.layers, strict=True))
    assert blocks.sqnr_db > layers.sqnr_db - 3
