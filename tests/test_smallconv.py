"""``native.smallconv`` (a dense int8 conv with a small window in one pass) and its route (``kernels.conv_small``).

Its three C bodies (VNNI where the CPU has it, AVX2 pinned, scalar pinned) must give lowbit's conv epilogue of the exact
int32 sums, bit for bit, on every geometry it takes (strides, padding, dilation along H, NCHW / channels-last / strided
inputs, channel counts off the 16-lane blocks, ReLU floors and narrow grids, with and without bias), at 1 and 2
threads; the converted layer takes it on a small window (SmallCNN's first conv) in eager mode, in its plan and
compiled, with the generic path's codes; values it cannot take raise, tensors it cannot take decline.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import lowbit as Q
from lowbit import kernels, native
from lowbit.examples import SmallCNN
from lowbit.kernels import ConvSpec, OutGrid, conv_small, onednn

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")
BODIES = ["best", "avx2", "scalar"]


def _body(name: str) -> contextlib.AbstractContextManager[None]:
    if name == "avx2":
        return native.force_avx2()
    return native.force_scalar() if name == "scalar" else contextlib.nullcontext()


def _expected(q: torch.Tensor, zx: int, w: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
              scale: torch.Tensor, bias: torch.Tensor | None, inv: float, z: int, lo: int, hi: int) -> torch.Tensor:
    """lowbit's conv epilogue of the exact sums, in torch: ``clamp(round(fl(clamp(fl(fl(fl(acc) s) + b) inv, lo - z,
    hi - z) + z)), 0, 255)`` with ``acc = Σ (x - z_x) w`` (zero padding: centred 0), float64 sums (exact)."""
    acc = F.conv2d(q.double() - zx, w.double(), None, stride, padding, dilation).float()
    t = acc * scale.view(1, -1, 1, 1)
    if bias is not None:
        t = t + bias.view(1, -1, 1, 1)
    v = (t * torch.tensor(inv, dtype=torch.float32)).clamp(float(lo - z) if lo > 0 else -float("inf"),
                                                           float(hi - z) if hi < 255 else float("inf"))
    return (v + z).round().clamp(0, 255).to(torch.uint8)


CASES = [  # (cin, kh, kw, cout, n, h, w, stride, padding, dilation)
    (1, 3, 3, 16, 2, 9, 11, [1, 1], [1, 1], [1, 1]),    # SmallCNN's first conv
    (3, 3, 3, 32, 1, 15, 17, [2, 2], [1, 1], [1, 1]),   # an RGB stem, stride 2
    (1, 5, 5, 8, 2, 12, 10, [1, 2], [2, 0], [2, 1]),    # 5 wide: two quads a row, dilation along H
    (2, 2, 2, 20, 3, 6, 7, [2, 1], [0, 1], [1, 1]),     # channels off the 16-lane blocks
    (4, 1, 1, 1, 1, 5, 5, [1, 1], [0, 0], [1, 1]),      # 1x1, one output channel
    (1, 3, 4, 48, 1, 4, 4, [3, 3], [3, 2], [1, 1]),     # padding past the window, 3 blocks
]


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_smallconv_is_the_epilogue_of_exact_sums(body: str, case: int) -> None:
    cin, kh, kw, cout, n, h, w, stride, padding, dilation = CASES[case]
    g = torch.Generator().manual_seed(case)
    wt = torch.randint(-128, 128, (cout, cin, kh, kw), dtype=torch.int8, generator=g)
    wt[0, 0].fill_(-128)  # the extreme products
    packed = native.smallconv_weight(wt)
    base = torch.randint(0, 256, (n, cin, h, 2 * w), dtype=torch.uint8, generator=g)
    layouts = {"nchw": base[..., :w].contiguous(), "channels_last": base[..., :w].contiguous(memory_format=torch.channels_last),
               "strided": base[..., ::2]}
    scale = torch.rand(cout, generator=g) * 1e-3 + 1e-5
    before = torch.get_num_threads()
    try:
        for (name, q), (zx, z, lo, hi, with_bias) in zip(layouts.items(), [(0, 0, 0, 255, True), (255, 7, 7, 255, True),
                                                                          (131, 64, 0, 127, False)]):
            bias = torch.randn(cout, generator=g) * 3 if with_bias else None
            inv = float(torch.tensor(0.3 + case).reciprocal())
            want = _expected(q, zx, wt, stride, padding, dilation, scale, bias, inv, z, lo, hi)
            for nthreads in (1, 2):
                torch.set_num_threads(nthreads)
                with _body(body):
                    got = native.smallconv(q, zx, packed, stride, padding, dilation, scale, bias, inv, z, lo, hi)
                assert got is not None and got.is_contiguous(memory_format=torch.channels_last), name
                assert torch.equal(got, want), f"{name}, {nthreads} threads: {int((got != want).sum())} codes differ"
    finally:
        torch.set_num_threads(before)


@needs_native
def test_smallconv_splits_work_over_threads_with_the_same_codes() -> None:
    """A batch big enough to split over threads (each thread pads its own images) gives the one-thread codes."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (16, 1, 28, 28), dtype=torch.uint8, generator=g)
    wt = torch.randint(-128, 128, (16, 1, 3, 3), dtype=torch.int8, generator=g)
    args = ([1, 1], [1, 1], [1, 1], torch.rand(16, generator=g) * 1e-3, torch.randn(16, generator=g), 10.0, 3, 3, 255)
    packed = native.smallconv_weight(wt)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.smallconv(q, 17, packed, *args)
        torch.set_num_threads(2)
        two = native.smallconv(q, 17, packed, *args)
    finally:
        torch.set_num_threads(before)
    assert one is not None and torch.equal(one, two)
    assert torch.equal(one, _expected(q, 17, wt, *args))


