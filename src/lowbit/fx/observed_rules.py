"""``convert_fx``'s decisions read from the calibration ranges: what ``prepare_fx`` could not tell without values.

``apply_observed_rules(conv)`` runs on a prepared graph before its observers are converted (``converter``):

- **A scalar product whose output range collapsed under the observer's floor.** ``y * c`` / ``y / c`` with a tiny
  ``c`` (``y / 1e30``) has an output range ``r`` below ``eps · (qmax - qmin)`` (``eps`` = 1e-8: the scale's floor),
  so the observed grid ``s = eps`` put every value on the zero point (0 dB; torch.ao's ``mul_scalar`` derives its
  output grid from its input's, 33 dB). Such a node gets the input's grid times ``c``, as torch.ao::

      (s_x · |c|, z_x)            c > 0   (x / c: s_x / |c|)
      (s_x · |c|, qmin + qmax - z_x)   c < 0   (the codes mirrored)

  so ``mul_scalar`` keeps the input's codes (``q' = q``; mirrored for ``c < 0``). Where ``s_x · |c|`` is no float32
  grid (below ``2**-128``: ``y * 1e-40``), where ``c`` is a traced number or the input grid's dtype differs, the
  node is kept float (``x̂ · c`` on the dequantized input), warned. A range of ``r ≥ eps · (qmax - qmin)`` (any
  ordinary constant: ``x * 0.5``, ``x / 3``) keeps the observed grid: codes unchanged. A scalar op reading such a
  product (``a * 2.0``) starts from the product's grid, not its observer's. Any other int op whose output range
  collapsed (``a + a``, ``torch.cat([a, a * 2])``, ``a * a``), or that reads a collapsed value without such a grid
  (``(a + a) * 1e30``), is kept float, warned (0.0 → 38-39 dB; torch.ao 0.0).
- **A child graph's attention mask without ``example_inputs``.** ``fx.masks`` needs an example run; a child graph
  prepared without one made ``scores + ext`` int8, its grid spanning the mask (scale ~40: 25.3 dB on
  ``tests/test_graphacc_s46.py``'s encoder, 43.9 with an example). Here an int8 add / sub of a child graph one of
  whose operands is an input of the graph (through shape ops) with calibration range ``[c, 0]``, ``-c ≥
  RATIO · max|other operand|`` (``fx.masks.RATIO`` = 2), or ``[0, 0]`` (no padding in any batch) is made float, and
  that input's observer is dropped when nothing else reads it: 43.9 dB. A range cannot show that the values are
  only ``0`` and ``c`` (the example rule's test): an input whose largest value is exactly 0 and whose smallest
  dwarfs the other operand is taken for a mask (keeping its add float costs no accuracy).

A node made float is named in ``report.left_float``; its output observer becomes a ``Quantize`` for the int ops that
read it, or is dropped.

>>> import torch
>>> from lowbit.observer import MinMaxObserver
>>> obs = MinMaxObserver()
>>> _ = obs(torch.tensor([1e-32, -3e-32]))
>>> collapsed(obs, 255), collapsed(MinMaxObserver(), 255)
(True, False)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import fx, nn

from ..nn.quantized._utils import check_out_grid, observer_grid
from .masks import RATIO
from .patterns import as_number

__all__ = ["apply_observed_rules", "collapsed"]

_FLOAT_READERS = ("float", "output", "opaque", "dynamic")


def _inner(obs: nn.Module) -> nn.Module:
    inner = getattr(obs, "activation_post_process", None)  # (a FakeQuantize's observer)
    return inner if isinstance(inner, nn.Module) else obs


def _range(obs: nn.Module) -> tuple[float, float] | None:
    lo, hi = (getattr(_inner(obs), k, None) for k in ("min_val", "max_val"))
    if not (isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor) and lo.numel() == 1 == hi.numel()):
        return None
    lo_f, hi_f = float(lo), float(hi)
    return (lo_f, hi_f) if lo_f <= hi_f else None  # (an observer that saw nothing: +inf / -inf)


def collapsed(obs: nn.Module, steps: int) -> bool:
    """Whether ``obs`` saw a range ``0 < r < eps · steps`` (``r`` spanning 0, as its grid): the scale's floor
    ``eps`` then coarsens its grid (module doc)."""
    rng, eps = _range(obs), getattr(_inner(obs), "eps", None)
    if rng is None or not isinstance(eps, float):
        return False
    r = max(rng[1], 0.0) - min(rng[0], 0.0)
    return 0.0 < r < eps * steps


def _observer(gm: fx.GraphModule, arg: Any) -> tuple[fx.Node | None, nn.Module | None, fx.Node | None]:
    """For an operand: ``(observer node, its module, origin)``, walking back through shape ops and observers; the
    observer nearest the origin (an input's own), the origin the first node that is neither."""
    obs_node = None
    while isinstance(arg, fx.Node):
        kind = arg.meta.get("lowbit_kind")
        if kind in ("obs_in", "obs_out"):
            obs_node = arg
        elif kind != "share" or not arg.args:
            break
        arg = arg.args[0]
    mod = gm.get_submodule(obs_node.target) if obs_node is not None else None
    return obs_node, mod, arg if isinstance(arg, fx.Node) else None


def _bypass(gm: fx.GraphModule, obs: fx.Node) -> None:
    obs.replace_all_uses_with(obs.args[0])
    gm.graph.erase_node(obs)


def _demote(conv: Any, node: fx.Node, why: str) -> None:
    """Make the int op ``node`` float (module doc): its output observer a ``Quantize`` when an int op reads it, else
    dropped; an input observer only it read dropped."""
    what = getattr(node.target, "__name__", str(node.target))
    node.meta.update(lowbit_kind="float", lowbit_domain="float", lowbit_qop=None)
    node.meta.pop("lowbit_scalar_op", None)
    node.meta.pop("lowbit_alpha", None)
    conv.report.left_float[conv._key(node)] = f"{what} (kept float: {why})"
    for user in list(node.users):
        if user.meta.get("lowbit_kind") == "obs_out":
            if all(r.meta.get("lowbit_kind") in _FLOAT_READERS for r in user.users):
                _bypass(conv.gm, user)
            else:
                user.meta["lowbit_kind"] = "obs_in"  # (becomes a Quantize: convert's input-observer step)
    for arg in node.all_input_nodes:
        if arg.meta.get("lowbit_kind") == "obs_in" and all(r.meta.get("lowbit_kind") in _FLOAT_READERS
                                                            for r in arg.users):
            _bypass(conv.gm, arg)


def _scalar_rule(conv: Any, node: fx.Node) -> None:
    obs_node = next((u for u in node.users if u.meta.get("lowbit_kind") == "obs_out"), None)
    if obs_node is None:
        return
    obs = conv.gm.get_submodule(obs_node.target)
    dtype = getattr(_inner(obs), "qdtype", None)
    steps = getattr(dtype, "quant_max", 255) - getattr(dtype, "quant_min", 0)
    if not collapsed(obs, steps):
        return
    ix, ic, _, _ = node.meta["lowbit_scalar_op"]
    c = as_number(node.args[ic])
    where = f"convert_fx: '{conv._key(node)}'"
    lo, hi = _range(obs) or (0.0, 0.0)
    seen = f"its output range [{lo:.3g}, {hi:.3g}] is below the observer's scale floor (eps)"
    _, in_obs, _ = _observer(conv.gm, node.args[ix])
    if c is None or c == 0.0 or in_obs is None:
        why = f"{seen}, and the multiplier is no number known at convert"
        warnings.warn(f"{where}: {why}; kept float", stacklevel=4)
        return _demote(conv, node, why)
    s_x, z_x, qdtype = _input_grid(conv, node.args[ix], in_obs, where)
    factor = abs(c) if node.meta["lowbit_qop"] == "mul_scalar" else 1.0 / abs(c)
    scale, zp = s_x * factor, z_x if c > 0 else qdtype.quant_min + qdtype.quant_max - z_x
    try:
        if dtype is not None and qdtype != dtype:
            raise ValueError(f"the input grid's dtype {qdtype!r} is not the output's {dtype!r}")
        node.meta["lowbit_grid"] = check_out_grid(scale, zp, qdtype, "QFunctional")
    except ValueError as err:
        why = f"{seen}, and the input's grid times {c!r} is no int8 grid ({err})"
        warnings.warn(f"{where}: {why}; kept float", stacklevel=4)
        _demote(conv, node, why)


def _input_grid(conv: Any, arg: Any, in_obs: nn.Module, where: str) -> tuple[float, int, Any]:
    """The grid the codes of ``arg`` are on: a producer's grid set by the scalar rule (``y * 1e-30`` read by ``* 2.0``:
    its codes are on ``s_x · 1e-30``, not on its observer's collapsed grid), else its observer's."""
    _, _, origin = _observer(conv.gm, arg)
    grid = origin.meta.get("lowbit_grid") if origin is not None else None
    return grid if grid is not None else observer_grid(in_obs, f"{where}: the input's observer")


def _collapsed_rule(conv: Any, node: fx.Node, scalar: bool) -> bool:
    """Make ``node`` float (``True``) where an int8 grid would lose its values (module doc): it reads a value whose
    observer collapsed and whose producer has no grid from the scalar rule, or (not a scalar op) its own output
    range collapsed."""
    def steps(obs: nn.Module) -> int:
        dtype = getattr(_inner(obs), "qdtype", None)
        return getattr(dtype, "quant_max", 255) - getattr(dtype, "quant_min", 0)

    for arg in node.all_input_nodes:
        _, obs, origin = _observer(conv.gm, arg)
        if obs is not None and collapsed(obs, steps(obs)) and (origin is None or "lowbit_grid" not in origin.meta):
            lo, hi = _range(obs) or (0.0, 0.0)
            why = (f"it reads '{origin.name if origin is not None else arg.name}', whose range [{lo:.3g}, {hi:.3g}] "
                   "is below the observer's scale floor (eps): int8 codes would put it on the zero point")
            break
    else:
        out = next((u for u in node.users if u.meta.get("lowbit_kind") == "obs_out"), None)
        obs = conv.gm.get_submodule(out.target) if out is not None and not scalar else None
        if obs is None or not collapsed(obs, steps(obs)):
            return False
        lo, hi = _range(obs) or (0.0, 0.0)
        why = f"its output range [{lo:.3g}, {hi:.3g}] is below the observer's scale floor (eps)"
    warnings.warn(f"convert_fx: '{conv._key(node)}': {why}; kept float", stacklevel=4)
    _demote(conv, node, why)
    return True


def _mask_rule(conv: Any, node: fx.Node) -> None:
    ops = [_observer(conv.gm, a) for a in node.args[:2] if isinstance(a, fx.Node)]
    if len(ops) != 2:
        return
    for (_, m_obs, origin), (_, o_obs, _) in (ops, ops[::-1]):
        if m_obs is None or origin is None or origin.op != "placeholder":
            continue
        rng, other = _range(m_obs), _range(o_obs) if o_obs is not None else None
        if rng is None or rng[1] != 0.0:
            continue
        size = max(abs(v) for v in other) if other is not None else float("inf")
        if rng[0] == 0.0 or -rng[0] >= RATIO * size:
            _demote(conv, node, f"adds {origin.name!r}, an input of this child graph whose calibration range "
                                f"[{rng[0] + 0.0:.3g}, 0] is an attention mask's (0 and c <= -{RATIO:g}x the other "
                                f"operand's |max| {size:.3g}, or zeros): one int8 grid over the sum would span it")
            return


def apply_observed_rules(conv: Any) -> None:
    """Run the module doc's rules on ``conv.gm`` (a ``converter._Converter`` before its ``observers`` step)."""
    child_without_example = bool(conv.prefix) and not any("lowbit_rank" in n.meta for n in conv.graph.nodes)
    for node in list(conv.graph.nodes):
        if node.meta.get("lowbit_kind") != "functional":
            continue
        qop = node.meta.get("lowbit_qop")
        if _collapsed_rule(conv, node, qop in ("mul_scalar", "div_scalar")):
            continue
        if qop in ("mul_scalar", "div_scalar"):
            _scalar_rule(conv, node)
        elif qop == "add" and child_without_example:
            _mask_rule(conv, node)
