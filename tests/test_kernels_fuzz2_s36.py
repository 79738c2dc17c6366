"""Session 36's second kernel fuzz: the dynamic Linear recipes, QFunctional add / add_relu / mul / cat, pooling of
QTensors and static ConvTranspose, every path against a float64 oracle of the documented math.

Paths: automatic, ``native.force_avx2()``, ``native.force_scalar()``, ``native.disabled()`` (and a pinned backend where
the recipe has one; an ``ONEDNN_MAX_CPU_ISA=AVX2`` subprocess for the dynamic recipes). Oracles:

- per-token dynamic recipes (8-bit default, 7-bit ``reduce_range``): the float32 row grids and codes as documented
  (``per_token``), exact integer sums and the epilogue in float64; a path may differ by float32 rounding of the
  epilogue's terms (far below one code's contribution at these K). Rows of NaN / Inf give NaN rows.
- the x86 recipe: torch.ao's ``quantize_dynamic`` bit for bit on the automatic path, within float32 rounding elsewhere;
  a NaN / Inf input gives NaN on every path (session 37: torch.ao's op gave finite garbage, or raised on a first NaN).
- add / mul / cat: ``round(float64 result / s) + z`` clamped, at most one code off (float32 steps), and every path the
  same codes (the native add is bit-identical to the torch passes by design).
- pooling: max exact; averages ``round(mean(q - z) + z)`` (torch's quantized ops' rounding: the mean code), exact.
- ConvTranspose: float64 ``conv_transpose`` of the dequantized operands requantized, at most one code off.

Regressions kept:
- the x86 recipe with a pinned backend (``use_backend("reference")``) raised ``ValueError: dequantize: scale=nan`` on a
  NaN / Inf input; every other non-fbgemm route gives NaN (``per_tensor_7bit`` now returns NaN itself).
- max pooling of a per-channel QTensor (channel axis not pooled) fell back to float values (a float ``Tensor`` out,
  warned); it now pools the codes and keeps the per-channel grid, as average pooling does.
"""

from __future__ import annotations

import contextlib
import copy
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import cap_changes_nothing, one_thread, run_capped  # noqa: F401  (autouse: 1 thread)
from lowbit import kernels as K
from lowbit import native
from lowbit.nn import quantized as nnq
from lowbit.nn.quantized.functional_modules import QFunctional

