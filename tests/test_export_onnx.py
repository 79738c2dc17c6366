"""lowbit.export.to_onnx: QDQ files that onnx.checker accepts and ONNX Runtime runs on integer kernels,
matching lowbit's converted models within one output quantum."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.examples import SmallCNN
from lowbit.export import run_onnx, to_onnx
from lowbit.nn.quantized import FloatFunctional

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread, ort_ops, quantized, within_one_quantum  # noqa: E402,F401 (one_thread: autouse fixture)

INT_KERNELS = {"QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm", "MatMulIntegerToFloat",
               "DynamicQuantizeMatMul", "QLinearAdd"}


# ---- helpers -------------------------------------------------------------------------------------
def calibration_images(n_batches: int = 3, batch: int = 64) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Fashion-MNIST images when the dataset is installed, else random images."""
    import lowbit.data as D
    if D.fashion_mnist_available():
        x, _ = D.load_fashion_mnist("test", limit=n_batches * batch + 100)
        x = D.normalize_images(x)
        return list(x[: n_batches * batch].split(batch)), x[n_batches * batch:]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 1, 28, 28, generator=g) for _ in range(n_batches)], torch.randn(100, 1, 28, 28)


class ResNetish(nn.Module):
    """Two residual blocks (conv-bn-relu, conv-bn, add_relu via FloatFunctional) and a Linear head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.stem, self.stem_bn, self.stem_relu = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        for i in (1, 2):
            setattr(self, f"c{i}a", nn.Conv2d(c, c, 3, padding=1, bias=False))
            setattr(self, f"b{i}a", nn.BatchNorm2d(c))
            setattr(self, f"r{i}", nn.ReLU())
            setattr(self, f"c{i}b", nn.Conv2d(c, c, 3, padding=1, bias=False))
            setattr(self, f"b{i}b", nn.BatchNorm2d(c))
            setattr(self, f"add{i}", FloatFunctional())
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(c * 4 * 4, 5)

    def groups(self) -> list[list[str]]:
        g = [["stem", "stem_bn", "stem_relu"]]
        for i in (1, 2):
            g += [[f"c{i}a", f"b{i}a", f"r{i}"], [f"c{i}b", f"b{i}b"]]
        return g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem_relu(self.stem_bn(self.stem(self.quant(x)))))            # (B, c, 8, 8)
        for i in (1, 2):
            r = getattr(self, f"r{i}")(getattr(self, f"b{i}a")(getattr(self, f"c{i}a")(x)))
            x = getattr(self, f"add{i}").add_relu(getattr(self, f"b{i}b")(getattr(self, f"c{i}b")(r)), x)
        return self.dequant(self.fc(torch.flatten(self.pool(x), 1)))                      # (B, 5)


class EncoderLayer(nn.Module):
    """Pre-LN transformer layer: quantized q/k/v/o and FFN Linears, float LayerNorm / softmax / residuals."""

    def __init__(self, d: int = 32, heads: int = 4, ff: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ff1, self.act, self.ff2 = nn.Linear(d, ff), nn.ReLU(), nn.Linear(ff, d)
        self.dq = Q.DeQuantStub()

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)               # (B, H, S, D/H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                                   # (B, S, D)
        y = self.ln1(x)
        q, k, v = (self._split(self.dq(lin(y))) for lin in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        x = x + self.dq(self.o(a.transpose(1, 2).reshape(x.shape)))
        return x + self.dq(self.ff2(self.act(self.ff1(self.ln2(x)))))


# ---- converted models: ORT matches lowbit, on integer kernels ------------------------------------
def test_small_cnn_matches_ort_on_integer_kernels(tmp_path):
    torch.manual_seed(0)
    batches, x = calibration_images()
    qm = quantized(SmallCNN(), batches, SmallCNN.fusion_groups())
    path = to_onnx(qm, batches[0][:2], tmp_path / "cnn.onnx")            # example batch 2, run batch 100
    out, ops = ort_ops(path, x, tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.fc2.scale)) >= 0.99
    assert {"QLinearConv", "QGemm"} <= ops and not ops & {"Conv", "Gemm", "MatMul"}


def test_resnet_style_residual_add_runs_as_qlinear_add(tmp_path):
    torch.manual_seed(1)
    m = ResNetish()
    qm = quantized(m, [torch.randn(32, 3, 16, 16) for _ in range(3)], m.groups())
    path = to_onnx(qm, torch.randn(2, 3, 16, 16), tmp_path / "resnet.onnx")
    x = torch.randn(9, 3, 16, 16)
    out, ops = ort_ops(path, x, tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.fc.scale)) >= 0.99
    assert {"QLinearConv", "QLinearAdd", "QGemm"} <= ops and not ops & {"Conv", "Add", "Gemm"}


def test_transformer_layer_quantized_linears_float_softmax_layernorm(tmp_path):
    torch.manual_seed(2)
    qm = quantized(EncoderLayer(), [torch.randn(8, 10, 32) for _ in range(3)], [["ff1", "act"]])
    path = to_onnx(qm, torch.randn(2, 10, 32), tmp_path / "layer.onnx")
    x = torch.randn(3, 10, 32)
    out, ops = ort_ops(path, x, tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.ff2.scale)) >= 0.99
    assert ops & INT_KERNELS and {"Softmax", "LayerNormalization"} <= ops and "Gemm" not in ops


# ---- file format ---------------------------------------------------------------------------------
def test_qdq_file_has_int8_weights_per_channel_axis_and_dynamic_batch(tmp_path):
    torch.manual_seed(3)
    qm = quantized(SmallCNN(), [torch.randn(16, 1, 28, 28)], SmallCNN.fusion_groups())
    path = to_onnx(qm, torch.randn(2, 1, 28, 28), tmp_path / "int8.onnx", weight_dtype="int8")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert proto.opset_import[0].version >= 13
    inits = {t.name: t for t in proto.graph.initializer}
    conv1_codes = [t for t in inits.values() if tuple(t.dims) == tuple(qm.conv1.weight_int8.shape)]
    assert conv1_codes and all(t.data_type == onnx.TensorProto.INT8 for t in conv1_codes)
    assert not any(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2 for t in inits.values())
    weight_dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                 and len(inits[n.input[0]].dims) >= 2]
    assert len(weight_dq) == 5 and all(a.name == "axis" and a.i == 0 for n in weight_dq for a in n.attribute)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert proto.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    float_path = tmp_path / "fp32.onnx"
    torch.onnx.export(SmallCNN().eval(), (torch.randn(2, 1, 28, 28),), str(float_path), dynamo=False)
    assert path.stat().st_size * 3 < float_path.stat().st_size                      # ~3.6x smaller


def test_auto_weights_are_exact_on_cpus_without_vnni_and_int8_equal_in_value(tmp_path):
    torch.manual_seed(4)
    qm = quantized(SmallCNN(), [torch.randn(16, 1, 28, 28)], SmallCNN.fusion_groups())
    x = torch.randn(6, 1, 28, 28)
    outs = {}
    for wd in ("auto", "int8", "uint8"):
        path = to_onnx(qm, x[:2], tmp_path / f"{wd}.onnx", weight_dtype=wd)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        outs[wd] = torch.from_numpy(sess.run(None, {"input": x.numpy()})[0])             # reference QDQ semantics
    assert torch.equal(outs["auto"], outs["int8"]) and torch.equal(outs["auto"], outs["uint8"])
    assert within_one_quantum(outs["auto"], qm(x), float(qm.fc2.scale)) >= 0.99


# ---- prepared / QAT models -----------------------------------------------------------------------
def test_qat_model_exports_frozen_int8_weights_and_matches_its_fake_quant_forward(tmp_path):
    torch.manual_seed(5)
    m = Q.fuse_modules_qat(SmallCNN(channels=(4, 8), hidden=16).train(), SmallCNN.fusion_groups())
    qat = Q.prepare_qat(m)
    for _ in range(3):
        qat(torch.randn(16, 1, 28, 28))
    qat.eval().apply(Q.disable_observer)                          # freeze the grids (else each forward moves them)
    before = {k: v.clone() for k, v in qat.state_dict().items()}
    path = to_onnx(qat, torch.randn(2, 1, 28, 28), tmp_path / "qat.onnx")
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())             # model untouched
    x = torch.randn(5, 1, 28, 28)
    out, ops = ort_ops(path, x, tmp_path)
    assert {"QLinearConv", "QGemm"} <= ops and "BatchNormalization" not in ops          # BN folded, int8 kernels
    quantum = float(qat.fc2.activation_post_process.scale)
    with torch.no_grad():
        assert within_one_quantum(out, qat(x), quantum) >= 0.99
    inits = onnx.load(str(path)).graph.initializer
    assert any(t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) and tuple(t.dims) == (4, 1, 3, 3)
               for t in inits)
    assert not any(t.data_type == onnx.TensorProto.FLOAT and tuple(t.dims) == (4, 1, 3, 3) for t in inits)


def test_lsq_qat_model_exports_its_learned_grid_with_a_fractional_zero_point(tmp_path):
    """LSQ's zero point is a float parameter its forward rounds: the export must round it too (not truncate)."""
    from lowbit.fake_quant import LearnableFakeQuantize, enable_param_learning

    torch.manual_seed(6)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), Q.DeQuantStub())
    qat = Q.prepare_qat(m.train(), Q.get_lsq_qat_qconfig())
    x = torch.randn(64, 8)
    qat(x)                                                        # static estimate of every grid
    qat.apply(enable_param_learning)
    affine = [fq for fq in qat.modules() if isinstance(fq, LearnableFakeQuantize) and fq.symmetric_zero_point is None]
    assert affine
    with torch.no_grad():
        for fq in affine:                                         # as if training had moved them off the integers
            fq.zero_point.add_(0.7)
    qat.eval()
    path = to_onnx(qat, x[:2], tmp_path / "lsq.onnx")
    out = torch.as_tensor(run_onnx(path, x)[0])
    quantum = float(qat[3].activation_post_process.calculate_qparams()[0])
    with torch.no_grad():
        assert within_one_quantum(out, qat(x), quantum) >= 0.99
    zero_points = {int(onnx.numpy_helper.to_array(t)) for t in onnx.load(str(path)).graph.initializer
                   if t.data_type == onnx.TensorProto.UINT8 and not t.dims}
    rounded = {int(round(float(fq.zero_point.detach()))) for fq in affine}
    truncated = {z - 1 for z in rounded} - rounded
    assert len(zero_points & rounded) >= 3 and not zero_points & truncated  # (unused input grids are not exported)


