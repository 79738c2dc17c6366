"""Session 51 (#10 at 2 threads, serial per-call work): the small first conv's lane.

A first conv that ``kernels.conv_small`` runs natively (``native.smallconv``: SmallCNN's ``1 → 16`` 3x3) had no lane, so
its eager module ran the plan on every call and the compiled ``lowbit::qconv_cfg`` ran its full body (``checked_weight``,
``check_conv``, the plan key, ``conv_small.conv``, ``native.smallconv``'s argument checks) on every call: the fast entry
arms only after a lane-served call. Now the plan arms a ``ConvLane`` without the layout step whose call is the same pass
with its arguments converted once per input grid (``native.smallconv_prepared``). Pinned here: the codes (eager with and
without the lane, compiled, exported and reloaded: bit-identical), the lane and the fast entry serving, the tallies, and
the per-call switches (a pinned backend, ``native.disabled()``) still taken. Also: the compiled pool op hands its window
straight to ``native.maxpool_codes``, and ``lowbit::qfunctional``'s add keeps an armed entry (the pass's numbers by
the six grid tensors' identities and versions) that skips its body's checks and wraps.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit import kernels, native
from lowbit.kernels import conv_small, onednn
from lowbit.nn.quantized import Conv2d, ConvReLU2d
from lowbit.pt2 import kernel_ops

from helpers import converted_smallcnn


def _routes() -> None:
    if not onednn.available() or not native.available() or not native.smallconv_body():
        pytest.skip("oneDNN int8 ops or lowbit.native's small conv not available here")


def _layer(c_in: int, c_out: int, k: int, stride: int, pad: int, relu: bool, seed: int, out_zp: int = 100) -> Conv2d:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if onednn.has_vnni() else (-64, 63)
    codes = torch.randint(lo, hi + 1, (c_out, c_in, k, k), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(c_out, generator=g) / 50 + 1e-3, torch.zeros(c_out, dtype=torch.long), Q.qint8, 0)
    mod = (ConvReLU2d if relu else Conv2d)(c_in, c_out, k, stride, pad, bias=True)
    mod.set_weight_bias(w, torch.randn(c_out, generator=g))
    mod.set_output_grid(0.05, out_zp, Q.quint8)
    return mod


def _input(c_in: int, batch: int, zp: int, seed: int, hw: tuple[int, int] = (12, 13), cl: bool = False) -> Q.QTensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (batch, c_in, *hw), generator=g).to(torch.uint8)
    if cl:
        codes = codes.contiguous(memory_format=torch.channels_last)
    return Q.QTensor(codes, torch.tensor(0.02), torch.tensor(zp), Q.quint8)


def _twin(mod: Conv2d) -> Conv2d:
    """``mod``'s copy that never takes the lane: the plan's run on every call (the path before this session)."""
    twin = copy.deepcopy(mod)
    twin._lane_call = lambda x: None  # type: ignore[method-assign]
    return twin


GEOMETRIES = [(1, 16, 3, 1, 1, True, 0), (1, 16, 3, 2, 0, False, 131), (1, 8, 3, 1, 1, False, 255),
              (1, 24, 3, 1, 0, True, 7)]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: f"{g[0]}-{g[1]}k{g[2]}s{g[3]}p{g[4]}")
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "cl"])
def test_small_conv_lane_serves_with_the_full_paths_codes(geo: tuple[Any, ...], cl: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first call the lane serves (``conv_small.conv`` no longer runs), with the full path's codes, layout,
    grid and tallies. Failed before: no lane, ``conv_small.conv`` ran on every call."""
    _routes()
    c_in, c_out, k, stride, pad, relu, zx = geo
    mod = _layer(c_in, c_out, k, stride, pad, relu, seed=c_out + zx)
    twin = _twin(mod)
    x = _input(c_in, 3, zx, seed=zx, cl=cl)
    runs: list[int] = []
    real = conv_small.conv
    monkeypatch.setattr(conv_small, "conv", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    for _ in range(4):
        want = twin(x)
        before_k, before_n = kernels.counts[("onednn", "conv")], native.counts["smallconv"]
        y = mod(x)
        assert torch.equal(y.int_repr(), want.int_repr()) and y.int_repr().stride() == want.int_repr().stride()
        assert y.scale == want.scale and y.zero_point == want.zero_point and y.dtype == want.dtype
        assert kernels.counts[("onednn", "conv")] - before_k == 1 and native.counts["smallconv"] - before_n == 1
    # the small pass's route: the module's first two calls (the second installs the armed lane, as for oneDNN's) and the
    # twin's four; the lane served calls 3 and 4 (before: 8)
    assert len(runs) == 2 + 4


def test_small_conv_lane_steps_aside_for_another_grid_shape_or_weight() -> None:
    """Another input grid object, another shape, a weight written in place: the full path serves, with its codes (a
    pin of the lane's terms for the small conv: they are the oneDNN lane's)."""
    _routes()
    mod = _layer(1, 16, 3, 1, 1, True, seed=1)
    x = _input(1, 2, 3, seed=2)
    for _ in range(2):
        mod(x)
    lane = mod._cache["lane"][0]
    served: list[bool] = []

    def spy(x: Q.QTensor) -> Any:
        y = lane(x)
        served.append(y is not None)
        return y
    mod._cache["lane"] = (spy, *mod._cache["lane"][1:])
    other = [Q.QTensor(x.int_repr(), torch.tensor(0.02), torch.tensor(3), Q.quint8), _input(1, 2, 3, seed=3, hw=(9, 9)),
             _input(1, 5, 3, seed=4)]
    for xi in other:
        assert torch.equal(mod(xi).int_repr(), _twin(mod)(xi).int_repr())
    assert served == [False, False, False]
    with torch.no_grad():
        mod.weight_int8.neg_()
    assert torch.equal(mod(x).int_repr(), _twin(mod)(x).int_repr())


def test_prepared_smallconv_is_smallconv() -> None:
    """``native.smallconv_prepared``'s run gives ``native.smallconv``'s codes on every body, any strides, and declines
    what it declines (new; failed before: no such function)."""
    _routes()
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (24, 1, 3, 3), generator=g, dtype=torch.int8)
    packed = native.smallconv_weight(w)
    scale, bias = torch.rand(24, generator=g) / 100 + 1e-4, torch.randn(24, generator=g)
    args = ([2, 1], [1, 0], [1, 1], scale, bias, 9.5, 100, 100, 255)
    run = native.smallconv_prepared(17, packed, *args)
    q = torch.randint(0, 256, (3, 1, 11, 10), generator=g).to(torch.uint8)
    for body in (native.force_scalar, native.force_avx2, None):
        with body() if body is not None else contextlib.nullcontext():
            for xq in (q, q.contiguous(memory_format=torch.channels_last), q[:, :, 1:, :]):
                want = native.smallconv(xq, 17, packed, *args)
                assert want is not None and torch.equal(run(xq), want) and run(xq).stride() == want.stride()
    assert run(q.to(torch.int8)) is None and run(torch.zeros(2, 2, 5, 5, dtype=torch.uint8)) is None
    with native.disabled():
        assert run(q) is None
    with pytest.raises(ValueError, match="zero point zx=300"):
        native.smallconv_prepared(300, packed, *args)
    assert native.smallconv_prepared(17, packed, [1, 1], [0, 0], [1, 1], scale[:8], None, 9.5, 0, 0, 255) is None