pytestmark = [pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

PATHS = {
    "auto": contextlib.nullcontext,
    "avx2": native.force_avx2,
    "scalar": native.force_scalar,
    "nonative": native.disabled,
}
U8, U7, S8 = Q.quint8, Q.quint8.with_range(0, 127), Q.qint8
EPS32 = 2.0 ** -24


# ---- dynamic Linear ----

def per_token_oracle(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, b: torch.Tensor | None,
                     levels: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, magnitude)``: the per-token recipe in float64 on its float32 grids and codes; ``magnitude`` bounds the
    epilogue's float32 terms (the tolerance scales with it)."""
    xf = x.float().reshape(-1, x.shape[-1])
    lo, hi = xf.amin(1, keepdim=True).clamp(max=0.0), xf.amax(1, keepdim=True).clamp(min=0.0)
    width = hi - lo
    sc = (width / levels).clamp(min=1e-8)
    negz = (lo / sc).round()
    q = (xf * torch.reciprocal(sc) - negz).round().clamp(0, levels)
    wide = ~torch.isfinite(width) & torch.isfinite(lo) & torch.isfinite(hi)
    if wide.any():  # a finite row wider than float32: the generic path's grid (documented: it decides)
        from lowbit.nn.quantized.dynamic.per_token import quantize_per_token
        qq, r = quantize_per_token(xf, U8 if levels == 255.0 else U7), wide.reshape(-1)
        q[r], sc[r], negz[r] = qq.int_repr()[r].float(), qq.scale[r, None], -qq.zero_point[r, None].float()
    wd = w.double() * ws.double()[:, None]
    y = ((q.double() + negz.double()) @ w.double().t()) * sc.double() * ws.double()
    y = y + (b.double() if b is not None else 0)
    y[(~torch.isfinite(width) & ~wide).reshape(-1)] = float("nan")
    mag = ((q.double() - 128).abs() @ wd.abs().t() + (negz.double() + 128).abs() * wd.sum(1).abs()) * sc.double()
    mag = mag + y.abs().nan_to_num(0) + (b.double().abs() if b is not None else 0)
    return y.reshape(*x.shape[:-1], -1), mag.reshape(*x.shape[:-1], -1)


def dyn_input(rng: random.Random, g: torch.Generator, m: int, k: int, kind: str, layout: str) -> torch.Tensor:
    x = torch.randn(m, k, generator=g) * rng.choice([1e-3, 1.0, 30.0])
    r, c = rng.randrange(m), rng.randrange(k)
    if kind == "const":
        x[r] = rng.choice([-2.5, 0.7, 1e-30])
    elif kind == "zero":
        x[r] = 0
    elif kind == "out1e6":
        x[r, c] = rng.choice([1e6, -1e6])
    elif kind == "out3e38":
        x[r, c] = rng.choice([3e38, -3e38])
    elif kind == "wide":  # a finite row whose range is past float32
        x[r, 0], x[r, -1] = 3e38, -3e38
    elif kind == "denorm":
        x[r] = torch.randn(k, generator=g) * 1e-40
    elif kind == "nan":
        x[r, c] = float("nan")
    elif kind == "inf":
        x[r, c] = rng.choice([float("inf"), float("-inf")])
    elif kind == "neg":
        x = -x.abs()
    if layout == "3d":
        return x[None]
    if layout == "T":
        return x.t().contiguous().t()
    if layout == "slice":
        return torch.stack([x, x], 2).reshape(m, 2 * k)[:, ::2]
    return x


DYN_M = (1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 65, 257)
DYN_KN = (1, 3, 17, 63, 65, 255, 257, 1023, 4097)
KINDS = ("plain", "const", "zero", "out1e6", "out3e38", "wide", "denorm", "nan", "inf", "neg")


def dynamic_fuzz(recipe: str, cases: int, seed: int) -> list:
    rng, wrong = random.Random(seed), []
    for i in range(cases):
        m, k, n = rng.choice(DYN_M), rng.choice(DYN_KN), rng.choice(DYN_KN)
        if m * k * n > 1_000_000:
            continue
        g = torch.Generator().manual_seed(seed + i)
        lin = nn.Linear(k, n, bias=rng.random() < 0.7)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * rng.choice([0.01, 1.0]))
        model = nn.Sequential(lin).eval()
        spec = {"default": None, "u7": {nn.Linear: Q.get_dynamic_qconfig(reduce_range=True)},
                "x86": {nn.Linear: Q.get_dynamic_qconfig(backend="x86")}}[recipe]
        qm = Q.quantize_dynamic(model) if spec is None else Q.quantize_dynamic(model, spec)
        kind, layout = rng.choice(KINDS), rng.choice(["2d", "3d", "T", "slice"])
        x = dyn_input(rng, g, m, k, kind, layout)
        if recipe == "x86" and kind in ("nan", "inf"):
            want, mag = None, None  # (torch.ao's op: finite garbage, or a RuntimeError on a first NaN)
        elif recipe == "x86":
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine, torch.backends.quantized.engine = torch.backends.quantized.engine, "x86"
                try:  # (the previous engine comes back: tests/conftest.py's state guard)
                    want = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear},
                                                                  dtype=torch.qint8)(x)
                finally:
                    torch.backends.quantized.engine = engine
            want, mag = want.double(), None
        else:
            wq = qm[0].weight()
            want, mag = per_token_oracle(x, wq.int_repr(), wq.scale.float(), lin.bias,
                                         255.0 if recipe == "default" else 127.0)
        paths = dict(PATHS, reference=lambda: K.use_backend("reference"))
        for name, ctx in paths.items():
            with ctx(), torch.no_grad():
                got = qm(x).double()
            if recipe == "x86" and kind in ("nan", "inf"):  # one grid: NaN out on every path (session 37: fbgemm's
                if not torch.isnan(got).all():                # own op gave finite garbage, or raised on a first NaN)
                    wrong.append((i, m, k, n, kind, layout, name, "non-finite input, not NaN out"))
                continue
            nan_w, nan_g = torch.isnan(want), torch.isnan(got)
            if recipe == "x86" and name == "auto":
                if not (torch.equal(nan_w, nan_g) and torch.equal(got[~nan_w], want[~nan_w])):
                    wrong.append((i, m, k, n, kind, layout, name, "not torch.ao's bits"))
                continue
            if recipe == "x86" and kind == "wide":
                continue  # fbgemm's own overflow handling differs
            if not torch.equal(nan_w, nan_g):
                wrong.append((i, m, k, n, kind, layout, name, "NaN rows", int(nan_w.sum()), int(nan_g.sum())))
                continue
            # (the reference backend's float32 sums of dequantized products round at each of the K steps)
            ulps = 64 + (k if name == "reference" else 0)
            tol = (1e-5 * (want.abs() + want.abs().max()) if mag is None else ulps * EPS32 * mag) + 1e-30
            err = (got - want).abs()
            bad = ~nan_w & (err > tol) & ~((want.abs() > 3.4e38) & torch.isinf(got))
            if bad.any():
                wrong.append((i, m, k, n, kind, layout, name, "values", int(bad.sum())))
    return wrong


