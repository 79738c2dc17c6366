"""Real-data accuracy of the eager workflows on Fashion-MNIST (Debian ``dataset-fashion-mnist``).

One small residual CNN (``lowbit.examples.SmallCNN``) is trained in fp32 on the first 15k training
images (2 epochs, Adam, cosine LR, fixed seeds) and evaluated on the full 10k test set. Then:

- static PTQ (``fuse_modules`` -> ``prepare`` with the default qconfig -> 2k calibration images ->
  ``convert``) loses at most 0.3 points;
- QAT (``fuse_modules_qat`` -> ``prepare_qat`` -> one epoch at lr 1e-4 on the same 15k, BN statistics
  frozen at 60 % and observers at 80 % of the steps -> ``convert``) ends at most 0.1 points below fp32;
- ``quantize_dynamic`` (the two Linear layers) loses at most 0.2 points;
- with plain min/max configs, lowbit and ``torch.ao.quantization`` (onednn engine) converted from the same
  trained model and calibration batch have equal activation qparams and agree on >= 99 % of top-1.

Run with ``pytest -m realdata -rP tests/test_realdata_fmnist.py`` to see the figures.

The whole file runs on 1 torch thread (training, calibration, evaluation; the floors above are deltas against the
fp32 model trained in the same run). At 2 threads on the 2-core CI machine, torch's OpenMP pool spent most of its
time waiting: the training fixture 116 s, the balanced-recipe test 176 s (its coordinate descent's ~18k small
``index_add_`` steps each entered the pool), QAT 87 s; at 1 thread the same work takes a fraction of that, and
the balanced test's logits are bit-identical at 1 and 2 threads (training is not: another float draw). Figures at
1 thread (session 45): fp32 86.96 %, static PTQ -0.17 points, QAT +0.09, dynamic -0.09, min/max parity 99.87 %
agreement, balanced recipe 2k images -0.15 points at 39.98 dB (default 39.41 dB); at 2 threads before: fp32 87.00 %,
PTQ +0.05, QAT +0.11, dynamic +0.06.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.data as D
from lowbit.examples import SmallCNN, evaluate, predict, train

pytestmark = [
    pytest.mark.realdata,
    pytest.mark.skipif(not D.fashion_mnist_available(),
                       reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist"),
]

N_TRAIN, EPOCHS, N_CALIB = 15000, 2, 2000
QUANTIZED = ["quant", "conv1", "conv2", "conv3", "skip", "fc1", "fc2"]  # modules with an output grid


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    xtr, ytr = D.load_fashion_mnist("train", limit=N_TRAIN)
    xte, yte = D.load_fashion_mnist("test")
    return {"xtr": D.normalize_images(xtr), "ytr": ytr, "xte": D.normalize_images(xte), "yte": yte}


@pytest.fixture(scope="module")
def fp32(data: dict[str, torch.Tensor]) -> tuple[SmallCNN, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for the whole module (module docstring), restored after it
    torch.manual_seed(0)
    model = train(SmallCNN(), data["xtr"], data["ytr"], epochs=EPOCHS, lr=2e-3, seed=0).eval()
    acc = evaluate(model, data["xte"], data["yte"])
    print(f"\nFashion-MNIST fp32 SmallCNN ({N_TRAIN} train images, {EPOCHS} epochs): {acc:.2f} %")
    yield model, acc
    torch.set_num_threads(threads)


def _report(name: str, acc: float, acc0: float) -> None:
    print(f"\nFashion-MNIST {name}: {acc:.2f} % (fp32 {acc0:.2f} %, delta {acc - acc0:+.2f} points)")


def test_static_ptq_loses_at_most_0_3_points(data, fp32):
    model, acc0 = fp32
    prepared = Q.prepare(Q.fuse_modules(model, SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.no_grad():
        prepared(data["xtr"][:N_CALIB])
    qmodel = Q.convert(prepared)
    assert type(qmodel.conv1).__module__.startswith("lowbit.nn.quantized")
    acc = evaluate(qmodel, data["xte"], data["yte"])
    _report("static PTQ (default qconfig)", acc, acc0)
    assert acc >= acc0 - 0.3


def test_qat_within_0_1_points_or_above(data, fp32):
    model, acc0 = fp32
    qat = Q.prepare_qat(Q.fuse_modules_qat(copy.deepcopy(model).train(), SmallCNN.fusion_groups()),
                      Q.get_default_qat_qconfig())

    def schedule(m: nn.Module, step: int, total: int) -> None:
        if step == int(0.6 * total):
            m.apply(Q.freeze_bn_stats)
        if step == int(0.8 * total):
            m.apply(Q.disable_observer)

    train(qat, data["xtr"], data["ytr"], epochs=1, lr=1e-4, seed=1, on_step=schedule)
    qmodel = Q.convert(qat.eval())
    assert type(qmodel.conv1).__module__.startswith("lowbit.nn.quantized")
    acc = evaluate(qmodel, data["xte"], data["yte"])
    _report("QAT (1 epoch, lr 1e-4)", acc, acc0)
    assert acc >= acc0 - 0.1


def test_dynamic_loses_at_most_0_2_points(data, fp32):
    model, acc0 = fp32
    qmodel = Q.quantize_dynamic(model)
    assert type(qmodel.fc1).__module__.startswith("lowbit.nn.quantized.dynamic")
    acc = evaluate(qmodel, data["xte"], data["yte"])
    _report("quantize_dynamic (Linear)", acc, acc0)
    assert acc >= acc0 - 0.2


def _torch_ao_twin(model: SmallCNN) -> nn.Module:
    """The same float model with torch.ao's stubs and FloatFunctional (parameters shared by copy)."""
    from torch.ao.nn.quantized import FloatFunctional
    from torch.ao.quantization import DeQuantStub, QuantStub

    twin = copy.deepcopy(model)
    twin.quant, twin.dequant, twin.skip = QuantStub(), DeQuantStub(), FloatFunctional()
    return twin


