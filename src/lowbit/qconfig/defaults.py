"""The default recipes: ``get_default_qconfig`` (static PTQ), ``get_default_qat_qconfig``, min/max,
LSQ, fused QAT, dynamic and embedding recipes, and the default ``QConfigMapping``s.

>>> import lowbit as Q
>>> qc = Q.get_default_qconfig()
>>> type(qc.activation()).__name__, type(qc.weight()).__name__
('HistogramObserver', 'PerChannelMinMaxObserver')

``backend=`` takes torch.ao's names and gives torch.ao's recipe for that engine (observer classes,
grids and schemes as ``torch.ao.quantization.get_default_qconfig(backend)``): ``"x86"`` / ``"fbgemm"``
observe activations on the 7-bit ``reduce_range`` grid ``quint8[0, 127]``; ``"onednn"`` and
``"qnnpack"`` on the full ``quint8[0, 255]`` grid (``"qnnpack"`` with per-tensor symmetric weights).
Without ``backend`` lowbit's own default stays: 8-bit activations (torch.ao's no-argument default is x86).

>>> Q.get_default_qconfig("x86").activation().qdtype
lowbit.quint8[0, 127]
"""

from __future__ import annotations

from typing import Any

import torch

from ..fake_quant import FakeQuantize
from ..observer.fixed import NoopObserver, PlaceholderObserver
from ..observer.histogram import HistogramObserver
from ..observer.minmax import MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver
from ..qscheme import (QDtype, as_qdtype, per_channel_affine, per_channel_affine_float_qparams, per_channel_symmetric,
                       per_tensor_affine, per_tensor_symmetric, qint8, quint4, quint8)
from .config import QConfig
from .mapping import QConfigMapping

__all__ = [
    "get_default_qconfig", "get_default_qat_qconfig", "get_default_qconfig_mapping", "get_default_qat_qconfig_mapping",
    "get_minmax_qconfig", "get_dynamic_qconfig", "get_lsq_qat_qconfig", "get_fused_qat_qconfig",
    "get_embedding_qconfig", "get_embedding_qat_qconfig",
]


BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")  # torch.ao's engine names, in its order


def _backend_grid(fn: str, backend: Any, version: Any, versions: tuple[int, ...]) -> QDtype:
    """The activation grid of ``backend``'s recipe (torch.ao's reduce_range on x86/fbgemm); checks the arguments."""
    if isinstance(version, bool) or version not in versions:
        raise ValueError(f"{fn}: version={version!r} is not supported; use one of {list(versions)}")
    if backend is None:
        return quint8
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{fn}: backend={backend!r} is not supported; use one of {list(BACKENDS)} "
                         "(torch.ao's engines) or None (lowbit's default recipe)")
    return quint8.with_range(0, 127) if backend in ("x86", "fbgemm") else quint8


def get_default_qconfig(backend: str | None = None, version: int = 0) -> QConfig:
    """Static PTQ: histogram-calibrated per-tensor affine activations, per-channel symmetric qint8 weights.

    ``backend=None``: lowbit's recipe, 8-bit ``quint8`` activations (exact on every CPU; without VNNI
    the int8 kernels split them or the weights into 7-bit halves, ``lowbit.kernels.avx2``). ``backend``
    in ``"x86"``, ``"fbgemm"``, ``"onednn"``, ``"qnnpack"`` (``version`` 0): torch.ao's recipe for that
    engine, activations on ``quint8[0, 127]`` (x86/fbgemm, ``reduce_range=True``: one exact call without
    VNNI, one bit of resolution less) or ``quint8[0, 255]``; qnnpack weights are one per-tensor symmetric
    qint8 grid.

    >>> get_default_qconfig("qnnpack").weight().qscheme.value
    'per_tensor_symmetric'
    """
    act = _backend_grid("get_default_qconfig", backend, version, (0,))
    weight = (MinMaxObserver.with_args(qscheme=per_tensor_symmetric, qdtype=qint8) if backend == "qnnpack" else
              PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8))
    return QConfig(activation=HistogramObserver.with_args(qscheme=per_tensor_affine, qdtype=act), weight=weight)


