"""Helpers shared by several test modules (not a test module): a state_dict round trip, a 1-thread fixture,
``force`` (pin the CPU kernel route: VNNI or not, fbgemm or oneDNN only).

``one_thread`` is a module-scoped autouse fixture: a test module that imports it runs with
``torch.set_num_threads(1)`` (the 2 shared cores are oversubscribed otherwise, ~10x slower) and the
previous thread count comes back after the module's last test.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn


def roundtrip(mod: nn.Module) -> dict:
    """``mod.state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``: plain tensors, no pickled code."""
    buf = io.BytesIO()
    torch.save(mod.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    return sd


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def force(monkeypatch: pytest.MonkeyPatch, *, vnni: bool, fbgemm: bool) -> None:
    """Make the oneDNN backend take its VNNI (or non-VNNI) route, with fbgemm or without, on any CPU."""
    from lowbit.kernels import onednn

    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    monkeypatch.setattr(onednn, "has_vnni", lambda: vnni)
    if fbgemm:
        if "x86" not in torch.backends.quantized.supported_engines:
            pytest.skip("no x86/fbgemm quantized engine")
        monkeypatch.setattr(torch.backends.quantized, "engine", "x86")
    else:
        monkeypatch.setattr(onednn, "_FBGEMM", ())
