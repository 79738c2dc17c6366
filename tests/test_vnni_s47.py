"""Session 47: the int8 kernels on an AVX-512 VNNI + AMX Xeon (issue #10).

Found here: oneDNN's int8 conv on an AMX CPU (``brg_conv_fwd:avx10_1_512_amx``) gives wrong sums (off by up to 255
codes) for dense, grouped and depthwise convs, 1-d to 3-d, whose output is one element wide along the last spatial
axis, read with a stride past 1 there: session 37's ``strided_column`` rule (one input channel a group, 2-d only) now
covers every such geometry (``spec.one_column`` reads the one window with stride 1: the same sums). The geometries
below are the fuzz's wrong cases on this CPU; on CPUs whose oneDNN is right there they pin the rewrite's sums.

Found here too: grouped convs with several input channels a group and more than 32 outputs a group (40, 48, 72, 200)
gave wrong sums (off by up to 234) on the AMX kernels, as session 38's channel multipliers did on AVX-512 VNNI: where
``isa.has_amx()``, ``spec.wide_multiplier`` sends them to the 32-channel chunks too (the s36 transposed-conv fuzz failed
on this CPU through its phase-stacked grouped convs).

Pins of behaviour that already held (the exactness sweep of this session on the AMX Xeon): every static Linear route at
the M / K / N edges (1-513 rows, K up to 3072) and the conv routes on codes whose u8 × s8 pairs overflow int16
(``vpmaddubsw``'s trap), against the exact integer oracle, and no reference-kernel fallback in a converted SmallCNN.
Paths are pinned per test (``native.force_avx2`` / ``force_scalar`` / ``disabled``, ``use_backend("onednn")``), so the
AVX2 routes run on this CPU too; nothing here depends on the CPU's ISA.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: 1 thread)
from lowbit import kernels as K
from lowbit.kernels import spec as S
from lowbit.kernels.spec import ConvSpec
from lowbit.nn import quantized as nnq
from test_conv_fuzz_s37 import PATHS as FUZZ_PATHS

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

U8, U7, S8 = Q.quint8, Q.quint8.with_range(0, 127), Q.qint8
PATHS = {k: v for k, v in FUZZ_PATHS.items() if k != "reference"}  # every route but the oracle's own
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MOD = {1: nnq.Conv1d, 2: nnq.Conv2d, 3: nnq.Conv3d}


def conv_oracle(mod: torch.nn.Module, x: Q.QTensor) -> torch.Tensor:
    """Exact sums in float64 (integers below 2⁵³), ``fl(s_x s_w)``, bias, ReLU, rounded and clamped to the out grid."""
    xd = x.int_repr().double() - x.q_zero_point()
    acc = _CONV[mod._dim](xd, mod.weight_int8.double(), None, mod.stride, mod.padding, mod.dilation, mod.groups)
    shape = (-1,) + (1,) * mod._dim
    y = acc * (torch.tensor(x.q_scale(), dtype=torch.float32) * mod.weight_scale).double().reshape(shape)
    y = y + mod.bias.double().reshape(shape)
    if mod._relu:
        y = y.clamp_min(0)
    qd = mod.out_qdtype
    return (torch.round(y / float(mod.scale)) + int(mod.zero_point)).clamp(qd.quant_min, qd.quant_max).long()


def fitted(mod: torch.nn.Module, x: Q.QTensor, oracle) -> torch.Tensor:
    """Give ``mod`` a u8 output grid spanning its exact outputs (so codes are not all clamped); the oracle's codes."""
    mod.set_output_grid(1.0, 0, U8)
    lo, hi = oracle(mod, x, raw=True)
    so = max((hi - lo) / 250, 1e-6)
    mod.set_output_grid(so, int(min(255, max(0, round(-lo / so) + 2))), U8)
    return oracle(mod, x)


def off_by(mod: torch.nn.Module, x: Q.QTensor, want: torch.Tensor) -> dict[str, int]:
    """``{path: largest code difference}`` for the paths more than one code (a near-tie) from ``want``."""
    bad = {}
    for name, ctx in PATHS.items():
        with ctx(), torch.no_grad():
            got = mod(x).int_repr().long()
        d = int((got - want).abs().max()) if got.numel() else 0
        if d > 1:
            bad[name] = d
    return bad


