"""Graph-mode bilinear upsampling on a shared grid, code for code (session 40, graphbl40).

``prepare_fx`` / ``prepare_qat_fx`` call the upsample input's observer again on its output (``obs_share``) and
``convert_fx`` runs the upsample on the codes (torch's quantized kernel, ``qtensor/resample.py``). The QAT simulation
and the reference model (``convert_to_reference_fx``) rounded the float op's output instead: one step off the
converted model at the kernel's near-ties (a 40-case sweep: QAT 99.46 % of codes equal, reference 99.92 %). Now a
``grid_blend`` node after each shared-grid fake-quant (``bilinear_on_shared_grid``) takes the kernel's codes on its
grid, the reference model a ``bilinear_on_grid`` call on the pair's buffers; ``convert_fx``, lowering and the ONNX
twin drop it. Oracle: the converted model (lowbit's codes equal torch's quantized kernel, tests/test_bilinear_s39.py).
"""

from __future__ import annotations

import copy
import pickle
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: one thread)
from lowbit.fx.classify import drop_grid_blends
from lowbit.reference.ops import bilinear_per_tensor
from lowbit.workflow.shared_grids import bilinear_on_shared_grid


class Net(nn.Module):
    """conv -> (ReLU) -> ``up`` (a function of the tensor, or a module) -> 1x1 conv; returns the upsample's input, its
    output and the head."""

    def __init__(self, up, relu: bool = False, c: int = 5) -> None:
        super().__init__()
        self.c1, self.c2, self.relu = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 4, 1), relu
        self.up = up if isinstance(up, nn.Module) else None
        self.fn = None if isinstance(up, nn.Module) else up

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.c1(x)
        if self.relu:
            h = torch.relu(h)
        u = self.up(h) if self.up is not None else self.fn(h)
        return h, u, self.c2(u)


FORMS = {
    "interpolate-scale": lambda: lambda h: F.interpolate(h, scale_factor=2, mode="bilinear"),
    "interpolate-size-align": lambda: lambda h: F.interpolate(h, size=(13, 11), mode="bilinear", align_corners=True),
    "interpolate-recompute": lambda: lambda h: F.interpolate(h, scale_factor=1.7, mode="bilinear",
                                                             recompute_scale_factor=True),
    "interpolate-positional": lambda: lambda h: F.interpolate(h, None, 2.5, "bilinear", False),
    "upsample": lambda: lambda h: F.upsample(h, scale_factor=3, mode="bilinear"),
    "upsample_bilinear": lambda: lambda h: F.upsample_bilinear(h, scale_factor=2),
    "nn.Upsample": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "nn.UpsamplingBilinear2d": lambda: nn.UpsamplingBilinear2d(size=(11, 9)),
    "bilinear-of-bilinear": lambda: lambda h: F.interpolate(F.interpolate(h, scale_factor=2, mode="bilinear"),
                                                            scale_factor=1.5, mode="bilinear"),
    "bilinear-relu-view": lambda: lambda h: torch.relu(F.interpolate(h, scale_factor=2, mode="bilinear")).view(
        h.shape[0], h.shape[1], h.shape[2] * 2, h.shape[3] * 2),
}


def _sweep(n: int, seed: int):
    """Random ``(h, w)`` input sizes and ``F.interpolate`` keywords: sizes down to 1, scale factors up and down (per
    axis too), recompute, align_corners, a ReLU before (zero point 0) or not."""
    rng = random.Random(seed)
    for _ in range(n):
        kw: dict = {"align_corners": rng.random() < 0.5}
        if rng.random() < 0.3:
            kw["size"] = (rng.randint(1, 17), rng.randint(1, 17))
        else:
            kw["scale_factor"] = rng.choice([2, 3, 0.5, 1.7, 2.5, 4, (2, 1.5), 0.75])
            if rng.random() < 0.3:
                kw["recompute_scale_factor"] = True
        yield (rng.randint(2, 9), rng.randint(2, 9)), kw, rng.random() < 0.5


