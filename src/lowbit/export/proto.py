"""Post-processing of an exported ONNX graph (``to_onnx`` calls it; needs the ``onnx`` package).

>>> import onnx
>>> from onnx import helper, TensorProto
>>> from lowbit.export.proto import constants_to_initializers
>>> c = [helper.make_node("Constant", [], [n], value=helper.make_tensor(n, TensorProto.FLOAT, [2], [1.0, 2.0]))
...      for n in ("a", "b")]
>>> add = helper.make_node("Add", ["a", "b"], ["y"])
>>> g = helper.make_graph(c + [add], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
>>> m = helper.make_model(g)
>>> constants_to_initializers(m)
>>> [t.name for t in m.graph.initializer], list(m.graph.node[0].input)
(['a'], ['a', 'a'])
"""

from __future__ import annotations

from typing import Any

__all__ = ["constants_to_initializers"]


def constants_to_initializers(proto: Any) -> None:
    """Move every ``Constant`` node's tensor into the graph's initializers (where QDQ tools expect weights).

    Equal constants become one initializer (a module called several times, such as an unrolled
    RNN's hidden-to-hidden Linear, emits its weights once per call).
    """
    from onnx import numpy_helper  # optional dependency: imported when an export runs

    keep: list[Any] = []
    seen: dict[tuple[Any, ...], str] = {}
    rename: dict[str, str] = {}
    outputs = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            value = node.attribute[0].t
            key = (value.data_type, tuple(value.dims), numpy_helper.to_array(value).tobytes())
            if key in seen and node.output[0] not in outputs:
                rename[node.output[0]] = seen[key]
                continue
            seen.setdefault(key, node.output[0])
            t = proto.graph.initializer.add()
            t.CopyFrom(value)
            t.name = node.output[0]
        else:
            for i, name in enumerate(node.input):
                if name in rename:
                    node.input[i] = rename[name]
            keep.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
