"""Fake quantization: observer + fake quantize with a straight-through gradient, the modules of QAT.

Each module computes ``y = (clamp(round(x / s) + z, qmin, qmax) - z) * s`` with
``dy/dx = 1[qmin <= round(x / s) + z <= qmax]``; they differ in where ``(s, z)`` come from:

- ``base.py``       FakeQuantize (the wrapped observer's grid) and the ``model.apply`` switches
- ``learnable.py``  LearnableFakeQuantize (LSQ/LSQ+: ``s``, ``z`` trained by gradient)
- ``lsq.py``        fake_quantize_learnable, the LSQ/LSQ+ forward and gradients ``LearnableFakeQuantize`` runs
- ``fused.py``      FusedMovingAvgObsFakeQuantize (torch's fused observe + fake-quant kernel)
- ``fixed.py``      FixedQParamsFakeQuantize (a grid fixed at construction, as for sigmoid / tanh outputs)
- ``switches.py``   the switches' and saved grid's load checks, and the traced switch assertion

``from lowbit.fake_quant import FakeQuantize`` and ``lowbit.FakeQuantize`` name the same class.

>>> import torch, lowbit as Q
>>> from lowbit.fake_quant import FixedQParamsFakeQuantize
>>> m = FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=0.5, zero_point=0))
>>> m(torch.tensor([0.3, 0.9, 500.0])).tolist()                   # quint8: codes 1, 2, 255
[0.5, 1.0, 127.5]
"""

from .base import FakeQuantize, disable_fake_quant, disable_observer, enable_fake_quant, enable_observer
from .fixed import FixedQParamsFakeQuantize
from .fused import FusedMovingAvgObsFakeQuantize, choose_qparams_fbgemm, fused_moving_avg_obs_fake_quant
from .learnable import (
    LearnableFakeQuantize,
    enable_param_learning,
    enable_static_estimate,
    enable_static_observation,
    fake_quantize_learnable,
)

__all__ = ["FakeQuantize", "enable_observer", "disable_observer", "enable_fake_quant", "disable_fake_quant",
           "FixedQParamsFakeQuantize", "FusedMovingAvgObsFakeQuantize", "choose_qparams_fbgemm",
           "fused_moving_avg_obs_fake_quant", "LearnableFakeQuantize", "fake_quantize_learnable",
           "enable_param_learning", "enable_static_estimate", "enable_static_observation"]
