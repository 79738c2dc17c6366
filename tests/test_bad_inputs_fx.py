"""Graph mode on the code patterns real models contain (session 24): the converted model computes what the float
model computes, or a clear message says what stays float; torch.ao is the oracle where it traces."""

from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _fx(model: nn.Module, x: torch.Tensor, example: bool = True) -> nn.Module:
    p = Q.prepare_fx(model, None, (x,) if example else None)
    p(x)
    return Q.convert_fx(p)


class _IntOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) + x
        z = torch.cat([y * 2.0, y * x], 1)
        return self.b(z[:, :8] + 1.0)


def test_converted_graphs_with_integer_ops_pickle_and_torch_load():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    p = Q.prepare_fx(_IntOps().eval(), None, (x,))
    p(x)
    for gm in (Q.convert_fx(p), Q.convert_to_reference_fx(p)):  # unpickling re-traces the code: Proxy operands;
        # (this file's `from __future__ import annotations` made `x: torch.Tensor` a string global torch.save refused)
        ref = gm(x)
        buf = io.BytesIO()
        torch.save(gm, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=False)(x), ref)
        assert torch.equal(pickle.loads(pickle.dumps(gm))(x), ref)


class _InPlace(nn.Module):
    def __init__(self, kind: int) -> None:
        super().__init__()
        self.c, self.c2, self.kind, self.r = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), kind, nn.ReLU6(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        if self.kind == 0:
            y.relu_()
        elif self.kind == 1:
            y.mul_(2.0)
        elif self.kind == 2:
            torch.relu_(y)
        elif self.kind == 3:
            F.relu(y, inplace=True)
        elif self.kind == 4:
            self.r(y)  # the result is not reassigned: the module changed y itself
        else:
            y.clamp_(0, 0.3)
        return self.c2(y)


@pytest.mark.parametrize("kind", range(6))
def test_in_place_ops_whose_result_is_not_reassigned_still_apply(kind):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    m = _InPlace(kind).eval()
    ref = m(x)
    assert _sqnr(ref, _fx(m, x)(x)) > 25  # were 2-10 dB (torch.ao too): the ReLU / scale applied to a dropped copy


@pytest.mark.parametrize("channels,shape,fused", [(8, (2, 8, 16), False), (5, (2, 5, 16), False), (8, (6, 16), True)])
def test_linear_bn1d_folds_only_on_2d_outputs(channels, shape, fused):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.bn, self.o = nn.Linear(16, 8), nn.BatchNorm1d(channels), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.bn(self.l(x)))

    torch.manual_seed(0)
    m = M().eval()
    m.bn.running_mean.uniform_(-1, 1)
    m.bn.running_var.uniform_(0.5, 2)
    m.bn.weight.data.uniform_(0.5, 2)
    x = torch.randn(*shape)
    q = _fx(m, x)
    assert _sqnr(m(x), q(x)) > 25  # 3-D: was 0.3 dB (the BN folded into the features) or "cannot fold"
    assert bool(q.lowbit_report.fused) is fused


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x)
        return y if mask is None else y * mask


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # data-dependent: the root cannot be traced
            x = self.blk(x)
        return self.blk(x, torch.sigmoid(x))


def test_a_child_called_with_and_without_an_optional_argument_is_prepared_through_its_children():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    m = _Untraceable().eval()
    with pytest.warns(UserWarning, match="called both with and without an optional argument"):
        q = _fx(m, x)  # was torch.fx's "mask has been specialized to have value None" at the first call
    assert _sqnr(m(x), q(x)) > 25


def test_an_omitted_optional_root_argument_is_traced_as_its_none_default():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.o = nn.Linear(16, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            y = self.a(x)
            if mask is not None:
                y = y.masked_fill(mask, 0.0)
            return self.o(y)

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    m = M().eval()
    assert _sqnr(m(x), _fx(m, x)(x)) > 25  # was masked_fill(None, ...) in the traced branch
    _, report = Q.quantize_ptq(m, [x], recipe="default", progress=False)
    assert report.sqnr_db > 25


def test_a_child_graph_that_never_ran_stays_float_with_a_warning():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > -1e9:
                return self.a(x)
            return self.b(x)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        q = _fx(M().eval(), torch.randn(3, 4))  # was "the observer after 'x' (x) saw no data"
    assert any("'b' never ran during calibration" in str(i.message) for i in w)
    assert q.lowbit_report.left_float == {"b": "never ran during calibration"}
    assert not any("quantized" in type(m).__module__ for m in q.b.modules())


def test_conv_transpose_output_size_and_input_keyword_calls():
    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d, self.u, self.fc = nn.Conv2d(3, 4, 3, 2, 1), nn.ConvTranspose2d(4, 3, 3, 2, 1), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(input=self.u(self.d(x), output_size=x.shape[-2:]) + x)

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    m = Up().eval()
    q = _fx(m, x)  # ran in prepare, then failed at the first call: no output_size / input= in the int8 modules
    assert q(x).shape == m(x).shape and _sqnr(m(x), q(x)) > 25
    qt = Q.quantize_per_tensor(torch.randn(2, 4, 4, 4).relu(), 0.02, 0, Q.quint8)
    with pytest.raises(ValueError, match="requested an output size of"):
        q.u(qt, output_size=(20, 20))


def test_without_example_inputs_comparisons_and_argmax_are_not_observed():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.b(self.a(x) * (x > 0))
            return y, y.argmax(-1)

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    m = Masked().eval()
    y, idx = _fx(m, x, example=False)(x)  # was "HistogramObserver observes floating-point tensors, got torch.bool"
    assert idx.dtype == torch.int64 and _sqnr(m(x)[0], y) > 20


def test_child_graphs_without_activation_observers_still_convert():
    """Weight-only (embedding) and dynamic child graphs have no activation observer: they are not 'never ran'."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Sequential(nn.Embedding(10, 4))
            self.dyn, self.fc = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.emb(idx).sum(1)
            if h.sum() > -1e9:  # the root cannot be traced: its children become graphs of their own
                h = self.dyn(h)
            return self.fc(h)

    qm = (Q.get_default_qconfig_mapping().set_object_type(nn.Embedding, Q.get_embedding_qconfig())
          .set_module_name("dyn", Q.get_dynamic_qconfig()))
    idx = torch.randint(0, 10, (2, 3))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = Q.prepare_fx(M().eval(), qm, (idx,))
        p(idx)
        c = Q.convert_fx(p)
    assert not any("never ran" in str(i.message) for i in w)
    kinds = {type(m).__module__ for part in (c.emb, c.dyn) for m in part.modules()}
    assert {"lowbit.nn.quantized.embedding", "lowbit.nn.quantized.dynamic.linear"} <= kinds


def test_unbatched_conv_transpose_takes_a_full_output_size():
    m = nn.Sequential(Q.QuantStub(), nn.ConvTranspose2d(4, 4, 3, stride=2), Q.DeQuantStub())
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(torch.randn(2, 4, 8, 8))
    c = Q.convert(p)
    assert c[1](c[0](torch.randn(4, 8, 8)), output_size=(4, 18, 18)).shape == (4, 18, 18)  # as nn.ConvTranspose2d
    assert c[1](c[0](torch.randn(1, 4, 8, 8)), output_size=(18, 18)).shape == (1, 4, 18, 18)
