"""The static Conv2d's fast lane (``kernels.lane.ConvLane``, session 48): once the conv plan's oneDNN call ran for an
input grid and shape, later calls on that grid and shape repeat the call with fewer checks. It must give the very codes
the full path gives (compared bit for bit with a twin module that never takes the lane, and with the generic
``onednn.conv``), keep ``kernels.counts`` as the full path keeps it, serve only what it was armed for, step aside when
the input grid, shape, qdtype or codes' dtype change or the layer's buffers do, and leave every error as it was.

The weights are full int8 where oneDNN runs VNNI and 7-bit (``saturation_safe``: one exact call without VNNI) where it
does not, so the planned route runs on AVX2-only machines, under ``ONEDNN_MAX_CPU_ISA=AVX2`` and on VNNI machines alike;
the comparisons are between routes of the same oneDNN call.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit import native
from lowbit.kernels import onednn
from lowbit.nn.quantized import Conv2d, ConvReLU2d

torch.set_num_threads(1)
KEY = ("onednn", "conv")

GEOMETRIES = [  # (c_in, c_out, kernel, stride, padding, dilation, groups)
    (8, 8, 3, 1, 1, 1, 1), (8, 16, 1, 1, 0, 1, 1), (8, 16, 3, 2, 1, 1, 1), (16, 16, 3, 1, 1, 1, 16),
    (16, 16, 3, 2, 1, 1, 16), (8, 12, 3, 1, 2, 2, 2), (3, 8, 3, 2, 1, 1, 1), (16, 32, 3, 1, 1, 1, 16)]


def _routes() -> None:
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")


def _layer(geo: tuple[Any, ...], relu: bool, seed: int, bias: bool = True, out_zp: int = 100,
           **kw: Any) -> Conv2d:
    c_in, c_out, k, stride, pad, dil, groups = geo
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if onednn.has_vnni() else (-64, 63)
    codes = torch.randint(lo, hi + 1, (c_out, c_in // groups, k, k), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(c_out, generator=g) / 50 + 1e-3, torch.zeros(c_out, dtype=torch.long), Q.qint8, 0)
    mod = (ConvReLU2d if relu else Conv2d)(c_in, c_out, k, stride, pad, dil, groups, bias=bias, **kw)
    mod.set_weight_bias(w, torch.randn(c_out, generator=g) if bias else None)
    mod.set_output_grid(0.05, out_zp, Q.quint8)
    return mod


def _input(c_in: int, batch: int, zp: int, channels_last: bool, seed: int, hw: tuple[int, int] = (9, 11),
           qd: Q.QDtype = Q.quint8) -> Q.QTensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(qd.quant_min, qd.quant_max + 1, (batch, c_in, *hw), generator=g).to(qd.storage)
    if channels_last:
        codes = codes.contiguous(memory_format=torch.channels_last)
    return Q.QTensor(codes, torch.tensor(0.02), torch.tensor(zp), qd)


def _twin(mod: Conv2d) -> Conv2d:
    """``mod``'s copy (its cache is never copied) that never takes the lane: the full path on every call."""
    twin = copy.deepcopy(mod)
    twin._lane_call = lambda x: None  # type: ignore[method-assign]
    return twin


def _laned(mod: Conv2d) -> bool:
    c = mod._cache.get("lane")
    return c is not None and c[0].armed()


class _NoFullPath:
    """Makes the module's plan raise while it is in place: only the lane may serve."""

    def __init__(self, mod: Conv2d) -> None:
        self.mod, self.hit = mod, mod._cache["plan"]

    def __enter__(self) -> None:
        def no_full_path(*_a: Any) -> None:
            raise AssertionError("the plan's run ran: the lane did not serve")
        self.mod._cache["plan"] = (*self.hit[:2], no_full_path, self.hit[3])

    def __exit__(self, *_a: Any) -> None:
        self.mod._cache["plan"] = self.hit


