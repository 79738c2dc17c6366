"""Whether a model came from ``prepare_fx`` / ``prepare_qat_fx``: the mark it carries, its way through ``pickle``, and
the refusal of one that does not (split from ``prepare.py`` / ``convert.py``).

``prepare_fx`` marks the graph it returns with ``gm.meta[STATE_KEY]`` (a container of prepared children: its
``__dict__``); each node's role is in its ``node.meta`` (``lowbit_kind``, ``lowbit_domain``, ``lowbit_qconfig`` ...).
``pickle`` / ``torch.save`` rebuild a ``GraphModule`` from its code: ``meta``, every node's ``meta`` and the root's
hooks are dropped, the rest of ``__dict__`` is kept (a deep copy keeps only what the graph reads). So each prepared
graph holds a ``Carry`` there (``carry``; its deep copies get theirs from a deepcopy hook, a loaded graph's copy
the snapshot from the ``Carry`` itself: a loaded graph has no hook): when pickled it takes a
snapshot of the mark, of the nodes' ``lowbit_*`` metadata and of the root's hooks (lowbit's ``load_state_dict``
pre-hooks, the ``attention_mask`` hooks). Nothing runs at load: ``is_prepared`` (so ``convert_fx``,
``convert_to_reference_fx``, ``prepare_fx``'s checks) or ``lowbit.fx.restore(model)`` puts them back on the rebuilt
graphs: the ``i``-th saved node of an ``(op, target)`` onto the ``i``-th re-traced one, every node matched or none
(re-tracing reads a tensor attribute once per use: those reads are merged first), so a loaded prepared model converts
exactly as the one saved (code, codes, grids and outputs). A graph that cannot be matched, an ``attention_mask`` model
calibrated after loading but before ``restore`` (its padding went into the statistics: the observers' bytes differ
from the snapshot's), or a pickle from before the carry is refused by ``check_prepared``, naming the cause and the
way out.

>>> import torch
>>> from torch import fx
>>> is_prepared(fx.symbolic_trace(torch.nn.Linear(2, 2)))
False
>>> check_prepared(torch.nn.Linear(2, 2), "convert_fx")
Traceback (most recent call last):
    ...
TypeError: convert_fx: expects a model returned by prepare_fx or prepare_qat_fx, got Linear
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections import Counter
from typing import Any, TypeVar

import torch
from torch import fx, nn

try:  # torch.fx's (private) meta key of the attributes GraphModule.__deepcopy__ sets again (fx/child_reads.py)
    from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY as PRESERVED_KEY
except ImportError:  # pragma: no cover - a torch without the name: its value in torch 2.1-2.13
    PRESERVED_KEY = "_user_preserved_attributes"

__all__ = ["STATE_KEY", "PRESERVED_KEY", "Carry", "carry", "check_prepared", "is_prepared", "restore", "uncarry"]

STATE_KEY = "lowbit_fx"  # gm.meta key marking a graph prepared by prepare_fx / prepare_qat_fx
M = TypeVar("M", bound=nn.Module)
CARRY_KEY = "_lowbit_fx_carry"  # gm.__dict__ key of its Carry (GraphModule.__reduce__ keeps __dict__, not meta)

_FIX = "load the prepared model's state_dict into a fresh prepare_fx / prepare_qat_fx model"
_REBUILT = ("a GraphModule with observers but no prepare state (pickle / torch.save rebuild a GraphModule from its "
            f"code and drop it); {_FIX}")


def _target(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _ours(hook: Any) -> bool:
    """A hook lowbit registered (a function of a ``lowbit`` module, or a ``functools.partial`` of one)."""
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__module__", "").split(".")[0] == "lowbit"


def _snapshot(gm: fx.GraphModule) -> dict[str, Any] | None:
    """What ``pickle`` would drop from a prepared (not converted) graph: its mark, node metadata, root hooks."""
    from .padding import _push

    state = gm.meta.get(STATE_KEY)
    if state is None or state.get("converted"):
        return None
    nodes = [(n.op, _target(n), {k: v for k, v in n.meta.items() if k.startswith("lowbit_")}) for n in gm.graph.nodes]
    padding = _push in gm._forward_pre_hooks.values()
    return {"state": state, "nodes": nodes, "seen": _statistics(gm) if padding else None,
            "load_hooks": [h.hook for h in gm._load_state_dict_pre_hooks.values() if _ours(getattr(h, "hook", None))],
            "padding": padding}


def _digest(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "meta"
    return hashlib.blake2b(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=8).hexdigest()


def _statistics(gm: fx.GraphModule) -> list[tuple[str, tuple[int, ...], str]]:
    """A digest of the padding-hooked observers' statistics (name, shape, hash of each buffer's bytes): whether the
    model was run between pickling and ``restore``."""
    from .padding import _observe_pre

    return [(f"{m}.{b}", tuple(t.shape), _digest(t)) for m, mod in gm.named_modules()
            if _observe_pre in mod._forward_pre_hooks.values() for b, t in mod.named_buffers(recurse=False)]


def _loaded(saved: dict[str, Any] | None) -> Carry:
    return Carry(None, saved)


class Carry:
    """A prepared graph's state through ``pickle`` (module docstring): bound to its graph, it pickles as a snapshot
    of it; unpickled, it holds the snapshot until ``restore`` puts it back (``lost``: why it could not)."""

    def __init__(self, gm: fx.GraphModule | None, saved: dict[str, Any] | None = None) -> None:
        self._gm = None if gm is None else weakref.ref(gm)
        self.saved, self.lost = saved, ""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        gm = None if self._gm is None else self._gm()
        return (_loaded, (self.saved if gm is None else _snapshot(gm),))

    def __deepcopy__(self, memo: dict[int, Any]) -> Carry:  # (GraphModule.__deepcopy__ put the copy in memo first)
        gm = None if self._gm is None else self._gm()
        new = Carry(None if gm is None else memo.get(id(gm)), copy.deepcopy(self.saved, memo))
        new.lost = self.lost
        if gm is None and self.saved is not None:  # a loaded graph not yet restored: no deepcopy hook (module doc)
            into = _copy_in_progress(memo)
            if into is not None:
                into.__dict__[CARRY_KEY] = new  # (GraphModule.__init__ keeps it; restored on the copy as on the loaded)
        return new


def _copy_in_progress(memo: dict[int, Any]) -> fx.GraphModule | None:
    """The ``GraphModule`` whose ``__dict__`` is being deep-copied: ``GraphModule.__deepcopy__`` puts its copy,
    made by ``__new__``, in ``memo`` and initialises it only after the ``__dict__``; the latest such copy not yet
    initialised (no ``_modules``: the graphs inside it were copied, and initialised, before)."""
    for v in reversed(list(memo.values())):
        if isinstance(v, fx.GraphModule) and "_modules" not in v.__dict__:
            return v
    return None


def carry(gm: fx.GraphModule) -> None:
    """Give a prepared graph its ``Carry`` (``prepare_fx`` calls it on every graph it prepares), and its deep copies
    theirs (``GraphModule.__deepcopy__`` keeps only the attributes the graph reads, then runs its deepcopy hooks)."""
    gm.__dict__[CARRY_KEY] = Carry(gm)
    hooks = gm.__dict__.get("_deepcopy_hooks")
    if isinstance(hooks, list) and carry not in hooks:
        hooks.append(carry)


def uncarry(gm: nn.Module) -> None:
    """Drop ``carry``'s attribute and hook (``convert_fx``: a converted graph pickles as it is)."""
    gm.__dict__.pop(CARRY_KEY, None)
    hooks = gm.__dict__.get("_deepcopy_hooks")
    if isinstance(hooks, list) and carry in hooks:
        hooks.remove(carry)


