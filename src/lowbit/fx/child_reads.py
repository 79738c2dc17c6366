"""What an untraceable forward reads of its children, kept on their prepared graphs.

A module whose own ``forward`` torch.fx cannot trace keeps that forward and has each child prepared one by one
(``prepare.py``): the child becomes a ``GraphModule``, a leaf layer (``nn.Linear``) one that calls it as ``module``.
Such a graph holds only what it runs, so the parent's own reads of the child, ``F.linear(x, self.proj.weight * 0.5)``,
tied weights ``x @ self.emb.weight.t()``, ``self.proj.weight.shape[0]`` or ``self.proj.out_features``, failed when the
prepared model first ran (``AttributeError: '_LeafRoot' object has no attribute 'weight'``), and after ``convert_fx``
the child's ``weight`` would be the int8 module's method. ``keep_child_reads`` gives the graph the attributes the
parent's class reads, ``self.<child>.<attr>`` in its source (every tensor and plain attribute when the source
cannot be read, or when a method other than ``__init__`` reaches the child another way: ``self._modules["proj"]``,
``p = self.proj; p.weight``, ``helper(self.proj)``): a parameter / buffer as the same tensor (the parent reads the
float parameter, the child's own call is quantized; ``convert_fx`` leaves it float), read by a ``get_attr`` node no
value depends on so that ``deepcopy`` and ``pickle`` (which keep what the graph reads) keep it; a number, string or
tuple as a preserved attribute (a ``None`` parameter, ``bias=False``, as ``None``). The source scan reads
``self.proj``, ``getattr(self, "proj")``, ``self._modules["proj"]`` and ``self.get_submodule("proj")`` alike
(``self.get_submodule("block.fc")``: ``self.block.fc``).

A read of a tensor of the child's own submodule, ``self.block.fc.weight`` (``block`` prepared as a graph that calls
``fc``), met a fused ``LinearReLU`` (no ``weight``) and after ``convert_fx`` the int8 module's method: the graph's
calls of ``fc`` now call ``fc.module`` (the fused / observed / converted module moved there) and ``fc`` holds the
float tensors read, as above. State-dict keys move with it (``block.fc.module.0.weight`` beside the kept
``block.fc.weight``); where the graph also reads ``fc``'s tensors itself (``get_attr``) the read is only warned.

>>> import torch
>>> from torch import fx, nn
>>> class Parent(nn.Module):
...     def forward(self, x):
...         return x @ self.proj.weight.t() * self.proj.out_features
>>> parent = Parent()
>>> parent.proj = nn.Linear(2, 3)
>>> gm = fx.symbolic_trace(nn.Sequential(parent.proj))
>>> keep_child_reads(parent, "proj", gm)  # (a doctest's class has no source to read: every attribute)
['bias', 'in_features', 'out_features', 'weight']
>>> gm.weight is parent.proj.weight, gm.out_features
(True, 3)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
import torch
from torch import fx, nn

from .state import PRESERVED_KEY as _USER_PRESERVED_ATTRIBUTES_KEY  # (torch's private key, guarded in fx/state.py)
from .state import STATE_KEY

__all__ = ["keep_child_reads", "read_attributes", "reads_layout"]

_PLAIN = (bool, int, float, str, tuple, torch.Size, torch.dtype, type(None))


def read_attributes(cls: type, name: str) -> set[str] | None:
    """The attributes ``attr`` that methods of ``cls`` (and its bases below ``nn.Module``) read as
    ``self.<name>.<attr>``; ``None`` when a source cannot be read.

    >>> from lowbit.nn.intrinsic.qat.modules import BnFoldedBase  # (self.layer.weight, self.layer._conv_forward(...))
    >>> sorted(read_attributes(BnFoldedBase, "layer"))
    ['_conv_forward', 'bias', 'weight']
    >>> class M(nn.Module):  # (a class typed in a doctest or a REPL has no source file)
    ...     def forward(self, x):
    ...         return x * self.fc.weight.shape[0]
    >>> read_attributes(M, "fc") is None
    True
    """
    reads = _class_reads(cls)
    return None if reads is None else set(reads.get(name, ()))


@functools.lru_cache(maxsize=256)
def _class_reads(cls: type) -> dict[str, frozenset[str]] | None:
    """``{child name: the attributes read of it}`` over the methods of ``cls`` (``"child.sub"``: of its submodule
    ``sub``, ``self.child.sub.attr``, and so on down); ``None`` without a source."""
    methods = _methods(cls)
    if methods is None:
        return None
    found: dict[str, set[str]] = {}
    for fn in methods:
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            path = _path(node, me)
            for k in range(1, len(path or ())):  # (``self.a.b.c``: ``a`` reads ``b``, ``a.b`` reads ``c``)
                found.setdefault(".".join(path[:k]), set()).add(path[k])
    return {k: frozenset(v) for k, v in found.items()}


@functools.lru_cache(maxsize=256)
def _methods(cls: type) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, ...] | None:
    """The functions with a first argument defined in the source of ``cls`` and of its ``nn.Module`` bases outside
    torch (methods and the functions nested in them), or ``None`` where one of those classes has no source (a class
    typed in a REPL or a doctest)."""
    found = []
    for base in cls.__mro__:
        if base in (nn.Module, object) or not issubclass(base, nn.Module) or base.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            return None
        found += [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args]
    return tuple(found)


_TABLES = ("_modules", "_parameters", "_buffers")


def _path(node: ast.AST, me: str) -> list[str] | None:
    """The names an expression reads from ``me`` (``self``): ``self.a.b`` -> ``['a', 'b']``, spelled also
    ``getattr(self, "a")`` (a constant name), ``self._modules["a"]`` (``_parameters`` / ``_buffers``) or
    ``self.get_submodule("a.b")``; ``None`` for any other expression."""
    if isinstance(node, ast.Name):
        return [] if node.id == me else None
    if isinstance(node, ast.Attribute):
        head, name = node.value, node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        head, name = node.args[0], node.args[1].value
    elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in _TABLES
          and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        head, name = node.value.value, node.slice.value
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_submodule"
          and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
          and node.args[0].value):  # (``self.get_submodule("block.fc")``: a dotted path reads down the tree)
        head, name = node.func.value, node.args[0].value
    else:
        return None
    path = _path(head, me)
    return None if path is None else [*path, *name.split(".")]


_ALL_CHILDREN = {"_modules", "get_submodule"}  # (not ``self.modules()`` loops: weight init, not a forward's read)
_NOT_ESCAPING = {"isinstance", "type", "id"}  # (calls that read the child object without its attributes)


@functools.lru_cache(maxsize=256)
def _escaping(cls: type) -> frozenset[str]:
    """The children that methods of ``cls`` other than ``__init__`` reach some way ``_class_reads`` cannot follow
    (``"*"``: any child): ``self.<name>`` not read as ``self.<name>.<attr>`` nor called, e.g. ``p = self.proj`` then
    ``p.weight``, ``helper(self.proj)``, ``getattr(self.proj, "weight")``; ``self._modules["proj"]`` /
    ``get_submodule("proj")`` name it; ``self._modules[k]`` reaches every child. Such a child keeps every
    attribute, as a class without source does.

    >>> class M(nn.Module):  # (a doctest's class has no source: nothing to scan)
    ...     pass
    >>> _escaping(M)
    frozenset()
    """
    found: set[str] = set()
    for fn in _methods(cls) or ():
        if fn.name == "__init__":
            continue
        me = fn.args.args[0].arg
        parents = {id(c): p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me
                    and isinstance(node.ctx, ast.Load)):
                continue
            up = parents.get(id(node))
            if node.attr in _ALL_CHILDREN:
                key = _constant_key(parents.get(id(up)) if isinstance(up, ast.Attribute) and up.attr == "get"
                                    else up, up if isinstance(up, ast.Attribute) else node)
                found.add(key if key is not None else "*")
            elif isinstance(up, ast.Attribute) or (isinstance(up, ast.Call) and up.func is node):
                continue
            elif isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in _NOT_ESCAPING:
                continue
            elif isinstance(up, ast.Compare):  # (``self.proj is None``)
                continue
            else:
                found.add(node.attr)
    return frozenset(found)


@functools.lru_cache(maxsize=256)
def _type_tests(cls: type) -> frozenset[str]:
    """The children whose type methods of ``cls`` other than ``__init__`` test: ``isinstance(self.proj, ...)``,
    ``issubclass(type(self.proj), ...)``, ``type(self.proj)`` (after ``prepare_fx`` the child is a ``GraphModule``:
    such a test sees another type and the forward may take another branch)."""
    found: set[str] = set()
    for fn in _methods(cls) or ():
        if fn.name == "__init__":
            continue
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "isinstance", "type") and node.args:
                path = _path(node.args[0], me)
                if path is not None and len(path) == 1:
                    found.add(path[0])
    return frozenset(found)


_LAYOUT = {"stride", "as_strided", "is_contiguous", "storage_offset", "data_ptr", "untyped_storage"}


@functools.lru_cache(maxsize=256)
def reads_layout(cls: type) -> bool:
    """Whether a method of ``cls`` other than ``__init__`` may read a tensor's memory layout (``.stride``,
    ``.as_strided``, ``.is_contiguous``, ``.storage_offset``, ``.data_ptr``, also by ``getattr(y, "stride")``;
    ``True`` without a source):
    ``convert_fx`` then lays the float outputs of ``cls``'s child graphs out as the float children's (an int8
    conv's are channels-last, so ``y.stride(1)`` / ``y.as_strided(...)`` read other values), a copy per output
    that a parent which reads no layout does not pay (+25 % on a per-child CNN). ``.view`` is not such a read:
    where the layout stops it torch raises ("view size is not compatible ... Use .reshape"), and a classifier's
    ``x.view(n, -1)`` after pooling to 1x1 works in either layout.

    >>> class M(nn.Module):
    ...     pass
    >>> reads_layout(M)  # (no source in a doctest)
    True
    """
    methods = _methods(cls)
    return methods is None or any(fn.name != "__init__" and any(_layout_name(n) for n in ast.walk(fn)) for fn in methods)


def _layout_name(node: ast.AST) -> bool:
    """``y.stride`` (``_LAYOUT``), also spelled ``getattr(y, "stride")``."""
    if isinstance(node, ast.Attribute):
        return node.attr in _LAYOUT
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in _LAYOUT)


def _constant_key(up: ast.AST | None, node: ast.AST) -> str | None:
    """The child named by ``self._modules["proj"]`` / ``self._modules.get("proj")`` / ``self.get_submodule("proj")``
    (``up``: the subscript or call, ``node``: what it subscripts or calls), else ``None``."""
    if isinstance(up, ast.Subscript) and isinstance(up.slice, ast.Constant) and isinstance(up.slice.value, str):
        return up.slice.value
    if isinstance(up, ast.Call) and up.func is node and up.args and isinstance(up.args[0], ast.Constant):
        return up.args[0].value if isinstance(up.args[0].value, str) and "." not in up.args[0].value else None
    return None


def keep_child_reads(parent: nn.Module, name: str, new: nn.Module, where: str = "prepare_fx") -> list[str]:
    """Give ``new``, the prepared graph of ``parent``'s child ``name`` (``parent``'s forward is not traced; called
    before ``new`` replaces the child), the attributes of the child the parent's class reads that ``new`` lacks
    (module doc); their names, sorted (``"fc.weight"``: a grandchild's, held by ``fc``; ``where``: who prepares, for
    the warning of a grandchild read that cannot be kept)."""
    child = parent._modules[name]
    if not isinstance(new, fx.GraphModule) or new is child or child is None:
        return []
    if name in _type_tests(type(parent)):
        warnings.warn(f"{where}: the forward of {type(parent).__name__} (not traced) tests the type of self.{name} "
                      f"(isinstance / type), which is now a prepared GraphModule, not a {type(child).__name__}: a test "
                      f"for {type(child).__name__} now fails; test an attribute instead, or make the forward "
                      f"traceable", stacklevel=5)
    kept = _keep_deep_reads(parent, name, child, new, where)
    if STATE_KEY in new.meta:
        new.meta[STATE_KEY]["layout_reads"] = reads_layout(type(parent))
    wanted = read_attributes(type(parent), name)
    if wanted is None or name in _escaping(type(parent)) or "*" in _escaping(type(parent)):
        wanted = {*(wanted or ()), *child._parameters, *child._buffers,
                  *(k for k, v in vars(child).items() if not k.startswith("_") and isinstance(v, _PLAIN))}
    for attr in sorted(wanted):
        if attr.startswith("__") or _has(new, attr):
            continue
        try:
            value = getattr(child, attr)
        except AttributeError:
            continue
        if isinstance(value, nn.Parameter) or isinstance(value, torch.Tensor) and attr in child._buffers:
            _keep_tensor(new, attr, new, attr, value, isinstance(value, nn.Parameter),
                         attr not in child._non_persistent_buffers_set)
        elif isinstance(value, _PLAIN) and (attr in vars(child) or value is None):  # (``bias=False``: a None entry)
            setattr(new, attr, value)  # (deepcopy sets the preserved ones again; a pickled prepared graph's are put
            new.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[attr] = value  # back from its state by restore)
            new.meta.get(STATE_KEY, {}).setdefault("kept_reads", {})[attr] = value
            kept.append(attr)
            continue
        else:
            continue
        kept.append(attr)
    if kept:
        new.recompile()
    return sorted(kept)


def _has(gm: nn.Module, attr: str) -> bool:
    return attr in gm._modules or attr in gm._parameters or attr in gm._buffers or attr in vars(gm) or hasattr(
        type(gm), attr)


def _keep_deep_reads(parent: nn.Module, name: str, child: nn.Module, new: fx.GraphModule, where: str) -> list[str]:
    """The parent's reads of a tensor of the child's own submodule, ``self.block.fc.weight`` (module doc): the graph
    calls ``fc`` (fused, observed, converted to an int8 module whose ``weight`` is a method), so the called module
    moves to ``fc.module`` and ``fc`` becomes a holder of the float tensors read (``_keep_tensor``). Kept only where
    the graph uses ``fc`` by calls alone (no ``get_attr`` of its tensors); else warned, naming the read."""
    kept, cls = [], type(parent).__name__
    for key, attrs in sorted((_class_reads(type(parent)) or {}).items()):
        head, _, sub = key.partition(".")  # (``sub``: ``fc``, or deeper, ``inner.fc``)
        inner = _submodule(child, sub) if head == name and sub else None
        tensors = sorted(a for a in attrs if inner is not None and (a in inner._parameters or a in inner._buffers)
                         and isinstance(getattr(inner, a), torch.Tensor))
        if not tensors:
            continue
        uses = [n for n in new.graph.nodes if n.op in ("call_module", "get_attr")
                and (n.target == sub or str(n.target).startswith(f"{sub}."))]
        called = _submodule(new, sub)
        if called is None or not uses or any(n.op != "call_module" or n.target != sub for n in uses):
            for attr in tensors:
                warnings.warn(f"{where}: the forward of {cls} (not traced) reads self.{name}.{sub}.{attr}, which "
                              f"graph mode cannot keep: the prepared '{name}' fuses, observes and converts '{sub}' "
                              f"(the read fails or meets the int8 module's method); read it from a child of {cls} "
                              f"itself, make {cls}'s forward traceable, or declare '{name}' non-traceable",
                              stacklevel=6)
            continue
        holder = nn.Module()
        holder.add_module("module", called)
        owner, _, last = sub.rpartition(".")
        new.get_submodule(owner)._modules[last] = holder
        for n in uses:
            n.target = f"{sub}.module"
        for attr in tensors:
            _keep_tensor(new, f"{sub}.{attr}", holder, attr, getattr(inner, attr), attr in inner._parameters,
                         attr not in inner._non_persistent_buffers_set)
            kept.append(f"{sub}.{attr}")
    return kept


def _submodule(mod: nn.Module, path: str) -> nn.Module | None:
    try:
        return mod.get_submodule(path)
    except AttributeError:
        return None


def _keep_tensor(new: fx.GraphModule, target: str, owner: nn.Module, attr: str, value: torch.Tensor, param: bool,
                 persistent: bool) -> None:
    """``owner.<attr> = value`` (a parameter or buffer), read by a ``get_attr`` node of ``new`` that no value depends
    on (so ``deepcopy`` and ``pickle`` keep it; ``convert_fx`` leaves it float)."""
    if param:
        owner.register_parameter(attr, value)  # type: ignore[arg-type]
    else:
        owner.register_buffer(attr, value, persistent=persistent)
    first = next((n for n in new.graph.nodes if n.op != "placeholder"), None)
    with new.graph.inserting_before(first):
        node = new.graph.get_attr(target)
    node.meta.update(lowbit_inserted=True, lowbit_kind="float", lowbit_domain="float", lowbit_kept_read=True)