def _qparams(mod: nn.Module) -> tuple[float, int]:
    s, z = mod.scale, mod.zero_point
    return float(s() if callable(s) else s), int(z() if callable(z) else z)


def test_minmax_parity_with_torch_ao(data, fp32):
    model, _ = fp32
    tq = pytest.importorskip("torch.ao.quantization")
    calib, x = data["xtr"][:N_CALIB], data["xte"]

    prepared = Q.prepare(Q.fuse_modules(model, SmallCNN.fusion_groups()), Q.get_minmax_qconfig())
    with torch.no_grad():
        prepared(calib)
    ours = Q.convert(prepared)

    # QNNPACK, not x86/fbgemm or oneDNN: on CPUs without VNNI both sum pairs of u8*s8 products in int16
    # (vpmaddubsw) and saturate when activations use the full 8-bit range (reduce_range=False); on this model
    # that alone flips ~3 % of torch.ao's predictions (86.5 % vs 87.0 %). QNNPACK subtracts the zero points
    # in int16 and accumulates in int32 on every x86 CPU, as lowbit does.
    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch.ao's qnnpack engine is not available in this torch build")
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "qnnpack"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = tq.fuse_modules(_torch_ao_twin(model).eval(), SmallCNN.fusion_groups())
            twin.qconfig = tq.QConfig(
                activation=tq.MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                                       reduce_range=False),
                weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                             qscheme=torch.per_channel_symmetric),
            )
            tq.prepare(twin, inplace=True)
            with torch.no_grad():
                twin(calib)
            theirs = tq.convert(twin)
            pred_theirs = predict(theirs, x)
    finally:
        torch.backends.quantized.engine = engine

    for name in QUANTIZED:
        (s1, z1), (s2, z2) = _qparams(getattr(ours, name)), _qparams(getattr(theirs, name))
        assert z1 == z2 and s1 == pytest.approx(s2, rel=1e-5), f"{name}: lowbit ({s1}, {z1}) vs torch.ao ({s2}, {z2})"
    pred_ours = predict(ours, x)
    agree = 100.0 * (pred_ours == pred_theirs).double().mean().item()
    acc_ours = 100.0 * (pred_ours == data["yte"]).double().mean().item()
    acc_theirs = 100.0 * (pred_theirs == data["yte"]).double().mean().item()
    print(f"\nFashion-MNIST min/max PTQ: lowbit {acc_ours:.2f} %, torch.ao {acc_theirs:.2f} %, "
          f"top-1 agreement {agree:.2f} %")
    assert agree >= 99.0



def test_balanced_recipe_no_worse_than_default(data, fp32):
    """``quantize_ptq(recipe="balanced")`` (default grids + quadratic codes + bias correction, graph mode; 512
    calibration images, 2k test images): within 0.3 points of fp32 and no further from the fp32 logits than the
    default recipe."""
    from lowbit import kernels

    model, _ = fp32
    calib, x, y = list(data["xtr"][:512].split(256)), data["xte"][:2000], data["yte"][:2000]
    acc0 = evaluate(model, x, y)
    with torch.no_grad():
        ref = model(x)
    got = {}
    with kernels.use_backend("reference"):
        for recipe in ("default", "balanced"):
            qmodel, _ = Q.quantize_ptq(model, calib, recipe=recipe, progress=False)
            with torch.no_grad():
                out = qmodel(x)
            sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
            got[recipe] = (evaluate(qmodel, x, y), sqnr)
            _report(f"quantize_ptq {recipe} (logit SQNR {sqnr:.2f} dB, 2k test images)", got[recipe][0], acc0)
    assert got["balanced"][0] >= acc0 - 0.3
    assert got["balanced"][1] >= got["default"][1] - 0.5, got