@needs_native
def test_smallconv_declines_what_it_cannot_take() -> None:
    wt = torch.ones(16, 1, 3, 3, dtype=torch.int8)
    packed = native.smallconv_weight(wt)
    q = torch.zeros(1, 1, 6, 6, dtype=torch.uint8)
    s = torch.ones(16)
    geo = ([1, 1], [1, 1], [1, 1])
    assert native.smallconv(q, 0, packed, *geo, s, None, 1.0, 0, 0, 255) is not None
    assert native.smallconv(q, 0, packed, [1, 1], [1, 1], [1, 2], s, None, 1.0, 0, 0, 255) is None  # dilation along W
    assert native.smallconv(q.to(torch.int8), 0, packed, *geo, s, None, 1.0, 0, 0, 255) is None     # not u8 codes
    assert native.smallconv(torch.zeros(1, 2, 6, 6, dtype=torch.uint8), 0, packed, *geo, s, None, 1.0, 0, 0, 255) is None
    assert native.smallconv(q, 0, packed, *geo, s.double(), None, 1.0, 0, 0, 255) is None        # float64 scales
    assert native.smallconv(q, 0, packed, *geo, s, torch.ones(3), 1.0, 0, 0, 255) is None          # bias of 3
    assert native.smallconv(q[:0], 0, packed, *geo, s, None, 1.0, 0, 0, 255) is None               # empty batch
    assert native.smallconv(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), 0, packed, [1, 1], [0, 0], [1, 1], s, None, 1.0,
                            0, 0, 255) is None                                                     # window past the image


