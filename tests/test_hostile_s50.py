"""Session 50 (hostile50): session 49's leftovers and a sweep of the CLI, configs, ``with_args``, ``fuse_modules``,
``quantize_dynamic`` and weight-only group sizes (/tmp/s50/hostile50). Each test failed before its fix:

- a float op with no int8 kernel run on a ``QTensor`` of a float64 model (eager ``QuantWrapper``): the fallback
  dequantized to float32, so a float64 ``LayerNorm`` after the int8 layer failed with torch's "mixed dtype", and a
  float op's result reaching the ``DeQuantize`` (``torch.softmax``, ``torch.cat`` of two grids) came out float32.
  Now the fallback dequantizes to float64 where the op's other operands hold a float64 tensor, and a float64
  region's ``DeQuantize`` casts a float32 tensor it is given to float64;
- a model mixing float32 and float64 parameters keeps float32 out of its int8 region (decided: which dequantize
  feeds a float64 layer is not known from the parameters), now warned once at convert;
- an observer moved with ``.to("meta")``: ``calculate_qparams`` / ``is_calibrated`` failed with torch's
  "Tensor.item() cannot be called on meta tensors"; now a ``RuntimeError`` naming the observer;
- ``lowbit quantize --out`` (or an input path) holding a NUL character: a ``ValueError`` traceback ("embedded null
  byte") from ``Path.resolve``; now the one-line error, exit status 2.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import LnAfter, one_thread  # noqa: F401  (one_thread: autouse fixture, this module runs on 1 thread)


class _Soft(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.a(x), -1)


class _Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), x], 1)  # two grids: the float fallback


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _wrapped_f64(cls: type, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = cls().double().eval()
    wrapped = Q.QuantWrapper(copy.deepcopy(model))
    wrapped.qconfig = Q.get_default_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the float fallback's warning)
        prepared = Q.prepare(wrapped)
        prepared(x)
        q = Q.convert(prepared)
        with torch.no_grad():
            return model(x), q(x)


@pytest.mark.parametrize("cls", [LnAfter, _Soft, _Cat])
def test_float64_model_float_ops_on_qtensors_keep_float64(cls: type) -> None:
    """Before: ``LnAfter`` raised "mixed dtype (CPU)", ``_Soft`` / ``_Cat`` returned float32."""
    x = torch.randn(16, 8, dtype=torch.float64)
    ref, out = _wrapped_f64(cls, x)
    assert out.dtype == torch.float64
    assert _sqnr(ref, out) > 30


def test_fallback_float64_only_where_an_operand_is_float64() -> None:
    """``F.linear`` on a QTensor and a float64 weight: float64 (before: torch's dtype mismatch); float32 operands keep
    the float32 result (pin)."""
    import torch.nn.functional as F

    qt = Q.quantize_per_tensor(torch.tensor([[0.5, 1.0, -1.5]]), 0.5, 0, Q.qint8)
    w = torch.randn(2, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the float fallback's warning)
        y = F.linear(qt, w)
        assert y.dtype == torch.float64 and torch.equal(y, F.linear(qt.dequantize().double(), w))
        assert F.linear(qt, w.float()).dtype == torch.float32
        assert (qt ** torch.full((3,), 2.0, dtype=torch.float64)).dtype == torch.float64


def test_mixed_float32_float64_model_is_warned_at_convert() -> None:
    torch.manual_seed(0)
    model = LnAfter().eval()
    model.fc2.double()

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m.fc2(self.m.ln(self.m.fc(x)).double())

    x = torch.randn(16, 8)
    prepared = Q.prepare_fx(Mixed().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    prepared(x)
    with pytest.warns(UserWarning, match="mixes float64 and torch.float32 parameters"):
        q = Q.convert_fx(prepared)
    assert q(x).dtype == torch.float32  # (the documented result)


@pytest.mark.parametrize("cls", [Q.MinMaxObserver, Q.MovingAverageMinMaxObserver, Q.PerChannelMinMaxObserver,
                                 Q.HistogramObserver, Q.MSEObserver, Q.PercentileObserver])
def test_observer_on_meta_names_itself(cls: type) -> None:
    obs = cls()
    obs(torch.rand(4, 3))
    obs = obs.to("meta")
    with pytest.raises(RuntimeError, match=f"{cls.__name__}: its statistics are on the meta device"):
        obs.calculate_qparams()


@pytest.mark.parametrize("flag", ["--out", "--calib"])
def test_cli_path_with_nul_is_one_line(tmp_path, capsys, flag: str) -> None:
    from lowbit.cli import main

    torch.save(torch.rand(4, 8), tmp_path / "x.pt")
    argv = ["quantize", "--model", "torch.nn:Identity", "--quiet", "--method", "dynamic",
            "--calib", str(tmp_path / "x.pt"), "--out", str(tmp_path / "out")]
    i = argv.index(flag) + 1
    argv[i] = argv[i] + "\x00z"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowbit: error:") and "NUL character" in err[0] and flag in err[0]


def test_prepare_fx_names_an_activation_factory_that_builds_no_observer() -> None:
    """Before: torch's "int is not a Module subclass" from ``add_submodule``."""
    qc = Q.get_default_qconfig()
    bad = Q.QConfigMapping().set_global(Q.QConfig(activation=lambda: 3, weight=qc.weight))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with pytest.raises(TypeError, match=r"prepare_fx: node 'input\w*': qconfig.activation\(\) built a builtins.int"):
        Q.prepare_fx(model, bad, example_inputs=(torch.rand(2, 8),))