def _one_read_each(gm: fx.GraphModule, saved: Counter[str]) -> None:
    """Re-tracing reads a tensor attribute once per use (a ``get_attr`` node each) where the saved graph read it
    once: those reads merged back into the first (a read has no side effect)."""
    first: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or saved[node.target] != 1:
            continue
        if node.target in first:
            node.replace_all_uses_with(first[node.target])
            gm.graph.erase_node(node)
        else:
            first[node.target] = node  # type: ignore[index]
    gm.recompile()


def _restore_one(gm: fx.GraphModule, c: Carry) -> None:
    saved = c.saved
    assert saved is not None
    _one_read_each(gm, Counter(t for op, t, _ in saved["nodes"] if op == "get_attr"))
    nodes = list(gm.graph.nodes)
    keys = [(n.op, _target(n)) for n in nodes]
    want = [(op, t) for op, t, _ in saved["nodes"]]
    if Counter(keys) != Counter(want):
        gone = sorted(f"{op} {t}" for op, t in (Counter(want) - Counter(keys)))
        new = sorted(f"{op} {t}" for op, t in (Counter(keys) - Counter(want)))
        c.lost = (f"the re-traced graph's nodes do not match the saved prepare state (saved only: {gone[:3]}, "
                  f"re-traced only: {new[:3]}); {_FIX}")
        return
    slots: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for op, t, meta in saved["nodes"]:
        slots.setdefault((op, t), []).append(meta)
    seen: Counter[tuple[str, str]] = Counter()
    for node, key in zip(nodes, keys):  # the i-th node of an (op, target) gets the i-th saved one's metadata
        node.meta.update(slots[key][seen[key]])
        seen[key] += 1
    if saved.get("padding") and saved.get("seen") != _statistics(gm):
        c.lost = ("it was calibrated after loading, before its attention_mask hooks were put back (the padding "
                  "tokens went into its statistics); load it again and call lowbit.fx.restore(model) before "
                  "calibrating")
        return
    gm.meta[STATE_KEY] = saved["state"]
    if saved["state"].get("kept_reads"):  # (fx/child_reads.py: a parent's reads of plain attributes, for deepcopy)
        gm.meta.setdefault(PRESERVED_KEY, {}).update(saved["state"]["kept_reads"])
    carry(gm)
    for hook in saved.get("load_hooks", []):  # (the load guard, absorbed BN keys skipped: fx/absorbed.py)
        gm.register_load_state_dict_pre_hook(hook)
    if saved.get("padding"):
        from .padding import attach
        attach(gm)


