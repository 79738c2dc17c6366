"""Session 45 (review45): hostile inputs on session 44's new code. Each group failed before its fix:

- an attention mask entering a child graph (its parent does not trace) whose example batch has no padding: the
  child's input ``ext`` is all zeros there, so it was no mask and ``scores + ext`` got an int8 grid of scale ~40 from
  the padded calibration batches (25.3 dB against fp32; 43.9 with a padded example); now 43.9 both ways
  (``fx/masks.py``: a child graph's all-zero float input counts as a mask);
- ``quantize_ptq(recipe="accurate")`` with a calibration batch after the first that the model cannot run: the
  equalization step (it runs every batch before calibration) raised the model's bare error (``mat1 and mat2 shapes
  cannot be multiplied``, ``RuntimeError`` from the child) instead of the other recipes' "calib batch 1 (input
  shapes ...) failed in the model";
- ``QTensor.view(torch.qint8 / torch.quint8 / torch.quint4x2 / torch.bits8)`` returned a tensor of that dtype without
  a grid (``NotImplementedError`` on any use, a crash on some); now torch's name of the QTensor's own grid gives the
  QTensor and the others a ``ValueError`` naming the dtype;
- ``scaled_operand`` (add / sub ``alpha`` on codes) with a string / ``None`` / many-element tensor ``alpha``: Python's
  ``bad operand type for abs()`` or torch's ambiguous truth value, now a ``TypeError`` naming ``alpha``;
- a checkpoint whose ``_metadata`` entry for a module is not a dict: ``dictionary update sequence element #0 ...``
  from lowbit's load pre-check, now a ``StateDictError`` naming the module.
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import lowbit as Q
from lowbit.nn.quantized.add_alpha import scaled_operand
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from test_mask_s44 import _data, _Layer
from test_untrace_s44 import _Branch, _Child, _model


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


# ---- attention masks in a child graph, padding-free example ----
class _Enc(nn.Module):
    """Two untraceable layers (``_Layer(split=True)``); ``given``: the additive mask is the model's input."""

    def __init__(self, given: bool) -> None:
        super().__init__()
        self.layers, self.given = nn.ModuleList([_Layer(True), _Layer(True)]), given

    def forward(self, x, mask):
        ext = mask if self.given else (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, ext)
        return x


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("padded_example", [False, True])
def test_child_graph_mask_stays_float_with_a_padding_free_example(given, padded_example):
    torch.manual_seed(0)
    model = _Enc(given).eval()
    x, m = _data()
    ms = (1.0 - m[:, :, None, None, :].float()) * -1e4 if given else m
    calib = [(x[i], ms[i]) for i in range(4)]
    example = calib[0] if padded_example else (x[0], torch.zeros_like(ms[0]) if given else torch.ones_like(m[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=example)
        with torch.no_grad():
            for c in calib:
                p(*c)
        q = Q.convert_fx(p)
        with torch.no_grad():
            db = _sqnr(model(x[4], ms[4]), q(x[4], ms[4]))
    assert db > 42.0, f"{db:.1f} dB"  # 43.9 (25.3 before with a padding-free example)
    scales = {n: float(mod.scale.max()) for n, mod in q.named_modules() if isinstance(getattr(mod, "scale", None),
                                                                                      torch.Tensor)}
    assert max(scales.values()) < 1.0, scales  # (39.99 before: the sum's grid spanned -1e4)
    assert "'add'" not in q.get_submodule("layers.0.sc").code
    why = p.lowbit_report.left_float
    assert any(k.startswith("layers.0.sc") and "ext" in v for k, v in why.items()), why


# ---- quantize_ptq(recipe="accurate"): a later batch the model cannot run ----
@pytest.mark.parametrize("cls, traceable", [(_Branch, True), (_Branch, False), (_Child, False)])
def test_accurate_recipe_names_a_later_batch_the_model_cannot_run(cls, traceable):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, 6, 6, generator=g).abs(), torch.randn(4, 3, 10, 10, generator=g).abs()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"quantize_ptq: calib batch 1 \(input shapes \[\(4, 3, 10, 10\)\]\) "
                                             r"failed in the model: RuntimeError: mat1 and mat2"):
            Q.quantize_ptq(_model(cls, traceable), batches, recipe="accurate", iters=2, refine=1, progress=False)


def test_accurate_recipe_runs_as_before_when_every_batch_runs():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, 6, 6, generator=g).abs() for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, report = Q.quantize_ptq(_model(_Branch), batches, recipe="accurate", iters=2, refine=1, progress=False)
    assert any(step == "equalize" for step, _ in report.steps)


# ---- QTensor.view with torch's quantized dtypes ----
@pytest.mark.parametrize("qdtype", [Q.qint8, Q.quint8])
def test_qtensor_view_torch_name_of_its_grid_is_the_same_qtensor(qdtype):
    x = torch.randn(2, 4, 3, 3)
    q = Q.quantize_per_tensor(x, 0.05, 0 if qdtype.signed else 128, qdtype)
    v = q.view(torch.qint8 if qdtype.signed else torch.quint8)
    assert type(v) is type(q) and v.qdtype == q.qdtype and torch.equal(v.int_repr(), q.int_repr())
    assert torch.equal(v.dequantize(), q.dequantize())


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2, torch.quint2x4, torch.bits8, torch.qint32])
def test_qtensor_view_other_quantized_dtypes_are_refused(dtype):
    q = Q.quantize_per_tensor(torch.randn(2, 4), 0.05, 0, Q.qint8)
    with pytest.raises(ValueError, match=rf"QTensor.view\(dtype={dtype!r}\)"):
        q.view(dtype)


# ---- scaled_operand's alpha ----
@pytest.mark.parametrize("alpha", ["2", None, torch.tensor([1.0, 2.0]), [2.0], 1 + 2j])
def test_scaled_operand_names_an_alpha_that_is_no_number(alpha):
    qx = Q.quantize_per_tensor(torch.randn(4, 6), 0.05, 128, Q.quint8)
    with pytest.raises(TypeError, match=r"scaled_operand: alpha must be a real number .* got "
                                        + type(alpha).__name__):
        scaled_operand(qx, alpha)


@pytest.mark.parametrize("alpha", [-1, 2.0, -0.5, 0.0, -0.0, float("nan"), float("inf"), torch.tensor(2.0), True])
def test_scaled_operand_numbers_are_alpha_times_the_value(alpha):
    qx = Q.quantize_per_tensor(torch.randn(4, 6), 0.05, 128, Q.quint8)
    got = scaled_operand(qx, alpha)
    got = got.dequantize() if hasattr(got, "dequantize") else got
    want = qx.dequantize() * alpha
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


# ---- load pre-check: a _metadata entry that is not a dict ----
def test_state_dict_metadata_entry_not_a_dict_is_named():
    torch.manual_seed(0)
    data = [torch.randn(5, 16)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, _ = Q.quantize_ptq(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval(), data,
                              progress=False)
    sd = q.state_dict()
    bad = collections.OrderedDict(sd)
    bad._metadata = copy.deepcopy(sd._metadata)
    bad._metadata["0"] = "x"
    with pytest.raises(Q.state_check.StateDictError, match=r"0: the checkpoint's _metadata entry must be a dict .* "
                                                           r"got str 'x'"):
        q.load_state_dict(bad)
