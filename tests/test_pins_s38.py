"""Session 38: kernel pins, the native switches and the speed guard with hostile inputs.

- ``use_backend(None)`` inside ``set_backend(name)`` kept the process pin (``get_backend`` read an unset block and a
  ``None`` block alike): the automatic chain it promises never ran. ``set_backend(["x"])`` raised ``unhashable type``.
- ``native.disabled()``'s object kept the state it found on itself: entered again inside itself (one module-level
  object), the outer exit restored the inner enter's ``True`` and the native passes stayed off in that thread.
- ``LOWBIT_NATIVE=off`` / ``false`` (anything but ``0``) left the native passes on, silently; ``LOWBIT_CUDA_FUSED``
  the same for the compiled CUDA epilogues; an empty ``LOWBIT_NATIVE_ENTRY`` raised while an empty ``CC`` or
  ``LOWBIT_CACHE_DIR`` means unset.
- ``convert(speed_check=True)`` fed ``True`` to the model (``Quantize expects a float tensor ..., got bool``);
  ``keep_faster`` with a float model on ``meta`` failed deep in a timing run (``Tensor on device meta is not on the
  expected device cpu!``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: 1 thread)
from lowbit import kernels as K
from lowbit import native
from lowbit.kernels import cuda_fused
from lowbit.nn.quantized._weighted import WeightedQuantModule
from lowbit.speed_guard import keep_faster


def _linear_case() -> tuple[Q.QTensor, Q.QTensor, K.OutGrid]:
    torch.manual_seed(0)
    x = Q.quantize_per_tensor(torch.randn(3, 16), 0.05, 7, Q.quint8)
    w = Q.quantize_per_channel(torch.randn(4, 16), torch.full((4,), 0.02), torch.zeros(4, dtype=torch.long), 0,
                               Q.qint8)
    return x, w, K.OutGrid(0.1, 100, Q.quint8)


def _ran() -> dict[str, int]:
    return {b: K.counts[(b, "linear")] for b in K.BACKENDS}


def test_use_backend_none_restores_the_automatic_chain_under_a_process_pin() -> None:
    x, w, out = _linear_case()
    want = K.reference.linear(x, w, None, out, False).int_repr().long()
    K.set_backend("reference")
    try:
        with K.use_backend(None):
            assert K.get_backend() is None
            before = _ran()
            got = K.linear(x, w, None, out)
            after = _ran()
            assert after["reference"] == before["reference"]  # the integer chain ran, not the process pin
            assert sum(after.values()) == sum(before.values()) + 1
            with K.use_backend("reference"), pytest.raises(RuntimeError):
                raise RuntimeError("inner block fails")
            assert K.get_backend() is None  # restored to the enclosing block's None, not to the process pin
        assert K.get_backend() == "reference"
    finally:
        K.set_backend(None)
    assert (got.int_repr().long() - want).abs().max() <= 1  # (near-ties: one code, the documented tolerance)
    assert K.get_backend() is None


@pytest.mark.parametrize("bad", [["onednn"], {"onednn": 1}, 1, ""])
def test_a_backend_name_of_the_wrong_type_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.set_backend(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kernel backend"), K.use_backend(bad):  # type: ignore[arg-type]
        pass
    assert K.get_backend() is None


def test_one_disabled_object_entered_inside_itself_restores_the_thread() -> None:
    off = native.disabled()
    was = native.available()
    with off:
        with off:
            assert not native.available()
        assert not native.available()  # still inside the outer block
    assert native.available() is was  # (before: off for the rest of the thread)


@pytest.mark.parametrize("value", ["off", "false", "no", "2", "-1"])
def test_lowbit_native_garbage_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LOWBIT_NATIVE", value)
    with pytest.raises(ValueError, match=f"LOWBIT_NATIVE='{value}'"):
        native._build()


def test_lowbit_native_zero_and_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWBIT_NATIVE", " 0")
    assert native._build()[::2] == (None, "LOWBIT_NATIVE=0")
    monkeypatch.delenv("LOWBIT_NATIVE_ENTRY", raising=False)
    monkeypatch.setenv("LOWBIT_NATIVE", "")  # empty: unset, the default
    default = native._build()[2]
    assert default != "LOWBIT_NATIVE=0"
    monkeypatch.setenv("LOWBIT_NATIVE_ENTRY", "")  # empty: unset (before: ValueError)
    assert native._build()[2] == default
    monkeypatch.setenv("LOWBIT_NATIVE_ENTRY", "CTYPES")
    if "compiler" not in default:  # (without a compiler the entry points are never chosen)
        with pytest.raises(ValueError, match="LOWBIT_NATIVE_ENTRY='CTYPES'"):
            native._build()


def test_lowbit_cuda_fused_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_fused, "_FAILED", [])
    cuda = torch.device("cuda")  # (a device object needs no GPU: enabled() reads its type and the variable)
    for value, on in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv("LOWBIT_CUDA_FUSED", value)
        assert cuda_fused.enabled(cuda) is on, value
        assert cuda_fused.enabled(torch.device("cpu")) is False
    for value in ("off", "false", "-1"):
        monkeypatch.setenv("LOWBIT_CUDA_FUSED", value)
        with pytest.raises(ValueError, match=f"LOWBIT_CUDA_FUSED='{value}'"):
            cuda_fused.enabled(cuda)


def _prepared() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    fm = nn.Sequential(Q.QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), Q.DeQuantStub()).eval()
    x = torch.randn(4, 16)
    prepared = Q.prepare(fm, Q.get_minmax_qconfig())
    prepared(x)
    return fm, prepared, x


@pytest.mark.parametrize("flag", [True, False])
def test_convert_speed_check_flag_is_refused_before_converting(flag: bool) -> None:
    _, prepared, x = _prepared()
    kept = copy.deepcopy(prepared)
    with pytest.raises(TypeError, match=f"convert: speed_check={flag}"):
        Q.convert(prepared, inplace=True, speed_check=flag)
    assert [type(m) for m in prepared.modules()] == [type(m) for m in kept.modules()]  # still the prepared model
    torch.testing.assert_close(prepared(x), kept(x), rtol=0, atol=0)
    qmodel = Q.convert(prepared)
    with pytest.raises(TypeError, match="keep_faster: example_inputs=True"):
        keep_faster(qmodel, kept, True)


def test_keep_faster_refuses_a_float_model_on_meta_and_swaps_nothing() -> None:
    fm, prepared, x = _prepared()
    qmodel = Q.convert(prepared)
    want = qmodel(x)
    with pytest.raises(ValueError, match=r"float_model's '1' \(Linear\) is on meta"):
        keep_faster(qmodel, copy.deepcopy(fm).to("meta"), x, timer=lambda name, a, b: (2.0, 1.0))
    assert isinstance(qmodel[1], WeightedQuantModule) and isinstance(qmodel[3], WeightedQuantModule)
    torch.testing.assert_close(qmodel(x), want, rtol=0, atol=0)
    dyn = Q.quantize_dynamic(nn.Sequential(nn.Linear(16, 8)))
    with pytest.raises(ValueError, match=r"float_model's '0' \(Linear\) is on meta"):
        keep_faster(dyn, nn.Sequential(nn.Linear(16, 8)).to("meta"), x, timer=lambda name, a, b: (2.0, 1.0))
    assert type(dyn[0]).__module__.startswith("lowbit.nn.quantized.dynamic")
