"""PyTorch 2 sweep (session 37): models whose forward returns or takes ``QTensor``s under ``torch.export`` (save ->
load, a fresh process too) and ``torch.compile``, bit-identical to eager."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import lowbit as Q

SRC = str(Path(Q.__file__).resolve().parent.parent)


class _Outputs(nn.Module):
    """A static Linear whose forward returns its ``QTensor`` (alone, in a tuple with float, in a dict) or a per-channel
    ``QTensor`` made from the float output."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.quant, self.fc, self.dequant = out, Q.QuantStub(), nn.Linear(8, 4), Q.DeQuantStub()

    def forward(self, x: torch.Tensor):
        y = self.fc(self.quant(x))
        if self.out == "qtensor":
            return y
        if self.out == "tuple":
            return y, self.dequant(y)
        if self.out == "dict":
            return {"q": y, "f": self.dequant(y), "pair": [y.relu(), 2.0 * self.dequant(y)]}
        return Q.quantize_per_channel(self.dequant(y), torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3]),
                                      1, Q.qint8.with_range(-100, 100))


def _converted(out: str) -> nn.Module:
    torch.manual_seed(0)
    p = Q.prepare(_Outputs(out).eval(), Q.get_default_qconfig())
    p(torch.randn(32, 8))
    return Q.convert(p)


def _same(a, b) -> bool:
    """Equal nests of tensors and QTensors: codes, scales, zero points, grid and axis."""
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return (isinstance(b, Q.QTensor) and torch.equal(a.int_repr(), b.int_repr()) and torch.equal(a.scale, b.scale)
            and torch.equal(a.zero_point, b.zero_point) and a.qdtype == b.qdtype and a.axis == b.axis)


_LOAD = """
import sys, torch, lowbit
for name in sys.argv[2:]:
    ep = torch.export.load(f"{sys.argv[1]}/{name}.pt2")
    torch.save(ep.module()(torch.load(f"{sys.argv[1]}/x.pt")), f"{sys.argv[1]}/{name}.y.pt")
"""


def test_export_models_returning_qtensors(tmp_path: Path) -> None:
    """``QTensor`` was no pytree node, so ``torch.export`` of a model returning one (alone or among float outputs)
    failed: "Found <class 'lowbit.qtensor.QTensor'> in output, which is not a known type". Now the exported program
    (dynamic batch; saved and loaded here and in a fresh process) returns eager's QTensors: codes, grid and axis."""
    x = torch.randn(5, 8)
    refs = {}
    for out in ("qtensor", "tuple", "dict", "per_channel"):
        model = _converted(out)
        with torch.no_grad():
            refs[out] = model(x)
        ep = torch.export.export(model, (x[:3],), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
        assert _same(refs[out], ep.module()(x)), out
        torch.export.save(ep, tmp_path / f"{out}.pt2")
        buf = io.BytesIO(tmp_path.joinpath(f"{out}.pt2").read_bytes())
        assert _same(refs[out], torch.export.load(buf).module()(x)), out
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path), *refs], check=True, env=env, timeout=300)
    for out, ref in refs.items():  # (torch.load's weights_only unpickler rebuilds QTensors: serial.rebuild)
        assert _same(ref, torch.load(tmp_path / f"{out}.y.pt")), f"{out}: the program loaded in a fresh process"


def test_export_quantized_layer_taking_a_qtensor() -> None:
    """A quantized layer exported on its ``QTensor`` input: the program takes QTensors on other scales and zero points
    of that grid and gives eager's codes."""
    layer = _converted("qtensor").fc
    x = torch.randn(5, 8)
    ep = torch.export.export(layer, (Q.quantize_per_tensor(x, 0.05, 128, Q.quint8),))
    for scale, zp in ((0.05, 128), (0.02, 100), (0.1, 0)):
        qx = Q.quantize_per_tensor(x, scale, zp, Q.quint8)
        assert _same(layer(qx), ep.module()(qx)), (scale, zp)


