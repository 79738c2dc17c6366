"""Eager workflows end to end: prepare / calibrate / convert, parity with torch.ao, reports, state_dict, dynamic."""

import copy
import warnings

import pytest
import torch
import torch.ao.nn.quantized as tnnq
import torch.ao.quantization as tq
from torch import nn

import lowbit.nn.quantized.dynamic as nnqd
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fuse import fuse_modules
from lowbit.mappings import get_default_static_quant_module_mappings
from lowbit.nn.quantized.conv import Conv2d as QConv2d
from lowbit.nn.quantized.conv import ConvReLU2d as QConvReLU2d
from lowbit.nn.quantized.functional_modules import FloatFunctional, QFunctional
from lowbit.nn.quantized.linear import Linear as QLinear
from lowbit.nn.quantized.stubs import DeQuantize, Quantize
from lowbit.qconfig import QConfigMapping, get_default_qconfig, get_dynamic_qconfig, get_minmax_qconfig
from lowbit.qscheme import qint8
from lowbit.qtensor import QTensor
from lowbit.workflow import convert, prepare, propagate_qconfig_, quantize_dynamic
from lowbit.stubs import DeQuantStub, QuantStub, QuantWrapper


FUSE = [["conv1", "bn1", "relu1"], ["conv2", "bn2"]]


class SmallCNN(nn.Module):
    """conv-bn-relu → conv-bn → residual add_relu (FloatFunctional) → maxpool → linear.

    ``torch_ao=True`` builds the same network with torch.ao's stubs and FloatFunctional.
    """

    def __init__(self, torch_ao: bool = False):
        super().__init__()
        self.quant = tq.QuantStub() if torch_ao else QuantStub()
        self.dequant = tq.DeQuantStub() if torch_ao else DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        # torch.ao cannot convert padding="same" (conv2d_prepack wants ints): equal to padding=1 here
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1 if torch_ao else "same"), nn.BatchNorm2d(8)
        self.skip = tnnq.FloatFunctional() if torch_ao else FloatFunctional()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.skip.add_relu(x, self.bn2(self.conv2(x)))
        return self.dequant(self.fc(self.pool(x).flatten(1)))


def _float_model(torch_ao=False):
    torch.manual_seed(0)
    m = SmallCNN(torch_ao)
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
    return fuse_modules(m.eval(), FUSE) if not torch_ao else tq.fuse_modules(m.eval(), FUSE)


def _data(n, seed):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def calibrated():
    prepared = prepare(_float_model(), get_minmax_qconfig())
    with torch.no_grad():
        for i in range(4):
            prepared(_data(32, i))
    return prepared


def test_prepare_places_observers_on_quantizable_outputs(calibrated):
    observed = {n for n, m in calibrated.named_modules() if hasattr(m, "activation_post_process")
                and not isinstance(m.activation_post_process, nn.Identity)}
    assert observed == {"quant", "conv1", "conv2", "skip", "fc"}  # not conv1.0 (fused child), not dequant
    # the fused marker runs only (conv, relu): its observers are not run as Sequential members
    assert not calibrated.conv1.input_activation_post_process.is_calibrated
    assert not calibrated.training
    x = _data(8, 9)
    torch.testing.assert_close(calibrated(x), _float_model()(x))  # observers are the identity


def test_qconfig_sources_agree():
    def observed(m):
        return sorted(n for n, mod in m.named_modules() if "activation_post_process" in mod._modules
                      and not isinstance(mod.activation_post_process, nn.Identity))

    m = _float_model()
    m.qconfig = get_minmax_qconfig()  # torch.ao style: attribute on the root, propagated to children
    by_attr = prepare(m)
    assert type(by_attr.conv1.activation_post_process).__name__ == "MinMaxObserver"
    by_default = prepare(_float_model())  # nothing set: the default recipe (histogram)
    assert type(by_default.fc.activation_post_process).__name__ == "HistogramObserver"
    excl = prepare(_float_model(), QConfigMapping().set_global(get_minmax_qconfig()).set_module_name("fc", None))
    assert observed(by_attr) == observed(by_default) == sorted(observed(excl) + ["fc"])
    sub = _float_model()
    sub.conv2.qconfig = None  # an attribute wins over the mapping
    assert "conv2" not in observed(prepare(sub, get_minmax_qconfig()))


