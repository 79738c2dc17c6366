"""A static int8 conv's per-call work at the floor: its oneDNN call's arguments made once per layer state.

``onednn.conv`` re-derives on every call what a converted layer never changes between calls: the geometry lists,
the packed weight (a version-keyed cache look-up), whether the CPU's u8 × s8 products could saturate (the split),
the output grid's Python numbers, whether ReLU fuses, and the input grid's scale and zero point (two ``item``
reads). ``conv_plan`` decides it once, for one layer state (weight codes, scales, bias, output grid), one
geometry and one activation ``QDtype``, and returns ``run(x)`` for a per-tensor ``QTensor`` input::

    y = onednn::qconv_pointwise(codes, s_x, z_x, packed w, s_w, 0, bias, geometry, s_out, z_out, u8, relu?)

It is the very call ``onednn.conv`` makes where no split is needed (a VNNI CPU, or weights ``saturation_safe``
on a CPU without VNNI), so the codes are bit-identical to the generic path's (``tests/test_static_plan.py``);
the plan drops only re-validation and re-derivation (~30 µs per call on the Zen 4 EPYC, where the oneDNN call
itself costs ~50 µs at batch 2). The weight is packed for the input it meets (``qconv_prepack`` given the input
shape and whether ``z_x`` is non-zero; kept per shape, up to ``conv_split.SHAPED_PACKS``, by
``conv_split.packed_for_input``): packed without them, oneDNN's layout for the real input can differ, and the call then
reorders the weight on every call (``ONEDNN_VERBOSE``: a generic ``simple:any`` reorder, 1.57 ms of a 1.7 ms call
for a 64 → 384 1x1 conv at batch 8 with z_x = 0; ~35 reorders in one MobileNetV2 forward), made on a new thread
(``conv_split.in_fresh_thread``: a thread's ideep cache hands a same-shaped layer the other zero point's layout). The
layout does not change the sums, so the codes are the same. NCHW codes (a Quantize stub's output, e.g. an image) go to
channels-last memory through ``lowbit.native`` first (MobileNetV2's stem input at batch 8: ~0.3 ms against ~0.8-1.6
for the copy inside the oneDNN call). An output grid narrower than the u8 storage (a 7-bit grid) is clamped by
oneDNN's ``hardtanh`` post-op (``OutGrid.onednn_post``: the same codes as a clamp after the call) instead of a second
pass over the codes.
Off by default (``AO_MACS`` 0: slower in a whole model, the next conv's call path then cold; see there): at small
sizes (at most ``AO_MACS`` multiply-adds, batch included) the call can go through torch.ao's x86
``quantized::conv2d(_relu)`` on a pack the plan keeps (``_ao_route``): the same oneDNN convolution, but its primitive
is cached in the pack where ``qconv_pointwise`` rebuilds its descriptor per call (~10-25 µs a call less at batch 1 on
the AMX Xeon, session 50). The input codes are viewed, not copied, as a quantized tensor; the output ``QTensor`` holds
torch's result as its ``tq``. Only where a rule allows it (``_ao_geometry``, ``_ao_fits``): dense or grouped with
several channels a group (torch.ao's depthwise path, fbgemm's, saturates), groups <= 100 (torch.ao packs those for
fbgemm), no dilation, no 7-bit clamp, an AVX-512 VNNI CPU with oneDNN uncapped, each input side at least the kernel's.
Codes bit-identical to the ``qconv_pointwise`` call's (400 random geometries, session 50).
``None`` where the generic dispatcher must run: no oneDNN, a split (the weight-split convs and the native depthwise
kernel), weights with zero points, a transposed or non-2-d conv, an input grid whose codes are not u8, a float
output, a non-CPU layer. The caller keys the plan on the layer's buffers and runs it only with no backend pinned and
outside tracing; each call counts in ``kernels.counts`` as ``("onednn", "conv")``, like the generic one.

>>> import torch, lowbit as Q
>>> from lowbit.kernels import ConvSpec, OutGrid, conv_plan
>>> w = Q.quantize_per_channel(torch.ones(1, 1, 1, 1), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> run = conv_plan.conv_plan(w, None, OutGrid(0.5, 0, Q.quint8), False, Q.quint8, ConvSpec(2, (1, 1), (0, 0), (1, 1), 1))
>>> x = Q.quantize_per_tensor(torch.full((1, 1, 2, 2), 2.0), 0.1, 0, Q.quint8)   # y = 2.0 on a 0.5 grid
>>> run is None or run(x).int_repr().flatten().tolist() == [4, 4, 4, 4]
True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import native
from ..qscheme import QDtype
from ..qtensor import QTensor
from . import conv_small, isa, onednn
from .conv_split import packed_for_input
from .lane import ConvLane
from .plan import _counts, input_grid_key
from .small_m import _quantized_out
from .spec import ConvSpec, OutGrid, odd_windows, padded_windows, strided_column, wide_multiplier

__all__ = ["conv_plan"]


def _op_entry(packet: Any) -> Any:
    """``packet``'s default overload as the C++ callable its Python ``__call__`` forwards to (``OpOverload._op``: the
    same dispatcher entry, one Python frame less: ~1.2-1.8 µs a call on the Xeon), or the overload where torch has
    no such attribute."""
    ov = packet.default
    return getattr(ov, "_op", ov)


_qconv_op = _op_entry(torch.ops.onednn.qconv_pointwise) if onednn.available() else None
_ao_ops = ((torch.ops.quantized.conv2d.new._op, torch.ops.quantized.conv2d_relu.new._op)
           if onednn.available() else None)
# multiply-adds (batch included) up to which a call takes torch.ao's cached primitive (_ao_route). 0: off (the default).
# Each layer alone is 1.02-1.25x faster on it up to 32M (session 50), but the whole MobileNetV2 at batch 1 was 0.93-0.95x
# of the qconv_pointwise route: a call costs ~10-25 µs more when the conv call before it took the other path (the host
# code around the kernel runs cold; the kernel's own time, the data and the CPU state are the same), so each depthwise
# conv after a routed one pays back the saving. Sending every conv through torch.ao's cache (depthwise ones by an
# onednn-engine pack) removes that, but the model was then 1.00-1.02x (b8 0.98x): no gain to ship.
# benchmarks/conv_route_warmth.py measures both. Set it (e.g. 32_000_000) to measure it again.
AO_MACS = 0
_AO_SHAPES = 16  # input shapes whose route choice a plan keeps


def _ao_pack(w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec,
             engine_name: str = "x86") -> Any:
    """torch.ao's x86 packed weight for ``w`` (its oneDNN ``PackedConvWeightsOnednn``: an AVX-512 VNNI CPU, weight
    zero points 0, groups <= 100), prepacked under the x86 engine (or ``engine_name``: ``"onednn"`` packs depthwise
    convs for oneDNN too, ``benchmarks/conv_route_warmth.py``) whatever the thread's engine is."""
    engine = torch.backends.quantized.engine
    try:
        with warnings.catch_warnings():  # (torch's deprecation warning on quantized tensors, silenced as the routes do)
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(w, w_scale.double(), torch.zeros_like(w_scale, dtype=torch.long), 0)
        torch.backends.quantized.engine = engine_name
        return torch.ops.quantized.conv2d_prepack(qw, bias, list(spec.stride), list(spec.padding), [1, 1], spec.groups)
    finally:
        torch.backends.quantized.engine = engine


