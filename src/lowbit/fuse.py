"""Module fusion: merge ``conv/linear → bn → relu`` runs into one module before quantization.

``fuse_modules`` (inference, eval mode) folds a BatchNorm into the layer before it with its
running statistics (``W' = W·s``, ``b' = (b - μ)·s + β``, ``s = γ/sqrt(σ² + eps)``; see
``lowbit.nn.intrinsic.fold``), so the fused model computes the same function. ``fuse_modules_qat``
keeps the BN as a marker (``nni.ConvBn2d`` ...) that ``prepare_qat`` turns into a QAT module which
folds on the fly while BN statistics keep training. In both, the first module of a group is
replaced by the fused one and the others by ``nn.Identity`` (torch.ao semantics).

Supported groups (by module type, in order):

=========================  ===========================  ==========================
group                      ``fuse_modules`` (eval)      ``fuse_modules_qat``
=========================  ===========================  ==========================
ConvNd, BatchNormNd        folded ConvNd                ``nni.ConvBnNd``
ConvNd, BatchNormNd, ReLU  ``nni.ConvReLUNd`` (folded)  ``nni.ConvBnReLUNd``
ConvNd, ReLU               ``nni.ConvReLUNd``           ``nni.ConvReLUNd``
ConvTransposeNd, BNNd      folded ConvTransposeNd       ``nni.ConvTransposeBnNd``
Linear, ReLU               ``nni.LinearReLU``           ``nni.LinearReLU``
Linear, BatchNorm1d        folded Linear                ``nni.LinearBn1d``
BatchNorm2d/3d, ReLU       ``nni.BNReLU2d/3d``          ``nni.BNReLU2d/3d``
=========================  ===========================  ==========================

A folded Linear + BatchNorm1d refuses an input that is not ``(N, F)``: BatchNorm1d normalises dim 1, the features
only there (``lowbit.nn.intrinsic.fold.check_linear_bn_input``). There is no ConvTranspose-BN-ReLU fusion (torch.ao
neither). Patterns registered with ``lowbit.fusion_registry.register_fusion_pattern`` are tried first.
In ``fuse_modules`` the ReLU may also be ``ReLU6`` or ``Hardtanh(0, t)``: it becomes
``nni.ClampedReLU(t)`` inside the ReLU marker, and the quantized layer's output grid does the clamp.

Any other group raises ``ValueError`` naming the modules and their types (nothing is dropped).

>>> import torch
>>> from torch import nn
>>> m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
>>> f = fuse_modules(m, [["0", "1", "2"]])
>>> [type(c).__name__ for c in f]
['ConvReLU2d', 'Identity', 'Identity']
>>> x = torch.randn(2, 1, 8, 8)
>>> torch.allclose(f(x), m(x), atol=1e-5)
True
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx, nn

from .fusion_registry import find_fusion_pattern
from .nn import intrinsic as nni
from .nn.intrinsic.fold import check_linear_bn_input, fold_bn_weights
from .qconfig import QConfig

__all__ = ["fuse_modules", "fuse_modules_qat", "fuse_known_modules"]

_BN = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d,
       nn.ConvTranspose1d: nn.BatchNorm1d, nn.ConvTranspose2d: nn.BatchNorm2d, nn.ConvTranspose3d: nn.BatchNorm3d,
       nn.Linear: nn.BatchNorm1d}
_CONV_RELU = {nn.Conv1d: nni.ConvReLU1d, nn.Conv2d: nni.ConvReLU2d, nn.Conv3d: nni.ConvReLU3d}
_CONV_BN = {nn.Conv1d: nni.ConvBn1d, nn.Conv2d: nni.ConvBn2d, nn.Conv3d: nni.ConvBn3d}
_CONVT_BN = {nn.ConvTranspose1d: nni.ConvTransposeBn1d, nn.ConvTranspose2d: nni.ConvTransposeBn2d,
             nn.ConvTranspose3d: nni.ConvTransposeBn3d}
_CONV_BN_RELU = {nn.Conv1d: nni.ConvBnReLU1d, nn.Conv2d: nni.ConvBnReLU2d, nn.Conv3d: nni.ConvBnReLU3d}
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called")
_BN_RELU = {nn.BatchNorm2d: nni.BNReLU2d, nn.BatchNorm3d: nni.BNReLU3d}


def _fold(layer: nn.Module, bn: nn.Module) -> nn.Module:
    """A copy of ``layer`` with ``bn`` (eval, running statistics) folded into weight and bias.

    The folded parameters keep the layer's ``requires_grad`` (a frozen layer stays frozen, as in torch.ao); a bias
    the fold creates follows the weight (torch.ao freezes it, so fine-tuning a fused model left it fixed)."""
    if bn.training or layer.training:
        raise ValueError(
            f"fuse_modules folds {type(bn).__name__} with its running statistics, which needs eval mode: "
            "call model.eval() first (or use fuse_modules_qat for quantization-aware training)"
        )
    fused = copy.deepcopy(layer)
    w, b = fold_bn_weights(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), bn,
                           transpose=isinstance(layer, nn.modules.conv._ConvTransposeNd),
                           groups=getattr(layer, "groups", 1), rsqrt=True)
    grad = layer.weight.requires_grad
    fused.weight = nn.Parameter(w, grad)
    fused.bias = nn.Parameter(b, grad if layer.bias is None else layer.bias.requires_grad)
    if isinstance(layer, nn.Linear):  # the fold is exact on (N, F) only (it was silently wrong on (N, L, F))
        fused.register_forward_pre_hook(check_linear_bn_input, with_kwargs=True)
    return fused


def fuse_known_modules(mods: Sequence[nn.Module], is_qat: bool = False) -> list[nn.Module]:
    """Fuse one group ``mods`` → ``[fused, Identity, ...]`` (same length); ``ValueError`` if unsupported."""
    types = tuple(type(m) for m in mods)
    parts = list(mods)  # as given: their hooks and qconfigs (a ReLU6's forward hooks were lost with it)
    registered = find_fusion_pattern(types)  # lowbit.fusion_registry: user patterns first
    if registered is None and not is_qat and len(mods) in (2, 3) and (relu := nni.as_fusable_relu(mods[-1])):
        mods = [*mods[:-1], relu]  # ReLU6 / Hardtanh(0, t): fused as a clamped ReLU (its grid does the clamp)
        types = types[:-1] + (nn.ReLU,)
    first = types[0]
    fused: nn.Module | None = None
    bn = next((m for m in mods[1:] if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    fn = "fuse_modules_qat" if is_qat else "fuse_modules"
    if registered is None and bn is not None and not bn.track_running_stats:
        raise ValueError(f"{fn}: {bn} has track_running_stats=False; folding needs its running statistics (build it "
                         "with track_running_stats=True, or leave it unfused)")
    width = getattr(mods[0], "out_channels", getattr(mods[0], "out_features", None))
    if registered is None and bn is not None and isinstance(width, int) and bn.num_features != width:
        # (the QAT markers took it: prepare_qat failed later, naming prepare_qat; torch.ao asserts here)
        raise ValueError(f"{fn}: {type(bn).__name__}({bn.num_features}) cannot follow {type(mods[0]).__name__} with "
                         f"{width} output channels (num_features must match)")
    if registered is not None:
        fused = registered.fuser(is_qat, *mods)
        want = registered.fused_type or nn.Module  # (the swap tables key on fused_type: another class stays float)
        if not isinstance(fused, want):
            raise TypeError(f"fuse: the registered fuser for {tuple(t.__name__ for t in types)} returned "
                            f"{type(fused).__name__}, not {want.__name__} (its fused_type)")
    elif len(mods) == 2 and types[1] is _BN.get(first):  # layer + bn
        if is_qat:
            fused = {**_CONV_BN, **_CONVT_BN, nn.Linear: nni.LinearBn1d}[first](*mods)
        else:
            fused = _fold(*mods)
    elif len(mods) == 3 and first in _CONV_BN and types[1:] == (_BN[first], nn.ReLU):
        fused = _CONV_BN_RELU[first](*mods) if is_qat else _CONV_RELU[first](_fold(mods[0], mods[1]), mods[2])
    elif len(mods) == 2 and types[1] is nn.ReLU:
        if first in _CONV_RELU:
            fused = _CONV_RELU[first](*mods)
        elif first is nn.Linear:
            fused = nni.LinearReLU(*mods)
        elif first in _BN_RELU:
            fused = _BN_RELU[first](*mods)
    if fused is None:
        names = ", ".join(t.__name__ for t in types)
        raise ValueError(
            f"{fn}: cannot fuse ({names}); "
            "supported: conv+bn(+relu), conv+relu, linear+relu, linear+bn, bn+relu, convtranspose+bn"
        )
    if hasattr(mods[0], "qconfig"):
        fused.qconfig = mods[0].qconfig
    _check_part_qconfigs(parts, fused)
    fused.train(mods[0].training)
    _move_hooks(parts, fused)
    return [fused] + [nn.Identity() for _ in mods[1:]]


def _check_part_qconfigs(mods: Sequence[nn.Module], fused: nn.Module) -> None:
    """Warn when some parts carry ``.qconfig = None`` and others a ``QConfig``: the fused module is one op, quantized
    or not as a whole by the first part's setting (torch.ao drops the parts' settings without a word)."""
    own = {i: m.__dict__["qconfig"] for i, m in enumerate(mods) if "qconfig" in m.__dict__}
    if len({qc is None for qc in own.values()}) < 2:
        return
    parts = ", ".join(f"part {i} ({type(mods[i]).__name__}): {'None' if qc is None else 'a QConfig'}"
                      for i, qc in own.items())
    gets = ("the first part's None: it stays float" if "qconfig" in mods[0].__dict__ and own[0] is None else
            "the first part's QConfig" if 0 in own else "no qconfig of its own: it inherits its parent's")
    warnings.warn(f"fuse: the parts of this {type(fused).__name__} disagree on .qconfig ({parts}); the fused module "
                  f"is one op and gets {gets}. Set the qconfig on the fused module (or on every part) instead",
                  stacklevel=4)


def _move_hooks(mods: Sequence[nn.Module], fused: nn.Module) -> None:
    """Move the user's forward pre-hooks of the first module and forward hooks of the last onto ``fused`` (torch.ao's
    rule), with their ``with_kwargs`` / ``always_call`` flags. Moved, not copied: they are taken off every module
    inside ``fused`` (the parts themselves, or the copies a BN fold made), so each runs once per call — an
    output-changing hook was applied twice. Hooks on the other parts cannot keep their place: a warning names them."""
    first, last = mods[0], mods[-1]
    pre = {k: (h, k in first._forward_pre_hooks_with_kwargs) for k, h in first._forward_pre_hooks.items()}
    post = {k: (h, k in last._forward_hooks_with_kwargs, k in last._forward_hooks_always_called)
            for k, h in last._forward_hooks.items()}
    for m in fused.modules():
        for k in pre:
            m._forward_pre_hooks.pop(k, None)
            m._forward_pre_hooks_with_kwargs.pop(k, None)
        for k in post:
            m._forward_hooks.pop(k, None)
            m._forward_hooks_with_kwargs.pop(k, None)
            m._forward_hooks_always_called.pop(k, None)
    for h, kw in pre.values():
        fused.register_forward_pre_hook(h, with_kwargs=kw)
    for h, kw, always in post.values():
        fused.register_forward_hook(h, with_kwargs=kw, always_call=always)
    left = [f"{type(m).__name__} (part {i}) {what}" for i, m in enumerate(mods)
            for what, hooks in (("forward pre-hooks", m._forward_pre_hooks if i else {}),
                                ("forward hooks", m._forward_hooks if i < len(mods) - 1 else {})) if hooks]
    if left:
        warnings.warn(f"fuse: {', '.join(left)} are not moved to the fused {type(fused).__name__}: only the first "
                      "module's pre-hooks and the last one's forward hooks are (they may no longer run, or see "
                      "other values)", stacklevel=4)


def _get(model: nn.Module, name: str) -> nn.Module:
    if not isinstance(name, str):
        raise TypeError(f"module names to fuse must be str, got {name!r}")
    if name == "":
        raise ValueError("fuse: '' names the model itself, which cannot be a part of a fusion (name its submodules, "
                         "as in named_modules())")
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"fuse: {type(model).__name__} has no submodule named {name!r}") from None


def _set(model: nn.Module, name: str, mod: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = mod  # in place: keeps Sequential order


class _ChildCalls(fx.Tracer):
    """Traces one module's ``forward`` with every submodule a leaf: the calls of its children, in run order."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _child_calls(parent: nn.Module, cache: dict[int, fx.Graph | None]) -> fx.Graph | None:
    """``parent``'s forward as a graph of its children's calls, or ``None`` where it is ``nn.Sequential``'s own
    forward (registration order is run order) or torch.fx cannot trace it."""
    if id(parent) not in cache:
        graph = None
        if type(parent).forward is not nn.Sequential.forward:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graph = _ChildCalls().trace(parent)
            except Exception:  # data-dependent control flow, a ModuleList / ModuleDict (no forward) ...
                graph = None
        cache[id(parent)] = graph
    return cache[id(parent)]


