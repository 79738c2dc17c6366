"""Reference quantized models (``torch.ao``'s ``is_reference`` / ``convert_to_reference_fx`` form).

``modules``: ``QuantDeQuant`` and the weight-QDQ ``Linear``/``Conv1d-3d``/``Embedding``/``EmbeddingBag``;
``convert``: eager ``to_reference`` (``lowbit.convert(..., is_reference=True)``) and its lowering;
``fx``: ``convert_to_reference_fx`` and its lowering; ``lower``: ``lower_reference`` (either form).
"""

from .convert import lower_reference_eager, to_reference
from .fx import convert_to_reference_fx, is_reference_fx, lower_reference_fx
from .lower import lower_reference
from .modules import (
    REFERENCE_MODULES,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Embedding,
    EmbeddingBag,
    FrozenObserver,
    Linear,
    QuantDeQuant,
    weight_qparams_of,
)

__all__ = ["QuantDeQuant", "FrozenObserver", "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
           "ConvTranspose3d", "Embedding", "EmbeddingBag",
           "weight_qparams_of", "REFERENCE_MODULES", "to_reference", "lower_reference", "lower_reference_eager",
           "convert_to_reference_fx", "lower_reference_fx", "is_reference_fx"]