def test_prepared_ptq_model_exports_what_convert_would_build(tmp_path):
    torch.manual_seed(7)
    m = Q.fuse_modules(SmallCNN(channels=(4, 8), hidden=16).eval(), SmallCNN.fusion_groups())
    m.qconfig = Q.get_default_qconfig()
    prepared = Q.prepare(m)
    with torch.no_grad():
        for _ in range(2):
            prepared(torch.randn(16, 1, 28, 28))
    path = to_onnx(prepared, torch.randn(2, 1, 28, 28), tmp_path / "prepared.onnx")
    qm = Q.convert(prepared)
    x = torch.randn(6, 1, 28, 28)
    out, ops = ort_ops(path, x, tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.fc2.scale)) >= 0.99
    assert "QLinearConv" in ops
    assert not any(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2 for t in onnx.load(str(path)).graph.initializer)


def test_fx_graph_module_exports(tmp_path):
    torch.manual_seed(8)
    from lowbit.fx import convert_fx, prepare_fx
    x = torch.randn(2, 1, 28, 28)
    prepared = prepare_fx(SmallCNN(channels=(4, 8), hidden=16).eval(), Q.get_default_qconfig_mapping(), (x,))
    with torch.no_grad():
        for _ in range(2):
            prepared(torch.randn(16, 1, 28, 28))
    qm = convert_fx(prepared)
    path = to_onnx(qm, x, tmp_path / "fx.onnx")
    x = torch.randn(5, 1, 28, 28)
    assert within_one_quantum(run_onnx(path, x)[0], qm(x), float(qm.fc2.scale)) >= 0.99


