"""``lowbit.native.entry``: the CPython entry points are built wherever ``Python.h`` is, call the same C functions with the
same argument values as ctypes (converted models give the same outputs through both, and the same passes run), reject
what ctypes rejects, and the build falls back to ctypes without the header or when the wrapper does not compile."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import native
from lowbit.native import entry

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")


@needs_native
def test_the_cpython_entry_points_are_used_wherever_python_h_is() -> None:
    want = "cpython" if entry.python_include() is not None else "ctypes"
    if os.environ.get("LOWBIT_NATIVE_ENTRY") == "ctypes":
        want = "ctypes"
    assert native.entry_points() == want, native.reason()
    assert native.reason().endswith("CPython entry points" if want == "cpython" else ")")
    with native.through_ctypes():
        assert native.entry_points() == "ctypes"
    assert native.entry_points() == want


def test_every_signature_has_a_wrapper_and_a_ctypes_type() -> None:
    src = entry.wrapper_source()
    for name, (args, res) in entry.SIGNATURES.items():
        assert f"static PyObject *w_{name}(" in src and f'{{"{name}", ' in src
        assert f"if (n != {len(args.split())}) return lbx_nargs" in src
        assert res in ("i32", "void") and all(a in ("p", "i64", "i32", "f32") for a in args.split())


def _both() -> list[Any]:
    """The entry points callers use, then their ctypes twins (the same object where no extension was built)."""
    native._lib()
    return [native._state["lib"], native._state["ctypes"]]


@needs_native
def test_scalar_arguments_convert_as_ctypes_does() -> None:
    for lib in _both():
        # int, bool and an index-able int all reach the C int; the answer is the body a pinned isa picks
        assert [lib.lb_smallconv_body(v) for v in (0, False, 2)] == [0, 0, lib.lb_smallconv_body(2)]
        q = torch.tensor([0, 10, 255], dtype=torch.uint8)
        for s in (0.5, 2):  # f32 from a float or an int
            out = torch.empty(3)
            lib.lb_dequantize(q.data_ptr(), 3, False, 10, s, out.data_ptr(), 1, 1)
            assert out.tolist() == [(v - 10) * s for v in (0, 10, 255)]
        x = torch.tensor([-1.0, 0.26, 1e9])
        codes = torch.empty(3, dtype=torch.uint8)
        assert lib.lb_quantize(x.data_ptr(), 3, 10.0, 10.0, float("-inf"), float("inf"), 0, codes.data_ptr(), 1, 1) == 0
        assert codes.tolist() == [0, 13, 255]
        with pytest.raises((TypeError, ctypes.ArgumentError)):  # a float where C takes an int
            lib.lb_smallconv_body(1.0)
        with pytest.raises((TypeError, ctypes.ArgumentError)):  # a string where C takes a float
            lib.lb_dequantize(q.data_ptr(), 3, 0, 10, "0.5", out.data_ptr(), 1, 1)
        with pytest.raises(TypeError):
            lib.lb_smallconv_body()
    fast = _both()[0]
    if fast is not _both()[1]:
        with pytest.raises(OverflowError, match="does not fit a C int"):  # (ctypes would wrap it silently)
            fast.lb_smallconv_body(1 << 40)
        with pytest.raises(TypeError, match="takes 1 arguments"):
            fast.lb_smallconv_body(1, 2)


class _Net(nn.Module):
    """A stem conv, a depthwise / pointwise pair with a residual add, max pooling, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU6())
        self.pw = nn.Conv2d(16, 16, 1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.pool(y + self.pw(self.dw(y)))
        return self.head(y.flatten(1))


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    net, x = _Net().eval(), torch.randn(4, 3, 16, 16)
    prepared = Q.prepare_fx(net, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    prepared(x)
    lin = nn.Linear(96, 40).eval()
    chain = Q.prepare(nn.Sequential(Q.QuantStub(), lin, Q.DeQuantStub()).eval(), Q.get_default_qconfig())
    rows = torch.randn(16, 96)
    chain(rows)
    return {"graph-mode CNN": (Q.convert_fx(prepared), x), "static Linear, 1 row": (Q.convert(chain), rows[:1]),
            "static Linear, 16 rows": (Q.convert(chain), rows),
            "dynamic Linear": (Q.quantize_dynamic(nn.Sequential(lin)), torch.randn(5, 96))}


@needs_native
@pytest.mark.parametrize("name", ["graph-mode CNN", "static Linear, 1 row", "static Linear, 16 rows", "dynamic Linear"])
def test_converted_models_give_the_same_outputs_through_both_entries(name: str) -> None:
    model, x = _models()[name]
    with torch.inference_mode():
        native.counts.clear()
        got = model(x)
        ran = dict(native.counts)
        with native.through_ctypes():
            native.counts.clear()
            ref = model(x)
            ran_ctypes = dict(native.counts)
    assert ran and ran == ran_ctypes, (ran, ran_ctypes)
    assert torch.equal(got, ref)


_FALLBACK = """
import sys
from pathlib import Path
from lowbit import native
from lowbit.native import entry
tmp = Path(sys.argv[1])
# stand-ins for the C files, every entry point a stub (the build's decisions are what is tested; ~1 s, not ~30)
C = {"p": "void *", "i64": "long long", "i32": "int", "f32": "float"}
stub = "".join(f"{'void' if res == 'void' else 'int'} {name}({', '.join(C[a] for a in args.split()) or 'void'})"
               f" {{{'' if res == 'void' else ' return 0;'} }}\\n" for name, (args, res) in entry.SIGNATURES.items())
(tmp / "stubs.c").write_text(stub)
(tmp / "common.h").write_text("")
native._SRC, native._DIR = [tmp / "stubs.c"], tmp
native._cache_dir = lambda: tmp / "a"
real_include, entry.python_include = entry.python_include, lambda: None
fast, slow, why = native._build()
print(why.split(", ")[-1], fast is slow, fast.lb_cpu_avx2() in (0, 1))
broken = tmp / "include"
broken.mkdir()
(broken / "Python.h").write_text("#error not a usable Python.h\\n")
native._cache_dir = lambda: tmp / "b"
entry.python_include = lambda: str(broken)
fast, slow, why = native._build()
print(why.split(", ")[-1], fast is slow, fast.lb_cpu_avx2() in (0, 1))
# and with the header the same stubs load through the extension (so the fallbacks above are the header's doing)
native._cache_dir = lambda: tmp / "c"
entry.python_include = real_include
fast, slow, why = native._build()
print(why.split(", ")[-1], fast is slow)
"""


@needs_native
def test_the_build_falls_back_to_ctypes_without_a_usable_python_h(tmp_path: Any) -> None:
    out = subprocess.run([sys.executable, "-c", _FALLBACK, str(tmp_path)], capture_output=True, text=True, timeout=600)
    # (one fresh process for the three builds: no header, a broken one, the real one)
    assert out.returncode == 0, out.stderr[-2000:]
    want = "CPython entry points False" if entry.python_include() else "ctypes entry points (no Python.h) True"
    assert out.stdout.splitlines() == ["ctypes entry points (no Python.h) True True",
                                       "ctypes entry points (built without them) True True", want]


@needs_native
def test_the_entry_switch_is_read_and_a_bad_value_names_itself() -> None:
    code = "from lowbit import native; print(native.entry_points(), native.reason().split(', ')[-1])"
    env = {**os.environ, "LOWBIT_NATIVE_ENTRY": "ctypes"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ctypes", "ctypes", "entry", "points",
                                                          "(LOWBIT_NATIVE_ENTRY=ctypes)"], out.stderr[-2000:]
    env["LOWBIT_NATIVE_ENTRY"] = "fast"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "LOWBIT_NATIVE_ENTRY='fast'" in out.stderr.strip().splitlines()[-1]