def _same(a: Q.QTensor, b: Q.QTensor) -> bool:
    return (torch.equal(a.int_repr(), b.int_repr()) and a.shape == b.shape and float(a.scale) == float(b.scale)
            and int(a.zero_point) == int(b.zero_point) and a.qdtype == b.qdtype)


def test_lane_serves_with_the_full_paths_codes_and_tallies() -> None:
    _routes()
    laned = 0
    grids = [(0, Q.quint8), (131, Q.quint8), (60, Q.quint8.with_range(0, 127))]
    cases = itertools.product(GEOMETRIES, [False, True], [1, 2, 3], grids, [True, False])
    for i, (geo, relu, batch, (zp, qd), cl) in enumerate(cases):
        mod = _layer(geo, relu, seed=i, bias=i % 3 != 0)
        twin = _twin(mod)
        x = _input(geo[0], batch, zp, cl, seed=100 + i, qd=qd)
        want = twin(x)
        assert _same(want, onednn.conv(x, *mod._prepared()[:1], mod.bias, mod._spec, mod._prepared()[1], relu, {}))
        for _ in range(2):  # the first call arms the lane, the second registers it
            assert _same(mod(x), want)
        if not _laned(mod):
            continue
        laned += 1
        before, nhwc = K.counts[KEY], native.counts["to_nhwc"]
        with _NoFullPath(mod):
            for _ in range(2):
                assert _same(mod(x), want), (geo, relu, batch, zp, cl)
        lane_calls, lane_nhwc = K.counts[KEY] - before, native.counts["to_nhwc"] - nhwc
        before, nhwc = K.counts[KEY], native.counts["to_nhwc"]
        twin(x), twin(x)  # the full path's tallies for the same two calls
        assert (lane_calls, lane_nhwc) == (K.counts[KEY] - before, native.counts["to_nhwc"] - nhwc) == (2, lane_nhwc)
    assert laned >= 250


def test_lane_layout_change_repeats_the_plans_layout_step() -> None:
    _routes()
    mod = _layer(GEOMETRIES[0], True, seed=1)
    twin = _twin(mod)
    x_cl = _input(8, 2, 131, True, seed=2)
    x_nchw = Q.QTensor._trusted(x_cl.int_repr().contiguous(), x_cl._scale, x_cl._zero_point, Q.quint8)
    for _ in range(2):
        mod(x_cl)
    assert _laned(mod)
    with _NoFullPath(mod):  # the same grid and shape in NCHW memory: served, codes copied to channels-last as run does
        n0 = native.counts["to_nhwc"]
        y = mod(x_nchw)
        n1 = native.counts["to_nhwc"]
        twin(x_nchw)
        assert native.counts["to_nhwc"] - n1 == n1 - n0
        assert _same(y, twin(x_nchw)) and _same(y, twin(x_cl))