# ---- oneDNN's one-wide strided output on AMX ----

def test_one_wide_strided_rule_covers_every_group_kind_and_dim():
    geo = lambda s, g, dim=2: ConvSpec(dim, (1,) * (dim - 1) + (s,), (0,) * dim, (1,) * dim, g)  # noqa: E731
    assert S.strided_column((1, 8, 9, 5), (8, 8, 4, 4), geo(2, 1))            # dense (session 37: only multipliers)
    assert S.strided_column((1, 8, 9, 5), (8, 4, 4, 4), geo(2, 2))            # grouped
    assert S.strided_column((1, 9, 9, 5), (9, 1, 4, 4), geo(2, 9))            # depthwise
    assert S.strided_column((1, 9, 5), (18, 9, 4), geo(3, 1, dim=1))          # 1-d
    assert S.strided_column((1, 3, 4, 4, 5), (6, 3, 2, 2, 4), geo(2, 1, dim=3))  # 3-d
    assert S.strided_column((1, 1, 8, 9), (8, 1, 4, 7), geo(4, 1))            # session 37's class, still in
    assert not S.strided_column((1, 8, 9, 6), (8, 8, 4, 4), geo(2, 1))        # two output columns
    assert not S.strided_column((1, 8, 9, 4), (8, 8, 4, 4), geo(1, 1))        # unit stride along W
    assert not S.strided_column((1, 8, 1, 9), (8, 8, 4, 4), ConvSpec(2, (2, 1), (0, 0), (1, 1), 1))  # one row: right
    assert not S.strided_column((1, 8, 9, 5), (8, 8, 4, 4), ConvSpec(2, (1, 2), (0, 0), (1, 1), 1, transposed=True))


def test_one_column_reads_the_window_with_unit_stride_in_any_dim():
    x = Q.QTensor(torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(1, 2, 3, 4, 5), 0.1, 7, U8)
    xc, spec = S.one_column(x, (4, 2, 2, 2, 3), ConvSpec(3, (2, 1, 4), (1, 0, 1), (1, 1, 2), 1))
    assert spec.stride == (2, 1, 1) and spec.padding == (0, 0, 0)
    assert xc.shape == (1, 2, 5, 4, 5)                                         # padded (1, 0, 1), cropped to 2·2+1
    assert int(xc.int_repr()[0, 0, 0, 0, 0]) == 7 and torch.equal(xc.int_repr()[0, :, 1:4, :, 1:5],
                                                                  x.int_repr()[0, :, :, :, :4])


# (dim, C_in, C_out, groups, kernel, stride, padding, dilation, spatial, batch, input grid, z_x): the fuzz's wrong cases
AMX_ONE_WIDE = [
    (2, 5, 9, 1, (5, 5), (1, 8), (7, 4), (3, 2), (7, 7), 1, U7, 0),           # dense (s37 fuzz case 30)
    (2, 3, 65, 1, (2, 2), (1, 3), (1, 1), (1, 1), (7, 1), 3, S8, 127),        # dense, 65 outputs (case 855)
    (2, 66, 34, 2, (2, 2), (1, 8), (1, 1), (1, 3), (11, 3), 3, U8, 255),      # two groups (case 237)
    (2, 12, 65, 1, (1, 5), (3, 2), (1, 1), (1, 1), (11, 3), 1, S8, 0),        # dense, stride in both axes (case 1356)
    (3, 17, 15, 1, (7, 2, 2), (1, 1, 2), (0, 0, 0), (3, 1, 1), (19, 7, 2), 1, U7, 0),  # 3-d dense (case 95)
    (3, 17, 34, 17, (2, 2, 2), (2, 5, 3), (1, 1, 1), (1, 3, 3), (7, 7, 2), 1, U8, 255),  # 3-d multiplier 2 (case 923)
]


