"""Session 36: ``quantize_ptq`` swept over architectures it was not developed on, each built tiny here — grouped
convs, depthwise with channel multiplier 2, dilated convs, Conv1d, a DenseNet cat, squeeze-excite, a 1x1-conv
shortcut, two adds on one stream, a post-activation residual, an add read twice, nested Sequentials, a
ConvTranspose2d decoder with a cat skip, a LayerNorm / GELU MLP, BN on both sides of a ReLU6, a float layer
inside a residual block, Hardswish / Hardsigmoid. For each: the equalization passes keep the float function,
every recipe runs and lists its steps, the int8 model equals the simulation the rounding passes optimise, and
the recovery recipes are not clearly worse than ``"default"`` on the calibration data.

Found: a transposed conv (not rounded by any pass, int8 after convert) ran with its *float* weight in every
simulation of the int8 model — the quantized walk of the rounding / bias correction, ``tune_biases`` and
``patch_observers(mode="quant")`` — so they fitted and reported another model than the converted one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms.equalize import equalize_prepared
from lowbit.algorithms.equalize_stream import equalize_streams
from lowbit.algorithms.layerwise import patch_observers, reconstruct
from lowbit.algorithms.tune import tune_biases

from helpers import one_thread  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.g2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.g4, self.dm = nn.Conv2d(8, 16, 1, groups=4), nn.Conv2d(16, 32, 3, padding=1, groups=16)  # multiplier 2
        self.p, self.fc = nn.Conv2d(32, 8, 1), nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu6(self.g4(F.relu(self.g2(F.relu(self.a(x))))))
        return self.fc(self.p(F.relu6(self.dm(x))).mean((2, 3)))


class DWMult(nn.Module):
    """ReLU6 into a depthwise conv with channel multiplier 2: not the clamp stretch's plain depthwise."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=4), nn.ReLU6())
        self.p = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        return self.p(self.dw(self.a(x)))


class Dilated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=2, dilation=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=3, dilation=3, groups=8)
        self.b = nn.Conv2d(8, 4, 3, padding=2, dilation=2)

    def forward(self, x):
        return self.b(F.relu6(self.dw(F.relu6(self.a(x)))))


class Audio1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv1d(2, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1, groups=8), nn.ReLU6())
        self.p, self.e, self.fc = nn.Conv1d(8, 8, 1), nn.Conv1d(8, 16, 1, groups=2), nn.Linear(16, 3)

    def forward(self, x):
        y = self.a(x)
        y = y + self.p(self.dw(y))
        return self.fc(F.relu(self.e(y)).mean(2))


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.c, self.d = nn.Conv2d(8, 4, 1), nn.Conv2d(12, 4, 1)

    def forward(self, x):
        a = F.relu(self.a(x))
        b = F.relu(self.b(a))
        c = F.relu(self.c(torch.cat([a, b], 1)))
        return self.d(torch.cat([a, b, c], 1))


class SE(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6())
        self.f1, self.f2, self.p = nn.Linear(8, 4), nn.Linear(4, 8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.dw(self.a(x))
        w = torch.sigmoid(self.f2(F.relu(self.f1(F.adaptive_avg_pool2d(y, 1).flatten(1)))))
        return self.p(y * w[:, :, None, None])


class Shortcut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 8, 3, padding=1)
        self.b2, self.sc, self.h = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        a = F.relu(self.a(x))
        return self.h(F.relu(self.b2(F.relu(self.b1(a))) + self.sc(a)))


class Inv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.e = nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.ReLU6())
        self.d = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c), nn.ReLU6())
        self.p = nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        return x + self.p(self.d(self.e(x)))


class TwoAdds(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.b, self.h = nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(Inv(4), Inv(4)), nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.h(self.b(self.stem(x)))


class PostAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.c1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.c2, self.h = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 3, 1)

    def forward(self, x):
        a = F.relu(self.stem(x))
        return self.h(F.relu(a + self.c2(F.relu(self.c1(a)))))


