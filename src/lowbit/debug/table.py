"""The result of the sensitivity tools (``sensitivity``, ``layer_sensitivity``, ``auto_mixed_precision``): one
``SensitivityRow`` per layer, ``drop = baseline - metric`` (``metric_drop``: 0 where the two are equal, so an SQNR
metric's ``inf - inf`` is no NaN), and the ``SensitivityTable`` that prints, renders as markdown and serialises them.

>>> t = SensitivityTable(1.0, [SensitivityRow("fc", "Linear", 0.75, metric_drop(1.0, 0.75))])
>>> t.rows[0].drop, metric_drop(float("inf"), float("inf"))
(0.25, 0.0)
"""

from __future__ import annotations

import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SensitivityRow", "SensitivityTable", "by_drop", "call_order_name", "keep_float", "md_cell", "metric_drop",
           "text_width"]

_MD_ESCAPE = str.maketrans({"\\": "\\\\", "|": "\\|", "`": "\\`", "<": "\\<", "\r": " ", "\n": " "})


def md_cell(text: str) -> str:
    """One Markdown table cell as literal text: a line break would end the row and a ``|`` split it (a layer named
    ``"a|b"`` shifted every later cell of its row); a backslash, a backtick (code span) and ``<`` (raw HTML) are
    backslash-escaped, so the cell renders as written. Shared by the debug tables and ``lowbit.report``."""
    return text.translate(_MD_ESCAPE)


