"""Session 37 differential fuzz of the weight-only Linear, quantized Embedding(Bag) and the tied LLM embedding against
a float64 oracle ``x.double() @ ŵ.double().T + b`` (``ŵ = (q - z) * s``). Each kernel path is chosen deliberately:
torch's int4 / int8 decode kernels (≤ 32 rows, bf16 activations: within ``2⁻⁸ |x|·(|ŵ| + |8 - z_u|·s)``, the affine
zero term being a second bf16 number), the float32 ``(x @ qᵀ)·s`` path and dequantize + ``F.linear`` (exact in
float32), under torch's AVX2 and AVX-512 bodies (``ATEN_CPU_CAPABILITY``, in a subprocess). The tests named after a
defect failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit import kernels, native
from lowbit.llm.tied import quantize_head
from lowbit.nn.quantized.embedding import Embedding, EmbeddingBag
from lowbit.nn.quantized.weight_only import DECODE_MAX_ROWS, WeightOnlyLinear
from lowbit.qscheme import QScheme

FQ = QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS


def _wo(k: int, n: int, bits: int, g: int, sym: bool, bias: bool = True, kernel: str = "auto", seed: int = 0,
        scale: float = 0.05) -> WeightOnlyLinear:
    """Random codes with both grid ends in every row, zero points at both ends (affine), a bias."""
    gen = torch.Generator().manual_seed(seed)
    m = WeightOnlyLinear(k, n, bias, bits, g, sym, kernel=kernel)
    groups, lo, hi = k // m._g, m.qdtype.quant_min, m.qdtype.quant_max
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen)
    codes[:, 0], codes[:, 1] = lo, hi
    z = torch.zeros(n, groups, dtype=torch.int64) if sym else torch.randint(lo, hi + 1, (n, groups), generator=gen)
    if not sym:
        z[0], z[-1] = lo, hi
    m.set_codes(codes, (torch.rand(n, groups, generator=gen) + 0.05) * scale, z)
    if bias:
        m.bias = torch.randn(n, generator=gen)
    return m


def _check(m: WeightOnlyLinear, x: torch.Tensor, kernel_path: bool) -> None:
    """``m(x)`` against the float64 oracle: non-finite exactly where it is, else within the path's bound."""
    y = m(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], m.out_features)
    k = m.in_features
    w = m.dequantize_weight().double()
    xd = x.double().reshape(-1, k)
    ref = xd @ w.T + (0.0 if m.bias is None else m.bias.double())
    yd = y.double().reshape(ref.shape)
    fin = torch.isfinite(ref.to(x.dtype))
    assert torch.equal(torch.isfinite(yd), fin), "NaN / Inf must reach exactly the rows the float model's reach"
    zu = m.zero_points.double() + (8 if m.qdtype.signed and m.bits == 4 else 0)
    spread = ((8 - zu).abs() * m.scales.double()).repeat_interleave(m._g, 1) if m.bits == 4 else 0.0
    mag = xd.abs().nan_to_num(0.0, 0.0) @ (w.abs() + spread).T
    if kernel_path:  # bf16 activations / scales (and the bf16 product of the int8 kernel)
        bound = 2**-8 * mag
    else:
        bound = 2**-16 * mag
    if x.dtype != torch.float32:
        bound = bound + 2**-7 * ref.abs() + 2**-7 * mag  # the input's own rounding of the product and the output
    err = (yd - ref).abs()
    assert bool((err[fin] <= bound[fin] + 1e-30).all()), float(((err - bound) / (bound + 1e-30))[fin].max())


# the weight-only paths, each pinned by its shape (bits, in, out, group size, symmetric) and the row count
_PATHS = {
    "int4_kernel_sym": ((4, 128, 32, 32, True), True),
    "int4_kernel_affine": ((4, 128, 48, 64, False), True),
    "int4_kernel_per_channel": ((4, 256, 16, -1, False), True),
    "int8_kernel": ((8, 64, 33, -1, True), True),
    "int8_scaled_float": ((8, 72, 17, -1, True), False),  # K % 16 != 0: x @ qᵀ in float32, then * s
    "int8_groups": ((8, 64, 17, 32, True), False),
    "int8_affine": ((8, 64, 17, -1, False), False),
    "int4_odd_out": ((4, 64, 17, 32, False), False),  # N % 16 != 0: dequantize + F.linear
    "int4_pairs": ((4, 34, 5, -1, True), False),
}


