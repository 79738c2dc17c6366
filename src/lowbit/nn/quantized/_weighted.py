"""``WeightedQuantModule``: the state, grids and per-call plan cache the static quantized Linear / Conv / ConvTranspose
modules share.

A layer holds int8 weight codes ``q_w`` with per-output-channel ``(s_w, z_w)``, a float32 ``bias`` and an output grid
``(s_y, z_y)``; for an input on ``(s_x, z_x)`` it computes ``y = clamp(round(acc · s_x s_w / s_y + b / s_y) + z_y)`` with
``acc = Σ (q_x - z_x)(q_w - z_w)`` on an exact int32 kernel (``lowbit.kernels``). Float inputs are quantized on the
grid recorded at convert (``input_scale`` / ``input_zero_point``; scale 0: per call).

>>> import torch, lowbit as Q
>>> m = Q.nn.quantized.Linear(4, 2)
>>> isinstance(m, WeightedQuantModule), sorted(m.state_dict())[:3]
(True, ['bias', 'input_scale', 'input_zero_point'])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...compile_state import tensor_version, tracing
from ... import kernels
from ...kernels import OutGrid
from ...kernels.plan import layer_key
from ...qscheme import QDtype, QScheme, as_qdtype, quint8
from ...qtensor import QTensor
from ._state import CheckedQuantState
from ._utils import (InputGrid, check_out_grid, check_precomputed_flag, float_op, output_qparams, quantize_weight,
                     weight_qparams, weight_qscheme)

__all__ = ["WeightedQuantModule"]

_compiling, _exporting = torch.compiler.is_compiling, torch.compiler.is_exporting  # (compile_state.tracing's)


class WeightedQuantModule(CheckedQuantState):
    """Base of the static quantized Linear / Conv family: the state and the packed-weight cache.

    ``state_dict``: ``weight_int8`` (int8 codes), ``weight_scale`` (float32, ``(C,)``),
    ``weight_zero_point`` (int64, ``(C,)``), ``bias`` (float32 buffer, absent without bias), and the
    output grid ``scale`` (0-d float32) / ``zero_point`` (0-d int64), and the recorded grid of float
    inputs ``input_scale`` / ``input_zero_point`` (scale 0: none). ``_cache`` holds packed
    weights and the prepared ``(weight QTensor, OutGrid)``; it is keyed on the buffers' versions and
    cleared by ``load_state_dict`` and ``.to()``, and never saved or deep-copied.
    """

    _relu = False
    _weight_axis = 0
    _float_type: type[nn.Module] = nn.Module

    def __init__(self, weight_shape: tuple[int, ...], n_bias: int, bias: bool, device: Any = None) -> None:
        super().__init__()
        c = weight_shape[self._weight_axis]
        self.register_buffer("weight_int8", torch.zeros(weight_shape, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(c, dtype=torch.float32, device=device))
        self.register_buffer("weight_zero_point", torch.zeros(c, dtype=torch.int64, device=device))
        self.register_buffer("bias", torch.zeros(n_bias, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("scale", torch.tensor(1.0, device=device))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int64, device=device))
        self.out_qdtype: QDtype = quint8
        self.weight_qdtype: QDtype = as_qdtype("qint8")
        self.weight_qscheme: QScheme = QScheme.PER_CHANNEL_SYMMETRIC
        # recorded grid for float inputs (set by convert): buffers, so it travels with state_dict;
        # input_scale == 0 means "none recorded" (float inputs are then quantized dynamically)
        self.register_buffer("input_scale", torch.tensor(0.0, device=device))
        self.register_buffer("input_zero_point", torch.tensor(0, dtype=torch.int64, device=device))
        self.input_qdtype: QDtype = quint8
        self._input_grid: InputGrid | None = None
        self._cache: dict[str, Any] = {}

    @property
    def input_grid(self) -> InputGrid | None:
        """``(scale, zero_point, qdtype)`` used to quantize float inputs, or ``None`` (dynamic)."""
        return self._input_grid

    @input_grid.setter
    def input_grid(self, grid: InputGrid | None) -> None:
        with torch.no_grad():
            if grid is None:
                self.input_scale.zero_()
                self.input_zero_point.zero_()
            else:
                scale, zero_point, qdtype = grid
                if not float(scale) > 0:
                    raise ValueError(f"{type(self).__name__}: input grid scale={scale!r} must be positive")
                self.input_scale.fill_(float(scale))
                self.input_zero_point.fill_(int(zero_point))
                self.input_qdtype = as_qdtype(qdtype)
        self._input_grid = None if grid is None else (float(grid[0]), int(grid[1]), self.input_qdtype)

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Any:
        """From a prepared float/QAT module (or a fused ``(op, ReLU)`` marker for the ReLU variants).

        Reads ``mod.qconfig.weight`` (or ``mod.weight_fake_quant``) for the weight grid, per channel
        along ``_weight_axis``, and ``mod.activation_post_process`` for the output grid.
        ``use_precomputed_fake_quant=True`` (torch.ao's argument): a QAT module's ``weight_fake_quant`` grid as it
        stands, the weight not observed again.
        """
        precomputed = check_precomputed_flag(use_precomputed_fake_quant, f"{cls.__name__}.from_float")
        op: Any = float_op(mod, cls._float_type, cls.__name__, cls._relu)
        owner = mod if hasattr(mod, "qconfig") or hasattr(mod, "weight_fake_quant") else op
        if op.bias is not None and not bool(torch.isfinite(op.bias.detach()).all()):
            raise ValueError(f"{cls.__name__}.from_float: the bias holds NaN/Inf values; the quantized layer "
                             "would turn them into finite output codes — fix or exclude this layer (qconfig None)")
        obs = weight_qparams(op.weight, owner, cls._weight_axis, cls.__name__, precomputed)
        weight = quantize_weight(op.weight, obs, cls._weight_axis)
        q = cls.from_reference(op, weight, *output_qparams(mod, cls.__name__))  # type: ignore[attr-defined]
        q.weight_qscheme = weight_qscheme(obs)
        return q

    # ---- state ----
    def set_weight_bias(self, weight: QTensor, bias: torch.Tensor | None) -> None:
        """Store a per-channel int8 weight ``QTensor`` (axis ``_weight_axis``) and a float bias."""
        where = type(self).__name__
        if not isinstance(weight, QTensor) or weight.int_repr().dtype != torch.int8:
            raise TypeError(f"{where}: weight must be a QTensor with int8 codes, got {weight!r}")
        if tuple(weight.shape) != tuple(self.weight_int8.shape):
            raise ValueError(f"{where}: weight of shape {tuple(weight.shape)} does not match "
                             f"{tuple(self.weight_int8.shape)}")
        c = weight.shape[self._weight_axis]
        scale, zp = weight.scale.reshape(-1), weight.zero_point.reshape(-1)
        if weight.axis is None:
            scale, zp = scale.expand(c), zp.expand(c)
        elif weight.axis != self._weight_axis:
            raise ValueError(f"{where}: weight must be per-channel along axis {self._weight_axis}, "
                             f"got axis={weight.axis}")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{where}: bias={'None' if bias is None else 'a tensor'} but the module was built "
                             f"with bias={self.bias is not None}")
        if bias is not None:
            bad = int((~torch.isfinite(bias.detach())).sum())
            if bad:  # (load_state_dict and from_float refuse them too: every kernel would turn them into wrong codes)
                raise ValueError(f"{where}: the bias holds {bad} NaN/Inf value(s)")
        with torch.no_grad():
            self.weight_int8.copy_(weight.int_repr())
            self.weight_scale.copy_(scale)
            self.weight_zero_point.copy_(zp)
            if bias is not None and self.bias is not None:
                self.bias.copy_(bias.detach().reshape(-1))
        self.weight_qdtype = weight.qdtype
        self._cache.clear()

    def set_output_grid(self, scale: Any, zero_point: Any, qdtype: Any = quint8) -> None:
        """Set the per-tensor output grid ``(scale, zero_point, qdtype)``."""
        s, z, dt = check_out_grid(scale, zero_point, qdtype, type(self).__name__)
        with torch.no_grad():
            self.scale.fill_(s)
            self.zero_point.fill_(z)
        self.out_qdtype = dt
        self._cache.clear()

    def weight(self) -> QTensor:
        """The int8 weight as a per-channel ``QTensor`` of copies, as torch.ao's unpacked weight: writing to its
        ``int_repr()`` or grid leaves the layer as it is (``set_weight_bias`` changes it)."""
        return QTensor(self.weight_int8.clone(), self.weight_scale.clone(), self.weight_zero_point.clone(),
                       self.weight_qdtype, self._weight_axis)

    def _weight_view(self) -> QTensor:
        """The weight ``QTensor`` viewing the buffers (the forward's: no copy)."""
        return QTensor(self.weight_int8, self.weight_scale, self.weight_zero_point, self.weight_qdtype,
                       self._weight_axis)

    def _prepared(self) -> tuple[QTensor, OutGrid]:
        """``(weight QTensor, OutGrid)``; the weight QTensor views the buffers, so only an in-place
        change of the output grid buffers needs a rebuild (``set_*``, ``load_state_dict`` and
        ``.to()`` clear the cache)."""
        buffers = self._buffers
        scale, zero_point = buffers["scale"], buffers["zero_point"]
        assert scale is not None and zero_point is not None
        if tracing():  # the traced kernels read the grid from the buffers (no Python float: export-safe)
            return self._weight_view(), OutGrid(float("nan"), 0, self.out_qdtype, scale, zero_point)
        key = (tensor_version(scale), tensor_version(zero_point))
        hit = self._cache.get("prepared")
        if hit is None or hit[0] != key:
            out = OutGrid(float(scale), int(zero_point), self.out_qdtype, scale.clone(), zero_point.clone())
            hit = (key, (self._weight_view(), out))
            self._cache["prepared"] = hit
        return hit[1]

    def _plan(self, x: QTensor, build: Any, q: torch.Tensor | None = None) -> Any:
        """The layer's eager per-call plan for input ``x`` (``build(weight, out, qdtype)`` makes it, e.g.
        ``kernels.plan.linear_plan``), or ``None`` where the generic path must run: tracing, a pinned backend,
        a per-channel, empty or non-CPU input. Kept in ``_cache`` for the buffers it was built from (identity
        and ``tensor_version``) and the input ``QDtype``; a plan that declines (``None``) is kept too. ``q``: ``x._meta``
        where the caller has read it."""
        if tracing() or kernels.get_backend() or x._axis is not None:  # (tracing first: no guard on the shape)
            return None
        if q is None:
            q = x._meta  # (the codes' shape and device: a native tensor's codes are not made here)
        if not q.is_cpu or not q.numel():
            return None
        b = self._buffers
        w, ws, wz, bias, s, z = (b["weight_int8"], b["weight_scale"], b["weight_zero_point"], b["bias"], b["scale"],
                                 b["zero_point"])
        key = layer_key(w, ws, wz, bias, s, z)  # type: ignore[arg-type]
        cache = self._cache
        hit = cache.get("plan")
        if hit is None or hit[0] != key or (hit[1] is not x._qdtype and hit[1] != x._qdtype):
            weight, out = self._prepared()
            cache.pop("lane", None)  # (the old plan's)
            # the buffers ride along: while the plan holds them, their ids cannot be reused
            hit = cache["plan"] = (key, x._qdtype, build(weight, bias, out, self._relu, x._qdtype), (w, ws, wz, bias, s, z))
        run = hit[2]
        if "lane" not in cache and run is not None and -1 not in key[7:]:  # (inference buffers keep no version)
            lane = getattr(run, "lane", None)
            if lane is not None and lane.armed():  # run_qt took a native route: later calls check less (_lane_call)
                cache["lane"] = (lane, hit[3], key[7:], key[0])
        return run

    def _lane_call(self, x: QTensor) -> Any:
        """The plan's fast lane (``kernels.lane``) for ``x``, or ``None``: not armed, the layer's buffers replaced,
        changed in place or the weight codes moved since it was armed (identity, version and address, as
        ``layer_key``), the CPU's VNNI answer changed, tracing, or a pinned backend; the lane itself returns ``None``
        for an input it does not serve."""
        if _compiling() or _exporting():  # (compile_state.tracing inlined, ~0.3 µs: first, as a traced read of the
            return None  # cache is a guard on its keys and a traced version read a data-dependent one; an eager call
        c = self._cache.get("lane")  # that armed the lane then recompiled the program)
        if c is None:
            return None
        lane, (w, ws, wz, bias, s, z), vers, vnni = c
        b = self._buffers
        if (b["weight_int8"] is not w or b["weight_scale"] is not ws or b["weight_zero_point"] is not wz
                or b["bias"] is not bias or b["scale"] is not s or b["zero_point"] is not z
                or (w._version, ws._version, wz._version, -2 if bias is None else bias._version, s._version,
                    z._version, w.data_ptr()) != vers
                or kernels.onednn.has_vnni() is not vnni or kernels.get_backend()):
            return None
        return lane(x)

    # ---- the cache is never state ----
    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._cache.clear()
        return super()._apply(fn, *args, **kwargs)  # (CheckedQuantState: .double()/.half() keep the buffers' dtypes)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._cache.clear()
        super()._load_from_state_dict(*args, **kwargs)
        scale = 0.0 if self.input_scale.is_meta else float(self.input_scale)  # (meta, assign=True: no values yet)
        self._input_grid = (scale, int(self.input_zero_point), self.input_qdtype) if scale > 0 else None
        ws, wz = self.weight_scale, self.weight_zero_point
        if not ws.is_meta and ws.numel():  # the label follows the loaded grid: a per-channel checkpoint in a per-tensor layer
            per_channel = self.weight_qscheme.is_per_channel or bool((ws != ws[0]).any() or (wz != wz[0]).any())
            symmetric = self.weight_qscheme.is_symmetric and not bool(wz.any())
            self.weight_qscheme = QScheme(f"per_{'channel' if per_channel else 'tensor'}_"
                                          f"{'symmetric' if symmetric else 'affine'}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def _grid_repr(self) -> str:
        grid = ("scale=<meta>, zero_point=<meta>" if self.scale.is_meta else  # moved to meta: still prints
                f"scale={float(self.scale):.6g}, zero_point={int(self.zero_point)}")
        return f"{grid}, dtype={self.out_qdtype!r}, qscheme={self.weight_qscheme.value}"