def _qat(model: nn.Module, x: torch.Tensor, mapping=None, steps: int = 2) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_qat_fx(model.train(), mapping or Q.get_default_qat_qconfig_mapping(), (x,))
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    for _ in range(steps):
        p(x)[2].square().mean().backward()
        opt.step()
        opt.zero_grad()
    p.apply(Q.disable_observer)
    return p.eval()


def _ptq(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), (x,))
    with torch.no_grad():
        p(x)
    return p


def _convert(p: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Q.convert_fx(copy.deepcopy(p))


def _off(a: torch.Tensor, b: torch.Tensor, step: float) -> tuple[int, float]:
    """(values more than a thousandth of a step apart, the largest gap in steps)."""
    d = (a - b).abs() / step
    return int((d > 1e-3).sum()), float(d.max())


def _up_step(q: nn.Module) -> float:
    """The converted model's grid of the upsample's input (c1's output)."""
    return float(q.c1.scale)


def _kernel(up, h: torch.Tensor, q: nn.Module) -> torch.Tensor:
    """The oracle: ``up`` run by the int8 model on the codes of ``h`` (the model's own upsample input) on the
    converted grid (lowbit's QTensor kernel, torch's quantized kernel's codes: tests/test_bilinear_s39.py)."""
    with torch.no_grad():
        return up(Q.quantize_per_tensor(h, float(q.c1.scale), int(q.c1.zero_point), Q.quint8)).dequantize()


def _check(model: nn.Module, q: nn.Module, up, x: torch.Tensor) -> None:
    """``model``'s upsample is the kernel's on its own input (exact), and within a step of the converted model's
    (the conv before it rounds its sums in float in QAT / reference: a near-tie there moves its codes); its head
    within a step of the converted head."""
    with torch.no_grad():
        (h, u, head), (_, qu, qhead) = model(x), q(x)
    assert _off(u, _kernel(up, h, q), _up_step(q)) == (0, 0.0)
    assert _off(u, qu, _up_step(q))[1] <= 1.001
    assert _off(head, qhead, float(q.c2.scale))[1] <= 1.001


# ---- 1. QAT simulation == converted model ---------------------------------------------------------------------------
def test_qat_sweep_equals_converted_code_for_code():
    """24 random upsamples: the QAT model's resampled values are the int8 kernel's codes of its own input, every one,
    and the converted model's (before: 0.5 % of the codes one step off)."""
    torch.manual_seed(0)
    equal = total = 0
    for (h, w), kw, relu in _sweep(24, 1):
        x = torch.randn(8, 3, h, w)
        fn = lambda t, kw=kw: F.interpolate(t, mode="bilinear", **kw)  # noqa: E731
        p = _qat(Net(fn, relu), x)
        q = _convert(p)
        _check(p, q, fn, x)
        with torch.no_grad():
            n, _ = _off(p(x)[1], q(x)[1], _up_step(q))
        equal, total = equal + q(x)[1].numel() - n, total + q(x)[1].numel()
    assert equal == total  # (no near-tie of the convs in this sweep: the whole model agrees)


@pytest.mark.parametrize("form", list(FORMS))
def test_qat_forms_equal_converted(form):
    """Each way of writing a bilinear upsample (functionals, positional arguments, modules, chained, behind share
    ops): QAT equals the kernel code for code (an upsample of an upsample was not shared at all: 2 steps off)."""
    torch.manual_seed(1)
    x = torch.randn(16, 3, 7, 6)
    up = FORMS[form]()
    p = _qat(Net(up), x)
    _check(p, _convert(p), up, x)


def test_lsq_qat_takes_its_learned_grid():
    """LSQ (``LearnableFakeQuantize``): the blend reads the learned scale and zero point; it trains (backward through
    the shared grid) and equals the kernel."""
    torch.manual_seed(2)
    x = torch.randn(8, 3, 6, 5)
    mapping = Q.QConfigMapping().set_global(Q.get_lsq_qat_qconfig())
    up = FORMS["interpolate-scale"]()
    p = _qat(Net(up), x, mapping, steps=3)
    _check(p, _convert(p), up, x)


# ---- 2. reference models --------------------------------------------------------------------------------------------
def test_reference_sweep_equals_converted_and_lowers_to_it():
    """``convert_to_reference_fx`` of calibrated (PTQ) and QAT graphs: the upsample's values are the kernel's codes,
    every one (before: 0.08 % one step off); lowering gives the converted model again."""
    torch.manual_seed(3)
    for i, ((h, w), kw, relu) in enumerate(_sweep(16, 2)):
        x = torch.randn(8, 3, h, w)
        fn = lambda t, kw=kw: F.interpolate(t, mode="bilinear", **kw)  # noqa: E731
        p = _qat(Net(fn, relu), x, steps=1) if i % 2 else _ptq(Net(fn, relu), x)
        q = _convert(p)
        ref = Q.convert_to_reference_fx(copy.deepcopy(p))
        _check(ref, q, fn, x)
        low = Q.lower_reference(copy.deepcopy(ref))
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(low(x), q(x)))