def test_float_inputs_and_quantized_activations(tmp_path):
    torch.manual_seed(6)
    # no QuantStub: the first Linear quantizes its float input on its recorded grid; LUT activation + ReLU6
    m = nn.Sequential(nn.Linear(8, 16), nn.Hardswish(), nn.Linear(16, 8), nn.ReLU6(), Q.DeQuantStub())
    qm = quantized(m, [torch.randn(64, 8) * 2 for _ in range(2)])
    assert qm[0].input_grid is not None
    path = to_onnx(qm, torch.randn(2, 8), tmp_path / "mlp.onnx")
    x = torch.randn(50, 8) * 2
    assert within_one_quantum(run_onnx(path, x)[0], qm(x), float(qm[2].scale)) >= 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_exports_the_same_file(tmp_path):
    torch.manual_seed(11)
    qm = quantized(SmallCNN(channels=(4, 8), hidden=16), [torch.randn(16, 1, 28, 28)], SmallCNN.fusion_groups())
    x = torch.randn(2, 1, 28, 28)
    cpu = to_onnx(qm, x, tmp_path / "cpu.onnx")
    gpu = to_onnx(qm.to("cuda"), x.to("cuda"), tmp_path / "gpu.onnx")
    assert torch.equal(run_onnx(cpu, x)[0], run_onnx(gpu, x)[0])


