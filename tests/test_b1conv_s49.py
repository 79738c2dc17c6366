"""Session 49 (b1conv49): the compiled ``lowbit::qconv_cfg`` keeps a fast entry per config string in the weight's
cache (``pt2.fast_entry.arm``, called as ``kernel_ops._arm_fast``): after a call the conv plan's lane served, the next
calls check the identities and versions of the layer's tensors and hand the input to the lane, skipping
``checked_weight``, ``check_conv`` and the plan key. Every change that made the full body take another route or
raise still does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit.compile_state import conv_config, qdtype_key
from lowbit.kernels import onednn
from lowbit.nn.quantized import Conv2d, ConvReLU2d
from lowbit.pt2 import kernel_ops

from helpers import STEP_ASIDE_EDITS, stepped_aside

torch.set_num_threads(1)
KEY = ("onednn", "conv")
# where the op takes the layer's tensors (helpers.stepped_aside)
CONV_AT = {"weight": 3, "w_scale": 4, "bias": 6, "scale": 7, "zero_point": 8}


def _routes() -> None:
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")


def _layer(relu: bool = True, groups: int = 1, seed: int = 3) -> Conv2d:
    c_in, c_out = 8, 16
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if onednn.has_vnni() else (-64, 63)  # (saturation_safe: planned on AVX2 too)
    codes = torch.randint(lo, hi + 1, (c_out, c_in // groups, 3, 3), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(c_out, generator=g) / 50 + 1e-3, torch.zeros(c_out, dtype=torch.long), Q.qint8, 0)
    mod = (ConvReLU2d if relu else Conv2d)(c_in, c_out, 3, 1, 1, groups=groups)
    mod.set_weight_bias(w, torch.randn(c_out, generator=g))
    mod.set_output_grid(0.05, 100, Q.quint8)
    return mod


def _args(mod: Conv2d, batch: int = 1, zp: int = 131) -> tuple[list[Any], str]:
    """``qconv_cfg``'s tensors (the module's buffers themselves, as a compiled program passes them) and config."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (batch, 8, 9, 11), generator=g, dtype=torch.uint8)
    x = x.contiguous(memory_format=torch.channels_last)
    sp = mod._spec
    cfg = conv_config(qdtype_key(Q.quint8), qdtype_key(mod.weight_qdtype), qdtype_key(mod.out_qdtype), mod._relu,
                      list(sp.stride), list(sp.padding), list(sp.dilation), sp.groups, False, [0, 0])
    return [x, torch.tensor(0.02), torch.tensor(zp), mod.weight_int8, mod.weight_scale, mod.weight_zero_point,
            mod.bias, mod.scale, mod.zero_point], cfg


def _full(args: list[Any], cfg: str) -> torch.Tensor:
    """The op's full body on clones (a fresh weight cache): what a cold call gives, or its error."""
    a = [None if t is None else t.clone() for t in args]
    return kernel_ops.qconv_cfg(*a, cfg)


class _Spy:
    """Counts the op's full-body calls (``kernel_ops._qconv``) on ``weight`` (not ``_full``'s clones)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, weight: torch.Tensor) -> None:
        self.n, orig = 0, kernel_ops._qconv

        def counted(*a: Any, **k: Any) -> Any:
            self.n += a[5] is weight
            return orig(*a, **k)
        monkeypatch.setattr(kernel_ops, "_qconv", counted)


def _armed(monkeypatch: pytest.MonkeyPatch, relu: bool = True) -> tuple[Conv2d, list[Any], str, torch.Tensor, _Spy]:
    _routes()
    mod = _layer(relu)
    args, cfg = _args(mod)
    want = _full(args, cfg)
    for _ in range(3):  # (run arms the lane, the lane's call arms the fast entry)
        assert torch.equal(kernel_ops.qconv_cfg(*args, cfg), want)
    return mod, args, cfg, want, _Spy(monkeypatch, args[3])


def test_fast_entry_serves_without_the_full_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """After arming, ``qconv_cfg`` calls never enter the full body (on int49 every call did), give the full body's
    codes and layout, and tally the conv as the full body does."""
    mod, args, cfg, want, spy = _armed(monkeypatch)
    before = K.counts[KEY]
    for _ in range(4):
        y = kernel_ops.qconv_cfg(*args, cfg)
        assert torch.equal(y, want) and y.stride() == want.stride()
    assert spy.n == 0, spy.n
    assert K.counts[KEY] - before == 4
    # the eager module gives the same codes
    x = Q.QTensor(args[0], args[1], args[2], Q.quint8)
    assert torch.equal(mod(x).int_repr(), want)


@pytest.mark.parametrize("edit", STEP_ASIDE_EDITS)
def test_fast_entry_steps_aside_for_every_change(monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    """Pins (the full body ran on every call before): each change the full body would see is seen, the codes are a
    cold call's, and the entry re-arms for the new state."""
    mod, args, cfg, want, spy = _armed(monkeypatch)
    with stepped_aside(args, edit, CONV_AT, monkeypatch):
        cold = _full(args, cfg)
        y = kernel_ops.qconv_cfg(*args, cfg)
        assert spy.n == 1, (edit, spy.n)  # the full body ran
        assert torch.equal(y, cold), edit
        for _ in range(3):
            assert torch.equal(kernel_ops.qconv_cfg(*args, cfg), cold)
    if edit in ("x_scale", "x_zero_point"):  # (the layer's entry stands: run re-arms the lane, which it then calls)
        assert spy.n == 1, (edit, spy.n)
    elif edit not in ("backend", "vnni", "other_w_scale"):
        assert spy.n == 2, (edit, spy.n)  # re-armed (run, then the lane): the last two calls took the fast entry


