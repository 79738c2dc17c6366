"""Default module swap tables of the eager workflows, and the report ``convert`` returns.

Each table maps an exact module type to the class whose ``from_float`` builds its replacement.
The getters return a fresh ``dict`` copy, so users extend a table and pass it to the workflow::

    mapping = get_default_static_quant_module_mappings()
    mapping[MyFloatLayer] = MyQuantizedLayer          # MyQuantizedLayer.from_float(mod)
    qmodel = convert(prepared, mapping=mapping)

>>> from torch import nn
>>> from lowbit.nn.quantized.linear import Linear as QLinear
>>> m = get_default_static_quant_module_mappings()
>>> m[nn.Linear] is QLinear, m is get_default_static_quant_module_mappings()
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .fusion_registry import extra_mappings
from .nn import intrinsic as nni
from .nn import qat as nnqat
from .nn.intrinsic.fold import carry_linear_bn_check
from .nn.intrinsic import qat as nniqat
from .nn.qat import dynamic as nnqatd
from .nn.quantized import activation as nnq_act
from .nn.quantized import conv as nnq_conv
from .nn.quantized import conv_transpose as nnq_convt
from .nn.quantized import dynamic as nnqd
from .nn.quantized import normalization as nnq_norm
from .nn.quantized.embedding import Embedding as QEmbedding
from .nn.quantized.embedding import EmbeddingBag as QEmbeddingBag
from .nn.quantized.functional_modules import FloatFunctional, QFunctional
from .nn.quantized.linear import Linear as QLinear
from .nn.quantized.linear import LinearReLU as QLinearReLU
from .nn.quantized.stubs import DeQuantize, Quantize
from .stubs import DeQuantStub, QuantStub

__all__ = [
    "get_default_static_quant_module_mappings",
    "get_default_qat_module_mappings",
    "get_default_dynamic_quant_module_mappings",
    "ConvertReport",
]


def get_default_static_quant_module_mappings() -> dict[type[nn.Module], type[nn.Module]]:
    """Float, fused and QAT module types → ``lowbit.nn.quantized`` classes (used by ``prepare``/``convert``).

    A standalone ``BatchNorm2d/3d`` / ``BNReLU2d/3d`` is int8 unless it normalizes with batch statistics
    (``lowbit.nn.quantized.normalization.batchnorm_float_reason``: it stays float, listed in the report)."""
    m: dict[type[nn.Module], type[nn.Module]] = {
        QuantStub: Quantize,
        DeQuantStub: DeQuantize,
        FloatFunctional: QFunctional,
        nn.Linear: QLinear, nnqat.Linear: QLinear, nniqat.LinearBn1d: QLinear,
        nni.LinearReLU: QLinearReLU, nniqat.LinearReLU: QLinearReLU,
        nn.Embedding: QEmbedding, nnqat.Embedding: QEmbedding, nn.EmbeddingBag: QEmbeddingBag,
        nnqat.EmbeddingBag: QEmbeddingBag,
    }
    for name in nnq_act.__all__:  # ReLU6, Hardswish, Hardsigmoid, ELU, LeakyReLU, Sigmoid, Tanh
        m[getattr(nn, name)] = getattr(nnq_act, name)
    for d in ("1d", "2d", "3d"):
        conv, conv_relu = getattr(nnq_conv, "Conv" + d), getattr(nnq_conv, "ConvReLU" + d)
        m[getattr(nn, "Conv" + d)] = conv
        m[getattr(nnqat, "Conv" + d)] = conv
        m[getattr(nniqat, "ConvBn" + d)] = conv
        m[getattr(nni, "ConvReLU" + d)] = conv_relu
        m[getattr(nniqat, "ConvReLU" + d)] = conv_relu
        m[getattr(nniqat, "ConvBnReLU" + d)] = conv_relu
        m[getattr(nn, "ConvTranspose" + d)] = getattr(nnq_convt, "ConvTranspose" + d)
        m[getattr(nnqat, "ConvTranspose" + d)] = getattr(nnq_convt, "ConvTranspose" + d)
        m[getattr(nniqat, "ConvTransposeBn" + d)] = getattr(nnq_convt, "ConvTranspose" + d)  # the BN folded
    for d in ("2d", "3d"):  # a BatchNorm not folded into a conv (torch.ao's default mapping has them too)
        m[getattr(nn, "BatchNorm" + d)] = getattr(nnq_norm, "BatchNorm" + d)
        m[getattr(nni, "BNReLU" + d)] = getattr(nnq_norm, "BNReLU" + d)
    m.update(extra_mappings("static"))  # fused types of user patterns (lowbit.fusion_registry)
    return m


def get_default_qat_module_mappings() -> dict[type[nn.Module], type[nn.Module]]:
    """Float and fused-marker types → QAT classes (used by ``prepare_qat``)."""
    m: dict[type[nn.Module], type[nn.Module]] = {
        nn.Linear: nnqat.Linear, nn.Embedding: nnqat.Embedding, nn.EmbeddingBag: nnqat.EmbeddingBag,
        nni.LinearReLU: nniqat.LinearReLU, nni.LinearBn1d: nniqat.LinearBn1d,
    }
    for d in ("1d", "2d", "3d"):
        m[getattr(nn, "Conv" + d)] = getattr(nnqat, "Conv" + d)
        m[getattr(nn, "ConvTranspose" + d)] = getattr(nnqat, "ConvTranspose" + d)  # weight grid along axis 1
        m[getattr(nni, "ConvTransposeBn" + d)] = getattr(nniqat, "ConvTransposeBn" + d)
        for name in ("ConvReLU", "ConvBn", "ConvBnReLU"):
            m[getattr(nni, name + d)] = getattr(nniqat, name + d)
    m.update(extra_mappings("qat"))
    return m


def get_default_dynamic_quant_module_mappings() -> dict[type[nn.Module], type[nn.Module]]:
    """Float types → ``lowbit.nn.quantized.dynamic`` classes (``from_float(mod, dtype=...)``)."""
    return {nn.Linear: nnqd.Linear, nnqatd.Linear: nnqd.Linear,
            nni.LinearReLU: nnqd.LinearReLU, nn.RNN: nnqd.RNN, nn.LSTM: nnqd.LSTM, nn.GRU: nnqd.GRU,
            nn.RNNCell: nnqd.RNNCell, nn.LSTMCell: nnqd.LSTMCell, nn.GRUCell: nnqd.GRUCell}


@dataclass
class ConvertReport:
    """What ``convert`` did: ``converted`` (path → ``"Float -> Quantized"``) and ``left_float``.

    ``left_float`` maps the path of every leaf module that had a qconfig but stayed float to its
    type name and the reason (no mapping entry, or not observed). Paths use ``"<root>"`` for the root.
    """

    converted: dict[str, str] = field(default_factory=dict)
    left_float: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"convert: {len(self.converted)} modules quantized, {len(self.left_float)} left float"]
        lines += [f"  float  {path}: {why}" for path, why in self.left_float.items()]
        return "\n".join(lines)


def copy_user_hooks(old: nn.Module, new: nn.Module, skip: tuple = ()) -> nn.Module:
    """Re-register ``old``'s forward pre-hooks and forward hooks (except the functions in ``skip``:
    the workflow's own observer hooks) on its replacement ``new``, in order, keeping their
    ``with_kwargs`` / ``always_call`` flags — as torch.ao's ``swap_module`` does, so a user's hook
    survives ``prepare_qat``, ``convert`` and ``quantize_dynamic``. Returns ``new``."""
    if new is old:
        return new
    for key, hook in old._forward_pre_hooks.items():
        if hook not in skip:
            new.register_forward_pre_hook(hook, with_kwargs=key in old._forward_pre_hooks_with_kwargs)
    for key, hook in old._forward_hooks.items():
        if hook not in skip:
            new.register_forward_hook(hook, with_kwargs=key in old._forward_hooks_with_kwargs,
                                      always_call=key in old._forward_hooks_always_called)
    return carry_linear_bn_check(old, new)  # a QAT LinearBn1d's int8 Linear refuses (N, L, F) as the QAT module did
