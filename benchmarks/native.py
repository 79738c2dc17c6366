"""lowbit.native, pass by pass: each native pass against the torch path it replaces (the same outputs), interleaved.

Run: ``python benchmarks/native.py [--quick] [--threads 1 2] [--rounds 7]`` (method: ``common.py``). Writes
``benchmarks/results/native.json``. Every case runs the same lowbit call twice per round, once as it is and once
inside ``native.disabled()`` (its torch ops), after checking the two outputs are equal; ratio = torch-path time /
native time (> 1: native faster). Cases, on whatever CPU this is (the routes without VNNI are pinned by patching
``onednn.has_vnni``, as the tests do, so an AVX-512 VNNI machine times them too):

- dynamic Linear, per-token 7-bit and 8-bit recipes: the row grids + codes and the per-row epilogue (MiniLM's
  4096×384→1536 and 4096×1536→384), and at few rows (16, 4, 1 × 768²) the whole Linear: the 7-bit recipe's rows
  (up to 16) and the 8-bit weight-split route without VNNI (up to 4);
- static conv without VNNI: a dense 3×3 (the split-weight epilogue) and a depthwise 3×3 (the whole conv), batch 8;
- the quantized add_relu of two 8×96×56² tensors; the Quantize stub on 8×3×224² and 1×768;
- the small-M static Linear without VNNI, M = 1 and 16 on 768² and 768×3072: the 8-bit recipe (lowbit's epilogue)
  and torch.ao's x86 recipe (fbgemm's requantization, reproduced), each with its Quantize stub.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import common

import lowbit as Q
from lowbit import native
from lowbit.kernels import onednn
from lowbit.nn.quantized.dynamic import Linear as DLinear
from lowbit.nn.quantized.functional_modules import QFunctional
from lowbit.nn.quantized.stubs import Quantize


def _off(f: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with native.disabled():
            return f()
    return run


def _same(a: Any, b: Any) -> bool:
    a = a.int_repr() if isinstance(a, Q.QTensor) else a
    b = b.int_repr() if isinstance(b, Q.QTensor) else b
    return torch.equal(a, b)


def _dynamic(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    shapes = [(16, 768, 768)] if quick else [(4096, 384, 1536), (4096, 1536, 384), (16, 768, 768), (4, 768, 768),
                                             (1, 768, 768)]
    out = []
    for m, k, n in shapes:
        for rr, name in ((True, "per-token 7-bit"), (False, "per-token 8-bit")):
            lin = nn.Linear(k, n)
            lin.qconfig = Q.get_dynamic_qconfig(reduce_range=rr)
            q = DLinear.from_float(lin)
            x = torch.randn(m, k)
            out.append((f"dynamic Linear {name} {m}×{k}×{n}", lambda q=q, x=x: q(x)))
    return out


def _static_model(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    qm, _ = Q.quantize_ptq(model.eval(), [x], recipe="default")
    return lambda: qm(x)


def _convs(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    h = 28 if quick else 56
    x = torch.randn(8, 96, h, h)
    dense = nn.Sequential(nn.Conv2d(96, 96, 3, padding=1), nn.ReLU())
    dw = nn.Sequential(nn.Conv2d(96, 96, 3, padding=1, groups=96), nn.ReLU6())
    return [(f"conv 3×3 dense 8×96×{h}² (epilogue)", _static_model(dense, x)),
            (f"conv 3×3 depthwise 8×96×{h}² (whole conv)", _static_model(dw, x))]


def _small(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    out = []
    a = Q.quantize_per_tensor(torch.randn(8, 96, 56, 56), 0.03, 120, Q.quint8)
    b = Q.quantize_per_tensor(torch.randn(8, 96, 56, 56), 0.02, 128, Q.quint8)
    f = QFunctional(0.04, 0, Q.quint8)
    out.append(("quantized add_relu 8×96×56²", lambda: f.add_relu(a, b)))
    stub = Quantize(0.02, 128, Q.quint8)
    for shape in ((8, 3, 224, 224), (1, 768)):
        x = torch.randn(*shape)
        out.append((f"Quantize {'×'.join(map(str, shape))}", lambda x=x: stub(x)))
    shapes = [(1, 768, 768)] if quick else [(1, 768, 768), (16, 768, 768), (1, 768, 3072), (16, 768, 3072)]
    for (m, k, n), (recipe, qconfig) in ((s, r) for s in shapes for r in (("8-bit", Q.get_default_qconfig()),
                                                                          ("x86 recipe", Q.get_default_qconfig("x86")))):
        lin = nn.Sequential(Q.QuantStub(), nn.Linear(k, n), Q.DeQuantStub()).eval()
        lin.qconfig = qconfig
        p = Q.prepare(lin)
        p(torch.randn(64, k))
        qm = Q.convert(p)
        x = torch.randn(m, k)
        out.append((f"static Linear {recipe} {m}×{k}×{n}", lambda qm=qm, x=x: qm(x)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    a = p.parse_args()
    if a.quick:
        a.rounds = min(a.rounds, 3)
    mach = common.machine()
    print(f"{mach.get('cpu', '?')} | ISA {mach.get('isa')} | torch {mach['torch']} | native: {native.reason()}")
    if not native.available():
        print("lowbit.native is not built here: nothing to compare")
        print(common.write_results(a.out or "native", {"available": False, "reason": native.reason()}))
        return
    warnings.simplefilter("ignore", UserWarning)
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else \
        torch.backends.quantized.engine
    real_vnni = onednn.has_vnni
    onednn.has_vnni = lambda: False  # the routes without VNNI, on any CPU (the tests pin them the same way)
    try:
        torch.manual_seed(0)
        cases = _dynamic(a.quick) + _convs(a.quick) + _small(a.quick)
        res: dict[str, Any] = {"available": True, "runs": []}
        for threads in a.threads:
            torch.set_num_threads(threads)
            rows = []
            for name, f in tqdm(cases, desc=f"native, {threads} thread(s)", file=sys.stdout):
                with torch.inference_mode():
                    if not _same(f(), _off(f)()):
                        raise AssertionError(f"{name}: native and torch paths differ")
                t = common.bench({"native": f, "torch": _off(f)}, a.rounds, a.min_time, a.max_load, a.max_wait)
                r = t.ratio("torch", "native")
                rows.append([name, f"{t.n_clean}/{a.rounds}", t.median("native") * 1e3, t.median("torch") * 1e3, r])
                res["runs"].append({"threads": threads, "case": name, **t.summary("torch")})
            print(f"\n{threads} thread(s): ms per call, medians of interleaved rounds; ratio = torch path / native")
            print(common.md_table(["case", "clean", "native ms", "torch path ms", "ratio"], rows))
    finally:
        onednn.has_vnni = real_vnni
    print(common.write_results(a.out or "native", res))


if __name__ == "__main__":
    main()
