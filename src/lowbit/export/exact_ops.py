"""``to_onnx(..., exact=True)`` for the code arithmetic between layers: ``QFunctional`` ops and quantized BatchNorm.

The QDQ form lets ONNX Runtime fuse ``DQ -> op -> Q`` into ``QLinearAdd`` / ``QLinearMul`` / ``QLinearConcat`` /
``QLinearMatMul`` and runs BatchNorm in float32 between Q/DQ nodes; each rounds near-tie codes its own way (``x / s``
of a float32 product, ORT's folded multipliers). Here each op is written as lowbit computes it
(``nn.quantized.functional_modules``, ``normalization._BatchNorm``), every float step one IEEE operation in lowbit's
order. With ``c = q - z`` an input's centred codes (lowbit's ``round(fl(x · fl(1 / s)) + z)`` of the float input,
``exact._codes``), ``k_i = fl(s_i / s)``, ``k = fl(fl(s_a s_b) / s)`` and the output grid ``(s, z)``::

    add (add_relu):  acc = fl(fl(c_a k_a) + fl(c_b k_b))
    mul:             acc = fl(fl(c_a c_b) k)                      (c_a c_b exact)
    add_scalar(v):   acc = fl(fl(c_a k_a) + fl(v / s))
    mul_scalar(v):   acc = fl(c_a fl(fl(s_a v) / s))
    q = clamp(round(acc) + z, lo, qmax)                           (lo = max(qmin, z) after a ReLU, else qmin)
    cat:             each part clamp(round(fl(c_i k_i)) + z, qmin, qmax), or its codes where its grid is (s, z)
    BatchNorm:       q = clamp(round(f64(f64(c alpha) + beta)) + z, lo, qmax)    (alpha, beta: ``code_map``, float64;
                     float32 ops where they round every input code of every channel the same, checked at export)

``Round`` is half to even, as ``torch.round``. The results leave as ``Cast -> DequantizeLinear`` and the next op reads
its codes back with ``Mul`` / ``Add`` / ``Round`` (never ``QuantizeLinear``), so ORT finds no ``DQ -> op -> Q`` to fuse
(``share_codes`` then hands a reader on the producer's grid the codes themselves).
A call with a float (or per-channel, so dequantized) input runs the float op on the float values, as lowbit does, and
lowbit's quantize of the result (``exact.ExactQDQ``). Kept as QDQ: ``matmul``, whose ``QLinearMatMul`` is lowbit's
formula already (exact int32 sums times ``fl(fl(s_a s_b) / s)``, rounded half to even; lowbit's float32 sums are exact
while ``K · max|c_a| · max|c_b| < 2**24``; 0 of 32,768 codes off, u8 x s8 full range included), a matmul with a float
input (float sums in ORT's order), and a BatchNorm whose input is float or whose call sites see different grids.

>>> import torch, lowbit as Q
>>> qa = Q.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.01, 128, Q.quint8)
>>> qb = Q.quantize_per_tensor(torch.tensor([0.25, 0.7]), 0.005, 0, Q.quint8)
>>> f = Q.nn.quantized.QFunctional(0.003, 60)
>>> grid = (qa.scale.item(), int(qa.zero_point), qa.qdtype)
>>> twin = ExactFunctionalTwin(f, {"mul": [grid, (qb.scale.item(), int(qb.zero_point), qb.qdtype)]})
>>> twin.mul(qa.dequantize(), qb.dequantize()).tolist() == f.mul(qa, qb).dequantize().tolist()
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .exact import _ONNX, ExactQDQ, _codes, _codes_symbolic, const_f32, dq_symbolic
from .qdq import FunctionalTwin, Grid, _storage, traced_scalar, untraced

__all__ = ["EXACT_OPS", "ExactBatchNormTwin", "ExactFunctionalTwin"]

EXACT_OPS = ("add", "add_relu", "mul", "cat", "add_scalar", "mul_scalar")
_F32 = torch.float32


def _grid(gr: Grid) -> tuple[float, int, int, int, torch.dtype]:
    """``(s, z, qmin, qmax, storage)`` of a per-tensor grid."""
    return float(gr[0]), int(gr[1]), gr[2].quant_min, gr[2].quant_max, _storage(gr[2], "to_onnx")


def _k(*num: float, s: float) -> float:
    """``fl(fl(n_1 n_2) / s)`` (``fl(n / s)`` for one factor) in float32, as lowbit's tensors compute it."""
    t = torch.tensor(num[0], dtype=_F32)
    for v in num[1:]:
        t = t * torch.tensor(v, dtype=_F32)
    return float(t / torch.tensor(s, dtype=_F32))


