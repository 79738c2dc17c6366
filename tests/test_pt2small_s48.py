"""Session 48 (#10, PT2): the per-call costs of a compiled small model.

- ``lowbit::qconv_cfg`` makes its ``ConvSpec`` once per config string (``kernel_ops._parsed``), not on every call;
- pins of what the compiled SmallCNN already is: one custom op per integer step and no copy, ``contiguous`` or dtype
  conversion that inductor adds around them (the fake implementations promise the layouts the real ops give), one
  tensor guard per graph input, a bounded number of guards, and bit-identical outputs compiled, exported (dynamic
  batch) and reloaded.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import lowbit as Q
from lowbit import native
from lowbit.kernels import ConvSpec
from lowbit.pt2 import kernel_ops

from helpers import converted_smallcnn


@pytest.fixture(scope="module")
def smallcnn() -> tuple[torch.nn.Module, torch.Tensor]:
    """SmallCNN converted on the default qconfig (fused, two random calibration batches) and a batch of 8."""
    return converted_smallcnn(8)


def test_qconv_cfg_makes_its_spec_once_per_config(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = "quint8:0:255|qint8:-128:127|quint8:0:255|0|1,1|1,1|1,1|1|0|0,0"
    kernel_ops._parsed.cache_clear()
    spec = kernel_ops._cfg_args(cfg)[3]
    assert isinstance(spec, ConvSpec) and kernel_ops._cfg_args(cfg)[3] is spec
    assert spec == ConvSpec(2, (1, 1), (1, 1), (1, 1), 1, False, (0, 0))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).eval()
    p = Q.prepare(torch.nn.Sequential(Q.QuantStub(), conv, Q.DeQuantStub()).eval(), Q.get_default_qconfig())
    x = torch.randn(2, 4, 6, 6)
    p(x)
    m = Q.convert(p)
    c = m[1]
    qx = m[0](x)
    args = (qx.int_repr(), qx.scale, qx.zero_point, c.weight_int8, c.weight_scale, c.weight_zero_point, c.bias,
            c.scale, c.zero_point, cfg)
    want = c(qx).int_repr()
    made = []
    real = kernel_ops._spec
    monkeypatch.setattr(kernel_ops, "_spec", lambda *a: made.append(a) or real(*a))
    for _ in range(3):
        assert torch.equal(torch.ops.lowbit.qconv_cfg(*args), want)
    assert made == []  # (the op's spec is the parsed one)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, dynamic=False)


@pytest.mark.skipif(not native.available(), reason="without lowbit.native the stub and the add are other programs "
                    "(lowbit::quantize, inductor's integer kernels)")
def test_compiled_smallcnn_runs_only_its_ops_and_the_dequantize(smallcnn: tuple[torch.nn.Module, torch.Tensor]) -> None:
    """(pin) The inductor program of SmallCNN: the lowbit ops, inductor's one float kernel (the final dequantize), and
    nothing between them: no copy, clone, ``contiguous``, dtype conversion or other aten fallback."""
    m, x = smallcnn
    with torch.inference_mode():
        ref = m(x)
        got, codes = run_and_get_code(_compiled(m), x)
    assert torch.equal(got, ref)
    code = "\n".join(line for line in "\n".join(codes).splitlines() if not line.lstrip().startswith("#"))
    calls = [line.split("torch.ops.lowbit.", 1)[1].split(".", 1)[0] for line in code.splitlines()
             if "= torch.ops.lowbit." in line]
    steps = [c for c in calls if c not in ("quantize_codes", "quantize")]
    assert steps == ["qconv_cfg", "max_pool2d_codes", "qconv_cfg", "qconv_cfg", "qfunctional", "max_pool2d_codes",
                     "contiguous_codes", "qlinear", "qlinear"], calls
    assert len(calls) == len(steps) + 1  # (the stub's one quantize)
    for word in ("torch.ops.aten.", "extern_kernels.", ".copy_(", ".clone(", ".contiguous(", "as_strided("):
        assert word not in code.replace("contiguous_codes", ""), word
    assert code.count("cpp_fused_") == 2  # (its definition and its one call: the final (q - z) · s)


def test_compiled_smallcnn_guards_are_bounded(smallcnn: tuple[torch.nn.Module, torch.Tensor]) -> None:
    """(pin) One tensor guard per graph input (the input and the 34 buffers the ops read) and at most 650 guard
    entries in all (torch 2.13: ~620; each costs ~0.1-0.3 µs a call, ~3x more with the caches cold)."""
    m, x = smallcnn
    seen: list = []

    def keep(entries: list) -> list[bool]:
        seen.extend(entries)
        return [True] * len(entries)
    torch._dynamo.reset()
    c = torch.compile(m, fullgraph=True, dynamic=False, options={"guard_filter_fn": keep})
    with torch.inference_mode():
        assert torch.equal(c(x), m(x))
    tensors = [e for e in seen if e.guard_type == "TENSOR_MATCH"]
    assert len(tensors) == 35
    assert len(seen) <= 650, len(seen)


def test_exported_smallcnn_dynamic_batch_save_load_bit_identical(smallcnn: tuple[torch.nn.Module, torch.Tensor]
                                                                  ) -> None:
    """(pin) ``torch.export`` with a dynamic batch, saved and loaded: the eager codes at every batch size."""
    m, x = smallcnn
    ep = torch.export.export(copy.deepcopy(m), (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    for n in (1, 3, 8, 17):
        xb = torch.randn(n, 1, 28, 28)
        with torch.inference_mode():
            assert torch.equal(loaded(xb), m(xb)), n