@pytest.mark.parametrize("recipe, cases, seed", [("default", 160, 360), ("u7", 100, 361), ("x86", 60, 362)])
def test_dynamic_linear_fuzz(recipe, cases, seed):
    assert dynamic_fuzz(recipe, cases, seed) == []


def test_dynamic_linear_fuzz_two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert dynamic_fuzz("default", 15, 363) == [] and dynamic_fuzz("u7", 10, 364) == []
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["reference", "onednn", None])
def test_x86_recipe_non_finite_input_on_a_pinned_backend_is_nan(backend):
    """A pinned backend's route of the x86 recipe: NaN out for a NaN / Inf input, as the other non-fbgemm routes
    (before: ``use_backend("reference")`` raised ``ValueError: dequantize: scale=nan``)."""
    torch.manual_seed(0)
    qm = Q.quantize_dynamic(nn.Sequential(nn.Linear(17, 5)), {nn.Linear: Q.get_dynamic_qconfig(backend="x86")})
    for v in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3, 17)
        x[1, 2] = v
        with K.use_backend(backend) if backend else native.disabled(), torch.no_grad():
            y = qm(x) if backend else None
        if y is not None:
            assert y.shape == (3, 5) and torch.isnan(y).all()


def test_dynamic_recipes_under_an_isa_cap():
    """The per-token recipes' fuzz with oneDNN capped to AVX2 (lowbit's routes without VNNI)."""
    if cap_changes_nothing():  # (oneDNN runs AVX2 uncapped here: the child's 35 cases, run in this process)
        from lowbit.kernels import onednn
        assert not onednn.has_vnni()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w = dynamic_fuzz("default", 20, 365) + dynamic_fuzz("u7", 15, 366)
        assert w == [], w
        return
    code = ("import sys, warnings; sys.path[:0] = [sys.argv[1]]; warnings.simplefilter('ignore')\n"
            "import test_kernels_fuzz2_s36 as t\n"
            "from lowbit.kernels import onednn; assert not onednn.has_vnni()\n"
            "w = t.dynamic_fuzz('default', 20, 365) + t.dynamic_fuzz('u7', 15, 366)\n"
            "assert w == [], w\nprint('ok')\n")
    run_capped(code)


# ---- QFunctional add / add_relu / mul / cat ----

