"""Graph-mode fusion: ``fuse_graph`` folds runs of float ops into the single modules / nodes that quantize as one.

``fuse_graph`` folds the runs ``conv-bn(-relu)``, ``conv-relu``, ``linear-relu``, ``linear-bn``,
``bn-relu`` and ``convtranspose-bn`` (relu as ``nn.ReLU``, ``F.relu``, ``torch.relu``
or ``.relu()``; not for QAT also a ``[0, t]`` clamp — ``ReLU6``, ``F.relu6``, ``Hardtanh(0, t)``,
``clamp(x, 0, t)`` — as ``nni.ClampedReLU(t)``, whose clamp the output grid then performs; not a
layer under a dynamic qconfig: there is no fused dynamic module) into one
``lowbit.nn.intrinsic`` module via ``lowbit.fuse.fuse_known_modules``;
``relu(a + b)`` into one ``add_relu`` node (``lowbit.fx.patterns.add_relu``); and ``relu(F.linear(x, self.w,
self.b))`` (likewise ``F.conv1d/2d/3d``) into one ``linear_relu`` / ``conv2d_relu`` node (``lowbit.fx.weighted``).
Patterns a user registered (``lowbit.fusion_registry``) are fused first. ``prepare_fx`` and ``fuse_fx`` call it.

>>> import torch
>>> from torch import fx, nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__(); self.conv, self.bn = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)
...     def forward(self, x, y):
...         return torch.relu(self.bn(self.conv(x)) + y)
>>> net = Net().eval()
>>> gm = fx.symbolic_trace(net)
>>> fuse_graph(gm, is_qat=False, require_qconfig=False)
['conv: Conv2d + BatchNorm2d -> Conv2d', 'add_relu: add + relu -> add_relu']
>>> x, y = torch.randn(2, 1, 5, 5), torch.randn(2, 4, 3, 3)
>>> torch.allclose(gm(x, y), net(x, y), atol=1e-5)  # the BN folded into the conv: the same function
True
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU6()).eval())
>>> fuse_graph(gm, is_qat=False, require_qconfig=False)  # ReLU6 is a [0, 6] clamp: the fused layer's output grid
['0: Linear + ReLU6 -> LinearReLU']
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..fuse import fuse_known_modules
from ..fusion_registry import fusion_patterns
from ..nn import intrinsic as nni
from ..workflow import is_dynamic_qconfig
from .absorbed import drop_absorbed
from .patterns import add_relu, as_number, canonical_binary, is_relu_target
from .weighted import WITH_RELU, parse

__all__ = ["fuse_graph", "clamp_relu"]

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN_OF = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d, nn.Linear: nn.BatchNorm1d}
# folded for inference, nni.ConvTransposeBnNd (trained by nniqat.ConvTransposeBnNd) for QAT; no ReLU variant
_BN_OF_TRANSPOSED = {nn.ConvTranspose1d: nn.BatchNorm1d, nn.ConvTranspose2d: nn.BatchNorm2d,
                     nn.ConvTranspose3d: nn.BatchNorm3d}


def _relu_user(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """``node``'s only user when it is a ReLU taking ``node`` as its sole tensor input."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    mod = modules.get(user.target) if user.op == "call_module" else None  # type: ignore[arg-type]
    if not is_relu_target(user.op, user.target, mod) or not user.args or user.args[0] is not node:
        return None
    return user


