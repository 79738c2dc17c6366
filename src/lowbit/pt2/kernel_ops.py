"""``lowbit::qlinear`` / ``lowbit::qconv``: the ``lowbit.kernels`` interface as custom ops.

Inputs are the plain tensors of the ``QTensor``s (codes, scale, zero point; grids as
``qdtype_key`` strings) and of the output grid (``out_scale``/``out_zero_point``, ``None`` for a
float output)::

    qlinear: (*, K) codes, (N, K) int8 weight  ->  (*, N) codes on the output grid (or float32)
    qconv:   (N, C, *spatial) codes             ->  (N, C_out, *spatial_out) codes, channels-last

The real implementation calls ``kernels.linear`` / ``kernels.conv`` (backend chosen at run time,
``use_backend`` pins honoured, ``counts`` tallied) with the packed weight cached per weight tensor
object (``weight_cache``: the same buffer object comes back on every call of a compiled or
exported program; ``cached_weight``: what the cache's entries hold in its place); with no backend
pinned, a per-tensor CPU ``qlinear`` runs the eager module's own ``kernels.plan.linear_plan`` (the
same codes, ~50 µs less per call at small M on the AVX2 EPYC), and ``qconv`` its
``kernels.conv_plan`` where it makes one (the same oneDNN call), kept in that cache; both enter their plan's lane
first (``kernels.lane``: the eager module's route, only what can change between calls checked).

>>> import torch, lowbit as Q
>>> from lowbit.pt2 import weight_cache
>>> w = torch.ones(2, 3, dtype=torch.int8)
>>> weight_cache(w) is weight_cache(w)
True
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from .. import kernels
from ..compile_state import qdtype_from_key
from ..kernels import ConvSpec, OutGrid
from ..kernels.conv_plan import conv_plan
from ..kernels.plan import layer_key, linear_plan
from ..qtensor import QTensor
from .checks import check_conv, check_geometry, check_linear, check_weight
from .fast_entry import arm as _arm_fast, call as _fast_call
from .quant_ops import define

__all__ = ["weight_cache", "conv_out_shape"]  # (cached_weight: the ops' internal, no argument checks)


def checked_weight(op: str, weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   bias: torch.Tensor | None, dim: int, axis: int = 0, groups: int = 1
                   ) -> tuple[dict[str, Any], torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``cached_weight(weight)`` and the grid ``(w_scale, w_zero_point, bias)`` the op must use, after ``check_weight``,
    which runs again only for other grid / bias objects, another geometry (``dim``, ``axis``, ``groups``) or a ``.data``
    swap of the weight (the cache starts afresh). Its entry holds the grid and bias tensors, as the plans do (never the
    weight: see ``cached_weight``), and copies of them: other objects with their values (``same_values``) give the
    copies back, so the plans keyed on the grid's identities stay valid. AOTInductor (and inductor's freezing) inline a
    1-d constant of at most 8 values (a per-channel grid or bias of a layer with <= 8 output channels) as a kernel that
    fills a fresh buffer on every call: without the copies every such layer built its plan (packed its weight) again
    on every call of an AOTI-compiled program."""
    cache, held = cached_weight(weight)
    grid, geometry = (w_scale, w_zero_point, bias), (dim, axis, groups)
    hit = cache.get("pt2.checked")
    if hit is None or hit[0] is not w_scale or hit[1] is not w_zero_point or hit[2] is not bias or hit[3] != geometry:
        if hit is not None and hit[3] == geometry and same_values(hit[4], grid):
            return cache, held, hit[4]
        check_weight(op, weight, w_scale, w_zero_point, bias, dim, axis, weight.shape[1] * groups if axis == 1 else None)
        cache["pt2.checked"] = (w_scale, w_zero_point, bias, geometry, held_copies(grid))
    return cache, held, grid  # type: ignore[return-value]


