"""Session 38 sweep of quantized ``Embedding`` / ``EmbeddingBag`` across eager, ``quantize_dynamic``, graph mode, QAT,
reference models, checkpoints and ONNX. Oracle: the float module (its forward renorms looked-up rows to ``max_norm``)
and the QAT model the int8 one is converted from. The tests named after a defect failed before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.fx as LFX
import lowbit.nn.qat as nnqat
from lowbit.nn.quantized.embedding import Embedding, EmbeddingBag


def _tables(max_norm: float | None = 1.0, norm_type: float = 2.0, seed: int = 0) -> nn.Module:
    """An Embedding and a 'mean' EmbeddingBag whose rows are 3-6x longer than ``max_norm`` (a few shorter)."""
    torch.manual_seed(seed)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 6, padding_idx=2, max_norm=max_norm, norm_type=norm_type)
            self.bag = nn.EmbeddingBag(16, 6, mode="mean", max_norm=max_norm, norm_type=norm_type)
            with torch.no_grad():
                for t in (self.emb.weight, self.bag.weight):
                    t.mul_(3.0)
                    t[:3] *= 0.05  # rows already inside max_norm stay as they are

        def forward(self, x: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
            return self.emb(x).sum(0) + self.bag(x, off)[0]

    return M().eval()


X, OFF = torch.tensor([0, 1, 5, 9, 5, 15, 2]), torch.tensor([0, 3])


def _float_out(m: nn.Module, mod: str, *args: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # (on a copy: the float forward renorms its own weight in place)
        return getattr(copy.deepcopy(m), mod)(*args)


def _routes(m: nn.Module, bits: int, fq: bool) -> dict[str, nn.Module]:
    qc = Q.get_embedding_qconfig(bits, float_qparams=fq)
    eager = copy.deepcopy(m)
    eager.emb.qconfig = eager.bag.qconfig = qc
    qm = Q.QConfigMapping().set_object_type(nn.Embedding, qc).set_object_type(nn.EmbeddingBag, qc)
    prepared = LFX.prepare_fx(copy.deepcopy(m), qm, (X, OFF))
    return {"eager": Q.convert(Q.prepare(eager)),
            "dynamic": Q.quantize_dynamic(copy.deepcopy(m), {nn.Embedding: qc, nn.EmbeddingBag: qc}),
            "fx": LFX.convert_fx(prepared)}


@pytest.mark.parametrize("bits,fq", [(8, False), (8, True), (4, True)])
def test_max_norm_renorms_looked_up_rows_on_every_route(bits, fq):
    """Defect: the quantized tables dropped ``max_norm`` (torch.ao's too): rows 3-6x longer than the float model's."""
    m = _tables()
    want_e, want_b = _float_out(m, "emb", X), _float_out(m, "bag", X, OFF)
    tol = 0.02 if bits == 8 else 0.2
    for route, c in _routes(m, bits, fq).items():
        got_e, got_b = c.emb(X), c.bag(X, OFF)
        assert c.emb.max_norm == 1.0 and c.bag.max_norm == 1.0, route
        assert float(got_e.norm(dim=1).max()) <= 1.0 + 1e-6, route
        assert torch.allclose(got_e, want_e, atol=tol), (route, float((got_e - want_e).abs().max()))
        assert torch.allclose(got_b, want_b, atol=tol), (route, float((got_b - want_b).abs().max()))
        # a short row is left alone (up to its quantization), not scaled up to max_norm
        assert float(got_e[0].norm()) < 0.5, route


def test_max_norm_other_norm_type_and_repr():
    m = _tables(max_norm=0.7, norm_type=1.0)
    c = _routes(m, 8, False)["eager"]
    got = c.emb(X)
    assert float(got.norm(p=1, dim=1).max()) <= 0.7 + 1e-6
    assert torch.allclose(got, _float_out(m, "emb", X), atol=0.02)
    assert "max_norm=0.7, norm_type=1.0" in repr(c.emb) and "max_norm=0.7" in repr(c.bag)


@pytest.mark.parametrize("bits", [8, 4])
def test_qat_model_and_its_int8_twin_agree_with_max_norm(bits):
    """Defect: QAT renormed the fake-quantized rows, the converted model did not (outputs 1-4 apart)."""
    m = _tables()
    m.train()
    m.qconfig = Q.get_embedding_qat_qconfig(bits)
    p = Q.prepare_qat(m)
    assert isinstance(p.emb, nnqat.Embedding)
    opt = torch.optim.SGD(p.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        p(X, OFF).sum().backward()
        opt.step()
    p.eval()
    with torch.no_grad():
        want_e, want_b = p.emb(X), p.bag(X, OFF)
    c = Q.convert(copy.deepcopy(p))
    assert torch.equal(c.emb(X), want_e)
    assert torch.allclose(c.bag(X, OFF), want_b, atol=1e-6)


def test_reference_model_keeps_max_norm():
    """Defect: ``convert(is_reference=True)`` and its ``to_float`` dropped ``max_norm`` / ``norm_type``."""
    m = _tables(max_norm=0.8, norm_type=3.0)
    m.emb.qconfig = m.bag.qconfig = Q.get_embedding_qconfig()
    ref = Q.convert(Q.prepare(copy.deepcopy(m)), is_reference=True)
    for name in ("emb", "bag"):
        mod = getattr(ref, name)
        assert (mod.max_norm, mod.norm_type) == (0.8, 3.0), name
        back = mod.to_float()
        assert (back.max_norm, back.norm_type) == (0.8, 3.0), name
    with torch.no_grad():
        assert float(ref.emb(X).norm(p=3, dim=1).max()) <= 0.8 + 1e-6
        assert torch.allclose(ref.emb(X), _float_out(m, "emb", X), atol=0.02)


def test_max_norm_constructor_checks_and_does_not_touch_the_table():
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="max_norm"):
            Embedding(4, 3, max_norm=bad)
    with pytest.raises(ValueError, match="norm_type"):
        EmbeddingBag(4, 3, max_norm=1.0, norm_type=float("nan"))
    q = Embedding.from_float(nn.Embedding(8, 4, max_norm=0.1))
    codes = q.weight_q.clone()
    q(torch.tensor([1, 2, 2]))
    assert torch.equal(q.weight_q, codes)  # renorm happens on the looked-up copy, as the QAT module's
    # no max_norm: the rows as stored (unchanged behaviour)
    plain = Embedding.from_float(nn.Embedding(8, 4))
    assert plain.max_norm is None and torch.equal(plain(torch.tensor([3])), plain.weight().dequantize()[3:4])


@pytest.mark.parametrize("bits,opset", [(8, 17), (4, 17), (8, 18)])
def test_onnx_export_renorms_like_the_module(tmp_path, bits, opset):
    """Defect: the ONNX twins gathered unrenormed rows."""
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx

    m = _tables()
    m.emb.qconfig = m.bag.qconfig = Q.get_embedding_qconfig(bits)
    c = Q.convert(Q.prepare(copy.deepcopy(m)))
    x2 = torch.tensor([[1, 5, 9], [15, 2, 0]])
    for name, args in (("emb", (x2,)), ("bag", (X, OFF))):
        mod = nn.Sequential(getattr(c, name)) if name == "emb" else getattr(c, name)
        path = to_onnx(mod, args, tmp_path / f"{name}.onnx", opset_version=opset)
        got = run_onnx(path, *args)[0]
        assert torch.allclose(got, mod(*args), atol=1e-5), name
        assert torch.allclose(got, _float_out(m, name, *args), atol=0.02 if bits == 8 else 0.2), name


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.bag, self.lin = nn.Embedding(16, 8, padding_idx=0), nn.EmbeddingBag(16, 8, mode="sum"), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(x) + self.bag(x)[:, None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tables_of_a_half_model_return_its_dtype(dtype):
    """Defect: the quantized tables of a bf16 / fp16 model returned float32, so the next float layer raised
    "mat1 and mat2 must have the same dtype" (eager, ``quantize_dynamic``, and the convert of a QAT model)."""
    torch.manual_seed(0)
    m = _Head().eval().to(dtype)
    x = torch.randint(0, 16, (3, 4))
    want = m(x)
    qc = Q.get_embedding_qconfig()
    eager = copy.deepcopy(m)
    eager.emb.qconfig = eager.bag.qconfig = qc
    qat = copy.deepcopy(m).train()
    qat.emb.qconfig = qat.bag.qconfig = Q.get_embedding_qat_qconfig()
    prepared = Q.prepare_qat(qat)
    prepared(x)
    routes = {"eager": Q.convert(Q.prepare(eager)),
              "dynamic": Q.quantize_dynamic(copy.deepcopy(m), {nn.Embedding: qc, nn.EmbeddingBag: qc}),
              "qat": Q.convert(prepared.eval())}
    for route, c in routes.items():
        assert c.emb(x).dtype == dtype and c.bag(x).dtype == dtype, route
        got = c(x)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=0.05), route
        assert c.emb.weight_scale.dtype == torch.float32, route  # the grid stays float32 (fp16 scales: another grid)
    # like the grids, the output dtype is the converted model's: casts afterwards leave it (test_hostile_s33b)
    c = routes["eager"]
    assert c.double().emb(x).dtype == dtype and "out_dtype=" in repr(c.emb)


def test_float32_tables_still_return_float32_and_state_dict_is_unchanged():
    q = Embedding.from_float(nn.Embedding(8, 4))
    assert q(torch.tensor([1])).dtype == torch.float32
    assert set(q.state_dict()) == {"weight_q", "weight_scale", "weight_zero_point"}
    assert q.half()(torch.tensor([1])).dtype == torch.float32 and "out_dtype" not in repr(q)
