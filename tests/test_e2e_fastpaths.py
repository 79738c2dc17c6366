"""Eager fast paths of the end-to-end glue (issue #10): each is checked code for code against the plain path
it replaces — 2-d max pooling of channels-last codes (oracle: torch's quantized ``max_pool2d``) and
``QFunctional.add``/``add_relu`` through fbgemm's dequantization (oracle: the float32 formula of
``functional_modules._scaled_sum``)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q
from lowbit import native
from lowbit.nn.quantized import functional_modules as fm
from lowbit.qtensor.pool import as_torch_quantized, max_pool2d_codes

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")


def codes(shape, dtype, seed, channels_last=True):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    q = torch.randint(lo, hi, shape, dtype=dtype, generator=g)
    return q.contiguous(memory_format=torch.channels_last) if channels_last else q


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 24), h=st.integers(1, 13), w=st.integers(1, 13), k=st.integers(1, 4),
       s=st.integers(1, 4), signed=st.booleans(), seed=st.integers(0, 2**16))
def test_max_pool2d_codes_match_torch_quantized(n, c, h, w, k, s, signed, seed):
    dtype = torch.int8 if signed else torch.uint8
    q = codes((n, c, h, w), dtype, seed)
    if k > h or k > w:
        assert max_pool2d_codes(q, k, s) is None
        return
    ours = max_pool2d_codes(q, k, s)
    assert ours is not None and ours.is_contiguous(memory_format=torch.channels_last)
    ref = F.max_pool2d(as_torch_quantized(q), k, s).int_repr()
    assert torch.equal(ours, ref)
    qt = Q.QTensor(q, 0.1, 3 if not signed else 0, Q.qint8 if signed else Q.quint8)
    assert torch.equal(torch.nn.MaxPool2d(k, s)(qt).int_repr(), ref)  # the QTensor op takes the same path


def test_max_pool2d_codes_declines_what_it_does_not_cover():
    q = codes((2, 4, 8, 8), torch.uint8, 0)
    assert max_pool2d_codes(q.contiguous(), 2) is None            # NCHW: torch's quantized kernel instead
    assert max_pool2d_codes(q, 2, 2, padding=1) is None
    assert max_pool2d_codes(q, 2, 2, dilation=2) is None
    assert max_pool2d_codes(q, 2, 2, ceil_mode=True) is None
    qt = Q.QTensor(q, 0.1, 0, Q.quint8)
    for kw in ({"padding": 1}, {"dilation": 2}, {"ceil_mode": True}):  # still exact through the other paths
        ref = F.max_pool2d(as_torch_quantized(q), 3, 2, **kw).int_repr()
        assert torch.equal(F.max_pool2d(qt, 3, 2, **kw).int_repr(), ref)


GRIDS = [Q.quint8, Q.qint8, Q.quint8.with_range(0, 127)]


@settings(max_examples=60, deadline=None)
@given(grid_in=st.sampled_from([Q.quint8, Q.qint8]), grid_out=st.sampled_from(GRIDS), relu=st.booleans(),
       sa=st.floats(1e-4, 1.0), sb=st.floats(1e-4, 1.0), so=st.floats(1e-4, 1.0), za=st.integers(0, 255),
       zb=st.integers(0, 255), zo=st.integers(0, 127), tie=st.sampled_from([None, 0.5, 2.0]),
       channels_last=st.booleans(), seed=st.integers(0, 2**16))
def test_fast_add_is_bit_identical_to_the_float32_formula(grid_in, grid_out, relu, sa, sb, so, za, zb, zo, tie,
                                                           channels_last, seed):
    if grid_in is Q.qint8:
        za, zb = za - 128, zb - 128
    if grid_out.storage == torch.int8:
        zo -= 64
    if tie is not None:  # output scale a simple multiple of an input scale: many exact .5 ties
        so = sa * tie
    shape = (3, 5, 7, 6)
    store = grid_in.storage
    qa = Q.QTensor(codes(shape, store, seed, channels_last), sa, za, grid_in)
    qb = Q.QTensor(codes(shape, store, seed + 1, channels_last), sb, zb, grid_in)
    m = fm.QFunctional(so, zo, grid_out)
    fast = fm._fast_add(qa, qb, m.scale, m.zero_point, m.qdtype, relu)
    assert fast is not None
    slow = m._binary(qa, qb, "add", fm._scaled_sum, torch.add, relu=relu)
    assert torch.equal(fast.int_repr(), slow.int_repr())
    assert (fast.q_scale(), fast.q_zero_point(), fast.qdtype) == (slow.q_scale(), slow.q_zero_point(), slow.qdtype)
    assert torch.equal((m.add_relu if relu else m.add)(qa, qb).int_repr(), slow.int_repr())


def test_fast_add_declines_broadcast_and_per_channel():
    qa = Q.quantize_per_tensor(torch.randn(2, 3, 4), 0.05, 128, Q.quint8)
    qb = Q.quantize_per_tensor(torch.randn(3, 4), 0.05, 128, Q.quint8)
    m = fm.QFunctional(0.1, 128)
    assert fm._fast_add(qa, qb, m.scale, m.zero_point, m.qdtype, False) is None
    pc = Q.quantize_per_channel(torch.randn(2, 3, 4), torch.full((2,), 0.05), torch.full((2,), 128), 0, Q.quint8)
    assert fm._fast_add(pc, qa, m.scale, m.zero_point, m.qdtype, False) is None
    expect = Q.quantize_per_tensor(qa.dequantize() + qb.dequantize(), 0.1, 128, Q.quint8).int_repr()
    assert (m.add(qa, qb).int_repr().int() - expect.int()).abs().max() <= 1


@settings(max_examples=300, deadline=None)
@given(*[st.floats(2.0 ** -100, 2.0 ** 100, width=32)] * 3)
def test_add_numbers_are_the_float32_quotients(sa, sb, so):
    """``_add_numbers`` divides the scales as Python floats and rounds to float32: the float32 tensor quotient
    ``_scaled_sum`` multiplies by, bit for bit (no double-rounding error for a quotient of float32 values); a
    quotient past float32's range (or a zero) gives ``None`` (the plain path runs)."""
    qa = Q.QTensor(torch.zeros(2, dtype=torch.uint8), sa, 3, Q.quint8)
    qb = Q.QTensor(torch.zeros(2, dtype=torch.uint8), sb, 5, Q.quint8)
    s = torch.tensor(so, dtype=torch.float32)
    got = fm._add_numbers(qa, qb, s, torch.tensor(7), Q.quint8, False)
    ka, kb = float(qa.scale / s), float(qb.scale / s)
    if not all(0 < k < float("inf") for k in (ka, kb)):
        assert got is None
    else:
        assert got == (ka, kb, 3, 5, 7, 0, 255)


