"""Hostile inputs left alone by session 33 and fixed in session 34: the ``torch.ops.lowbit`` custom ops called by hand
with inconsistent shapes or dtypes (fbgemm / oneDNN errors deep inside, garbage codes, or — a 1-d weight to
``qlinear`` — a process killed by ``free(): invalid pointer``), in eager calls and under ``torch.compile`` (the fake
implementations accepted them); ``lowbit quantize --qat-epochs`` without QAT and ``lowbit quantize-llm --bits 4`` with
an 8-bit method, accepted and ignored. Each is now an error naming the value; each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from lowbit import cli
from lowbit.compile_state import conv_config
from lowbit.nn.quantized.dynamic import Linear as DynamicLinear

U8 = "quint8:0:255"
I8 = "qint8:-128:127"


def _linear_args(**over: object) -> list:
    torch.manual_seed(0)
    a = {"x": torch.randint(0, 256, (4, 16), dtype=torch.uint8), "x_scale": torch.tensor(0.02),
         "x_zero_point": torch.tensor(3), "x_qdtype": U8, "weight": torch.randint(-128, 128, (8, 16), dtype=torch.int8),
         "w_scale": torch.full((8,), 0.01), "w_zero_point": torch.zeros(8, dtype=torch.int64), "w_qdtype": I8,
         "bias": torch.zeros(8), "out_scale": torch.tensor(0.05), "out_zero_point": torch.tensor(7), "out_qdtype": U8,
         "relu": False}
    a.update(over)
    return list(a.values())


_W = torch.randint(-128, 128, (8, 16), dtype=torch.int8)

QLINEAR_CASES = [  # (argument overrides, error, what the message names); before: see each comment
    ({"x": torch.zeros(4, 15, dtype=torch.uint8)}, ValueError,
     r"x of shape \(4, 15\) does not end in the weight's K=16"),  # fbgemm "packB"
    ({"x": torch.zeros((), dtype=torch.uint8)}, ValueError, r"x of shape \(\) does not end"),  # IndexError in onednn.py
    ({"weight": _W[None]}, ValueError, r"weight must be 2-d, got shape \(1, 8, 16\)"),  # fbgemm "linear_prepack"
    ({"weight": _W.float()}, TypeError, "weight must hold int8 codes, got dtype torch.float32"),  # "kernels.linear: ..."
    ({"w_scale": torch.ones(5)}, ValueError, r"w_scale of shape \(5,\) must hold 1 value or one per channel"),
    ({"w_zero_point": torch.zeros(5, dtype=torch.int64)}, ValueError, r"w_zero_point of shape \(5,\)"),  # was accepted
    ({"bias": torch.zeros(5)}, ValueError, r"bias of shape \(5,\) must be \(8,\)"),  # "size of tensor a (8) ... (5)"
    ({"x": torch.zeros(4, 16, dtype=torch.int64)}, TypeError, "x must hold torch.uint8 codes of the grid 'quint8:0:255', "
                                                              "got dtype torch.int64"),  # was accepted: garbage
    ({"x": torch.zeros(4, 16)}, TypeError, "x must hold .* got dtype torch.float32"),  # was accepted
    ({"x": torch.zeros(4, 16, dtype=torch.int8)}, TypeError, "x must hold .* got dtype torch.int8"),  # was accepted
    ({"x_scale": torch.ones(2)}, ValueError, r"x_scale and x_zero_point must hold one value each .* shapes \(2,\)"),
    ({"out_zero_point": None}, ValueError, "out_scale and out_zero_point go together"),
]


@pytest.mark.parametrize(("over", "error", "match"), QLINEAR_CASES)
def test_qlinear_op_names_inconsistent_arguments(over, error, match):
    with pytest.raises(error, match=f"^lowbit::qlinear: {match}"):
        torch.ops.lowbit.qlinear(*_linear_args(**over))


def test_qlinear_op_refuses_a_1d_weight_without_crashing():
    # was: "free(): invalid pointer" and the process aborted (so run in its own process before the fix)
    with pytest.raises(ValueError, match=r"^lowbit::qlinear: weight must be 2-d, got shape \(16,\)"):
        torch.ops.lowbit.qlinear(*_linear_args(weight=_W[0]))


@pytest.mark.parametrize(("over", "error", "match"), [QLINEAR_CASES[0], QLINEAR_CASES[7], QLINEAR_CASES[6]])
def test_compiled_qlinear_call_gives_the_same_error(over, error, match):
    # was: the fake implementation took them (the real one then failed in fbgemm, or gave garbage codes)
    args = _linear_args(**over)
    torch._dynamo.reset()  # (static shapes: a recompile would name the sizes symbolically, as (s37,))
    with pytest.raises(Exception, match=f"lowbit::qlinear: {match}") as caught:
        torch.compile(lambda *a: torch.ops.lowbit.qlinear(*a), fullgraph=True, backend="eager")(*args)
    assert f"got {error.__name__}(" in str(caught.value)  # dynamo's TorchRuntimeError quotes the op's error


def test_qlinear_op_still_takes_good_arguments():
    y = torch.ops.lowbit.qlinear(*_linear_args())
    assert y.shape == (4, 8) and y.dtype == torch.uint8
    for over in ({"w_scale": torch.tensor(0.01), "w_zero_point": torch.tensor(0)}, {"bias": None},
                 {"out_scale": None, "out_zero_point": None, "out_qdtype": ""}, {"x": torch.zeros(2, 3, 16, dtype=torch.uint8)}):
        y2 = torch.ops.lowbit.qlinear(*_linear_args(**over))
        assert y2.shape[-1] == 8


def _dynamic_args(**over: object) -> list:
    torch.manual_seed(0)
    m = DynamicLinear.from_float(torch.nn.Linear(16, 8))
    a = {"x": torch.randn(4, 16), "weight": m.weight_int8, "w_scale": m.weight_scale,
         "w_zero_point": m.weight_zero_point, "w_qdtype": I8, "bias": m.bias}
    a.update(over)
    return list(a.values())


DYNAMIC_CASES = [
    ({"x": torch.randn(4, 15)}, ValueError, r"x of shape \(4, 15\) must be \(M, K\) with the weight's K=16"),  # oneDNN
    ({"x": torch.randn(2, 4, 16)}, ValueError, r"x of shape \(2, 4, 16\) must be \(M, K\)"),  # "too many values to unpack"
    ({"x": torch.randint(0, 3, (4, 16))}, TypeError, "x must be a float tensor, got dtype torch.int64"),  # accepted
    ({"weight": _W[0]}, ValueError, r"weight must be 2-d, got shape \(16,\)"),  # IndexError in per_token.py
    ({"weight": _W[None]}, ValueError, r"weight must be 2-d, got shape \(1, 8, 16\)"),  # "t() expects ... <= 2 dims"
    ({"weight": _W.float()}, TypeError, "weight must hold int8 codes, got dtype torch.float32"),  # "kernels.linear: ..."
    ({"w_scale": torch.ones(3)}, ValueError, r"w_scale of shape \(3,\) must hold 1 value or one per channel"),
    ({"bias": torch.zeros(5)}, ValueError, r"bias of shape \(5,\) must be \(8,\)"),  # "size of tensor a (8) ... (5)"
]


@pytest.mark.parametrize(("over", "error", "match"), DYNAMIC_CASES)
def test_dynamic_linear_op_names_inconsistent_arguments(over, error, match):
    with pytest.raises(error, match=f"^lowbit::dynamic_linear: {match}"):
        torch.ops.lowbit.dynamic_linear(*_dynamic_args(**over))


def test_exported_dynamic_linear_call_gives_the_same_error():
    rest = _dynamic_args()[1:]

    class Call(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.lowbit.dynamic_linear(x, *rest)

    with pytest.raises(ValueError, match=r"^lowbit::dynamic_linear: x of shape \(4, 15\)"):  # was: export succeeded
        torch.export.export(Call(), (torch.randn(4, 15),))
    y = torch.ops.lowbit.dynamic_linear(*_dynamic_args())
    assert y.shape == (4, 8) and torch.ops.lowbit.dynamic_linear(*_dynamic_args(x=torch.randn(0, 16))).shape == (0, 8)


def _conv_args(x=None, weight=None, bias=None, config=None) -> list:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 4, 8, 8), dtype=torch.uint8) if x is None else x
    w = torch.randint(-128, 128, (6, 4, 3, 3), dtype=torch.int8) if weight is None else weight
    config = conv_config(U8, I8, U8, False, [1, 1], [1, 1], [1, 1], 1, False, [0, 0]) if config is None else config
    return [x, torch.tensor(0.02), torch.tensor(3), w, torch.full((6,), 0.01), torch.zeros(6, dtype=torch.int64), bias,
            torch.tensor(0.05), torch.tensor(7), config]


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"x": torch.zeros(4, 8, 8, dtype=torch.uint8)}, ValueError, r"x of shape \(4, 8, 8\) must be 4-d"),  # negative dim
    ({"x": torch.zeros(2, 5, 8, 8, dtype=torch.uint8)}, ValueError, r"x of shape \(2, 5, 8, 8\) has 5 channels; the "
                                                                    r"weight of shape \(6, 4, 3, 3\) with groups=1 takes 4"),
    ({"x": torch.zeros(2, 4, 8, 8)}, TypeError, "x must hold torch.uint8 codes .* got dtype torch.float32"),  # AttributeError
    ({"weight": torch.zeros(6, 4, dtype=torch.int8)}, ValueError, r"weight must be 4-d, got shape \(6, 4\)"),
    ({"bias": torch.zeros(4)}, ValueError, r"bias of shape \(4,\) must be \(6,\)"),
    ({"config": conv_config(U8, I8, U8, False, [1, 1], [1], [1, 1], 1, False, [0, 0])}, ValueError,
     r"stride=\[1, 1\], padding=\[1\], dilation=\[1, 1\], groups=1: one value per spatial dim"),
])
def test_qconv_cfg_op_names_inconsistent_arguments(kw, error, match):
    with pytest.raises(error, match=f"^lowbit::qconv_cfg: {match}"):
        torch.ops.lowbit.qconv_cfg(*_conv_args(**kw))
    assert torch.ops.lowbit.qconv_cfg(*_conv_args()).shape == (2, 6, 8, 8)


def test_other_ops_name_their_arguments():
    a = torch.randint(0, 256, (4, 8), dtype=torch.uint8)
    s, z = torch.tensor(0.1), torch.tensor(3)
    with pytest.raises(ValueError, match=r"^lowbit::qfunctional: x of shape \(4, 8\) and y of shape \(3, 8\) do not "
                                         "broadcast"):
        torch.ops.lowbit.qfunctional("add", a, s, z, U8, a[:3], s, z, U8, 0.0, s, z, U8)
    with pytest.raises(ValueError, match=r"^lowbit::qfunctional: op='sub' is not one of"):  # was an AttributeError
        torch.ops.lowbit.qfunctional("sub", a, s, z, U8, a, s, z, U8, 0.0, s, z, U8)
    with pytest.raises(TypeError, match="^lowbit::qfunctional: x must hold torch.uint8 codes .* torch.int64"):  # accepted
        torch.ops.lowbit.qfunctional("add", a.long(), s, z, U8, a, s, z, U8, 0.0, s, z, U8)
    # the fake implementation unpacked (N, C, H, W) from a 3-d tensor ("not enough values to unpack")
    with pytest.raises(Exception, match=r"lowbit::max_pool2d_codes: kernel_size=\[2, 2\], stride=\[2, 2\] on a "
                                        r"torch.uint8 tensor of shape \(4, 8, 8\)"):
        torch.compile(lambda q: torch.ops.lowbit.max_pool2d_codes(q, [2, 2], [2, 2]), fullgraph=True,
                      backend="eager")(torch.zeros(4, 8, 8, dtype=torch.uint8))


def test_weight_only_op_names_its_input():
    from lowbit.nn.quantized.weight_only import WeightOnlyLinear

    m = WeightOnlyLinear.from_float(torch.nn.Linear(64, 8), bits=4, group_size=32)
    spec = [m.in_features, m.out_features, m.bits, m.group_size, int(m.symmetric), int(m.relu)]

    def call(x, bias=m.bias):
        return torch.ops.lowbit.weight_only_linear(x, m.qweight, m.scales, m.zero_points, bias, spec, m.kernel)

    with pytest.raises(ValueError, match=r"^lowbit::weight_only_linear: x of shape \(3, 63\) does not end in "
                                         "in_features=64"):  # "shape '[-1, 64]' is invalid for input of size 189"
        call(torch.randn(3, 63))
    with pytest.raises(TypeError, match="^lowbit::weight_only_linear: x must be a float tensor, got dtype torch.int64"):
        call(torch.zeros(3, 64, dtype=torch.int64))  # was accepted: an int64 output
    with pytest.raises(ValueError, match=r"^lowbit::weight_only_linear: bias of shape \(3,\) must be \(8,\)"):
        call(torch.randn(3, 64), torch.zeros(3))
    assert call(torch.randn(3, 64)).shape == (3, 8)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "s34model.py").write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(8, 3))\n")
    torch.save(torch.randn(16, 8), "calib.pt")
    return tmp_path


@pytest.mark.parametrize("extra", [["--method", "ptq"], ["--method", "dynamic", "--method", "ptq"], []])
def test_quantize_refuses_qat_epochs_without_qat(workdir, capsys, extra):
    # was rc 0: the value was ignored (with no --method and no --calib-labels, QAT is not among the default methods)
    rc = cli.main(["quantize", "--quiet", "--model", "s34model:make", "--calib", "calib.pt", *extra, "--qat-epochs", "3",
                   "--out", "o"])
    err = capsys.readouterr().err
    assert rc == 2 and "--qat-epochs 3 applies to --method qat, which is not among the methods to run" in err, err
    assert len(err.strip().splitlines()) == 1 and not (workdir / "o").exists()


def test_quantize_without_qat_epochs_still_runs_and_qat_reads_its_default(workdir, capsys):
    from lowbit.cli.command import QAT_EPOCHS, _check_args, build_parser

    assert cli.main(["quantize", "--quiet", "--model", "s34model:make", "--calib", "calib.pt", "--method", "dynamic",
                     "--out", "o"]) == 0
    args = build_parser().parse_args(["quantize", "--model", "s34model:make", "--calib", "calib.pt", "--calib-labels",
                                      "y.pt", "--method", "qat"])
    _check_args(args, ["qat"])
    assert args.qat_epochs == QAT_EPOCHS == 0.5


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_quantize_llm_refuses_4_bits_with_an_8_bit_method(tmp_path, capsys, method):
    # was: the model loaded, the method ran at 8 bits and the report said "bits": 8
    rc = cli.main(["quantize-llm", str(tmp_path / "missing.gguf"), "--method", method, "--bits", "4", "--out",
                   str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--bits 4 with --method {method}: its weights are 8-bit" in err, err
    assert not (tmp_path / "o").exists()
    # --bits 8 with it is consistent: the run goes on to the model (here missing)
    rc = cli.main(["quantize-llm", str(tmp_path / "missing.gguf"), "--method", method, "--bits", "8", "--out",
                   str(tmp_path / "o")])
    assert rc == 2 and "--bits" not in capsys.readouterr().err