def test_compile_across_input_grids_with_changing_ranges() -> None:
    """A compiled quantized layer fed ``QTensor``s whose grid range changes (``quint8``, then ``[0, 127]``, then
    ``[0, 100]``): dynamo made the grid's ``quant_max`` symbolic after the first change (automatic dynamic), and
    ``qdtype_key``'s f-string of it stopped ``fullgraph=True`` ("BUILD_STRING type error"). The key is made by
    ``QDtype`` itself now (a constant string): each grid gives eager's codes."""
    layer = _converted("qtensor").fc
    x = torch.randn(5, 8)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # (the break is dynamo's: no C++)
    for qdtype, scale, zp in ((Q.quint8, 0.05, 128), (Q.quint8, 0.02, 100), (Q.quint8.with_range(0, 127), 0.03, 60),
                              (Q.quint8.with_range(0, 100), 0.03, 60), (Q.quint8.with_range(10, 200), 0.03, 50)):
        qx = Q.quantize_per_tensor(x, scale, zp, qdtype)
        assert _same(layer(qx), compiled(qx)), qdtype


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _in_place_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6)
    p = Q.prepare_fx(_Conv().eval(), Q.get_default_qconfig_mapping(), (x,))
    p(torch.randn(16, 3, 6, 6))
    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    return {"convert_fx": (Q.convert_fx(p), x), "static_linear": (_converted("tuple"), torch.randn(5, 8)),
            "dynamic": (Q.quantize_dynamic(mlp), torch.randn(5, 16)),
            "dynamic_x86": (Q.quantize_dynamic(mlp, {nn.Linear: Q.get_dynamic_qconfig(backend="x86")}),
                            torch.randn(5, 16)),
            "weight_only_int4": (Q.quantize_weight_only(mlp, bits=4, group_size=16), torch.randn(5, 16))}


def test_compiled_model_sees_in_place_weight_writes() -> None:
    """The ops cache packs per weight on a ``weight.detach()`` (``pt2.kernel_ops.cached_weight``), keyed on its version;
    a compiled program runs the ops below autograd's ``ADInplaceOrView`` key, where that detach got a version counter
    of its own, so an in-place write of the weight codes (``copy_``) left the compiled model on the old packs (the
    fx conv, the dynamic Linears: silently the old outputs). Now the compiled model gives eager's new outputs."""
    for kind, (model, x) in _in_place_models().items():
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            before = compiled(x)
            for t in model.buffers():
                if t.dtype in (torch.int8, torch.uint8) and t.dim() >= 2:  # (every weight's codes, rows reversed)
                    t.copy_(torch.flip(t, [0]))
            got = compiled(x)  # (before eager runs: eager would refresh the entries on its own)
            want = copy.deepcopy(model)(x)  # (fresh caches)
        assert not _same(before, want), kind
        assert _same(got, want), f"{kind}: the compiled model kept the old weights"


def test_dynamic_batch_program_with_max_pool_takes_an_empty_batch() -> None:
    """A traced 2-d max pool of codes is one ``lowbit::max_pool2d_codes``; its real implementation refused an empty
    batch ("... on a torch.uint8 tensor of shape (0, 4, 8, 8) ... is not covered"), which a program with a dynamic
    batch dim (exported, or compiled with ``dynamic=True``) meets where eager pools it another way. Now eager's empty
    output, and the same codes at batch 1 and 3."""
    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 5), Q.DeQuantStub()).eval()
    p = Q.prepare(Q.fuse_modules(model, [["1", "2"]]), Q.get_default_qconfig())
    p(torch.randn(16, 3, 8, 8))
    q = Q.convert(p)
    x = torch.randn(3, 3, 8, 8)
    ep = torch.export.export(q, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for b in (0, 1, 3):
            want = q(x[:b])
            assert want.shape == (b, 5)
            assert torch.equal(ep.module()(x[:b]), want), f"exported, batch {b}"
            assert torch.equal(compiled(x[:b]), want), f"compiled, batch {b}"