def get_default_qat_qconfig(backend: str | None = None, version: int = 1) -> QConfig:
    """QAT: the static recipe's grids behind ``FakeQuantize``.

    ``backend=None`` (lowbit's recipe; ``version`` is not used): activations use a moving-average
    min/max (c = 0.01) on ``quint8``; weights use the seeds' cumulative ``PerChannelMinMaxObserver``
    (torch uses a moving-average per-channel observer here). With a torch.ao ``backend`` (see
    ``get_default_qconfig``): torch.ao's recipe, ``version=1`` on the fused observe + fake-quant module
    (``FusedMovingAvgObsFakeQuantize``), ``version=0`` on ``FakeQuantize``; moving-average observers on
    both sides, activations on the backend's grid, weights per channel (qnnpack: per tensor) symmetric.

    >>> fq = get_default_qat_qconfig("x86").activation()
    >>> type(fq).__name__, fq.qdtype
    ('FusedMovingAvgObsFakeQuantize', lowbit.quint8[0, 127])
    """
    act = _backend_grid("get_default_qat_qconfig", backend, version, (0, 1))
    if backend is None:
        return QConfig(
            activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine,
                                              qdtype=quint8),
            weight=FakeQuantize.with_args(observer=PerChannelMinMaxObserver, ch_axis=0,
                                          qscheme=per_channel_symmetric, qdtype=qint8),
        )
    from ..fake_quant import FusedMovingAvgObsFakeQuantize
    from ..observer.minmax import MovingAveragePerChannelMinMaxObserver

    fq: Any = FusedMovingAvgObsFakeQuantize if version == 1 else FakeQuantize
    weight = (fq.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_symmetric, qdtype=qint8)
              if backend == "qnnpack" else
              fq.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme=per_channel_symmetric,
                           qdtype=qint8))
    return QConfig(activation=fq.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine, qdtype=act),
                   weight=weight)


def get_minmax_qconfig() -> QConfig:
    """Static PTQ with plain min/max activations: the recipe that matches ``torch.ao`` numerics exactly."""
    return QConfig(
        activation=MinMaxObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_lsq_qat_qconfig() -> QConfig:
    """QAT with learned step sizes (LSQ): ``LearnableFakeQuantize`` with gradient scaling on both sides.

    Activations per-tensor affine quint8 (moving-average min/max initialises scale and zero point),
    weights per-channel symmetric qint8 (min/max initialises the scales). The qparams follow the
    observers until ``model.apply(lowbit.fake_quant.enable_param_learning)``.

    >>> import lowbit as Q
    >>> type(Q.get_lsq_qat_qconfig().weight()).__name__
    'LearnableFakeQuantize'
    """
    from ..fake_quant import LearnableFakeQuantize

    return QConfig(
        activation=LearnableFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine,
                                                   qdtype=quint8, use_grad_scaling=True),
        weight=LearnableFakeQuantize.with_args(observer=PerChannelMinMaxObserver, ch_axis=0,
                                               qscheme=per_channel_symmetric, qdtype=qint8, use_grad_scaling=True),
    )


