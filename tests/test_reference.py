"""Reference models: the modules against torch.ao's reference modules, eager and graph-mode reference
models against the int8 models, and lowering (reference -> int8) against direct conversion."""

import io
import warnings

import pytest
import torch
import torch.ao.nn.quantized.reference as tnnqr
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
import lowbit.reference as R
from lowbit import kernels
from lowbit.nn.intrinsic import qat as nniqat
from lowbit.fuse import fuse_modules, fuse_modules_qat
from lowbit.nn.quantized.functional_modules import FloatFunctional


def _torch_qparams(w, qscheme, axis=0):
    """torch.ao's weight_qparams dict for ``w`` from its own observer."""
    if qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        obs = tq.MinMaxObserver(dtype=torch.qint8, qscheme=qscheme)
    else:
        obs = tq.PerChannelMinMaxObserver(ch_axis=axis, dtype=torch.qint8, qscheme=qscheme)
    obs(w)
    s, z = obs.calculate_qparams()
    d = {"qscheme": qscheme, "dtype": torch.qint8, "scale": s, "zero_point": z}
    if obs.qscheme in (torch.per_channel_affine, torch.per_channel_symmetric):
        d["axis"] = axis
    return d


FLOATS = {
    "linear": (lambda: nn.Linear(12, 7), tnnqr.Linear, R.Linear, (5, 12)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), tnnqr.Conv1d, R.Conv1d, (2, 3, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, groups=1), tnnqr.Conv2d, R.Conv2d, (2, 3, 8, 8)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), tnnqr.Conv3d, R.Conv3d, (1, 2, 4, 4, 4)),
    "convt2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1), tnnqr.ConvTranspose2d,
                R.ConvTranspose2d, (2, 3, 5, 5)),
}


@pytest.mark.parametrize("kind", sorted(FLOATS))
@pytest.mark.parametrize("qscheme", [torch.per_channel_symmetric, torch.per_channel_affine, torch.per_tensor_affine])
def test_reference_modules_match_torch_ao(kind, qscheme):
    make, theirs_cls, ours_cls, shape = FLOATS[kind]
    torch.manual_seed(0)
    f = make()
    qp = _torch_qparams(f.weight.detach(), qscheme, axis=1 if kind.startswith("convt") else 0)
    # torch.ao's reference modules take a symmetric grid as affine (zero point 0), as its get_qparam_dict does
    tqp = {**qp, "qscheme": torch.per_channel_affine} if qscheme == torch.per_channel_symmetric else qp
    theirs, ours = theirs_cls.from_float(f, tqp), ours_cls.from_float(f, qp)  # torch spellings accepted
    x = torch.randn(*shape)
    assert torch.equal(ours.get_quantized_weight().int_repr(), theirs.get_quantized_weight().int_repr())
    torch.testing.assert_close(ours.get_weight(), theirs.get_weight(), rtol=0, atol=0)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    assert ours.weight_qscheme is Q.qscheme.as_qscheme(qscheme) and ours.weight_dtype == Q.qint8


def test_reference_embedding_matches_torch_ao_and_errors():
    torch.manual_seed(0)
    f = nn.Embedding(20, 6)
    obs = tq.default_float_qparams_observer()
    obs(f.weight)
    s, z = obs.calculate_qparams()
    qp = {"qscheme": torch.per_channel_affine_float_qparams, "dtype": torch.quint8, "scale": s, "zero_point": z,
          "axis": 0}
    theirs, ours = tnnqr.Embedding.from_float(f, qp), R.Embedding.from_float(f, qp)
    idx = torch.randint(0, 20, (4, 3))
    torch.testing.assert_close(ours(idx), theirs(idx), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="axis"):
        R.Linear(3, 3, weight_qparams={"qscheme": Q.per_channel_symmetric, "dtype": Q.qint8, "scale": 1.0,
                                       "zero_point": 0})
    with pytest.raises(TypeError, match="weight_qparams"):
        R.Linear(3, 3)
    with pytest.raises(ValueError, match="scale"):
        R.QuantDeQuant(0.0, 0)