def test_reference_graph_calls_the_kernel_on_its_own_grid_buffers():
    """The reference graph reads as ``bilinear_per_tensor(x, dequantize(quantize(up, s, z, ...)), s, z, qmin, qmax,
    ...)`` on buffers that ``state_dict`` carries; no fake-quant is left in it; a reference model loading another
    calibration's state_dict follows its grids."""
    torch.manual_seed(4)
    x = torch.randn(8, 3, 6, 5)
    p = _qat(Net(FORMS["interpolate-scale"]()), x)
    ref = Q.convert_to_reference_fx(copy.deepcopy(p))
    calls = [n for n in ref.graph.nodes if n.op == "call_function" and n.target is bilinear_per_tensor]
    assert len(calls) == 1 and all(a.op == "get_attr" for a in calls[0].args[2:4])
    assert "bilinear_on_shared_grid" not in ref.code
    assert not any(isinstance(m, Q.FakeQuantize) for m in ref.modules())
    other = _qat(Net(FORMS["interpolate-scale"]()), 2 * x)
    ref2 = Q.convert_to_reference_fx(copy.deepcopy(other))
    ref2.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert torch.equal(ref2(x)[1], ref(x)[1])


# ---- 3. what the blend leaves alone ---------------------------------------------------------------------------------
def _dropped(p: fx.GraphModule) -> fx.GraphModule:
    d = copy.deepcopy(p)
    drop_grid_blends(d)
    d.recompile()
    return d


def test_calibration_and_gradients_are_the_float_ops():
    """An observer (calibration) and a disabled fake-quant get the float op's values (the node passes them on), and
    the QAT gradient is the fake-quantized float op's: the same as with the node dropped."""
    torch.manual_seed(5)
    x = torch.randn(4, 3, 6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(Net(FORMS["interpolate-scale"]()).eval(), Q.get_default_qconfig_mapping(), (x,))
    d = _dropped(p)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(p(x), d(x)))
    assert torch.equal(p.activation_post_process_0.max_val, d.activation_post_process_0.max_val)
    qp = _qat(Net(FORMS["interpolate-scale"]()), x)
    qd = _dropped(qp)
    for m in (qp, qd):
        m(x)[1].sum().backward()
    assert qp.c1.weight.grad is not None and qp.c1.weight.grad.abs().sum() > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(qp.parameters(), qd.parameters()) if a.grad is not None)
    qp.apply(Q.disable_fake_quant)
    with torch.no_grad():
        y = F.interpolate(qp.c1(x), scale_factor=2, mode="bilinear")
        assert torch.equal(qp(x)[1], y)


