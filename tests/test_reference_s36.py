"""Session 36: graph-mode reference models keep their activation grids in ``state_dict``.

- ``convert_to_reference_fx`` wrote each activation grid as literal floats in the graph (the quantize node's
  args): a reference model's ``state_dict`` lacked its activation grids, and loading a checkpoint into a freshly
  converted reference model (another calibration) silently kept the fresh grids. The grids are now buffers read by
  ``get_attr`` nodes, named as torch.ao's ``convert_to_reference_fx`` names them (``conv_input_scale_0``,
  ``conv_scale_0``, ``_scale_0``, ...), and ``lower_reference`` reads them back from the buffers.
- A reference model moved with ``.double()`` failed with "Input type (float) and bias type (double)": it now runs
  in float64 on the same grids (float32 scales are exact in float64); ``.half()`` / ``.bfloat16()`` (which round the
  grids onto other values) are refused naming the call.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn
import torch.nn.functional as F

import lowbit as Q
import lowbit.reference as R
from lowbit import kernels


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.relu, self.fc = nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.conv(x)), 1))


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.fc = nn.Parameter(torch.randn(4, 8) * 0.3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w) + self.fc(x)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = Sub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(x)


def _calib(shape: tuple[int, ...], seed: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, *shape, generator=g) * (1 + seed) for _ in range(n)]


def _ref(model: nn.Module, shape: tuple[int, ...], seed: int) -> nn.Module:
    calib = _calib(shape, seed)
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), (calib[0],))
    with torch.no_grad():
        for c in calib:
            p(c)
    return Q.convert_to_reference_fx(p)


def _torch_ao_ref(model: nn.Module, shape: tuple[int, ...], seed: int) -> nn.Module:
    from torch.ao.quantization.quantize_fx import convert_to_reference_fx, prepare_fx
    calib = _calib(shape, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = prepare_fx(model, tq.get_default_qconfig_mapping("fbgemm"), (calib[0],))
        with torch.no_grad():
            for c in calib:
                p(c)
        return convert_to_reference_fx(p)


def _act_grid_keys(model: nn.Module) -> set[str]:
    return {k for k in model.state_dict() if "." not in k}  # root buffers: the activation (and F.linear weight) grids


_CONV_LINEAR_GRIDS = {"conv_input_scale_0", "conv_input_zero_point_0", "conv_scale_0", "conv_zero_point_0",
                      "fc_scale_0", "fc_zero_point_0"}
_NESTED_GRIDS = {"sub_input_scale_0", "sub_input_zero_point_0", "sub_scale_0", "sub_zero_point_0",  # F.linear's w
                 "sub_scale_1", "sub_zero_point_1", "sub_fc_scale_0", "sub_fc_zero_point_0",
                 "sub_scale_2", "sub_zero_point_2"}


@pytest.mark.parametrize("make,shape,grids,shared", [
    (ConvLinear, (3, 8, 8), _CONV_LINEAR_GRIDS, {"_scale_0": "conv_scale_0"}),
    (Nested, (8,), _NESTED_GRIDS, {})])
def test_activation_grids_are_buffers_named_as_torch_ao(make, shape, grids, shared) -> None:
    """The grids are root buffers read through get_attr, under torch.ao's names. torch.ao also observes flatten's
    output (``_scale_0``, the grid it shares with the conv's output); lowbit keeps the conv's grid there (no node)."""
    torch.manual_seed(0)
    model = make().eval()
    ref, theirs = _ref(model, shape, 0), _torch_ao_ref(model, shape, 0)
    assert _act_grid_keys(ref) == grids
    assert _act_grid_keys(theirs) == grids | set(shared) | {k.replace("scale", "zero_point") for k in shared}
    for extra, same in shared.items():  # torch.ao's extra observer holds the grid it shares
        assert torch.equal(theirs.get_buffer(extra), theirs.get_buffer(same))
    for node in ref.graph.nodes:  # every quantize / dequantize reads its grid through get_attr
        if node.op == "call_function" and getattr(node.target, "__module__", "") == R.ops.__name__:
            assert all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in node.args[1:3]), node.format_node()
    for k in grids:
        buf, their = ref.get_buffer(k), theirs.get_buffer(k)
        assert buf.dtype == their.dtype == (torch.float32 if "_scale_" in k else torch.int64), k
        assert buf.shape == their.shape, k


@pytest.mark.parametrize("make,shape", [(ConvLinear, (3, 8, 8)), (Nested, (8,))])
def test_state_dict_round_trip_into_a_fresh_reference_model_is_bit_identical(make, shape) -> None:
    torch.manual_seed(0)
    model = make().eval()
    ref, fresh = _ref(model, shape, 0), _ref(model, shape, 2)  # two calibrations: other grids
    x = _calib(shape, 5, 1)[0]
    assert not torch.equal(ref(x), fresh(x))
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    assert torch.equal(fresh(x), ref(x))
    # lowering reads the grids from the buffers: the loaded model lowers to the original's int8 model
    lowered, lowered_loaded = Q.lower_reference(ref), Q.lower_reference(fresh)
    sa, sb = lowered.state_dict(), lowered_loaded.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        a, b = sa[k], sb[k]
        if isinstance(a, torch.Tensor):
            a, b = (a.int_repr(), b.int_repr()) if a.is_quantized else (a, b)
            assert torch.equal(a, b), k
    with kernels.use_backend("reference"):
        assert torch.equal(lowered(x), lowered_loaded(x))


def test_lowered_reference_still_equals_convert_fx() -> None:
    torch.manual_seed(0)
    model = ConvLinear().eval()
    calib = _calib((3, 8, 8), 1)
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), (calib[0],))
    for c in calib:
        p(c)
    ref = Q.convert_to_reference_fx(p)
    direct, lowered = Q.convert_fx(p), Q.lower_reference(ref)
    assert not any(k for k in lowered.state_dict() if "_scale_" in k and "." not in k)  # grids went into the int8 modules
    x = _calib((3, 8, 8), 7, 1)[0]
    with kernels.use_backend("reference"):
        assert torch.equal(direct(x), lowered(x))
    out = [n for n in ref.graph.nodes if n.op == "call_function" and n.target is R.ops.dequantize_per_tensor][-1]
    step = float(ref.get_buffer(out.args[1].target))
    assert (ref(x) - direct(x)).abs().max() <= step * 1.001


def test_double_reference_model_runs_in_float64_on_the_same_grids() -> None:
    torch.manual_seed(0)
    ref = _ref(ConvLinear().eval(), (3, 8, 8), 0)
    x = _calib((3, 8, 8), 4, 1)[0]
    y = ref(x)
    moved = ref.double()
    assert moved.conv_scale_0.dtype == torch.float64
    y64 = moved(x.double())
    assert y64.dtype == torch.float64
    out = [n for n in ref.graph.nodes if n.op == "call_function" and n.target is R.ops.dequantize_per_tensor][-1]
    step = float(ref.get_buffer(out.args[1].target))
    assert (y64 - y.double()).abs().max() <= step * 1.001  # the same grids; float64 float arithmetic in between
    assert moved(x).dtype == torch.float64
    # the eager reference model too
    pe = Q.prepare(nn.Sequential(Q.QuantStub(), ConvLinear().eval(), Q.DeQuantStub()), Q.get_default_qconfig())
    pe(x)
    refe = Q.convert(pe, is_reference=True)
    assert refe.double()(x.double()).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_reference_model_is_refused_naming_the_call(dtype) -> None:
    torch.manual_seed(0)
    ref = _ref(ConvLinear().eval(), (3, 8, 8), 0)
    x = _calib((3, 8, 8), 4, 1)[0]
    moved = ref.to(dtype)
    with pytest.raises(TypeError, match=r"quantize_per_tensor: the grid's scale is torch\.(float16|bfloat16).*\.half\(\)"):
        moved(x.to(dtype))
    with pytest.raises(TypeError, match=r"lower_reference_fx: the grid's scale is torch\.(float16|bfloat16)"):
        Q.lower_reference(moved)
    pe = Q.prepare(nn.Sequential(Q.QuantStub(), ConvLinear().eval(), Q.DeQuantStub()), Q.get_default_qconfig())
    pe(x)
    refe = Q.convert(pe, is_reference=True).to(dtype)
    with pytest.raises(TypeError, match=r"grid's scale is torch\.(float16|bfloat16).*\.half\(\)"):
        refe(x.to(dtype))


def test_reference_model_with_grid_buffers_exports_and_compiles() -> None:
    """torch.export keeps the grids as the program's buffers (same outputs); torch.compile gives the same values."""
    torch.manual_seed(0)
    ref = _ref(ConvLinear().eval(), (3, 8, 8), 0)
    x = _calib((3, 8, 8), 4, 1)[0]
    ep = torch.export.export(ref, (x,))
    assert {"conv_scale_0", "conv_zero_point_0", "fc_scale_0"} <= set(ep.state_dict)
    assert torch.equal(ep.module()(x), ref(x))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(ref)(x), ref(x))
