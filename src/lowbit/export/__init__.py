"""Deployment export: QDQ ONNX files for converted and prepared/QAT lowbit models.

``from lowbit.export import to_onnx`` (needs ``pip install lowbit[onnx]``; onnx and onnxruntime are
imported only when called).

>>> from lowbit.export import to_onnx, run_onnx
>>> callable(to_onnx) and callable(run_onnx)
True
"""

from .onnx import run_onnx, to_onnx

__all__ = ["run_onnx", "to_onnx"]
