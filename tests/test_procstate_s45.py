"""Session 45 (procstate45): process-wide state.

1. What made a weight-only 4-bit model's outputs differ between the long CI test process and a fresh one
   (test_state_s44's whole-model pickle test): the thread count. ~35 test modules call ``torch.set_num_threads(1)`` at
   import, so a whole run (which imports them all while collecting) ran at 1 thread, and a fresh process at the
   machine's count. ``weight_only4`` there (group size 8: no int4 kernel) computes ``F.linear(x, ŵ) + b`` in float32,
   and torch's float GEMM (MKL) rounds differently at 1 and at 2+ threads for some shapes (5 x 16 @ 16 x 24; so does
   the float model itself): expected of float accumulation, not a lowbit choice. The integer paths (eager static, FX,
   dynamic int8) and the weight-only int4 / int8 kernels give the same bits at any thread count. The suite now runs
   at one thread count however it is started (``tests/conftest.py``: ``SUITE_THREADS``, inherited by fresh processes
   through ``OMP_NUM_THREADS``).
2. ``tests/conftest.py``'s guard: each test (and each module's fixtures) leaves torch's and lowbit's process-wide
   settings as it found them, else they are restored and the test fails naming them. ``lowbit quantize-llm
   --threads N`` in-process left the caller at N threads (``main()`` restored them for ``quantize`` only).
3. ``scaled_operand`` (an add with ``alpha`` / a sub / ``c - x``) kept its scaled grids in a process-wide cache (up to
   64 entries) holding the source grid tensors of deleted models; the memo is now on the ``QFunctional`` that adds
   the operand (``_scaled``, next to ``_memo``), dropped from pickles and deep copies; codes bit-identical, compiled
   and exported programs too.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conftest
import lowbit as Q
from lowbit import cli, kernels, native
from lowbit.cli import common
from lowbit.nn.quantized import add_alpha
from lowbit.nn.quantized.functional_modules import QFunctional

HERE = Path(__file__).parent


# ---------------------------------------------------------------- 1. thread count

def _mlp(k: int = 256, n: int = 256, out: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, out)).eval()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv, self.relu = nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()
        self.fc = nn.Linear(32 * 16 * 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(torch.flatten(self.relu(self.conv(self.quant(x))), 1)))


_XC = torch.randn(8, 16, 16, 16, generator=torch.Generator().manual_seed(1))
_XM = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))


def _static() -> nn.Module:
    torch.manual_seed(0)
    m = _Net().eval()
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(_XC)
    return Q.convert(p)


def _fx() -> nn.Module:
    torch.manual_seed(0)
    p = Q.prepare_fx(_Net().eval(), Q.get_default_qconfig_mapping(), (_XC,))
    p(_XC)
    return Q.convert_fx(p)


INTEGER = {  # (model, input, the kernels.counts op its int8 route tallies, or None: a torch kernel of its own)
    "static": (_static, _XC, "conv"),
    "fx": (_fx, _XC, "conv"),
    "dynamic": (lambda: Q.quantize_dynamic(_mlp()), _XM, None),
    "weight_only int4 kernel": (lambda: Q.quantize_weight_only(_mlp(), bits=4, group_size=32, skip=()), _XM[:32], None),
    "weight_only int8 kernel": (lambda: Q.quantize_weight_only(_mlp(), bits=8, group_size=-1, skip=()), _XM[:32], None),
}


@pytest.mark.parametrize("kind", list(INTEGER))
def test_integer_paths_give_the_same_bits_at_any_thread_count(kind, monkeypatch):
    """1, 2 and 3 torch threads, lowbit.native's passes split over them wherever they can be (``_THREAD_MIN`` 1):
    the same output bits (integer sums; the float epilogue per element)."""
    make, x, op = INTEGER[kind]
    model = make()
    if kind.startswith("weight_only"):
        assert all(m._kernel_applies(x) or m._int8_kernel_applies(x) for m in model.modules()
                   if isinstance(m, Q.nn.quantized.WeightOnlyLinear))
    monkeypatch.setattr(native, "_THREAD_MIN", 1)
    outs, before = [], torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            ran = kernels.counts[("onednn", op)] if op else 0
            with torch.no_grad():
                outs.append(model(x))
            assert not op or kernels.counts[("onednn", op)] > ran  # (the int8 route ran, not the reference)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), [float((o - outs[0]).abs().max()) for o in outs]


@pytest.mark.parametrize("bits, group_size, rows", [(4, 8, 5), (4, 32, 64), (8, 8, 5)])
def test_the_dequantized_weight_only_path_is_torchs_float_linear_at_each_thread_count(bits, group_size, rows):
    """Group sizes without a kernel (8), or more rows than ``DECODE_MAX_ROWS``: ``F.linear(x, ŵ) + b``, bit for bit
    torch's own float32 product at each thread count; any thread dependence of these outputs is torch's GEMM (MKL's
    at 1 against 2+ threads for 5 x 16 @ 16 x 24: 1 ulp, max |Δ| 4.5e-8 on test_state_s44's weight_only4; the float
    model's outputs move as much), none of lowbit's."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    q = Q.quantize_weight_only(lin, bits=bits, group_size=group_size if group_size <= 16 else 16, skip=())
    big = Q.quantize_weight_only(_mlp(), bits=bits, group_size=group_size, skip=())[0]
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for mod, x in ((q, torch.randn(rows, 16)), (big, torch.randn(rows, 256))):
                assert not mod._kernel_applies(x) and not mod._int8_kernel_applies(x)
                with torch.no_grad():
                    assert torch.equal(mod(x), F.linear(x, mod.dequantize_weight()) + mod.bias)
    finally:
        torch.set_num_threads(before)


def test_the_suite_and_the_fresh_processes_it_starts_run_at_one_thread_count():
    """Before: a whole run at 1 thread (modules set it at import) and a fresh process at the machine's count, so a
    weight-only 4-bit model's outputs computed in both differed (4.5e-8; CI's failure of test_state_s44)."""
    sys.path.insert(0, str(HERE))
    try:
        from test_state_s44 import KINDS
    finally:
        sys.path.remove(str(HERE))
    make, x = KINDS["weight_only4"]
    with torch.no_grad():
        ref = make(0)(x)
    code = (f"import sys, io, torch; sys.path.insert(0, {str(HERE)!r}); from test_state_s44 import KINDS\n"
            "make, x = KINDS['weight_only4']\nbuf = io.BytesIO()\nwith torch.no_grad():\n"
            "    torch.save((torch.get_num_threads(), make(0)(x)), buf)\nsys.stdout.buffer.write(buf.getvalue())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    threads, got = torch.load(io.BytesIO(out.stdout), weights_only=True)
    assert torch.equal(got, ref), (threads, torch.get_num_threads(), float((got - ref).abs().max()))
    assert threads == torch.get_num_threads() == conftest.SUITE_THREADS


# ---------------------------------------------------------------- 2. the state guard (tests/conftest.py)

def _leak_engine() -> None:
    torch.backends.quantized.engine = "qnnpack"


LEAKS = {
    "threads": (lambda: torch.set_num_threads(torch.get_num_threads() + 1), r"torch\.get_num_threads\(\) 1 -> 2"),
    "engine": (_leak_engine, r"torch\.backends\.quantized\.engine '\w+' -> 'qnnpack'"),
    "default dtype": (lambda: torch.set_default_dtype(torch.float64),
                      r"torch\.get_default_dtype\(\) torch\.float32 -> torch\.float64"),
    "grad": (lambda: torch.set_grad_enabled(False), r"torch\.is_grad_enabled\(\) True -> False"),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True),
                      r"torch\.are_deterministic_algorithms_enabled\(\) / warn_only \(False, False\) -> \(True, False\)"),
    "anomaly": (lambda: torch.set_anomaly_enabled(True), r"torch\.is_anomaly_enabled\(\) / check_nan \(False, True\)"),
    "matmul precision": (lambda: torch.set_float32_matmul_precision("medium"),
                         r"get_float32_matmul_precision\(\) 'highest' -> 'medium'"),
    "set_backend": (lambda: kernels.set_backend("reference"), r"set_backend \(process pin\) None -> 'reference'"),
    "use_backend left open": (lambda: kernels._pinned.set("reference"),  # (as a block entered and never left)
                              r"use_backend pin \(a block left open\) '<unset>' -> 'reference'"),
    "native off": (lambda: setattr(native._local, "off", True), r"lowbit\.native off switch False -> True"),
    "native scalar": (lambda: setattr(native._local, "isa", 0), r"lowbit\.native isa switch 1 -> 0"),
    "cli traceback": (lambda: setattr(common, "RAISE_UNEXPECTED", True),
                      r"lowbit\.cli\.common\.RAISE_UNEXPECTED False -> True"),
}