@needs_native
def test_smallconv_bad_values_raise_naming_them() -> None:
    packed = native.smallconv_weight(torch.ones(16, 1, 3, 3, dtype=torch.int8))
    q, s = torch.zeros(1, 1, 6, 6, dtype=torch.uint8), torch.ones(16)
    geo = ([1, 1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="zx=256"):
        native.smallconv(q, 256, packed, *geo, s, None, 1.0, 0, 0, 255)
    with pytest.raises(ValueError, match="zx=True"):
        native.smallconv(q, True, packed, *geo, s, None, 1.0, 0, 0, 255)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zx=2.5"):
        native.smallconv(q, 2.5, packed, *geo, s, None, 1.0, 0, 0, 255)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inv=nan"):
        native.smallconv(q, 0, packed, *geo, s, None, float("nan"), 0, 0, 255)
    with pytest.raises(ValueError, match="inv=-1.0"):
        native.smallconv(q, 0, packed, *geo, s, None, -1.0, 0, 0, 255)
    with pytest.raises(ValueError, match="zero_point=300"):
        native.smallconv(q, 0, packed, *geo, s, None, 1.0, 300, 0, 255)
    with pytest.raises(ValueError, match=r"stride=\[0, 1\]"):
        native.smallconv(q, 0, packed, [0, 1], [1, 1], [1, 1], s, None, 1.0, 0, 0, 255)
    with pytest.raises(ValueError, match=r"padding=\[-1, 0\]"):
        native.smallconv(q, 0, packed, [1, 1], [-1, 0], [1, 1], s, None, 1.0, 0, 0, 255)
    with pytest.raises(ValueError, match="6 \\* 3 \\* 3 is more than 64"):
        native.smallconv_weight(torch.ones(8, 6, 3, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="torch.float32 of shape"):
        native.smallconv_weight(torch.ones(8, 1, 3, 3))


def _small_cnn(n: int = 8) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups())
    prepared = Q.prepare(model, Q.get_default_qconfig())
    x = torch.randn(n, 1, 28, 28)
    prepared(x)
    return Q.convert(prepared), x


@needs_native
def test_small_cnn_first_conv_takes_the_native_pass_in_eager_plan_and_compiled() -> None:
    """The first conv (1 → 16, 3x3: 12 taps) runs ``native.smallconv``, counted as a oneDNN-backend conv (no fallback);
    the rest of the convs keep oneDNN. Eager (its plan), the generic dispatcher and the compiled model give one set of
    codes; against oneDNN's own call on the same codes the output may differ only at exact ties."""
    if native.smallconv_body() not in conv_small.SMALL_TAPS:
        pytest.skip(f"no AVX2 on this CPU: the native body is {native.smallconv_body()!r}, never routed")
    qm, x = _small_cnn()
    assert conv_small.takes(qm.conv1.weight(), ConvSpec(2, (1, 1), (1, 1), (1, 1), 1), OutGrid(0.1, 0, Q.quint8))
    assert not conv_small.takes(qm.conv2.weight(), ConvSpec(2, (1, 1), (1, 1), (1, 1), 1), OutGrid(0.1, 0, Q.quint8))
    with torch.inference_mode():
        before, conv_before = native.counts["smallconv"], kernels.counts[("onednn", "conv")]
        eager = qm(x)
        assert native.counts["smallconv"] == before + 1
        assert kernels.counts[("onednn", "conv")] == conv_before + 3
        xq = qm.quant(x)
        plan = qm.conv1(xq)
        generic = kernels.conv(xq, qm.conv1.weight(), qm.conv1.bias, ConvSpec(2, (1, 1), (1, 1), (1, 1), 1),
                               OutGrid(float(qm.conv1.scale), int(qm.conv1.zero_point), Q.quint8), relu=True)
        assert torch.equal(plan.int_repr(), generic.int_repr())
        compiled = torch.compile(qm, fullgraph=True)(x)
        assert torch.equal(eager, compiled)


@needs_native
def test_small_window_codes_match_onednn_but_at_ties() -> None:
    """Against oneDNN's call on the same codes and grids (where oneDNN is built; weights oneDNN is exact for on this
    CPU): at most one code apart, and on a vanishing share of the outputs (exact float ties of ``fl(y inv) + z``)."""
    if not onednn.available():
        pytest.skip("oneDNN is not built into this torch")
    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 256, (8, 3, 40, 40), dtype=torch.uint8, generator=g)
    # without VNNI oneDNN's u8 x s8 pairs saturate for full-range weights: there it gets saturation-safe ones
    lim = 128 if onednn.has_vnni() else 64
    wt = torch.randint(-lim, lim, (32, 3, 3, 3), dtype=torch.int8, generator=g)
    sw, sx, zx = (torch.rand(32, generator=g) * 1e-3 + 1e-5), 0.02, 9
    bias, s_out, z_out = torch.randn(32, generator=g), 0.07, 4
    packed = torch.ops.onednn.qconv_prepack(wt, sw, 1.0, zx, [1, 1], [1, 1], [1, 1], 1, list(q.shape))
    ref = torch.ops.onednn.qconv_pointwise(q.contiguous(memory_format=torch.channels_last), sx, zx, packed, sw,
                                           torch.zeros(32, dtype=torch.long), bias, [1, 1], [1, 1], [1, 1], 1, s_out,
                                           z_out, torch.uint8, "none", [], "")
    inv = float(torch.tensor(s_out, dtype=torch.float32).reciprocal())
    got = native.smallconv(q, zx, native.smallconv_weight(wt), [1, 1], [1, 1], [1, 1], sw * sx, bias, inv, z_out, 0, 255)
    d = (got.int() - ref.int()).abs()
    assert int(d.max()) <= 1 and int((d > 0).sum()) <= d.numel() * 1e-5


