"""``to_onnx(exact="x86")``'s last graph pass: each exact Conv's requantization as depthwise 1x1 Convs.

An exact float-sum Conv (``lowbit.export.exact``) ends on lowbit's float32 epilogue, elementwise ops::

    acc -> Mul(S, .) -> [Add(b)] -> Mul(., inv) -> [Add(., z)] -> Round -> Clip(lo, hi)           (S, b per channel)

ONNX Runtime's NCHWc layout (the blocked layout of its fast float Convs) knows none of ``Add`` / ``Mul`` with a
constant, ``Round`` or ``Clip``, so every such Conv left NCHWc for them (a ``ReorderOutput`` / ``ReorderInput`` pair)
and ran four or five elementwise passes. Here the chain becomes depthwise 1x1 Convs (``group = C``), which NCHWc
runs in its layout::

    acc -> Conv(w = S, b) -> Conv(w = inv, b = z) -> Conv(w = 1, b = M) -> Conv(w = 1, b = -M) -> Clip(lo, hi)

with ``M = 1.5 · 2**23``. Each 1x1 depthwise Conv computes ``fl(fl(w · x) + b)``: one rounded product, then the bias
added (ORT / MLAS 1.32, checked on its NCHWc and plain paths, ``tests/test_onnxbench_s44.py``), the same two float32
operations as ``Mul`` then ``Add``. ``fl(fl(v + M) - M)`` is ``v`` rounded half to even for ``|v| < 2**22`` (the sum
lies in ``[2**23, 2**24)``, where float32 steps are 1, and ``M`` is even); beyond, both steps are increasing, so the
result is past the same end of ``[lo, hi]`` and the ``Clip`` gives what ``Clip(Round(v))`` gives. Where ``z = 0``
(``Add`` absent) the rounding's ``+M`` is the second Conv's bias: ``fl(fl(y · inv) + M)``. A zero code may come out
as ``+0`` where ``Round`` gave ``-0``: the same code. ORT fuses the ``Clip`` into the last Conv. Matched only on 2-D
``Conv`` outputs with float32 constants in the exporter's operand order; anything else is left as it is.
Opt-in (``exact="x86"``), not ``exact=True``'s default: x86 MLAS (AVX2, AVX-512) starts a depthwise Conv's sum at
zero and adds the bias after it, but ARM's NEON NCHWc kernel starts the sum at the bias and fuses the multiply-add
(``fl(w · x + b)``, one rounding), so the file is not exact there; the elementwise chain rounds each op on every build.

>>> import numpy as np
>>> from onnx import helper, numpy_helper
>>> c = lambda n, v: numpy_helper.from_array(np.asarray(v, dtype=np.float32), n)
>>> nodes = [helper.make_node("Conv", ["x", "w"], ["acc"]), helper.make_node("Mul", ["S", "acc"], ["y1"]),
...          helper.make_node("Mul", ["y1", "inv"], ["y2"]), helper.make_node("Round", ["y2"], ["r"]),
...          helper.make_node("Clip", ["r", "lo", "hi"], ["q"])]
>>> g = helper.make_graph(nodes, "g", [], [], [c("w", np.ones((2, 2, 1, 1))), c("S", [[[0.5]], [[0.25]]]),
...                                            c("inv", 4.0), c("lo", 0.0), c("hi", 255.0)])
>>> depthwise_epilogues(g), [n.op_type for n in g.node]
(1, ['Conv', 'Conv', 'Conv', 'Conv', 'Clip'])
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MAGIC", "depthwise_epilogues"]

MAGIC = np.float32(1.5 * 2**23)  # fl(fl(v + MAGIC) - MAGIC) = round_half_even(v) for |v| < 2**22


def _chain(clip: Any, producer: dict[str, Any], consts: dict[str, np.ndarray],
           uses: dict[str, int]) -> tuple[list[Any], Any, np.ndarray, np.ndarray | None, np.ndarray, float] | None:
    """``(nodes to remove, conv, S, b, inv, z)`` of ``Conv -> Mul(S, .) -> [Add(b)] -> Mul(inv) -> [Add(z)] -> Round
    -> Clip``, each intermediate read once, or ``None``."""
    def const(name: str) -> np.ndarray | None:
        v = consts.get(name)
        return v if v is not None and v.dtype == np.float32 else None

    def step(name: str, op: str) -> Any:
        n = producer.get(name)
        return n if n is not None and n.op_type == op and uses.get(name, 0) == 1 else None

    if len(clip.input) != 3 or any(const(n) is None or const(n).size != 1 or not abs(float(const(n))) < 2**22
                                   for n in clip.input[1:]):  # (the rounding's range argument, module doc)
        return None
    rnd = step(clip.input[0], "Round")
    if rnd is None:
        return None
    removed, cur, z = [rnd, clip], producer.get(rnd.input[0]), 0.0
    if cur is not None and cur.op_type == "Add":  # + z (a scalar)
        zc = const(cur.input[1])
        if zc is None or zc.size != 1 or uses.get(cur.output[0], 0) != 1:
            return None
        removed.append(cur)
        z, cur = float(zc), producer.get(cur.input[0])
    if cur is None or cur.op_type != "Mul" or uses.get(cur.output[0], 0) != 1:
        return None
    inv = const(cur.input[1])
    if inv is None or inv.size != 1:
        return None
    removed.append(cur)
    cur, bias = producer.get(cur.input[0]), None
    if cur is not None and cur.op_type == "Add":  # + b (per channel)
        bias = const(cur.input[1])
        if bias is None or uses.get(cur.output[0], 0) != 1:
            return None
        removed.append(cur)
        cur = producer.get(cur.input[0])
    if cur is None or cur.op_type != "Mul" or uses.get(cur.output[0], 0) != 1:
        return None
    scale, conv = const(cur.input[0]), producer.get(cur.input[1])
    weight = None if conv is None or conv.op_type != "Conv" or len(conv.input) < 2 else const(conv.input[1])
    if scale is None or weight is None or weight.ndim != 4:  # a 2-D Conv with constant weights (C, C_in / g, kh, kw)
        return None
    channels = weight.shape[0]

    def per_channel(v: np.ndarray) -> bool:  # a scalar, or (C, 1, 1): one value per channel of (N, C, H, W)
        return v.size == 1 and v.ndim <= 3 or v.shape == (channels, 1, 1)
    if not per_channel(scale) or (bias is not None and not per_channel(bias)):
        return None
    removed.append(cur)
    return removed, conv, np.broadcast_to(scale.reshape(-1), (channels,)), bias, inv, z


def depthwise_epilogues(graph: Any) -> int:
    """Rewrite every exact Conv epilogue of ``graph`` (an ONNX ``GraphProto``) as depthwise 1x1 Convs (module doc);
    return how many were rewritten. Values are unchanged (module doc)."""
    from onnx import helper, numpy_helper  # optional dependency: imported when an export runs

    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    for o in graph.output:
        uses[o.name] = uses.get(o.name, 0) + 1
    taken = {t for n in graph.node for t in list(n.input) + list(n.output)} | set(consts)

    def fresh(base: str) -> str:
        k = 0
        while f"{base}_{k}" in taken:
            k += 1
        taken.add(f"{base}_{k}")
        return f"{base}_{k}"

    shared: dict[tuple[tuple[int, ...], bytes], str] = {}  # one initializer per distinct constant (the 1s, ±M, ...)

    def initializer(a: np.ndarray, base: str) -> str:
        key = (a.shape, a.tobytes())
        if key not in shared:
            shared[key] = fresh(base)
            graph.initializer.append(numpy_helper.from_array(a, shared[key]))
        return shared[key]

    replace: dict[int, list[Any]] = {}  # id(Clip) -> its replacement nodes
    drop: set[int] = set()
    for clip in [n for n in graph.node if n.op_type == "Clip"]:
        found = _chain(clip, producer, consts, uses)
        if found is None:
            continue
        removed, conv, scale, bias, inv, z = found
        new: list[Any] = []
        base, channels = clip.output[0], scale.size

        def dw(x: str, w: Any, b: Any, new: list[Any] = new, base: str = base, channels: int = channels) -> str:
            """A depthwise 1x1 Conv ``fl(fl(w x) + b)`` of ``x`` (``w``, ``b``: scalars or per channel)."""
            w4 = np.broadcast_to(np.asarray(w, np.float32), (channels,)).reshape(channels, 1, 1, 1).copy()
            wn, out = initializer(w4, base + "_dw_w"), fresh(base + "_dw")
            bn = initializer(np.broadcast_to(np.asarray(b, np.float32), (channels,)).copy(), base + "_dw_b")
            new.append(helper.make_node("Conv", [x, wn, bn], [out], group=channels, kernel_shape=[1, 1]))
            return out

        y = dw(conv.output[0], scale, 0.0 if bias is None else bias.reshape(-1))  # (a bias of size 1 broadcasts)
        y = dw(y, inv, MAGIC) if z == 0.0 else dw(dw(y, inv, z), 1.0, MAGIC)
        y = dw(y, 1.0, -MAGIC)
        new.append(helper.make_node("Clip", [y, clip.input[1], clip.input[2]], [clip.output[0]]))
        replace[id(clip)] = new
        drop.update(id(n) for n in removed)
    nodes = []
    for n in graph.node:
        if id(n) in replace:
            nodes.extend(replace[id(n)])
        elif id(n) not in drop:
            nodes.append(n)
    read = {i for n in nodes for i in n.input}
    unused = [t for t in graph.initializer if t.name not in read]
    del graph.node[:]
    graph.node.extend(nodes)
    for t in unused:
        graph.initializer.remove(t)
    return len(replace)
