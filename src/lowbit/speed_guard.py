"""Speed guard: keep a quantized layer only where its int8 kernel beats its float twin on this machine.

Whether int8 pays depends on the CPU (VNNI or not), the layer shape and the batch: on AVX2-only
x86 CPUs an 8-bit × 8-bit layer needs two exact oneDNN calls (see ``lowbit.kernels.onednn``), and
at tiny shapes the per-call overhead of quantize → kernel → requantize exceeds a float GEMM.
``keep_faster`` measures instead of guessing:

1. one run of ``qmodel(*example_inputs)`` with forward pre-hooks captures every quantized layer's
   real input (static ``Linear``/``Conv*`` and dynamic ``Linear``);
2. each layer is timed against its **replacement**: the float twin (the module at the same path of
   ``float_model``, cleaned of observers; QAT modules via ``to_float()``) fed with the dequantized
   input, its output re-quantized onto the layer's output grid for the next int8 layer
   (``FloatFallback``); a dynamic layer's replacement is the float module itself;
3. with ``t_int8`` and ``t_float`` the medians over ``rounds`` interleaved rounds and
   ``ratio = median_r(t_float / t_int8)`` (> 1: int8 is faster), the layer stays int8 iff
   ``ratio > margin``; otherwise it is swapped for its replacement (in place);
4. layers interact (a float conv hands the next int8 conv another memory layout, neighbours
   requantize), so the model with all swaps is timed against the all-int8 model on the same
   inputs (timer name ``"<model>"``); unless it is faster, every swap is reverted.

The result has the same interface: every replacement takes what the layer took and returns what
it returned (a ``QTensor`` on the same grid, or float), so the model still runs unchanged.
``get_speed_qconfig()`` is the companion recipe: 7-bit activations on CPUs without VNNI, which
makes one oneDNN call exact for every int8 weight (about 2x faster there than 8-bit activations).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> fmodel = nn.Sequential(nn.Linear(8, 8))
>>> qmodel = Q.quantize_dynamic(fmodel)
>>> fake = lambda name, run_int8, run_float: (2e-3, 1e-3)       # (int8 s, float s): float wins
>>> report = keep_faster(qmodel, fmodel, torch.randn(4, 8), timer=fake)
>>> [(d.layer, d.kept) for d in report.decisions], type(report.model[0]).__name__
([('0', False)], 'Linear')
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .fake_quant import FakeQuantize
from .kernels import onednn
from .nn.quantized._weighted import WeightedQuantModule
from .nn.quantized.dynamic.linear import Linear as DynamicLinear
from .nn.quantized.stubs import Quantize
from .observer.base import ObserverBase
from .qconfig import QConfig, get_default_qconfig
from .qscheme import QDtype, quint8
from .qtensor import QTensor

__all__ = ["Decision", "FloatFallback", "SpeedReport", "get_speed_qconfig", "keep_faster"]

Timer = Callable[[str, Callable[[], Any], Callable[[], Any]], tuple[float, float]]
_QUANT_LAYERS = (WeightedQuantModule, DynamicLinear)


@dataclass
class Decision:
    """One layer: its input shape, median ms per call of int8 and of the float replacement, the ratio."""

    layer: str
    kind: str
    shape: tuple[int, ...] | None
    int8_ms: float | None
    float_ms: float | None
    ratio: float | None  # median of per-round t_float / t_int8 (> 1: int8 is faster)
    kept: bool
    note: str = ""


@dataclass
class SpeedReport:
    """``decisions`` per quantized layer and ``model``: the (possibly new root) model after swapping."""

    decisions: list[Decision] = field(default_factory=list)
    model: nn.Module | None = None
    model_ms: tuple[float, float] | None = None  # whole model: (all int8, with the swaps) when any was tried

    @property
    def swapped(self) -> list[str]:
        return [d.layer for d in self.decisions if not d.kept]

    def __str__(self) -> str:
        lines = [(f"speed guard: {len(self.decisions) - len(self.swapped)} int8 layers kept, "
                  f"{len(self.swapped)} swapped back to float"),
                 (f"  {'layer':24s} {'kind':16s} {'input shape':18s} {'int8 ms':>9s} {'float ms':>9s} "
                  f"{'ratio':>6s}  kept")]
        if self.model_ms is not None:
            lines.append(f"  whole model: all int8 {self.model_ms[0]:.3f} ms, with swaps {self.model_ms[1]:.3f} ms")
        for d in self.decisions:
            f = (lambda v: "-" if v is None else f"{v:.3f}")
            lines.append(f"  {d.layer or '<root>':24s} {d.kind:16s} {d.shape!s:18s} {f(d.int8_ms):>9s} "
                         f"{f(d.float_ms):>9s} {'-' if d.ratio is None else f'{d.ratio:.2f}':>6s}  "
                         f"{'int8' if d.kept else 'float'}{'  (' + d.note + ')' if d.note else ''}")
        return "\n".join(lines)


def run_in_own_dtype(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a float layer inside an int8 model: ``x`` cast to the layer's parameter dtype (a model
    moved with ``.double()`` / ``.half()`` moves its float layers, while its int8 layers keep computing in
    float32), the result cast back to ``x``'s dtype (what the int8 layer it stands for would give)."""
    w = next(module.parameters(), None)
    if w is None or not w.is_floating_point() or not x.is_floating_point() or w.dtype == x.dtype:
        return module(x)
    return module(x.to(w.dtype)).to(x.dtype)


