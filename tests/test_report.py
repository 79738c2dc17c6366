"""lowbit.report: Markdown/HTML report with PNG plots whose numbers match the tables and compare()."""

from __future__ import annotations

import math
import re
import struct
import sys
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug import CompareResult, LayerComparison, activation_ranges, compare
from lowbit.report import rows_to_markdown, write_report

torch.set_num_threads(1)
GROUPS = [["conv", "bn", "relu"]]
ROWS = [
    {"method": "fp32", "accuracy": 91.234, "delta": 0.0, "size_kib": 120.44, "size_ratio": 1.0,
     "latency_ms": 2.517, "speedup": 1.0},
    {"method": "ptq", "accuracy": 90.871, "delta": -0.363, "size_kib": 33.21, "size_ratio": 3.6265,
     "latency_ms": 1.234, "speedup": 2.0397},
]


@pytest.fixture(scope="module")
def debug_data():
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(quant=Q.QuantStub(), conv=nn.Conv2d(3, 8, 3, padding=1), bn=nn.BatchNorm2d(8),
                                  relu=nn.ReLU(), flat=nn.Flatten(), fc=nn.Linear(8 * 36, 5),
                                  dequant=Q.DeQuantStub())).eval()
    x = torch.randn(64, 3, 6, 6)
    prepared = Q.prepare(Q.fuse_modules(m, GROUPS), Q.get_default_qconfig())
    prepared(x)
    return compare(m, Q.convert(prepared), x), prepared


def assert_png(path: Path) -> None:
    """A valid PNG: signature, IHDR with a non-empty size, every chunk's CRC right, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body, (crc,) = data[pos + 8:pos + 8 + length], struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width > 100 and height > 100


def md_tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in ``text`` as rows of cells (header and separator dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current[2:])
            current = []
    return tables


def html_tables(text: str) -> list[list[list[str]]]:
    return [[re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", body)]
            for body in re.findall(r"<tbody>(.*?)</tbody>", text, flags=re.DOTALL)]


def check_numbers(tables: list[list[list[str]]], result: CompareResult, prepared: nn.Module) -> None:
    rows_table, sqnr_table, range_table = tables
    for cells, r in zip(rows_table, ROWS, strict=True):
        assert cells[0] == r["method"]
        got = [float(c.rstrip("x")) for c in cells[1:]]
        want = [r[k] for k in ("accuracy", "delta", "size_kib", "size_ratio", "latency_ms", "speedup")]
        assert got == pytest.approx(want, abs=0.051)  # printed with 1-2 decimals
    for cells, r in zip(sqnr_table, result.rows, strict=True):
        assert cells[0] == r.name and float(cells[3]) == pytest.approx(r.act_sqnr_db, abs=0.005)
        assert (cells[5] == "-") if r.weight_sqnr_db is None else float(cells[5]) == pytest.approx(r.weight_sqnr_db,
                                                                                                    abs=0.005)
    for cells, a in zip(range_table, activation_ranges(prepared), strict=True):
        assert cells[0] == a.name and [float(c) for c in cells[4:6]] == pytest.approx(list(a.clip), rel=1e-3, abs=1e-9)


@pytest.mark.parametrize("fmt", ["md", "html"])
def test_report_files_and_numbers_match(tmp_path, debug_data, fmt):
    pytest.importorskip("matplotlib")
    result, prepared = debug_data
    out = write_report(tmp_path / "out", ROWS, compare_result=result, histograms=prepared, fmt=fmt, notes="a & b")
    assert out.report == tmp_path / "out" / f"report.{fmt}" and out.report.is_file()
    assert set(out.figures) == {"sqnr", "activations"}
    for png in out.figures.values():
        assert_png(png)
    text = out.report.read_text()
    check_numbers(md_tables(text) if fmt == "md" else html_tables(text), result, prepared)
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)" if fmt == "md" else r'<img src="([^"]+)"', text)
    assert sorted(links) == sorted(p.name for p in out.figures.values())
    assert ("a &amp; b" if fmt == "html" else "a & b") in text
    # the figures show compare()'s numbers: bar heights and clip lines read back from the drawn artists
    want = [(r.name, "activation", r.act_sqnr_db) for r in result.rows]
    want += [(r.name, "weight", r.weight_sqnr_db) for r in result.rows if r.weight_sqnr_db is not None]
    got = out.plotted["sqnr"]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], rel=1e-6)
    for (name, lo, hi), a in zip(out.plotted["activations"], activation_ranges(prepared), strict=True):
        assert name == a.name and (lo, hi) == pytest.approx(a.clip, rel=1e-6, abs=1e-12)


def test_infinite_sqnr_is_drawn_and_reported(tmp_path):
    pytest.importorskip("matplotlib")
    result = CompareResult([LayerComparison("a", "Linear", "a", math.inf, 0.0, 40.0, 1e-3),
                            LayerComparison("b", "Linear", "b", -3.5, 0.5, None, None),
                            LayerComparison("c", "Linear", "c", -math.inf, 0.5, None, None)])
    out = write_report(tmp_path, [], compare_result=result)
    assert out.plotted["sqnr"] == [("a", "activation", math.inf), ("b", "activation", -3.5),
                                   ("c", "activation", -math.inf), ("a", "weight", 40.0)]
    (table,) = md_tables(out.report.read_text())
    assert [row[3] for row in table] == ["inf", "-3.50", "-inf"] and table[1][5] == "-"


def test_rows_table_is_the_cli_table():
    from lowbit.cli import _table

    assert rows_to_markdown(ROWS) == _table(ROWS)


def test_without_matplotlib(tmp_path, debug_data, monkeypatch):
    result, prepared = debug_data
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=re.escape("pip install lowbit[report]")):
        write_report(tmp_path, ROWS, compare_result=result, plots=True)
    out = write_report(tmp_path, ROWS, compare_result=result, histograms=prepared)
    assert out.figures == {} and sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
    text = out.report.read_text()
    assert "pip install lowbit[report]" in text
    check_numbers(md_tables(text), result, prepared)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="fmt='pdf'"):
        write_report(tmp_path, ROWS, fmt="pdf")
    with pytest.raises(ValueError, match=r"table_rows\[0\].*'speedup'"):
        write_report(tmp_path, [{k: v for k, v in ROWS[0].items() if k != "speedup"}])
    with pytest.raises(TypeError, match="table_rows"):
        write_report(tmp_path, "fp32 91%")
    with pytest.raises(TypeError, match="compare_result"):
        write_report(tmp_path, ROWS, compare_result={"rows": []})
    with pytest.raises(TypeError, match="histograms"):
        write_report(tmp_path, ROWS, histograms="prepared")
    with pytest.raises(ValueError, match="name="):
        write_report(tmp_path, ROWS, name="../x")
    with pytest.raises(TypeError, match="plots="):
        write_report(tmp_path, ROWS, plots="yes")
    assert list(tmp_path.iterdir()) == []  # nothing written on bad input