def test_lane_not_armed_where_the_plan_does_not_make_the_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit padding (the module pads before the plan), a strided column (rewritten by ``onednn.conv``), the AMX
    chunks of a wide grouped conv (no plan), an s8 input grid: the lane never serves, the same codes."""
    _routes()
    cases: list[tuple[Conv2d, Q.QTensor]] = [
        (_layer((8, 8, 4, 1, "same", 1, 1), False, seed=3), _input(8, 2, 131, True, seed=4)),
        (_layer((8, 8, 3, 1, 1, 1, 1), True, seed=5, padding_mode="reflect"), _input(8, 2, 131, True, seed=6)),
        (_layer((9, 9, 4, 2, 0, 1, 9), False, seed=7), _input(9, 1, 131, True, seed=8, hw=(9, 5))),
        (_layer((8, 8, 4, 2, 0, 1, 1), False, seed=9), _input(8, 1, 131, True, seed=10, hw=(9, 5))),
        (_layer((8, 8, 3, 1, 1, 1, 1), True, seed=13), _input(8, 2, -7, True, seed=14, qd=Q.qint8)),
    ]
    monkeypatch.setattr(onednn, "has_amx", lambda: True)
    cases.append((_layer((8, 80, 3, 1, 1, 1, 2), True, seed=15), _input(8, 2, 131, True, seed=16)))
    from lowbit.kernels.lane import ConvLane

    served: list[bool] = []
    real = ConvLane.__call__

    def counted(lane: Any, x: Q.QTensor) -> Any:
        y = real(lane, x)
        served.append(y is not None)
        return y
    monkeypatch.setattr(ConvLane, "__call__", counted)
    for mod, x in cases:
        twin = _twin(mod)
        want = twin(x)
        for _ in range(3):
            assert _same(mod(x), want)
        assert not any(served), mod


def _armed_pair(relu: bool = True) -> tuple[Conv2d, Q.QTensor]:
    _routes()
    mod = _layer(GEOMETRIES[0], relu, seed=21)
    x = _input(8, 2, 131, True, seed=22)
    for _ in range(2):
        mod(x)
    assert _laned(mod)
    return mod, x


def _fresh(mod: Conv2d, x: Q.QTensor) -> Q.QTensor:
    twin = type(mod)(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                     mod.groups, bias=mod.bias is not None)
    twin.load_state_dict(mod.state_dict())
    twin.out_qdtype = mod.out_qdtype
    return twin(x)


def test_lane_steps_aside_for_an_input_grid_shape_or_dtype_it_was_not_armed_for() -> None:
    mod, x = _armed_pair()
    q, s, z = x.int_repr(), x._scale, x._zero_point
    other = [
        Q.QTensor(q, s, z, Q.quint8),  # the same values in new grid tensors (QTensor's views of them)
        Q.QTensor._trusted(q, s.clone(), z, Q.quint8),  # another scale tensor, same value
        Q.QTensor._trusted(q, torch.tensor(0.03), z, Q.quint8),  # another grid
        Q.QTensor._trusted(q, s, torch.tensor(5), Q.quint8),  # another zero point
        Q.QTensor._trusted(q, s, z, Q.quint8.with_range(0, 255)),  # an equal qdtype, not the same object
        Q.QTensor._trusted(q[:1], s, z, Q.quint8),  # another batch
        Q.QTensor._trusted(q[..., :7], s, z, Q.quint8),  # another width
        Q.QTensor._trusted(q.to(torch.int16), s, z, Q.quint8),  # the same grid, codes stored wider
    ]
    for y in other:
        assert mod._cache["lane"][0](y) is None  # the lane declines: the full path serves
        assert _same(mod(y), _fresh(mod, y))
    # an in-place change of the grid the lane was armed with (the versions move): the new grid's codes
    mod(x)
    with torch.no_grad():
        x.scale.mul_(1.5)
    assert mod._cache["lane"][0](x) is None
    assert _same(mod(x), _fresh(mod, x))
    with torch.no_grad():
        x.zero_point.sub_(3)
    assert mod._cache["lane"][0](x) is None
    assert _same(mod(x), _fresh(mod, x))


@pytest.mark.parametrize("edit", ["bias", "weight_scale", "scale", "zero_point", "weight_int8", "set_weight_bias",
                                  "load_state_dict", "set_output_grid"])
def test_lane_steps_aside_when_the_layer_changes(edit: str) -> None:
    mod, x = _armed_pair()
    lane = mod._cache["lane"]
    with torch.no_grad():
        if edit == "bias":
            mod.bias.add_(0.5)
        elif edit == "weight_scale":
            mod.weight_scale.mul_(1.7)
        elif edit == "scale":
            mod.scale.mul_(2.0)
        elif edit == "zero_point":
            mod.zero_point.sub_(7)
        elif edit == "weight_int8":
            mod.weight_int8.neg_()
        elif edit == "set_weight_bias":
            w = mod.weight()
            mod.set_weight_bias(Q.QTensor(w.int_repr().flip(0).clone(), w.scale, w.zero_point, Q.qint8, 0),
                                mod.bias.clone() - 1)
        elif edit == "load_state_dict":
            sd = {k: v.clone() for k, v in mod.state_dict().items()}
            sd["bias"] += 2.0
            mod.load_state_dict(sd)
        else:
            mod.set_output_grid(0.07, 3, Q.quint8)
    if "lane" in mod._cache and mod._cache["lane"] is lane:
        assert mod._lane_call(x) is None  # the module's checks refuse the stale lane
    y = mod(x)
    assert _same(y, _fresh(mod, x)), edit
    for _ in range(2):
        assert _same(mod(x), y)
    assert _laned(mod)  # re-armed for the new state


def test_lane_steps_aside_for_a_pinned_backend_and_the_errors_stay() -> None:
    mod, x = _armed_pair()
    want = mod(x)
    with K.use_backend("onednn"):
        assert mod._lane_call(x) is None
        assert _same(mod(x), want)
    # bad inputs after the lane is armed: the very errors of a fresh module
    q = x.int_repr()
    bad = [Q.QTensor(q[:, :4], x.scale, x.zero_point, Q.quint8),  # wrong channels
           Q.QTensor(q[..., :2, :2], x.scale, x.zero_point, Q.quint8),  # smaller than the window
           Q.QTensor(q[0, 0], x.scale, x.zero_point, Q.quint8),  # wrong rank
           Q.QTensor(q.to(torch.int8), torch.tensor(0.02), torch.tensor(0), Q.qint8, None),  # s8 grid: generic path
           Q.QTensor(q, torch.full((8,), 0.02), torch.zeros(8, dtype=torch.long), Q.quint8, 1)]  # per channel
    fresh = _layer(GEOMETRIES[0], True, seed=21)
    for b in bad:
        try:
            want_b: Any = fresh(b)
        except Exception as e:  # noqa: BLE001  (the error's type and message must match)
            want_b = e
        if isinstance(want_b, Exception):
            with pytest.raises(type(want_b)) as got:
                mod(b)
            assert str(got.value) == str(want_b)
        else:
            assert _same(mod(b), want_b)


def test_lane_unbatched_and_inference_mode() -> None:
    mod, x = _armed_pair()
    twin = _twin(mod)
    one = Q.QTensor(x.int_repr()[0], x.scale, x.zero_point, Q.quint8)
    assert _same(mod(one), twin(one))  # unbatched: the full path (its reshape), the same codes
    # grids held in inference tensors (a model run under inference_mode): the lane keys them by identity, as the plan
    with torch.inference_mode():
        xi = Q.QTensor(x.int_repr().clone(), torch.tensor(0.02), torch.tensor(131), Q.quint8)
        want = twin(xi)
        for _ in range(2):
            mod(xi)
        with _NoFullPath(mod):
            assert _same(mod(xi), want)
    # a layer whose buffers are inference tensors (converted under inference_mode): never laned (no versions)
    with torch.inference_mode():
        inf = _layer(GEOMETRIES[0], True, seed=21)
        for _ in range(3):
            assert _same(inf(x), twin(x))
    assert "lane" not in inf._cache


def test_lane_in_a_converted_cnn_gives_the_full_paths_outputs() -> None:
    """A chain of convs (each input the previous layer's output grid), a residual add and a pool: three forwards with
    the lanes give the outputs and the tallies of three without."""
    _routes()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.dq = Q.QuantStub(), Q.DeQuantStub()
            self.c1, self.r1 = torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.ReLU()
            self.c2, self.r2 = torch.nn.Conv2d(16, 16, 3, 1, 1, groups=16), torch.nn.ReLU()
            self.c3 = torch.nn.Conv2d(16, 16, 1)
            self.add = Q.nn.quantized.FloatFunctional()
            self.c4 = torch.nn.Conv2d(16, 8, 3, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.r1(self.c1(self.q(x)))
            h = self.add.add(h, self.c3(self.r2(self.c2(h))))
            return self.dq(self.c4(h))

    torch.manual_seed(0)
    m = Net().eval()
    m.qconfig = Q.get_default_qconfig()
    m = Q.fuse_modules(m, [["c1", "r1"], ["c2", "r2"]])
    Q.prepare(m, inplace=True)
    m(torch.randn(4, 3, 20, 20))
    m = Q.convert(m)
    off = copy.deepcopy(m)
    for mod in off.modules():
        if isinstance(mod, Conv2d):
            mod._lane_call = lambda x: None  # type: ignore[method-assign]
    x = torch.randn(2, 3, 20, 20)
    got, want = [], []
    c0 = dict(K.counts)
    for _ in range(3):
        got.append(m(x))
    c1 = dict(K.counts)
    for _ in range(3):
        want.append(off(x))
    c2 = dict(K.counts)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    keys = set(c0) | set(c1) | set(c2)
    assert {k: c1.get(k, 0) - c0.get(k, 0) for k in keys} == {k: c2.get(k, 0) - c1.get(k, 0) for k in keys}
    # (without VNNI this model's full int8 weights take the split: no plan, no lane)
    assert sum(_laned(mod) for mod in m.modules() if isinstance(mod, Conv2d)) >= (3 if onednn.has_vnni() else 0)


# (groups, in a group, out a group, kernel, stride, padding, H×W, batch, z_x): one call on 64 or 128 outputs a group
# gave codes off by 190-245 on the AMX Xeon (session 48's sweep: 17 of 79 random 64-wide and 13 of 48 128-wide grouped
# geometries wrong, 0 of 243 in 32-wide chunks)
WIDE_64_128 = [(8, 2, 64, (3, 3), 1, 1, (5, 11), 1, 128), (3, 2, 64, (3, 3), 1, 1, (6, 19), 8, 128),
               (3, 2, 128, (3, 3), 1, 1, (19, 11), 2, 128), (4, 5, 128, (3, 3), 2, 1, (18, 14), 5, 128)]


@pytest.mark.parametrize("case", WIDE_64_128)
def test_amx_chunks_of_64_or_128_outputs_a_group_stay_32_wide(case: tuple[Any, ...],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A pin (right on main): on the AMX route (pinned, any CPU) these grouped convs run in calls of at most 32 outputs a
    group and give the integer oracle's codes; with 64-wide calls (``MULTIPLIER_CHUNK = 64``) the AMX Xeon's codes were
    off by up to 245."""
    _routes()
    g, cpg, opg, k, st, pad, hw, n, zx = case
    monkeypatch.setattr(onednn, "has_amx", lambda: True)
    widths: list[int] = []
    real = onednn.conv

    def conv(x: Q.QTensor, weight: Q.QTensor, *a: Any) -> Any:
        widths.append(weight.shape[0] // g)
        return real(x, weight, *a)
    monkeypatch.setattr(onednn, "conv", conv)
    gen = torch.Generator().manual_seed(sum(hw) * opg)
    q = torch.randint(0, 256, (n, g * cpg, *hw), generator=gen, dtype=torch.uint8)
    wc = torch.randint(-128 if onednn.has_vnni() else -64, 128 if onednn.has_vnni() else 64,
                       (g * opg, cpg, *k), generator=gen, dtype=torch.int8)
    ref = torch.nn.functional.conv2d(q.double() - zx, wc.double(), None, st, pad, 1, g)
    s_y = float(ref.std()) / 30
    mod = Conv2d(g * cpg, g * opg, k, st, pad, 1, g, bias=False)
    mod.set_weight_bias(Q.QTensor(wc, torch.ones(g * opg), torch.zeros(g * opg, dtype=torch.long), Q.qint8, 0), None)
    mod.set_output_grid(s_y, 128, Q.quint8)
    y = mod(Q.QTensor(q.contiguous(memory_format=torch.channels_last), 1.0, zx, Q.quint8)).int_repr().double()
    want = (torch.round(ref / s_y) + 128).clamp(0, 255)
    assert float((y - want).abs().max()) <= 1  # (float32 epilogue against float64: ties may round apart)
    assert len(widths) > 1 and max(widths[1:]) <= 32  # (the first: the whole layer, which chunks)