@pytest.fixture(scope="module")
def smallcnn() -> tuple[torch.nn.Module, torch.Tensor]:
    return converted_smallcnn(16)


def test_compiled_smallcnn_first_conv_takes_the_fast_entry(smallcnn: tuple[torch.nn.Module, torch.Tensor],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled SmallCNN's first conv (the small native pass) is served by ``qconv_cfg``'s fast entry after its
    warm-up calls: its full body no longer runs; outputs bit-identical to eager, tallies as eager's. Failed before: the
    full body ran on every call (no lane, so no entry)."""
    _routes()
    m, x = smallcnn
    torch._dynamo.reset()
    c = torch.compile(copy.deepcopy(m), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        want = m(x)
        for _ in range(3):
            c(x)
        full: list[str] = []
        real = kernel_ops._qconv
        # (the first conv's full body: its weight reads one input channel; the others may run theirs where this CPU
        # takes no oneDNN lane for them: the split routes without VNNI)
        monkeypatch.setattr(kernel_ops, "_qconv",
                            lambda op, *a, **kw: full.extend([op] if a[4].shape[1] == 1 else []) or real(op, *a, **kw))
        for _ in range(3):
            before_k, before_n = kernels.counts[("onednn", "conv")], native.counts["smallconv"]
            assert torch.equal(c(x), want)
            assert kernels.counts[("onednn", "conv")] - before_k == 3 and native.counts["smallconv"] - before_n == 1
    assert full == []


def test_compiled_smallcnn_pinned_backend_and_native_switch_still_taken(
        smallcnn: tuple[torch.nn.Module, torch.Tensor]) -> None:
    """A pinned backend (``kernels.use_backend``) and ``native.disabled()`` are read per call past the armed entry:
    the reference backend's tally, and the oneDNN route without the small pass, each with eager's outputs under the
    same switch (a pin: the fast entry checks the backend, the prepared pass the native switch)."""
    _routes()
    m, x = smallcnn
    torch._dynamo.reset()
    c = torch.compile(copy.deepcopy(m), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for _ in range(3):
            c(x)
        with kernels.use_backend("reference"):
            want = m(x)
            before = kernels.counts[("reference", "conv")]
            assert torch.equal(c(x), want) and kernels.counts[("reference", "conv")] - before == 3  # (the three convs)
        with native.disabled():
            want = m(x)
            before = native.counts["smallconv"]
            assert torch.equal(c(x), want) and native.counts["smallconv"] == before
        assert torch.equal(c(x), m(x))


def test_exported_smallcnn_saved_and_loaded_is_eager(smallcnn: tuple[torch.nn.Module, torch.Tensor]) -> None:
    """``torch.export`` (dynamic batch) -> save -> load: eager's outputs, also after the loaded program's lanes armed
    (a pin: no op schema changed)."""
    _routes()
    m, x = smallcnn
    with torch.inference_mode():
        want = m(x)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(copy.deepcopy(m), (x,), dynamic_shapes=({0: batch},))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(loaded(x), want)
        assert torch.equal(loaded(x[:5]), m(x[:5]))


def test_compiled_pool_op_runs_the_native_pass_directly(smallcnn: tuple[torch.nn.Module, torch.Tensor],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``lowbit::max_pool2d_codes`` hands its window straight to ``native.maxpool_codes`` (``qtensor.pool``'s argument
    parsing skipped): eager's outputs and the pass's tally. Failed before: every call went through
    ``qtensor.pool.max_pool2d_codes``."""
    _routes()
    from lowbit.pt2 import module_ops
    m, x = smallcnn
    torch._dynamo.reset()
    c = torch.compile(copy.deepcopy(m), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        want = m(x)
        c(x)
        parsed: list[int] = []
        real = module_ops.max_pool2d_codes
        monkeypatch.setattr(module_ops, "max_pool2d_codes", lambda *a: parsed.append(1) or real(*a))
        before = native.counts["maxpool"]
        assert torch.equal(c(x), want) and native.counts["maxpool"] - before == 2
        assert parsed == []
        with native.disabled():  # (no pass: the parsed path's torch pooling, the same codes)
            assert torch.equal(c(x), m(x)) and len(parsed) == 2


def test_pool_op_refuses_what_it_refused() -> None:
    """A window past 16 taps, an NCHW input: the op's errors as before; a 2x2 window: its maxima (a pin)."""
    _routes()
    q = torch.randint(0, 256, (2, 4, 10, 10), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="is not covered"):
        torch.ops.lowbit.max_pool2d_codes(q, [5, 5], [5, 5])
    with pytest.raises(ValueError, match="is not covered"):
        torch.ops.lowbit.max_pool2d_codes(q.contiguous(), [2, 2], [2, 2])
    y = torch.ops.lowbit.max_pool2d_codes(q, [2, 2], [2, 2])
    assert torch.equal(y, q.reshape(2, 4, 5, 2, 5, 2).amax((3, 5))) and y.is_contiguous(memory_format=torch.channels_last)


def _add_args(relu: bool = True, shape: tuple[int, ...] = (4, 8, 6, 6), seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    qa = torch.randint(0, 256, shape, generator=g).to(torch.uint8).contiguous(memory_format=torch.channels_last)
    qb = torch.randint(0, 256, shape, generator=g).to(torch.uint8).contiguous(memory_format=torch.channels_last)
    return ["add_relu" if relu else "add", qa, torch.tensor(0.031), torch.tensor(120), "quint8:0:255", qb,
            torch.tensor(0.027), torch.tensor(131), "quint8:0:255", 0.0, torch.tensor(0.05), torch.tensor(7),
            "quint8:0:255"]


def _eager_add(args: list[Any]) -> torch.Tensor:
    """The codes of ``QFunctional``'s eager add on the op's grids."""
    op, qa, sa, za, _, qb, sb, zb, _, _, s, z, _ = args
    f = Q.nn.quantized.QFunctional()
    f.scale, f.zero_point = s.clone(), z.clone()
    xa, xb = Q.QTensor(qa, float(sa), int(za), Q.quint8), Q.QTensor(qb, float(sb), int(zb), Q.quint8)
    return (f.add_relu(xa, xb) if op == "add_relu" else f.add(xa, xb)).int_repr()


@pytest.mark.parametrize("relu", [True, False])
def test_qfunctional_add_takes_its_armed_entry(relu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a call the native pass served, ``lowbit::qfunctional``'s add hands the codes straight to the pass (the
    body's checks, wraps and memo key skipped): eager's codes and layout, one ``qadd`` tally a call. Failed before:
    the body (``_Grid._eager_add*``) ran on every call."""
    _routes()
    from lowbit.pt2 import module_ops
    args = _add_args(relu)
    want = _eager_add(args)
    body: list[int] = []
    name = "_eager_add_relu" if relu else "_eager_add"
    real = getattr(module_ops._Grid, name)
    monkeypatch.setattr(module_ops._Grid, name, lambda self, *a: body.append(1) or real(self, *a))
    for _ in range(3):
        before = native.counts["qadd"]
        y = torch.ops.lowbit.qfunctional(*args)
        assert torch.equal(y, want) and y.stride() == want.stride() and native.counts["qadd"] - before == 1
    assert len(body) == 1


def test_qfunctional_add_entry_steps_aside() -> None:
    """Another grid object, an in-place write of a grid, a ``.data`` swap to two values, other codes' dtype or shape,
    NCHW and channels-last operands mixed: the body runs, with its codes or its error (a pin of the entry's terms)."""
    _routes()
    args = _add_args(seed=1)
    torch.ops.lowbit.qfunctional(*args)
    torch.ops.lowbit.qfunctional(*args)
    other = list(args)
    other[10] = torch.tensor(0.05)  # (the same value, another object)
    assert torch.equal(torch.ops.lowbit.qfunctional(*other), _eager_add(other))
    args[2].mul_(1.5)  # (the x scale written in place: the numbers read again)
    assert torch.equal(torch.ops.lowbit.qfunctional(*args), _eager_add(args))
    mixed = list(args)
    mixed[5] = args[5].contiguous()
    assert torch.equal(torch.ops.lowbit.qfunctional(*mixed), _eager_add(mixed))
    small = _add_args(seed=1, shape=(2, 8, 6, 6))
    small[2], small[3], small[6], small[7], small[10], small[11] = args[2], args[3], args[6], args[7], args[10], args[11]
    assert torch.equal(torch.ops.lowbit.qfunctional(*small), _eager_add(small))
    bad = list(args)
    bad[1] = args[1].to(torch.int8)
    with pytest.raises(TypeError, match="x must hold torch.uint8 codes"):
        torch.ops.lowbit.qfunctional(*bad)
    args[10].data = torch.tensor([0.05, 0.06])  # (no version bump: the numel check)
    with pytest.raises(ValueError):
        torch.ops.lowbit.qfunctional(*args)
