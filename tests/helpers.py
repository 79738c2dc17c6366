"""Helpers shared by several test modules (not a test module): a state_dict round trip, a 1-thread fixture.

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