# ---- bad input -----------------------------------------------------------------------------------
class _Custom(nn.Module):
    """A quantized module lowbit's exporter does not know (posing as one from lowbit.nn.quantized)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


_Custom.__module__ = "lowbit.nn.quantized.custom"


def test_unsupported_module_is_named_with_its_path_and_type(tmp_path):
    m = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), _Custom()))
    with pytest.raises(TypeError, match=r"'1\.1' of type lowbit\.nn\.quantized\.custom\._Custom"):
        to_onnx(m, torch.randn(2, 8), tmp_path / "custom.onnx")


def test_unwritable_path_and_bad_arguments(tmp_path):
    qm = quantized(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()), [torch.randn(8, 4)])
    x = torch.randn(2, 4)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker / "m.onnx", tmp_path / "missing_dir" / "m.onnx"):
        with pytest.raises(ValueError, match="cannot write path="):
            to_onnx(qm, x, bad)
    with pytest.raises(ValueError, match="is a directory"):
        to_onnx(qm, x, tmp_path)
    with pytest.raises(TypeError, match="path must be"):
        to_onnx(qm, x, 3)
    with pytest.raises(ValueError, match="weight_dtype='int4'"):
        to_onnx(qm, x, tmp_path / "m.onnx", weight_dtype="int4")
    with pytest.raises(ValueError, match="opset_version=11"):
        to_onnx(qm, x, tmp_path / "m.onnx", opset_version=11)
    with pytest.raises(TypeError, match="example_inputs"):
        to_onnx(qm, [1, 2], tmp_path / "m.onnx")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        to_onnx(lambda t: t, x, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_uncalibrated_observer_and_conflicting_input_grids_are_named(tmp_path):
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval()
    m.qconfig = Q.get_default_qconfig()
    with pytest.raises(RuntimeError, match=r"observer '0\.activation_post_process'.*saw no calibration data"):
        to_onnx(Q.prepare(m), torch.randn(2, 4), tmp_path / "m.onnx")

    class Shared(nn.Module):                              # one Linear called on two different grids
        def __init__(self) -> None:
            super().__init__()
            self.q1, self.q2, self.fc = Q.QuantStub(), Q.QuantStub(), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.q1(x)).dequantize() + self.fc(self.q2(x * 10)).dequantize()

    qm = quantized(Shared(), [torch.randn(8, 4)])
    with pytest.raises(ValueError, match="'fc' .*different grids"):
        to_onnx(qm, torch.randn(2, 4), tmp_path / "m.onnx")


def test_missing_onnx_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)                                     # import onnx -> ImportError
    with pytest.raises(ImportError, match=r"pip install lowbit\[onnx\]"):
        to_onnx(nn.Linear(2, 2), torch.randn(1, 2), tmp_path / "m.onnx")


def test_run_onnx_names_a_bad_path_or_input_before_ort_starts(tmp_path):
    torch.manual_seed(0)
    p = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval(), Q.get_default_qconfig())
    p(torch.randn(8, 4))
    path = to_onnx(Q.convert(p), torch.randn(2, 4), tmp_path / "m.onnx")
    x = torch.randn(2, 4)
    cases = [(dict(optimized_model_path=str(tmp_path / "no_dir" / "o.onnx")), ValueError,
              "optimized_model_path=.* directory .* does not exist"),  # was ORT's "SystemError : 2"
             (dict(optimized_model_path=str(tmp_path)), ValueError, "optimized_model_path=.* is a directory")]
    for kw, err, needle in cases:
        with pytest.raises(err, match=needle):
            run_onnx(path, x, **kw)
    with pytest.raises(TypeError, match="input 0 has dtype torch.bfloat16"):  # was "unsupported ScalarType"
        run_onnx(path, x.bfloat16())
    with pytest.raises(FileNotFoundError, match="no ONNX file at"):
        run_onnx(tmp_path / "missing.onnx", x)
    assert run_onnx(path, x, optimized_model_path=str(tmp_path / "opt.onnx"))[0].shape == (2, 2)