def _layout(q: torch.Tensor, how: str) -> torch.Tensor:
    if how == "cl" and q.dim() == 4:
        return q.contiguous(memory_format=torch.channels_last)
    if how == "T" and q.dim() > 1:
        return q.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "slice":
        return torch.cat([q, q], -1)[..., ::2]
    return q


def _zp(rng: random.Random, qd: Q.QDtype) -> int:
    return rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max + 1) // 2, qd.quant_min + 1])


def test_qfunctional_fuzz():
    rng, wrong = random.Random(3601), []
    for i in range(240):
        g = torch.Generator().manual_seed(i)
        op = rng.choice(["add", "add_relu", "mul", "cat"])
        shape = rng.choice([(2, 3, 5, 7), (1, 17, 9, 9), (4, 33), (257,), (3, 1, 1, 1), (2, 64, 13, 11)])
        if i % 30 == 0:
            shape = (2, 64, 72, 72)  # split across threads
        qa, qb, od = rng.choice([U8, S8, U7]), rng.choice([U8, S8, U7]), rng.choice([U8, S8, U7])
        sa = rng.choice([1e-3, 0.02, 0.1, 1.0])
        sb = sa if rng.random() < 0.3 else rng.choice([1e-3, 0.05, 0.3, 2.0, 1e3])
        so = rng.choice([1e-4, 0.01, 0.05, 0.3, 100.0])  # 1e-4 / 100: saturating output grids
        za, zb, zo = _zp(rng, qa), _zp(rng, qb), _zp(rng, od)
        bshape, dim = shape, 0
        if op == "cat":
            dim = rng.randrange(len(shape))
            bshape = tuple(s if d != dim else rng.choice([1, 3]) for d, s in enumerate(shape))
        elif len(shape) == 4 and rng.random() < 0.2:
            bshape = (1, shape[1], 1, 1)  # broadcast
        la = rng.choice(["c", "cl", "T", "slice"])
        lb = rng.choice([la, la, "c", "cl", "T", "slice"])
        ca = _layout(torch.randint(qa.quant_min, qa.quant_max + 1, shape, generator=g).to(qa.storage), la)
        cb = _layout(torch.randint(qb.quant_min, qb.quant_max + 1, bshape, generator=g).to(qb.storage), lb)
        xa, xb, f = Q.QTensor(ca, sa, za, qa), Q.QTensor(cb, sb, zb, qb), QFunctional(so, zo, od)
        f32 = lambda v: torch.tensor(v, dtype=torch.float32).double()  # noqa: E731
        da, db = (ca.long() - za).double() * f32(sa), (cb.long() - zb).double() * f32(sb)
        y = torch.cat([da, db], dim) if op == "cat" else da * db if op == "mul" else da + db
        lo = zo if op == "add_relu" else od.quant_min
        want = (torch.round(y / f32(so)) + zo).clamp(lo, od.quant_max).long()
        got = {}
        for name, ctx in PATHS.items():
            with ctx():
                got[name] = (f.cat([xa, xb], dim) if op == "cat" else getattr(f, op)(xa, xb)).int_repr().long()
            if int((got[name] - want).abs().max()) > 1:
                wrong.append((i, op, shape, bshape, la, lb, name))
        if any(not torch.equal(v, got["auto"]) for v in got.values()):
            wrong.append((i, op, shape, la, lb, "paths disagree"))
    assert wrong == []


# ---- pooling ----