def _one_wide_case(case: tuple) -> tuple[torch.nn.Module, Q.QTensor]:
    dim, cin, cout, groups, ks, st, pad, dl, hw, n, qd, zx = case
    g = torch.Generator().manual_seed(cin * 100 + cout)
    mod = _MOD[dim](cin, cout, ks, st, pad, dl, groups)
    shape = tuple(mod.weight_int8.shape)
    w = Q.QTensor(torch.randint(-128, 128, shape, generator=g).to(torch.int8), torch.rand(cout, generator=g) * 0.01
                  + 1e-4, torch.zeros(cout, dtype=torch.int64), S8, 0)
    mod.set_weight_bias(w, torch.randn(cout, generator=g))
    q = torch.randint(qd.quant_min, qd.quant_max + 1, (n, cin, *hw), generator=g).to(qd.storage)
    return mod, Q.QTensor(q, 0.02, zx, qd)


def _conv_range(mod, x, raw=False):
    if not raw:
        return conv_oracle(mod, x)
    xd = x.int_repr().double() - x.q_zero_point()
    acc = _CONV[mod._dim](xd, mod.weight_int8.double(), None, mod.stride, mod.padding, mod.dilation, mod.groups)
    y = acc * (torch.tensor(x.q_scale(), dtype=torch.float32) * mod.weight_scale).double().reshape(
        (-1,) + (1,) * mod._dim) + mod.bias.double().reshape((-1,) + (1,) * mod._dim)
    return float(y.min()), float(y.max())


@pytest.mark.parametrize("case", AMX_ONE_WIDE)
def test_one_wide_strided_conv_is_exact_on_every_path(case):
    mod, x = _one_wide_case(case)
    assert S.strided_column(x.shape, mod.weight_int8.shape, mod._spec)
    want = fitted(mod, x, _conv_range)
    assert off_by(mod, x, want) == {}


# ---- oneDNN's AMX grouped convs past 32 outputs a group ----

def test_wide_groups_rule_keys_on_amx():
    g2 = ConvSpec(2, (1, 1), (0, 0), (1, 1), 2)
    assert S.wide_multiplier((80, 2, 3, 3), g2, amx=True)                   # 40 outputs a group, 2 inputs a group
    assert not S.wide_multiplier((80, 2, 3, 3), g2)                          # without AMX: right (sessions 36-38)
    assert S.wide_multiplier((80, 1, 3, 3), g2)                              # session 38's multiplier: on any CPU
    assert not S.wide_multiplier((64, 2, 3, 3), g2, amx=True)                # 32 a group
    assert not S.wide_multiplier((80, 4, 3, 3), ConvSpec(2, (1, 1), (0, 0), (1, 1), 1), amx=True)  # ungrouped


