"""lowbit: int8 quantization for PyTorch — calibrate, convert, deploy.

``import lowbit as Q`` gives the seeds' ``quantization`` surface: schemes and dtypes,
``calculate_qparams``, quantize/dequantize/fake_quantize, ``QTensor``, observers, ``FakeQuantize``,
``QConfig``/``QConfigMapping`` and the workflows. Module families live in ``lowbit.nn``.

>>> import torch, lowbit as Q
>>> obs = Q.MinMaxObserver()
>>> _ = obs(torch.tensor([-1.0, 3.0]))
>>> [round(v.item(), 5) for v in obs.calculate_qparams()]
[0.01569, 64]
"""

from .fake_quant import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    LearnableFakeQuantize,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    fused_moving_avg_obs_fake_quant,
)
from .functional import dequantize, fake_quantize, quantize
from .qparams import QParams, calculate_qparams
from .qscheme import (
    QDtype,
    QScheme,
    per_channel_affine,
    per_channel_affine_float_qparams,
    per_channel_symmetric,
    per_tensor_affine,
    per_tensor_symmetric,
    qint4,
    qint8,
    qint32,
    quint4,
    quint8,
)
from .qtensor import QTensor, quantize_per_channel, quantize_per_tensor
from .observer import (
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    NoopObserver,
    ObserverBase,
    EntropyObserver,
    MSEObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
    RecordingObserver,
    get_observer_dict,
    get_observer_state_dict,
    load_observer_state_dict,
    sync_observers,
)
from .qconfig import (
    QConfig,
    QConfigMapping,
    get_default_qat_qconfig,
    get_default_qat_qconfig_mapping,
    get_default_qconfig,
    get_default_qconfig_mapping,
    get_dynamic_qconfig,
    get_embedding_qat_qconfig,
    get_embedding_qconfig,
    get_fused_qat_qconfig,
    get_lsq_qat_qconfig,
    get_minmax_qconfig,
    qconfig_equals,
)
from .recipes import get_accurate_qconfig, get_calibration_qconfig
from .algorithms.smoothquant import smooth_quant
from .algorithms.float_output import fuse_dequantize
from .algorithms.best_of import best_of_ranges
from .algorithms.equalize_eager import equalize
from .stubs import DeQuantStub, QuantStub, QuantWrapper
from .fuse import fuse_modules, fuse_modules_qat
from .mappings import (
    ConvertReport,
    get_default_dynamic_quant_module_mappings,
    get_default_qat_module_mappings,
    get_default_static_quant_module_mappings,
)
from .workflow import (
    convert,
    freeze_bn_stats,
    prepare,
    prepare_qat,
    propagate_qconfig_,
    quantize_dynamic,
    update_bn_stats,
)
from .quantize_api import quantize_qat
from .fx import FxReport, convert_fx, fuse_fx, prepare_fx, prepare_qat_fx
from .custom_config import ConvertCustomConfig, FuseCustomConfig, PrepareCustomConfig
from .fusion_registry import register_fusion_pattern, unregister_fusion_pattern
from .reference import convert_to_reference_fx, lower_reference
from .weight_only import quantize_weight_only
from .ptq import PTQReport, quantize_ptq
from . import llm
from .llm import quantize_llm, quantize_w8a8
from .nn.intrinsic.qat.modules import set_bn_fold_mode
from .nn.qat.dynamic import get_dynamic_qat_qconfig
from .runtime import keep_freed_memory
from . import pt2  # noqa: F401  registers the torch.ops.lowbit custom ops (torch.compile / torch.export)

__version__ = "0.1.0"

__all__ = [
    # schemes and dtypes
    "QScheme", "QDtype", "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
    "per_channel_symmetric", "per_channel_affine_float_qparams", "qint8", "quint8", "qint32", "qint4", "quint4",
    # numerics
    "QParams", "calculate_qparams", "quantize", "dequantize", "fake_quantize",
    "QTensor", "quantize_per_tensor", "quantize_per_channel",
    # observers and fake quantization
    "ObserverBase", "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver", "FixedQParamsObserver", "PlaceholderObserver", "NoopObserver",
    "sync_observers", "HistogramObserver", "PercentileObserver", "EntropyObserver", "MSEObserver",
    "FakeQuantize", "enable_observer", "disable_observer", "enable_fake_quant", "disable_fake_quant",
    "LearnableFakeQuantize", "FusedMovingAvgObsFakeQuantize",
    "FixedQParamsFakeQuantize", "fused_moving_avg_obs_fake_quant", "RecordingObserver", "get_observer_dict",
    "get_observer_state_dict", "load_observer_state_dict",
    # configs
    "QConfig", "QConfigMapping", "get_default_qconfig", "get_default_qat_qconfig", "get_default_qconfig_mapping",
    "get_default_qat_qconfig_mapping", "get_minmax_qconfig", "get_dynamic_qconfig", "get_dynamic_qat_qconfig",
    "get_lsq_qat_qconfig", "get_fused_qat_qconfig", "qconfig_equals", "get_accurate_qconfig",
    "get_calibration_qconfig", "smooth_quant", "fuse_dequantize", "best_of_ranges", "equalize",
    # eager workflows
    "QuantStub", "DeQuantStub", "QuantWrapper", "fuse_modules", "fuse_modules_qat", "prepare", "convert",
    "prepare_qat", "quantize_dynamic", "propagate_qconfig_", "freeze_bn_stats", "update_bn_stats", "ConvertReport",
    "set_bn_fold_mode", "quantize_qat", "lower_reference",
    "get_default_static_quant_module_mappings", "get_default_qat_module_mappings",
    "get_default_dynamic_quant_module_mappings",
    # graph mode
    "prepare_fx", "prepare_qat_fx", "convert_fx", "FxReport", "fuse_fx", "convert_to_reference_fx",
    # custom configs and user fusion patterns
    "PrepareCustomConfig", "ConvertCustomConfig", "FuseCustomConfig", "register_fusion_pattern",
    "unregister_fusion_pattern",
    # weight-only (int4/int8 group-wise Linear)
    "quantize_weight_only", "get_embedding_qconfig", "get_embedding_qat_qconfig",
    # one-call PTQ with accuracy recovery (lowbit.algorithms)
    "quantize_ptq", "PTQReport",
    # LLMs: block-by-block GPTQ/AWQ, tied quantized heads, W8A8 (lowbit.llm)
    "llm", "quantize_llm", "quantize_w8a8",
    # process settings for inference speed (glibc malloc: freed memory kept for reuse)
    "keep_freed_memory",
]
