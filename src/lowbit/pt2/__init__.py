"""PyTorch 2 support: every lowbit integer step as a ``torch.library`` custom op (``torch.ops.lowbit.*``).

``QTensor`` stays a plain value object (not a ``torch.Tensor`` subclass): converted models take float
in and give float out, so QTensors live only *inside* the traced region, where dynamo and
``torch.export`` see them as the plain tensors they hold (codes, scale, zero point) — "flattened at
module boundaries". While tracing (``lowbit.compile_state.tracing()``), each integer step becomes
one custom op:

===============================  ==============================================================
``lowbit::quantize``             ``clamp(round(x / s) + z)`` per tensor or per channel
``lowbit::dequantize``           ``(q - z) · s``
``lowbit::quantize_codes``       the ``Quantize`` stub's eager pass on a float32 CPU input (native build)
``lowbit::qlinear`` / ``qconv``  int8 GEMM / convolution with the fused epilogue (``lowbit.kernels``)
``lowbit::qconv_cfg``            ``qconv`` with its grids and geometry in one string (what traces emit)
``lowbit::dynamic_linear``       per-token dynamic int8 Linear (float in, float out)
``lowbit::weight_only_linear``   group-wise int4/int8 weight-only Linear
``lowbit::qfunctional``          ``QFunctional`` add / add_relu / mul / add_scalar / mul_scalar
===============================  ==============================================================

Each op's real implementation is the eager code path itself (same kernels, same backend choice,
``kernels.counts`` still tallied), so ``torch.compile(model, fullgraph=True)`` and an exported
program (``torch.export.export`` → ``save`` → ``load``, in any process that imported ``lowbit``)
give the eager outputs bit for bit. Its fake implementation gives the output shape, dtype and
memory format (convolutions: channels-last codes, as oneDNN produces them). Packed weights are a
cache keyed on the weight tensor object (``weight_cache``), never part of the graph.

AOTInductor (``torch._inductor.aoti_compile_and_package`` of an exported program) compiles the float glue to C++ and
calls each ``lowbit::`` op through torch's proxy executor, i.e. the dispatcher and these Python implementations: the
package runs bit-identically to eager in a Python process that imported ``lowbit``; one that did not fails at
``aoti_load_package`` with torch's ``Could not find schema for lowbit::<op>`` (after a misleading "Loading outdated
pt2 file" warning), and a C++-only runtime cannot run it (no C++ kernels are registered). AOTI checks no input shape
or stride unless ``AOTI_RUNTIME_CHECK_INPUTS=1`` (torch's, for every model: a non-contiguous input can give wrong
numbers).

>>> import torch, lowbit as Q
>>> q = torch.ops.lowbit.quantize(torch.tensor([0.26, -1.0]), torch.tensor(0.1), torch.tensor(0), "qint8:-128:127", None)
>>> q.tolist()
[3, -10]
"""

from __future__ import annotations

from . import kernel_ops, module_ops, quant_ops
from .kernel_ops import weight_cache

__all__ = ["weight_cache", "kernel_ops", "module_ops", "quant_ops"]
