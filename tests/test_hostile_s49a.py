"""Session 49 (review49a): hostile inputs on accuracy recovery, QAT and the LLM paths. Each group failed before its fix:

- a float64 model (graph and eager mode) returned float32 from its int8 region, and a float64 op after it (a
  ``LayerNorm``) failed deep with "mixed dtype (CPU)"; now ``DeQuantize`` returns the dtype the region was entered
  with (convert reads it from the float model's parameters: ``stubs.region_dtype``), as the float model does; the
  reference graph's Linear failed ("mat1 and mat2 must have the same dtype"): its grids are float64 for such a model;
- ``best_of_ranges`` on a calibration batch holding NaN/Inf failed deep in the histogram observer ("has not observed
  any finite data"); now a ``ValueError`` naming the batch, as ``quantize_ptq`` does;
- ``lowbit.llm`` (``quantize_llm``, ``quantize_w8a8``) on a model whose ``forward`` takes no ``use_cache`` raised
  torch's "forward() got an unexpected keyword argument 'use_cache'" from inside the capture; now the keyword goes
  only to a forward that takes it;
- ``reconstruct`` on a float or converted model and ``refine_grids`` on a converted one returned ``[]`` (nothing
  rounded or searched, no word); now a ``TypeError`` saying a calibrated prepared model is needed;
- torch.ao's ``QConfigMapping`` given as lowbit's: the error opened with its repr (dozens of lines); now one line.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import LnAfter, one_thread  # noqa: F401  (one_thread: autouse fixture, this module runs on 1 thread)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


_X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


class _Eager(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.fc, self.dq, self.ln = Q.QuantStub(), nn.Linear(8, 8), Q.DeQuantStub(), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.dq(self.fc(self.q(x))))


def _float64(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls().double().eval()


def test_float64_graph_model_returns_float64_through_a_float_op() -> None:
    m = _float64(LnAfter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(_X,))
        p(_X)
        q = Q.convert_fx(p)
    out = q(_X)  # (was: RuntimeError "mixed dtype (CPU)" in the float64 LayerNorm)
    assert out.dtype == torch.float64
    assert _sqnr(m(_X), out) > 30
    for again in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert torch.equal(again(_X), out)


def test_float64_reference_graph_and_fuse_dequantize() -> None:
    """The reference graph's dequantize gives float64 too (its Linear failed: "mat1 and mat2 must have the same
    dtype"); ``fuse_dequantize`` leaves a float64 model's Linears (their float output would be float32)."""
    m = _float64(LnAfter)
    p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(_X,))
    p(_X)
    ref = Q.convert_to_reference_fx(copy.deepcopy(p))
    out = ref(_X)
    assert out.dtype == torch.float64 and _sqnr(m(_X), out) > 30
    lowered = Q.lower_reference(ref)
    assert lowered(_X).dtype == torch.float64
    q = Q.convert_fx(p)
    assert Q.fuse_dequantize(q) == []
    assert q(_X).dtype == torch.float64


def test_float64_eager_model_returns_float64_through_a_float_op() -> None:
    m = _float64(_Eager)
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(_X)
    q = Q.convert(p)
    out = q(_X)
    assert out.dtype == torch.float64
    assert _sqnr(m(_X), out) > 30


def test_float32_models_keep_float32_dequantize() -> None:
    """Pin (right before): a float32 model's DeQuantize gets no dtype; an explicit one is checked."""
    torch.manual_seed(0)
    m = LnAfter().eval()
    x = _X.float()
    p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    p(x)
    q = Q.convert_fx(p)
    assert q.dequantize.out_dtype is None and q(x).dtype == torch.float32
    from lowbit.nn.quantized.stubs import DeQuantize

    with pytest.raises(TypeError, match="float16"):
        DeQuantize(torch.float16)


def test_best_of_ranges_names_a_nan_batch() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    bad = torch.randn(8, 16)
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"best_of_ranges: calib batch 1 holds 1 NaN/Inf"):
        Q.best_of_ranges(m, [torch.randn(8, 16), bad], progress=False)


class _Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.q_proj, self.up_proj, self.down_proj = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, 32), \
            nn.Linear(32, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.q_proj(self.ln(x))
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class _NoCacheLM(nn.Module):
    """A decoder of one's own whose forward takes the token ids only (no ``use_cache``, no ``**kwargs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.layers = nn.Embedding(32, 16), nn.ModuleList([_Block(), _Block()])
        self.norm, self.lm_head = nn.LayerNorm(16), nn.Linear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize("how", ["gptq", "w8a8"])
def test_llm_forward_without_use_cache(how: str) -> None:
    torch.manual_seed(0)
    m = _NoCacheLM().eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 32, (2, 12), generator=g) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = (Q.quantize_llm(m, calib, bits=8, group_size=16, progress=False) if how == "gptq"
             else Q.quantize_w8a8(m, calib))
    t = torch.randint(0, 32, (2, 12), generator=g)
    with torch.no_grad():
        assert _sqnr(m(t), q(t)) > 20


@pytest.mark.parametrize("which", ["float", "converted"])
def test_reconstruct_refuses_a_model_without_observers(which: str) -> None:
    """``reconstruct`` on a float or converted model, ``refine_grids`` on a converted one, returned ``[]`` (nothing
    rounded or searched, no word)."""
    from lowbit.algorithms import reconstruct

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(8, 16)
    if which == "converted":
        p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(x,))
        p(x)
        m = Q.convert_fx(p)
    with pytest.raises(TypeError, match=r"reconstruct: needs a calibrated prepared model .* with no observer"):
        reconstruct(m, [x], iters=2, progress=False)
    if which == "converted":  # refine_grids took it too: []
        from lowbit.algorithms.grid_search import refine_grids

        with pytest.raises(TypeError, match=r"refine_grids: .* got a converted one"):
            refine_grids(m, [x], progress=False)


def test_a_torch_ao_qconfig_mapping_is_named_in_one_line() -> None:
    """torch.ao's QConfigMapping as ``qconfig_mapping``: the error was its repr (dozens of lines) before the reason."""
    tq = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = tq.get_default_qconfig_mapping()
    with pytest.raises(TypeError, match=r"^qconfig is torch.ao's QConfigMapping; lowbit takes its own") as e:
        Q.quantize_ptq(m, [torch.randn(8, 16)], "default", qconfig_mapping=ao, progress=False)
    assert "\n" not in str(e.value)