class _Spec:
    """One op's constants, handed to ``_CodesOpFn`` as a Python object (not traced): ``op``, the input grids ``ins``
    (``_grid``), the output ``(s, z, lo, hi, storage)``, the multipliers ``ks`` and cat's ``dim``."""

    def __init__(self, op: str, ins: list[Any], out: tuple[float, int, int, int, torch.dtype], dim: int = 0,
                 c: Any = 0.0) -> None:
        self.op, self.ins, self.out, self.dim = op, ins, out, dim
        self.traced = isinstance(c, torch.Tensor)  # (the scalar is the op's last input, a float32 0-dim tensor)
        s = out[0]
        if op == "mul":
            self.ks = [_k(ins[0][0], ins[1][0], s=s)]
        elif op in ("add_scalar", "mul_scalar") and isinstance(c, torch.Tensor):  # traced (a shape): per call
            self.ks = [_k(ins[0][0], s=s)]
        elif op == "mul_scalar":  # QFunctional._eager_mul_scalar: x.scale * c / s on float32 tensors
            self.ks = [float(torch.tensor(ins[0][0], dtype=_F32) * c / torch.tensor(s, dtype=_F32))]
        elif op == "add_scalar":  # QFunctional._eager_add_scalar: (x.scale / s), then c / s
            self.ks = [_k(ins[0][0], s=s), float(c / torch.tensor(s, dtype=_F32))]
        else:
            self.ks = [_k(g[0], s=s) for g in ins]


