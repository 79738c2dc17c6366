"""Eager prepared / QAT models keep a resampled input's grid (session 40). The converted model runs a functional (or
``nn.Upsample``) bilinear upsample on the codes, on its input's grid, and hands those codes to the next layer; the
eager prepared / QAT model resampled float values and the next layer observed (QAT: fake-quantized) them on its own
input grid: QAT vs converted within 2 output steps, 59 % exact. Nearest upsampling and functional max pooling (codes
selected, grid kept after convert) had the same gap (one step, ~88-91 % exact). Now the prepared root runs a
``TorchFunctionMode`` (``workflow/shared_grids.py``, installed where the model can call these functionals): those
functionals keep the input's grid and bilinear outputs take the int8 kernel's codes
(``qtensor.resample.bilinear_on_grid``). Oracle: the converted model (lowbit's bilinear codes equal torch's
quantized kernel, ``tests/test_bilinear_s39.py``).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import Fn, one_thread  # noqa: F401  (autouse: one thread)
from lowbit.qtensor.resample import bilinear_codes


class Net(nn.Module):
    """QuantStub -> conv -> ReLU -> ``up`` -> conv -> DeQuantStub; returns the head and the resampled values."""

    def __init__(self, up: nn.Module, c: int = 8, k: int = 3) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.relu, self.up, self.c2 = nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), up, nn.Conv2d(c, 4, k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.up(self.relu(self.c1(self.quant(x))))
        return self.dequant(self.c2(u)), self.dequant(u)


UPS = {
    "F.interpolate": lambda: Fn(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")),
    "F.interpolate-size-align": lambda: Fn(lambda t: F.interpolate(t, size=(13, 11), mode="bilinear",
                                                                   align_corners=True)),
    "F.upsample_bilinear": lambda: Fn(lambda t: F.upsample_bilinear(t, scale_factor=2)),
    "Upsample": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "UpsamplingBilinear2d": lambda: nn.UpsamplingBilinear2d(scale_factor=2),
    "F.interpolate-nearest": lambda: Fn(lambda t: F.interpolate(t, scale_factor=2)),
    "F.max_pool2d": lambda: Fn(lambda t: F.max_pool2d(t, 1)),
}


def _qat(model: nn.Module, x: torch.Tensor, qconfig: Q.QConfig | None = None, steps: int = 3) -> nn.Module:
    p = Q.prepare_qat(model.train(), qconfig or Q.get_default_qat_qconfig())
    opt = torch.optim.SGD(p.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        p(x)[0].square().mean().backward()
        opt.step()
    p.apply(Q.disable_observer)
    return p.eval()


def _steps(a: torch.Tensor, b: torch.Tensor, step: float) -> tuple[float, float]:
    d = (a - b).abs() / step
    return float((d < 1e-3).double().mean()), float(d.max())


@pytest.mark.parametrize("name", list(UPS))
def test_eager_qat_equals_its_converted_model(name):
    """Before: bilinear 58.7-60.4 % of the head's outputs exact, up to 2.0 steps; nearest 90.7 %, max_pool2d 87.5 %
    (1 step). Now every output and every resampled code is equal."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (F.upsample_bilinear is deprecated)
        p = _qat(Net(UPS[name]()), x)
        q = Q.convert(copy.deepcopy(p))
        with torch.no_grad():
            (head, up), (qhead, qup) = p(x), q(x)
    assert _steps(head, qhead, float(q.c2.scale)) == (1.0, 0.0)
    assert torch.equal(up, qup)
    assert q.c2.input_grid is None  # (it reads the upsample's codes; the QAT model's c2 observed no input of its own)


