"""Session 36: a differential fuzz of the int8 kernel paths against the exact oracle, and the cases it found.

Every case runs on each path this machine has: automatic, ``native.force_avx2()``, ``native.force_scalar()``,
``native.disabled()``, ``use_backend("onednn")`` (and, in a subprocess, ``ONEDNN_MAX_CPU_ISA=AVX2``). The oracle is the
exact integer sum in float64, ``acc · fl(s_x s_w) + b``, ReLU, ``round(y / s_out) + z_out`` clamped: a path may differ
from it by one code (near-ties, the documented tolerance), never more. The reference backend is not the oracle here:
its float32 sums of products of size ~1e20 cancel inexactly (noted in the session report).

Regressions kept:
- fbgemm's requantization (the x86 recipe's u8 output with no split: ``small_m.native_requant`` and fbgemm's own op)
  overflowed: a value past int32 became ``INT32_MIN`` (a positive overflow gave code 0 / the ReLU floor), and a bias
  over an underflowing ``s_x s_w`` became infinite. Such layers now take the exact float epilogue
  (``small_m.requant_fits``).
- oneDNN's grouped conv with one input channel per group and a channel multiplier, padded at least by the dilated
  kernel's extent, returned run-to-run different codes (off by up to ~200; torch's own x86 / onednn engines too). The
  input is now padded with its zero point before the call (``spec.padded_windows``).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

import lowbit as Q
from helpers import cap_changes_nothing, one_thread, run_capped  # noqa: F401  (autouse: 1 thread)
from lowbit import kernels as K
from lowbit import native
from lowbit.kernels import small_m
from lowbit.kernels.spec import ConvSpec, padded_windows
from lowbit.nn import quantized as nnq

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

PATHS = {
    "auto": contextlib.nullcontext,
    "avx2": native.force_avx2,
    "scalar": native.force_scalar,
    "nonative": native.disabled,
    "onednn": lambda: K.use_backend("onednn"),
}
U8, U7, S8 = Q.quint8, Q.quint8.with_range(0, 127), Q.qint8
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def oracle(mod: torch.nn.Module, x: Q.QTensor) -> torch.Tensor:
    """The exact sums in float64 (integers below 2⁵³), the float32 ``s_x s_w``, bias, ReLU, rounded and clamped."""
    xd = x.int_repr().double() - x.q_zero_point()
    wd = mod.weight_int8.double()
    if isinstance(mod, nnq.Linear):
        acc, shape = xd @ wd.t(), (-1,)
    else:
        acc = _CONV[mod._dim](xd, wd, None, mod.stride, mod.padding, mod.dilation, mod.groups)
        shape = (-1,) + (1,) * mod._dim
    y = acc * (torch.tensor(x.q_scale(), dtype=torch.float32) * mod.weight_scale).double().reshape(shape)
    if mod.bias is not None:
        y = y + mod.bias.double().reshape(shape)
    if mod._relu:
        y = y.clamp_min(0)
    qd = mod.out_qdtype
    return (torch.round(y / float(mod.scale)) + int(mod.zero_point)).clamp(qd.quant_min, qd.quant_max).long()


def wrong_paths(mod: torch.nn.Module, x: Q.QTensor, repeats: int = 1) -> dict[str, int]:
    """``{path: largest code difference}`` for every path (and repeat) more than one code from the oracle."""
    want, bad = oracle(mod, x), {}
    for name, ctx in PATHS.items():
        for _ in range(repeats):
            with ctx(), torch.no_grad():
                got = mod(x).int_repr().long()
            assert got.shape == want.shape, name
            d = int((got - want).abs().max()) if got.numel() else 0
            if d > 1:
                bad[name] = max(bad.get(name, 0), d)
    return bad


def weight(shape: tuple[int, ...], g: torch.Generator, mode: str, axis: int = 0) -> Q.QTensor:
    if mode == "rand":
        c = torch.randint(-128, 128, shape, generator=g)
    elif mode == "alt":  # the extremes: saturating vpmaddubsw pairs
        c = torch.where(torch.rand(shape, generator=g) < 0.5, -128, 127)
    else:
        c = torch.full(shape, int(mode))
    n = shape[axis]
    return Q.QTensor(c.to(torch.int8), torch.rand(n, generator=g) * 0.01 + 1e-4, torch.zeros(n, dtype=torch.int64),
                     Q.qint8, axis)


def codes(shape: tuple[int, ...], qd: Q.QDtype, g: torch.Generator) -> torch.Tensor:
    return torch.randint(qd.quant_min, qd.quant_max + 1, shape, generator=g).to(qd.storage)


# ---- fbgemm's requantization out of int32's range ----

REQUANT_CASES = [  # (M, K, N, input grid, x codes, s_x, z_x, ReLU, output grid, s_out, z_out)
    (129, 1, 255, S8, -128, 0.02, 127, False, U7, 1e-30, 51),    # y / s_out ~ 1e31: code 0 where 127 is right
    (63, 1, 255, S8, None, 1.5e-38, 0, True, U8, 1.0, 36),       # s_x s_w underflows: bias / it = inf, the ReLU floor
    (7, 1, 17, U7, None, 1e20, 0, True, U7, 1000.0, 120),        # y / s_out ~ 1e17
    (3, 65, 33, U8, None, 0.05, 128, False, U8, 1e-9, 128),      # a realistic layer on a saturating output grid
]


@pytest.mark.parametrize("case", REQUANT_CASES)
def test_fbgemm_requantization_past_int32_takes_the_exact_epilogue(case):
    m, k, n, qd, c, sx, zx, relu, od, so, zo = case
    g = torch.Generator().manual_seed(m * k + n)
    mod = (nnq.LinearReLU if relu else nnq.Linear)(k, n)
    w = weight((n, k), g, "alt")
    mod.set_weight_bias(w, torch.randn(n, generator=g) * 10)
    mod.set_output_grid(so, zo, od)
    q = torch.full((m, k), c, dtype=qd.storage) if c is not None else codes((m, k), qd, g)
    x = Q.QTensor(q, sx, zx, qd)
    assert wrong_paths(mod, x) == {}
    assert not small_m.requant_fits(w.int_repr(), w.scale, mod.bias, x.q_scale(), K.OutGrid(so, zo, od), None)


def test_requant_fits_keeps_ordinary_layers_on_fbgemms_codes():
    g = torch.Generator().manual_seed(0)
    w = weight((64, 768), g, "alt")
    out = K.OutGrid(0.05, 128, U8)
    assert small_m.requant_fits(w.int_repr(), w.scale, torch.randn(64), 0.02, out, None)
    assert small_m.requant_fits(w.int_repr()[:0], w.scale[:0], None, 0.02, out, None)  # no channels
    cache: dict = {}
    assert not small_m.requant_fits(w.int_repr(), w.scale, None, 1e20, out, cache)
    assert cache["native.requant_fits"][1] is False  # kept per layer state and input scale


def test_x86_recipe_module_on_an_input_far_past_its_calibration():
    """The converted x86-recipe Linear (fbgemm's requantization) fed inputs 1e6x its calibration range: every path
    saturates as the oracle does (before: the overflowed values gave code 0 on the automatic path)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(65, 17), Q.DeQuantStub()).eval()
    m.qconfig = Q.get_default_qconfig("x86")
    p = Q.prepare(m)
    p(torch.randn(16, 65) * 1e-3)
    qm = Q.convert(p)
    lin, x = qm[1], qm[0](torch.randn(5, 65))
    with torch.no_grad():  # a layer whose output grid spans ~1e-3 meets the reach of a much wider input grid
        lin.set_output_grid(1e-12, 64, lin.out_qdtype)
    assert wrong_paths(lin, x) == {}