def test_prepared_graph_node_converts_away_and_survives_copies():
    """The prepared graph holds one ``bilinear_on_shared_grid`` node reading the fake-quant by ``get_attr`` (no state
    of its own: the state_dict keys are unchanged); deepcopy and pickle keep it; the converted model has neither the
    node nor the fake-quant."""
    torch.manual_seed(6)
    x = torch.randn(4, 3, 6, 5)
    p = _qat(Net(FORMS["nn.Upsample"]()), x)
    blends = [n for n in p.graph.nodes if n.target is bilinear_on_shared_grid]
    assert len(blends) == 1 and blends[0].args[2].op == "get_attr"
    assert set(p.state_dict()) == set(_dropped(p).state_dict())
    again = pickle.loads(pickle.dumps(p))
    with torch.no_grad():
        assert torch.equal(again(x)[1], p(x)[1])
    q = _convert(p)
    assert "bilinear_on_shared_grid" not in q.code and not any(isinstance(m, Q.FakeQuantize) for m in q.modules())
    assert not [k for k in q.state_dict() if "activation_post_process" in k]


def test_bilinear_on_shared_grid_leaves_per_row_grids_and_plain_modules_alone():
    """A grid along a resampled axis, an observer and a module with no grid give ``y`` back."""
    x = torch.rand(1, 2, 3, 3)
    y = F.interpolate(x, scale_factor=2, mode="bilinear")
    fq = Q.FakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=2)
    fq(x)
    assert bilinear_on_shared_grid(x, y, fq, None, 2) is y
    assert bilinear_on_shared_grid(x, y, nn.Identity(), None, 2) is y


# ---- 4. compile / export of converted models, the ONNX twin ---------------------------------------------------------
def test_compile_and_export_of_the_converted_qat_model():
    torch.manual_seed(7)
    x = torch.randn(4, 3, 6, 5)
    p = _qat(Net(FORMS["interpolate-scale"]()), x)
    q = _convert(p)
    with torch.no_grad():
        want = q(x)
        got = torch.compile(q, fullgraph=True, backend="aot_eager")(x)
        ep = torch.export.export(q, (x,))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(ep.module()(x), want))
        assert all(torch.equal(a, b) for a, b in zip(torch.compile(p, backend="aot_eager")(x), p(x)))


def test_onnx_of_graph_qat_equals_qat_and_converted(tmp_path):
    """The export twin drops the node (its upsample already runs on the codes, ``export/codes.py``): ORT's resampled
    values are the kernel's codes of its own input, as the QAT model's are (they were within one step); an upsample
    of an upsample is written on the codes as well, and so are ``F.upsample`` / ``F.upsample_bilinear``."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx
    torch.manual_seed(8)
    x = torch.randn(8, 3, 6, 5)
    for form in ("interpolate-scale", "bilinear-of-bilinear", "upsample", "upsample_bilinear"):
        p = _qat(Net(FORMS[form]()), x)
        q = _convert(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_onnx(copy.deepcopy(p), x[:2], tmp_path / f"{form}.onnx")
        import onnx
        ops = {n.op_type for n in onnx.load(str(tmp_path / f"{form}.onnx")).graph.node}
        assert "Resize" not in ops, form
        xs = torch.randn(16, 3, 6, 5, generator=torch.Generator().manual_seed(9))
        h, up, _ = run_onnx(tmp_path / f"{form}.onnx", xs)
        with torch.no_grad():
            (qh, qup, _), (ph, pup, _) = q(xs), p(xs)
        assert _off(up, _kernel(FORMS[form](), h, q), _up_step(q)) == (0, 0.0), form
        assert _off(pup, _kernel(FORMS[form](), ph, q), _up_step(q)) == (0, 0.0), form
        assert _off(ph, qh, _up_step(q)) == _off(pup, qup, _up_step(q)) == (0, 0.0), form  # (ORT's conv: float)