def _skips(node: Any, parent: nn.Module) -> bool:
    """An ``nn.Identity`` call (left by an earlier fusion): transparent to the run order."""
    return (isinstance(node, fx.Node) and node.op == "call_module"
            and isinstance(parent.get_submodule(str(node.target)), nn.Identity))


def _readers(node: fx.Node, parent: nn.Module) -> list[fx.Node]:
    out: list[fx.Node] = []
    for user in node.users:
        out += _readers(user, parent) if _skips(user, parent) else [user]
    return out


def _what(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    return str(node.target) if node.op in ("call_module", "call_method") else getattr(node.target, "__name__", node.name)


def _check_dataflow(parent: nn.Module, where: str, group: list[str], children: list[str], graph: fx.Graph) -> bool:
    """Check in ``parent``'s traced forward that each member reads only the previous member's output and that
    output feeds only it; ``False`` where a member is not called there (nothing to judge by)."""
    calls = {c: [n for n in graph.nodes if n.op == "call_module" and n.target == c] for c in children}
    if not all(calls.values()):
        return False
    for c, nodes in calls.items():
        if len(nodes) > 1:
            raise ValueError(f"fuse: cannot fuse {group}: {where + c!r} runs {len(nodes)} times in "
                             f"{type(parent).__name__}.forward, and the fused module would replace every call")
    for a, b in zip(children, children[1:]):
        src = calls[b][0].args[0] if calls[b][0].args else None
        while _skips(src, parent):
            src = src.args[0]  # type: ignore[union-attr]
        if src is not calls[a][0]:
            raise ValueError(f"fuse: cannot fuse {group}: {[where + _what(src)]} sits between them, and the fused "
                             "module would skip it (fuse only modules that run one after the other)")
        others = [u for u in _readers(calls[a][0], parent) if u is not calls[b][0]]
        if others:
            raise ValueError(f"fuse: cannot fuse {group}: the output of {where + a!r} is also read by "
                             f"{[where + _what(u) for u in others]}, which would read the fused module's output")
    return True


def _check_adjacent(model: nn.Module, group: list[str], cache: dict[int, fx.Graph | None]) -> None:
    """Members of a group that share a parent must run one after the other there, each reading only the previous
    one's output: a module run between them (``conv1, bn1, relu1`` fused as ``["conv1", "relu1"]``) would be skipped
    by the fused module, a member run twice or an output read elsewhere would change too — silently changing the
    function. The parent's ``forward`` is traced (children as leaves) to see its run order, so modules registered
    in another order than they run (torchvision's ``Bottleneck`` registers ``relu1`` last, its
    ``SqueezeExcitation`` ``fc2`` before ``activation``) fuse as in torch.ao. Where the forward cannot be traced
    (or is ``nn.Sequential``'s), the members must be adjacent among the parent's children (``nn.Identity`` left by an
    earlier fusion aside). Members under other parents are not judged."""
    parents: dict[str, list[str]] = {}
    for name in group:
        parent, _, child = name.rpartition(".")
        parents.setdefault(parent, []).append(child)
    for parent, children in parents.items():
        if len(children) < 2:
            continue
        mod = model.get_submodule(parent) if parent else model
        where = f"{parent}." if parent else ""
        graph = _child_calls(mod, cache)
        if graph is not None and _check_dataflow(mod, where, group, children, graph):
            continue
        kids = mod._modules
        order = list(kids)
        pos = sorted(order.index(c) for c in children)
        between = [order[i] for i in range(pos[0] + 1, pos[-1])
                   if order[i] not in children and kids[order[i]] is not None and not isinstance(kids[order[i]], nn.Identity)]
        if between:
            raise ValueError(f"fuse: cannot fuse {group}: {[where + b for b in between]} sits between them, and the "
                             "fused module would skip it (fuse only modules that run one after the other)")


def _groups(modules_to_fuse: Any) -> list[list[str]]:
    flat = isinstance(modules_to_fuse, (list, tuple)) and len(modules_to_fuse) > 0
    if flat and all(isinstance(n, str) for n in modules_to_fuse):
        return [list(modules_to_fuse)]
    if (not isinstance(modules_to_fuse, (list, tuple))
            or not all(isinstance(g, (list, tuple)) and len(g) >= 2 for g in modules_to_fuse)):
        raise TypeError("modules_to_fuse must be a list of module names or a list of such lists "
                        f"(each of length >= 2), got {modules_to_fuse!r}")
    return [list(g) for g in modules_to_fuse]


def _fuse(model: nn.Module, modules_to_fuse: Any, inplace: bool, is_qat: bool,
          fuser: Callable[..., list[nn.Module]], qconfig: Any = None) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"fuse: inplace must be a bool, got {inplace!r}")
    if not callable(fuser):
        raise TypeError(f"fuse: fuser_func={fuser!r} must be callable (mods, is_qat) -> list of modules")
    groups = _groups(modules_to_fuse)
    if not inplace:
        model = copy.deepcopy(model)
    traced: dict[int, fx.Graph | None] = {}  # each parent's forward, traced once per call
    swapped: list[tuple[str, nn.Module]] = []  # (name, the module it held): a later group's error puts them back
    hooks: list[tuple[nn.Module, dict[str, Any]]] = []  # the parts' hook tables, as the fusion found them
    try:
        for group in groups:
            mods = [_get(model, n) for n in group]
            _check_adjacent(model, group, traced)
            hooks += [(m, {k: dict(getattr(m, k)) for k in _HOOK_TABLES}) for m in mods]
            try:
                new = fuser(mods, is_qat=is_qat)
            except (ValueError, TypeError) as e:  # name the group the user wrote
                raise type(e)(f"{e} (fusing {group})") from e
            if (not isinstance(new, (list, tuple)) or len(new) != len(group)
                    or not all(isinstance(m, nn.Module) for m in new)):  # zip would drop the rest: a BN applied twice
                raise TypeError(f"fuse: fuser_func must return {len(group)} nn.Modules for the group {group} (the "
                                f"fused module, then nn.Identity for each other one), got {new!r}")
            for name, mod in zip(group, new):
                if qconfig is not None and mod is new[0]:
                    mod.qconfig = qconfig
                swapped.append((name, _get(model, name)))
                _set(model, name, mod)
    except Exception:
        for name, old in reversed(swapped):  # inplace=True: the caller's model as it was
            _set(model, name, old)
        for m, tables in reversed(hooks):  # (hooks moved off the parts; in place: the users' handles stay valid)
            for k, v in tables.items():
                getattr(m, k).clear()
                getattr(m, k).update(v)
        raise
    return model