@pytest.mark.parametrize("built", [True, False])
def test_traced_glue_ops_on_codes(built):
    """Traced (export here; torch.compile takes the same path), SmallCNN's glue stays on the 8-bit codes: 2-d max
    pooling is the opaque ``lowbit::max_pool2d_codes`` (no float ``max_pool2d``; opaque since session 17), the
    flatten of channels-last codes the opaque ``lowbit::contiguous_codes`` (no ``aten.clone``: inductor's copy was a
    scalar gather); the skip add and the Quantize stub are the opaque ``lowbit::qfunctional`` and
    ``lowbit::quantize_codes`` (eager's native one-pass add and quantize) where ``lowbit.native`` is built, else
    aten float32 ops in eager's order. The program gives eager's codes."""
    from lowbit.examples import SmallCNN
    if built and not native.available():
        pytest.skip(f"lowbit.native not built: {native.reason()}")
    torch.manual_seed(0)
    m = Q.fuse_modules(SmallCNN(channels=(4, 8), hidden=16).eval(), SmallCNN.fusion_groups())
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(16, 1, 28, 28))
    q = Q.convert(p)
    x = torch.randn(3, 1, 28, 28)
    with contextlib.ExitStack() as stack:
        if not built:
            stack.enter_context(mock.patch.object(native, "traced_available", lambda: False))
        ep = torch.export.export(q, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith(("aten.max_pool", "aten.clone")) for t in targets), targets
    assert {"lowbit.max_pool2d_codes.default", "lowbit.contiguous_codes.default"} <= targets, targets
    assert any(t.startswith("lowbit.qconv") for t in targets)
    assert ("lowbit.qfunctional.default" in targets) == built, targets
    assert ("lowbit.quantize_codes.default" in targets) == built, targets
    assert any(t.startswith("aten.round") for t in targets) != built, targets  # (the inline quantize's rounding)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), q(x))
        x_cl = x.contiguous(memory_format=torch.channels_last)  # (the stub's codes keep a dense input's layout)
        assert torch.equal(ep.module()(x_cl), q(x_cl))


@pytest.mark.parametrize("layouts", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("relu", [False, True])
def test_fast_add_large_inputs_in_blocks_are_bit_identical(layouts, relu):
    """Above ``_ADD_BLOCK`` elements the fast add runs on blocks of whole samples (40 × 2304 codes: blocks of
    28 and 12 samples); mixed layouts take the one-block path. Output scale 2 × an input scale: many ties."""
    shape = (40, 16, 12, 12)
    qa = Q.QTensor(codes(shape, torch.uint8, 1, layouts[0]), 0.02, 131, Q.quint8)
    qb = Q.QTensor(codes(shape, torch.uint8, 2, layouts[1]), 0.013, 77, Q.quint8)
    m = fm.QFunctional(0.04, 125)
    fast = fm._fast_add(qa, qb, m.scale, m.zero_point, m.qdtype, relu)
    slow = m._binary(qa, qb, "add", fm._scaled_sum, torch.add, relu=relu)
    assert fast is not None and torch.equal(fast.int_repr(), slow.int_repr())
    assert fast.int_repr().is_contiguous(memory_format=torch.channels_last) == layouts[0]


@pytest.mark.parametrize("relu", [False, True])
def test_fast_add_memo_follows_grid_changes(relu):
    """The add reads its grids' numbers once per grid state (a memo on the QFunctional): in-place changes of the
    output grid or of an input's scale or zero point give the codes of an add without the memo, on every call."""
    shape = (3, 8, 5, 5)
    qa = Q.QTensor(codes(shape, torch.uint8, 1, True), torch.tensor(0.02), torch.tensor(131), Q.quint8)
    qb = Q.QTensor(codes(shape, torch.uint8, 2, True), torch.tensor(0.013), torch.tensor(77), Q.quint8)
    m = fm.QFunctional(0.04, 125)

    def check() -> None:
        got = m.add_relu(qa, qb) if relu else m.add(qa, qb)
        want = fm._fast_add(qa, qb, m.scale, m.zero_point, m.qdtype, relu)  # no memo
        assert want is not None and torch.equal(got.int_repr(), want.int_repr())

    check()
    check()
    with torch.no_grad():
        m.scale.mul_(1.5)
        check()
        m.zero_point.sub_(20)
        check()
        qa.scale.mul_(0.7)
        check()
        qb.zero_point.add_(9)
        check()
    assert len(m._memo) <= 8
