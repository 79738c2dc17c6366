"""Session 36: lowbit.nn.quantized module families against torch.ao (and the float modules) as the oracle.

Each defect test failed before its fix; the parity tests pin what the sweep found matching.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import lowbit as Q
from lowbit import kernels
import lowbit.nn.quantized as nnq
import lowbit.nn.quantized.dynamic as nnqd
from lowbit.observer.minmax import MinMaxObserver, PerChannelMinMaxObserver
from lowbit.qconfig import QConfig

torch.set_num_threads(1)
QC = QConfig(activation=MinMaxObserver.with_args(), weight=PerChannelMinMaxObserver.with_args(ch_axis=0))
QC_T = QConfig(activation=MinMaxObserver.with_args(),
               weight=MinMaxObserver.with_args(qdtype=Q.qint8, qscheme=Q.per_tensor_symmetric))


def prepared(mod: nn.Module, qconfig: QConfig, x: torch.Tensor) -> nn.Module:
    mod.qconfig = qconfig
    mod.activation_post_process = qconfig.activation()
    with torch.no_grad():
        mod.activation_post_process(mod(x))
    return mod


def quant_in(x: torch.Tensor) -> Q.QTensor:
    lo, hi = x.aminmax()
    s, z = Q.calculate_qparams(lo, hi, Q.per_tensor_affine, Q.quint8)
    return Q.quantize_per_tensor(x, s, z, Q.quint8)


def to_torch(qx: Q.QTensor) -> torch.Tensor:
    return torch.quantize_per_tensor(qx.dequantize(), float(qx.scale), int(qx.zero_point), torch.quint8)


# ---------------------------------------------------------------- InstanceNorm: unbatched inputs, rank, channels

@pytest.mark.parametrize("cls,fcls,shape", [
    (nnq.InstanceNorm1d, nn.InstanceNorm1d, (4, 10)),
    (nnq.InstanceNorm2d, nn.InstanceNorm2d, (4, 5, 6)),
    (nnq.InstanceNorm3d, nn.InstanceNorm3d, (3, 4, 5, 2)),
])
@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_unbatched_matches_float(cls, fcls, shape, affine) -> None:
    """An unbatched (C, *spatial) input is one sample, as nn.InstanceNorm*d takes it (2d/3d normalized the wrong
    axes silently: C read as the batch; 1d raised 'Expected more than 1 spatial element')."""
    torch.manual_seed(0)
    c = shape[0]
    w, b = (torch.rand(c) + 0.5, torch.randn(c)) if affine else (None, None)
    q = cls(c, w, b, 0.02, 128, affine=affine)
    f = fcls(c, affine=affine).eval()
    if affine:
        with torch.no_grad():
            f.weight.copy_(w)
            f.bias.copy_(b)
    x = torch.randn(*shape) * 3
    qx = quant_in(x)
    want = Q.quantize_per_tensor(f(qx.dequantize()), 0.02, 128, Q.quint8)
    got = q(qx)
    assert got.shape == want.shape
    assert int((got.int_repr().int() - want.int_repr().int()).abs().max()) <= 1
    # the batched form of the same sample gives the same codes
    assert torch.equal(q(quant_in(x).reshape(1, *shape)).int_repr()[0], got.int_repr())


def test_instance_norm_batched_parity_with_torch_ao() -> None:
    torch.manual_seed(1)
    w, b = torch.rand(6) + 0.5, torch.randn(6)
    q = nnq.InstanceNorm2d(6, w, b, 0.03, 100, affine=True)
    ao = torch.ao.nn.quantized.InstanceNorm2d(6, nn.Parameter(w.clone()), nn.Parameter(b.clone()), 0.03, 100,
                                             affine=True)
    qx = quant_in(torch.randn(2, 6, 5, 5) * 2)
    assert torch.equal(q(qx).int_repr(), ao(to_torch(qx)).int_repr())


def test_instance_norm_rank_and_channels_named() -> None:
    q2 = nnq.InstanceNorm2d(4, None, None, 0.03, 100)
    with pytest.raises(ValueError, match=r"InstanceNorm2d.*\(2, 4, 5, 6, 7\)"):
        q2(torch.randn(2, 4, 5, 6, 7))  # a 5-D input was normalized silently (nn.InstanceNorm2d refuses it)
    with pytest.raises(ValueError, match=r"InstanceNorm2d.*\(5,\)"):
        q2(torch.randn(5))
    qa = nnq.InstanceNorm1d(4, torch.ones(4), torch.zeros(4), 0.03, 100, affine=True)
    with pytest.raises(ValueError, match=r"InstanceNorm1d.*5 channels.*num_features=4"):
        qa(torch.randn(2, 5, 10))  # was torch's "weight should contain 10 elements not 8"


# ---------------------------------------------------------------- NaN float inputs become no codes

@pytest.mark.parametrize("make", [
    lambda: nnq.LayerNorm(3, torch.ones(3), torch.zeros(3), 0.03, 100),
    lambda: nnq.GroupNorm(1, 5, torch.ones(5), torch.zeros(5), 0.03, 100),
    lambda: nnq.InstanceNorm1d(5, None, None, 0.03, 100),
    lambda: nnq.Hardswish(0.03, 10),
    lambda: nnq.ELU(0.03, 100),
    lambda: nnq.LeakyReLU(0.03, 100),
    lambda: nnq.Sigmoid(),
    lambda: nnq.ReLU6(),
], ids=["layernorm", "groupnorm", "instancenorm", "hardswish", "elu", "leakyrelu", "sigmoid", "relu6"])
def test_nan_float_input_refused(make) -> None:
    """A float input holding NaN was quantized to finite codes (quant_max); the other quantized layers refuse it."""
    m = make()
    x = torch.randn(2, 5, 3)
    x[1, 2, 0] = float("nan")
    with pytest.raises(RuntimeError, match=type(m).__name__ + r".*NaN"):
        m(x)
    m(torch.randn(2, 5, 3))  # finite float input still works


# ---------------------------------------------------------------- dynamic RNNs: integer states and packed data

@pytest.mark.parametrize("cls,fcls", [(nnqd.LSTM, nn.LSTM), (nnqd.GRU, nn.GRU), (nnqd.RNN, nn.RNN)])
def test_rnn_integer_state_refused(cls, fcls) -> None:
    """An integer / bool hx was cast to float silently (torch's RNNs and lowbit's cells refuse it)."""
    q = cls.from_float(fcls(5, 7, num_layers=2))
    x = torch.randn(3, 4, 5)
    h = torch.ones(2, 4, 7, dtype=torch.long)
    hx = (h, torch.zeros(2, 4, 7)) if cls is nnqd.LSTM else h
    with pytest.raises(TypeError, match=rf"dynamic {cls.__name__}.*hidden state.*torch.int64"):
        q(x, hx)
    good = (h.float(), torch.zeros(2, 4, 7)) if cls is nnqd.LSTM else h.float()
    y, _ = q(x, good)
    assert y.shape == (3, 4, 7)


def test_rnn_packed_integer_data_refused() -> None:
    q = nnqd.LSTM.from_float(nn.LSTM(2, 3))
    pk = pack_padded_sequence(torch.arange(24).reshape(3, 4, 2), torch.tensor([3, 2, 1, 1]))
    with pytest.raises(TypeError, match=r"dynamic LSTM.*PackedSequence.*torch.int64"):
        q(pk)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_packed_with_initial_state_matches_float(batch_first, bidirectional) -> None:
    torch.manual_seed(2)
    f = nn.LSTM(5, 7, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
    q = nnqd.LSTM.from_float(f)
    dirs = 2 if bidirectional else 1
    x = torch.randn(3, 4, 5)
    lens = torch.tensor([4, 2, 3]) if batch_first else torch.tensor([3, 1, 2, 3])
    batch = 3 if batch_first else 4
    hx = (torch.randn(2 * dirs, batch, 7), torch.randn(2 * dirs, batch, 7))
    pk = pack_padded_sequence(x, lens, batch_first=batch_first, enforce_sorted=False)
    with torch.no_grad():
        (y, (h, c)), (yr, (hr, cr)) = q(pk, hx), f(pk, hx)
    assert torch.equal(y.batch_sizes, yr.batch_sizes)
    assert float((y.data - yr.data).abs().max()) < 0.03
    assert float((h - hr).abs().max()) < 0.03 and float((c - cr).abs().max()) < 0.05


# ---------------------------------------------------------------- ConvTranspose geometry

@pytest.mark.parametrize("kw", [dict(stride=1, output_padding=1), dict(stride=2, output_padding=2),
                                dict(stride=(2, 1), output_padding=(1, 1))])
def test_conv_transpose_output_padding_checked_at_construction(kw) -> None:
    """output_padding >= max(stride, dilation) was accepted and failed at the first forward inside the kernel."""
    with pytest.raises(ValueError, match=r"ConvTranspose2d: output_padding=.*stride="):
        nnq.ConvTranspose2d(4, 4, 3, **kw)
    nnq.ConvTranspose2d(4, 4, 3, stride=2, output_padding=1)
    nnq.ConvTranspose2d(4, 4, 3, stride=1, dilation=2, output_padding=1)  # smaller than the dilation: valid


# ---------------------------------------------------------------- parity sweep (matched before; pinned)

CASES = [
    (nnq.Linear, lambda: nn.Linear(16, 8), (5, 16), QC),
    (nnq.Conv1d, lambda: nn.Conv1d(4, 6, 3, padding=2, dilation=2, groups=2), (2, 4, 11), QC),
    (nnq.Conv2d, lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, padding_mode="reflect"), (2, 4, 9, 9), QC),
    (nnq.Conv3d, lambda: nn.Conv3d(2, 4, 3, padding=1), (1, 2, 5, 5, 5), QC),
    (nnq.ConvTranspose1d, lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1), (2, 4, 7), QC_T),
    (nnq.ConvTranspose2d, lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
     (2, 4, 5, 5), QC_T),
]


@pytest.mark.parametrize("cls,make,shape,qconfig", CASES, ids=[c[0].__name__ + str(i) for i, c in enumerate(CASES)])
def test_from_float_bit_exact_with_torch_ao(cls, make, shape, qconfig) -> None:
    import torch.ao.quantization as tq

    torch.manual_seed(3)
    f, x = make(), torch.randn(*shape)
    per_channel = qconfig is QC
    ao_w = (tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            if per_channel else tq.MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
    ao_qc = tq.QConfig(activation=tq.MinMaxObserver.with_args(dtype=torch.quint8), weight=ao_w)
    ours = cls.from_float(prepared(copy.deepcopy(f), qconfig, x))
    saved = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "x86"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ao = getattr(torch.ao.nn.quantized, cls.__name__).from_float(prepared(copy.deepcopy(f), ao_qc, x))
            qx = quant_in(x)
            ya = ao(to_torch(qx))
    finally:
        torch.backends.quantized.engine = saved
    assert torch.equal(ours.weight().int_repr(), ao.weight().int_repr())
    assert (float(ours.scale), int(ours.zero_point)) == (ao.scale, ao.zero_point)
    if kernels.onednn.has_vnni():
        assert torch.equal(ours(qx).int_repr(), ya.int_repr())
    else:  # torch.ao's fbgemm saturates u8×s8 pair sums of full-range codes without VNNI: the exact reference decides
        with kernels.use_backend("reference"):
            want = ours(qx).int_repr()
        assert torch.equal(ours(qx).int_repr(), want)


def test_conv_transpose3d_matches_float_simulation() -> None:
    """torch.ao's quantized ConvTranspose3d is off by up to 221 codes here (every engine); lowbit's is exact."""
    torch.manual_seed(1)
    f, x = nn.ConvTranspose3d(2, 4, 2, stride=2), torch.randn(1, 2, 3, 3, 3)
    q = nnq.ConvTranspose3d.from_float(prepared(f, QC_T, x))
    qx = quant_in(x)
    ref = F.conv_transpose3d(qx.dequantize(), q.weight().dequantize(), q.bias, 2)
    assert torch.equal(q(qx).int_repr(), Q.quantize_per_tensor(ref, float(q.scale), int(q.zero_point), Q.quint8).int_repr())
