"""Hostile inputs found by session 39's sweep of the session 35-38 entry points (~730 probes: quantized
ConvTranspose1d/2d/3d and BatchNorm2d/3d / BNReLU, the graph-mode share ops, ``batches.real_rows`` /
``llm.blocks.linear_rows``, ``llm.dist``, the pt2 cache helpers, the static Linear's lane, Embedding ``max_norm``,
backend pins and native switches). Each test failed before its fix: a quantized BatchNorm loading non-finite or
negative statistics (every code 0, silently), an int64 ``attention_mask`` given to ``real_rows`` (rows gathered by
number), a graph-mode ``chunk`` whose tuple is sliced (a DeQuantize on a tuple at run time), ``output_size`` of the
wrong kind (a TypeError inside torch), ``norm_type=inf`` (a valid float Embedding refused at convert)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: one thread)
from lowbit import kernels
from lowbit.batches import real_rows
from lowbit.llm.blocks import linear_rows
from lowbit.llm.dist import shard
from lowbit.nn.intrinsic import BNReLU2d as BNReLU2dFloat
from lowbit.nn.quantized import normalization as qn
from lowbit.nn.quantized.conv_transpose import ConvTranspose1d, ConvTranspose2d
from lowbit.nn.quantized.embedding import Embedding as QEmbedding
from lowbit.reference.fx import convert_to_reference_fx

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")


def _bn(cls: type, c: int = 4) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = cls(c, scale=0.05, zero_point=60)
    m.running_mean.copy_(torch.rand(c, generator=g) * 2 - 1)
    m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
    return m


def _codes(shape: tuple[int, ...]) -> Q.QTensor:
    torch.manual_seed(1)
    return Q.QTensor(torch.randint(0, 256, shape, dtype=torch.uint8), 0.03, 90, Q.quint8)


@pytest.mark.parametrize("cls", [qn.BatchNorm2d, qn.BNReLU2d, qn.BatchNorm3d, qn.BNReLU3d])
@pytest.mark.parametrize(("key", "value", "match"), [
    ("running_var", float("nan"), r"running_var: \[nan, nan, nan, nan\] must be finite and >= 0"),
    ("running_var", -1.0, r"running_var: \[-1.0, -1.0, -1.0, -1.0\] must be finite and >= 0"),
    ("running_mean", float("inf"), r"running_mean: \[inf, inf, inf, inf\] must be finite \("),
])
def test_quantized_batchnorm_refuses_bad_statistics_at_load(cls, key, value, match):
    # was: loaded, then every output code 0 (NaN rounded, clamped and cast), or the output zero point (BNReLU)
    m = _bn(cls)
    x = _codes((2, 4) + (3,) * m._spatial)
    before = m(x).int_repr().clone()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state[key] = torch.full((4,), value)
    with pytest.raises(ValueError, match=match):
        m.load_state_dict(state)
    assert torch.equal(m(x).int_repr(), before)  # nothing loaded


@pytest.mark.parametrize("relu", [False, True])
def test_quantized_batchnorm_from_float_refuses_bad_statistics(relu):
    bn = nn.BatchNorm2d(3).eval()
    bn.running_var[1] = -2.0
    bn.activation_post_process = Q.MinMaxObserver()
    bn.activation_post_process(torch.randn(8))
    src = BNReLU2dFloat(bn, nn.ReLU()) if relu else bn
    if relu:
        src.activation_post_process = bn.activation_post_process
    cls = qn.BNReLU2d if relu else qn.BatchNorm2d
    with pytest.raises(ValueError, match=rf"{cls.__name__}.from_float: running_var\[1\]=-2 \+ eps=1e-05 is not above 0"):
        cls.from_float(src)


def test_quantized_batchnorm_names_a_float_input_of_another_width_and_a_negative_width():
    m = _bn(qn.BatchNorm2d)
    # was: torch's "running_mean should contain 3 elements not 4" from F.batch_norm
    with pytest.raises(ValueError, match=r"BatchNorm2d\(4\) expects a 4-D input with 4 channels, got shape "
                                         r"\(2, 3, 5, 5\)"):
        m(torch.randn(2, 3, 5, 5))
    # was: "Trying to create tensor with negative dimension -1" from nn.BatchNorm2d's buffers
    with pytest.raises(ValueError, match="BNReLU3d: num_features=-1 must be an int >= 0"):
        qn.BNReLU3d(-1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_real_rows_takes_a_01_mask_of_any_dtype_as_the_bool_one(dtype):
    x = torch.arange(24.0).reshape(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    want = x[mask.bool()]
    # was: an integer mask indexed rows by number ((2, 3, 3, 4) gathered rows 0 / 1), a float one an IndexError
    assert torch.equal(real_rows(x, mask.to(dtype)), want)
    assert torch.equal(real_rows(x.reshape(6, 4), mask.to(dtype)), want)
    assert torch.equal(linear_rows(x, mask.to(dtype)), want)


def test_real_rows_names_a_mask_that_is_not_01():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"real_rows: mask of dtype torch.int64 holds \[2, 2, 2\]"):
        real_rows(x, torch.tensor([[2, 2, 0], [2, 0, 0]]))
    with pytest.raises(ValueError, match=r"holds \[-inf"):  # an additive mask
        real_rows(x, torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]))
    with pytest.raises(TypeError, match="real_rows: mask must be a .* tensor, got list"):  # was: AttributeError
        real_rows(x, [[1, 1, 0], [1, 0, 0]])


class _Between(nn.Module):
    def __init__(self, fn, c2in: int) -> None:
        super().__init__()
        self.c1, self.c2, self.fn = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(c2in, 4, 1), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.fn(self.c1(x)))


@pytest.mark.parametrize(("fn", "c2in"), [
    (lambda t: torch.cat(t.chunk(2, 1)[::-1], 1), 4),
    (lambda t: torch.cat(t.chunk(2, 1)[:1], 1), 2),
    (lambda t: torch.cat(torch.split(t, [1, 3], 1)[1:], 1), 3),
], ids=["chunk-reversed", "chunk-slice", "split-slice"])
def test_graph_mode_chunk_whose_tuple_is_sliced_converts(fn, c2in):
    # was: TypeError "DeQuantize expects a QTensor or a tensor, got tuple" (the chunk was shared, its slice a tuple)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = _Between(fn, c2in).eval()
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    p(x)
    ref = convert_to_reference_fx(copy.deepcopy(p))
    q = Q.convert_fx(p)
    with torch.no_grad(), kernels.use_backend("reference"):
        got, want = q(x), ref(x)
    assert torch.equal(got, want)
    assert (got - model(x)).abs().max() < 0.1


@pytest.mark.parametrize(("cls", "shape", "bad"), [
    (ConvTranspose1d, (2, 4, 5), "abc"),  # was: TypeError "'<' not supported between 'str' and 'int'" in torch
    (ConvTranspose2d, (2, 4, 5, 5), "abc"),  # was: "must have 2 or 4 elements (got 3)"
    (ConvTranspose2d, (2, 4, 5, 5), [-1, -1]),
    (ConvTranspose2d, (2, 4, 5, 5), [9.0, 9.0]),
    (ConvTranspose2d, (2, 4, 5, 5), 9),
])
def test_conv_transpose_names_a_bad_output_size(cls, shape, bad):
    m = cls(4, 6, 3, stride=2, padding=1, output_padding=1)
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}: output_size={bad!r} must be a list of")):
        m(_codes(shape), output_size=bad)
    x = _codes(shape[1:])  # unbatched: the output size may name the channels
    assert m(x, output_size=[6, 9, 9][: len(shape) - 1]).shape == (6, 9, 9)[: len(shape) - 1]


def test_embedding_max_norm_with_the_infinity_norm_converts():
    # was: ValueError "norm_type=inf must be a finite number > 0" for a float Embedding torch runs
    torch.manual_seed(0)
    f = nn.Embedding(10, 4, max_norm=1.0, norm_type=float("inf"))
    with torch.no_grad():
        f.weight.mul_(5)
    f.qconfig = Q.get_embedding_qconfig()
    q = QEmbedding.from_float(f)
    idx = torch.tensor([1, 2, 7])
    got = q(idx)
    table = copy.deepcopy(f)
    with torch.no_grad():
        table.weight.copy_(q.weight().dequantize())
    assert torch.allclose(got, table(idx), atol=1e-6)
    assert float(got.abs().amax(1).max()) <= 1.0 + 1e-6
    with pytest.raises(ValueError, match="norm_type=-inf must be a number > 0"):
        QEmbedding(4, 3, max_norm=1.0, norm_type=float("-inf"))


def test_shard_refuses_a_bool_rank():
    with pytest.raises(ValueError, match=r"rank=True must be in \[0, world=2\)"):  # was: read as rank 1
        shard([1, 2, 3], True, 2)