def restore(model: M) -> M:
    """Put back the prepare state of every graph in ``model`` that ``pickle`` rebuilt (module docstring); returns
    ``model``. ``convert_fx`` and the other graph-mode entry points call it; call it yourself right after loading a
    model whose ``forward`` takes ``attention_mask`` before calibrating it (its padding hooks come back here).

    >>> import pickle, torch
    >>> from lowbit.fx import prepare_fx
    >>> p = prepare_fx(torch.nn.Sequential(torch.nn.Linear(2, 2)), example_inputs=(torch.randn(1, 2),))
    >>> q = pickle.loads(pickle.dumps(p))
    >>> STATE_KEY in q.meta, STATE_KEY in restore(copy.deepcopy(q)).meta, STATE_KEY in restore(q).meta
    (False, True, True)
    """
    for m in model.modules():
        c = m.__dict__.get(CARRY_KEY) if isinstance(m, fx.GraphModule) else None
        if isinstance(c, Carry) and c.saved is not None and not c.lost and STATE_KEY not in m.meta:
            _restore_one(m, c)
    return model


def is_prepared(model: Any) -> bool:
    """Whether ``model`` came from ``prepare_fx`` / ``prepare_qat_fx`` (a GraphModule or a container; a pickled one's
    state put back first)."""
    if isinstance(model, nn.Module):
        restore(model)
    if isinstance(model, fx.GraphModule):
        return STATE_KEY in model.meta
    return isinstance(model, nn.Module) and STATE_KEY in model.__dict__


def _lost(model: nn.Module) -> str:
    """Why a pickled graph in ``model`` could not take its prepare state back ("" when none says)."""
    return next((c.lost for m in model.modules() if isinstance(c := m.__dict__.get(CARRY_KEY), Carry) and c.lost), "")


def check_prepared(model: Any, who: str) -> None:
    """A ``TypeError`` naming what ``model`` is unless ``is_prepared(model)`` (a pickled prepared graph: why, and
    the way out)."""
    if is_prepared(model):
        lost = _lost(model)
        if lost:  # (a container whose child graph could not be matched: it would convert as float, a different model)
            raise TypeError(f"{who}: a graph of this pickled prepared model lost its prepare state: {lost}")
        return
    from ..fake_quant.base import FakeQuantize
    from ..observer.base import ObserverBase

    observed = isinstance(model, fx.GraphModule) and any(isinstance(m, (ObserverBase, FakeQuantize))
                                                         for m in model.modules())
    why = _lost(model) if isinstance(model, nn.Module) else ""
    raise TypeError(f"{who}: expects a model returned by prepare_fx or prepare_qat_fx, got {type(model).__name__}"
                    + ("" if isinstance(model, nn.Module) else " (not an nn.Module)")
                    + (f": {why}" if why else f": {_REBUILT}" if observed else ""))
