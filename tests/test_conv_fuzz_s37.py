"""Session 37: a differential fuzz of static quantized conv GEOMETRY on every route against the exact float64 oracle.

Each case runs through the converted ``nn.quantized`` Conv module and through ``kernels.conv`` (the functional route,
a fresh cache) on every route this machine has: automatic, ``native.force_avx2()``, ``native.force_scalar()``,
``native.disabled()``, ``use_backend("onednn")``, ``use_backend("reference")`` and the routes without VNNI as
``helpers.force`` pins them (fbgemm or not, both C bodies); an ``ONEDNN_MAX_CPU_ISA=AVX2`` subprocess repeats the
regressions. The oracle: the exact sums ``Σ (q_x - z_x)(q_w - z_w)`` in float64 on the codes padded per
``padding_mode``, ``· fl(s_x s_w) + b``, ReLU, ``round(y / s_out) + z_out`` clamped; a route may differ from it by one
code (near-ties, the documented tolerance), never more.

Regressions kept (torch's own oneDNN int8 conv, ``onednn::qconv_pointwise``; torch.ao's x86 / onednn engines the same):
- a padding at least the input's extent, or an output window whose taps all fall in the padding (dilation gaps around
  a small input included), crashed the process (SIGSEGV) or returned run-to-run different sums (up to ~1.5e6 codes off),
  dense, grouped and depthwise, 1-d to 3-d: the codes are padded with ``z_x`` first (``spec.odd_windows``).
- a 2-d conv with one input channel and several output channels a group whose output is one column wide, read with a
  stride past 1 along W, returned run-to-run different sums: the one window is read with stride 1 (``spec.one_column``);
  on an AMX Xeon (session 47) any conv one output wide along the last axis with a stride past 1 there, every group kind
  and dim, so the rule covers all of them.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import cap_changes_nothing, force, one_thread, run_capped  # noqa: F401  (autouse: 1 thread)
from lowbit import kernels as K
from lowbit import native
from lowbit.kernels import spec
from lowbit.kernels.spec import ConvSpec
from lowbit.nn import quantized as nnq

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

U8, U7, S8, S7 = Q.quint8, Q.quint8.with_range(0, 127), Q.qint8, Q.qint8.with_range(-64, 63)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_FLOAT = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_QUANT = {1: (nnq.Conv1d, nnq.ConvReLU1d), 2: (nnq.Conv2d, nnq.ConvReLU2d), 3: (nnq.Conv3d, nnq.ConvReLU3d)}

PATHS = {
    "auto": contextlib.nullcontext,
    "avx2": native.force_avx2,
    "scalar": native.force_scalar,
    "nonative": native.disabled,
    "onednn": lambda: K.use_backend("onednn"),
    "reference": lambda: K.use_backend("reference"),
}
NO_VNNI = {"fbgemm": (True, contextlib.nullcontext), "fbgemm_avx2": (True, native.force_avx2),
           "fbgemm_scalar": (True, native.force_scalar), "no_fbgemm": (False, contextlib.nullcontext),
           "no_fbgemm_nonative": (False, native.disabled)}


def real(fc: nn.Module, mod: nn.Module, x: Q.QTensor) -> torch.Tensor:
    """``acc · fl(s_x s_w) + b`` in float64: the exact sums on the codes padded as ``fc`` pads (zeros: the zero point)."""
    d = mod._dim
    mode = "constant" if fc.padding_mode == "zeros" else fc.padding_mode
    value = {"value": float(x.q_zero_point())} if mode == "constant" else {}
    xd = F.pad(x.int_repr().double(), fc._reversed_padding_repeated_twice, mode=mode, **value) - x.q_zero_point()
    wd = mod.weight_int8.double() - mod.weight_zero_point.double().reshape((-1,) + (1,) * (d + 1))
    acc = _CONV[d](xd, wd, None, fc.stride, 0, fc.dilation, fc.groups)
    shape = (-1,) + (1,) * d
    y = acc * (torch.tensor(x.q_scale(), dtype=torch.float32) * mod.weight_scale).double().reshape(shape)
    return y if mod.bias is None else y + mod.bias.double().reshape(shape)


def oracle(fc: nn.Module, mod: nn.Module, x: Q.QTensor) -> torch.Tensor:
    """``real``, ReLU, rounded half to even onto the module's output grid and clamped."""
    y = real(fc, mod, x)
    if mod._relu:
        y = y.clamp_min(0)
    qd = mod.out_qdtype
    return (torch.round(y / float(mod.scale)) + int(mod.zero_point)).clamp(qd.quant_min, qd.quant_max).long()