@pytest.mark.parametrize("name", list(LEAKS))
def test_the_state_guard_restores_a_leak_and_fails_naming_it(name):
    leak, match = LEAKS[name]
    before = conftest._read_state()
    leak()
    assert conftest._read_state() != before
    with pytest.raises(pytest.fail.Exception, match=r"^here left process-wide state changed \(restored now.*" + match):
        conftest._restore_and_report(before, "here")
    assert conftest._read_state() == before
    assert conftest.LEAKS.pop().startswith("here: ")
    conftest._restore_and_report(before, "here")  # nothing changed: no failure


def test_quantize_llm_threads_flag_does_not_outlive_main(tmp_path, capsys):
    """Before: ``main(["quantize-llm", ..., "--threads", "2"])`` left the calling process at 2 threads (the
    ``quantize`` command restored them; this one did not), an error exit too."""
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    if other > (os.cpu_count() or 1):
        pytest.skip("one CPU: --threads accepts 1 only")
    rc = cli.main(["quantize-llm", str(tmp_path / "missing.gguf"), "--speed-tokens", "1", "--threads", str(other),
                   "--out", str(tmp_path / "o")])
    assert rc == 2 and "--speed-tokens 1" in capsys.readouterr().err
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------- 3. scaled_operand's grids on the QFunctional

