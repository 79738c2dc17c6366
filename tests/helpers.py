"""Helpers shared by several test modules (not a test module): a state_dict round trip, thread-count fixtures,
``force`` (pin the CPU kernel route: VNNI or not, fbgemm or oneDNN only).

``split_over(threads, monkeypatch)``: a block on ``threads`` torch threads with every ``lowbit.native`` pass split over
them (1: never split). ``threads(n)`` makes an autouse fixture: a test module that binds or imports it runs with
``torch.set_num_threads(n)`` and the previous count comes back afterwards. ``one_thread`` (module scope) is the common
one: the 2 shared cores are oversubscribed otherwise, ~10x slower; the real-data files bind ``threads(2, ...)``: their
floors were measured at 2 threads.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn


def roundtrip(mod: nn.Module) -> dict:
    """``mod.state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``: plain tensors, no pickled code."""
    buf = io.BytesIO()
    torch.save(mod.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    return sd


@contextlib.contextmanager
def split_over(threads: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``threads`` torch threads, every native pass split over them (1: never split); the count restored after."""
    from lowbit import native

    monkeypatch.setattr(native, "_THREAD_MIN", 1 if threads > 1 else 1 << 30)
    with num_threads(threads):
        yield


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """A block on ``n`` torch threads, the previous count restored after (e.g. a test's references, whose results do
    not depend on the thread count, computed on 1 thread: on 2 shared cores torch's pool mostly waits)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def threads(n: int, scope: str = "module", name: str = "one_thread") -> Any:
    """An autouse fixture (bound to a name in a test module, or imported there) that runs that module's tests on
    ``n`` torch threads and restores the previous count after the module (``scope="module"``) or each test."""

    @pytest.fixture(autouse=True, scope=scope, name=name)  # type: ignore[call-overload]
    def _threads() -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        yield
        torch.set_num_threads(before)

    return _threads


one_thread = threads(1)


def observer_output_error(p: nn.Module, x: torch.Tensor, name: str, scale: float, zero_point: int) -> float:
    """Oracle for the grid search: the whole prepared model ``p`` run with only observer ``name`` fake-quantizing on
    ``(scale, zero_point)``, every other observer passing values through; the summed squared error against all float."""
    import lowbit as Q
    from lowbit.functional import fake_quantize

    mods = dict(p.named_modules())
    obs = [m for m in mods.values() if isinstance(m, Q.ObserverBase)]
    target = mods[name]
    try:
        for m in obs:
            m.forward = (lambda v, m=m: fake_quantize(v, torch.tensor([scale]), torch.tensor([float(zero_point)]),
                                                      m.quant_min, m.quant_max, None, float_zero_point=True)) \
                if m is target else (lambda v: v)
        with torch.no_grad():
            out = p(x)
        for m in obs:
            m.forward = lambda v: v
        with torch.no_grad():
            ref = p(x)
    finally:
        for m in obs:
            m.__dict__.pop("forward", None)
    return float((out.double() - ref.double()).pow(2).sum())


def force(monkeypatch: pytest.MonkeyPatch, *, vnni: bool, fbgemm: bool, shared: bool = True) -> None:
    """Make the oneDNN backend take its VNNI (or non-VNNI) route, with fbgemm or without, on any CPU; ``shared``: a
    VNNI CPU with AVX-512 VNNI (few rows take the routes without VNNI), else one with AVX-VNNI only."""
    from lowbit.kernels import isa, onednn

    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    if vnni and onednn.cpu_has_vnni() and onednn.isa_capped():
        # torch still sends _int_mm to this oneDNN, whose capped kernels saturate: no VNNI route to force (the cap's own
        # routes are tested unforced: test_kernels_paths.test_real_avx2_kernels_under_an_isa_cap)
        pytest.skip("ONEDNN_MAX_CPU_ISA caps oneDNN below VNNI: its VNNI route cannot be forced")
    monkeypatch.setattr(onednn, "has_vnni", lambda: vnni)
    monkeypatch.setattr(onednn, "shares_routes", lambda: shared)
    if fbgemm:
        if "x86" not in torch.backends.quantized.supported_engines:
            pytest.skip("no x86/fbgemm quantized engine")
        monkeypatch.setattr(torch.backends.quantized, "engine", "x86")
    else:
        monkeypatch.setattr(isa, "_FBGEMM", ())


def cap_changes_nothing() -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA=AVX2`` is this CPU's own ISA: ``/proc/cpuinfo`` lists no AVX-512, AMX or ``avx_*``
    (AVX-VNNI and kin) flag, so oneDNN runs its AVX2 kernels capped or not (Zen 3: ``ONEDNN_VERBOSE`` prints ``isa:Intel
    AVX2`` and the same primitives both ways) and lowbit takes the same routes (``onednn.has_vnni()`` is false and
    ``isa_capped`` only counts on a VNNI CPU). There a capped child computes exactly what this process does."""
    from lowbit.kernels import isa

    flags = isa._cpu_flags()
    return "avx2" in flags and not any(f.startswith(("avx512", "amx", "avx_")) for f in flags)


