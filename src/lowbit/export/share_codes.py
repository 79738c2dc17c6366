"""``to_onnx(exact=True)``'s graph pass: consumers read their producer's codes instead of re-quantizing its floats.

An exact export (``lowbit.export.exact``) ends every quantized result on its float32 codes ``P`` (a ``Clip`` to the
grid's range) and leaves it as ``Cast -> DequantizeLinear(s, z)`` (int8 codes as ``P + 128``); every quantized reader
then takes its codes back from those floats with lowbit's quantize::

    P -> [Add(128)] -> Cast -> DequantizeLinear(s, z) -> [shape ops] -> Mul(fl(1/s')) -> Add(z') -> Round -> Clip(lo', hi')

four float ops per reader (a Cast more for integer kernels). In lowbit the reader takes the producer's ``QTensor``
codes as they are, and on the producer's grid the chain is the identity. This pass proves that for each chain by
evaluating it, in float32 as ONNX Runtime does (``(q - z) · s``, then ``fl(fl(d · m) + a)``, round half to even,
clip), on every code ``v`` in ``P``'s range ``[lo, hi]``; where every ``v`` comes back as ``v``, the reader's ``Clip``
is replaced by ``P`` (through clones of the shape ops on the way: ``Reshape``, ``Flatten``, ``Transpose``,
``Squeeze``, ``Unsqueeze``, ``Identity`` and ``MaxPool``, which commute with the increasing map ``v -> (v - z) · s``).
A ``Cast`` to float of a ``Cast`` of such codes to 8 bits is the codes themselves. Nodes left without readers are
removed, and initializers left unread. Codes are unchanged by construction: each rewired tensor holds the same values.

>>> import numpy as np
>>> from onnx import helper, numpy_helper, TensorProto
>>> c = lambda n, v: numpy_helper.from_array(np.array(v, dtype=np.float32), n)
>>> nodes = [helper.make_node("Round", ["x"], ["xr"]), helper.make_node("Clip", ["xr", "lo", "hi"], ["p"]),
...          helper.make_node("Cast", ["p"], ["u"], to=2),
...          helper.make_node("DequantizeLinear", ["u", "s", "z"], ["d"]), helper.make_node("Mul", ["d", "inv"], ["m"]),
...          helper.make_node("Add", ["m", "zf"], ["a"]), helper.make_node("Round", ["a"], ["r"]),
...          helper.make_node("Clip", ["r", "lo", "hi"], ["y"]), helper.make_node("Sub", ["y", "zf"], ["c"])]
>>> inits = [c("lo", 0.0), c("hi", 255.0), c("s", 0.1), numpy_helper.from_array(np.array(3, np.uint8), "z"),
...          c("inv", np.float32(1) / np.float32(0.1)), c("zf", 3.0)]
>>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
...                       [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])], inits)
>>> share_codes(g), [(n.op_type, list(n.input)) for n in g.node]
(1, [('Round', ['x']), ('Clip', ['xr', 'lo', 'hi']), ('Sub', ['p', 'zf'])])
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["share_codes"]

_SHAPE_OPS = ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "MaxPool")
_INT8 = {2: (0, 255), 3: (-128, 127)}  # TensorProto UINT8 / INT8 ranges


class _Graph:
    def __init__(self, graph: Any) -> None:
        from onnx import numpy_helper  # optional dependency: imported when an export runs

        self.g = graph
        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.names = {t for n in graph.node for t in list(n.input) + list(n.output)} | set(self.consts)

    def readers(self, name: str) -> list[Any]:
        return [n for n in self.g.node if name in n.input]

    def scalar(self, name: str) -> float | None:
        v = self.consts.get(name)
        return float(v) if v is not None and v.size == 1 else None

    def other(self, node: Any, name: str) -> float | None:
        """The constant scalar operand of a two-input ``node`` beside ``name``."""
        ins = list(node.input)
        if len(ins) != 2 or name not in ins:
            return None
        return self.scalar(ins[1] if ins[0] == name else ins[0])

    def fresh(self, base: str) -> str:
        name, i = f"{base}_codes", 0
        while name in self.names:
            i += 1
            name = f"{base}_codes{i}"
        self.names.add(name)
        return name


def _codes_of(G: _Graph, dq: Any) -> tuple[str, np.ndarray] | None:
    """``(P, d)`` for a ``DequantizeLinear`` of ``Cast([Add(P, off)])`` with ``P`` a ``Clip`` to integer constants:
    ``d[i]`` is the float32 value ORT dequantizes code ``lo + i`` to; ``None`` for any other form."""
    if len(dq.input) < 2 or G.scalar(dq.input[1]) is None:
        return None
    s = np.float32(G.scalar(dq.input[1]))
    zq = int(G.scalar(dq.input[2]) or 0) if len(dq.input) > 2 else 0
    cast = G.producer.get(dq.input[0])
    if cast is None or cast.op_type != "Cast":
        return None
    src, off = cast.input[0], 0.0
    add = G.producer.get(src)
    if add is not None and add.op_type == "Add" and G.other(add, add.input[0]) is not None:
        src, off = add.input[0], G.other(add, add.input[0])
    clip = G.producer.get(src)
    if clip is None or clip.op_type != "Clip" or len(clip.input) != 3 or not _integral(G, clip.input[0]):
        return None
    lo, hi = G.scalar(clip.input[1]), G.scalar(clip.input[2])
    if lo is None or hi is None or lo != int(lo) or hi != int(hi) or off != int(off) or not 0 <= hi - lo <= 65535:
        return None
    v = np.arange(int(lo), int(hi) + 1, dtype=np.int64)
    t = v + int(off)
    if not all(t.min() >= a and t.max() <= b for a, b in [_INT8.get(_to(cast), (-2**31, 2**31 - 1))]):
        return None  # (the Cast would wrap: not the values below)
    return src, (t - zq).astype(np.float32) * s


def _integral(G: _Graph, name: str, depth: int = 6) -> bool:
    """Whether ``name`` holds integers: a ``Round``, or ``Add`` / ``Sub`` / ``Clip`` of such with integer constants,
    or a ``Concat`` of such (the forms exact exports end on before their ``Clip``)."""
    n = G.producer.get(name)
    if n is None or depth == 0:
        return False
    if n.op_type == "Round":
        return True
    if n.op_type == "Concat":
        return all(_integral(G, i, depth - 1) for i in n.input)
    if n.op_type in ("Add", "Sub", "Clip") and n.input:
        consts = [G.scalar(i) for i in n.input[1:]] if n.op_type == "Clip" else [G.other(n, n.input[0])]
        return all(c is not None and c == int(c) for c in consts) and _integral(G, n.input[0], depth - 1)
    return False


def _to(cast: Any) -> int:
    return next((a.i for a in cast.attribute if a.name == "to"), 0)


def _read_back(G: _Graph, mul: Any, name: str, d: np.ndarray, lo: int) -> Any | None:
    """The final ``Clip`` of ``Mul(name, m) -> Add(a) -> Round -> Clip(l, h)`` if that chain, evaluated in float32 on
    the dequantized codes ``d`` (of codes ``lo, lo + 1, ...``), gives every code back, else ``None``."""
    chain, cur = [mul], mul
    for op in ("Add", "Round", "Clip"):
        nxt = G.readers(cur.output[0])
        if len(nxt) != 1 or nxt[0].op_type != op:
            return None
        cur = nxt[0]
        chain.append(cur)
    m, a = G.other(mul, name), G.other(chain[1], mul.output[0])
    lim = [G.scalar(chain[3].input[i]) if len(chain[3].input) > i else None for i in (1, 2)]
    if m is None or a is None or lim[0] is None or lim[1] is None:
        return None
    y = np.round(d * np.float32(m) + np.float32(a))  # float32 products and sums, half to even (ORT's Round)
    codes = np.clip(y, np.float32(lim[0]), np.float32(lim[1]))
    return chain[3] if bool(np.array_equal(codes, lo + np.arange(len(d), dtype=np.float32))) else None


def share_codes(graph: Any) -> int:
    """Rewire every reader chain of the module doc to its producer's codes; return how many chains were replaced."""
    from onnx import NodeProto

    G = _Graph(graph)
    outputs = {o.name for o in graph.output}
    replace: dict[str, str] = {}
    inserts: list[tuple[Any, Any]] = []  # (after node, new node)
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear"]:
        found = _codes_of(G, dq)
        if found is None:
            continue
        src, d = found
        lo = int(G.scalar(G.producer[src].input[1]) or 0)
        todo = [(dq.output[0], src)]
        while todo:
            name, codes = todo.pop()
            for n in G.readers(name):
                if n.op_type in _SHAPE_OPS and n.input[0] == name and len(n.output) == 1:
                    clone = NodeProto()
                    clone.CopyFrom(n)
                    clone.input[0], clone.output[0] = codes, G.fresh(n.output[0])
                    clone.name = f"{n.name}_codes" if n.name else ""
                    inserts.append((n, clone))
                    todo.append((n.output[0], clone.output[0]))
                elif n.op_type == "Mul":
                    end = _read_back(G, n, name, d, lo)
                    if end is not None and end.output[0] not in outputs:
                        replace[end.output[0]] = codes
    if not replace:
        return 0
    nodes = list(graph.node)
    for after, clone in inserts:
        nodes.insert(next(i for i, n in enumerate(nodes) if n is after) + 1, clone)
    for n in nodes:
        for i, name in enumerate(n.input):
            while name in replace:  # (a Quantize reading codes on its own grid: its readers read the first codes)
                name = replace[name]
            n.input[i] = name
    _drop_casts(nodes, G, set(replace.values()), outputs)
    del graph.node[:]
    graph.node.extend(_live(nodes, outputs))
    read = {name for n in graph.node for name in n.input} | outputs
    unused = [t for t in graph.initializer if t.name not in read]  # (ORT warns about each)
    for t in unused:
        graph.initializer.remove(t)
    return len(replace)


def _drop_casts(nodes: list[Any], G: _Graph, codes: set[str], outputs: set[str]) -> None:
    """``Cast(float) <- Cast(8-bit) <- codes``: the codes (integers in the 8-bit range: the identity)."""
    producer = {o: n for n in nodes for o in n.output}
    alias: dict[str, str] = {}
    for n in nodes:
        inner = producer.get(n.input[0]) if n.op_type == "Cast" and n.input else None
        if (_to(n) == 1 and inner is not None and inner.op_type == "Cast" and _to(inner) in _INT8
                and inner.input[0] in codes and n.output[0] not in outputs):
            alias[n.output[0]] = inner.input[0]
    for n in nodes:
        for i, name in enumerate(n.input):
            n.input[i] = alias.get(name, name)


def _live(nodes: list[Any], outputs: set[str]) -> list[Any]:
    """``nodes`` without those whose outputs nothing reads (repeated until none is left)."""
    while True:
        read = {name for n in nodes for name in n.input} | outputs
        keep = [n for n in nodes if any(o in read for o in n.output)]
        if len(keep) == len(nodes):
            return keep
        nodes = keep