# ---- oneDNN's depthwise conv with a channel multiplier, padded past its kernel ----

PAD_CASES = [  # (dim, C_in, C_out, groups, kernel, padding, dilation, H/W, input grid)
    (2, 8, 16, 8, 2, 2, 1, (2, 7), U8),
    (2, 8, 16, 8, 2, 3, 1, (2, 7), S8),
    (2, 16, 32, 16, 3, 3, 1, (5, 5), U8),
    (2, 32, 64, 32, 3, 4, 1, (3, 9), S8),
    (2, 8, 24, 8, 2, 3, 2, (4, 4), U8),
    (1, 8, 16, 8, 2, 2, 1, (9,), U8),
]


@pytest.mark.parametrize("case", PAD_CASES)
def test_depthwise_multiplier_padded_past_its_kernel(case):
    dim, cin, cout, groups, ks, pad, dil, hw, qd = case
    g = torch.Generator().manual_seed(cin + cout + pad)
    mod = (nnq.Conv1d if dim == 1 else nnq.Conv2d)(cin, cout, ks, 1, pad, dil, groups)
    mod.set_weight_bias(weight(tuple(mod.weight_int8.shape), g, "rand"), torch.randn(cout, generator=g))
    mod.set_output_grid(0.05, 128, U8)
    x = Q.QTensor(codes((1, cin, *hw), qd, g), 0.1, (qd.quant_min + qd.quant_max) // 2, qd)
    assert padded_windows(mod.weight_int8.shape, ConvSpec(dim, mod.stride, mod.padding, mod.dilation, groups))
    assert wrong_paths(mod, x, repeats=3) == {}  # (the wrong codes changed from run to run)


def test_padded_windows_names_only_the_failing_geometry():
    spec = lambda p, g=8, d=1: ConvSpec(2, (1, 1), (p, p), (d, d), g)  # noqa: E731
    assert padded_windows((16, 1, 2, 2), spec(2))
    assert not padded_windows((16, 1, 2, 2), spec(1))        # a window always meets the input
    assert not padded_windows((8, 1, 2, 2), spec(2))         # plain depthwise: oneDNN is right there
    assert not padded_windows((16, 4, 2, 2), spec(2, g=2))   # several input channels per group
    assert not padded_windows((16, 8, 2, 2), spec(2, g=1))   # dense
    assert not padded_windows((16, 1, 2, 2), spec(2, d=2))   # dilated extent 3 > 2
    assert not padded_windows((16, 1, 2, 2), ConvSpec(2, (1, 1), (2, 2), (1, 1), 8, transposed=True))


# ---- the seeded differential fuzz (ordinary scales; extremes of codes, zero points and shapes) ----

MS = (1, 2, 3, 7, 16, 31, 32, 33, 63, 64, 65, 129)
KN = (1, 3, 5, 17, 63, 65, 255, 257, 1023)


def test_linear_fuzz():
    rng, wrong = random.Random(36), []
    for i in range(160):
        m, k, n = rng.choice(MS), rng.choice(KN), rng.choice(KN)
        if m * k * n > 2_000_000:
            continue
        g = torch.Generator().manual_seed(i)
        qd, od = rng.choice([U8, U7, S8]), rng.choice([U8, U7, S8])
        relu = rng.random() < 0.3
        mod = (nnq.LinearReLU if relu else nnq.Linear)(k, n, bias=rng.random() < 0.7)
        mod.set_weight_bias(weight((n, k), g, rng.choice(["rand", "alt", "-128", "127"])),
                            torch.randn(n, generator=g) if mod.bias is not None else None)
        mod.set_output_grid(rng.choice([1e-3, 0.05, 1.0]), rng.randint(od.quant_min, od.quant_max), od)
        zx = rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max + 1) // 2])
        layout = rng.choice(["2d", "3d", "T", "slice"])
        q = codes((m, 2 * k) if layout == "slice" else (k, m) if layout == "T" else (m, k), qd, g)
        q = q[:, ::2] if layout == "slice" else q.t() if layout == "T" else q[None] if layout == "3d" else q
        bad = wrong_paths(mod, Q.QTensor(q, rng.choice([1e-3, 0.02, 1.0]), zx, qd))
        if bad:
            wrong.append((i, m, k, n, layout, bad))
    assert wrong == []