def run_capped(code: str) -> None:
    """Run ``code`` (Python; ``sys.argv[1]`` is the tests folder) in a fresh process with oneDNN capped to AVX2 and 1
    thread (its saturating kernels, lowbit's exact routes without VNNI, on any CPU); it must print ``ok`` last."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", code, here], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def sgd_steps(*pairs: tuple[torch.Tensor, torch.optim.Optimizer]) -> None:
    """One optimizer step per ``(output, optimizer)`` pair on the loss ``mean(output²)``: the QAT lockstep tests train
    a torch.ao model and its lowbit twin side by side with it."""
    for y, opt in pairs:
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()


class ConvNet(nn.Module):
    """conv-relu, an add, pooling, flatten and a linear head (3 x 8 x 8 inputs): the graph-mode model of the PyTorch 2
    tests."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.conv1(x))
        b = self.conv2(a) + a
        return self.fc(torch.flatten(torch.nn.functional.max_pool2d(b, 2), 1))


def ao_x86(fn: Any) -> Any:
    """``fn()`` on torch.ao's x86 engine with its deprecation notices silenced; the previous engine comes back."""
    import warnings

    prev = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices
            return fn()
    finally:
        torch.backends.quantized.engine = prev


class Fn(nn.Module):
    """A function as a module (a graph-mode op between layers)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class UNet(nn.Module):
    """conv → strided conv → ``up`` (an upsample) → cat with the skip → conv, ``width`` channels inside."""

    def __init__(self, up: nn.Module, width: int = 4) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.up, self.c3 = up, nn.Conv2d(2 * width, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c1(x)
        return self.c3(torch.cat([a, self.up(self.c2(a))], 1))


def randomize_bn(model: nn.Module) -> nn.Module:
    """Seeded running statistics and affine parameters in every ``BatchNorm2d/3d`` of ``model`` (a fresh BN is the
    identity map, which hides folding and int8-BN errors); returns ``model``."""
    g = torch.Generator().manual_seed(1)
    for bn in model.modules():
        if isinstance(bn, (nn.BatchNorm2d, nn.BatchNorm3d)):
            c = bn.num_features
            bn.running_mean.copy_(torch.rand(c, generator=g) * 2 - 1)
            bn.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
            bn.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
            bn.bias.data.copy_(torch.rand(c, generator=g) - 0.5)
    return model


def fresh_python(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` run by a fresh interpreter (``sys.argv[1:]`` = ``args``) that imports this checkout's lowbit, on 1
    thread: what a deployment target loading a saved program sees."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)


def bn_depthwise_net(linear_bias: bool = True) -> nn.Module:
    """The end-to-end tuning tests' toy (test_tune, test_distill, test_ties42_s42): conv + BN + ReLU6, a depthwise
    conv whose channels span two decades of weight scale, ReLU, flatten, Linear(288, 5) on 6x6 inputs; seed 0, eval."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 36, 5, bias=linear_bias))
    with torch.no_grad():
        model[3].weight.mul_(torch.logspace(-1, 1, 8).view(8, 1, 1, 1))
        model[1].running_mean.uniform_(-0.5, 0.5)
    return model.eval()


