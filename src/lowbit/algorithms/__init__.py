"""Accuracy-recovery algorithms for post-training quantization (calibration data only, no labels).

- ``layers``: weighted layers of a prepared model, their weight codes, frozen learned codes;
- ``adaround``: learned rounding of one layer's weights (Nagel et al. 2020);
- ``layerwise``: the layer-by-layer pass (``reconstruct``) (AdaRound + empirical bias correction) on the
  quantized model's own inputs, graph or eager mode (``layerwise_step``: one layer's step and shared helpers);
- ``equalize``: cross-layer equalization with bias absorption (Nagel et al. 2019), graph mode (``equalize_pairs``:
  which pairs, and how a second layer's weights read each input channel);
- ``equalize_eager``: the same for eager models (torch.ao's ``_equalize.equalize`` signature; pairs given or found).
"""

from .adaround import adaround_codes
from .layerwise import LayerChange, reconstruct
from .layerwise_eager import reconstruct_eager

__all__ = ["adaround_codes", "reconstruct", "reconstruct_eager", "LayerChange"]