def test_errors_after_arming_are_a_cold_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin: bad inputs to an armed op raise the full body's very errors."""
    mod, args, cfg, want, spy = _armed(monkeypatch)
    x = args[0]
    bad = {"channels": x[:, :4], "rank": x[0], "dtype": x.to(torch.int8), "wide": x.to(torch.int16),
           "x_scale": None}
    for name, xb in bad.items():
        a = list(args)
        if xb is None:
            a[1] = torch.tensor([0.02, 0.03])
        else:
            a[0] = xb
        with pytest.raises((ValueError, TypeError)) as cold:
            _full(a, cfg)
        with pytest.raises(cold.type) as got:
            kernel_ops.qconv_cfg(*a, cfg)
        assert str(got.value) == str(cold.value), name
    assert torch.equal(kernel_ops.qconv_cfg(*args, cfg), want)


@pytest.mark.parametrize("which", [1, 2, 7, 8])
def test_grid_data_swap_after_arming_raises_the_cold_error(monkeypatch: pytest.MonkeyPatch, which: int) -> None:
    """A ``.data`` swap of an input or output grid tensor to two values (no version bump, same object) raises the full
    body's per-tensor error, as every call did before the fast entry (without its numel checks it served)."""
    mod, args, cfg, want, spy = _armed(monkeypatch)
    with torch.no_grad():
        args[which].data = args[which].reshape(1).repeat(2)
    with pytest.raises((ValueError, TypeError)) as cold:
        _full(args, cfg)
    with pytest.raises(cold.type) as got:
        kernel_ops.qconv_cfg(*args, cfg)
    assert str(got.value) == str(cold.value)


def test_fast_entry_with_inference_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin: a layer converted under ``inference_mode`` (tensors without version counters) is served too, with the
    full body's codes."""
    _routes()
    with torch.inference_mode():
        mod = _layer(False, seed=5)
        args, cfg = _args(mod, batch=2, zp=0)
        want = _full(args, cfg)
        for _ in range(3):
            kernel_ops.qconv_cfg(*args, cfg)
        spy = _Spy(monkeypatch, args[3])
        assert torch.equal(kernel_ops.qconv_cfg(*args, cfg), want)
        assert spy.n == 0


def test_compiled_smallcnn_b1_bit_identical_to_eager_and_full_body() -> None:
    """Compiled SmallCNN b1 and b3 give eager's output with the fast entries (armed: none on int49) and with them
    dropped. The conv weights are clamped to 7 bits, so the convs are planned under ``ONEDNN_MAX_CPU_ISA=AVX2`` too."""
    _routes()
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from compiled_overhead import build

    from lowbit.nn.quantized.conv import _ConvNd
    m, x = build("smallcnn")
    for mod in m.modules():
        if isinstance(mod, _ConvNd):
            mod.weight_int8.clamp_(-64, 63)  # (saturation_safe: planned on AVX2-only CPUs too)
    with torch.inference_mode():
        c = torch.compile(m, fullgraph=True, dynamic=False)
        for b in (1, 3):
            xb = x[:b]
            ref = m(xb)
            for _ in range(4):
                assert torch.equal(c(xb), ref)
            n = sum(isinstance(k, str) and "|" in k for _, cache in kernel_ops._CACHES.values() for k in cache)
            assert n >= 1  # (SmallCNN's planned convs armed)
            for _, cache in list(kernel_ops._CACHES.values()):
                for k in [k for k in cache if isinstance(k, str) and "|" in k]:
                    del cache[k]
            assert torch.equal(c(xb), ref)