class TwoConsumers(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.blk = nn.Conv2d(3, 4, 3, padding=1), Inv(4)
        self.h1, self.h2 = nn.Conv2d(4, 3, 1), nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        y = self.blk(self.stem(x))
        return self.h1(y) + self.h2(y)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU6()),
                                      nn.Sequential(nn.Sequential(Inv(4)), Inv(4)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Sequential(nn.Linear(4, 5)))

    def forward(self, x):
        return self.head(self.features(x))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.e1, self.e2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.d, self.o = nn.Conv2d(8, 4, 3, padding=1), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        a = F.relu(self.e1(x))
        u = F.relu(self.up(F.relu(self.e2(a))))
        return self.o(F.relu(self.d(torch.cat([u, a], 1))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2, self.l3 = nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = self.ln(self.l1(x))
        y = y + self.l2(F.gelu(y))
        return self.l3(F.gelu(y))


class BnRelu6(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8))
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class FloatInBlock(TwoAdds):
    """The depthwise conv of the first block stays float (``qconfig_mapping`` sets it to None)."""

    FLOAT = "b.0.d.0"


class Hard(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.hs = nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish()
        self.dw, self.hsig, self.p = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardsigmoid(), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.dw(self.hs(self.a(x)))
        return self.p(y * self.hsig(y))


MODELS = {"grouped": Grouped, "dw_multiplier": DWMult, "dilated": Dilated, "conv1d": Audio1d, "densenet_cat": Dense,
          "squeeze_excite": SE, "conv_shortcut": Shortcut, "two_adds": TwoAdds, "post_activation": PostAct,
          "add_two_consumers": TwoConsumers, "nested": Nested, "unet_transposed": UNet, "mlp_layernorm": MLP,
          "bn_relu6_bn": BnRelu6, "float_in_block": FloatInBlock, "hardswish": Hard}


def _build(name):
    """The model, with skewed channel ranges and BN statistics (what equalization acts on), and 2 calibration
    batches of 8 (16 for the MLP)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.3, 2)
                m.bias.uniform_(-0.2, 0.2)
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
                n = m.weight.shape[0]
                m.weight.mul_(torch.logspace(-1, 0.5, n)[torch.randperm(n)].view(-1, *[1] * (m.weight.dim() - 1)))
    shape = {"conv1d": (8, 2, 32), "mlp_layernorm": (16, 12)}.get(name, (8, 3, 12, 12))
    return model.eval(), [torch.randn(*shape) for _ in range(2)]


def _mapping(model, base):
    return base.set_module_name(model.FLOAT, None) if hasattr(model, "FLOAT") else base


def _accurate(model):
    return _mapping(model, Q.QConfigMapping().set_global(Q.get_accurate_qconfig()))


def _sqnr(ref, out):
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("weights", [False, True])
def test_equalization_keeps_the_float_function(name, weights):
    """The clamp stretch, the weight-range pairs (``equalize=True``) and the residual streams are exact: the prepared
    model (observers still the identity) computes the float model after each, on the calibration data, and without
    the weight pairs also on other data inside the stretch's 1.5x headroom (the weight pairs' bias absorption
    ``relu(y - c) = relu(y) - c`` holds where ``y >= c``: on the calibration data, which set ``c``)."""
    model, calib = _build(name)
    xs = [calib[1]] + ([] if weights else [torch.randn_like(calib[0]) * 0.5])
    p = Q.prepare_fx(copy.deepcopy(model), _accurate(model), example_inputs=(calib[0],))
    with torch.no_grad():
        ys = [model(x) for x in xs]
        for step in ("pairs", "streams"):
            if step == "pairs":
                equalize_prepared(p, [(b,) for b in calib], relu6="range", weights=weights)
            else:
                equalize_streams(p, [(b,) for b in calib], alpha=0.75)
            for x, y in zip(xs, ys):
                torch.testing.assert_close(p(x), y, rtol=1e-4, atol=1e-5 * float(y.abs().max()))


@pytest.mark.parametrize("name", list(MODELS))
def test_recipes_run_list_their_steps_and_do_not_lose_to_default(name):
    model, calib = _build(name)
    sqnr, steps = {}, {}
    for recipe, kw in (("default", {}), ("balanced", {}),
                       ("accurate", dict(iters=20, equalize=True, streams=0.75, refine=2, tune=5))):
        base = Q.QConfigMapping().set_global(Q.get_accurate_qconfig()) if recipe == "accurate" else \
            Q.get_default_qconfig_mapping()
        q, rep = Q.quantize_ptq(model, calib, recipe, qconfig_mapping=_mapping(model, base), progress=False, **kw)
        with torch.no_grad():
            sqnr[recipe] = _sqnr(model(calib[0]), q(calib[0]))
        assert sqnr[recipe] == pytest.approx(rep.sqnr_db, abs=1e-6)  # the report scores the returned model
        steps[recipe] = [s for s, _ in rep.steps]
        if hasattr(model, "FLOAT"):
            assert type(q.get_submodule(model.FLOAT)) is nn.Conv2d
    assert steps["default"] == ["fuse", "calibrate", "convert"]
    assert steps["balanced"] == ["fuse", "calibrate", "round", "correct bias", "convert"]
    assert steps["accurate"][:7] == ["fuse", "equalize", "calibrate", "refine grids", "round", "correct bias",
                                     "tune biases"]
    assert steps["accurate"][7:] in (["convert"], ["convert", "float output"])
    # on the calibration data the recovery recipes are at least the default recipe's (measured: -0.9 dB at worst,
    # the MLP's balanced build; +0 to +5 dB elsewhere)
    assert sqnr["balanced"] > sqnr["default"] - 1.5, sqnr
    assert sqnr["accurate"] > sqnr["default"] - 1.5, sqnr


def _recipe_prepared(model, calib, blocks):
    """The accurate recipe's prepared model up to rounding and bias correction, from the public steps."""
    p = Q.prepare_fx(copy.deepcopy(model), _accurate(model), example_inputs=(calib[0],))
    batches = [(b,) for b in calib]
    with torch.no_grad():
        equalize_prepared(p, batches, relu6="range", weights=True)
        equalize_streams(p, batches, alpha=0.75)
        for b in calib:
            p(b)
    reconstruct(p, batches, iters=10, blocks=blocks, learn_grids=blocks, progress=False)
    return p


@pytest.mark.parametrize("name", list(MODELS))
def test_int8_model_equals_the_simulation_the_rounding_optimised(name):
    """``patch_observers(mode="quant")`` runs the prepared model as the int8 model runs (design: exact, up to ties at
    a residual add): after rounding (blocks and learned grids) the converted model's output is the simulation's."""
    model, calib = _build(name)
    p = _recipe_prepared(model, calib, blocks=True)
    sim = copy.deepcopy(p)
    patch_observers(sim, "quant")
    q = Q.convert_fx(p)
    with torch.no_grad():
        ys, yq = sim(calib[0]), q(calib[0])
    # exact up to float ties (design): at most one element in a thousand, each by one step of the output grid (the
    # squeeze-excite net under ONEDNN_MAX_CPU_ISA=AVX2: 1 of 4608 elements, the float ops' other roundings)
    d = (ys - yq).abs()
    grid = yq.flatten().unique()
    step = float((grid[1:] - grid[:-1]).min()) if grid.numel() > 1 else 0.0
    assert int((d > 0).sum()) <= max(1, d.numel() // 1000), float(d.max())
    assert float(d.max()) <= step * 1.0001, (float(d.max()), step)


def test_transposed_conv_runs_on_its_int8_weight_in_the_simulation():
    """The decoder's ConvTranspose2d is int8 after convert but rounded by no pass: the simulation runs its
    round-to-nearest weight (before: its float weight, 3 % of the outputs differed from the int8 model's, by up to
    the whole quantization error), and undoing the patch gives the float layer back."""
    from lowbit.algorithms.layers import rounded_forward

    model, calib = _build("unet_transposed")
    p = _recipe_prepared(model, calib, blocks=False)
    up = p.get_submodule("up")
    run = rounded_forward(up)
    assert run is not None and rounded_forward(p.get_submodule("d")) is None
    q = Q.convert_fx(copy.deepcopy(p))
    with torch.no_grad():
        x = torch.randn(2, 8, 6, 6)
        w_int8 = q.get_submodule("up").weight().dequantize()
        torch.testing.assert_close(run(x), F.conv_transpose2d(x, w_int8, up.bias, 2), rtol=0, atol=1e-6)
        assert not torch.allclose(run(x), up(x), rtol=0, atol=1e-6)
        patched = patch_observers(p, "quant")
        assert up in patched
        for m in patched:
            m.__dict__.pop("forward", None)
        torch.testing.assert_close(up(x), F.conv_transpose2d(x, up.weight, up.bias, 2))


def test_tune_reports_the_int8_error_with_a_transposed_conv():
    """``tune_biases`` scores the simulation; with the decoder's ConvTranspose2d on its float weight that was not
    the converted model's error (the design promises it is)."""
    model, calib = _build("unet_transposed")
    p = _recipe_prepared(model, calib, blocks=False)
    with torch.no_grad():
        before = sum(float((Q.convert_fx(copy.deepcopy(p))(b) - model(b)).pow(2).sum(1).mean()) for b in calib)
    r = tune_biases(p, model, calib, iters=5, batch_size=8, lr=1e-4, progress=False)
    assert r.error_before == pytest.approx(before, rel=1e-5), (r, before)
    with torch.no_grad():
        after = sum(float((Q.convert_fx(copy.deepcopy(p))(b) - model(b)).pow(2).sum(1).mean()) for b in calib)
    assert after == pytest.approx(r.error_after if r.kept else r.error_before, rel=1e-5)


def test_tune_safeguard_keeps_the_untuned_model_when_it_does_not_gain():
    """A tuning run that raises the calibration error is not kept: the model is the one without tuning."""
    model, calib = _build("grouped")
    kw = dict(iters=20, refine=0, progress=False)
    q0, r0 = Q.quantize_ptq(model, calib, "accurate", **kw)
    q1, r1 = Q.quantize_ptq(model, calib, "accurate", tune=5, **kw)
    tuned = dict(r1.steps)["tune biases"]
    x = torch.randn_like(calib[0])
    with torch.no_grad():
        if "not kept" in tuned:
            assert torch.equal(q0(x), q1(x)) and r1.sqnr_db == r0.sqnr_db
        else:
            assert r1.sqnr_db != r0.sqnr_db


def test_rounding_walk_feeds_the_next_layer_the_int8_models_input(monkeypatch):
    """The layer after the decoder's ConvTranspose2d (``d``, reading ``cat([up, skip])``) is rounded and
    bias-corrected on the quantized walk's input: that is the int8 model's input to ``d``, bit for bit (before:
    computed with the transposed conv's float weight)."""
    from lowbit.algorithms import layerwise

    model, calib = _build("unet_transposed")
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    seen, layer = {}, layerwise._layer

    def spy(name, mod, xq, *args, **kwargs):
        seen[name] = [x.clone() for x in xq]
        return layer(name, mod, xq, *args, **kwargs)
    monkeypatch.setattr(layerwise, "_layer", spy)
    reconstruct(p, calib, adaround=False, bias_correction=True, progress=False)
    q = Q.convert_fx(p)
    got = []
    h = q.get_submodule("d").register_forward_pre_hook(lambda _m, a: got.append(a[0].dequantize()))
    with torch.no_grad():
        for b in calib:
            q(b)
    h.remove()
    assert len(got) == len(seen["d"]) == 2
    for walk, int8 in zip(seen["d"], got):
        assert torch.equal(walk, int8), float((walk - int8).abs().max())