class _AlphaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sub(self.a(x), self.b(x), alpha=0.5)  # (a + (-0.5) · b: b's grid scaled, codes mirrored)
        return 2.0 - y  # (c - y: y's codes mirrored, then add_scalar)


_XA = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))


def _alpha_model() -> nn.Module:
    torch.manual_seed(0)
    p = Q.prepare_fx(_AlphaNet().eval(), Q.get_default_qconfig_mapping(), (_XA,))
    p(_XA)
    return Q.convert_fx(p)


def _qfunctionals(q: nn.Module) -> list[QFunctional]:
    return [m for m in q.modules() if isinstance(m, QFunctional)]


def test_a_deleted_models_add_alpha_grids_are_freed():
    """Before: the process-wide ``add_alpha._SCALED`` held the source grid (and its scaled copy) of every model that
    ran an add with alpha, after the model was deleted (up to 64 of them)."""
    q = _alpha_model()
    with torch.no_grad():
        q(_XA)
        grid = q.b(q.quantize_1(_XA))._scale  # the grid scaled_operand scales: the conv output's
    ref = weakref.ref(grid)
    del q, grid
    gc.collect()
    assert ref() is None
    assert not [k for k, v in vars(add_alpha).items() if isinstance(v, dict) and not k.startswith("__")]


def test_the_scaled_grids_are_read_once_per_model_and_kept_on_its_qfunctionals():
    q = _alpha_model()
    with torch.no_grad():
        outs = [q(_XA) for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    qfs = _qfunctionals(q)
    assert len(qfs) == 2
    for qf in qfs:  # one scaled grid (the sub's b, the rsub's y) and one set of requantization constants each
        assert len(qf._scaled) == 1, qf
    assert len(qfs[0]._memo) == 1  # (the add: its constants memo hits with the same scaled-grid tensors each call)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_converted_model_leave_the_eager_memos_behind(how):
    """Before: ``deepcopy`` / ``torch.save`` carried ``QFunctional._memo`` (keyed on the ids of the original's
    tensors) with the copied tensors it held."""
    q = _alpha_model()
    with torch.no_grad():
        ref = q(_XA)
    assert _qfunctionals(q)[0].__dict__.get("_memo")  # (the sub's constants, read by the run above)
    if how == "deepcopy":
        c = copy.deepcopy(q)
    else:
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert not any("_memo" in qf.__dict__ or "_scaled" in qf.__dict__ for qf in _qfunctionals(c))
    with torch.no_grad():
        assert torch.equal(c(_XA), ref) and torch.equal(c(_XA), ref)
    if how == "deepcopy":  # (the copy's own memos; a loaded pickle is re-traced from its code, see the report)
        assert all(len(qf._scaled) == 1 for qf in _qfunctionals(c))


@pytest.mark.parametrize("how", ["compile", "export"])
def test_add_with_alpha_and_a_mirrored_operand_trace_to_the_eager_codes(how):
    q = _alpha_model()
    x2 = _XA * 1.7
    with torch.no_grad():
        ref, ref2 = q(_XA), q(x2)
        run = (torch.compile(q, backend="aot_eager", fullgraph=True) if how == "compile"
               else torch.export.export(q, (_XA,)).module())
        assert torch.equal(run(_XA), ref) and torch.equal(run(x2), ref2)
