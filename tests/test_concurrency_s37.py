"""Converted models used as servers use them (session 37): several Python threads calling the same model at once
(inputs, batch sizes and input grids differing per thread, ``torch.set_num_threads`` 1 or 2 per thread), a model
sent to a spawned or forked process, and a ``load_state_dict`` while other threads run the model.

Every concurrent output is compared bit for bit with the same input run alone (the native kernels' sums are exact:
the thread count does not change a result). Races are made deterministic where they can be (a hook that runs the
other thread's step at the racing point); the rest run real threads with a short GIL switch interval. Every wait has
a timeout (``concurrent.futures``), so a deadlock fails instead of hanging.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import gc
import multiprocessing.reduction
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with multiprocessing's pickler)
from torch import nn

import lowbit as Q
from lowbit import kernels, native
from lowbit.examples import SmallCNN
from lowbit.native import gemm
from lowbit.nn.quantized import weight_only as wo
from lowbit.nn.quantized.activation import Hardswish
from lowbit.nn.quantized.dynamic import per_token
from lowbit.pt2 import kernel_ops

warnings.filterwarnings("ignore", category=UserWarning)

_TIMEOUT = 120  # seconds for any wait: a deadlock fails the test


@contextmanager
def _fast_switching() -> Iterator[None]:
    """A short GIL switch interval: Python-level races show up in a few hundred calls instead of millions."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(job: Any, n: int) -> list[Any]:
    """``job(i)`` on ``n`` threads started together; their results (a hang fails after ``_TIMEOUT``)."""
    barrier = threading.Barrier(n)

    def start(i: int) -> Any:
        barrier.wait(_TIMEOUT)
        return job(i)

    with cf.ThreadPoolExecutor(n) as ex:
        return [f.result(timeout=_TIMEOUT) for f in [ex.submit(start, i) for i in range(n)]]


# ---- the models ----
class _MLP(nn.Module):
    def __init__(self, k: int = 96) -> None:
        super().__init__()
        self.q, self.dq = Q.QuantStub(), Q.DeQuantStub()
        self.l, self.r, self.l2 = nn.Linear(k, 80), nn.ReLU(), nn.Linear(80, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.l2(self.r(self.l(self.q(x)))))


def _static_mlp(recipe: str | None = None) -> nn.Module:
    torch.manual_seed(5)
    m = _MLP().eval()
    m.qconfig = Q.get_default_qconfig(recipe)
    m = Q.fuse_modules(m, [["l", "r"]])
    Q.prepare(m, inplace=True)
    m(torch.randn(256, 96))
    return Q.convert(m)


def _static_cnn() -> nn.Module:
    torch.manual_seed(0)
    m = SmallCNN().eval()
    m.qconfig = Q.get_default_qconfig()
    m = Q.fuse_modules(m, m.fusion_groups())
    Q.prepare(m, inplace=True)
    m(torch.randn(32, 1, 28, 28))
    return Q.convert(m)


class _Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.c3, self.fc, self.pool = nn.Conv2d(16, 8, 1), nn.Linear(24 * 4, 10), nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        y = torch.relu(a + self.c2(a))
        return self.fc(self.pool(torch.cat([y, self.c3(y)], 1)).flatten(1))


def _graph_cnn() -> nn.Module:
    torch.manual_seed(2)
    p = Q.prepare_fx(_Graph().eval(), Q.get_default_qconfig_mapping(), (torch.randn(4, 3, 16, 16),))
    p(torch.randn(16, 3, 16, 16))
    return Q.convert_fx(p)


def _float_mlp(k: int = 96) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(k, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10)).eval()


def _dynamic_mlp(recipe: str | None = None) -> nn.Module:
    qc = Q.get_dynamic_qconfig(backend=recipe) if recipe else Q.get_dynamic_qconfig()
    return Q.quantize_dynamic(_float_mlp(), {nn.Linear: qc})


def _int4_mlp() -> nn.Module:
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    return Q.quantize_weight_only(m, bits=4, group_size=32)


def _inputs(shape: tuple[int, ...], sizes: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, *shape, generator=g) * (0.25 + i) for i, b in enumerate(sizes)]  # other grids per input


