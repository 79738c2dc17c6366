"""The `lowbit quantize` command: built-in example end to end, user models, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit import cli
from lowbit.data import fashion_mnist_available

TINY_NO_QAT = ["--train-size", "256", "--test-size", "256", "--calib-size", "64", "--epochs", "0.25", "--quiet"]
TINY = [*TINY_NO_QAT, "--qat-epochs", "0.25"]  # (--qat-epochs is refused where QAT is not among the methods to run)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(["quantize", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_builtin_example_writes_checkpoints_and_a_report_matching_the_table(tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, _ = run_cli([*TINY, "--out", str(out)], capsys)
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"model_ptq.pt", "model_qat.pt", "model_dynamic.pt", "report.json", "report.md"} <= names
    report = json.loads((out / "report.json").read_text())
    assert [r["method"] for r in report["rows"]] == ["fp32", "ptq", "qat", "dynamic"]
    md = (out / "report.md").read_text()
    for r in report["rows"]:          # every printed row is in the report, cell for cell
        line = next(ln for ln in stdout.splitlines() if ln.startswith(f"| {r['method']} |"))
        assert line in md
        assert f"{r['accuracy']:.2f}" in line
    assert all(r["size_ratio"] > 2.5 for r in report["rows"][1:])   # int8 checkpoints are smaller
    for k in ("ptq", "qat", "dynamic"):     # checkpoints hold plain tensors only
        sd = torch.load(out / f"model_{k}.pt", weights_only=True)
        assert sd and all(isinstance(v, torch.Tensor) for v in sd.values())
    assert report["layers"] and all("name" in row or "layer" in row for row in report["layers"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".lowbit-")]   # no temp dirs left


def _write_model_module(tmp_path: Path) -> str:
    (tmp_path / "usermodel.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        "def not_a_module():\n    return 3\n")
    return str(tmp_path)


def test_user_model_ptq_and_dynamic(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(_write_model_module(tmp_path))
    torch.save(torch.randn(64, 8), tmp_path / "calib.pt")
    torch.save({"x": torch.randn(32, 8)}, tmp_path / "eval.pt")
    torch.save(torch.randint(0, 3, (32,)), tmp_path / "labels.pt")
    rc, stdout, _ = run_cli(["--model", "usermodel:make", "--calib", "calib.pt", "--eval", "eval.pt",
                             "--labels", "labels.pt", "--method", "ptq", "--method", "dynamic", "--quiet",
                             "--out", "o"], capsys)
    assert rc == 0, stdout
    assert {"model_ptq.pt", "model_dynamic.pt", "report.md"} <= {p.name for p in (tmp_path / "o").iterdir()}
    assert "| ptq |" in stdout and "| dynamic |" in stdout


@pytest.mark.parametrize("args, needle", [
    (["--model", "nocolon"], "expected 'package.module:factory'"),
    (["--model", "no_such_pkg_xyz:make", "--calib", "calib.pt"], "cannot import 'no_such_pkg_xyz'"),
    (["--model", "usermodel:not_a_module", "--calib", "calib.pt"], "not an nn.Module"),
    (["--model", "usermodel:make", "--calib", "missing.pt"], "--calib file not found: missing.pt"),
    (["--model", "usermodel:make", "--calib", "wrong.pt"], "does not fit the model"),
    (["--model", "usermodel:make", "--calib", "calib.pt", "--method", "qat"], "needs --calib-labels"),
    (["--calib", "calib.pt"], "--calib needs --model"),
    (["--model", "usermodel:make", "--calib", "calib.txt"], "unsupported format '.txt'"),
])
def test_errors_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(_write_model_module(tmp_path))
    torch.save(torch.randn(16, 8), tmp_path / "calib.pt")
    torch.save(torch.randn(16, 5), tmp_path / "wrong.pt")
    (tmp_path / "calib.txt").write_text("1 2 3")
    rc, _, err = run_cli([*args, "--quiet", "--out", "o"], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowbit: error:") and needle in lines[0], err
    assert not (tmp_path / "o").exists()


def test_console_entry_point_and_python_m(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lowbit", "quantize", "--model", "x"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "lowbit: error:" in r.stderr


@pytest.mark.skipif(not fashion_mnist_available(), reason="Debian dataset-fashion-mnist not installed")
def test_builtin_uses_fashion_mnist_when_installed(tmp_path, capsys):
    rc, _, _ = run_cli([*TINY_NO_QAT, "--method", "dynamic", "--out", str(tmp_path / "o")], capsys)
    assert rc == 0
    assert json.loads((tmp_path / "o" / "report.json").read_text())["rows"][0]["method"] == "fp32"


def test_unknown_method_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["quantize", "--method", "bogus"])
    assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
