"""How Python calls the native passes: each C entry point's signature, once, and the two ways to call it.

Every ``lb_*`` function of the C files is listed in ``SIGNATURES`` with its argument and result types (``p`` a
pointer, ``i64`` ``int64_t``, ``i32`` ``int``, ``f32`` ``float``; ``void`` no result). From that one table:

- ``bind_ctypes(dll)`` gives the functions through ``ctypes`` (``argtypes`` / ``restype`` set): works with any
  Python, but converting the arguments costs ~0.3-0.6 µs each on a slow core (measured on a Zen 1 EPYC: a
  ten-argument ``lb_quantize`` of one float 3.9 µs through ctypes, 0.33 µs through the extension below);
- ``wrapper_source()`` writes a CPython extension (``_lowbit_native``, compiled into the same shared object when
  ``Python.h`` is found) with one ``METH_FASTCALL`` function per entry point, which converts the same arguments
  the same way in C and calls the entry point with the GIL released, as ctypes does.

Both give the same C call with the same argument values: a pointer is an ``int`` (``data_ptr()``) or ``None``
(NULL), ``i64`` / ``i32`` an ``int`` (a ``bool`` too), ``f32`` a ``float`` or ``int`` converted as
``(float)(double)x``. The extension is stricter in one place: an ``i32`` outside ``int``'s range raises
``OverflowError`` where ctypes wraps it silently. ``bind`` gives the object callers use, ``lib.lb_quantize(...)``
either way.

>>> from lowbit.native import entry
>>> entry.SIGNATURES["lb_quantize"]
('p i64 f32 f32 f32 f32 i32 p i32 i32', 'i32')
>>> "w_lb_quantize" in entry.wrapper_source()
True
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import sysconfig
import types
from pathlib import Path

__all__ = ["SIGNATURES", "MODULE", "bind_ctypes", "wrapper_source", "python_include", "load_ext", "bind"]

SIGNATURES: dict[str, tuple[str, str]] = {
    "lb_row_grid": ("p i64 i64 i64 f32 f32 f32 i32 p i64 p p i32 i32", "i32"),
    "lb_row_epilogue": ("p i64 i64 i64 p p p p i32 i32 i32", "void"),
    "lb_conv_epilogue": ("p p i64 i64 i64 i64 i64 p p f32 f32 f32 f32 p i32 i32", "void"),
    "lb_qadd": ("p i32 p i32 p i32 i64 f32 f32 f32 f32 f32 f32 f32 i32 i32", "void"),
    "lb_quantize": ("p i64 f32 f32 f32 f32 i32 p i32 i32", "i32"),
    "lb_dequantize": ("p i64 i32 f32 f32 p i32 i32", "void"),
    "lb_dwconv": ("p i64 i64 i64 i64 p i32 i32 i32 i32 i32 i32 i32 i32 i32 i64 i64 p p f32 f32 f32 f32 p i32 i32",
                  "void"),
    "lb_smallconv": ("p i64 i64 i64 i64 i64 i64 i64 i64 p p p i64 i64 i32 i32 i32 i32 i32 i32 i32 i32 i32 i64 i64 p p"
                     " f32 f32 f32 f32 p i32 i32", "i32"),
    "lb_smallconv_body": ("i32", "i32"),
    "lb_linear_run": ("p p i64 i64 i32 p p p i32 i32", "i32"),
    "lb_linear_split": ("p i64 i32 i32 i32", "i32"),
    "lb_conv_gemm": ("p p i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i32 i64 i64 p i32 i32", "i32"),
    "lb_dyn_linear": ("p i64 i64 i64 i64 p p p i32 p p p i32 i32 i32", "i32"),
    "lb_all_finite": ("p i64 i32", "i32"),
    "lb_maxpool_codes": ("p i32 i64 i64 i64 i64 i64 i64 i64 i64 p i32 i32", "void"),
    "lb_to_nhwc": ("p i64 i64 i64 p i32", "void"),
    "lb_im2col": ("p i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i32 i64 i64 p i32", "void"),
    "lb_to_nchw": ("p i64 i64 i64 p i32", "void"),
    "lb_cpu_avx2": ("", "i32"),
    "lb_cpu_vnni": ("", "i32"),
    "lb_cpu_amx": ("", "i32"),
    "lb_cpu_avx512": ("", "i32"),
    "lb_openmp": ("", "i32"),
}
MODULE = "_lowbit_native"  # the extension's name (its init function is PyInit__lowbit_native)

_CTYPES = {"p": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int, "f32": ctypes.c_float, "void": None}
_C = {"p": "void *", "i64": "int64_t", "i32": "int", "f32": "float", "void": "void"}
_CONVERT = {"p": "lbx_p", "i64": "lbx_i64", "i32": "lbx_i32", "f32": "lbx_f32"}


def bind_ctypes(dll: ctypes.CDLL) -> types.SimpleNamespace:
    """Every entry point of ``dll`` with its ctypes ``argtypes`` and ``restype`` set from ``SIGNATURES``."""
    fns = {}
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(dll, name)
        fn.argtypes = [_CTYPES[a] for a in args.split()]
        fn.restype = _CTYPES[res]
        fns[name] = fn
    return types.SimpleNamespace(**fns)


_PRELUDE = r"""#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>