class CNN(nn.Module):
    """quant → conv-bn-relu → conv → add_relu (FloatFunctional) → maxpool → flatten → linear → hardswish → linear."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.skip = FloatFunctional()
        self.pool = nn.MaxPool2d(2)
        self.fc1, self.act, self.fc2 = nn.Linear(6 * 4 * 4, 16), nn.Hardswish(), nn.Linear(16, 5)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.skip.add_relu(x, self.conv2(x))
        return self.dequant(self.fc2(self.act(self.fc1(self.pool(x).flatten(1)))))


def _cnn():
    torch.manual_seed(0)
    m = CNN()
    with torch.no_grad():
        m.bn1.running_mean.uniform_(-0.2, 0.2)
        m.bn1.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _data(n, seed):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    bad = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
    assert not bad, bad


@pytest.mark.parametrize("backend", ["reference", "int_mm"])
def test_eager_reference_model_matches_int8_and_lowers_to_it(backend):
    p = Q.prepare(fuse_modules(_cnn(), [["conv1", "bn1", "relu1"]]), Q.get_minmax_qconfig())
    with torch.no_grad():
        for i in range(4):
            p(_data(32, i))
    ref, report = Q.convert(p, is_reference=True, return_report=True)
    assert set(report.converted) == {"conv1", "conv2", "fc1", "fc2"} and report.left_float == {}
    assert type(ref.fc1) is R.Linear and type(ref.conv1[0]) is R.Conv2d and type(ref.conv2) is R.Conv2d
    assert isinstance(ref.skip.activation_post_process, R.QuantDeQuant)
    assert not any(isinstance(m, Q.ObserverBase) for m in ref.modules())
    direct = Q.convert(p)
    lowered = Q.lower_reference(ref)
    _assert_same_state(lowered, direct)  # same codes, scales, zero points, grids
    x = _data(300, 11)
    with kernels.use_backend(backend):
        y8, yl = direct(x), lowered(x)
    assert torch.equal(y8, yl)
    quantum = float(direct.fc2.scale)
    yr = ref(x)
    assert (yr - y8).abs().max() <= quantum * 1.001  # the reference states the int8 model
    assert torch.equal(ref(x), yr) and not ref.training
    buf = io.BytesIO()  # a saved reference model (whole-module pickle) still lowers to the same int8 model
    torch.save(ref, buf)
    buf.seek(0)
    _assert_same_state(Q.lower_reference(torch.load(buf, weights_only=False)), direct)


def test_eager_reference_of_qat_model_with_bn_folding():
    m = fuse_modules_qat(_cnn().train(), [["conv1", "bn1", "relu1"]])
    p = Q.prepare_qat(m, Q.get_default_qat_qconfig())
    assert isinstance(p.conv1, nniqat.ConvBnReLU2d)
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    for i in range(3):
        opt.zero_grad()
        p(_data(16, i)).square().mean().backward()
        opt.step()
    p.apply(Q.disable_observer)
    ref = Q.convert(p, is_reference=True)
    assert type(ref.conv1[0]) is R.Conv2d and type(ref.fc1) is R.Linear
    direct = Q.convert(p)
    lowered = Q.lower_reference(ref)
    _assert_same_state(lowered, direct)
    x = _data(100, 5)
    with kernels.use_backend("reference"):
        y8 = direct(x)
    assert (ref(x) - y8).abs().max() <= float(direct.fc2.scale) * 1.001


def test_eager_reference_of_transposed_conv_lowers_to_direct_convert():
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.ConvTranspose2d(3, 4, 3, stride=2, groups=1), nn.ReLU(),
                      Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_minmax_qconfig())
    for i in range(3):
        p(torch.randn(8, 3, 5, 5, generator=torch.Generator().manual_seed(i)))
    ref = Q.convert(p, is_reference=True)
    assert type(ref[1]) is R.ConvTranspose2d and ref[1].weight_axis == 1
    direct = Q.convert(p)
    _assert_same_state(Q.lower_reference(ref), direct)
    x = torch.randn(4, 3, 5, 5)
    with kernels.use_backend("reference"):
        y8 = direct(x)
    assert (ref(x) - y8).abs().max() <= float(direct[1].scale) * 1.001


def test_eager_reference_errors():
    p = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(3, 3)), Q.get_minmax_qconfig())
    with pytest.raises(RuntimeError, match="saw no data"):
        Q.convert(p, is_reference=True)
    with pytest.raises(TypeError, match="is_reference"):
        Q.convert(p, is_reference="yes")
    with pytest.raises(ValueError, match="speed_check"):
        Q.convert(p, is_reference=True, speed_check=torch.randn(2, 3))


class FxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.w, self.b = nn.Parameter(torch.randn(5, 96) * 0.1), nn.Parameter(torch.zeros(5))
        self.emb = nn.Embedding(20, 5)

    def forward(self, x, idx):
        x = F.relu(self.bn1(self.conv1(x)))
        x = x + self.conv2(x)
        x = F.max_pool2d(x, 2).flatten(1)
        return F.linear(x, self.w, self.b) + self.emb(idx)


def test_fx_reference_graph_has_explicit_qdq_and_lowers_to_convert_fx():
    torch.manual_seed(0)
    m = FxNet().eval()
    with torch.no_grad():
        m.bn1.running_var.uniform_(0.5, 2.0)
    qmap = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(nn.Embedding,
                                                                               Q.get_embedding_qconfig())
    idx = torch.randint(0, 20, (32,), generator=torch.Generator().manual_seed(0))
    p = Q.prepare_fx(m, qmap, (_data(2, 0), idx[:2]))
    with torch.no_grad():
        for i in range(4):
            p(_data(32, i), idx)
    ref = Q.convert_to_reference_fx(p)
    code = ref.code
    assert code.count("quantize_per_tensor(") >= 4 and "quantize_per_channel(" in code  # activations, F.linear's weight
    assert not any(isinstance(c, Q.ObserverBase) for c in ref.modules())
    assert type(ref.emb) is R.Embedding and any(isinstance(c, R.Conv2d) for c in ref.modules())
    direct = Q.convert_fx(p)
    lowered = Q.convert_fx(ref)  # convert_fx of a reference model lowers it
    _assert_same_state(lowered, direct)
    x, i2 = _data(200, 3), torch.randint(0, 20, (200,))
    with kernels.use_backend("reference"):
        y8, yl = direct(x, i2), lowered(x, i2)
    assert torch.equal(y8, yl)
    out_scale = [n for n in ref.graph.nodes if n.op == "call_function" and n.target is R.ops.dequantize_per_tensor][-1]
    assert (ref(x, i2) - y8).abs().max() <= float(ref.get_buffer(out_scale.args[1].target)) * 1.001  # grid: a buffer
    with pytest.raises(TypeError, match="convert_to_reference_fx"):
        Q.convert_to_reference_fx(ref)


def test_fx_reference_agrees_with_torch_ao_reference_graph():
    """torch.ao's convert_to_reference_fx on the same model and recipe: the same float program on the same grids."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    calib = [torch.randn(32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ours = Q.prepare_fx(m, Q.QConfigMapping().set_global(Q.get_minmax_qconfig()), (calib[0],))
    tqc = tq.QConfig(activation=tq.MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=False),
                     weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    from torch.ao.quantization.quantize_fx import convert_to_reference_fx as t_ref
    from torch.ao.quantization.quantize_fx import prepare_fx as t_prepare
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = t_prepare(m, tq.QConfigMapping().set_global(tqc), (calib[0],))
        with torch.no_grad():
            for x in calib:
                ours(x), theirs(x)
        tr = t_ref(theirs)
    r = Q.convert_to_reference_fx(ours)
    x = torch.randn(100, 8)
    out_scale = [n for n in r.graph.nodes if n.op == "call_function" and n.target is R.ops.dequantize_per_tensor][-1]
    assert (r(x) - tr(x)).abs().max() <= float(r.get_buffer(out_scale.args[1].target)) * 1.001