def text_width(text: str) -> int:
    """Terminal columns of ``text``: East Asian wide / full-width characters take two, combining marks none (a
    layer named in Hangul or with an emoji pushed the columns of its row out of line)."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text: str, width: int, right: bool = False) -> str:
    """``text`` padded with spaces to ``width`` columns (``text_width``), on the left when ``right``."""
    fill = " " * max(0, width - text_width(text))
    return fill + text if right else text + fill


def _function_name(obj: Any) -> str:
    """``operator.add``, ``torch.cat``, ... (the module the function is reached from, then its name)."""
    import operator

    import torch

    name = getattr(obj, "__name__", repr(obj))
    for mod in (operator, torch):
        if getattr(mod, name, None) is obj:
            return f"{mod.__name__}.{name}"
    return f"{getattr(obj, '__module__', None) or '?'}.{name}"


def call_order_name(key: tuple[str, Any, int]) -> str:
    """The row name of a graph-mode op (an add, a ``mul``, a ``cat``) that a mapping reaches only through its call-order
    key ``(module_name, function, index)`` (``set_module_name_object_type_order``): ``"module_name:function#index"``,
    ``"function#index"`` at the root. ``SensitivityTable.op_keys`` maps the name back to the key.

    >>> import operator, torch
    >>> call_order_name(("features.3", operator.add, 0)), call_order_name(("", torch.cat, 1))
    ('features.3:operator.add#0', 'torch.cat#1')
    """
    module_name, obj, index = key
    fn = f"{_function_name(obj)}#{index}"
    return f"{module_name}:{fn}" if module_name else fn


def keep_float(mapping: Any, name: str, op_keys: dict[str, tuple[str, Any, int]]) -> Any:
    """``mapping`` with the layer or op ``name`` kept float: ``set_module_name(name, None)``, or for a graph-mode op
    ``set_module_name_object_type_order(*op_keys[name], None)``; returns ``mapping``.

    >>> import operator, lowbit as Q
    >>> m = keep_float(Q.QConfigMapping(), "add#0", {"add#0": ("", operator.add, 0)})
    >>> m.module_name_object_type_order_qconfigs
    {('', <built-in function add>, 0): None}
    """
    if not callable(getattr(mapping, "set_module_name", None)):
        raise TypeError(f"keep_float: mapping={type(mapping).__name__} must be a QConfigMapping")
    if not isinstance(name, str):
        raise TypeError(f"keep_float: name={name!r} must be a str (a module path or a 'module:function#index' row name)")
    if not isinstance(op_keys, dict):
        raise TypeError(f"keep_float: op_keys={type(op_keys).__name__} must be a dict (SensitivityTable.op_keys)")
    key = op_keys.get(name)
    if key is not None and not (isinstance(key, tuple) and len(key) == 3):
        raise ValueError(f"keep_float: op_keys[{name!r}]={key!r} must be a (module_name, function, index) key")
    if name in op_keys:
        return mapping.set_module_name_object_type_order(*op_keys[name], None)
    if "#" in name:  # an op's row name: set_module_name would match no module and keep the op int8, silently
        raise ValueError(f"keep_float: {name!r} names a graph-mode op ('module:function#index') that op_keys does not "
                         f"hold ({sorted(op_keys)[:4]}); pass the table's op_keys (SensitivityTable.op_keys)")
    return mapping.set_module_name(name, None)


@dataclass(frozen=True)
class SensitivityRow:
    """One layer quantized alone: ``metric = eval_fn(model with only this layer int8)``, ``drop = baseline - metric``."""

    name: str
    module_type: str
    metric: float
    drop: float


@dataclass
class SensitivityTable:
    """``rows`` worst first; with a tolerance, ``float_layers`` kept float and the final metric."""

    baseline: float
    rows: list[SensitivityRow] = field(default_factory=list)
    tolerance: float | None = None
    float_layers: list[str] = field(default_factory=list)
    final_metric: float | None = None      # everything quantized except float_layers (tolerance only)
    all_quantized_metric: float | None = None  # everything quantized (auto_mixed_precision)
    view: str = "alone"  # rows: "alone" = only this layer int8; "float" = only this layer float (search="fast")
    # graph mode's ops (adds, mul, cat): row name (call_order_name) -> (module_name, function, index), the key that
    # keeps the op float: mapping.set_module_name_object_type_order(*op_keys[name], None)
    op_keys: dict[str, tuple[str, Any, int]] = field(default_factory=dict)

    @property
    def final_drop(self) -> float | None:
        return None if self.final_metric is None else metric_drop(self.baseline, self.final_metric)

    @property
    def met_tolerance(self) -> bool | None:
        d = self.final_drop
        return None if d is None or self.tolerance is None else d <= self.tolerance

    def _cells(self) -> list[tuple[str, ...]]:
        return [(r.name, r.module_type, f"{r.metric + 0.0:.4g}", f"{r.drop + 0.0:+.4g}",
                 "yes" if r.name in self.float_layers else "") for r in self.rows]

    def _footer(self) -> str:
        text = f"baseline (float) = {self.baseline + 0.0:.4g}"  # + 0.0: no "-0"
        if self.all_quantized_metric is not None:
            text += f"; all quantized = {self.all_quantized_metric + 0.0:.4g}"
        if self.final_metric is not None:
            assert self.final_drop is not None
            budget = ("no tolerance" if self.tolerance is None else
                      f"tolerance {self.tolerance:g}, {'met' if self.met_tolerance else 'NOT met'}")
            text += (f"; all quantized but {len(self.float_layers)} float layer(s): {self.final_metric + 0.0:.4g} "
                     f"(drop {self.final_drop:+.4g}, {budget})")
        return text

    def _metric_head(self) -> str:
        return "metric (only this layer float)" if self.view == "float" else "metric (only this layer int8)"

    def __str__(self) -> str:
        head = ("layer", "type", self._metric_head(), "drop", "kept float")
        table = [head, *[tuple(c.translate(_ONE_LINE) for c in row) for row in self._cells()]]
        widths = [max(text_width(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(pad(c, w, right=i >= 2) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                 for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([*lines, self._footer()])

    def to_markdown(self) -> str:
        lines = [f"| layer | type | {self._metric_head()} | drop | kept float |", "|---|---|---:|---:|---|"]
        lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in self._cells()]
        return "\n".join([*lines, "", self._footer()])

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "rows": [asdict(r) for r in self.rows], "tolerance": self.tolerance,
                "float_layers": list(self.float_layers), "final_metric": self.final_metric,
                "final_drop": self.final_drop,
                "op_keys": {n: [m, _function_name(f), i] for n, (m, f, i) in self.op_keys.items()}}


_ONE_LINE = str.maketrans({"\t": " ", "\r": " ", "\n": " "})  # a text-table row is one line


def metric_drop(baseline: float, metric: float) -> float:
    """``baseline - metric``, and 0 where the two are equal: an SQNR-vs-float metric scores the float model ``inf``,
    and a model that matches it exactly (every layer float) has lost nothing (``inf - inf`` would be NaN)."""
    return 0.0 if metric == baseline else baseline - metric


def by_drop(row: SensitivityRow) -> tuple[float, float]:
    """Sort key, worst layer first: the larger drop, and among equal drops (every drop is ``inf`` under an
    infinite baseline) the lower metric."""
    return -row.drop, row.metric