def clamp_relu(node: fx.Node, mod: nn.Module | None) -> nni.ClampedReLU | None:
    """``ClampedReLU(t)`` when ``node`` computes ``clamp(x, 0, t)`` of its first argument, t > 0 constant.

    Recognised: ``nn.ReLU6``, ``nn.Hardtanh(0, t)``, ``F.relu6``, ``F.hardtanh(x, 0, t)``,
    ``torch.clamp(x, 0, t)`` / ``x.clamp(0, t)`` (also ``min=0, max=t`` keywords). Others: None.
    """
    if node.op == "call_module":
        relu = nni.as_fusable_relu(mod) if mod is not None and type(mod) is not nn.ReLU else None
        return relu if isinstance(relu, nni.ClampedReLU) else None
    if node.target is F.relu6 and not node.kwargs.get("inplace", False):
        return nni.ClampedReLU(6.0)
    rest, kw = list(node.args[1:]), dict(node.kwargs)
    if node.target is F.hardtanh or (node.op in ("call_function", "call_method") and node.target in (torch.clamp, "clamp")):
        lo_name, hi_name = ("min_val", "max_val") if node.target is F.hardtanh else ("min", "max")
        lo = as_number(rest[0] if rest else kw.get(lo_name, -1.0 if node.target is F.hardtanh else None))
        hi = as_number(rest[1] if len(rest) > 1 else kw.get(hi_name, 1.0 if node.target is F.hardtanh else None))
        if lo == 0.0 and hi is not None and hi > 0 and not kw.get("inplace", False):
            return nni.ClampedReLU(hi)
    return None