def test_convert_end_to_end_runs_int8(calibrated):
    q, report = convert(calibrated, return_report=True)
    assert [type(q.quant), type(q.conv1), type(q.conv2), type(q.skip), type(q.fc), type(q.dequant)] == [
        Quantize, QConvReLU2d, QConv2d, QFunctional, QLinear, DeQuantize]
    assert q.conv2.padding_str == "same"
    assert q.conv1.input_grid is None  # its input comes from the QuantStub: already a QTensor
    assert report.left_float == {} and "conv1" in report.converted
    assert not any("activation_post_process" in m._modules for m in q.modules())
    assert not any(m._forward_hooks for m in q.modules())
    seen = {}
    for name in ("conv1", "conv2", "pool", "fc"):
        getattr(q, name).register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, o))
    x = _data(64, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float fallback anywhere inside the int8 region
        y = q(x)
    assert all(isinstance(seen[n], QTensor) for n in seen)
    ref = _float_model()(x)
    assert (y - ref).norm() / ref.norm() < 0.05
    assert type(calibrated.conv1) is not QConvReLU2d  # not inplace


def _torch_ao_convert(calib_batches, engine):
    # Without reduce_range, measured on this model (lowbit's int8 outputs match its float
    # reference exactly): x86/fbgemm saturate u8*s8 pair sums in int16 (conv codes off by up to
    # 94 on 2.4 %; 96.6 % top-1 agreement), onednn's linear is off by up to 26 codes on 10 % of
    # outputs (99.2 %), qnnpack differs from lowbit by at most 1 code (requantize rounding; 100 %).
    engine, torch.backends.quantized.engine = torch.backends.quantized.engine, engine
    try:
        return _torch_ao_prepare_convert(calib_batches)
    finally:
        torch.backends.quantized.engine = engine


def _torch_ao_prepare_convert(calib_batches):
    m = _float_model(torch_ao=True)
    m.qconfig = tq.QConfig(
        activation=tq.MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False),
        weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = tq.prepare(m)
        with torch.no_grad():
            for x in calib_batches:
                p(x)
        return p, tq.convert(copy.deepcopy(p))


@pytest.mark.parametrize("engine", ["onednn", "qnnpack"])
def test_parity_with_torch_ao(calibrated, engine):
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"torch.ao engine {engine} not built")
    tp, tqm = _torch_ao_convert([_data(32, i) for i in range(4)], engine)
    names = ["quant", "conv1", "conv2", "skip", "fc"]
    for name in names:
        s, z = calibrated.get_submodule(name).activation_post_process.calculate_qparams()
        ts, tz = tp.get_submodule(name).activation_post_process.calculate_qparams()
        torch.testing.assert_close(s.reshape(()), ts.reshape(()), rtol=1e-6, atol=0, msg=name)
        assert int(z) == int(tz), name
    x = _data(1000, 123)
    ours, theirs = convert(calibrated)(x), tqm(x)
    assert (ours.argmax(1) == theirs.argmax(1)).float().mean() >= 0.99
    if engine == "qnnpack":  # the exact engine: every logit within a few output quanta
        assert (ours - theirs).abs().max() < 3 * float(calibrated.fc.activation_post_process.calculate_qparams()[0])


def test_uncalibrated_convert_names_module():
    p = prepare(_float_model(), get_minmax_qconfig())
    with pytest.raises(RuntimeError, match=r"module 'quant' \(QuantStub\).*saw no data"):
        convert(p)


class WithExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.norm, self.act, self.fc2 = nn.Linear(6, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3)

    def forward(self, x):
        return self.dequant(self.fc2(self.act(self.norm(self.fc1(self.quant(x))))))