def test_conv_fuzz():
    rng, wrong = random.Random(3636), []
    for i in range(120):
        g = torch.Generator().manual_seed(100 + i)
        dim = rng.choice([1, 2, 2, 3])
        kind = rng.choice(["dense", "dw", "mult", "group"])
        cin = rng.choice([1, 3, 8, 16, 17, 33])
        groups, cout = {"dense": (1, rng.choice([1, 3, 16, 33, 64])), "dw": (cin, cin), "mult": (cin, 2 * cin),
                        "group": (1, rng.choice([5, 32]))}[kind]
        if kind == "group":
            groups = 2
            cin, cout = 2 * cin, 2 * cout
        ks, st, pd, dl = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3]), rng.choice([0, 1, 2, 3]), rng.choice([1, 2])
        hw = tuple(max(rng.choice([1, 2, 3, 5, 7, 13]), dl * (ks - 1) + 1 - 2 * pd) for _ in range(dim))
        relu = rng.random() < 0.3
        cls = {1: (nnq.Conv1d, nnq.ConvReLU1d), 2: (nnq.Conv2d, nnq.ConvReLU2d), 3: (nnq.Conv3d, nnq.ConvReLU3d)}[dim][relu]
        mod = cls(cin, cout, ks, st, pd, dl, groups)
        mod.set_weight_bias(weight(tuple(mod.weight_int8.shape), g, rng.choice(["rand", "alt"])),
                            torch.randn(cout, generator=g))
        od, qd = rng.choice([U8, U7, S8]), rng.choice([U8, U7, S8])
        mod.set_output_grid(rng.choice([1e-3, 0.05, 1.0]), rng.randint(od.quant_min, od.quant_max), od)
        q = codes((rng.choice([1, 2]), cin, *hw), qd, g)
        if dim == 2 and rng.random() < 0.5:
            q = q.contiguous(memory_format=torch.channels_last)
        zx = rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max + 1) // 2])
        bad = wrong_paths(mod, Q.QTensor(q, rng.choice([0.01, 0.1]), zx, qd))
        if bad:
            wrong.append((i, dim, kind, cin, cout, ks, st, pd, dl, hw, bad))
    assert wrong == []


def test_regressions_under_an_isa_cap():
    """The regression cases with oneDNN capped to AVX2 (its saturating kernels; lowbit's exact routes without VNNI)."""
    if cap_changes_nothing():
        pytest.skip("oneDNN runs its AVX2 kernels uncapped on this CPU: the capped child would repeat "
                    "test_fbgemm_requantization_past_int32_takes_the_exact_epilogue, test_depthwise_multiplier_padded_"
                    "past_its_kernel and test_x86_recipe_module_on_an_input_far_past_its_calibration (1 thread both)")
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; import test_kernels_fuzz_s36 as t\n"
            "from lowbit.kernels import onednn; assert not onednn.has_vnni()\n"
            "for c in t.REQUANT_CASES: t.test_fbgemm_requantization_past_int32_takes_the_exact_epilogue(c)\n"
            "for c in t.PAD_CASES: t.test_depthwise_multiplier_padded_past_its_kernel(c)\n"
            "t.test_x86_recipe_module_on_an_input_far_past_its_calibration()\nprint('ok')\n")
    run_capped(code)