def held_copies(tensors: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    """Copies of ``tensors`` that only a cache holds (nothing writes them: ``same_values`` compares with them)."""
    return tuple(None if t is None else t.detach().clone() for t in tensors)


def same_values(held: tuple[torch.Tensor | None, ...], given: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether ``given`` holds ``held``'s values, tensor for tensor (dtype, shape, device and ``torch.equal``; ``None``
    only for ``None``).

    >>> same_values((torch.ones(3), None), (torch.ones(3), None)), same_values((torch.ones(3),), (torch.ones(3).long(),))
    (True, False)
    """
    return all((h is None) == (g is None) and (h is None or (h.dtype == g.dtype and h.shape == g.shape  # type: ignore[union-attr]
                                                          and h.device == g.device and torch.equal(h, g)))  # type: ignore[arg-type]
               for h, g in zip(held, given, strict=True))


_CACHES: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def weight_cache(weight: torch.Tensor) -> dict[str, Any]:
    """The packed-weight cache dict of this weight tensor object (dropped when the tensor dies)."""
    key = id(weight)
    hit = _CACHES.get(key)
    if hit is not None and hit[0]() is weight:
        return hit[1]

    def drop(ref: weakref.ref, key: int = key, caches: dict = _CACHES) -> None:  # bound now: safe at exit
        if caches.get(key, (None,))[0] is ref:
            del caches[key]

    cache: dict[str, Any] = {}
    _CACHES[key] = (weakref.ref(weight, drop), cache)
    return cache


def cached_weight(weight: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """``weight``'s cache and the tensor its entries (plans, packs, modules) must hold instead of ``weight``:
    ``weight.detach()``, made once per cache (the same storage and version counter, another Python object).

    The cache lives while ``weight`` does, so an entry that held ``weight`` itself kept its own key alive: until
    session 29 the Linears (static, dynamic, weight-only) of a compiled or exported program were never freed. A
    ``.data =`` swap changes the storage without a version bump: the held tensor then no longer starts where
    ``weight`` does, and the cache starts afresh (~0.5 µs a call; a swap to another view at the same address is not
    detected). So it does when ``weight``'s version moved (an in-place write: ``copy_``, ``load_state_dict``): a
    compiled or exported program runs the ops below autograd's ``ADInplaceOrView`` key, where ``detach()`` makes a
    tensor with a version counter of its own, so the entries' version keys on the held tensor never moved and a
    compiled model kept computing with the packs of the old weight codes.

    >>> import torch
    >>> w = torch.ones(2, 3, dtype=torch.int8)
    >>> cache, held = cached_weight(w)
    >>> held is not w and held.data_ptr() == w.data_ptr() and cached_weight(w)[1] is held
    True
    """
    cache = weight_cache(weight)
    held = cache.get("weight")
    version = -1 if weight.is_inference() else weight._version
    # (.get: another thread's clear below may run between these reads; shape and stride: ~1.2 µs more a call, not
    if held is None or held.data_ptr() != weight.data_ptr() or cache.get("version") != version:  # compared)
        cache.clear()
        held = cache["weight"] = weight.detach()
        cache["version"] = version
    return cache, held


@functools.lru_cache(maxsize=256)
def _qdtype(key: str) -> Any:
    """``qdtype_from_key`` once per key: the same ``QDtype`` object on every call (the lane compares it by identity;
    a narrowed grid, ``with_range``, is a new object per parse)."""
    return qdtype_from_key(key)


def _out_grid(scale: torch.Tensor | None, zero_point: torch.Tensor | None, qdtype: str) -> OutGrid | None:
    if scale is None or zero_point is None:
        return None
    s, z = scale.to(torch.float32).reshape(()), zero_point.to(torch.int64).reshape(())
    return OutGrid(float(s), int(z), qdtype_from_key(qdtype), s, z)


def _storage(qdtype: str, has_out: bool) -> torch.dtype:
    return qdtype_from_key(qdtype).storage if has_out else torch.float32


def _linear_plan(cache: dict[str, Any], x_qdtype: str, weight: torch.Tensor, w_scale: torch.Tensor,
                 w_zero_point: torch.Tensor, w_qdtype: str, bias: torch.Tensor | None, out_scale: torch.Tensor,
                 out_zero_point: torch.Tensor, out_qdtype: str, relu: bool) -> Any:
    """The eager layer's ``kernels.plan.linear_plan`` for these buffers (``None``: the generic path), kept in the
    weight's cache for the buffers' identities and versions, the grids and the CPU's VNNI (as the module keeps it)."""
    key = (x_qdtype, w_qdtype, out_qdtype, relu, *layer_key(weight, w_scale, w_zero_point, bias, out_scale,
                                                         out_zero_point))
    hit = cache.get("pt2.linear_plan")
    if hit is None or hit[0] != key:
        wq = QTensor._trusted(weight, w_scale, w_zero_point, qdtype_from_key(w_qdtype), axis=0)
        out = _out_grid(out_scale, out_zero_point, out_qdtype)
        run = linear_plan(wq, bias, out, relu, qdtype_from_key(x_qdtype))  # type: ignore[arg-type]
        # the buffers ride along: while the plan holds them, their ids cannot be reused
        hit = cache["pt2.linear_plan"] = (key, run, (w_scale, w_zero_point, bias, out_scale, out_zero_point))
    return hit[1]


def _conv_plan(cache: dict[str, Any], x_qdtype: str, weight: torch.Tensor, w_scale: torch.Tensor,
               w_zero_point: torch.Tensor, w_qdtype: str, bias: torch.Tensor | None, out_scale: torch.Tensor,
               out_zero_point: torch.Tensor, out_qdtype: str, relu: bool, spec: ConvSpec) -> Any:
    """The eager conv module's ``kernels.conv_plan`` for these buffers and this geometry (``None``: the generic path),
    kept in the weight's cache as ``_linear_plan`` keeps the Linear's."""
    key = (x_qdtype, w_qdtype, out_qdtype, relu, spec, *layer_key(weight, w_scale, w_zero_point, bias, out_scale,
                                                               out_zero_point))
    hit = cache.get("pt2.conv_plan")
    if hit is None or hit[0] != key:
        wq = QTensor._trusted(weight, w_scale, w_zero_point, qdtype_from_key(w_qdtype), axis=0)
        run = conv_plan(wq, bias, _out_grid(out_scale, out_zero_point, out_qdtype), relu, qdtype_from_key(x_qdtype),
                        spec)
        hit = cache["pt2.conv_plan"] = (key, run, (w_scale, w_zero_point, bias, out_scale, out_zero_point))
    return hit[1]


def qlinear(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
            weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str,
            bias: torch.Tensor | None, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None,
            out_qdtype: str, relu: bool) -> torch.Tensor:
    hit = _CACHES.get(id(weight))  # the fast entry (fast_entry, as qconv_cfg's): the lane's call after identity checks
    if (hit is not None and hit[0]() is weight and x_scale.dim() == 0 == x_zero_point.dim()
            and x_scale.dtype == torch.float32 and x_zero_point.dtype == torch.int64):  # (the full body's lane terms)
        fast = _fast_call(hit[1].get((x_qdtype, w_qdtype, out_qdtype, relu)), x, x_scale, x_zero_point, weight,
                          w_scale, w_zero_point, bias, out_scale, out_zero_point)
        if fast is not None:
            return fast[0].int_repr().contiguous()
    given = (weight, w_scale, w_zero_point, bias)
    cache, weight, (w_scale, w_zero_point, bias) = checked_weight("qlinear", weight, w_scale, w_zero_point, bias, 2)
    check_linear("qlinear", x, x_scale, x_zero_point, x_qdtype, weight, out_scale, out_zero_point)
    if (out_scale is not None and out_zero_point is not None and x.is_cpu and x.dim() and x.numel()
            and kernels.get_backend() is None and x_scale.numel() == 1):  # the eager module's plan (its floor)
        run = _linear_plan(cache, x_qdtype, weight, w_scale, w_zero_point, w_qdtype, bias, out_scale, out_zero_point,
                           out_qdtype, relu)
        if run is not None:
            if (x_scale.dim() == 0 == x_zero_point.dim() and x_scale.dtype == torch.float32
                    and x_zero_point.dtype == torch.int64 and x_scale.device == x.device == x_zero_point.device):
                # the eager module's own entry (run_qt, the plan's lane first): its route, its codes, and after the
                # first call on this input grid only what can change between calls is checked (kernels.lane)
                xq = QTensor._trusted(x, x_scale, x_zero_point, _qdtype(x_qdtype))
                y = run.lane(xq)
                if y is None:
                    y = run.qt(xq)
                else:  # (keyed by the grid strings and relu: the rest of the plan's key is the entry's own)
                    _arm_fast(cache, (x_qdtype, w_qdtype, out_qdtype, relu), run.lane, xq._qdtype, given,
                              (w_scale, w_zero_point, bias, out_scale, out_zero_point), None)
                return y.int_repr().contiguous()
            return run(x, x_scale.item(), int(x_zero_point.item())).int_repr().contiguous()
    xq = QTensor._trusted(x, x_scale, x_zero_point, qdtype_from_key(x_qdtype))
    wq = QTensor._trusted(weight, w_scale, w_zero_point, qdtype_from_key(w_qdtype), axis=0)
    out = _out_grid(out_scale, out_zero_point, out_qdtype)
    y = kernels.linear(xq, wq, bias, out, relu, cache)
    return (y.int_repr() if isinstance(y, QTensor) else y).contiguous()


def _qlinear_fake(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str, weight: torch.Tensor,
      w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str, bias: torch.Tensor | None,
      out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None, out_qdtype: str,
      relu: bool) -> torch.Tensor:
    check_weight("qlinear", weight, w_scale, w_zero_point, bias, 2)
    check_linear("qlinear", x, x_scale, x_zero_point, x_qdtype, weight, out_scale, out_zero_point)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=_storage(out_qdtype, out_scale is not None))