def functional(mod: nn.Module, x: Q.QTensor) -> Q.QTensor:
    """``kernels.conv`` on the module's prepared weight and geometry, with a fresh cache (no plan)."""
    qx = mod._pad(x) if mod._explicit_pad is not None else x
    weight, out = mod._prepared()
    return K.conv(qx, weight, mod.bias, mod._spec, out, mod._relu, {})


def wrong(fc: nn.Module, mod: nn.Module, x: Q.QTensor, paths: dict, repeats: int = 1) -> dict[str, int]:
    """``{route: largest code difference}`` for every route (module and functional) more than one code off."""
    want, bad = oracle(fc, mod, x), {}
    for name, ctx in paths.items():
        for route, run in (("module", mod), ("functional", lambda t: functional(mod, t))):
            for _ in range(repeats):
                with ctx(), torch.no_grad():
                    got = run(x).int_repr().long()
                assert got.shape == want.shape, (name, route)
                d = int((got - want).abs().max()) if got.numel() else 0
                if d > 1:
                    bad[f"{name}/{route}"] = max(bad.get(f"{name}/{route}", 0), d)
    return bad


def build(dim: int, cin: int, cout: int, groups: int, ks: tuple[int, ...], stride: tuple[int, ...], padding: object,
          dilation: tuple[int, ...], pmode: str, g: torch.Generator, *, relu: bool = False, wmode: str = "rand",
          per_tensor: bool = False, bias: str = "randn") -> tuple[nn.Module, nn.Module]:
    """A float conv (the geometry) and its quantized module with the given weight codes and a bias."""
    fc = _FLOAT[dim](cin, cout, ks, stride, padding, dilation, groups, bias=bias != "none", padding_mode=pmode)
    shape = (cout, cin // groups, *fc.kernel_size)
    c = {"rand": lambda: torch.randint(-128, 128, shape, generator=g),
         "alt": lambda: torch.where(torch.rand(shape, generator=g) < 0.5, -128, 127),
         "127": lambda: torch.full(shape, 127), "-128": lambda: torch.full(shape, -128),
         "zerochan": lambda: torch.randint(-128, 128, shape, generator=g) * (torch.arange(cout) % 2).reshape(
             (-1,) + (1,) * (dim + 1))}[wmode]().to(torch.int8)
    if per_tensor:
        w = Q.QTensor(c, float(torch.rand(1, generator=g)) * 0.01 + 1e-4, 0, Q.qint8)
    else:
        w = Q.QTensor(c, torch.rand(cout, generator=g) * 0.01 + 1e-4, torch.zeros(cout, dtype=torch.int64), Q.qint8, 0)
    mod = _QUANT[dim][relu].from_reference(fc, w, 1.0, 0)
    b = {"randn": torch.randn(cout, generator=g), "huge": torch.randn(cout, generator=g) * 1e4,
         "none": None}[bias]
    mod.set_weight_bias(w, b)
    return fc, mod


def codes(shape: tuple[int, ...], qd: Q.QDtype, g: torch.Generator) -> torch.Tensor:
    return torch.randint(qd.quant_min, qd.quant_max + 1, shape, generator=g).to(qd.storage)


def fit_output(fc: nn.Module, mod: nn.Module, x: Q.QTensor, od: Q.QDtype, spread: float) -> None:
    """An output grid about ``spread`` codes per standard deviation of the layer's real outputs (few saturate)."""
    want = real(fc, mod, x)
    sd = float(want.std()) if want.numel() > 1 else float(want.abs().max()) if want.numel() else 1.0
    mod.set_output_grid(max(sd / spread, 1e-3), (od.quant_min + od.quant_max + 1) // 2, od)


# ---- oneDNN's crash and wrong sums on windows in the padding (spec.odd_windows) ----

# (dim, C_in, C_out, groups, kernel, stride, padding, dilation, spatial)
CRASH_CASES = [
    (1, 1, 1, 1, (1,), (3,), (4,), (3,), (1,)),                 # every window reads padding only: SIGSEGV
    (3, 66, 66, 33, (1, 1, 1), (8, 8, 3), (1, 4, 4), (3, 1, 3), (16, 7, 1)),   # the fuzz's first find
    (2, 1, 1, 1, (1, 1), (1, 3), (0, 4), (1, 3), (1, 1)),
    (1, 4, 12, 4, (1,), (3,), (1,), (3,), (2,)),
    (2, 2, 6, 2, (3, 1), (1, 3), (5, 5), (2, 2), (2, 1)),
]
WRONG_CASES = [  # run-to-run different sums, no crash (each wrong through lowbit before the fix)
    (2, 1, 3, 1, (2, 2), (3, 2), (5, 1), (1, 2), (2, 1)),       # ~1.5e6 codes off in the raw op
    (2, 4, 8, 4, (3, 3), (1, 4), (1, 2), (1, 1), (3, 2)),       # a channel multiplier, padding = the input
    (3, 1, 2, 1, (5, 5, 3), (1, 1, 3), (4, 1, 0), (2, 1, 1), (1, 3, 3)),   # padding past a one-wide input
    (3, 4, 8, 4, (5, 5, 2), (3, 2, 1), (3, 4, 1), (3, 2, 2), (8, 2, 1)),   # dilation gaps around the input
    (2, 8, 12, 4, (2, 2), (1, 1), (4, 1), (1, 3), (1, 2)),
    (2, 16, 16, 16, (1, 3), (1, 5), (1, 0), (1, 1), (1, 5)),    # plain depthwise
    (3, 1, 17, 1, (3, 2, 4), (4, 4, 4), (1, 0, 1), (1, 1, 1), (1, 2, 2)),
]
# a one-column output read with a W stride past 1 (one input channel, several outputs a group)
COLUMN_CASES = [
    (2, 9, 18, 9, (4, 4), (1, 2), (0, 0), (2, 1), (9, 5)),      # no padding at all
    (2, 16, 32, 16, (3, 5), (1, 4), (1, 0), (2, 1), (9, 8)),
    (2, 4, 8, 4, (2, 3), (1, 2), (1, 1), (1, 1), (8, 2)),
    (2, 16, 48, 16, (2, 2), (1, 4), (0, 1), (1, 1), (5, 3)),
    (2, 9, 18, 9, (2, 4), (1, 5), (1, 0), (2, 1), (2, 8)),
    (2, 9, 18, 9, (4, 4), (1, 2), (2, 2), (2, 1), (5, 1)),       # the fuzz's find: padded first, then one column
]


def _module_case(case: tuple, seed: int, qd: Q.QDtype = U8, zx: int | None = None) -> tuple:
    dim, cin, cout, groups, ks, st, pd, dl, hw = case
    g = torch.Generator().manual_seed(seed)
    fc, mod = build(dim, cin, cout, groups, ks, st, pd, dl, "zeros", g)
    x = Q.QTensor(codes((2, cin, *hw), qd, g), 0.1, (qd.quant_min + qd.quant_max + 1) // 2 if zx is None else zx, qd)
    fit_output(fc, mod, x, U8, 30)
    return fc, mod, x


@pytest.mark.parametrize("case", WRONG_CASES + COLUMN_CASES)
def test_odd_geometries_give_the_exact_codes_on_every_route(case):
    fc, mod, x = _module_case(case, sum(case[1:4]))
    assert wrong(fc, mod, x, PATHS, repeats=3) == {}  # (the wrong sums changed from run to run)


def _crash_cases() -> None:
    for i, case in enumerate(CRASH_CASES):
        for qd, zx in ((U8, 128), (U8, 0), (S8, -3)):
            fc, mod, x = _module_case(case, i, qd, zx)
            assert wrong(fc, mod, x, PATHS) == {}, case


def test_windows_wholly_in_the_padding_do_not_crash():
    """oneDNN crashed the process on these (SIGSEGV), so they run in a child process."""
    here = Path(__file__).parent
    code = "import sys; sys.path[:0] = [sys.argv[1]]; import test_conv_fuzz_s37 as t; t._crash_cases(); print('ok')"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, str(here)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("case", WRONG_CASES[:3] + COLUMN_CASES[:3])
@pytest.mark.parametrize("fbgemm", [True, False])
def test_odd_geometries_without_vnni(case, fbgemm, monkeypatch):
    force(monkeypatch, vnni=False, fbgemm=fbgemm)
    fc, mod, x = _module_case(case, 7 + sum(case[1:4]))
    assert wrong(fc, mod, x, {"auto": contextlib.nullcontext, "avx2": native.force_avx2}, repeats=2) == {}


def _brute_odd(n: int, k: int, s: int, d: int, p: int) -> bool:
    ext = d * (k - 1) + 1
    out = (n + 2 * p - ext) // s + 1
    return (p > 0 and p >= n) or any(not any(p <= o * s + t * d < p + n for t in range(k)) for o in range(out))


def test_odd_windows_is_the_brute_force_rule():
    rng = random.Random(37)
    for _ in range(20000):
        k, s, d, p, n = rng.randint(1, 7), rng.randint(1, 9), rng.randint(1, 4), rng.randint(0, 9), rng.randint(1, 30)
        if n + 2 * p < d * (k - 1) + 1:
            continue
        assert spec.odd_windows((1, 1, n), (1, 1, k), ConvSpec(1, (s,), (p,), (d,), 1)) == _brute_odd(n, k, s, d, p)
    pad1 = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    assert not spec.odd_windows((8, 64, 56, 56), (64, 64, 3, 3), pad1)     # an ordinary 3x3 conv
    assert spec.odd_windows((8, 64, 1, 1), (64, 64, 3, 3), pad1)           # padding the whole 1x1 input
    assert not spec.odd_windows((1, 1, 1), (1, 1, 1), ConvSpec(1, (3,), (4,), (3,), 1, transposed=True))


def test_strided_column_names_only_the_failing_class():
    geo = lambda s, g: ConvSpec(2, (1, s), (0, 0), (1, 1), g)  # noqa: E731
    strided_column = spec.strided_column
    assert strided_column((1, 1, 8, 9), (8, 1, 4, 7), geo(4, 1))          # one input channel, 8 outputs
    assert strided_column((1, 9, 9, 5), (18, 1, 4, 4), geo(2, 9))         # a channel multiplier
    assert not strided_column((1, 9, 9, 5), (18, 1, 4, 4), geo(1, 9))     # unit stride
    assert not strided_column((1, 9, 9, 9), (18, 1, 4, 4), geo(2, 9))     # several columns
    # session 47: on an AMX Xeon every group kind and dim fails there too (tests/test_vnni_s47.py)
    assert strided_column((1, 9, 9, 5), (9, 1, 4, 4), geo(2, 9))          # plain depthwise
    assert strided_column((1, 8, 9, 5), (8, 8, 4, 4), geo(2, 1))          # several input channels
    assert strided_column((1, 1, 5), (8, 1, 4), ConvSpec(1, (2,), (0,), (1,), 1))   # 1-d, one wide


# ---- the seeded geometry fuzz ----

def _case(rng: random.Random, i: int) -> tuple:
    g = torch.Generator().manual_seed(3700 + i)
    dim = rng.choice([1, 2, 2, 2, 3])
    kind = rng.choice(["dense", "dense", "g2", "half", "dw", "mult2", "mult3"])
    cin = rng.choice([1, 2, 3, 5, 7, 9, 12, 17, 33, 65])
    if kind == "dense":
        groups, cout = 1, rng.choice([1, 3, 7, 9, 15, 16, 17, 33, 65])
    elif kind == "g2":
        cin, groups, cout = 2 * cin, 2, 2 * rng.choice([1, 3, 5, 8, 17])
    elif kind == "half":
        cin = 2 * cin
        groups = cin // 2
        cout = groups * rng.choice([1, 2, 3])
    else:
        groups, cout = cin, cin * (1 if kind == "dw" else int(kind[-1]))
    ks = tuple(rng.choice([1, 2, 3, 4, 5, 7]) for _ in range(dim))
    ks = (ks[0],) * dim if rng.random() < 0.5 else ks
    st = tuple(rng.choice([1, 1, 2, 3, 5, 8]) for _ in range(dim))
    dl = tuple(rng.choice([1, 1, 2, 3]) for _ in range(dim))
    pmode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    pad = rng.choice(["int", "int", "tuple", "same", "valid"])
    padding: object = {"int": rng.choice([0, 1, 2, 3, 5, 8]), "tuple": tuple(rng.choice([0, 1, 2, 4, 7]) for _ in range(dim)),
                       "same": "same" if st == (1,) * dim else 1, "valid": "valid"}[pad]
    relu = rng.random() < 0.35
    fc, mod = build(dim, cin, cout, groups, ks, st, padding, dl, pmode, g, relu=relu,
                    wmode=rng.choice(["rand", "rand", "alt", "127", "-128", "zerochan"]), per_tensor=rng.random() < 0.25,
                    bias=rng.choice(["randn", "randn", "huge", "none"]))
    lr = fc._reversed_padding_repeated_twice
    hw = []
    for j in range(dim):
        left, right = lr[2 * (dim - 1 - j)], lr[2 * (dim - 1 - j) + 1]
        need = max(1, dl[j] * (ks[j] - 1) + 1 - left - right)
        h = max(rng.choice([need, need, 1, 2, 3, 5, 7, 11]), need)
        h = max(h, max(left, right) + 1) if pmode == "reflect" else max(h, left, right) if pmode == "circular" else h
        hw.append(h)
    qd, od = rng.choice([U8, U8, U7, S8, S7]), rng.choice([U8, U8, U7, S8, S7])
    n = rng.choice([0, 1, 1, 3])
    q = codes((n, cin, *hw), qd, g)
    layout = rng.choice(["contiguous", "contiguous", "channels_last", "strided"])
    if layout == "channels_last" and dim > 1:
        q = q.contiguous(memory_format=torch.channels_last if dim == 2 else torch.channels_last_3d)
    elif layout == "strided":
        q = codes((n, cin, *hw[:-1], 2 * hw[-1]), qd, g)[..., ::2]
    if rng.random() < 0.1:
        q = torch.full_like(q, rng.choice([qd.quant_min, qd.quant_max]))
    zx = rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max + 1) // 2])
    x = Q.QTensor(q, rng.choice([0.003, 0.01, 0.1]), zx, qd)
    if rng.random() < 0.7:
        fit_output(fc, mod, x, od, rng.choice([10, 40, 120]))
    else:  # a saturating grid
        mod.set_output_grid(rng.choice([1e-3, 50.0]), rng.choice([od.quant_min, od.quant_max]), od)
    return fc, mod, x, (i, dim, kind, cin, cout, groups, ks, st, dl, pmode, padding, hw, n, layout, str(qd), zx)


def test_conv_geometry_fuzz():
    rng, bad = random.Random(37), []
    for i in range(300):
        fc, mod, x, desc = _case(rng, i)
        got = wrong(fc, mod, x, PATHS)
        if got:
            bad.append((desc, got))
    assert bad == []


@pytest.mark.parametrize("route", sorted(NO_VNNI))
def test_conv_geometry_fuzz_without_vnni(route, monkeypatch):
    fbgemm, ctx = NO_VNNI[route]
    force(monkeypatch, vnni=False, fbgemm=fbgemm)
    rng, bad = random.Random(370), []
    for i in range(120):
        fc, mod, x, desc = _case(rng, i)
        got = wrong(fc, mod, x, {route: ctx})
        if got:
            bad.append((desc, got))
    assert bad == []


def test_regressions_under_an_isa_cap():
    """The regressions with oneDNN capped to AVX2 (its saturating kernels; lowbit's exact routes without VNNI)."""
    if cap_changes_nothing():
        pytest.skip("oneDNN runs its AVX2 kernels uncapped on this CPU: the capped child would repeat "
                    "test_windows_wholly_in_the_padding_do_not_crash, test_odd_geometries_give_the_exact_codes_on_every_"
                    "route and test_conv_geometry_fuzz call for call (1 thread both)")
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; import test_conv_fuzz_s37 as t\n"
            "from lowbit.kernels import onednn; assert not onednn.has_vnni()\n"
            "t._crash_cases()\n"
            "for c in t.WRONG_CASES + t.COLUMN_CASES: t.test_odd_geometries_give_the_exact_codes_on_every_route(c)\n"
            "t.test_conv_geometry_fuzz()\nprint('ok')\n")
    run_capped(code)