def _clamp_user(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[fx.Node, nni.ClampedReLU] | None:
    """``node``'s only user when it clamps ``node`` to ``[0, t]`` (ReLU6-like), with its ``ClampedReLU``."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if not user.args or user.args[0] is not node:
        return None
    mod = modules.get(user.target) if user.op == "call_module" else None  # type: ignore[arg-type]
    relu = clamp_relu(user, mod)
    return None if relu is None else (user, relu)


def _set_module(gm: fx.GraphModule, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, mod)


def _hook_free_join(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a → b`` may become one fused module: no forward hook on ``a`` and no forward pre-hook on ``b`` (the
    hooks fusion cannot move: a BN's hook was dropped, a conv's ran on the BN-folded output; wrong numbers). Graph
    mode fuses on its own, so it leaves such a run unfused where ``fuse_modules`` (asked by the user) warns."""
    return not a._forward_hooks and not b._forward_pre_hooks


def _fuse_registered(gm: fx.GraphModule, modules: dict[str, nn.Module], calls: dict[Any, int], is_qat: bool,
                     require_qconfig: bool, erased: set[fx.Node]) -> list[str]:
    """Fuse chains of call_module nodes matching ``lowbit.fusion_registry`` patterns (longest first)."""
    fused: list[str] = []
    patterns = sorted(fusion_patterns(), key=lambda p: -len(p.pattern))
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_module" or calls.get(node.target, 0) != 1:
            continue
        for entry in patterns:
            run = [node]
            while len(run) < len(entry.pattern):
                last = run[-1]
                nxt = next(iter(last.users)) if len(last.users) == 1 else None
                if (nxt is None or nxt.op != "call_module" or calls.get(nxt.target, 0) != 1 or not nxt.args
                        or nxt.args[0] is not last or not _hook_free_join(modules[last.target], modules[nxt.target])):
                    break
                run.append(nxt)
            types = tuple(type(modules[n.target]) for n in run)  # type: ignore[index]
            if types != entry.pattern:
                continue
            first = modules[node.target]  # type: ignore[index]
            qc = getattr(first, "qconfig", None)
            if require_qconfig and (qc is None or is_dynamic_qconfig(qc)):
                break
            new = fuse_known_modules([modules[n.target] for n in run], is_qat=is_qat)[0]  # type: ignore[index]
            _set_module(gm, node.target, new)  # type: ignore[arg-type]
            modules[node.target] = new  # type: ignore[index]
            run[-1].replace_all_uses_with(node)
            for n in reversed(run[1:]):
                gm.graph.erase_node(n)
                erased.add(n)
            drop_absorbed(gm, [str(n.target) for n in run[1:]])
            fused.append(f"{node.target}: {' + '.join(t.__name__ for t in types)} -> {type(new).__name__}")
            break
    return fused


def _absorbed_entry(n: fx.Node, act: Any, is_act: bool) -> str:
    """``absorbed``'s entry for ``n``: a module's target, ``"relu"`` / ``"clamp:t"`` for a functional ReLU / clamp; an
    activation module whose target reads as a marker (``self.relu = nn.ReLU6()``) as what it computes (compare took
    it for ``F.relu``: no clamp at 6)."""
    name = str(n.target)
    if n.op == "call_module" and not (is_act and (name == "relu" or name.startswith("clamp:"))):
        return name
    is_relu = type(act) is nn.ReLU if n.op == "call_module" else is_relu_target(n.op, n.target)
    return "relu" if is_relu else f"clamp:{float(act.max_val)}"


def fuse_graph(gm: fx.GraphModule, is_qat: bool, require_qconfig: bool = True,
               absorbed: dict[str, list[str]] | None = None) -> list[str]:
    """Fuse module runs and add-relu in place; return descriptions of the fused runs.

    User patterns (``lowbit.fusion_registry``) are fused first. ``require_qconfig=True`` (``prepare_fx``): a
    conv / linear / ConvTranspose run whose layer has no qconfig (kept float) fuses too, as in torch.ao — eval folds
    its BN (a float ``nni.ConvReLU2d`` / the plain layer), QAT keeps the float ``nni.ConvBn*d`` — but a ReLU6-like
    clamp after it stays a float module and a standalone BN a BN; a user pattern, or a layer under a dynamic qconfig,
    needs a (static) qconfig. ``require_qconfig=False`` (``fuse_fx``) fuses everything. ``absorbed`` (if given) receives, for each
    fused conv/linear-BN-ReLU run, ``{layer target: [targets of the modules it absorbed, in order]}``
    (``"relu"`` for a functional ReLU, ``"clamp:t"`` for a functional ``[0, t]`` clamp such as ``F.relu6``),
    for ``lowbit.debug.compare``.
    """
    modules = dict(gm.named_modules())
    bn_of = {**_BN_OF, **_BN_OF_TRANSPOSED}
    fused: list[str] = []
    erased: set[fx.Node] = set()
    calls: dict[Any, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    fused += _fuse_registered(gm, modules, calls, is_qat, require_qconfig, erased)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node in erased or calls[node.target] > 1:
            continue  # a module called at several sites keeps its own form
        first = modules[node.target]
        if type(first) not in bn_of and type(first) not in (nn.BatchNorm2d, nn.BatchNorm3d):
            continue
        qc = getattr(first, "qconfig", None)
        # a layer kept float (no qconfig) still fuses, as torch.ao fuses it: eval folds its BN (the float fused module
        # is what search="fast"'s float copy of the layer computes), QAT keeps the float nni.ConvBn*d; only the clamps
        # torch.ao does not fuse (ReLU6-like) stay modules of their own, and a standalone BN stays one too
        excluded = require_qconfig and qc is None
        run, mods = [node], [first]
        act_node: fx.Node | None = None  # the activation the run absorbed, if any, and its module (act)
        act: nn.Module | None = None
        if type(first) in bn_of:
            nxt = next(iter(node.users)) if len(node.users) == 1 else None
            # a Linear's BatchNorm1d normalises its features only on a 2-D output (on (N, L, F) it normalises dim 1,
            # not the features: no fold); the rank is known when example inputs ran the graph
            rank_ok = type(first) is not nn.Linear or node.meta.get("lowbit_rank", 2) == 2
            # a BN without running statistics normalises with batch statistics even in eval: nothing to fold, it
            # stays a float op (fuse_modules refuses it; here the whole graph was refused)
            if (nxt is not None and nxt.op == "call_module" and calls[nxt.target] == 1 and rank_ok
                    and type(modules[nxt.target]) is bn_of[type(first)] and modules[nxt.target].track_running_stats
                    and _hook_free_join(first, modules[nxt.target])):
                run.append(nxt)
                mods.append(modules[nxt.target])
        if type(first) in _LAYERS or type(first) in (nn.Linear, nn.BatchNorm2d, nn.BatchNorm3d):
            relu = _relu_user(run[-1], modules)
            act = modules[relu.target] if relu is not None and relu.op == "call_module" else nn.ReLU()
            clamp = None if relu is not None or is_qat else _clamp_user(run[-1], modules)
            if clamp is not None and excluded:  # (float: no grid to clamp on; it stays a float module, as in torch.ao)
                if clamp[0].op == "call_module" and hasattr(modules[clamp[0].target], "qconfig"):
                    modules[clamp[0].target].qconfig = None
                clamp = None
            if clamp is not None:  # ReLU6-like: its [0, t] clamp becomes the layer's output grid
                relu, act = clamp
            linear_bn = type(first) is nn.Linear and len(run) == 2
            relu_mod = modules[relu.target] if relu is not None and relu.op == "call_module" else act
            if (relu is not None and not linear_bn and calls.get(relu.target, 1) == 1
                    and _hook_free_join(mods[-1], relu_mod)):
                run.append(relu)
                mods.append(relu_mod)  # (a ReLU6 module itself: fuse_known_modules makes its ClampedReLU, moves its hooks)
                act_node = relu
        if len(run) == 1:
            continue
        if require_qconfig and qc is not None and is_dynamic_qconfig(qc):
            continue  # dynamic layers have no fused dynamic twin
        if excluded and type(first) in (nn.BatchNorm2d, nn.BatchNorm3d):
            # a standalone BN kept float stays a BN (the float clamp / stream equalizations read it); its ReLU stays
            # float with it (else an int8 ReLU of its own after a quantize the float BN never asked for)
            for n in run[1:]:
                if n.op == "call_module" and hasattr(modules[n.target], "qconfig"):
                    modules[n.target].qconfig = None
            continue
        new = fuse_known_modules(mods, is_qat=is_qat)[0]
        if hasattr(first, "qconfig"):
            new.qconfig = first.qconfig
        _set_module(gm, node.target, new)
        modules[node.target] = new
        run[-1].replace_all_uses_with(node)
        for n in reversed(run[1:]):
            gm.graph.erase_node(n)
            erased.add(n)
        drop_absorbed(gm, [str(n.target) for n in run[1:] if n.op == "call_module"])
        fused.append(f"{node.target}: {' + '.join(type(m).__name__ for m in mods)} -> {type(new).__name__}")
        if absorbed is not None:
            absorbed[node.target] = [_absorbed_entry(n, act, n is act_node) for n in run[1:]]
    # relu(F.linear(x, self.w, self.b)) -> linear_relu(x, self.w, self.b) (likewise F.conv1d/2d/3d)
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function" or node.target not in WITH_RELU:
            continue
        relu = _relu_user(node, modules)
        clamp = None if relu is not None or is_qat else _clamp_user(node, modules)
        if clamp is not None:  # ReLU6-like: the fused node clamps at t, its output grid does it in int8
            relu = clamp[0]
        if relu is None or parse(node, gm)[0] is None:
            continue  # a layer graph mode cannot quantize keeps its float form
        if clamp is not None:
            node.kwargs = {**node.kwargs, "relu_max": clamp[1].max_val}
        base, node.target = node.target, WITH_RELU[node.target]
        node.meta["lowbit_target"] = base  # (the qconfig mapping's object-type key)
        relu.replace_all_uses_with(node)
        gm.graph.erase_node(relu)
        erased.add(relu)
        fused.append(f"{node.name}: {base.__name__} + relu -> {node.target.__name__}")
    # relu(a + b) -> add_relu(a, b)
    for node in list(gm.graph.nodes):
        if node in erased or canonical_binary(node.op, node.target) != "add" or node.kwargs:
            continue
        if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        relu = _relu_user(node, modules)
        if relu is None:
            continue
        with gm.graph.inserting_after(node):
            new_node = gm.graph.call_function(add_relu, tuple(node.args))
        new_node.meta = {**node.meta, "lowbit_target": node.target}  # (operator.add or torch.add: its own setting)
        relu.replace_all_uses_with(new_node)
        gm.graph.erase_node(relu)
        gm.graph.erase_node(node)
        erased.update((relu, node))
        fused.append(f"{new_node.name}: add + relu -> add_relu")
    gm.graph.lint()
    gm.recompile()
    return fused