def conv_out_shape(x_shape: Any, w_shape: Any, spec: ConvSpec) -> list[Any]:
    """``(N, C_out, *spatial_out)`` of a (transposed) convolution (``ConvSpec`` geometry)."""
    spatial = []
    for i in range(spec.dim):
        n, k = x_shape[2 + i], w_shape[2 + i]
        s, p, d = spec.stride[i], spec.padding[i], spec.dilation[i]
        if spec.transposed:
            spatial.append((n - 1) * s - 2 * p + d * (k - 1) + spec.output_padding[i] + 1)
        else:
            spatial.append((n + 2 * p - d * (k - 1) - 1) // s + 1)
    c_out = w_shape[1] * spec.groups if spec.transposed else w_shape[0]
    return [x_shape[0], c_out, *spatial]


def _conv_layout(t: torch.Tensor, dim: int, nlc: bool) -> torch.Tensor:
    """``t`` (a conv's output, real or fake) in the layout the eager oneDNN route gives: channels-last for 2-d and 3-d,
    ``(N, C, L)`` with strides ``(L·C, 1, C)`` for 1-d with ``nlc`` (a 1-d conv runs as a channels-last 2-d one). The
    layout is no detail: float reductions after the dequantize (``mean``, ``sum``) add in memory order, so contiguous
    1-d codes gave a compiled ``mean`` 3e-8 off eager's. Without ``nlc`` (the legacy ``qconv`` op, a ten-field
    ``qconv_cfg`` string: programs traced before) 1-d codes stay contiguous, the strides those programs' compiled
    kernels (AOTInductor, inductor's caches) were built to read."""
    if dim == 1:
        return t.transpose(1, 2).contiguous().transpose(1, 2) if nlc else t.contiguous()
    return t.contiguous(memory_format=torch.channels_last if dim == 2 else torch.channels_last_3d)


def _spec(stride: list[int], padding: list[int], dilation: list[int], groups: int, transposed: bool,
          output_padding: list[int]) -> ConvSpec:
    return ConvSpec(len(stride), tuple(stride), tuple(padding), tuple(dilation), groups, transposed,
                    tuple(output_padding))


def _qconv(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
           weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str,
           bias: torch.Tensor | None, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None,
           out_qdtype: str, relu: bool, stride: list[int], padding: list[int], dilation: list[int], groups: int,
           transposed: bool, output_padding: list[int], checked_spec: ConvSpec | None = None,
           nlc: bool = False, config: str | None = None) -> torch.Tensor:
    """``qconv`` / ``qconv_cfg`` (``op``: the name its errors give; ``qconv_cfg`` gives ``checked_spec``, the geometry's
    ``ConvSpec`` made and checked once per config string: ~2 µs a call less than making it here, and its ``config``,
    under which a call the plan's lane served keeps the fast entry ``qconv_cfg`` tries first: ``_arm_fast``)."""
    spec = checked_spec
    if spec is None:
        spec = _spec(stride, padding, dilation, groups, transposed, output_padding)
        check_geometry(op, spec)
    given = (weight, w_scale, w_zero_point, bias)
    cache, weight, (w_scale, w_zero_point, bias) = checked_weight(op, weight, w_scale, w_zero_point, bias, spec.dim + 2,
                                                                  1 if transposed else 0, groups)
    check_conv(op, x, x_scale, x_zero_point, x_qdtype, weight, out_scale, out_zero_point, spec)
    xq = QTensor._trusted(x, x_scale, x_zero_point, _qdtype(x_qdtype))  # (one QDtype object per key: the lane's)
    if (out_scale is not None and out_zero_point is not None and x.is_cpu and x.numel()
            and kernels.get_backend() is None and x_scale.numel() == 1):  # the eager module's plan (its floor)
        run = _conv_plan(cache, x_qdtype, weight, w_scale, w_zero_point, w_qdtype, bias, out_scale, out_zero_point,
                         out_qdtype, relu, spec)
        if run is not None:
            # the eager module's route: the plan's lane first (armed by run's last call on this input grid and shape:
            # the same oneDNN call on the same pack, only what can change between calls checked), then run
            lane = getattr(run, "lane", None)  # (every conv plan has one; the small pass's since session 51)
            y = None if lane is None else lane(xq)
            if y is None:
                y = run(xq)
            elif config is not None:  # (a stale entry replaced: the plan may be another since)
                _arm_fast(cache, config, lane, xq._qdtype, given, (w_scale, w_zero_point, bias, out_scale,
                                                                   out_zero_point), (spec.dim, nlc))
            return _conv_layout(y.int_repr(), spec.dim, nlc)
    wq = QTensor._trusted(weight, w_scale, w_zero_point, qdtype_from_key(w_qdtype), axis=1 if transposed else 0)
    out = _out_grid(out_scale, out_zero_point, out_qdtype)
    y = kernels.conv(xq, wq, bias, spec, out, relu, cache)
    return _conv_layout(y.int_repr() if isinstance(y, QTensor) else y, spec.dim, nlc)


def _qconv_fake_op(op: str, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
      weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str, bias: torch.Tensor | None,
      out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None, out_qdtype: str, relu: bool,
      stride: list[int], padding: list[int], dilation: list[int], groups: int, transposed: bool,
      output_padding: list[int], nlc: bool = False) -> torch.Tensor:
    spec = _spec(stride, padding, dilation, groups, transposed, output_padding)
    check_geometry(op, spec)
    check_weight(op, weight, w_scale, w_zero_point, bias, spec.dim + 2, 1 if transposed else 0,
                 weight.shape[1] * groups if transposed and weight.dim() > 1 else None)
    check_conv(op, x, x_scale, x_zero_point, x_qdtype, weight, out_scale, out_zero_point, spec)
    shape = conv_out_shape(x.shape, weight.shape, spec)
    dtype = _storage(out_qdtype, out_scale is not None)
    return _conv_layout(x.new_empty(shape, dtype=dtype), spec.dim, nlc)


def qconv(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
          weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str,
          bias: torch.Tensor | None, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None,
          out_qdtype: str, relu: bool, stride: list[int], padding: list[int], dilation: list[int], groups: int,
          transposed: bool, output_padding: list[int]) -> torch.Tensor:
    return _qconv("qconv", x, x_scale, x_zero_point, x_qdtype, weight, w_scale, w_zero_point, w_qdtype, bias, out_scale,
                  out_zero_point, out_qdtype, relu, stride, padding, dilation, groups, transposed, output_padding)


def _qconv_fake(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, x_qdtype: str,
                weight: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, w_qdtype: str,
                bias: torch.Tensor | None, out_scale: torch.Tensor | None, out_zero_point: torch.Tensor | None,
                out_qdtype: str, relu: bool, stride: list[int], padding: list[int], dilation: list[int], groups: int,
                transposed: bool, output_padding: list[int]) -> torch.Tensor:
    return _qconv_fake_op("qconv", x, x_scale, x_zero_point, x_qdtype, weight, w_scale, w_zero_point, w_qdtype, bias,
                          out_scale, out_zero_point, out_qdtype, relu, stride, padding, dilation, groups, transposed,
                          output_padding)


_GRIDS = ("Tensor x, Tensor x_scale, Tensor x_zero_point, str x_qdtype, Tensor weight, Tensor w_scale, "
          "Tensor w_zero_point, str w_qdtype, Tensor? bias, Tensor? out_scale, Tensor? out_zero_point, "
          "str out_qdtype, bool relu")
define(f"qlinear({_GRIDS}) -> Tensor", qlinear, _qlinear_fake)
define(f"qconv({_GRIDS}, int[] stride, int[] padding, int[] dilation, int groups, bool transposed, "
       "int[] output_padding) -> Tensor", qconv, _qconv_fake)


@functools.lru_cache(maxsize=512)
def _parsed(config: str) -> tuple[Any, ...]:
    """``compile_state.conv_config``'s string back to ``qconv``'s arguments (parsed once per distinct string)."""
    parts = config.split("|")
    nlc = len(parts) == 11 and parts[10] == "nlc" and "," not in parts[4]  # (a 1-d conv traced since session 43)
    if len(parts) != 10 and not nlc:
        raise ValueError(f"lowbit::qconv_cfg: config={config!r} is not conv_config's ten '|'-separated fields "
                         "(eleven for a 1-d conv: 'nlc' last)")
    x_qd, w_qd, out_qd, relu, stride, padding, dilation, groups, transposed, output_padding = parts[:10]

    def ints(v: str) -> list[int]:
        return [int(t) for t in v.split(",")] if v else []
    args = (x_qd, w_qd, out_qd, relu == "1", ints(stride), ints(padding), ints(dilation), int(groups),
            transposed == "1", ints(output_padding))
    spec = _spec(*args[4:])
    check_geometry("qconv_cfg", spec)
    return (*args, nlc, spec)


def _cfg_args(config: str) -> tuple[tuple[str, str, str, bool], tuple[Any, ...], bool, ConvSpec]:
    """``(grids and relu, geometry lists, nlc, the checked ConvSpec)`` of a ``qconv_cfg`` string (cached per string:
    the lists are shared, never written)."""
    x_qd, w_qd, out_qd, relu, *geometry, nlc, spec = _parsed(config)
    return (x_qd, w_qd, out_qd, relu), tuple(geometry), nlc, spec


def qconv_cfg(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, weight: torch.Tensor,
              w_scale: torch.Tensor, w_zero_point: torch.Tensor, bias: torch.Tensor | None, out_scale: torch.Tensor | None,
              out_zero_point: torch.Tensor | None, config: str) -> torch.Tensor:
    hit = _CACHES.get(id(weight))  # the fast entry (fast_entry): the lane's call after identity and version checks
    fast = _fast_call(None if hit is None or hit[0]() is not weight else hit[1].get(config), x, x_scale, x_zero_point,
                      weight, w_scale, w_zero_point, bias, out_scale, out_zero_point)
    if fast is not None:
        y, (dim, nlc) = fast
        return _conv_layout(y.int_repr(), dim, nlc)
    (x_qd, w_qd, out_qd, relu), geometry, nlc, spec = _cfg_args(config)
    return _qconv("qconv_cfg", x, x_scale, x_zero_point, x_qd, weight, w_scale, w_zero_point, w_qd, bias, out_scale,
                  out_zero_point, out_qd, relu, *geometry, checked_spec=spec, nlc=nlc, config=config)


def _qconv_cfg_fake(x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, weight: torch.Tensor,
      w_scale: torch.Tensor, w_zero_point: torch.Tensor, bias: torch.Tensor | None, out_scale: torch.Tensor | None,
      out_zero_point: torch.Tensor | None, config: str) -> torch.Tensor:
    (x_qd, w_qd, out_qd, relu), geometry, nlc, _ = _cfg_args(config)
    return _qconv_fake_op("qconv_cfg", x, x_scale, x_zero_point, x_qd, weight, w_scale, w_zero_point, w_qd, bias,
                          out_scale, out_zero_point, out_qd, relu, *geometry, nlc=nlc)


# what traced convs emit since session 21: qconv's 19 arguments boxed by the dispatcher cost ~13 µs per call (a no-op
# op timed with them, Zen 4 EPYC), these 10 ~5 (the int lists and strings are the costly ones); qconv stays registered
# for programs exported before
define("qconv_cfg(Tensor x, Tensor x_scale, Tensor x_zero_point, Tensor weight, Tensor w_scale, Tensor w_zero_point, "
       "Tensor? bias, Tensor? out_scale, Tensor? out_zero_point, str config) -> Tensor", qconv_cfg, _qconv_cfg_fake)