def built_with_float(model: nn.Module, inp: tuple, names: list[str], op_keys: dict) -> nn.Module:
    """The model ``prepare_fx`` / ``convert_fx`` build (default qconfig mapping, calibrated on ``inp``) with the
    layers / ops ``names`` kept float (``op_keys``: a mixed-precision table's op names to mapping keys): the oracle
    the fast mixed-precision search's rows are checked against."""
    import copy
    import warnings

    import lowbit as Q
    from lowbit.debug.table import keep_float

    mapping = Q.get_default_qconfig_mapping()
    for n in names:
        keep_float(mapping, n, op_keys)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=inp)
        p(*inp)
        return Q.convert_fx(p)


# the changes a compiled op's fast entry must see (``lowbit.pt2.fast_entry``), shared by the conv and Linear entries
STEP_ASIDE_EDITS = ("weight_int8", "weight_data", "weight_scale", "bias", "scale", "zero_point", "x_scale",
                    "x_zero_point", "other_w_scale", "other_out_scale", "backend", "vnni")


@contextlib.contextmanager
def stepped_aside(args: list, edit: str | None, at: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make one of ``STEP_ASIDE_EDITS`` to an op's argument list (in place, as a user's write would) and hold it for
    the block: ``at`` names the positions of ``weight``, ``w_scale``, ``bias``, ``scale`` and ``zero_point`` (the
    input's scale and zero point are at 1 and 2 in both ops). Writes bump versions; ``weight_data`` is a ``.data``
    swap (no version bump, another address); ``other_*`` put another object in the slot; ``backend`` pins the
    reference kernels and ``vnni`` flips the VNNI answer for the block; ``None`` changes nothing."""
    from lowbit import kernels
    from lowbit.kernels import onednn

    w, ws, b, s, zp = (at[k] for k in ("weight", "w_scale", "bias", "scale", "zero_point"))
    with torch.no_grad():
        if edit == "weight_int8":
            args[w].neg_()
        elif edit == "weight_data":
            args[w].data = args[w].flip(0).clone()
        elif edit == "weight_scale":
            args[ws].mul_(1.7)
        elif edit == "bias":
            args[b].add_(0.5)
        elif edit == "scale":
            args[s].mul_(2.0)
        elif edit == "zero_point":
            args[zp].sub_(7)
        elif edit == "x_scale":
            args[1].mul_(1.5)
        elif edit == "x_zero_point":
            args[2].sub_(3)
        elif edit == "other_w_scale":
            args[ws] = args[ws].clone()
        elif edit == "other_out_scale":
            args[s] = args[s].clone()
        elif edit not in ("backend", "vnni", None):
            raise ValueError(f"unknown edit {edit!r}")
    if edit == "vnni":
        flipped = not onednn.has_vnni()
        monkeypatch.setattr(onednn, "has_vnni", lambda: flipped)
    with kernels.use_backend("reference") if edit == "backend" else contextlib.nullcontext():
        yield


class Inverted(nn.Module):
    """MobileNetV2's inverted residual: expand 1x1 + ReLU6, depthwise 3x3 + ReLU6, project 1x1, + input."""

    def __init__(self, c: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, 4 * c, 1), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c), nn.ReLU6())
        self.project = nn.Conv2d(4 * c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.dw(self.expand(x)))


def inverted_net() -> nn.Module:
    """A small MobileNetV2-like net (seeded): stem, two inverted residuals, pooling, a classifier; takes (N, 3, H, W)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), Inverted(8), nn.Conv2d(8, 12, 1), Inverted(12),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5)).eval()


class LnAfter(nn.Module):
    """Linear -> LayerNorm -> Linear (8 -> 8 -> 4): a float op right after the int8 region."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln, self.fc2 = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.fc(x)))


def converted_smallcnn(batch: int) -> tuple[nn.Module, torch.Tensor]:
    """SmallCNN converted on the default qconfig (fused, two random calibration batches of 32, seed 0) and a random
    batch of ``batch`` images."""
    import lowbit as Q
    from lowbit.examples import SmallCNN
    torch.manual_seed(0)
    m = Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups())
    p = Q.prepare(m, Q.get_default_qconfig())
    with torch.inference_mode():
        for _ in range(2):
            p(torch.randn(32, 1, 28, 28))
    return Q.convert(p), torch.randn(batch, 1, 28, 28)