@pytest.mark.parametrize("path", sorted(_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_only_paths_against_float64(path, dtype):
    (bits, k, n, g, sym), kernel_path = _PATHS[path]
    decode = kernel_path and dtype != torch.float16
    for kernel in ("auto", "reference"):
        m = _wo(k, n, bits, g, sym, kernel=kernel, seed=k + n)
        gen = torch.Generator().manual_seed(1)
        for rows in (0, 1, 5, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1, 96):
            x = torch.randn(rows, k, generator=gen)
            if rows > 3:
                x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
            on_kernel = decode and kernel == "auto" and rows <= DECODE_MAX_ROWS
            _check(m, x.to(dtype), on_kernel)
            # layouts: transposed storage, 3-D / 4-D batches, a channels-last 4-D tensor, a strided slice
            _check(m, x.t().contiguous().t().to(dtype), on_kernel)
            if rows == 5:
                x4 = torch.randn(1, k, 5, 1, generator=gen).to(memory_format=torch.channels_last).permute(0, 2, 3, 1)
                _check(m, x4.to(dtype), on_kernel)
                _check(m, torch.randn(5, 2 * k, generator=gen)[:, ::2].reshape(5, 1, k).to(dtype), on_kernel)


def test_fp16_int8_per_channel_does_not_overflow():
    """fp16 input, 8-bit per-channel weights: ``x @ qᵀ`` (|q| up to 128) passed half's 65504 where ``x @ ŵᵀ`` did not
    (inf for activations of ~60 at K = 256; also after ``model.half()``)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    q = WeightOnlyLinear.from_float(lin, bits=8, group_size=-1)
    x = (torch.randn(40, 256) * 60).half()
    for rows in (1, 40):
        ref = x[:rows].double() @ q.dequantize_weight().double().T + q.bias.double()
        mag = x[:rows].double().abs() @ q.dequantize_weight().double().abs().T
        assert float(ref.abs().max()) < 1000
        for mod in (q, WeightOnlyLinear.from_float(lin, bits=8, group_size=-1).half()):
            y = mod(x[:rows])
            assert y.dtype == torch.float16 and bool(torch.isfinite(y).all())
            assert bool(((y.double() - ref).abs() <= 2**-9 * mag + 2**-10 * ref.abs()).all())


def test_int4_kernel_subnormal_scales_take_the_exact_path():
    """A scale below bfloat16's normal range kept a few bits in the kernel's bf16 scales (8 % off at 1e-40)."""
    m = _wo(128, 32, 4, 32, False, bias=False, scale=1e-40)
    x = torch.randn(2, 128) * 1e20
    ref = x.double() @ m.dequantize_weight().double().T
    y = m(x)
    assert bool(((y.double() - ref).abs() <= 1e-4 * (x.double().abs() @ m.dequantize_weight().double().abs().T)).all())
    normal = _wo(128, 32, 4, 32, False, bias=False)  # normal scales keep the kernel (a cache is built)
    normal(torch.randn(1, 128))
    assert normal._int4_cache() and m._int4_cache() == ()  # (the pack, or () where the exact path runs)


_UNDER_CAP = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_wo_fuzz_s37 import _wo
out = {}
for k in (8, 16, 24, 40, 64, 72, 136):  # torch's AVX-512 int8 kernel crashed for k % 16 == 8 (at 1-32 rows)
    for n in (3, 48):
        m = _wo(k, n, 8, -1, True, seed=k * n)
        x = torch.randn(32, k, generator=torch.Generator().manual_seed(k))
        out[f"i8_{k}_{n}"] = torch.stack([m(x[:r]).double().sum(0) for r in (1, 2, 3, 17, 32)])
for name, (k, n, g, sym) in {"i4s": (128, 32, 32, True), "i4a": (256, 48, 64, False), "i4c": (128, 16, -1, False)}.items():
    m = _wo(k, n, 4, g, sym, seed=k + n)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(n))
    out[name] = torch.cat([m(x[:r]) for r in (1, 7, 32)])
torch.save(out, sys.argv[2])
print("ok", torch.backends.cpu.get_cpu_capability())
"""


def _run_under(cap: str | None, path: Path) -> dict[str, torch.Tensor]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(Q.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap:
        env["ATEN_CPU_CAPABILITY"] = cap
    r = subprocess.run([sys.executable, "-c", _UNDER_CAP, str(Path(__file__).parent), str(path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-2000:])
    return torch.load(path)


def test_decode_kernels_under_avx2_and_avx512_bodies(tmp_path):
    """torch's int8 / int4 decode kernels under its AVX2 body and the machine's best (AVX-512 where present) agree
    with each other and with the float64 oracle; ``in_features = 24`` (and 8, 40, 72, 136) crashed the process in the
    AVX-512 int8 kernel (a multiple of 8 was checked, it needs 16), or gave 68 % error."""
    best, avx2 = _run_under(None, tmp_path / "best.pt"), _run_under("avx2", tmp_path / "avx2.pt")
    assert best.keys() == avx2.keys()
    for key in best:
        scale = float(best[key].abs().max()) + 1e-6
        assert float((best[key] - avx2[key]).abs().max()) <= 2**-6 * scale, key
    for k in (8, 24, 136):  # the oracle, for the shapes that crashed
        m = _wo(k, 48, 8, -1, True, seed=k * 48)
        x = torch.randn(32, k, generator=torch.Generator().manual_seed(k))
        ref = torch.stack([(x[:r].double() @ m.dequantize_weight().double().T + m.bias.double()).sum(0)
                           for r in (1, 2, 3, 17, 32)])
        mag = float((x.double().abs() @ m.dequantize_weight().double().abs().T).sum(0).max())
        assert float((best[f"i8_{k}_48"] - ref).abs().max()) <= 2**-8 * mag


def test_lowbit_pins_do_not_change_weight_only_numbers():
    """The weight-only Linears and embeddings run torch ops only: lowbit's backend / ISA pins leave them bit-equal."""
    m = _wo(128, 32, 4, 32, False)
    bag = EmbeddingBag(10, 5, "mean", qdtype=Q.quint4)
    bag.set_weight(torch.randn(10, 5))
    x, idx, offs = torch.randn(3, 128), torch.tensor([1, 2, 9, 0]), torch.tensor([0, 3])
    y, e = m(x), bag(idx, offs)
    for pin in (kernels.use_backend("reference"), native.force_scalar(), native.force_avx2()):
        with pin:
            assert torch.equal(m(x), y) and torch.equal(bag(idx, offs), e)


# ---- float-qparams embeddings ----
@pytest.mark.parametrize("qdtype", [Q.qint8, Q.qint4, Q.quint8, Q.quint4])
def test_float_qparams_rows_stay_within_half_a_step(qdtype):
    """``z = -min / s`` (torch.ao's) put a signed grid's codes at 0..qmax-qmin, clamped: 128 steps off for qint8
    (torch.ao the same); now ``z = qmin - min / s``, unchanged for the unsigned grids."""
    torch.manual_seed(0)
    w = torch.randn(6, 9) * 3
    for cls in (Embedding, EmbeddingBag):
        e = cls(6, 9, qdtype=qdtype, qscheme=FQ)
        e.set_weight(w)
        s = e.weight_scale.double()
        rows = e(torch.arange(6)) if cls is Embedding else e(torch.arange(6)[:, None])
        assert bool(((rows.double() - w.double()).abs() <= 0.5 * s[:, None] + 1e-6).all())
    s, z = Q.calculate_qparams(w.amin(1), w.amax(1), FQ, qdtype)
    torch.testing.assert_close(z, qdtype.quant_min - w.amin(1) / s)
    if qdtype is Q.quint8:  # torch.ao's float_qparams observer: the same grid
        from torch.ao.quantization.observer import PerChannelMinMaxObserver
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams)
            obs(w)
            ts, tz = obs.calculate_qparams()
        assert torch.equal(s, ts) and torch.equal(z, tz)


def test_float_qparams_one_row_table():
    """A one-row table's ``(1,)`` float zero point became a Python float in the qparam check, then "must be an
    integer": ``Embedding(1, D)`` with float qparams, ``from_float`` of it and a one-channel QTensor all raised."""
    w = torch.tensor([[0.5, -1.25, 2.0, 0.75]])
    e = Embedding(1, 4, qscheme=FQ)
    e.set_weight(w)
    torch.testing.assert_close(e(torch.tensor([0, 0])), w.expand(2, 4), atol=0.5 * float(e.weight_scale), rtol=0)
    m = nn.Embedding(1, 4)
    m.qconfig = Q.get_embedding_qconfig(8, float_qparams=True)
    q = Embedding.from_float(m)
    assert q.weight_zero_point.dtype == torch.float32
    torch.testing.assert_close(q(torch.tensor([0])), m.weight.detach(), atol=0.5 * float(q.weight_scale), rtol=0)
    qt = Q.QTensor(torch.tensor([[3, 4]], dtype=torch.uint8), torch.tensor([0.1]), torch.tensor([1.5]), Q.quint8, axis=0)
    torch.testing.assert_close(qt.dequantize(), torch.tensor([[0.15, 0.25]]))
    with pytest.raises(ValueError, match="finite"):
        Q.dequantize(torch.tensor([[3]], dtype=torch.uint8), torch.tensor([0.1]), torch.tensor([float("nan")]), 0)


@pytest.mark.parametrize("qdtype", [Q.quint8, Q.quint4, Q.qint4])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_against_float64(qdtype, mode):
    """Bags of dequantized rows as ``F.embedding_bag`` in float64: offsets with empty bags, ``include_last_offset``,
    ``per_sample_weights``, ``padding_idx`` (also a bag of padding only), odd 4-bit row widths, 2-D inputs."""
    gen = torch.Generator().manual_seed(3)
    for dim, pad, last, scheme in ((5, None, False, FQ), (7, 2, True, QScheme.PER_CHANNEL_AFFINE), (1, -1, False, FQ)):
        bag = EmbeddingBag(9, dim, mode, pad, last, qdtype, scheme)
        bag.set_weight(torch.randn(9, dim, generator=gen) * 4)
        table = bag.weight().dequantize().double()
        p = None if pad is None else pad % 9
        inp = torch.tensor([2, 2, 0, 8, 2, 5, 1])
        offs = torch.tensor([0, 0, 2, 4, 4] + ([7] if last else []))
        psw = torch.randn(7, generator=gen) if mode == "sum" else None
        y = bag(inp, offs, psw)
        ref = F.embedding_bag(inp, table, offs, mode=mode, include_last_offset=last, padding_idx=p,
                              per_sample_weights=None if psw is None else psw.double())
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-5)
        inp2 = torch.tensor([[1, 2, 3], [2, 2, 2], [8, 0, 4]])
        ref2 = F.embedding_bag(inp2, table, mode=mode, padding_idx=p)
        torch.testing.assert_close(bag(inp2).double(), ref2, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(Embedding.forward(bag, inp2).double(), table[inp2], rtol=1e-6, atol=1e-6)


# ---- the tied LLM embedding ----
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, 32, True), (4, 32, False), (4, -1, False)])
def test_tied_embedding_rows_and_empty_ids(bits, group, sym):
    """Lookups equal the head's dequantized rows exactly for any id shape; no ids (an empty batch) raised in a
    ``reshape(0, -1, g)`` ("the unspecified dimension size -1 can be any value")."""
    torch.manual_seed(0)
    emb = nn.Embedding(50, 64, padding_idx=3)
    head = nn.Linear(64, 50, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
    quantize_head(model, bits=bits, group_size=group, symmetric=sym)
    e, table = model["embed_tokens"], model["lm_head"].dequantize_weight()
    for ids in (torch.tensor([0, 49, 3]), torch.randint(0, 50, (2, 3, 4)), torch.randint(0, 50, (4, 6))[:, ::2],
                torch.tensor(7), torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, dtype=torch.long)):
        out = e(ids)
        assert out.shape == (*ids.shape, 64) and torch.equal(out, table[ids])
    model.to(torch.bfloat16)
    assert e(torch.zeros(2, 0, dtype=torch.long)).dtype == torch.bfloat16