def fuse_modules(model: nn.Module, modules_to_fuse: Any, inplace: bool = False,
                 fuser_func: Callable[..., list[nn.Module]] = fuse_known_modules) -> nn.Module:
    """Fuse groups of submodules for inference (the model must be in eval mode when a BN is folded).

    ``modules_to_fuse``: one list of dotted names (``["conv", "bn", "relu"]``, nested such as
    ``"layer1.0.conv1"``) or a list of such lists. Returns the fused model (a deep copy unless
    ``inplace``). ``fuser_func(mods, is_qat=False)`` may be replaced to add custom patterns.
    """
    return _fuse(model, modules_to_fuse, inplace, False, fuser_func)


def fuse_modules_qat(model: nn.Module, modules_to_fuse: Any, qconfig: Any = None, inplace: bool = False,
                     fuser_func: Callable[..., list[nn.Module]] = fuse_known_modules) -> nn.Module:
    """Fuse for quantization-aware training: conv+bn stay unfolded (``nni.ConvBn2d`` ...) for ``prepare_qat``.

    ``qconfig`` (optional) is stored as ``.qconfig`` on each fused module, overriding what
    ``prepare_qat`` would otherwise resolve for it (the rest of the model still gets the default
    or the ``qconfig`` given to ``prepare_qat``).
    """
    if qconfig is not None and not isinstance(qconfig, QConfig):  # (torch.ao's QConfig failed later, in prepare_qat)
        raise TypeError(f"fuse_modules_qat: qconfig must be a lowbit QConfig or None, got {qconfig!r}")
    return _fuse(model, modules_to_fuse, inplace, True, fuser_func, qconfig)