/* The argument conversions of ctypes' c_void_p, c_int64, c_int and c_float (an int c_int cannot hold raises here). */
static int lbx_p(PyObject *o, void **v) {
    if (o == Py_None) { *v = NULL; return 0; }
    *v = PyLong_AsVoidPtr(o);
    return (*v == NULL && PyErr_Occurred()) ? -1 : 0;
}
static int lbx_i64(PyObject *o, int64_t *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    *v = (int64_t)x;
    return 0;
}
static int lbx_i32(PyObject *o, int *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < INT_MIN || x > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "lowbit.native: %lld does not fit a C int", x);
        return -1;
    }
    *v = (int)x;
    return 0;
}
static int lbx_f32(PyObject *o, float *v) {
    double x = PyFloat_AsDouble(o);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    *v = (float)x;
    return 0;
}
static PyObject *lbx_nargs(const char *name, Py_ssize_t want, Py_ssize_t got) {
    PyErr_Format(PyExc_TypeError, "lowbit.native.%s takes %zd arguments (%zd given)", name, want, got);
    return NULL;
}
"""


def _wrapper(name: str, args: list[str], res: str) -> str:
    """One entry point's prototype and its ``METH_FASTCALL`` wrapper."""
    n = len(args)
    proto = f"extern {_C[res]} {name}({', '.join(_C[a] for a in args) or 'void'});\n"
    lines = [f"static PyObject *w_{name}(PyObject *self, PyObject *const *a, Py_ssize_t n) {{",
             f'    if (n != {n}) return lbx_nargs("{name}", {n}, n);']
    lines += [f"    {_C[a]} a{i};" for i, a in enumerate(args)]
    if args:
        tests = " || ".join(f"{_CONVERT[a]}(a[{i}], &a{i})" for i, a in enumerate(args))
        lines.append(f"    if ({tests}) return NULL;")
    call = f"{name}({', '.join(f'a{i}' for i in range(n))})"
    if res == "void":
        lines += ["    Py_BEGIN_ALLOW_THREADS", f"    {call};", "    Py_END_ALLOW_THREADS", "    Py_RETURN_NONE;"]
    else:
        lines += ["    int r;", "    Py_BEGIN_ALLOW_THREADS", f"    r = {call};", "    Py_END_ALLOW_THREADS",
                  "    return PyLong_FromLong(r);"]
    return proto + "\n".join(lines) + "\n}\n"


def wrapper_source() -> str:
    """The C source of the ``_lowbit_native`` extension: one fast-call wrapper per ``SIGNATURES`` entry."""
    body = [_PRELUDE]
    for name, (args, res) in SIGNATURES.items():
        body.append(_wrapper(name, args.split(), res))
    table = "".join(f'    {{"{name}", (PyCFunction)(void (*)(void))w_{name}, METH_FASTCALL, NULL}},\n'
                    for name in SIGNATURES)
    body.append(f"static PyMethodDef lbx_methods[] = {{\n{table}    {{NULL, NULL, 0, NULL}}\n}};\n"
                f'static struct PyModuleDef lbx_module = {{PyModuleDef_HEAD_INIT, "{MODULE}", NULL, -1, lbx_methods}};\n'
                f"PyMODINIT_FUNC PyInit_{MODULE}(void) {{ return PyModule_Create(&lbx_module); }}\n")
    return "\n".join(body)


def python_include() -> str | None:
    """The folder holding this interpreter's ``Python.h``, or ``None`` (no headers installed: ctypes only)."""
    inc = sysconfig.get_paths().get("include")
    return inc if inc and (Path(inc) / "Python.h").exists() else None


def load_ext(path: Path) -> types.ModuleType | None:
    """The ``_lowbit_native`` extension inside the shared object ``path``, or ``None`` (built without it)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        return None
    try:
        mod = importlib.util.module_from_spec(spec)
    except ImportError:  # (no PyInit__lowbit_native in it)
        return None
    return mod if all(hasattr(mod, name) for name in SIGNATURES) else None


def bind(dll: ctypes.CDLL, path: Path, want: str = "cpython") -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """``(fast, ctypes_only)``: the entry points as callers use them (the extension's where it was built into ``path``
    and ``want`` is ``"cpython"``, else the ctypes ones themselves: ``fast is ctypes_only``) and the ctypes ones alone
    (``native.through_ctypes()`` for tests)."""
    slow = bind_ctypes(dll)
    ext = load_ext(path) if want == "cpython" else None
    if ext is None:
        return slow, slow
    return types.SimpleNamespace(**{name: getattr(ext, name) for name in SIGNATURES}), slow