def _ao_geometry(weight_shape: torch.Size, spec: ConvSpec, relu: bool, post: str, clamp: bool) -> bool:
    """Whether the layer's geometry may take torch.ao's cached primitive (``_ao_route``): a dense or grouped (not
    depthwise, groups <= 100: torch.ao's x86 engine then packs for oneDNN) conv without dilation, its post-op none or
    ReLU, on an AVX-512 VNNI CPU whose oneDNN ISA is not capped. The input-size rule is ``_ao_fits``."""
    cout, cin_g = weight_shape[0], weight_shape[1]
    return (_ao_ops is not None and onednn.has_vnni() and "avx512_vnni" in isa._cpu_flags()
            and "x86" in torch.backends.quantized.supported_engines and cin_g > 1 and spec.groups <= 100
            and cout // spec.groups > 1 and all(d == 1 for d in spec.dilation) and not clamp
            and post == ("relu" if relu else "none"))


def _ao_fits(shape: torch.Size, weight_shape: torch.Size, spec: ConvSpec) -> bool:
    """Whether an input of ``shape`` (N, C, H, W) takes the cached primitive: each spatial size at least the kernel's
    (torch.ao's op crashed on a width-1 input under a 1x1 dilated kernel, session 49), and at most ``AO_MACS``
    multiply-adds (above it the call's fixed cost is noise and torch.ao's primitive, packed without the input's
    shape, was measured slower)."""
    n, _, h, w_ = shape
    kh, kw = weight_shape[2], weight_shape[3]
    if h < kh or w_ < kw:
        return False
    (sh, sw), (ph, pw) = spec.stride, spec.padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w_ + 2 * pw - kw) // sw + 1
    return ho > 0 and wo > 0 and n * ho * wo * weight_shape[0] * weight_shape[1] * kh * kw <= AO_MACS

