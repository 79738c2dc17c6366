"""Session 36's deployment sweep: products of the workflows (quantize_ptq's mixed-precision twins, keep_faster's
float fallbacks, reference models) through the deployment routes (state_dict into a freshly converted model,
``.double()`` / ``.half()``, ``to_onnx``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug.mixed_precision import _FloatTwin
from lowbit.export import to_onnx
from lowbit.speed_guard import FloatFallback, keep_faster


def _calib(seed: int, shape: tuple[int, ...] = (16, 16)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * (1 + seed) for _ in range(2)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Q.QuantStub(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 8),
                         Q.DeQuantStub()).eval()


def _converted(seed: int) -> tuple[nn.Module, nn.Module]:
    """A static int8 MLP calibrated on ``seed``'s data (so its grids depend on the seed), and its float model."""
    f = _mlp()
    p = Q.prepare(copy.deepcopy(f), Q.get_default_qconfig())
    for x in _calib(seed):
        p(x)
    return Q.convert(p), f


def _with_twin(seed: int) -> nn.Module:
    """Layer '3' kept float the way ``quantize_ptq(max_float_layers=...)`` keeps it: a ``_FloatTwin`` that puts
    its output back on the int8 layer's output grid (read by the int8 layer '4')."""
    q, f = _converted(seed)
    q[3] = _FloatTwin(copy.deepcopy(f[3]), q[3], float_out=False)
    return q


def _with_fallback(seed: int) -> nn.Module:
    q, f = _converted(seed)
    table = {"3": (2.0, 1.0), "<model>": (2.0, 1.0)}  # layer '3' "faster in float", the swaps win as a whole
    keep_faster(q, f, torch.randn(4, 16), timer=lambda name, a, b: table.get(name, (1.0, 2.0)))
    assert isinstance(q[3], FloatFallback) and q[3].out is not None
    return q


@pytest.mark.parametrize("build", [_with_twin, _with_fallback], ids=["float_twin", "float_fallback"])
def test_float_layer_output_grid_travels_in_state_dict(build) -> None:
    """The float layer's output grid was a Python tuple: a checkpoint loaded into a freshly converted model kept
    the fresh model's grid there, and every output after it silently differed. Now the grid is a buffer pair."""
    src, dst = build(0), build(1)
    assert src[3].out if isinstance(src[3], FloatFallback) else src[3].grid
    x = torch.randn(5, 16)
    with torch.no_grad():
        ref = src(x)
        assert not torch.equal(dst(x), ref)  # (the grids differ: the test can tell)
        state = {k: v.clone() for k, v in src.state_dict().items()}
        assert any(k.startswith("3.requant.") for k in state)
        dst.load_state_dict(torch.load(_roundtrip(state), weights_only=True))
        assert torch.equal(dst(x), ref)
        grid = src[3].out if isinstance(src[3], FloatFallback) else src[3].grid
        assert grid == (dst[3].out if isinstance(dst[3], FloatFallback) else dst[3].grid)
    for route in (copy.deepcopy(src), torch.compile(src, fullgraph=True, dynamic=False)):
        with torch.no_grad():
            assert torch.equal(route(x), ref)


def _roundtrip(state: dict) -> object:
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("build", [_with_twin, _with_fallback], ids=["float_twin", "float_fallback"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_float_layer_in_a_moved_model_runs(build, dtype: torch.dtype) -> None:
    """``.to(float64)`` / ``.half()`` moves the float layer but not the int8 ones (their state keeps its dtypes):
    the float layer got float32 from its int8 neighbour and failed deep in torch (``mat1 and mat2 must have the
    same dtype``). It now runs in its own dtype and gives float32 back, as the int8 layer it stands for."""
    q = build(0)
    x = torch.randn(5, 16).to(dtype)
    with torch.no_grad():
        ref = q(x)
        moved = copy.deepcopy(q).to(dtype)
        assert moved[3].float_mod.weight.dtype == dtype if isinstance(q[3], _FloatTwin) else \
            moved[3].module.weight.dtype == dtype
        got = moved(x)
    assert got.dtype == ref.dtype == torch.float32
    step = float(q[4].scale)  # the output grid of the last int8 layer
    assert (got - ref).abs().max() <= step + 1e-6


def test_reference_model_to_onnx_refuses_and_names_the_lowering(tmp_path) -> None:
    """A ``convert_to_reference_fx`` model failed deep in TorchScript's exporter (``aten::int_repr`` is not
    supported); ``to_onnx`` now names the reference op and ``lower_reference``, which exports."""
    pytest.importorskip("onnx")
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    x = torch.randn(4, 16)
    p = Q.prepare_fx(f, Q.get_default_qconfig_mapping(), (x,))
    for c in _calib(0):
        p(c)
    ref = Q.convert_to_reference_fx(p)
    with pytest.raises(TypeError, match=r"reference (op|model).*lower_reference"):
        to_onnx(ref, (x,), tmp_path / "ref.onnx")
    assert not (tmp_path / "ref.onnx").exists()
    lowered = Q.lower_reference(ref)
    to_onnx(lowered, (x,), tmp_path / "lowered.onnx")
    assert (tmp_path / "lowered.onnx").exists()


def test_eager_reference_model_to_onnx_refuses(tmp_path) -> None:
    p = Q.prepare(_mlp(), Q.get_default_qconfig())
    for c in _calib(0):
        p(c)
    ref = Q.convert(p, is_reference=True)
    with pytest.raises(TypeError, match=r"module '.*'.*reference model.*lower_reference"):
        to_onnx(ref, (torch.randn(2, 16),), tmp_path / "ref.onnx")
