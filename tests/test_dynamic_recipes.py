"""The dynamic Linear's 7-bit activation recipes (``nn/quantized/dynamic/reduced.py``).

``per_tensor_7bit`` (``get_dynamic_qconfig(backend="x86")``) is torch.ao's x86 dynamic Linear: its grid must be
fbgemm's (``torch._choose_qparams_per_tensor(x, reduce_range=True)``), its codes ``torch.quantize_per_tensor``'s,
and on torch's x86 engine its outputs torch.ao's bit for bit. ``per_token_7bit``
(``get_dynamic_qconfig(reduce_range=True)``) is lowbit's per-token recipe on ``quint8[0, 127]``: the fbgemm fast
path must use exactly the codes of ``quantize_per_token(x, U7)`` (checked through outputs equal to the pinned
reference backend up to float32 rounding: one code off moves an output by ~1e-3, the tolerance is 1e-5).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.nn.quantized.dynamic import Linear as DLinear
from lowbit.nn.quantized.dynamic import reduced
from lowbit.nn.quantized.dynamic.per_token import U7, quantize_per_token

from helpers import one_thread, roundtrip  # noqa: F401  (autouse fixture)

X86 = "fbgemm" in torch.backends.quantized.supported_engines


@pytest.fixture(autouse=True)
def x86_engine():
    if not X86:
        yield
        return
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    yield
    torch.backends.quantized.engine = old


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.zeros(3, 4), torch.ones(2, 3), -torch.ones(2, 3), torch.full((2, 2), 1e-9),
           torch.tensor([[1e-7, -2e-7]]), torch.tensor([[3e-3, -2e-3]]), torch.tensor([[1e-40, -1e-40]])]
    for i in range(300):
        scale = 10.0 ** (torch.rand((), generator=g).item() * 12 - 8)
        shift = (torch.rand((), generator=g).item() * 6 - 3) * scale * (i % 3)
        out.append(torch.randn(1 + i % 5, 1 + i % 37, generator=g) * scale + shift)
    return out


@pytest.mark.skipif(not X86, reason="torch built without fbgemm")
def test_ao_qparams_and_codes_are_torch_aos() -> None:
    bad = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for x in _inputs():
            s, z = torch._choose_qparams_per_tensor(x, True)
            s32 = float(torch.tensor(s, dtype=torch.float32))  # fbgemm runs the float32 scale
            mine = reduced.ao_qparams(x)
            codes = torch.quantize_per_tensor(x, s, z, torch.quint8).int_repr()
            if mine != (s32, z) or not torch.equal(reduced.ao_codes(x, *mine), codes):
                bad.append((x.abs().max().item(), (s32, z), mine))
    assert not bad, bad[:5]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 40)).eval()


@pytest.mark.skipif(not X86, reason="torch built without fbgemm")
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (70, 48), (2, 5, 48)])
def test_per_tensor_7bit_is_torch_aos_dynamic_linear_bit_for_bit(shape: tuple[int, ...]) -> None:
    m = _mlp()
    ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(m), {nn.Linear}, dtype=torch.qint8)
    q = Q.quantize_dynamic(m, {nn.Linear: Q.get_dynamic_qconfig(backend="x86")})
    assert q[0].activation == "per_tensor_7bit" and "activation=per_tensor_7bit" in repr(q[0])
    x = torch.randn(*shape) * 3 + 0.5
    kernels.counts.clear()
    y = q(x)
    assert torch.equal(y, ao(x))
    assert kernels.counts[("onednn", "linear")] == 2
    for backend in ("reference", "onednn", "int_mm"):  # the generic path: the same codes through lowbit.kernels
        with kernels.use_backend(backend):
            assert torch.allclose(q[0](x), ao[0](x), rtol=1e-5, atol=1e-5), backend


@pytest.mark.parametrize("m", [1, 3, 33, 300])
def test_per_token_7bit_fast_path_has_the_reference_codes(m: int) -> None:
    torch.manual_seed(m)
    lin = nn.Linear(64, 24)
    lin.qconfig = Q.get_dynamic_qconfig(reduce_range=True)
    q = DLinear.from_float(lin)
    assert q.activation == "per_token_7bit"
    x = torch.randn(m, 64) * torch.rand(m, 1) * 4 + torch.randn(m, 1)
    kernels.counts.clear()
    y = q(x)
    if X86:
        assert kernels.counts[("onednn", "linear")] == 1 and not kernels.counts[("reference", "linear")]
    with kernels.use_backend("reference"):
        ref = q(x)
    assert kernels.counts[("reference", "linear")] == 1
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    # the reference itself: x̂ ŵᵀ + b on the 7-bit per-token codes
    xq = quantize_per_token(x, U7)
    assert int(xq.int_repr().max()) <= 127 and xq.qdtype == U7
    expect = xq.dequantize() @ q.weight().dequantize().t() + q.bias
    assert torch.allclose(ref, expect, rtol=1e-5, atol=1e-5)


def test_per_token_7bit_row_blocks_are_the_whole_tensor_passes() -> None:
    # 1500×384 is three 1 MiB row blocks (682 rows each, the last partial): the blocked row min/max and u must be the
    # whole-tensor operations bit for bit, and the layer (u in the thread's kept scratch) must not alias its output
    from lowbit.nn.quantized.dynamic.per_token import _LEVELS, _row_grids

    torch.manual_seed(0)
    x = torch.randn(1500, 384) * torch.rand(1500, 1) * 4 + torch.randn(1500, 1)
    x[0] = 0.0
    x[700] = 2.5  # a constant row in the second block
    (s, nz), (s_b, nz_b) = _row_grids(x, _LEVELS[127]), _row_grids(x, _LEVELS[127], blocked=True)
    assert torch.equal(s, s_b) and torch.equal(nz, nz_b)
    u = reduced._u7(x, s, nz)
    assert torch.equal(u, torch.mul(x, torch.reciprocal(s)).sub_(nz).clamp_max_(127))
    lin = nn.Linear(384, 40)
    lin.qconfig = Q.get_dynamic_qconfig(reduce_range=True)
    q = DLinear.from_float(lin)
    y = q(x)
    y_other = q(torch.randn(900, 384))  # another call through the same scratch
    assert torch.equal(q(x), y) and y_other.shape == (900, 40)
    with kernels.use_backend("reference"):
        ref = q(x)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    x[1499, 7] = float("nan")  # a non-finite row in the last block: the generic path, NaN in that row only
    y_nan = q(x)
    assert bool(y_nan[1499].isnan().all()) and torch.allclose(y_nan[:1499], ref[:1499], rtol=1e-5, atol=1e-5)


def test_quantize_per_token_7bit_matches_calculate_qparams_and_quantize() -> None:
    x = torch.randn(20, 33) * torch.logspace(-3, 2, 20)[:, None]
    x[3] = 0.0
    x[4] = x[4].abs()
    xq = quantize_per_token(x, U7)
    scale, zp = Q.calculate_qparams(x.amin(1), x.amax(1), Q.QScheme.PER_CHANNEL_AFFINE, U7)
    assert torch.equal(xq.scale, scale) and torch.equal(xq.zero_point, zp)
    assert torch.equal(xq.int_repr(), Q.quantize_per_channel(x, scale, zp, 0, U7).int_repr())
    with pytest.raises(ValueError, match="qdtype=lowbit.qint8"):
        quantize_per_token(x, Q.qint8)


def test_recipes_follow_the_engine_the_pin_and_the_weights() -> None:
    lin = nn.Linear(32, 16)
    x = torch.randn(9, 32)
    for qc in (Q.get_dynamic_qconfig(reduce_range=True), Q.get_dynamic_qconfig(backend="x86")):
        lin.qconfig = qc
        q = DLinear.from_float(lin)
        y = q(x)
        old = torch.backends.quantized.engine
        torch.backends.quantized.engine = "qnnpack" if "qnnpack" in torch.backends.quantized.supported_engines else old
        try:
            kernels.counts.clear()
            assert torch.allclose(q(x), y, rtol=1e-5, atol=1e-5)  # another engine: the generic path
        finally:
            torch.backends.quantized.engine = old
        sd = roundtrip(q)
        fresh = DLinear(32, 16, activation=q.activation)
        fresh.load_state_dict(sd)
        assert torch.equal(fresh(x), y)


def test_pt2_op_carries_the_recipe() -> None:
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    for act in ("per_token_7bit", "per_tensor_7bit"):
        lin.qconfig = (Q.get_dynamic_qconfig(reduce_range=True) if act == "per_token_7bit"
                       else Q.get_dynamic_qconfig(backend="x86"))
        q = DLinear.from_float(lin)
        y = torch.ops.lowbit.dynamic_linear(x, q.weight_int8, q.weight_scale, q.weight_zero_point,
                                            f"qint8:-128:127|{act}", q.bias)
        assert torch.equal(y, q(x))


def test_recipe_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="activation='per_row'"):
        DLinear(4, 4, activation="per_row")
    with pytest.raises(ValueError, match="backend='qnnpack'"):
        Q.get_dynamic_qconfig(backend="qnnpack")
    with pytest.raises(TypeError, match="reduce_range=1"):
        Q.get_dynamic_qconfig(reduce_range=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not apply"):
        Q.get_dynamic_qconfig(torch.float16, reduce_range=True)
    with pytest.raises(TypeError, match="per_token='no'"):
        Q.PlaceholderObserver(is_dynamic=True, per_token="no")  # type: ignore[arg-type]
    lin = nn.Linear(4, 4)
    lin.qconfig = Q.QConfig(activation=Q.PlaceholderObserver.with_args(is_dynamic=True, per_token=False),
                            weight=Q.get_dynamic_qconfig().weight)
    with pytest.raises(ValueError, match=r"quint8\[0, 127\]"):
        DLinear.from_float(lin)
    assert DLinear.from_float(nn.Linear(4, 4)).activation == "per_token"  # no qconfig: lowbit's default


def test_onnx_export_refuses_the_7bit_recipes_instead_of_exporting_8bit_numerics() -> None:
    from lowbit.export.dynamic import DynamicLinearTwin

    lin = nn.Linear(8, 4)
    lin.qconfig = Q.get_dynamic_qconfig(reduce_range=True)
    with pytest.raises(ValueError, match="activation='per_token_7bit'"):
        DynamicLinearTwin(DLinear.from_float(lin), "auto")
    DynamicLinearTwin(DLinear.from_float(nn.Linear(8, 4)), "auto")  # the default recipe exports


def test_prepare_convert_and_fx_carry_the_recipe() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    for qc, act in ((Q.get_dynamic_qconfig(backend="x86"), "per_tensor_7bit"),
                    (Q.get_dynamic_qconfig(reduce_range=True), "per_token_7bit")):
        qm = Q.QConfigMapping().set_global(qc)
        eager = Q.convert(Q.prepare(copy.deepcopy(m), qm))
        fx = Q.convert_fx(Q.prepare_fx(copy.deepcopy(m), qm, (x,)))
        assert [mod.activation for mod in fx.modules() if isinstance(mod, DLinear)] == [act, act]
        assert eager[0].activation == act and torch.equal(eager(x), fx(x))