def get_fused_qat_qconfig() -> QConfig:
    """QAT on torch's fused observe + fake-quant kernel (``FusedMovingAvgObsFakeQuantize``), as torch.ao's
    default fused recipe: moving-average per-tensor affine quint8 activations, moving-average per-channel
    symmetric qint8 weights (c = 0.01).

    >>> import lowbit as Q
    >>> type(Q.get_fused_qat_qconfig().activation()).__name__
    'FusedMovingAvgObsFakeQuantize'
    """
    from ..fake_quant import FusedMovingAvgObsFakeQuantize
    from ..observer.minmax import MovingAveragePerChannelMinMaxObserver

    return QConfig(
        activation=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver,
                                                           qscheme=per_tensor_affine, qdtype=quint8),
        weight=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0,
                                                       qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_dynamic_qconfig(dtype: QDtype | str | torch.dtype = qint8, *, backend: str | None = None,
                        reduce_range: bool = False) -> QConfig:
    """Dynamic quantization: activations quantized per batch at runtime, weights ahead of time.

    ``dtype=qint8``: quint8 activations (``PlaceholderObserver(is_dynamic=True)``: the range is
    measured on each batch, one grid per token) and per-channel symmetric qint8 weights (torch's default
    dynamic recipe is per tensor). ``dtype=torch.float16``: float16 weight storage, float activations — torch's
    ``float16_dynamic_qconfig`` (``PlaceholderObserver`` with ``qdtype=torch.float16`` on both sides);
    ``quantize_dynamic`` with it builds the same modules as ``quantize_dynamic(..., dtype=torch.float16)``.

    ``reduce_range=True``: the same per-token recipe on 7-bit activations ``quint8[0, 127]`` (one exact
    int8 call on CPUs without VNNI, one bit of resolution less). ``backend="x86"`` / ``"fbgemm"``:
    torch.ao's ``default_dynamic_qconfig`` as those engines run it (``reduce_range=True``): one 7-bit grid
    per input tensor (``PlaceholderObserver(per_token=False)``) and per-tensor symmetric qint8 weights —
    the dynamic ``Linear`` then computes torch.ao's outputs bit for bit, through torch.ao's own op on x86.
    The 7-bit recipes are the dynamic ``Linear`` / ``LinearReLU``'s; dynamic RNNs and cells keep per-token 8-bit.

    >>> import torch, lowbit as Q
    >>> qc = Q.get_dynamic_qconfig(torch.float16)
    >>> qc.weight().qdtype, qc.activation().is_dynamic
    (torch.float16, True)
    >>> qc = Q.get_dynamic_qconfig(backend="x86")
    >>> qc.activation().qdtype, qc.activation().per_token, qc.weight().qscheme.value
    (lowbit.quint8[0, 127], False, 'per_tensor_symmetric')
    """
    if backend is not None and backend not in ("x86", "fbgemm"):
        raise ValueError(f"get_dynamic_qconfig: backend={backend!r} is not supported; use 'x86' or 'fbgemm' "
                         "(torch.ao's default_dynamic_qconfig on those engines) or None (lowbit's per-token recipe)")
    if not isinstance(reduce_range, bool):
        raise TypeError(f"get_dynamic_qconfig: reduce_range={reduce_range!r} must be a bool")
    if dtype in (torch.float16, "float16"):
        if backend is not None or reduce_range:
            raise ValueError("get_dynamic_qconfig: dtype=torch.float16 has float activations; "
                             f"backend={backend!r} / reduce_range={reduce_range!r} do not apply")
        return QConfig(
            activation=PlaceholderObserver.with_args(qdtype=torch.float16, is_dynamic=True),
            weight=PlaceholderObserver.with_args(qdtype=torch.float16),
        )
    if as_qdtype(dtype) != qint8:
        raise ValueError(f"get_dynamic_qconfig: dtype={dtype!r} is not supported; use qint8 or torch.float16")
    if backend is not None:
        return QConfig(
            activation=PlaceholderObserver.with_args(qdtype=quint8.with_range(0, 127), is_dynamic=True,
                                                     per_token=False),
            weight=MinMaxObserver.with_args(qscheme=per_tensor_symmetric, qdtype=qint8),
        )
    return QConfig(
        activation=PlaceholderObserver.with_args(qdtype=quint8.with_range(0, 127) if reduce_range else quint8,
                                                 is_dynamic=True),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
    )


def _embedding_bits(fn: str, bits: Any, float_qparams: Any = False) -> QDtype:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):
        raise ValueError(f"{fn}: bits={bits!r} must be 8 or 4")
    if not isinstance(float_qparams, bool):  # ('no' was truthy: torch.ao's float-qparams recipe, not the one asked)
        raise TypeError(f"{fn}: float_qparams={float_qparams!r} must be True or False")
    return quint8 if bits == 8 else quint4


def get_embedding_qconfig(bits: int = 8, float_qparams: bool = False) -> QConfig:
    """Weight-only embeddings, as ``torch.ao``'s ``float_qparams_weight_only_qconfig``: one grid per table row.

    Weights: per-row (``ch_axis=0``) affine min/max on ``quint8`` (``bits=8``) or ``quint4`` (``bits=4``,
    packed two per byte by ``nnq.Embedding``); the output stays float, so the activation entry is a
    ``NoopObserver`` (never inserted for embeddings). By default the zero point is an integer code, as
    everywhere else in lowbit (the range widened to include 0); ``float_qparams=True`` is torch.ao's
    recipe exactly: ``per_channel_affine_float_qparams``, ``s = (max - min) / (qmax - qmin)``, float
    ``z = -min / s`` (same codes and outputs as torch.ao's quantized Embedding/EmbeddingBag).

    >>> import torch, lowbit as Q
    >>> emb = torch.nn.Sequential(torch.nn.Embedding(10, 8))
    >>> emb[0].qconfig = Q.get_embedding_qconfig(4)
    >>> Q.convert(Q.prepare(emb))[0]
    Embedding(10, 8, qdtype=lowbit.quint4, qscheme=per_row_affine)
    """
    qdtype = _embedding_bits("get_embedding_qconfig", bits, float_qparams)
    qscheme = per_channel_affine_float_qparams if float_qparams else per_channel_affine
    return QConfig(
        activation=NoopObserver.with_args(),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=qscheme, qdtype=qdtype),
    )


