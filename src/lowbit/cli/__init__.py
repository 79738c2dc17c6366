"""``lowbit quantize``: quantize a model end to end and report accuracy, size and latency.

With no arguments it runs the built-in example: the small residual CNN of ``lowbit.examples``
trained on Fashion-MNIST (Debian ``dataset-fashion-mnist``; scikit-learn's 8x8 digits, upscaled,
when that package is absent), then static PTQ, QAT and dynamic quantization, and prints::

    method   accuracy  Δ vs fp32  size (KiB)  size ratio  latency ratio vs fp32 (batch 64)

It writes ``model_<method>.pt`` (state dicts that load with ``torch.load(weights_only=True)``),
``report.md`` (+ figures) and ``report.json`` (strict JSON: a missing figure is ``null``) to
``--out``. That folder is replaced as a whole once everything succeeded, or left untouched.

For your own model: ``--model pkg.module:factory [--weights w.pt] --calib data.{pt,npz,npy}|images/
[--eval x --labels y] --method ptq|qat|dynamic``. Errors are one line on stderr, exit status 2.

The package, by concern: ``common`` (the one-line error, stages, progress), ``inputs`` (model,
data, labels: loading and checks), ``methods`` (the ``--method`` registry: ``register_method``
adds one), ``measure`` (accuracy, size, latency), ``output`` (the ``--out`` folder), ``command``
(the parser, the run, ``main``).

>>> build_parser().parse_args(["quantize", "--method", "ptq"]).method
['ptq']
"""

from __future__ import annotations

from .command import build_parser, main
from .common import CLIError
from .measure import table as _table
from .methods import METHODS, Job, register_method

__all__ = ["main", "build_parser", "CLIError", "METHODS", "Job", "register_method"]
_ = _table  # kept importable as lowbit.cli._table (the report tests compare it with rows_to_markdown)