@needs_native
@pytest.mark.parametrize("body", BODIES)
def test_small_window_codes_are_the_split_weight_convs(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI (forced) a dense conv's 8-bit codes take oneDNN's weight split and lowbit's epilogue in torch ops
    (native passes off); the native small-window pass gives the same codes, in each body."""
    from helpers import force

    force(monkeypatch, vnni=False, fbgemm=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 21, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(21, 8, 1)).eval()
    qmodel, _ = Q.quantize_ptq(model, [torch.randn(4, 3, 12, 12) for _ in range(3)], recipe="default")
    x = torch.randn(5, 3, 12, 12)
    with native.disabled():
        ref = qmodel(x)
    before = native.counts["smallconv"]
    with _body(body):
        got = qmodel(x)
    # 36 taps: VNNI's window, and AVX2's where the weights would be split (these full-range ones)
    assert not onednn.saturation_safe(qmodel.get_submodule("0").weight().int_repr())
    assert native.counts["smallconv"] == before + (native.smallconv_body() in conv_small.SMALL_TAPS)
    assert torch.equal(got, ref)


def test_narrow_or_wide_windows_keep_onednn() -> None:
    """A window narrower than 3 taps (a 1x1 conv pads each row to a quad: mostly zero products) or past the CPU's tap
    limit, a grouped or transposed conv, a weight with zero points, a float output: not routed."""
    grid = OutGrid(0.1, 0, Q.quint8)
    spec = ConvSpec(2, (1, 1), (0, 0), (1, 1), 1)

    def weight(shape: tuple[int, ...], zp: int = 0) -> Q.QTensor:
        return Q.QTensor(torch.ones(shape, dtype=torch.int8), torch.full((shape[0],), 0.01),
                         torch.full((shape[0],), zp, dtype=torch.long), Q.qint8, 0)

    assert not conv_small.takes(weight((96, 16, 1, 1)), spec, grid)      # MobileNetV2's 16 -> 96 expand
    assert not conv_small.takes(weight((8, 2, 3, 2)), spec, grid)
    assert not conv_small.takes(weight((8, 8, 3, 3)), spec, grid)        # 96 taps
    assert not conv_small.takes(weight((8, 1, 3, 3)), ConvSpec(2, (1, 1), (1, 1), (1, 1), 2), grid)
    assert not conv_small.takes(weight((8, 1, 3, 3), zp=1), spec, grid)
    assert not conv_small.takes(weight((8, 1, 3, 3)), spec, None)
    assert not conv_small.takes(weight((8, 1, 3, 3)), ConvSpec(2, (1, 1), (1, 1), (1, 2), 1), grid)  # dilation along W
    assert conv_small.takes(weight((8, 1, 3, 3)), spec, grid) == (native.smallconv_body() in conv_small.SMALL_TAPS)
    # 36 taps: on VNNI; without, only where the weights would take the split (two oneDNN calls)
    assert conv_small.takes(weight((8, 3, 3, 3)), spec, grid) == (native.smallconv_body() == "vnni")
    assert conv_small.takes(weight((8, 3, 3, 3)), spec, grid, split=True) == (native.smallconv_body() in conv_small.SMALL_TAPS)


@needs_native
def test_per_tensor_weights_and_signed_inputs_through_the_dispatcher() -> None:
    """``kernels.conv`` on a per-tensor weight grid (one scale for every channel) and on qint8 activation codes (shifted
    to u8 by the backend) takes the native pass where routed, with the epilogue of the exact sums."""
    if native.smallconv_body() not in conv_small.SMALL_TAPS:
        pytest.skip("no AVX2 on this CPU: the small-window pass is never routed")
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (20, 1, 3, 3), dtype=torch.int8, generator=g)
    w = Q.QTensor(codes, torch.tensor(0.004), torch.tensor(0), Q.qint8)
    bias = torch.randn(20, generator=g)
    spec, out = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1), OutGrid(0.25, 11, Q.quint8)
    for qd, zp in ((Q.quint8, 77), (Q.qint8, -5)):
        xq = Q.QTensor(torch.randint(qd.quant_min, qd.quant_max + 1, (3, 1, 10, 9), generator=g).to(qd.storage),
                       torch.tensor(0.03), torch.tensor(zp), qd)
        before = native.counts["smallconv"]
        y = kernels.conv(xq, w, bias, spec, out, relu=False)
        assert native.counts["smallconv"] == before + 1
        u8 = xq.int_repr().to(torch.int16) + (128 if qd is Q.qint8 else 0)  # the backend's u8 shift of int8 codes
        want = _expected(u8.to(torch.uint8), zp + (128 if qd is Q.qint8 else 0), codes, [1, 1], [1, 1], [1, 1],
                         torch.full((20,), 0.004) * 0.03, bias, float(torch.tensor(0.25).reciprocal()), 11, 0, 255)
        assert torch.equal(y.int_repr(), want)


@pytest.mark.parametrize("body", ["vnni", "avx2", "scalar", ""])
def test_route_limits_per_body(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's tap limits for each body a CPU may run, pinned (a VNNI machine and an AVX2-only one take different
    windows): VNNI up to 64 taps; AVX2 up to 16, or 64 where the weights would be split; scalar or no build never."""
    monkeypatch.setattr(native, "smallconv_body", lambda: body)
    grid, spec = OutGrid(0.1, 0, Q.quint8), ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)

    def w(cin: int, k: int) -> Q.QTensor:
        return Q.QTensor(torch.ones(16, cin, k, k, dtype=torch.int8), torch.full((16,), 0.01),
                         torch.zeros(16, dtype=torch.long), Q.qint8, 0)

    for cin, k, split, want in [(1, 3, False, {"vnni", "avx2"}), (3, 3, False, {"vnni"}), (3, 3, True, {"vnni", "avx2"}),
                                (4, 4, True, {"vnni", "avx2"}), (6, 3, True, set()), (1, 5, False, {"vnni"})]:
        assert conv_small.takes(w(cin, k), spec, grid, split) == (body in want), (cin, k, split, body)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_set_weight_bias_rejects_non_finite_biases(bad: float) -> None:
    """A converted layer's ``set_weight_bias`` refuses a NaN / Inf bias naming how many (``load_state_dict`` and
    ``from_float`` already did): every kernel, the small-window pass included, would turn it into wrong codes."""
    qm, _ = _small_cnn(2)
    for layer in (qm.conv1, qm.fc1):
        bias = layer.bias.clone()
        bias[0] = bad
        before = layer.bias.clone()
        with pytest.raises(ValueError, match=r"the bias holds 1 NaN/Inf value"):
            layer.set_weight_bias(layer.weight(), bias)
        assert torch.equal(layer.bias, before)  # nothing stored