def test_max_pool_keeps_a_per_channel_grid():
    """Max pooling a per-channel QTensor (channel axis 1, spatial dims pooled) pools the codes on its grid
    (before: a float Tensor out, through the dequantizing fallback)."""
    g = torch.Generator().manual_seed(0)
    s, z = torch.rand(5, generator=g) * 0.1 + 0.01, torch.randint(0, 256, (5,), generator=g)
    for dim, fn, kw in [(1, F.max_pool1d, {"kernel_size": 3, "stride": 2, "padding": 1}),
                        (2, F.max_pool2d, {"kernel_size": 2}),
                        (2, F.max_pool2d, {"kernel_size": 3, "stride": 1, "dilation": 2, "ceil_mode": True}),
                        (3, F.max_pool3d, {"kernel_size": 2, "stride": 1}),
                        (2, F.adaptive_max_pool2d, {"output_size": (3, 2)})]:
        q = torch.randint(0, 256, (2, 5, *(7,) * dim), generator=g).to(torch.uint8)
        if dim == 2:
            q = q.contiguous(memory_format=torch.channels_last)
        x = Q.QTensor(q, s, z, U8, 1)
        y = fn(x, **kw)
        assert isinstance(y, Q.QTensor) and y.axis == 1 and torch.equal(y.scale, s) and torch.equal(y.zero_point, z)
        assert torch.equal(y.int_repr(), fn(q.float(), **kw).to(torch.uint8))
        assert torch.equal(y.dequantize(), fn(x.dequantize(), **kw))
    out = F.max_pool1d(Q.QTensor(torch.zeros(4, 5, dtype=torch.uint8), s, z, U8, 1), 2)
    assert not isinstance(out, Q.QTensor)  # the channel axis pooled: float values (warned), as before


def test_pool_fuzz():
    rng, wrong = random.Random(3602), []
    for i in range(160):
        g = torch.Generator().manual_seed(i)
        dim = rng.choice([1, 2, 2, 3])
        op = rng.choice(["max", "max", "avg", "adaptive_avg", "adaptive_max"] if dim == 2 else ["max", "avg",
                                                                                               "adaptive_avg"])
        qd, c = rng.choice([U8, S8, U7]), rng.choice([1, 3, 16, 17, 64])
        sp = tuple(rng.choice([1, 2, 3, 5, 7, 8, 13, 31]) for _ in range(dim))
        q = torch.randint(qd.quant_min, qd.quant_max + 1, (rng.choice([1, 2]), c, *sp), generator=g).to(qd.storage)
        lay = rng.choice(["c", "cl", "slice"])
        if lay == "cl" and dim > 1:
            q = q.contiguous(memory_format=torch.channels_last if dim == 2 else torch.channels_last_3d)
        elif lay == "slice":
            q = torch.cat([q, q], 1)[:, ::2]
        if rng.random() < 0.25:
            zs = torch.randint(qd.quant_min, qd.quant_max + 1, (c,), generator=g)
            x, zc = Q.QTensor(q, torch.rand(c, generator=g) * 0.1 + 0.01, zs, qd, 1), zs.reshape(1, -1, *[1] * dim)
        else:
            z = rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max) // 2])
            x, zc = Q.QTensor(q, 0.05, z, qd), torch.tensor(z)
        f = getattr(F, f"{op}_pool{dim}d")
        if op in ("max", "avg"):
            k = tuple(min(rng.choice([1, 2, 3]), s) for s in sp)
            kw = {"kernel_size": k, "stride": tuple(rng.choice([1, 2, 3]) for _ in range(dim)),
                  "padding": tuple(rng.choice([0, 0, 1]) if kk >= 2 else 0 for kk in k), "ceil_mode": rng.random() < .3}
            if op == "max" and rng.random() < 0.3:
                d = tuple(rng.choice([1, 2]) for _ in range(dim))
                if all(dd * (kk - 1) + 1 <= s + 2 * p for dd, kk, s, p in zip(d, k, sp, kw["padding"])):
                    kw["dilation"] = d
            if op == "avg":
                kw["count_include_pad"] = rng.random() < 0.5
                if dim > 1 and rng.random() < 0.3:
                    kw["divisor_override"] = rng.choice([1, 3, 7])
        else:
            kw = {"output_size": tuple(rng.choice([1, 2, 3, 5]) for _ in range(dim))}
        try:
            want = (f(q.double(), **kw) if "max" in op
                    else torch.round(f(q.double() - zc, **kw) + zc)).clamp(qd.quant_min, qd.quant_max).long()
        except RuntimeError:
            continue  # a geometry torch refuses
        for name, ctx in PATHS.items():
            with ctx():
                y = f(x, **kw)
            if not (isinstance(y, Q.QTensor) and y.axis == x.axis and torch.equal(y.int_repr().long(), want)):
                wrong.append((i, op, dim, lay, x.axis, sp, kw, name))
    assert wrong == []