def requant_grid(requant: Quantize | None) -> tuple[float, int, QDtype] | None:
    """A float layer's output grid ``(scale, zero_point, qdtype)`` from its ``Quantize`` child (``None``: float out)."""
    return None if requant is None else (float(requant.scale), int(requant.zero_point), requant.qdtype)


class FloatFallback(nn.Module):
    """A float module in an int8 model: ``quantize(float_module(x̂), out grid)`` (or float output).

    ``x̂`` is the dequantized input when a ``QTensor`` arrives (a float input is used as is); with
    ``out = (scale, zero_point, qdtype)`` the result is re-quantized onto that grid, so the next
    int8 layer sees exactly the kind of input the replaced layer produced. The grid is a ``Quantize`` child
    (``requant``: buffers, so it travels in ``state_dict``); the module runs in its own dtype (``run_in_own_dtype``).
    """

    def __init__(self, module: nn.Module, out: tuple[float, int, QDtype] | None, channels_last: bool = False) -> None:
        super().__init__()
        self.module = module
        self.add_module("requant", None if out is None else Quantize(*out))
        self.channels_last = channels_last  # the replaced int8 conv returned channels-last codes: keep that layout

    @property
    def out(self) -> tuple[float, int, QDtype] | None:
        """The output grid ``(scale, zero_point, qdtype)``, or None (float output)."""
        return requant_grid(self.requant)

    def forward(self, x: Any) -> Any:
        xf = x.dequantize() if isinstance(x, QTensor) else x
        if self.channels_last and xf.dim() == 4:
            xf = xf.contiguous(memory_format=torch.channels_last)
        y = run_in_own_dtype(self.module, xf)
        return y if self.requant is None else self.requant(y)

    def extra_repr(self) -> str:
        out = self.out
        return "float output" if out is None else f"out scale={out[0]:.4g}, zero_point={out[1]}"


def get_speed_qconfig(vnni: bool | None = None) -> QConfig:
    """The default static recipe, with 7-bit activations (``quint8.with_range(0, 127)``) without VNNI.

    ``vnni=None`` asks the CPU (``kernels.onednn.has_vnni()``). Without VNNI, 7-bit activations let
    oneDNN make one exact call per layer for any int8 weight instead of two (``reduce_range``);
    the cost is one bit of activation resolution (measured in ``benchmarks/README.md``).

    >>> get_speed_qconfig(vnni=False).activation().qdtype
    lowbit.quint8[0, 127]
    """
    if vnni is not None and not isinstance(vnni, bool):
        raise TypeError(f"get_speed_qconfig: vnni must be a bool or None, got {vnni!r}")
    base = get_default_qconfig()
    if onednn.has_vnni() if vnni is None else vnni:
        return base
    act = base.activation
    if isinstance(act, functools.partial):
        act = functools.partial(act.func, *act.args, **{**act.keywords, "qdtype": quint8.with_range(0, 127)})
    return QConfig(activation=act, weight=base.weight)


def _float_twin(mod: nn.Module) -> nn.Module:
    """A clean float copy of a prepared module: no observers, no lowbit hooks, QAT → float."""
    twin = copy.deepcopy(mod)
    to_float = getattr(twin, "to_float", None)
    if callable(to_float) and hasattr(twin, "weight_fake_quant"):
        twin = to_float()
    for m in twin.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for key in [k for k, h in hooks.items() if str(getattr(h, "__module__", "")).startswith("lowbit.workflow")]:
                del hooks[key]
        for name in ("activation_post_process", "input_activation_post_process"):
            if isinstance(m._modules.get(name), (ObserverBase, FakeQuantize)):
                del m._modules[name]
    return twin.eval()


_GEOMETRY = ("in_features", "out_features", "in_channels", "out_channels", "kernel_size", "stride", "padding",
             "dilation", "groups")