MODELS = {  # name: (make, input shape without the batch)
    "static_mlp": (_static_mlp, (96,)),
    "static_mlp_x86": (lambda: _static_mlp("x86"), (96,)),
    "static_cnn": (_static_cnn, (1, 28, 28)),
    "graph_cnn": (_graph_cnn, (3, 16, 16)),
    "dynamic": (_dynamic_mlp, (96,)),
    "dynamic_x86": (lambda: _dynamic_mlp("x86"), (96,)),
    "int4": (_int4_mlp, (128,)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_threads_sharing_a_cold_model_give_each_inputs_own_output(name: str) -> None:
    """8 threads (1 or 2 torch threads each) call one model from its first call on: batch sizes 1-64, one-row inputs
    on distinct grids (the dynamic Linear's one-row plan once shared a per-call scale buffer: threads got each
    other's scales, and a racing first call left it reading an unwritten buffer for good)."""
    make, shape = MODELS[name]
    base = make()
    xs = _inputs(shape, (1, 1, 1, 2, 3, 1, 16, 64) if shape != (1, 28, 28) else (1, 1, 2, 8), 7)
    ref_model = copy.deepcopy(base)
    refs = [ref_model(x) for x in xs]
    threads = torch.get_num_threads()
    try:
        with _fast_switching():
            for _ in range(3):
                m = copy.deepcopy(base)  # (no plan, pack or table made yet: the first calls race too)

                def job(i: int, m: nn.Module = m) -> int:
                    torch.set_num_threads(1 + i % 2)
                    return sum(not torch.equal(m(xs[(i + r) % len(xs)]), refs[(i + r) % len(xs)]) for r in range(12))

                assert sum(_run_threads(job, 8)) == 0
                assert all(torch.equal(m(x), r) for x, r in zip(xs, refs))  # and nothing left broken for later calls
    finally:
        torch.set_num_threads(threads)  # (the count new threads start with: torch keeps the last one set)


@pytest.mark.skipif(not native.available(), reason="lowbit.native not built")
def test_dynamic_one_row_plan_made_twice_at_once_stays_exact() -> None:
    """Two threads making a dynamic Linear's VNNI plans at once (the second inside the first, as a thread switch
    puts it): before session 37 the first thread's one-row plan read a scale buffer the second had replaced, never
    written again: every later one-row call gave NaN / Inf or other garbage."""
    mod = Q.nn.quantized.dynamic.Linear.from_float(_float_mlp()[0])
    x = torch.randn(1, 96) * 3
    want = copy.deepcopy(mod)(x)
    plan = per_token._plan(mod.weight_int8, mod.weight_scale, mod.weight_zero_point, mod.dtype, mod._cache)
    if plan is None or not (kernels.onednn.has_vnni() and native.vnni()):
        pytest.skip("the one-row native plan runs on AVX-512 VNNI CPUs only")
    real, nested = native.linear_plan, []

    def racing(w: torch.Tensor, mode: str, *a: Any, **kw: Any) -> Any:
        made = real(w, mode, *a, **kw)
        if mode == "float" and not nested:
            nested.append(None)
            nested[0] = per_token._vnni_plans(plan, mod.bias)  # the other thread, between this plan and the store
        return made

    native.linear_plan = racing
    try:
        per_token._vnni_plans(plan, mod.bias)
    finally:
        native.linear_plan = real
    assert nested and plan.vnni is not nested[0]  # (the outer thread's plans stored last, as the race left them)
    for _ in range(3):
        assert torch.equal(mod(x), want)


# ---- one model sent to other processes ----
class _Run(torch.utils.data.Dataset):
    def __init__(self, m: nn.Module, xs: list[torch.Tensor]) -> None:
        self.m, self.xs = m, xs

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.m(self.xs[i])


@pytest.mark.parametrize("name", ["static_mlp", "static_cnn"])
def test_pickling_for_a_spawned_process_leaves_the_parents_model_exact(name: str) -> None:
    """multiprocessing's pickler (a spawned / forkserver ``Process``'s arguments, a ``Queue``, ``DataLoader`` workers)
    moves every tensor it sends into shared memory in place: a new address, the same version. The static Linear's
    plans read the weight codes and bias where they were: the parent's model then read freed memory (wrong outputs
    every call, silently) until session 37 keyed the plans on those addresses too."""
    make, shape = MODELS[name]
    m = make()
    xs = _inputs(shape, (1, 3, 16), 11)
    refs = [copy.deepcopy(m)(x) for x in xs]
    for _ in range(2):
        assert all(torch.equal(m(x), r) for x, r in zip(xs, refs))  # (plans made, lane armed)
    multiprocessing.reduction.ForkingPickler.dumps(m)
    gc.collect()
    junk = [torch.full((4096,), 7, dtype=torch.int8) for _ in range(512)]  # the freed memory, reused
    assert all(torch.equal(m(x), r) for x, r in zip(xs, refs))
    del junk


def test_dataloader_workers_spawned_and_forked_run_the_model_exactly() -> None:
    """A model run in ``DataLoader`` workers (spawn: a pickled copy; fork: the parent's memory, torch sets one thread
    there), the parent's model still exact afterwards."""
    m = _static_mlp()
    xs = _inputs((96,), (1, 5, 64, 2), 12)
    refs = [copy.deepcopy(m)(x) for x in xs]
    for x in xs:
        m(x)
    for ctx in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(_Run(m, xs), batch_size=None, num_workers=1, multiprocessing_context=ctx,
                                             timeout=_TIMEOUT)
        got = list(loader)
        assert all(torch.equal(a, b) for a, b in zip(got, refs)), ctx
        assert all(torch.equal(m(x), r) for x, r in zip(xs, refs)), ctx


# ---- load_state_dict while other threads run ----
def _int4_state_b(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v ^ 0x11 if k.endswith("qweight") else v.clone()) for k, v in sd.items()}


def test_int4_pack_made_during_a_load_state_dict_is_not_kept() -> None:
    """A forward making the int4 pack from the old codes while another thread's ``load_state_dict`` lands (the
    hook runs it right there) stored that pack after the load had cleared the cache: every later forward ran the old
    weights. The pack is now kept for the buffers' versions read before it was made."""
    m = _int4_mlp()
    sd_b = _int4_state_b(m.state_dict())
    model_b = copy.deepcopy(m)
    model_b.load_state_dict(sd_b)
    x = torch.randn(3, 128)
    want_b = model_b(x)
    real, fired = wo._unpack4, []

    def loading(*a: Any, **kw: Any) -> torch.Tensor:
        codes = real(*a, **kw)
        if not fired:
            fired.append(True)
            m.load_state_dict(sd_b)  # (another thread's load, between reading the codes and storing the pack)
        return codes

    wo._unpack4 = loading
    try:
        m(x)  # (its output mixes the states: the load ran inside it)
    finally:
        wo._unpack4 = real
    assert fired
    for _ in range(2):
        assert torch.equal(m(x), want_b)


def test_forwards_after_load_state_dict_returns_use_the_new_state_while_threads_run() -> None:
    """What is guaranteed: a forward that starts after ``load_state_dict`` returned gives the loaded state's output bit
    for bit, while other threads keep calling the model (a forward running during the load may mix the states,
    never raises)."""
    m = _int4_mlp()
    sd_a = copy.deepcopy(m.state_dict())
    sd_b = _int4_state_b(sd_a)
    xs = _inputs((128,), (1, 2, 5), 13)
    ref_a = [copy.deepcopy(m)(x) for x in xs]
    mb = copy.deepcopy(m)
    mb.load_state_dict(sd_b)
    ref_b = [mb(x) for x in xs]
    stop, errors = threading.Event(), []

    def spin(i: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                m(xs[(i + n) % len(xs)])
            except Exception as e:  # noqa: BLE001 (reported by the assert below)
                errors.append(repr(e))
                return
            n += 1

    stale = 0
    with _fast_switching(), cf.ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(spin, i) for i in range(3)]
        try:
            for r in range(60):
                sd, ref = (sd_b, ref_b) if r % 2 == 0 else (sd_a, ref_a)
                m.load_state_dict(sd)
                stale += not all(torch.equal(m(x), y) for x, y in zip(xs, ref))
        finally:
            stop.set()
            for f in futures:
                f.result(timeout=_TIMEOUT)
    assert not errors and stale == 0


def test_conv_pack_entry_survives_a_cache_cleared_by_another_thread() -> None:
    """oneDNN's conv route re-read its cache entry after other calls: a ``load_state_dict`` in another thread clearing
    the layer's cache there raised ``KeyError`` in the forward that was running."""
    m = _static_cnn()
    conv = m.conv2
    x = Q.quantize_per_tensor(torch.rand(2, 16, 14, 14) * 2, 2 / 255, 0, Q.quint8)
    with kernels.use_backend("onednn"):
        want = copy.deepcopy(conv)(x)
        real = kernels.onednn.conv_small.takes

        def clearing(*a: Any, **kw: Any) -> bool:
            conv._cache.clear()  # (another thread's load_state_dict, between the entry's read and its update)
            return real(*a, **kw)

        kernels.onednn.conv_small.takes = clearing
        try:
            got = conv(x)
        finally:
            kernels.onednn.conv_small.takes = real
        assert torch.equal(got.int_repr(), want.int_repr())
        assert torch.equal(conv(x).int_repr(), want.int_repr())


# ---- caches written in two steps ----
def test_lut_activation_shared_by_threads_on_other_input_grids() -> None:
    """A quantized activation's table was two attributes (key, table): a thread could pair its grid's key with another
    grid's table, returned then and on every later call with that grid."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    qs = [Q.quantize_per_tensor(x, 0.01 * (i + 1), 100 + i, Q.quint8) for i in range(6)]
    refs = [Hardswish(scale=0.02, zero_point=20)(q).int_repr() for q in qs]
    with _fast_switching():
        for _ in range(25):
            m = Hardswish(scale=0.02, zero_point=20)

            def job(i: int, m: nn.Module = m) -> int:
                return sum(not torch.equal(m(qs[(i + r) % 6]).int_repr(), refs[(i + r) % 6]) for r in range(30))

            assert sum(_run_threads(job, 6)) == 0
            assert all(torch.equal(m(q).int_repr(), r) for q, r in zip(qs, refs))


@pytest.mark.skipif(not native.available(), reason="lowbit.native not built")
@pytest.mark.parametrize("kernels_", ["best", "avx2"])
def test_a_published_weight_pack_is_never_replaced(kernels_: str) -> None:
    """Two threads packing one plan's weights at once: the second stored its pack between the first's check and store,
    and the first then replaced it (and freed it) while the second's native call, GIL released, was reading it. The
    hook runs the second thread's whole call at that point; the pack it ran on must be the one the plan keeps."""
    torch.manual_seed(0)
    w = torch.randint(-128, 128, (40, 96), dtype=torch.int8)
    x = torch.randint(0, 256, (4, 96), dtype=torch.uint8)
    pinned = native.force_avx2 if kernels_ == "avx2" else _nothing
    want, out_a, out_b = torch.empty(4, 40), torch.empty(4, 40), torch.empty(4, 40)
    ref = gemm.linear_plan(w, "float", torch.ones(40), None)
    plan = gemm.linear_plan(w, "float", torch.ones(40), None)
    assert ref is not None and plan is not None
    with pinned():
        assert ref.run(x, 3, want)
    seen: list[int] = []

    def other() -> None:  # the second thread's whole call
        with pinned():
            assert plan.run(x, 3, out_b)
            seen.append(plan._plan.wv if native.vnni() else plan._plan.wp)

    real_v, real_b, hooked = gemm.pack_vnni, gemm.pack_bcast, []

    class Hooked(torch.Tensor):
        def data_ptr(self) -> int:  # type: ignore[override]
            if not hooked:  # (the first thread, after its pack was made: the point a thread switch may fall)
                hooked.append(True)
                t = threading.Thread(target=other)
                t.start()
                t.join(_TIMEOUT)
            return torch.Tensor.data_ptr(self)

    gemm.pack_vnni = lambda t: real_v(t) if hooked else real_v(t).as_subclass(Hooked)
    gemm.pack_bcast = lambda t: real_b(t) if hooked else real_b(t).as_subclass(Hooked)
    try:
        with pinned():
            assert plan.run(x, 3, out_a)
            kept = plan._plan.wv if native.vnni() else plan._plan.wp
    finally:
        gemm.pack_vnni, gemm.pack_bcast = real_v, real_b
    if not hooked:
        pytest.skip("these kernels pack no weights here (no AVX2)")
    assert seen == [kept] and torch.equal(out_a, want) and torch.equal(out_b, want)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_compiled_ops_weight_cache_read_while_another_thread_clears_it() -> None:
    """``lowbit::qlinear``'s weight cache (``pt2.kernel_ops.cached_weight``) read its version after another read: a
    thread clearing it in between (its weight changed) raised ``KeyError`` in the other."""
    w = torch.ones(4, 3, dtype=torch.int8)
    cache, held = kernel_ops.cached_weight(w)

    class Clearing(torch.Tensor):
        def data_ptr(self) -> int:  # type: ignore[override]
            cache.clear()  # (the other thread's rebuild, between this thread's two reads)
            return torch.Tensor.data_ptr(self)

    cache["weight"] = held.as_subclass(Clearing)
    cache2, held2 = kernel_ops.cached_weight(w)
    assert cache2 is cache and type(held2) is torch.Tensor and held2.data_ptr() == w.data_ptr()
    assert cache.get("version") == w._version and kernel_ops.cached_weight(w)[1] is held2