def test_unknown_modules_listed_in_report_and_custom_mapping():
    p = prepare(WithExtras(), get_minmax_qconfig())
    p(torch.randn(16, 6))
    with pytest.warns(UserWarning, match="no integer implementation"):
        q, report = convert(p, return_report=True)
        q(torch.randn(4, 6))
    assert set(report.left_float) == {"norm", "act"} and "LayerNorm" in report.left_float["norm"]
    assert "left float" in str(report)
    assert type(q.norm) is nn.LayerNorm and not hasattr(q.norm, "qconfig")

    class QGELU(nn.Module):  # a user's quantized op: plugged in through the mapping
        @classmethod
        def from_float(cls, mod):
            out = cls()
            out.grid = mod.activation_post_process.calculate_qparams()
            return out

    mapping = get_default_static_quant_module_mappings()
    mapping[nn.GELU] = QGELU
    assert nn.GELU not in get_default_static_quant_module_mappings()  # a copy
    p = prepare(WithExtras(), get_minmax_qconfig(), mapping=mapping)
    p(torch.randn(16, 6))
    q, report = convert(p, mapping=mapping, return_report=True)
    assert type(q.act) is QGELU and set(report.left_float) == {"norm"}


def test_state_dict_round_trip_bit_exact(calibrated, tmp_path):
    q = convert(calibrated)
    twin = prepare(_float_model(), get_minmax_qconfig())
    twin(_data(16, 42) * 3)  # different calibration: different grids until loaded
    twin = convert(twin)
    path = tmp_path / "q.pt"
    torch.save(q.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    twin.load_state_dict(sd)
    x = _data(32, 5)
    assert torch.equal(twin(x), q(x))
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in q.state_dict().items())


def test_inplace_semantics_and_root_swap():
    m = _float_model()
    p = prepare(m, get_minmax_qconfig())
    assert p is not m and not any("activation_post_process" in x._modules for x in (m.conv1, m.fc))
    p = prepare(m, get_minmax_qconfig(), inplace=True)
    assert p is m and hasattr(m.conv1, "activation_post_process")
    p(_data(8, 0))
    q = convert(p, inplace=True)
    assert q is m and type(m.conv1) is QConvReLU2d
    lin = nn.Linear(4, 4)
    pl = prepare(lin, get_minmax_qconfig())
    pl(torch.randn(8, 4))
    assert type(convert(pl)) is QLinear  # the root itself is swapped


def test_quant_wrapper_and_propagation():
    w = QuantWrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    p = prepare(w, get_default_qconfig())
    p(torch.randn(32, 4))
    q = convert(p)
    assert [type(q.quant), type(q.module[0]), type(q.dequant)] == [Quantize, QLinear, DeQuantize]
    assert q(torch.randn(2, 4)).dtype == torch.float32
    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    propagate_qconfig_(m, QConfigMapping().set_global(get_minmax_qconfig()).set_module_name("1", None))
    assert m[0].qconfig is not None and m[1][0].qconfig is None


