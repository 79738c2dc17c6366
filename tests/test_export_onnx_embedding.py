"""ONNX export of 4-bit Embedding and of EmbeddingBag (8/4-bit rows): ORT's outputs vs lowbit's modules."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from onnx_helpers import one_thread  # noqa: E402,F401

import lowbit as Q  # noqa: E402
from lowbit.export import run_onnx, to_onnx  # noqa: E402
from lowbit.nn.quantized import Embedding, EmbeddingBag  # noqa: E402

I4, U4, I8, U8 = onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT8, onnx.TensorProto.UINT8


class Bag(nn.Module):
    """Wraps a bag so the exported graph takes (input, offsets[, per_sample_weights])."""

    def __init__(self, bag: nn.Module) -> None:
        super().__init__()
        self.bag = bag

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.bag(x, None, *rest)
        return self.bag(x, *rest)


def table_types(path) -> set[int]:
    return {t.data_type for t in onnx.load(str(path)).graph.initializer if len(t.dims) == 2}


def bags(lengths: list[int], n_rows: int, last: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D input and its offsets for bags of the given lengths (0 = an empty bag)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, n_rows, (sum(lengths),), generator=g)
    ends = torch.tensor([0, *lengths]).cumsum(0)
    return x, (ends if last else ends[:-1])


# ---- 4-bit Embedding ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [Q.quint4, Q.qint4])
@pytest.mark.parametrize("opset", [17, 21])
def test_embedding_4bit_matches_lowbit_and_is_int4_at_opset_21(tmp_path, dtype, opset):
    torch.manual_seed(0)
    emb = Embedding.from_float(nn.Embedding(40, 7), dtype=dtype)       # odd width: the packing spans rows
    path = to_onnx(nn.Sequential(emb), torch.tensor([[1, 2, 3]]), tmp_path / "e.onnx", opset_version=opset)
    idx = torch.randint(0, 40, (9, 3))
    assert torch.equal(run_onnx(path, idx)[0], emb(idx))
    signed = dtype == Q.qint4
    assert table_types(path) == ({I4 if signed else U4} if opset == 21 else {I8 if signed else U8})
    assert onnx.load(str(path)).opset_import[0].version == opset


def test_embedding_4bit_file_is_about_half_the_8bit_one(tmp_path):
    torch.manual_seed(0)
    table = nn.Embedding(1000, 64)
    idx = torch.tensor([[1, 2]])
    p8 = to_onnx(nn.Sequential(Embedding.from_float(table)), idx, tmp_path / "e8.onnx", opset_version=21)
    p4 = to_onnx(nn.Sequential(Embedding.from_float(table, dtype=Q.quint4)), idx, tmp_path / "e4.onnx",
                 opset_version=21)
    p4_17 = to_onnx(nn.Sequential(Embedding.from_float(table, dtype=Q.quint4)), idx, tmp_path / "e4_17.onnx")
    size8, size4, size4_17 = (p.stat().st_size for p in (p8, p4, p4_17))
    assert size4 < 0.6 * size8 and size4_17 >= size8          # measured: 37.0 kB vs 69.5 kB; one code per byte
    assert table_types(p8) == {U8}                             # 8-bit tables are never narrowed


# ---- EmbeddingBag ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [Q.quint8, Q.quint4])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
def test_bag_offsets_dynamic_lengths_and_empty_bags(tmp_path, dtype, mode, last):
    torch.manual_seed(1)
    bag = EmbeddingBag.from_float(nn.EmbeddingBag(30, 5, mode=mode, include_last_offset=last), dtype=dtype)
    path = to_onnx(Bag(bag), bags([2, 3], 30, last, 0), tmp_path / "bag.onnx", opset_version=18)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Loop" not in ops and "ScatterElements" in ops
    cases = [[4], [0, 3, 0, 0, 5, 1], [1] * 9, [7, 0], [0, 0]]  # [0, 0]: no index at all
    for seed, lengths in enumerate(cases):
        x, off = bags(lengths, 30, last, seed)
        torch.testing.assert_close(run_onnx(path, x, off)[0], bag(x, off), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_2d_input_and_padding_idx(tmp_path, mode):
    torch.manual_seed(2)
    bag = EmbeddingBag.from_float(nn.EmbeddingBag(20, 6, mode=mode, padding_idx=3), dtype=Q.qint4)
    path = to_onnx(Bag(bag), torch.tensor([[1, 2, 3, 4]]), tmp_path / "bag2d.onnx", opset_version=18)
    x = torch.randint(0, 20, (7, 4))
    x[0] = 3                                                   # all padding: an empty bag (0)
    x[1, :2] = 3
    torch.testing.assert_close(run_onnx(path, x)[0], bag(x), rtol=1e-5, atol=1e-6)
    assert bool((bag(x)[0] == 0).all())


def test_bag_per_sample_weights_1d_and_2d(tmp_path):
    torch.manual_seed(3)
    bag = EmbeddingBag.from_float(nn.EmbeddingBag(25, 4, mode="sum", padding_idx=0))
    x, off = bags([2, 2], 25, False, 0)
    path = to_onnx(Bag(bag), (x, off, torch.rand(4)), tmp_path / "w1.onnx")
    x, off = bags([3, 0, 1, 6], 25, False, 5)
    x[0] = 0
    w = torch.rand(x.shape[0])
    torch.testing.assert_close(run_onnx(path, x, off, w)[0], bag(x, off, w), rtol=1e-5, atol=1e-6)
    path2 = to_onnx(Bag(bag), (torch.tensor([[1, 2, 3]]), torch.rand(1, 3)), tmp_path / "w2.onnx")
    x2, w2 = torch.randint(0, 25, (5, 3)), torch.rand(5, 3)
    torch.testing.assert_close(run_onnx(path2, x2, w2)[0], bag(x2, None, w2), rtol=1e-5, atol=1e-6)


_SESSIONS: dict[str, tuple[Path, nn.Module]] = {}


def _exported(mode: str) -> tuple[Path, nn.Module]:
    """One exported 4-bit bag per mode, reused across hypothesis examples (exporting is the slow part)."""
    if mode not in _SESSIONS:
        torch.manual_seed(4)
        bag = EmbeddingBag.from_float(nn.EmbeddingBag(50, 3, mode=mode, padding_idx=7), dtype=Q.qint4)
        path = Path(tempfile.mkdtemp()) / f"{mode}.onnx"
        _SESSIONS[mode] = (to_onnx(Bag(bag), bags([1, 2], 50, False, 0), path, opset_version=18), bag)
    return _SESSIONS[mode]


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["sum", "mean", "max"]), lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_bag_matches_lowbit_on_any_bag_lengths(mode, lengths, seed):
    """Property: for any bag lengths (empty bags, padding entries included) ORT == lowbit (rtol 1e-5)."""
    path, bag = _exported(mode)
    x, off = bags(lengths, 50, False, seed)
    x[::3] = 7                                                  # padding entries
    torch.testing.assert_close(run_onnx(path, x, off)[0], bag(x, off), rtol=1e-5, atol=1e-6)


# ---- bad input ------------------------------------------------------------------------------------
def test_bag_max_needs_opset_18_and_opset_range(tmp_path):
    bag = EmbeddingBag.from_float(nn.EmbeddingBag(10, 4, mode="max"))
    with pytest.raises(ValueError, match=r"EmbeddingBag 'bag' with mode='max' needs opset_version >= 18.*=17"):
        to_onnx(Bag(bag), bags([1, 2], 10, False, 0), tmp_path / "m.onnx", opset_version=17)
    emb = Embedding.from_float(nn.Embedding(10, 4), dtype=Q.quint4)
    with pytest.raises(ValueError, match="opset_version=22"):
        to_onnx(nn.Sequential(emb), torch.tensor([[1]]), tmp_path / "e.onnx", opset_version=22)


def test_opset_21_relabel_keeps_other_layers_exact(tmp_path):
    """Opset 21 is exported at 20 and relabelled: a static int8 Linear gives the same ORT output as at 17."""
    m = nn.Sequential(Q.QuantStub(), nn.Linear(6, 3), Q.DeQuantStub()).eval()
    m.qconfig = Q.get_default_qconfig()
    m = Q.prepare(m)
    m(torch.randn(16, 6))
    m = Q.convert(m)
    x = torch.randn(5, 6)
    p17, p21 = (to_onnx(m, x[:2], tmp_path / f"l{o}.onnx", opset_version=o) for o in (17, 21))
    assert onnx.load(str(p21)).opset_import[0].version == 21
    assert torch.equal(run_onnx(p17, x)[0], run_onnx(p21, x)[0])