def get_embedding_qat_qconfig(bits: int = 8, float_qparams: bool = False) -> QConfig:
    """QAT embeddings (``nn.qat.Embedding`` / ``EmbeddingBag``): the table fake-quantized per row on every step.

    As ``torch.ao``'s ``default_embedding_qat_qconfig``: a ``FakeQuantize`` over a memoryless
    (``averaging_constant=1``) per-row moving-average min/max, so each step's grid is the current
    table's; ``bits`` and ``float_qparams`` as in ``get_embedding_qconfig``.

    >>> import lowbit as Q
    >>> fq = Q.get_embedding_qat_qconfig(4, float_qparams=True).weight()
    >>> fq.qdtype, fq.qscheme.value, fq.zero_point.dtype
    (lowbit.quint4, 'per_channel_affine_float_qparams', torch.float32)
    """
    from ..observer.minmax import MovingAveragePerChannelMinMaxObserver

    qdtype = _embedding_bits("get_embedding_qat_qconfig", bits, float_qparams)
    qscheme = per_channel_affine_float_qparams if float_qparams else per_channel_affine
    return QConfig(
        activation=NoopObserver.with_args(),
        weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme=qscheme,
                                      qdtype=qdtype, averaging_constant=1.0),
    )


# torch.ao's fixed-qparams ops (its default mappings' object types; method calls such as ``x.sigmoid()`` resolve as
# ``torch.sigmoid`` in graph mode), each with its output range [lo, hi]: the grid is quint8 with ``scale = (hi - lo) /
# 256`` and ``lo`` on code 0 (sigmoid / hardsigmoid / softmax: 1/256, zero point 0; tanh: 2/256, zero point 128)
_FIXED_QPARAMS_OPS: tuple[tuple[Any, float, float], ...] = (
    (torch.nn.Hardsigmoid, 0.0, 1.0), (torch.nn.functional.hardsigmoid, 0.0, 1.0),
    (torch.nn.Sigmoid, 0.0, 1.0), (torch.sigmoid, 0.0, 1.0),
    (torch.nn.Softmax, 0.0, 1.0),
    (torch.nn.Tanh, -1.0, 1.0), (torch.tanh, -1.0, 1.0),
)


def _with_fixed_qparams(global_qconfig: QConfig, qat: bool) -> QConfigMapping:
    """``global_qconfig`` as the global setting, plus torch.ao's fixed output grids for sigmoid / hardsigmoid /
    softmax / tanh: ``FixedQParamsObserver`` (``FixedQParamsFakeQuantize`` for QAT) with the global weight recipe."""
    from ..fake_quant import FixedQParamsFakeQuantize
    from ..observer.fixed import FixedQParamsObserver

    mapping = QConfigMapping().set_global(global_qconfig)
    for op, lo, hi in _FIXED_QPARAMS_OPS:
        scale = (hi - lo) / 256
        obs = FixedQParamsObserver.with_args(scale=scale, zero_point=int(round(-lo / scale)), qdtype=quint8)
        act = FixedQParamsFakeQuantize.with_args(observer=obs) if qat else obs
        mapping.set_object_type(op, QConfig(activation=act, weight=global_qconfig.weight))
    return mapping


def get_default_qconfig_mapping(backend: str | None = None, version: int = 0) -> QConfigMapping:
    """``get_default_qconfig(backend, version)`` as the global setting, and torch.ao's fixed output grids for
    ``nn.Sigmoid`` / ``torch.sigmoid``, ``nn.Hardsigmoid`` / ``F.hardsigmoid``, ``nn.Softmax`` (quint8, scale 1/256,
    zero point 0) and ``nn.Tanh`` / ``torch.tanh`` (scale 2/256, zero point 128), as torch.ao's mapping pins them.

    >>> m = get_default_qconfig_mapping()
    >>> obs = m.object_type_qconfigs[torch.tanh].activation()
    >>> type(obs).__name__, obs.scale.item(), obs.zero_point.item()
    ('FixedQParamsObserver', 0.0078125, 128)
    """
    return _with_fixed_qparams(get_default_qconfig(backend, version), qat=False)


def get_default_qat_qconfig_mapping(backend: str | None = None, version: int = 1) -> QConfigMapping:
    """``get_default_qat_qconfig(backend, version)`` as the global setting, and the fixed output grids of
    ``get_default_qconfig_mapping`` behind ``FixedQParamsFakeQuantize`` (torch.ao's QAT mapping)."""
    return _with_fixed_qparams(get_default_qat_qconfig(backend, version), qat=True)