def _check_twin(name: str, qmod: nn.Module, fmod: nn.Module) -> None:
    """The float module at ``name`` must be the layer ``qmod`` was converted from: a weighted layer of the same geometry
    (a swap to anything else would change the model's output)."""
    fw = getattr(fmod, "weight", None)
    if not isinstance(fw, torch.Tensor):
        inner = next((m for m in fmod.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)), None)
        fw = None if inner is None else inner.weight
        fmod = fmod if inner is None else inner
    differs = [g for g in _GEOMETRY if hasattr(qmod, g) and hasattr(fmod, g) and getattr(qmod, g) != getattr(fmod, g)
               and not isinstance(getattr(fmod, g), str)]  # (padding="same" is a tuple once quantized)
    qdev = next((t.device for t in (*qmod.parameters(), *qmod.buffers())), None)
    if fw is not None and (fw.is_meta or (qdev is not None and fw.device != qdev)):  # (timed: it must compute)
        raise ValueError(f"keep_faster: float_model's {name or '<root>'!r} ({type(fmod).__name__}) is on {fw.device}, "
                         f"the quantized {type(qmod).__name__} on {qdev}; pass the float model with its weights on "
                         f"the quantized model's device")
    if fw is None or differs:
        raise ValueError(f"keep_faster: float_model's {name or '<root>'!r} ({type(fmod).__name__}) is not the layer the "
                         f"quantized {type(qmod).__name__} was converted from"
                         + (f" ({', '.join(f'{g} {getattr(fmod, g)} != {getattr(qmod, g)}' for g in differs)})"
                            if differs else " (it has no weight)"))


