"""The quantization methods ``lowbit quantize --method`` runs, in one registry.

A method is a function ``run(job) -> quantized model``; :class:`Job` carries the float model (a
copy the method may modify), the calibration data, labels when the method asked for them, the
parsed arguments, and ``extras`` where a method leaves things for the report (PTQ leaves its
prepared model, whose observers draw the activation histograms). Adding a method is one call::

    register_method("mine", run_mine, help="what it does", needs_labels=False)

before the parser is built (``build_parser`` reads the registry for ``--method``'s choices).

>>> sorted(METHODS)[:3]
['dynamic', 'ptq', 'qat']
>>> METHODS["qat"].needs_labels
True
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .common import CLIError, progress

__all__ = ["Job", "Method", "METHODS", "QCONFIGS", "register_method", "qconfig_for"]

#: the static recipes ``--qconfig`` accepts (its argparse choices)
QCONFIGS = ("default", "histogram", "minmax", "speed")


@dataclass
class Job:
    """What a method gets: ``fp32`` (its own copy), ``calib`` (N, ...) float inputs, ``labels`` (N,) or None."""

    fp32: nn.Module
    calib: torch.Tensor
    labels: torch.Tensor | None
    args: argparse.Namespace
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def quiet(self) -> bool:
        return bool(getattr(self.args, "quiet", False))


@dataclass(frozen=True)
class Method:
    """A registered method: ``run(job)`` returns the quantized model; ``needs_labels`` asks for ``--calib-labels``."""

    name: str
    run: Callable[[Job], nn.Module]
    help: str = ""
    needs_labels: bool = False


METHODS: dict[str, Method] = {}


def register_method(name: str, run: Callable[[Job], nn.Module], help: str = "", needs_labels: bool = False) -> None:
    """Add (or replace) the method ``name`` of ``lowbit quantize --method``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_method: name={name!r} must be an identifier-like string")
    if not callable(run):
        raise TypeError(f"register_method: run for {name!r} must be callable, got {type(run).__name__}")
    METHODS[name] = Method(name, run, help, needs_labels)


# ---------------------------------------------------------------- the built-in methods


def qconfig_for(name: str) -> Any:
    """The static PTQ recipe named by ``--qconfig``."""
    import lowbit as Q

    from ..speed_guard import get_speed_qconfig

    recipes: dict[str, Callable[[], Any]] = {"default": Q.get_default_qconfig, "histogram": Q.get_default_qconfig,
                                             "minmax": Q.get_minmax_qconfig, "speed": get_speed_qconfig}
    if name not in recipes:
        raise CLIError(f"--qconfig {name!r}: choose one of {sorted(recipes)}")
    return recipes[name]()


def _has_stubs(model: nn.Module) -> bool:
    from ..stubs import QuantStub

    return any(isinstance(m, QuantStub) for m in model.modules())


def _fusion_groups(model: nn.Module) -> list[list[str]]:
    groups = getattr(model, "fusion_groups", None)
    return groups() if callable(groups) else []


def _ptq(job: Job, batch: int = 256) -> nn.Module:
    """Fuse (when the model lists its fusion groups), prepare, calibrate, convert.

    ``--recipe accurate`` / ``balanced``: ``lowbit.quantize_ptq`` with that recipe (graph mode; accurate: fuse,
    equalize, calibrate with MSE-searched ranges unless ``--qconfig`` names other grids, AdaRound, bias
    correction; balanced: the default grids, quadratic rounding, bias correction), the same as the Python call.
    """
    import lowbit as Q

    recipe = getattr(job.args, "recipe", "default")
    if recipe in ("accurate", "balanced"):
        # --qconfig default: the recipe's own grids (accurate: MSE-searched ranges, as quantize_ptq picks);
        # a named --qconfig overrides them
        name = getattr(job.args, "qconfig", "default")
        mapping = None if name == "default" else Q.QConfigMapping().set_global(qconfig_for(name))
        # --seed seeds AdaRound's sampling too (accurate: the only recipe that reads a seed; it was always 0)
        extra = dict(distill=getattr(job.args, "distill", 0), seed=getattr(job.args, "seed", 0)) \
            if recipe == "accurate" else {}
        qmodel, report = Q.quantize_ptq(job.fp32.eval(), list(job.calib.split(batch)), recipe=recipe,
                                        qconfig_mapping=mapping, progress=not job.quiet, **extra)
        job.extras["ptq_report"] = str(report)
        return qmodel

    m = job.fp32 if _has_stubs(job.fp32) else Q.QuantWrapper(job.fp32)
    m = Q.fuse_modules(m.eval(), _fusion_groups(m)) if _fusion_groups(m) else m
    prepared = Q.prepare(m, qconfig_for(job.args.qconfig))
    with torch.no_grad():
        chunks = range(0, len(job.calib), batch)
        for i in progress(chunks, "calibrate", len(chunks), job.quiet):
            prepared(job.calib[i: i + batch])
    job.extras["prepared_ptq"] = prepared
    return Q.convert(prepared)


def _qat(job: Job) -> nn.Module:
    """Fuse for QAT, fine-tune with fake quantization (BN, then observers frozen late), convert."""
    import lowbit as Q

    from ..examples import train

    assert job.labels is not None
    m = job.fp32 if _has_stubs(job.fp32) else Q.QuantWrapper(job.fp32)
    m = Q.fuse_modules_qat(m.train(), _fusion_groups(m)) if _fusion_groups(m) else m.train()
    prepared = Q.prepare_qat(m, Q.get_default_qat_qconfig())
    bar = iter(progress(iter(int, 1), "QAT", None, job.quiet))

    def schedule(mod: nn.Module, step: int, total: int) -> None:
        next(bar)
        # the usual schedule: BN statistics, then observers, frozen for the last steps (never before step 1)
        if step == max(1, int(0.6 * total)):
            mod.apply(Q.freeze_bn_stats)
        if step == max(1, int(0.8 * total)):
            mod.apply(Q.disable_observer)

    train(prepared, job.calib, job.labels, epochs=job.args.qat_epochs, lr=2e-4, seed=1, on_step=schedule)
    return Q.convert(prepared.eval())


def _dynamic(job: Job) -> nn.Module:
    import lowbit as Q

    return Q.quantize_dynamic(job.fp32.eval())  # the default mapping: Linear, RNN/LSTM/GRU and their cells


register_method("ptq", _ptq, "static post-training quantization (calibrate on --calib)")
register_method("qat", _qat, "quantization-aware fine-tuning on --calib/--calib-labels", needs_labels=True)
register_method("dynamic", _dynamic, "dynamic quantization (int8 weights, per-batch activation ranges)")
