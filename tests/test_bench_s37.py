"""Session 37: the benchmark scripts users run (benchmarks/*.py): arguments checked by argparse before any work, the
ISA line printed first, ``--quick`` honoured and ``--out`` written where asked. Smoke runs only: nothing is timed
(``--rounds 1``, a tiny ``--min-time``, no idleness wait) and every result goes to a scratch path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SRC = Path(__file__).resolve().parents[1] / "src"
FAST = ["--threads", "1", "--rounds", "1", "--min-time", "0.001", "--max-wait", "0"]


def _load(name: str):
    """A benchmark script as a module (its ``main`` not run); the scripts import ``common`` from their folder."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name == "common":
        return importlib.import_module("common")
    spec = importlib.util.spec_from_file_location(f"bench_s37_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# The file's smoke runs of whole scripts, each a fresh interpreter at 1 thread: (script, arguments, ``--out`` name)
ISA_RUNS = [
    ("conv.py", ["--quick", *FAST]),  # was: no ISA line at all
    ("overhead.py", ["--shapes", "1x32x32", "--rounds", "1", "--min-time", "0.001", "--max-wait", "0"]),
    ("histogram_observer.py", ["--threads", "1", "--rounds", "1", "--numel", "2000"]),  # was: no ISA, no --threads
]
LINEAR_QUICK = ("linear.py", ["--vs-ao", "--dynamic-only", "--quick", *FAST])
_OUT = {"histogram_observer.py": "res.json"}  # (the others take a stem and write <stem>.json)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """``{script: (its finished run, its scratch folder)}`` for ``ISA_RUNS`` and ``LINEAR_QUICK``: the same commands
    each test ran one after the other, started together (the pytest process only waits on them, so they overlap on
    the cores it leaves idle; each is still a fresh interpreter with its own ``--out`` folder)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    started = {}
    try:
        for script, args in [*ISA_RUNS, LINEAR_QUICK]:
            folder = tmp_path_factory.mktemp(script.replace(".", "_"))
            cmd = [sys.executable, str(BENCH / script), *args, "--out", str(folder / _OUT.get(script, "res"))]
            started[script] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                env=env), folder)
        done = {}
        for script, (proc, folder) in started.items():
            out, err = proc.communicate(timeout=300)
            done[script] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder)
        return done
    finally:
        for proc, _ in started.values():
            proc.kill()


@pytest.mark.parametrize("argv, bad", [(["--threads", "0"], "'0'"), (["--threads", "1", "-2"], "'-2'"),
                                       (["--rounds", "0"], "'0'"), (["--min-time", "0"], "'0'"),
                                       (["--min-time", "nan"], "'nan'"), (["--max-wait", "-1"], "'-1'"),
                                       (["--max-load", "inf"], "'inf'")])
def test_common_args_refuse_bad_values(argv, bad, capsys):
    # was: parsed, then torch.set_num_threads(0)'s RuntimeError or bench()'s ValueError, a traceback after setup work
    import argparse

    common = _load("common")
    p = argparse.ArgumentParser()
    common.add_common_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--" + argv[0].lstrip("-") in err and bad in err


def test_mkn_shapes():
    import argparse

    common = _load("common")
    assert common.mkn("16x768X3072") == (16, 768, 3072)
    for bad in ("1x64", "0x4x4", "1x-4x4", "axbxc", "1x2x3x4"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            common.mkn(bad)


def test_overhead_shape_refused_by_argparse(monkeypatch, capsys, keep_threads):
    # was: ValueError "not enough values to unpack" after the ISA line
    overhead = _load("overhead")
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--shapes", "1x64", "--out", "unused"])
    with pytest.raises(SystemExit) as e:
        overhead.main()
    assert e.value.code == 2 and "'1x64'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [(["--kinds", "fp16"], "fp16"),  # was: built and labelled int4 as "fp16"
                                       (["--new", "1"], "--new 1"),  # was: ZeroDivisionError after the runs
                                       (["--threads", "0"], "'0'"),  # was: torch's RuntimeError
                                       (["--batches", "0"], "'0'")])
def test_generate_args_checked_before_the_model_loads(argv, msg, monkeypatch, capsys, keep_threads):
    generate = _load("generate")

    def no_model():
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(generate.D, "load_smollm2", no_model)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--no-compile", "--out", "unused", *argv])
    with pytest.raises(SystemExit) as e:
        generate.main()
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_accuracy_unknown_model_refused(monkeypatch, capsys, tmp_path):
    # was: ran no model and wrote an empty results file
    accuracy = _load("accuracy")
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--models", "fmnist,mnv3", "--out", str(tmp_path / "acc")])
    with pytest.raises(SystemExit) as e:
        accuracy.main()
    assert e.value.code == 2 and "--models fmnist,mnv3" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_weight_only_out_is_honoured(monkeypatch, capsys, tmp_path, keep_threads):
    # was: no --out: every run (a smoke one too) rewrote benchmarks/results/weight_only.json
    weight_only = _load("weight_only")
    monkeypatch.setattr(sys, "argv", ["weight_only.py", "--skip-llm", "--skip-speed", "--out", str(tmp_path / "wo")])
    weight_only.main()
    assert capsys.readouterr().out.splitlines()[0].startswith("ISA: ")
    assert json.loads((tmp_path / "wo.json").read_text())["machine"]["torch"] == torch.__version__


def test_linear_dynamic_only_needs_vs_ao(monkeypatch, capsys):
    # was: --dynamic-only without --vs-ao silently ran the other table
    linear = _load("linear")
    monkeypatch.setattr(sys, "argv", ["linear.py", "--dynamic-only", "--quick", *FAST, "--out", "unused"])
    with pytest.raises(SystemExit) as e:
        linear.main()
    assert e.value.code == 2 and "--dynamic-only needs --vs-ao" in capsys.readouterr().err


@pytest.mark.parametrize("script, args", ISA_RUNS)
def test_isa_line_first_and_out_written(script, args, script_runs):
    r, folder = script_runs[script]  # (script with args, --out folder / "res.json" or "res")
    assert r.args[2:] == [*args, "--out", str(folder / _OUT.get(script, "res"))], r.args
    assert r.returncode == 0, r.stderr[-2000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("ISA: ") and "torch cpu capability" in first, first
    d = json.loads((folder / "res.json").read_text())
    assert d["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_linear_dynamic_only_quick(script_runs):
    # was: --quick ignored with --vs-ao --dynamic-only (all 12 shapes, up to 512x4096x4096, minutes)
    r, folder = script_runs["linear.py"]  # (linear.py --vs-ao --dynamic-only --quick ... --out folder / "res")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0].startswith("ISA: ")
    runs = json.loads((folder / "res.json").read_text())["runs"]
    assert [(x["M"], x["K"], x["N"]) for x in runs] == [(16, 768, 768), (1, 768, 3072)]


def test_smallconv_reports_how_far_onednn_codes_are():
    # was: only a count, labelled "off by 1"; without VNNI (ONEDNN_MAX_CPU_ISA=AVX2) oneDNN's saturating pairs put
    # its codes up to 5 away
    smallconv = _load("smallconv")
    if not smallconv.native.available():
        pytest.skip(f"lowbit.native: {smallconv.native.reason()}")
    ms, info = smallconv.methods((2, 3, 16, 16, 8, 3, 1, 1))
    native, ref = ms[next(iter(ms))](), ms["oneDNN"]()
    assert info["onednn_max_code_diff"] == int((native.int() - ref.int()).abs().max())
    assert info["onednn_tie_codes"] == int((native != ref).sum())