def test_eager_reference_keeps_custom_modules_float_and_lowers_with_the_config():
    from test_custom_config import Doubler, ObservedDoubler, QuantDoubler, custom_net

    ours = Q.prepare(custom_net(), Q.get_minmax_qconfig(), prepare_custom_config_dict={
        "float_to_observed_custom_module_class": {Doubler: ObservedDoubler}})
    for _ in range(3):
        ours(torch.randn(16, 6))
    cfg = Q.ConvertCustomConfig().set_observed_to_quantized_mapping(ObservedDoubler, QuantDoubler)
    ref = Q.convert(ours, is_reference=True, convert_custom_config_dict=cfg)
    assert type(ref[2]) is ObservedDoubler and isinstance(ref[2].activation_post_process, R.QuantDeQuant)
    q, lowered = Q.convert(ours, convert_custom_config_dict=cfg), Q.lower_reference(ref, convert_custom_config_dict=cfg)
    assert type(lowered[2]) is QuantDoubler
    x = torch.randn(8, 6)
    with kernels.use_backend("reference"):
        assert torch.equal(lowered(x), q(x))
        assert (ref(x) - q(x)).abs().max() <= float(q[3].scale) * 1.001


def test_reference_models_export_with_torch_export():
    """The reference forms are plain float programs: torch.export captures them, same outputs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()
    x = _data(8, 1)
    p = Q.prepare_fx(m, Q.QConfigMapping().set_global(Q.get_minmax_qconfig()), (x,))
    p(x)
    ref = Q.convert_to_reference_fx(p)
    assert torch.equal(torch.export.export(ref, (x,)).module()(x), ref(x))
    pe = Q.prepare(nn.Sequential(Q.QuantStub(), m, Q.DeQuantStub()), Q.get_minmax_qconfig())
    pe(x)
    refe = Q.convert(pe, is_reference=True)
    assert torch.equal(torch.export.export(refe, (x,)).module()(x), refe(x))
