"""Session 48 follow-ups (pt2lane48): the compiled ``lowbit::qconv_cfg`` enters the eager plan's conv lane
(``kernels.lane.ConvLane``) as the compiled ``qlinear`` enters the Linear's, and the weight-split convs' initial packs
(``conv_split._pack_wsplit``, a 3-d conv's) are made on a fresh thread and, for ``z_x != 0``, for the input's zero
point: oneDNN reorders no weight per call (``ONEDNN_VERBOSE``, counted in a child process under
``ONEDNN_MAX_CPU_ISA=AVX2``, which makes lowbit take the weight split on any x86 CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.kernels import lane as lane_mod
from lowbit.kernels import onednn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_compiled_conv_op_is_served_by_the_plan_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled SmallCNN b8: after the first call, its planned convs' ``qconv_cfg`` calls are served by the plan's
    ``ConvLane`` (the eager module's route), and the output stays bit-identical to eager. On int48 the op called the
    plan's full ``run``: the lane served none of the compiled calls. The conv weights are clamped to 7 bits, so the
    convs are planned (no split) on AVX2-only CPUs and under ``ONEDNN_MAX_CPU_ISA=AVX2`` too."""
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    from compiled_overhead import build

    from lowbit.nn.quantized.conv import _ConvNd
    m, x = build("smallcnn")
    x = x[:8]
    for mod in m.modules():
        if isinstance(mod, _ConvNd):
            mod.weight_int8.clamp_(-64, 63)  # (saturation_safe: the plan runs on any x86 CPU)
    with torch.inference_mode():
        ref = m(x)
        c = torch.compile(m, fullgraph=True, dynamic=False)
        assert torch.equal(c(x), ref)
        served = [0]
        orig = lane_mod.ConvLane.__call__

        def counted(self: lane_mod.ConvLane, q: object) -> object:
            y = orig(self, q)  # type: ignore[arg-type]
            served[0] += y is not None
            return y
        monkeypatch.setattr(lane_mod.ConvLane, "__call__", counted)
        for _ in range(3):
            assert torch.equal(c(x), ref)
    assert served[0] >= 3, served  # (SmallCNN's second conv at least, on each of the 3 calls)


CHILD = r"""
import sys, zlib, torch, lowbit as Q
from lowbit.kernels import onednn, ConvSpec, OutGrid
from lowbit.kernels.avx2 import weight_halves, stack_halves
torch.set_num_threads(1)
assert not onednn.has_vnni()
for g in (1, 2):
    for prior, zx in ((9, 0), (-1, 0), (0, 9), (-1, 9)):
        c = 8 if zx == 0 else 16  # (one geometry per z_x: the case with the other pack first runs first)
        gen = torch.Generator().manual_seed(g)
        codes = torch.randint(-128, 128, (c, c // g, 3, 3, 3), generator=gen, dtype=torch.int8)
        w = Q.QTensor(codes, torch.rand(c, generator=gen) / 50 + 1e-3, torch.zeros(c, dtype=torch.long), Q.qint8, 0)
        geo = ([1, 1, 1], [1, 1, 1], [1, 1, 1])
        if prior >= 0:  # a pack of this geometry for the other kind of z_x in this thread first (another layer's)
            stacked = stack_halves(*weight_halves(codes), g)
            torch.ops.onednn.qconv_prepack(stacked, torch.ones(stacked.shape[0]), 1.0, prior, *geo, g, None)
        x = Q.QTensor(torch.randint(0, 256, (2, c, 5, 5, 5), generator=gen).to(torch.uint8), torch.tensor(0.02),
                      torch.tensor(zx), Q.quint8)
        spec, out, cache = ConvSpec(3, (1, 1, 1), (1, 1, 1), (1, 1, 1), g), OutGrid(0.05, 100, Q.quint8), {}
        onednn.conv(x, w, None, spec, out, False, cache)
        print(f"@@ groups {g} prior {prior} z_x {zx}", flush=True)
        y = onednn.conv(x, w, None, spec, out, False, cache)
        print("@@end", zlib.crc32(y.int_repr().contiguous().numpy().tobytes()), flush=True)
"""


def test_3d_weight_split_packs_reorder_no_weight_per_call() -> None:
    """A 3-d conv on the weight split (5-d input: ``_pack_wsplit``'s shape-less packs): packed in the calling thread
    after a same-geometry ``z_x != 0`` pack, and for ``z_x = 0`` while fed ``z_x != 0``, oneDNN reordered the weight on
    every call (int48: all 8 cases, 1 reorder a call); now none, and each case's codes (crc32) are the same with or
    without the other pack first (and int48's codes: the same crc32s)."""
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cases, name, reorders, sums = {}, None, 0, {}
    for line in res.stdout.splitlines():
        if line.startswith("@@ "):
            name, reorders = line[3:], 0
        elif line.startswith("@@end"):
            cases[name] = reorders
            sums[name] = int(line.split()[1])
            name = None
        elif name is not None and "reorder" in line and "s8" in line:
            reorders += 1
    assert len(cases) == 8, res.stdout[-2000:]
    assert all(v == 0 for v in cases.values()), cases
    for g in (1, 2):
        assert sums[f"groups {g} prior -1 z_x 0"] == sums[f"groups {g} prior 9 z_x 0"]
        assert sums[f"groups {g} prior -1 z_x 9"] == sums[f"groups {g} prior 0 z_x 9"]
