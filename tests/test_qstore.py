"""``lowbit.qstore.codes`` — torch's quantize at scale 1 as lowbit's add / round / clamp / store — bit for bit.

The one-pass route must give ``clamp(round_half_even(fl(v + z)), lo, hi)`` on ties, their float32 neighbours,
saturating values and infinities, for every 8-bit grid (full, 7-bit, ReLU floors) and zero point, on vector
bodies and tails, in the input's memory order; the two fallbacks (``z`` added first, the four float ops) too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit import qstore

GRIDS = [(torch.uint8, 0, 255), (torch.uint8, 0, 127), (torch.uint8, 40, 255), (torch.int8, -128, 127),
         (torch.int8, -64, 63), (torch.int8, 0, 127)]


def _formula(v: torch.Tensor, z: int, lo: int, hi: int, storage: torch.dtype) -> torch.Tensor:
    return torch.add(v, float(z)).round_().clamp_(lo, hi).to(storage)


def _adversarial(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(-700, 700, (n,), generator=g).float() / 2          # exact ties k + 0.5 (and integers)
    near = torch.nextafter(half, torch.where(torch.rand(n, generator=g) < 0.5, -1e9, 1e9))
    far = torch.tensor([1e6, -1e6, 3e9, -3e9, 2.0**31, -(2.0**31), 3e38, -3e38, float("inf"), -float("inf")])
    return torch.cat([half, near, torch.randn(n, generator=g) * 300, far])


@pytest.fixture(params=["one pass", "z added first", "float ops"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "one pass" and not qstore.exact(True):
        pytest.skip("this torch build's quantize_per_tensor does not round v + z once")
    if request.param != "one pass":
        monkeypatch.setattr(qstore, "exact", lambda fused: request.param == "z added first" and not fused)
    return str(request.param)


@pytest.mark.parametrize("storage,lo,hi", GRIDS)
def test_codes_match_the_formula_on_ties_and_saturation(route: str, storage: torch.dtype, lo: int, hi: int) -> None:
    smin = 0 if storage == torch.uint8 else -128
    for z in sorted({smin, smin + 1, smin + 3, lo, hi, (lo + hi) // 2, smin + 255}):
        for n in (1, 7, 8, 9, 33, 5000):                 # vector bodies and scalar tails; > 4096 codes: a storage view
            v = _adversarial(n, n + z)
            got = qstore.codes(v.clone(), z, lo, hi, storage)
            want = _formula(v, z, lo, hi, storage)
            assert got.dtype == storage and not got.is_quantized
            assert torch.equal(got, want), f"{route}: z={z} grid [{lo}, {hi}] n={n}"


@given(st.lists(st.floats(-400, 400, width=32), min_size=1, max_size=80), st.integers(0, 255), st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_codes_property(vals: list[float], z: int, grid: int) -> None:
    storage, lo, hi = GRIDS[grid]
    z = z if storage == torch.uint8 else z - 128
    v = torch.tensor(vals, dtype=torch.float32)
    assert torch.equal(qstore.codes(v.clone(), z, lo, hi, storage), _formula(v, z, lo, hi, storage))


def test_codes_keep_the_memory_order() -> None:
    """A channels-last (or any dense permuted) input gives codes in the same strides, as ``.to(dtype)`` does."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(2, 8, 5, 5, generator=g).contiguous(memory_format=torch.channels_last),
             torch.randn(3, 24, 9, generator=g).permute(0, 2, 1).contiguous().permute(0, 2, 1),
             torch.randn(40, 70, generator=g).t(), torch.randn(1, 70, generator=g).expand(4, 70),
             (torch.randn(80, 70, generator=g) * 100)[::2, 1:]]
    for v in cases:
        want = _formula(v * 10, 3, 0, 255, torch.uint8)
        got = qstore.codes(v * 10, 3, 0, 255, torch.uint8)
        assert torch.equal(got, want) and got.stride() == want.stride()


def test_other_storage_and_devices_take_the_float_ops() -> None:
    v = _adversarial(50, 1)
    assert torch.equal(qstore.codes(v.clone(), 5, -1000, 1000, torch.int16), _formula(v, 5, -1000, 1000, torch.int16))
    assert torch.equal(qstore.codes(v.clone(), 300, 0, 255, torch.uint8), _formula(v, 300, 0, 255, torch.uint8))