# ---- ConvTranspose ----

def test_conv_transpose_fuzz():
    rng, wrong = random.Random(3603), []
    paths = dict(PATHS, onednn=lambda: K.use_backend("onednn"))
    ct, checked = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}, 0
    for i in range(160):
        g = torch.Generator().manual_seed(i)
        dim, groups = rng.choice([1, 2, 2, 3]), rng.choice([1, 1, 2, 3])
        cin, cout = groups * rng.choice([1, 2, 5, 16]), groups * rng.choice([1, 3, 8])
        ks = tuple(rng.choice([1, 2, 3, 4]) for _ in range(dim))
        st = tuple(rng.choice([1, 2, 3, 5]) for _ in range(dim))  # stride > kernel too
        dl, pd = tuple(rng.choice([1, 2]) for _ in range(dim)), tuple(rng.choice([0, 1, 2]) for _ in range(dim))
        op = tuple(rng.randrange(max(s, d)) for s, d in zip(st, dl))
        mod = {1: nnq.ConvTranspose1d, 2: nnq.ConvTranspose2d, 3: nnq.ConvTranspose3d}[dim](
            cin, cout, ks, st, pd, op, groups, rng.random() < 0.7, dl)
        wshape, ncol = (cin, cout // groups, *ks), cout // groups
        c = (torch.randint(-128, 128, wshape, generator=g) if rng.random() < 0.5
             else torch.where(torch.rand(wshape, generator=g) < .5, -128, 127)).to(torch.int8)
        w = (Q.QTensor(c, torch.rand(ncol, generator=g) * 0.01 + 1e-4, torch.zeros(ncol, dtype=torch.int64), S8, 1)
             if rng.random() < 0.8 else Q.QTensor(c, 0.005, 0, S8))
        b = torch.randn(cout, generator=g) if mod.bias is not None else None
        mod.set_weight_bias(w, b)
        od, qd = rng.choice([U8, U7, S8]), rng.choice([U8, U7, S8])
        so, zo = rng.choice([1e-3, 0.05, 1.0]), rng.randint(od.quant_min, od.quant_max)
        mod.set_output_grid(so, zo, od)
        sp = tuple(rng.choice([1, 2, 3, 5, 7]) for _ in range(dim))
        q = torch.randint(qd.quant_min, qd.quant_max + 1, (rng.choice([1, 2]), cin, *sp), generator=g).to(qd.storage)
        if dim == 2 and rng.random() < 0.4:
            q = q.contiguous(memory_format=torch.channels_last)
        elif rng.random() < 0.2:
            q = torch.cat([q, q], 1)[:, ::2]
        sx, zx = rng.choice([0.01, 0.1, 1.0]), rng.choice([qd.quant_min, qd.quant_max, (qd.quant_min + qd.quant_max + 1) // 2])
        f32 = lambda v: torch.tensor(v, dtype=torch.float32).double()  # noqa: E731
        try:
            y = ct[dim]((q.double() - zx) * f32(sx), w.dequantize().double(), None if b is None else b.double(),
                        st, pd, op, groups, dl)
        except RuntimeError:
            continue  # an output size torch refuses
        checked += 1
        want = (torch.round(y / f32(so)) + zo).clamp(od.quant_min, od.quant_max).long()
        for name, ctx in paths.items():
            with ctx(), torch.no_grad():
                got = mod(Q.QTensor(q, sx, zx, qd)).int_repr().long()
            if got.shape != want.shape or int((got - want).abs().max()) > 1:
                wrong.append((i, dim, groups, cin, cout, ks, st, pd, dl, op, sp, name))
    assert wrong == [] and checked > 100