def test_bad_arguments():
    m = _float_model()
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        prepare("net")
    with pytest.raises(TypeError, match="qconfig=.*must be None, a QConfig"):
        prepare(m, qconfig="fbgemm")
    with pytest.raises(TypeError, match="inplace must be a bool"):
        convert(m, inplace="yes")
    with pytest.raises(TypeError, match="mapping"):
        convert(m, mapping={nn.Linear: object})
    with pytest.raises(TypeError, match="return_report"):
        convert(m, return_report=1)
    m.fc.qconfig = "x"
    with pytest.raises(TypeError, match="module 'fc'"):
        prepare(m)
    with pytest.warns(UserWarning, match="no prepared module"):
        convert(nn.Sequential(nn.Linear(2, 2)))
    with pytest.warns(UserWarning, match="no quantizable module"):
        prepare(nn.Sequential(nn.ReLU(), nn.LayerNorm(2)))


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.rnn = nn.LSTM(16, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x, _ = self.rnn(self.enc(x))
        x, _ = self.gru(x)
        return self.head(x)


def test_quantize_dynamic_specs():
    torch.manual_seed(0)
    m, x = Seq().eval(), torch.randn(2, 5, 8)
    q = quantize_dynamic(m)
    assert [type(q.enc[0]), type(q.rnn), type(q.gru), type(q.head)] == [nnqd.Linear, nnqd.LSTM, nnqd.GRU, nnqd.Linear]
    assert type(m.head) is nn.Linear  # not inplace
    assert (q(x) - m(x)).norm() / m(x).norm() < 0.05
    only_linear = quantize_dynamic(m, {nn.Linear})
    assert type(only_linear.rnn) is nn.LSTM and type(only_linear.head) is nnqd.Linear
    by_name = quantize_dynamic(m, {"enc": qint8, nn.LSTM: torch.float16, "head": None})
    assert type(by_name.enc[0]) is nnqd.Linear and type(by_name.head) is nn.Linear and type(by_name.gru) is nn.GRU
    assert type(by_name.rnn) is nnqd.LSTM
    by_qconfig = quantize_dynamic(m, {nn.Linear: get_dynamic_qconfig(), "head": torch.float16})
    assert by_qconfig.enc[0].weight().qdtype == qint8 and by_qconfig.head.weight_fp16.dtype == torch.float16
    f16 = quantize_dynamic(m, dtype=torch.float16)
    assert (f16(x) - m(x)).abs().max() < 1e-2
    assert type(quantize_dynamic(nn.LSTM(4, 4))) is nnqd.LSTM  # bare root
    assert quantize_dynamic(m, inplace=True) is m and type(m.head) is nnqd.Linear
    with pytest.raises(ValueError, match="dtype="):
        quantize_dynamic(Seq(), dtype="quint4")
    with pytest.raises(TypeError, match="qconfig_spec"):
        quantize_dynamic(Seq(), qconfig_spec="Linear")
    with pytest.warns(UserWarning, match="no module of a targeted type"):
        quantize_dynamic(nn.Sequential(nn.ReLU()))


class Breadth(nn.Module):
    """Embeddings (float out), activations and a ConvTranspose between stubs: every static mapping family."""

    def __init__(self):
        super().__init__()
        self.emb, self.bag = nn.Embedding(20, 8), nn.EmbeddingBag(20, 8, mode="mean")
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc = nn.Linear(8, 8)
        self.acts = nn.Sequential(nn.Sigmoid(), nn.Tanh(), nn.Hardswish(), nn.Hardsigmoid(), nn.ELU(),
                                  nn.LeakyReLU(0.2), nn.ReLU6())
        self.ct = nn.ConvTranspose1d(8, 4, 3, stride=2, output_padding=1)

    def forward(self, idx):
        x = self.emb(idx) + self.bag(idx)[:, None]  # (B, T, 8) float
        x = self.acts(self.fc(self.quant(x)))
        return self.dequant(self.ct(x.permute(0, 2, 1)))


def test_every_static_family_converts():
    torch.manual_seed(0)
    m, idx = Breadth().eval(), torch.randint(0, 20, (4, 6))
    p = prepare(m, get_minmax_qconfig())
    assert not hasattr(p.emb, "activation_post_process")  # float output: no observer
    p(idx)
    q, report = convert(p, return_report=True)
    assert report.left_float == {} and len(report.converted) == 13
    assert all(type(a).__module__.startswith("lowbit.nn.quantized") for a in [q.emb, q.bag, q.ct, *q.acts])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = q(idx)
    assert (out - m(idx)).abs().max() < 0.05 * m(idx).abs().max()


def test_float_inputs_get_a_calibrated_grid():
    """A layer fed by a float op (or a model without QuantStub) records its input grid at calibration."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)).eval()
    p = prepare(m, get_minmax_qconfig())
    x = torch.randn(64, 6)
    p(x)
    assert p[2].input_activation_post_process.is_calibrated is False  # fed by ReLU of an observed output
    q, report = convert(p, return_report=True)
    assert set(report.left_float) == {"3"}
    lo, hi = x.min().item(), x.max().item()
    scale, zp, _ = q[0].input_grid
    assert abs(scale - (hi - lo) / 255) < 1e-6 and q[2].input_grid is None and q[4].input_grid is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LayerNorm runs float on dequantized values, by design
        y, y1 = q(x).dequantize(), q(x[:1]).dequantize()
    torch.testing.assert_close(y[:1], y1, rtol=0, atol=0)  # a fixed grid: batch-independent outputs
    assert (y - m(x)).norm() / m(x).norm() < 0.05
    assert q[0].input_grid is not None and not any(
        "input_activation_post_process" in mod._modules or mod._forward_pre_hooks for mod in q.modules())


def _pool_head(quant: type = QuantStub, dequant: type = DeQuantStub) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(quant(), nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10), dequant()).eval()


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def test_global_average_pool_is_requantized_on_the_next_layers_calibrated_grid():
    """conv -> global average -> Linear: lowbit averages in float and the Linear quantizes on the grid it
    calibrated on the averages; torch.ao keeps the conv's (much wider) grid through the pool."""
    m = _pool_head()
    x = torch.randn(64, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    ref = m(x).detach()
    prepared = prepare(m, get_minmax_qconfig())
    prepared(x)
    qm, report = convert(prepared, return_report=True)
    assert "3" not in report.left_float and isinstance(qm[5], QLinear) and qm[5].input_grid is not None
    assert qm[5].input_grid[0] < qm[1].scale / 4  # the averages' grid is much finer than the conv output's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran on dequantized values" warning: averaging in float is the design
        out = qm(x)
    ao = _pool_head(tq.QuantStub, tq.DeQuantStub)
    ao.qconfig = tq.QConfig(activation=tq.MinMaxObserver.with_args(dtype=torch.quint8),
                            weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with _engine("onednn"):
        ao_prepared = tq.prepare(ao)
        ao_prepared(x)
        ao_out = tq.convert(ao_prepared)(x)
    assert _sqnr(ref, out) > _sqnr(ref, ao_out) + 6  # > 4x lower error power than keeping the conv's grid
    # a QTensor given to the pool directly still averages in integer, on its own grid (torch's quantized op)
    q = torch.quantize_per_tensor(torch.rand(2, 3, 4, 4), 0.05, 3, torch.quint8)
    from lowbit.qtensor import quantize_per_tensor
    lq = nn.AdaptiveAvgPool2d(1)(quantize_per_tensor(q.dequantize(), 0.05, 3, "quint8"))
    assert isinstance(lq, QTensor) and lq.q_scale() == pytest.approx(0.05) and lq.q_zero_point() == 3
    assert (lq.int_repr().int() - nn.AdaptiveAvgPool2d(1)(q).int_repr().int()).abs().max() <= 1  # torch rounds ties up


class _engine:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.old = torch.backends.quantized.engine
        torch.backends.quantized.engine = self.name

    def __exit__(self, *exc: object) -> None:
        torch.backends.quantized.engine = self.old


def test_torch_ao_positional_orders_keep_working() -> None:
    """torch.ao: prepare(model, inplace) and prepare_qat(model, mapping) — positional, as migrated scripts call them."""
    import lowbit as Q
    import lowbit.nn.qat as nnqat

    model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), Q.DeQuantStub()).eval()
    model.qconfig = Q.get_default_qconfig()
    same = Q.prepare(model, True)
    assert same is model and hasattr(model[1], "activation_post_process")

    qat_model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.Conv2d(1, 1, 1), Q.DeQuantStub()).train()
    qat_model.qconfig = Q.get_default_qat_qconfig()
    only_linear = Q.prepare_qat(qat_model, {nn.Linear: nnqat.Linear})
    assert isinstance(only_linear[1], nnqat.Linear) and type(only_linear[2]) is nn.Conv2d