def test_has_amx_reads_the_flag_and_the_onednn_cap(monkeypatch):
    from lowbit.kernels import isa
    monkeypatch.setattr(isa, "_cpu_flags", lambda: frozenset({"avx2", "avx512_vnni", "amx_int8"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    try:
        for cap, want in (("", True), ("ALL", True), ("AVX512_CORE_AMX", True), ("AVX512_CORE_VNNI", False),
                          ("AVX2", False)):
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
            isa.has_amx.cache_clear()
            assert isa.has_amx() is want, cap
        monkeypatch.setattr(isa, "_cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        isa.has_amx.cache_clear()
        assert isa.has_amx() is False
    finally:
        isa.has_amx.cache_clear()


# (dim, groups, C_in a group, C_out a group, kernel, spatial, batch, channels-last): the grouped probe's wrong cases
AMX_GROUPED = [
    (2, 3, 2, 200, (3, 2), (5, 5), 2, True),
    (2, 2, 3, 48, (1, 3), (5, 7), 2, False),
    (2, 3, 2, 40, (3, 2), (3, 8), 1, False),
    (2, 3, 2, 72, (3, 3), (7, 8), 1, False),
    (1, 3, 16, 40, (2,), (2,), 2, False),       # a transposed conv's phase-stacked conv (s36 fuzz case 83)
]


def _grouped_case(case: tuple) -> tuple[torch.nn.Module, Q.QTensor]:
    dim, groups, cpg, opg, ks, hw, n, cl = case
    g = torch.Generator().manual_seed(groups * 1000 + cpg * 10 + opg)
    cin, cout = groups * cpg, groups * opg
    mod = _MOD[dim](cin, cout, ks, 1, 0, 1, groups)
    w = Q.QTensor(torch.randint(-128, 128, tuple(mod.weight_int8.shape), generator=g).to(torch.int8),
                  torch.rand(cout, generator=g) * 0.01 + 1e-4, torch.zeros(cout, dtype=torch.int64), S8, 0)
    mod.set_weight_bias(w, torch.randn(cout, generator=g))
    q = torch.randint(0, 256, (n, cin, *hw), generator=g).to(torch.uint8)
    return mod, Q.QTensor(q.contiguous(memory_format=torch.channels_last) if cl else q, 0.02, 128, U8)


@pytest.mark.parametrize("case", AMX_GROUPED)
def test_wide_grouped_conv_is_exact_on_every_path(case):
    mod, x = _grouped_case(case)
    want = fitted(mod, x, _conv_range)
    assert off_by(mod, x, want) == {}


@pytest.mark.parametrize("case", AMX_GROUPED[:2])
def test_wide_grouped_conv_chunked_where_amx_is_pinned(case, monkeypatch):
    """The AMX route pinned on any CPU: the conv runs in chunks of 32 outputs a group (no plan), the same codes."""
    from lowbit.kernels import conv_plan, onednn
    monkeypatch.setattr(onednn, "has_amx", lambda: True)
    mod, x = _grouped_case(case)
    want = fitted(mod, x, _conv_range)
    assert conv_plan.conv_plan(mod.weight(), mod.bias, K.OutGrid(float(mod.scale), int(mod.zero_point), U8), False,
                               U8, mod._spec) is None
    calls = []
    real = onednn._chunked
    monkeypatch.setattr(onednn, "_chunked", lambda *a: calls.append(1) or real(*a))
    assert off_by(mod, x, want) == {} and calls


# ---- pins: saturating codes (u8 255 x s8 -128 pairs overflow int16) on every route ----

def _linear_range(mod, x, raw=False):
    xd = x.int_repr().double() - x.q_zero_point()
    y = (xd @ (mod.weight_int8.double() - mod.weight_zero_point.double()[:, None]).t()) * (
        torch.tensor(x.q_scale(), dtype=torch.float32) * mod.weight_scale).double() + mod.bias.double()
    if mod._relu:
        y = y.clamp_min(0)
    if raw:
        return float(y.min()), float(y.max())
    qd = mod.out_qdtype
    return (torch.round(y / float(mod.scale)) + int(mod.zero_point)).clamp(qd.quant_min, qd.quant_max).long()


@pytest.mark.parametrize("m", [1, 3, 17, 128, 129, 513])
@pytest.mark.parametrize("k,n", [(7, 1000), (777, 8), (3072, 64)])
@pytest.mark.parametrize("grid", ["u8", "s8", "affine_w"])
def test_saturating_linear_codes_are_exact_on_every_route(m, k, n, grid):
    g = torch.Generator().manual_seed(m * 31 + k + n)
    qd, zx = (U8, 0) if grid != "s8" else (S8, 0)
    xc = torch.where(torch.rand(m, k, generator=g) < 0.9, qd.quant_max, qd.quant_min)   # mostly 255 (u8) / 127 (s8)
    x = Q.QTensor(xc.to(qd.storage), 0.02, zx, qd)
    wc = torch.where(torch.rand(n, k, generator=g) < 0.8, -128, 127).to(torch.int8)    # pairs of -128: 2·255·128
    wz = torch.randint(-20, 20, (n,), generator=g) if grid == "affine_w" else torch.zeros(n, dtype=torch.int64)
    mod = (nnq.LinearReLU if m % 2 else nnq.Linear)(k, n)
    mod.set_weight_bias(Q.QTensor(wc, torch.rand(n, generator=g) * 0.01 + 1e-4, wz, S8, 0), torch.randn(n, generator=g))
    want = fitted(mod, x, _linear_range)
    assert off_by(mod, x, want) == {}


SAT_CONVS = [  # (dim, C_in, C_out, groups, kernel, stride, padding, dilation, spatial, batch)
    (2, 64, 128, 1, (1, 1), (1, 1), (0, 0), (1, 1), (14, 14), 2),     # 1x1
    (2, 64, 64, 1, (3, 3), (1, 1), (1, 1), (1, 1), (20, 20), 2),      # 3x3
    (2, 259, 8, 1, (3, 3), (1, 1), (1, 1), (1, 1), (9, 9), 1),        # K = 2331, an odd channel count
    (2, 32, 64, 1, (3, 3), (2, 2), (1, 1), (1, 1), (17, 17), 2),      # strided
    (2, 96, 96, 96, (3, 3), (1, 1), (1, 1), (1, 1), (28, 28), 1),     # depthwise
    (2, 144, 144, 144, (3, 3), (2, 2), (1, 1), (1, 1), (29, 29), 1),  # depthwise, strided
    (2, 64, 64, 4, (3, 3), (1, 1), (1, 1), (1, 1), (15, 15), 2),      # grouped
    (2, 3, 32, 1, (3, 3), (2, 2), (1, 1), (1, 1), (64, 64), 2),       # a stem (the small-window pass)
]


@pytest.mark.parametrize("case", SAT_CONVS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_saturating_conv_codes_are_exact_on_every_route(case, channels_last):
    dim, cin, cout, groups, ks, st, pad, dl, hw, n = case
    g = torch.Generator().manual_seed(cin * 7 + cout + hw[0])
    mod = (nnq.ConvReLU2d if cin % 2 else nnq.Conv2d)(cin, cout, ks, st, pad, dl, groups)
    shape = tuple(mod.weight_int8.shape)
    wc = torch.where(torch.rand(shape, generator=g) < 0.8, -128, 127).to(torch.int8)
    mod.set_weight_bias(Q.QTensor(wc, torch.rand(cout, generator=g) * 0.01 + 1e-4, torch.zeros(cout, dtype=torch.int64),
                                  S8, 0), torch.randn(cout, generator=g))
    q = torch.where(torch.rand(n, cin, *hw, generator=g) < 0.9, 255, 0).to(torch.uint8)
    if channels_last:
        q = q.contiguous(memory_format=torch.channels_last)
    x = Q.QTensor(q, 0.02, 0, U8)
    want = fitted(mod, x, _conv_range)
    assert off_by(mod, x, want) == {}


def test_converted_small_cnn_runs_no_reference_kernel():
    from lowbit.examples import SmallCNN
    torch.manual_seed(0)
    fp = SmallCNN().eval()
    p = Q.prepare(Q.fuse_modules(fp, SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.no_grad():
        p(torch.randn(16, 1, 28, 28))
        qm = Q.convert(p)
        K.counts.clear()
        qm(torch.randn(4, 1, 28, 28))
    assert K.counts[("onednn", "conv")] == 3 and K.counts[("onednn", "linear")] == 2
    assert not [key for key in K.counts if key[0] == "reference"]


# ---- weight-only: a NaN row stays in its row (torch's bf16 F.linear on AMX spread it into the next) ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_nan_rows_stay_apart_under_a_leaky_matmul(dtype, monkeypatch):
    """torch's bf16 ``F.linear`` on this AMX Xeon put row 1's NaN into row 0 too (96 × 34 × 5, oneDNN's brg_matmul). The
    leak is simulated here on every CPU: the module computes the non-finite rows apart, the others stay finite."""
    from lowbit.nn.quantized import weight_only as wo

    torch.manual_seed(47)
    m = wo.WeightOnlyLinear.from_float(torch.nn.Linear(34, 5), bits=4, group_size=-1)
    real = F.linear

    def leaky(x, w, b=None):  # a NaN anywhere in a batch of rows reaches every row (the worst leak)
        y = real(x, w, b)
        return y + (x.sum() * 0) if x.dim() == 2 and x.shape[0] > 1 else y

    monkeypatch.setattr(wo.F, "linear", leaky)
    x = torch.randn(96, 34)
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    with torch.no_grad():
        y = m(x.to(dtype))
    want = torch.isfinite(x).all(1)
    assert torch.equal(torch.isfinite(y).all(1), want)
    with torch.no_grad():
        clean = m(torch.where(want[:, None], x, 0).to(dtype))
    assert torch.equal(y[want], clean[want])  # the finite rows as without the bad ones