def _sweep(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(["size", "scale", "recompute"])
        if kind == "size":
            kw = {"size": (rng.randint(1, 15), rng.randint(1, 15))}
        else:
            kw = {"scale_factor": (rng.choice([0.5, 0.7, 1.0, 1.5, 2.0, 2.3, 3.0]), rng.choice([0.6, 1.0, 1.7, 2.0])),
                  "recompute_scale_factor": kind == "recompute"}
        kw["align_corners"] = rng.random() < 0.5
        yield (rng.randint(2, 7), rng.randint(2, 7)), kw


def test_qat_sweep_codes_equal_converted_codes():
    """24 random resamples (sizes, scale factors up and down, recompute, align_corners): the QAT model's resampled
    values are the converted model's codes, code for code (before: the float op, off the grid)."""
    torch.manual_seed(3)
    for (h, w), kw in _sweep(24, 0):
        x = torch.randn(4, 3, h, w)
        p = _qat(Net(Fn(lambda t, kw=kw: F.interpolate(t, mode="bilinear", **kw)), c=5, k=1), x, steps=1)
        q = Q.convert(copy.deepcopy(p))
        with torch.no_grad():
            (head, up), (qhead, qup) = p(x), q(x)
        assert torch.equal(up, qup), kw
        assert _steps(head, qhead, float(q.c2.scale)) == (1.0, 0.0), kw


def test_bilinear_on_grid_is_the_kernels_codes_with_the_fake_quant_gradient():
    """The float form of the kernel: the codes of ``bilinear_codes`` on the input's codes (ties to even around
    ``-z``: rounding ``F.interpolate``'s float output moves them), and the gradient of the fake-quantized float op."""
    from lowbit.qtensor.resample import bilinear_on_grid  # (new in session 40)
    q = torch.tensor([[[[10, 11], [12, 14]]]], dtype=torch.int32)
    for z in (0, 3, 41):
        s = torch.tensor(0.1)
        x = ((q - z) * s).requires_grad_()
        y = torch.fake_quantize_per_tensor_affine(F.interpolate(x, scale_factor=2, mode="bilinear"), s, z, 0, 255)
        out = bilinear_on_grid(x, y, s, torch.tensor(z), 0, 255, None, scale_factor=2)
        want = bilinear_codes(q, torch.tensor(z), 0, 255, (4, 4), False)
        assert torch.equal((out.detach() / s).round().int() + z, want)
        if z == 3:
            assert not torch.equal((y.detach() / s).round().int() + z, want)  # (the float op's ties)
        out.sum().backward()
        assert torch.allclose(x.grad, torch.full_like(x, 4.0))  # (each input feeds 16 outputs, weights sum to 4)


def test_lsq_qat_trains_and_equals_converted():
    """LSQ: the second call of the input's fake-quant in one forward trains (no in-place version bump: the learned
    grid is read without ``calculate_qparams``' clamp) and the model equals its converted one."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    model = Net(UPS["F.interpolate"]())
    p = Q.prepare_qat(model.train(), Q.get_lsq_qat_qconfig())
    opt = torch.optim.SGD(p.parameters(), lr=1e-3)
    for step in range(4):
        if step == 2:
            p.apply(lambda m: m.enable_param_learning() if hasattr(m, "enable_param_learning") else None)
        opt.zero_grad()
        p(x)[0].square().mean().backward()
        opt.step()
    p.apply(Q.disable_observer)
    p.eval()
    q = Q.convert(copy.deepcopy(p))
    with torch.no_grad():
        (head, up), (qhead, qup) = p(x), q(x)
    assert torch.equal(up, qup) and _steps(head, qhead, float(q.c2.scale)) == (1.0, 0.0)


def test_prepared_reference_and_lowered_models_equal_converted():
    """Post-training: calibration sees the upsampled values through the input's observer (graph mode's obs_share);
    the next conv records no input grid; the eager reference model holds the kernel's codes, so it equals the int8
    model (before: within one step at the kernel's ties) and so does its lowered model."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    p = Q.prepare(Net(UPS["F.interpolate"]()).eval(), Q.get_minmax_qconfig())
    seen: list[tuple[int, ...]] = []
    h = p.c1.activation_post_process.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    with torch.no_grad():
        p(x)
    h.remove()
    assert seen == [(8, 8, 6, 5), (8, 8, 12, 10)]  # its own output, then the upsampled one
    assert not Q.fake_quant.base.holds_grid(p.c2.input_activation_post_process)
    q = Q.convert(copy.deepcopy(p))
    ref = Q.convert(copy.deepcopy(p), is_reference=True)
    with torch.no_grad():
        want, got, low = q(x), ref(x), Q.lower_reference(ref)(x)
    assert torch.equal(got[1], want[1]) and torch.equal(low[0], want[0])
    assert _steps(got[0], want[0], float(q.c2.scale))[1] <= 1.001  # (the reference conv sums in float)


def test_untagged_and_float_resamples_are_left_alone():
    """A float tensor no observed module made, and antialiased bilinear (float after convert too): the next conv
    observes them on its own input grid, as before."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 5)

    class Plain(nn.Module):
        def __init__(self, antialias: bool) -> None:
            super().__init__()
            self.c1, self.c2, self.antialias = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1), antialias

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            if not self.antialias:
                t = F.interpolate(t, scale_factor=2, mode="bilinear")  # (the graph input: float)
            t = self.c1(t)
            return self.c2(F.interpolate(t, scale_factor=0.5, mode="bilinear", antialias=self.antialias))

    for antialias in (False, True):
        p = Q.prepare(Plain(antialias).eval(), Q.get_minmax_qconfig())
        with torch.no_grad():
            p(x)
        assert Q.fake_quant.base.holds_grid(p.c1.input_activation_post_process)
        assert Q.fake_quant.base.holds_grid(p.c2.input_activation_post_process) == antialias


def test_mode_is_off_after_an_error_and_gone_after_convert():
    from torch.overrides import _get_current_function_mode_stack
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5)
    p = Q.prepare(Net(UPS["F.interpolate"]()).eval(), Q.get_minmax_qconfig())
    p(x)
    with pytest.raises(RuntimeError):
        p(torch.randn(2, 5, 6, 5))  # (a wrong channel count: conv's own error)
    assert _get_current_function_mode_stack() == []
    q = Q.convert(p)
    assert not q._forward_pre_hooks and not q._forward_hooks


def test_compiled_qat_model_equals_eager():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 5)
    p = _qat(Net(UPS["F.interpolate"]()), x, steps=1)
    compiled = torch.compile(p, backend="aot_eager")
    with torch.no_grad():
        got, want = compiled(x)[1], p(x)[1]
    assert _steps(got, want, float(p.c1.activation_post_process.scale)) == (1.0, 0.0)  # (same codes; float ulps)


def test_onnx_of_eager_qat_resamples_the_codes(tmp_path):
    """The export twin writes the upsample as a Resize of the codes on the input's grid (``export/codes.py``):
    ORT's resampled values equal the QAT model's (and the converted model's) code for code."""
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    model = Net(UPS["F.interpolate"](), c=3)
    model.c1 = nn.Identity()  # (the upsample reads the QuantStub's codes: ORT's float conv moves near-ties of its own)
    p = _qat(model, x)
    path = to_onnx(p, x[:2], tmp_path / "qat.onnx")
    head, up = run_onnx(path, x)
    with torch.no_grad():
        want_head, want_up = p(x)
    assert _steps(up, want_up, float(p.quant.activation_post_process.scale)) == (1.0, 0.0)  # (DequantizeLinear: ulps)
    step = float(p.c2.activation_post_process.scale)
    assert _steps(head, want_head, step)[1] <= 1.001  # (ORT's float conv at near-ties)


def _resize(t: torch.Tensor) -> torch.Tensor:  # a module-level helper a forward calls (the mode must be installed)
    return F.interpolate(t, scale_factor=2, mode="bilinear")


class ViaHelper(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _resize(t)


@pytest.mark.parametrize("prep", ["prepare", "prepare_qat"])
def test_the_mode_is_installed_only_where_the_model_can_resample(prep: str) -> None:
    from lowbit.workflow.hooks import _enter_shared_grids
    from lowbit.workflow.shared_grids import calls_resampling

    def hooked(m: nn.Module) -> bool:
        return _enter_shared_grids in m._forward_pre_hooks.values()

    qc = Q.get_default_qat_qconfig() if prep == "prepare_qat" else Q.get_default_qconfig()
    fn = getattr(Q, prep)
    plain = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), Q.DeQuantStub())
    assert not calls_resampling(plain) and not hooked(fn(copy.deepcopy(plain).train(prep == "prepare_qat"), qc))
    for up in (ViaHelper(), nn.Upsample(scale_factor=2), UPS["F.max_pool2d"]()):
        model = Net(up).train(prep == "prepare_qat")
        assert calls_resampling(model) and hooked(fn(model, qc)), type(up).__name__
    # through a module-level helper the QAT model still equals its converted model, code for code
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 5)
    q = _qat(Net(ViaHelper()), x) if prep == "prepare_qat" else None
    if q is not None:
        head, _ = q(x)
        qhead, _ = Q.convert(copy.deepcopy(q))(x)
        assert _steps(head, qhead, float(Q.convert(copy.deepcopy(q)).c2.scale)) == (1.0, 0.0)
