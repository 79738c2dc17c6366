"""`lowbit quantize --out`: replaced as a whole or left untouched (reruns, failures, Ctrl-C); strict report.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lowbit import cli
from lowbit.cli import command, output

MODULE = """
import os, pathlib, time, torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    def forward(self, x):
        if len(x) == 48 and os.environ.get("LOWBIT_TEST_STALL"):   # the latency batch: well into the run
            pathlib.Path(os.environ["LOWBIT_TEST_STALL"]).write_text("stalled")
            for _ in range(600):   # short sleeps: a signal the kernel hands to another thread (OpenMP's)
                time.sleep(0.1)    # does not interrupt one long sleep of the main thread
        return self.body(x)
def make():
    return Net()
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "usermodel_out.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    torch.save(torch.randn(48, 8), "calib.pt")
    torch.save(torch.randint(0, 3, (48,)), "y.pt")
    return tmp_path


BASE = ["--model", "usermodel_out:make", "--calib", "calib.pt", "--quiet"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def strict_load(path: Path):
    def reject(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(path.read_text(), parse_constant=reject)


def first_run(capsys) -> dict[str, bytes]:
    assert cli.main(["quantize", *BASE, "--method", "ptq", "--method", "dynamic", "--eval", "calib.pt",
                     "--labels", "y.pt", "--out", "o"]) == 0
    capsys.readouterr()
    return snapshot(Path("o"))


def test_rerun_with_other_methods_replaces_the_folder_as_a_whole(workdir, capsys):
    before = first_run(capsys)
    assert {"model_ptq.pt", "model_dynamic.pt", "report.json", "report.md", ".lowbit-out"} <= set(before)
    assert cli.main(["quantize", *BASE, "--method", "dynamic", "--out", "o"]) == 0
    after = snapshot(workdir / "o")
    assert "model_ptq.pt" not in after and not any(n.endswith(".png") for n in after)   # nothing of run 1 is left
    assert [r["method"] for r in strict_load(workdir / "o" / "report.json")["rows"]] == ["fp32", "dynamic"]
    assert not list(workdir.glob(".lowbit-*"))


def test_report_json_is_strict_json_without_eval_data(workdir, capsys):
    assert cli.main(["quantize", *BASE, "--method", "ptq", "--out", "o"]) == 0     # no --eval: accuracy unknown
    report = strict_load(workdir / "o" / "report.json")
    assert all(r["accuracy"] is None and r["delta"] is None for r in report["rows"])
    assert all(isinstance(r["size_kib"], float) for r in report["rows"])


def test_a_failure_midway_leaves_the_old_folder_intact(workdir, capsys, monkeypatch):
    before = first_run(capsys)

    def half_written(d, *a, **k):
        (Path(d) / "report.md").write_text("half")
        raise OSError(28, "No space left on device")

    import lowbit.report
    monkeypatch.setattr(lowbit.report, "write_report", half_written)
    rc = cli.main(["quantize", *BASE, "--method", "dynamic", "--out", "o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "No space left on device" in err[0]
    assert snapshot(workdir / "o") == before and not list(workdir.glob(".lowbit-*"))


def test_swap_without_rename_exchange(workdir, capsys, monkeypatch):
    first_run(capsys)
    monkeypatch.setattr(output, "_exchange", lambda a, b: False)     # e.g. not Linux: move aside, rename, delete
    assert cli.main(["quantize", *BASE, "--method", "dynamic", "--out", "o"]) == 0
    assert "model_ptq.pt" not in snapshot(workdir / "o") and not list(workdir.glob(".lowbit-*"))


def test_the_commit_rechecks_the_target(workdir, capsys, monkeypatch):
    folder = output.OutputFolder(workdir / "o")
    (workdir / "o").write_text("appeared meanwhile")
    with pytest.raises(cli.CLIError, match="names an existing file"), folder:
        folder.commit()
    assert (workdir / "o").read_text() == "appeared meanwhile" and not list(workdir.glob(".lowbit-*"))


def _terminal_signals() -> None:
    """The child starts with SIGINT/SIGTERM at their defaults, as from a terminal: a test run started in the
    background (``cmd &`` in a script, as CI may be) ignores SIGINT, and a child inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_midway_leaves_the_old_folder_intact(workdir, capsys, sig):
    before = first_run(capsys)
    env = {**os.environ, "LOWBIT_TEST_STALL": str(workdir / "stalled"), "PYTHONPATH": str(Path(cli.__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "lowbit", "quantize", *BASE, "--method", "dynamic", "--out", "o"],
                            cwd=workdir, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_signals)
    try:
        for _ in range(1200):                       # wait (up to 120 s) until the run stalls in its latency batch
            if (workdir / "stalled").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert (workdir / "stalled").exists(), proc.stderr.read() if proc.poll() is not None else "no stall"
        assert list(workdir.glob(".lowbit-*"))      # the staging folder exists: the run is midway
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines() == ["lowbit: interrupted; --out o left as it was"]
    assert snapshot(workdir / "o") == before and not list(workdir.glob(".lowbit-*"))


def test_default_methods_skip_qat_without_labels():
    args = command.build_parser().parse_args(["quantize", "--model", "m:f"])
    assert command._default_methods(args) == ["ptq", "dynamic"]
    args = command.build_parser().parse_args(["quantize", "--model", "m:f", "--calib-labels", "y.pt"])
    assert command._default_methods(args) == ["ptq", "qat", "dynamic"]


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(workdir, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                              # a pid that no longer runs
    stale = workdir / f"{output._staging_prefix().replace(str(os.getpid()), str(dead.pid))}abc123"
    stale.mkdir()
    (stale / "model_ptq.pt").write_text("half")
    alive = workdir / f"{output._staging_prefix()}live42"     # this process: alive, kept
    alive.mkdir()
    assert cli.main(["quantize", *BASE, "--method", "dynamic", "--out", "o"]) == 0
    assert not stale.exists() and alive.exists()
