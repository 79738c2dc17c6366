"""Session 44 (refuse44): under ``torch.compile(fullgraph=True)`` the refusals glue44 left raise lowbit's own error
when the compiled program runs, as eager does (``compile_state.refuse`` / ``lowbit::failed``; the embedding's id
range through ``lowbit::checked_ids``), and a good input afterwards gives eager's exact outputs.

Before (every compiled case here failed; the export ones passed): dynamo's ``Unsupported: Observed exception`` at compile
time for a ConvTranspose channel count, any wrong rank, a spatial size below a conv's kernel, dynamic Linear / WeightOnlyLinear
feature counts and dtypes, QFunctional integer operands, embedding float ids and a 3-d EmbeddingBag input; an
out-of-range embedding id gave torch's ``IndexError: index out of range in self``. ``torch.export`` still refuses while tracing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq


def _fx(m: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(m).eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        p(x)
        return Q.convert_fx(p)


_qf = nnq.QFunctional(0.1, 128)


def _q(a: torch.Tensor) -> Q.QTensor:
    return Q.quantize_per_tensor(a, 0.1, 128, Q.quint8)


class _Add(nn.Module):
    def forward(self, a, b):
        return _qf.add(_q(a), b)


class _Mul(nn.Module):
    def forward(self, a, b):
        return _qf.mul(b, _q(a))


class _AddScalar(nn.Module):
    def forward(self, a, b):
        return _qf.add_scalar(b, 1.0)


class _Cat(nn.Module):
    def forward(self, a, b):
        return _qf.cat([_q(a), b], 1)


def _models():
    torch.manual_seed(0)
    convt = _fx(nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.ReLU()), torch.randn(2, 3, 6, 6))
    conv = _fx(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 5)), torch.randn(2, 3, 8, 8))
    lin = nn.Sequential(nn.Linear(8, 4))
    return {"convt": convt, "conv": conv, "dyn": Q.quantize_dynamic(copy.deepcopy(lin)),
            "wo": Q.quantize_weight_only(copy.deepcopy(lin)),
            "emb": nnq.Embedding.from_float(nn.Embedding(10, 4)),
            "bag": nnq.EmbeddingBag.from_float(nn.EmbeddingBag(10, 4)),
            "add": _Add(), "mul": _Mul(), "add_scalar": _AddScalar(), "cat": _Cat()}


_IDS = torch.tensor([[1, 2, 3], [4, 5, 9]])
_F23 = (torch.linspace(-1, 1, 6).reshape(2, 3), torch.linspace(1, -2, 6).reshape(2, 3))
_I23 = torch.ones(2, 3, dtype=torch.long)
_CONVT = "ConvTranspose2d: expects input of shape \\(N, 3, \\*2 spatial dims\\) or unbatched, got "
_CONV = "Conv2d: expects input of shape \\(N, 3, \\*2 spatial dims\\) or unbatched, got "

# model, good input, bad input, eager's error and message (all failed before under fullgraph=True)
CASES = {
    "convT channels": ("convt", (torch.randn(2, 3, 6, 6),), (torch.randn(2, 5, 6, 6),), ValueError,
                       _CONVT + r"\(2, 5, 6, 6\)$"),
    "convT channels, unbatched": ("convt", (torch.randn(3, 6, 6),), (torch.randn(5, 6, 6),), ValueError,
                                  _CONVT + r"\(5, 6, 6\)$"),
    "convT rank": ("convt", (torch.randn(2, 3, 6, 6),), (torch.randn(1, 2, 3, 6, 6),), ValueError,
                   _CONVT + r"\(1, 2, 3, 6, 6\)$"),
    "conv rank 5": ("conv", (torch.randn(2, 3, 8, 8),), (torch.randn(1, 2, 3, 8, 8),), ValueError,
                    _CONV + r"\(1, 2, 3, 8, 8\)$"),
    "conv rank 1": ("conv", (torch.randn(2, 3, 8, 8),), (torch.randn(8),), ValueError, _CONV + r"\(8,\)$"),
    "conv spatial": ("conv", (torch.randn(2, 3, 8, 8),), (torch.randn(2, 3, 2, 8),), ValueError,
                     r"^Conv2d: input spatial size \(2, 8\) is smaller than the kernel \(3, 3\) \(dilation \(1, 1\), "
                     r"padding \(0, 0\)\) needs: at least \(3, 3\)$"),
    "dyn features": ("dyn", (torch.randn(3, 8),), (torch.randn(3, 7),), ValueError,
                     r"^dynamic Linear: input shape \(3, 7\) does not end in in_features=8$"),
    "dyn dtype": ("dyn", (torch.randn(3, 8),), (torch.ones(3, 8, dtype=torch.long),), TypeError,
                  r"^dynamic Linear expects a floating-point tensor, got dtype torch.int64$"),
    "dyn dtype and features": ("dyn", (torch.randn(3, 8),), (torch.ones(3, 7, dtype=torch.long),), TypeError,
                               r"^dynamic Linear expects a floating-point tensor, got dtype torch.int64$"),
    "wo features": ("wo", (torch.randn(3, 8),), (torch.randn(2, 3, 7),), ValueError,
                    r"^WeightOnlyLinear: input of shape \(2, 3, 7\) does not end in in_features=8$"),
    "wo dtype": ("wo", (torch.randn(3, 8),), (torch.ones(3, 8, dtype=torch.long),), TypeError,
                 r"^WeightOnlyLinear: input must be a float tensor, got torch.int64$"),
    "emb float ids": ("emb", (_IDS,), (_IDS.float(),), TypeError,
                      r"^Embedding: indices must be an integer tensor, got dtype torch.float32$"),
    "emb id too large": ("emb", (_IDS,), (_IDS + 5,), IndexError,
                         r"^Embedding: index 10 is out of range for 10 embeddings$"),
    "bag float ids": ("bag", (_IDS,), (_IDS.float(),), TypeError,
                      r"^EmbeddingBag: indices must be an integer tensor, got dtype torch.float32$"),
    "bag rank 3": ("bag", (_IDS,), (_IDS[None],), ValueError,
                   r"^EmbeddingBag: input must be 1-D \(with offsets\) or 2-D, got shape \(1, 2, 3\)$"),
    "bag negative id": ("bag", (_IDS,), (_IDS - 2,), IndexError,
                        r"^EmbeddingBag: index -1 is out of range for 10 embeddings$"),
    **{f"QFunctional.{op} int operand": (op, _F23, (_F23[0], _I23), TypeError,
                                         rf"^QFunctional.{op} expects QTensors or float tensors, got Tensor of dtype "
                                         r"torch.int64$") for op in ("add", "mul", "add_scalar", "cat")},
}


@pytest.fixture(scope="module")
def models():
    return _models()


def _same(a, b) -> bool:
    if isinstance(a, Q.QTensor):
        return isinstance(b, Q.QTensor) and torch.equal(a.int_repr(), b.int_repr()) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_compile_raises_eagers_refusal(models, case):
    name, good, bad, exc, msg = CASES[case]
    m = models[name]
    with pytest.raises(exc, match=msg):  # eager: the oracle
        m(*bad)
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, backend="eager")
    ref = m(*good)
    assert _same(cm(*good), ref)
    with pytest.raises(exc, match=msg):
        cm(*bad)
    assert _same(cm(*good), ref)  # a good input after the bad one: eager's exact outputs


@pytest.mark.parametrize("case", ["conv rank 5", "wo dtype", "emb id too large"])
def test_aot_eager_raises_eagers_refusal(models, case):
    name, good, bad, exc, msg = CASES[case]
    m = models[name]
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    with pytest.raises(exc, match=msg):
        cm(*bad)
    assert _same(cm(*good), m(*good))


def test_inductor_raises_the_first_refusal_of_a_wrong_rank(models):
    """The conv refuses a 5-d input; its stand-in result (one sample) feeds the Linear, which takes it: the program
    raises the conv's refusal (``lowbit::failed`` reads the refused input: kept, ordered)."""
    torch._dynamo.reset()
    cm = torch.compile(models["conv"], fullgraph=True)
    with pytest.raises(ValueError, match=CASES["conv rank 5"][4]):
        cm(torch.randn(1, 2, 3, 8, 8))


@pytest.mark.parametrize("case", ["convT channels", "conv spatial", "dyn features", "wo dtype", "emb float ids"])
def test_export_still_refuses_while_tracing(models, case):
    name, _, bad, exc, msg = CASES[case]
    with pytest.raises(exc, match=msg.rstrip("$")):  # (export appends the graph node it was at)
        torch.export.export(models[name], bad)


def test_export_of_an_embedding_has_no_id_check_op(models):
    """``lowbit::checked_ids`` is torch.compile's only: an exported program is as before (its index_select
    bounds-checks)."""
    ep = torch.export.export(models["emb"], (_IDS,))
    assert not any("checked_ids" in str(n.target) for n in ep.graph.nodes)
    assert torch.equal(ep.module()(_IDS), models["emb"](_IDS))