def conv_plan(weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None, relu: bool, x_qdtype: QDtype,
              spec: ConvSpec) -> Callable[[QTensor], QTensor] | None:
    """``run(x)``: the layer's one oneDNN call on a per-tensor u8-coded ``x`` (module docstring), or ``None``."""
    w = weight.int_repr()
    if (out is None or spec.transposed or spec.dim != 2 or x_qdtype.storage != torch.uint8 or not onednn.available()
            or w.device.type != "cpu" or w.dtype != torch.int8 or out.qdtype.storage != torch.uint8
            or bool(weight.zero_point.any()) or padded_windows(weight.shape, spec)  # (these two: onednn.conv pads
            or wide_multiplier(weight.shape, spec, onednn.has_amx())):  # or chunks)
        return None
    counts, key = _counts(), ("onednn", "conv")
    grid: list[Any] = [None]  # (key of the input grid's tensors, s_x, z_x, the tensors held)

    def input_grid(x: QTensor) -> tuple[Any, float, int, Any]:
        """The input grid as Python numbers, read once per grid state (no ``item`` per call)."""
        s, z = x._scale, x._zero_point
        gkey = input_grid_key(s, z)
        hit = grid[0]
        if hit is None or hit[0] != gkey:
            hit = grid[0] = (gkey, s.item(), int(z.item()), (s, z))
        return hit  # type: ignore[no-any-return]

    split = not (onednn.has_vnni() or onednn.saturation_safe(w))  # (this CPU's u8 x s8 pairs could saturate)
    # a first conv's small window: onednn.conv's native pass, planned (7-bit input codes never take the split)
    if conv_small.takes(weight, spec, out, split and x_qdtype.quant_max > 127):
        cache: dict[str, Any] = {}

        # its lane (kernels.lane, without the layout step: the pass reads any strides): the same pass, its arguments
        # converted once per input grid (conv_small.prepared), on an input of the grid and shape it last took; the
        # compiled qconv_cfg's fast entry then serves it too (pt2.fast_entry)
        small_lane = ConvLane(lambda q, sx, zx, run: run(q), counts, key, channels_last=False)
        ready: list[Any] = [None]  # ((s_x, z_x), conv_small.prepared's run)

        def run_small(x: QTensor) -> QTensor:
            hit = input_grid(x)  # (u8 codes: the plan's input grid)
            q = x.int_repr()
            y = conv_small.conv(q, hit[1], hit[2], weight, bias, spec, out, relu, cache)  # type: ignore[arg-type]
            if y is None:  # (declined: the generic path, which declines the same way and runs oneDNN)
                y = onednn.conv(x, weight, bias, spec, out, relu, cache)
            elif q.dtype == torch.uint8 and q.is_cpu and x._axis is None:  # the next call on this grid and shape
                grid_numbers = (hit[1], hit[2])
                if ready[0] is None or ready[0][0] != grid_numbers:
                    ready[0] = (grid_numbers, conv_small.prepared(weight, bias, spec, out, relu, cache,  # type: ignore[arg-type]
                                                                  hit[1], hit[2]))
                if ready[0][1] is not None:
                    small_lane.arm(x, q.shape, ready[0][1], hit[1], hit[2])
            counts[key] += 1
            return y
        run_small.lane = small_lane  # type: ignore[attr-defined]
        run_small.small = True  # type: ignore[attr-defined]  # (its lane serves the native pass, not oneDNN's call)
        return run_small
    if split:  # the split routes: the generic path
        return None
    stride, padding, dilation = onednn._geometry(spec)
    w_scale, w_zp, groups = weight.scale, weight.zero_point, spec.groups
    packs: dict[tuple[Any, bool], Any] = {}  # (input shape, z_x != 0) -> the weight packed for it (module docstring)

    def pack(zx: int, shape: list[int] | None) -> Any:
        return torch.ops.onednn.qconv_prepack(w, w_scale, 1.0, zx, stride, padding, dilation, groups, shape)
    s_out, z_out, qd = out.scale, out.zero_point, out.qdtype
    post, scalars, clamp = out.onednn_post(relu)  # a 7-bit grid's clamp as oneDNN's post-op (module docstring)

    odd: dict[Any, bool] = {}  # input shape -> oneDNN wrong there: onednn.conv rewrites such inputs (spec.py)
    generic: dict[str, Any] = {}

    s_t, z_t = out.scale_t, out.zero_point_t
    # out.wrap's own choice for CPU codes, made once: the grid's tensors kept where they are on the CPU (~0.5 µs a call)
    trusted = s_t is not None and z_t is not None and s_t.device.type == "cpu"

    ao = AO_MACS > 0 and trusted and _ao_geometry(w.shape, spec, relu, post, clamp)
    ao_st: list[Any] = [None, None, {}]  # (torch.ao's pack, (s_x, z_x, empty quantized input on that grid), shape -> fits)

    def call(q: torch.Tensor, sx: float, zx: int, packed: Any) -> QTensor:
        if ao:
            fits = ao_st[2].get(q.shape)
            if fits is None:
                if len(ao_st[2]) >= _AO_SHAPES:
                    ao_st[2].clear()
                fits = ao_st[2][q.shape] = _ao_fits(q.shape, w.shape, spec)
            if fits and q.is_contiguous(memory_format=torch.channels_last):
                return _ao_route(q, sx, zx)
        y = _qconv_op(q, sx, zx, packed, w_scale, w_zp, bias, stride, padding, dilation, groups, s_out, z_out,
                      torch.uint8, post, scalars, "")
        if clamp:
            y = y.clamp_(qd.quant_min, qd.quant_max)
        return QTensor._trusted(y, s_t, z_t, qd) if trusted else out.wrap(y)  # type: ignore[arg-type]

    def _ao_route(q: torch.Tensor, sx: float, zx: int) -> QTensor:
        """torch.ao's ``quantized::conv2d(_relu)`` on the codes (viewed, not copied, as a quantized tensor on the input
        grid): the same oneDNN convolution, its primitive cached in the pack (~13-25 µs a call less at batch 1)."""
        if ao_st[0] is None:
            ao_st[0] = _ao_pack(w, w_scale, bias, spec)
        g = ao_st[1]
        if g is None or g[0] != sx or g[1] != zx:
            g = ao_st[1] = (sx, zx, _quantized_out((0,), sx, zx))
        t = torch.empty_like(g[2]).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())
        y = _ao_ops[relu](t, ao_st[0], s_out, z_out)  # type: ignore[index]
        return QTensor._trusted(None, s_t, z_t, qd, None, y)  # type: ignore[arg-type]
    lane = ConvLane(call, counts, key)

    def run(x: QTensor) -> QTensor:
        q = x.int_repr()
        bad = odd.get(q.shape)
        if bad is None:
            if len(odd) >= 16:
                odd.pop(next(iter(odd)))
            bad = odd[q.shape] = odd_windows(q.shape, w.shape, spec) or strided_column(q.shape, w.shape, spec)
        if bad:
            counts[key] += 1
            return onednn.conv(x, weight, bias, spec, out, relu, generic)  # type: ignore[no-any-return]
        hit = input_grid(x)
        counts[key] += 1
        shape = q.shape
        if not q.is_contiguous(memory_format=torch.channels_last):  # oneDNN would copy it so, ~3x slower (an NCHW input)
            cl = native.to_channels_last(q)
            q = q if cl is None else cl
        packed = packed_for_input(packs, q, hit[2], pack)
        y = call(q, hit[1], hit[2], packed)
        if q.dtype == torch.uint8 and q.is_cpu and x._axis is None:  # the next call on this grid and shape: the lane
            lane.arm(x, shape, packed, hit[1], hit[2])
        return y

    run.lane = lane  # type: ignore[attr-defined]  # (armed by run; the module calls it first: kernels.lane)
    return run