def _eval(spec: _Spec, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """lowbit's output codes (float32) of ``spec`` on the float inputs ``xs`` (module doc)."""
    if spec.traced:  # the scalar, per call: fl(fl(s_a v) / s) or fl(v / s), as lowbit's float32 tensors
        xs, v = xs[:-1], xs[-1].to(_F32)
        s_a, s = torch.tensor(spec.ins[0][0], dtype=_F32), torch.tensor(spec.out[0], dtype=_F32)
        ks = [s_a * v / s] if spec.op == "mul_scalar" else [torch.tensor(spec.ks[0], dtype=_F32), v / s]
    cs = [_codes(x, *g[:4]) - float(g[1]) for x, g in zip(xs, spec.ins)]
    s, z, lo, hi, _ = spec.out
    if spec.op == "cat":
        parts = [c + float(g[1]) if (g[0], g[1]) == (s, z) else
                 torch.clamp(torch.round(c * torch.tensor(k, dtype=_F32)) + float(z), lo, hi)
                 for c, g, k in zip(cs, spec.ins, spec.ks)]
        return torch.clamp(torch.cat(parts, spec.dim), lo, hi)
    k = ks if spec.traced else [torch.tensor(v, dtype=_F32) for v in spec.ks]
    if spec.op in ("add", "add_relu"):
        acc = cs[0] * k[0] + cs[1] * k[1]
    elif spec.op == "add_scalar":
        acc = cs[0] * k[0] + k[1]
    elif spec.op == "mul_scalar":
        acc = cs[0] * k[0]
    else:
        acc = (cs[0] * cs[1]) * k[0]
    return torch.clamp(torch.round(acc) + float(z), lo, hi)


def _symbolic(g: Any, spec: _Spec, xs: tuple[Any, ...]) -> Any:
    """``_eval`` as ONNX nodes, ending on float32 codes."""
    s, z, lo, hi, _ = spec.out

    def requant(acc: Any) -> Any:  # Round -> Add(z) -> Clip
        return g.op("Clip", g.op("Add", g.op("Round", acc), const_f32(g, float(z))), const_f32(g, float(lo)),
                    const_f32(g, float(hi)))

    ks: list[Any] = [const_f32(g, k) for k in spec.ks]
    if spec.traced:  # the scalar, per call (as _eval)
        xs, v = xs[:-1], g.op("Cast", xs[-1], to_i=_ONNX[_F32])
        s_a, s_out = const_f32(g, spec.ins[0][0]), const_f32(g, s)
        ks = [g.op("Div", g.op("Mul", s_a, v), s_out)] if spec.op == "mul_scalar" else [ks[0], g.op("Div", v, s_out)]
    codes = [_codes_symbolic(g, x, *gr[:4], None) for x, gr in zip(xs, spec.ins)]
    if spec.op == "cat":
        parts = [q if (gr[0], gr[1]) == (s, z) else
                 requant(g.op("Mul", g.op("Sub", q, const_f32(g, float(gr[1]))), const_f32(g, k)))
                 for q, gr, k in zip(codes, spec.ins, spec.ks)]
        return g.op("Clip", g.op("Concat", *parts, axis_i=spec.dim), const_f32(g, float(lo)), const_f32(g, float(hi)))
    cs = [g.op("Sub", q, const_f32(g, float(gr[1]))) for q, gr in zip(codes, spec.ins)]
    if spec.op in ("add", "add_relu"):
        acc = g.op("Add", g.op("Mul", cs[0], const_f32(g, spec.ks[0])), g.op("Mul", cs[1], const_f32(g, spec.ks[1])))
    elif spec.op == "add_scalar":
        acc = g.op("Add", g.op("Mul", cs[0], ks[0]), ks[1])
    elif spec.op == "mul_scalar":
        acc = g.op("Mul", cs[0], ks[0])
    else:
        acc = g.op("Mul", g.op("Mul", cs[0], cs[1]), const_f32(g, spec.ks[0]))
    return requant(acc)


class _CodesOpFn(torch.autograd.Function):
    """A ``QFunctional`` op on lowbit's codes of its float inputs, dequantized onto the output grid (module doc)."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, *xs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with untraced():
            s, z = spec.out[:2]
            return (_eval(spec, tuple(x.detach() for x in xs)) - float(z)) * torch.tensor(s, dtype=_F32)

    @staticmethod
    def symbolic(g: Any, spec: _Spec, *xs: Any) -> Any:
        s, z, _, _, st = spec.out
        return dq_symbolic(g, _symbolic(g, spec, xs), s, z, st)


class ExactFunctionalTwin(FunctionalTwin):
    """``FunctionalTwin`` whose ``add`` / ``add_relu`` / ``mul`` / ``cat`` / ``add_scalar`` / ``mul_scalar`` of
    quantized inputs run lowbit's code arithmetic (``_CodesOpFn``); a call with a float input runs the float op and
    lowbit's quantize (``ExactQDQ``); ``matmul`` stays QDQ."""

    def __init__(self, mod: Any, in_grids: dict[str, list[Grid | None]]) -> None:
        super().__init__(mod, in_grids)
        self.in_grids = in_grids
        s, z, qmin, qmax, st = _grid((float(mod.scale), int(mod.zero_point), mod.qdtype))
        # a float-input call's result as lowbit's _from_float quantizes it; matmul keeps QuantizeLinear, so that ORT
        # fuses its QLinearMatMul (lowbit's formula)
        self.matmul_qdq, self.out_qdq = self.out_qdq, ExactQDQ(float(mod.scale), int(mod.zero_point), mod.qdtype)
        self.ins: dict[str, list[Any]] = {}
        self.outs: dict[str, tuple[float, int, int, int, torch.dtype]] = {}
        for op in EXACT_OPS:
            gs = in_grids.get(op)
            if gs and all(gr is not None for gr in gs):
                self.ins[op] = [_grid(gr) for gr in gs if gr is not None]
                self.outs[op] = (s, z, max(qmin, z) if op == "add_relu" else qmin, qmax, st)

    def qdq_ops(self) -> list[str]:
        """The calls whose codes ORT may round its own way: a matmul with a float (or per-channel) input (its float
        sums run in ORT's order)."""
        gs = self.in_grids.get("matmul")
        return ["matmul"] if gs and not all(gr is not None for gr in gs) else []

    def _exact(self, op: str, xs: tuple[torch.Tensor, ...], dim: int = 0, c: Any = 0.0) -> torch.Tensor:
        if isinstance(c, torch.Tensor):  # (a traced scalar: the op's last input)
            xs = (*xs, c)
        return _CodesOpFn.apply(_Spec(op, self.ins[op], self.outs[op], dim, c), *(x.detach() for x in xs))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._exact("add", (x, y)) if "add" in self.ins else super().add(x, y)

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._exact("add_relu", (x, y)) if "add_relu" in self.ins else super().add_relu(x, y)

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._exact("mul", (x, y)) if "mul" in self.ins else super().mul(x, y)

    def add_scalar(self, x: torch.Tensor, c: float) -> torch.Tensor:
        c = traced_scalar(c)
        return self._exact("add_scalar", (x,), c=c) if "add_scalar" in self.ins else super().add_scalar(x, c)

    def mul_scalar(self, x: torch.Tensor, c: float) -> torch.Tensor:
        c = traced_scalar(c)
        return self._exact("mul_scalar", (x,), c=c) if "mul_scalar" in self.ins else super().mul_scalar(x, c)

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.matmul_qdq(torch.matmul(*self._in("matmul", x, y)))

    def cat(self, xs: Any, dim: int = 0) -> torch.Tensor:
        xs = tuple(xs)
        if "cat" in self.ins and len(xs) == len(self.ins["cat"]):
            return self._exact("cat", xs, dim)
        return super().cat(xs, dim)


class _BatchNormFn(torch.autograd.Function):
    """lowbit's quantized BatchNorm on the codes of its float input (module doc), dequantized."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bn: Any) -> torch.Tensor:  # type: ignore[override]
        with untraced():
            s_in, z_in, qmin, qmax, _ = bn.in_grid
            s, z, lo, hi, _ = bn.out
            c = (_codes(x, s_in, z_in, qmin, qmax) - float(z_in)).double()
            q = torch.clamp(torch.round(c * bn.alpha + bn.beta) + float(z), lo, hi)
            return ((q - z) * s).to(_F32)

    @staticmethod
    def symbolic(g: Any, x: Any, bn: Any) -> Any:
        s_in, z_in, qmin, qmax, _ = bn.in_grid
        s, z, lo, hi, st = bn.out
        c = g.op("Sub", _codes_symbolic(g, x, s_in, z_in, qmin, qmax, None), const_f32(g, float(z_in)))
        if bn.f32:  # float32 ops give lowbit's codes on every input code (checked at export)
            y = g.op("Round", g.op("Add", g.op("Mul", c, g.op("Constant", value_t=bn.alpha.float())),
                                   g.op("Constant", value_t=bn.beta.float())))
        else:  # float64, as lowbit's kernel
            y = g.op("Add", g.op("Mul", g.op("Cast", c, to_i=11), g.op("Constant", value_t=bn.alpha)),
                     g.op("Constant", value_t=bn.beta))
            y = g.op("Cast", g.op("Round", y), to_i=_ONNX[_F32])
        q = g.op("Add", y, const_f32(g, float(z)))
        return dq_symbolic(g, g.op("Clip", q, const_f32(g, float(lo)), const_f32(g, float(hi))), s, z, st)


class ExactBatchNormTwin(nn.Module):
    """A quantized ``BatchNorm2d`` / ``3d`` (+ ReLU) on a static per-tensor input grid, as lowbit's kernel maps the
    codes (``_BatchNormFn``)."""

    def __init__(self, mod: Any, in_grid: Grid) -> None:
        super().__init__()
        self.in_grid = _grid(in_grid)
        s, z, qmin, qmax, st = _grid((float(mod.scale), int(mod.zero_point), mod.qdtype))
        self.out = (s, z, max(qmin, z) if mod._relu else qmin, qmax, st)
        alpha, beta = mod.code_map(torch.tensor(self.in_grid[0], dtype=_F32))
        shape = (1, -1) + (1,) * mod._spatial
        self.alpha, self.beta = alpha.detach().cpu().reshape(shape), beta.detach().cpu().reshape(shape)
        # every input code of every channel: float32's fl(fl(c alpha) + beta) (alpha, beta are float32 values) rounds to
        # lowbit's codes almost always (a tie within float32 error in any channel sends the layer to float64 ops)
        c = (torch.arange(self.in_grid[2], self.in_grid[3] + 1, dtype=torch.float64) - self.in_grid[1])[:, None]
        a64, b64 = alpha.detach().cpu().reshape(1, -1), beta.detach().cpu().reshape(1, -1)
        lo, hi = self.out[2] - z, self.out[3] - z
        y32 = torch.round(c.float() * a64.float() + b64.float()).double()
        self.f32 = bool(torch.equal(torch.clamp(torch.round(c * a64 + b64), lo, hi), torch.clamp(y32, lo, hi)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BatchNormFn.apply(x.detach(), self)