def _default_timer(rounds: int, min_time: float = 0.005) -> Timer:
    def timer(name: str, run_int8: Callable[[], Any], run_float: Callable[[], Any]) -> tuple[float, float]:
        fns = (run_int8, run_float)
        counts = []
        for f in fns:
            f()
            t = time.perf_counter()
            f()
            counts.append(max(1, int(min_time / max(time.perf_counter() - t, 1e-9))))
        ti: list[float] = []
        tf: list[float] = []
        for r in range(rounds):  # interleaved, order alternating
            for j in ((0, 1) if r % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                for _ in range(counts[j]):
                    fns[j]()
                (ti if j == 0 else tf).append((time.perf_counter() - t) / counts[j])
        import statistics  # (here: its decimal / fractions imports cost ~5 ms of every `import lowbit`)
        ratio = statistics.median(b / a for a, b in zip(ti, tf))
        return statistics.median(ti), statistics.median(ti) * ratio  # float time consistent with the ratio
    return timer


def _capture_inputs(qmodel: nn.Module, example_inputs: tuple[Any, ...]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    handles = []
    for name, m in qmodel.named_modules():
        if isinstance(m, _QUANT_LAYERS):
            def hook(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                if args and name not in seen:
                    seen[name] = args[0]
            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            qmodel(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _replacement(qmod: nn.Module, twin: nn.Module, x: Any) -> nn.Module:
    if not isinstance(qmod, WeightedQuantModule):  # dynamic: float in, float out
        return twin
    scale, zero_point = qmod._buffers["scale"], qmod._buffers["zero_point"]
    assert scale is not None and zero_point is not None  # registered by WeightedQuantModule
    with torch.inference_mode():
        y = qmod(x)
    codes = y.int_repr() if isinstance(y, QTensor) else y
    cl = codes.dim() == 4 and codes.is_contiguous(memory_format=torch.channels_last) and not codes.is_contiguous()
    if cl:
        twin = twin.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return FloatFallback(twin, (float(scale), int(zero_point), qmod.out_qdtype), channels_last=cl)


def _set(model: nn.Module, name: str, mod: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    model.get_submodule(parent_name)._modules[attr] = mod


def keep_faster(qmodel: nn.Module, float_model: nn.Module, example_inputs: Any, rounds: int = 5,
                margin: float = 1.0, timer: Timer | None = None) -> SpeedReport:
    """Swap each quantized layer of ``qmodel`` (in place) back to float where int8 is not faster.

    ``float_model``: the float (or prepared, observers are ignored) model ``qmodel`` came from;
    layers are matched by module path. ``example_inputs``: a tensor or a tuple of positional
    arguments of ``qmodel``, with the real shapes. A layer stays int8 iff ``t_float / t_int8 >
    margin``. ``timer(name, run_int8, run_float) -> (int8 s, float s)`` replaces the built-in
    interleaved timer (for tests); it is also called with ``name="<model>"`` for the whole-model
    check. Returns a ``SpeedReport``; use ``report.model`` (the root itself is replaced when it is
    a quantized layer).
    """
    if not isinstance(qmodel, nn.Module) or not isinstance(float_model, nn.Module):
        raise TypeError(f"keep_faster: qmodel and float_model must be nn.Modules, got "
                        f"{type(qmodel).__name__} and {type(float_model).__name__}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"keep_faster: rounds={rounds!r} must be a positive int")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin < float("inf"):
        raise ValueError(f"keep_faster: margin={margin!r} must be a positive finite number")
    if timer is not None and not callable(timer):
        raise TypeError(f"keep_faster: timer={timer!r} must be callable or None")
    if isinstance(example_inputs, bool) or example_inputs is None:  # (convert's speed_check=True read as a switch)
        raise TypeError(f"keep_faster: example_inputs={example_inputs!r}: pass the model's example inputs (a tensor or "
                        "a tuple of positional arguments)")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if not args:
        raise ValueError("keep_faster: example_inputs is empty")
    for i, a in enumerate(args):  # a layer timed on no element measures call overhead only: its decision is noise
        if isinstance(a, torch.Tensor) and a.numel() == 0:
            raise ValueError(f"keep_faster: example_inputs[{i}] of shape {tuple(a.shape)} holds no element; time the "
                             "layers on a real batch")
    timer = timer or _default_timer(rounds)
    floats = dict(float_model.named_modules())
    report = SpeedReport(model=qmodel)
    layers = [(n, m) for n, m in qmodel.named_modules() if isinstance(m, _QUANT_LAYERS)]
    for name, qmod in layers:
        if name not in floats:
            raise ValueError(f"keep_faster: float_model has no module {name or '<root>'!r} matching the "
                             f"quantized {type(qmod).__name__}")
        _check_twin(name, qmod, floats[name])
    modes = {m: m.training for m in qmodel.modules()}
    qmodel.eval()  # the timing runs must not update a float BatchNorm's statistics or draw dropout masks
    try:
        return _keep_faster(qmodel, floats, layers, args, margin, timer, report)
    finally:
        for m, training in modes.items():
            m.training = training


def _check_times(times: Any, name: str) -> tuple[float, float]:
    if (not isinstance(times, (tuple, list)) or len(times) != 2
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf for t in times)):
        raise ValueError(f"keep_faster: timer returned {times!r} for {name!r}; it must return two positive finite "
                         "seconds (int8, float)")
    return times[0], times[1]


def _keep_faster(qmodel: nn.Module, floats: dict[str, nn.Module], layers: list[tuple[str, nn.Module]],
                 args: tuple[Any, ...], margin: float, timer: Timer, report: SpeedReport) -> SpeedReport:
    inputs = _capture_inputs(qmodel, args)
    swaps: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, qmod in layers:
        kind = type(qmod).__name__ + (" (dynamic)" if isinstance(qmod, DynamicLinear) else "")
        if name not in inputs:
            report.decisions.append(Decision(name, kind, None, None, None, None, True, "not run"))
            continue
        x = inputs[name]
        repl = _replacement(qmod, _float_twin(floats[name]), x)
        with torch.inference_mode():
            times = timer(name, functools.partial(qmod, x), functools.partial(repl, x))
        t_int8, t_float = _check_times(times, name)
        ratio = t_float / t_int8
        kept = ratio > margin
        report.decisions.append(Decision(name, kind, tuple(x.shape), t_int8 * 1e3, t_float * 1e3, ratio, kept))
        if not kept:
            swaps[name] = (qmod, repl)
    if not swaps:
        return report
    if "" in swaps:  # the root is the only quantized layer
        report.model = swaps[""][1]
        return report

    def run(use_float: bool) -> Any:
        for n, (q, r) in swaps.items():
            _set(qmodel, n, r if use_float else q)
        return qmodel(*args)

    # layers interact (layouts, requantization between neighbours): the swapped model must win as a whole
    try:
        with torch.inference_mode():
            t_int8, t_mixed = _check_times(timer("<model>", functools.partial(run, False),
                                                 functools.partial(run, True)), "<model>")
    except BaseException:
        for n, (q, _) in swaps.items():  # the timer may have left the swaps in place: the caller's model stays int8
            _set(qmodel, n, q)
        raise
    report.model_ms = (t_int8 * 1e3, t_mixed * 1e3)
    if not t_int8 / t_mixed > 1.0:
        for d in report.decisions:
            if d.layer in swaps:
                d.kept, d.note = True, "reverted: the whole model was not faster"
        run(False)
    else:
        run(True)
    return report
