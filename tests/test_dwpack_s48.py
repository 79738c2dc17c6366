"""Conv weight packs made on a fresh thread (``conv_split.in_fresh_thread``, session 48): ``onednn::qconv_prepack`` asks
ideep for the weight layout through a per-thread cache whose key leaves out the input zero point, so a layer packed for
``z_x != 0`` in a thread that already packed the same geometry and input shape for ``z_x = 0`` (or the other way round)
got the other layout, and oneDNN reordered its weight on every call (MobileNetV2's 960-channel depthwise convs).

The reorders are counted with ``ONEDNN_VERBOSE`` in a child process; the codes are compared bit for bit with the
packs made the old way (in the calling thread, after a pack of the other kind of zero point). The weights are 7-bit, so
the planned oneDNN call runs on AVX2-only machines, under ``ONEDNN_MAX_CPU_ISA=AVX2`` and on VNNI machines alike.
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit.kernels import conv_split, onednn
from lowbit.nn.quantized import ConvReLU2d

torch.set_num_threads(1)

GEOMETRIES = [  # (channels in, out, kernel, stride, padding, groups)
    (32, 32, 3, 1, 1, 32), (96, 96, 3, 2, 1, 96), (960, 960, 3, 1, 1, 960), (16, 32, 3, 1, 1, 4), (24, 48, 1, 1, 0, 1),
    (16, 16, 3, 1, 1, 1)]


def _routes() -> None:
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")


def _layer(geo: tuple[int, ...], seed: int) -> ConvReLU2d:
    c_in, c_out, k, stride, pad, groups = geo
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-64, 64, (c_out, c_in // groups, k, k), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(c_out, generator=g) / 50 + 1e-3, torch.zeros(c_out, dtype=torch.long), Q.qint8, 0)
    mod = ConvReLU2d(c_in, c_out, k, stride, pad, 1, groups)
    mod.set_weight_bias(w, torch.randn(c_out, generator=g))
    mod.set_output_grid(0.05, 100, Q.quint8)
    return mod


def _input(c_in: int, batch: int, zp: int, channels_last: bool, seed: int, hw: int = 7) -> Q.QTensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (batch, c_in, hw, hw), generator=g).to(torch.uint8)
    if channels_last:
        codes = codes.contiguous(memory_format=torch.channels_last)
    return Q.QTensor(codes, torch.tensor(0.02), torch.tensor(zp), Q.quint8)


CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_dwpack_s48 import GEOMETRIES, _input, _layer
torch.set_num_threads(1)
for i, geo in enumerate(GEOMETRIES):
    for za, zb in ((0, 9), (9, 0)):
        a, b = _layer(geo, i), _layer(geo, i + 50)  # one geometry, two layers: the first fed z_a, the second z_b
        xa, xb = _input(geo[0], 2, za, True, 1), _input(geo[0], 2, zb, True, 2)
        a(xa), b(xb)
        print(f"@@ {geo} z_x {za} then {zb}", flush=True)
        a(xa), b(xb)
        print("@@end", flush=True)
print("ok")
"""


def test_no_weight_reorder_per_call_when_both_zero_points_meet_one_geometry() -> None:
    """Two layers of one geometry and input shape in one thread, the first fed ``z_x = 0`` and the second ``z_x = 9``
    (and the other way round): on their later calls oneDNN reorders no weight (``ONEDNN_VERBOSE``'s ``reorder`` lines
    on ``s8`` data). Packed in the calling thread, the second layer got the first one's layout and every call of it
    reordered its weight (on this AVX-512 VNNI Xeon: all 12 cases, depthwise, grouped and dense)."""
    _routes()
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "ONEDNN_VERBOSE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, here], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    case, reorders, cases = None, {}, 0
    for line in done.stdout.splitlines():
        if line.startswith("@@end"):
            case = None
        elif line.startswith("@@"):
            case, cases = line[3:], cases + 1
        elif case is not None and "exec,cpu,reorder" in line and "src:s8" in line:
            reorders[case] = reorders.get(case, 0) + 1
    assert cases == 2 * len(GEOMETRIES)
    assert reorders == {}, reorders


def _old_way(make: Any, zx: int, shape: list[int] | None) -> Any:
    return make(zx, shape)  # (the pack made in the calling thread: before session 48)


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_codes_match_the_packs_made_in_the_calling_thread(monkeypatch: pytest.MonkeyPatch,
                                                         geo: tuple[int, ...]) -> None:
    """A pin (bit-identical before and after): the layout does not change the sums. Per geometry, layout, batch and
    order of zero points, a layer packed the old way right after a layer of the other kind of zero point (its weight
    in the other layout, reordered inside every call) and its twin packed on a fresh thread give the same codes."""
    _routes()
    for (i, (za, zb)), cl, batch in itertools.product(enumerate(((0, 7), (7, 0), (131, 0), (0, 255))), (True, False),
                                                      (1, 3)):
        first, old = _layer(geo, i), _layer(geo, i + 10)
        new = copy.deepcopy(old)  # (its cache is never copied: packs of its own)
        xa, xb = _input(geo[0], batch, za, cl, i), _input(geo[0], batch, zb, cl, i + 20)
        torch.set_num_threads(torch.get_num_threads())  # (empties this thread's ideep cache)
        with monkeypatch.context() as m:
            m.setattr(conv_split, "in_fresh_thread", _old_way)
            first(xa)
            y_old = old(xb)
            assert torch.equal(old(xb).int_repr(), y_old.int_repr())  # (the plan's pack, then the lane)
        y_new = new(xb)
        assert torch.equal(y_new.int_repr(), y_old.int_repr()), (geo, za, zb, cl, batch)
        assert torch.equal(new(xb).int_repr(), y_old.int_repr())


def test_packs_are_made_on_a_fresh_thread_with_the_callers_thread_count() -> None:
    """``packed_for_input`` runs ``make`` off the calling thread (a new thread each time: an empty ideep cache), with
    the caller's ``torch.get_num_threads()``; a hit makes nothing."""
    seen: list[tuple[threading.Thread, int, list[int] | None]] = []

    def make(z: int, shape: list[int] | None) -> str:
        seen.append((threading.current_thread(), torch.get_num_threads(), shape))
        return f"pack {z}"
    store: dict[Any, Any] = {}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert conv_split.packed_for_input(store, torch.zeros(1, 2, 3, 3), 0, make) == "pack 0"
        assert conv_split.packed_for_input(store, torch.zeros(1, 2, 3, 3), 5, make) == "pack 5"
        assert conv_split.packed_for_input(store, torch.zeros(1, 2, 3, 3), 6, make) == "pack 5"  # (a hit)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 2 and seen[0][0] is not seen[1][0]  # (thread objects: an ended thread's ident can come back)
    assert all(t is not threading.current_thread() and n == 2 and shape == [1, 2, 3, 3] for t, n, shape in seen)


def test_an_error_while_packing_reaches_the_caller() -> None:
    """``make``'s error is raised in the calling thread, as it was when ``make`` ran there; nothing is stored."""
    def make(z: int, shape: list[int] | None) -> Any:
        raise ValueError(f"bad pack for z_x = {z}")
    store: dict[Any, Any] = {}
    with pytest.raises(ValueError, match="bad pack for z_x = 3"):
        conv_split.packed_for_input(store, torch.zeros(1, 2, 3, 3), 3, make)
    assert store == {}
