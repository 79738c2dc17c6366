"""Session 37: graph mode quantizes nn.MultiheadAttention and torch's transformer layers / stacks.

torch.fx keeps these modules leaves, so ``prepare_fx`` / ``convert_fx`` / ``quantize_ptq`` left them float (with a
misleading "no quantizable op got a qconfig" warning). ``prepare_fx`` now swaps each for a traceable twin
(``lowbit.fx.attention`` / ``lowbit.fx.transformer``) whose projections and FFN Linears quantize like any Linear.
Oracles: the float module itself (the prepared model, observers the identity, must give its outputs), and the
cosine / SQNR of the int8 model against it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.fx import convert_fx, prepare_fx, prepare_qat_fx

QC = Q.get_default_qconfig_mapping()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return (10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - out.double()).pow(2).sum())).item()


pytestmark = pytest.mark.usefixtures("mha_slow_path")  # (tests/conftest.py: torch's module-by-module path)


class Attn(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, need_weights: bool, average: bool = True) -> None:
        super().__init__()
        self.mha, self.need_weights, self.average = mha, need_weights, average

    def forward(self, q, k, v, kpm, mask):
        return self.mha(q, k, v, key_padding_mask=kpm, attn_mask=mask, need_weights=self.need_weights,
                        average_attn_weights=self.average)


def _mask(kind: str, rows: int, tgt: int, src: int, g: torch.Generator):
    if kind == "none":
        return None
    shape = (tgt, src) if kind.endswith("2d") else (rows, tgt, src)
    drop = torch.rand(shape, generator=g) < 0.3
    drop[..., 0] = False  # every query sees a key
    if kind.startswith("bool"):
        return drop
    return torch.where(drop, torch.tensor(-1e4), torch.randn(shape, generator=g) * 0.1)


CASES = [  # batch_first, kdim/vdim, bias, add_bias_kv, add_zero_attn, key padding, attn mask, need_weights, average
    (True, None, True, False, False, "bool", "none", False, True),
    (False, None, True, False, False, "float", "bool2d", True, True),
    (True, (12, 20), True, False, False, "bool", "float3d", True, False),
    (False, (12, 20), False, False, False, "none", "float2d", False, True),
    (True, None, True, True, False, "bool", "bool2d", True, True),
    (False, None, True, False, True, "float", "float3d", True, False),
    (True, (12, 20), False, True, True, "bool", "bool3d", True, True),
]


@pytest.mark.parametrize("case", CASES)
def test_mha_prepared_matches_float_and_int8_is_close(case):
    bf, kv, bias, bias_kv, zero_attn, kpm_kind, mask_kind, need_weights, average = case
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    e, heads, n, lt, ls = 16, 4, 3, 5, 7
    kdim, vdim = kv or (None, None)
    mha = nn.MultiheadAttention(e, heads, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim,
                                vdim=vdim, batch_first=bf)
    if bias_kv:  # (torch initialises them with xavier: keep them, they are weights)
        assert mha.bias_k is not None
    model = Attn(mha, need_weights, average).eval()

    def inputs(n=n):
        def lay(length, dim):
            return torch.randn((n, length, dim) if bf else (length, n, dim), generator=g)

        q, k, v = lay(lt, e), lay(ls, kdim or e), lay(ls, vdim or e)
        kpm = None if kpm_kind == "none" else (torch.rand(n, ls, generator=g) < 0.3)
        if kpm is not None:
            kpm[:, 0] = False
            if kpm_kind == "float":
                kpm = kpm.float() * -1e4
        return q, k, v, kpm, _mask(mask_kind, n * heads, lt, ls, g)

    example = inputs()
    prepared = prepare_fx(model, QC, example)
    assert isinstance(prepared.mha.linear_Q, nn.Linear)
    with torch.no_grad():
        ref, got = model(*example), prepared(*example)
    assert torch.allclose(got[0], ref[0], atol=2e-6, rtol=1e-5)
    if need_weights:
        assert got[1].shape == ref[1].shape and torch.allclose(got[1], ref[1], atol=1e-6)
    else:
        assert got[1] is None
    for _ in range(16):  # (calibration sees ~1,000 tokens: 8-bit grids on random data)
        prepared(*inputs(16))
    qmodel = convert_fx(prepared)
    for name in ("linear_Q", "linear_K", "linear_V", "out_proj"):
        assert isinstance(getattr(qmodel.mha, name), nnq.Linear), name
    test = inputs()
    with torch.no_grad():
        ref, out = model(*test), qmodel(*test)
    assert _cos(ref[0], out[0]) >= 0.999, (_cos(ref[0], out[0]), _sqnr(ref[0], out[0]))
    if need_weights:
        assert (ref[1] - out[1]).abs().max() < 0.05


def test_mha_unbatched_and_root_and_need_weights_default():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2).eval()
    x = torch.randn(6, 16)  # unbatched (L, E)
    prepared = prepare_fx(mha, QC, (x, x, x))
    with torch.no_grad():
        ref, got = mha(x, x, x), prepared(x, x, x)
    assert torch.allclose(got[0], ref[0], atol=2e-6) and torch.allclose(got[1], ref[1], atol=1e-6)
    for _ in range(4):
        y = torch.randn(6, 16)
        prepared(y, y, y)
    q = convert_fx(prepared)
    assert isinstance(q.linear_Q, nnq.Linear)
    with torch.no_grad():
        assert _cos(mha(x, x, x)[0], q(x, x, x)[0]) >= 0.999


def test_twin_state_is_the_modules_and_refuses_one_sided_bias_kv():
    from lowbit.fx.attention import TracedMultiheadAttention

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, kdim=4, vdim=6, add_bias_kv=True)
    twin = TracedMultiheadAttention.from_float(mha)
    assert torch.equal(twin.linear_K.weight, mha.k_proj_weight) and torch.equal(twin.linear_V.bias,
                                                                                 mha.in_proj_bias[16:])
    assert torch.equal(twin.bias_v, mha.bias_v) and twin.kdim == 4 and twin.vdim == 6
    mha.bias_v = None
    with pytest.raises(ValueError, match="only one of bias_k / bias_v"):
        TracedMultiheadAttention.from_float(mha)


class Enc(nn.Module):
    def __init__(self, layer: nn.Module, num_layers: int, norm: bool) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(layer.linear1.in_features)
                                         if norm else None, enable_nested_tensor=False)

    def forward(self, x, mask, kpm):
        return self.enc(x, mask=mask, src_key_padding_mask=kpm)


@pytest.mark.parametrize("bf,norm_first,act", [(True, False, "relu"), (False, True, "gelu"), (True, True, F.silu)])
def test_encoder_stack_quantizes_its_linears(bf, norm_first, act):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, activation=act, batch_first=bf, norm_first=norm_first)
    model = Enc(layer, 2, norm=norm_first).eval()
    float_keys = set(model.state_dict())

    def inputs():
        x = torch.randn((3, 6, 16) if bf else (6, 3, 16), generator=g)
        kpm = torch.zeros(3, 6, dtype=torch.bool)
        kpm[0, 4:] = True
        return x, nn.Transformer.generate_square_subsequent_mask(6), kpm

    example = inputs()
    prepared = prepare_fx(model, QC, example)
    assert set(model.state_dict()) == float_keys  # the user's model is left as it was (inplace=False)
    assert isinstance(model.enc.layers[0].self_attn, nn.MultiheadAttention)
    with torch.no_grad():
        assert torch.allclose(prepared(*example), model(*example), atol=1e-5)
    for _ in range(8):
        prepared(*inputs())
    qmodel = convert_fx(prepared)
    for i in range(2):
        lay = getattr(qmodel.enc.layers, str(i))  # (a GraphModule's container: no indexing)
        for m in (lay.self_attn.linear_Q, lay.self_attn.linear_K, lay.self_attn.linear_V, lay.self_attn.out_proj,
                  lay.linear1, lay.linear2):
            assert isinstance(m, nnq.Linear)
    assert isinstance(getattr(qmodel.enc.layers, "0").norm1, nn.LayerNorm)
    keys = set(qmodel.state_dict())
    assert "enc.layers.1.self_attn.linear_Q.weight_int8" in keys and "enc.layers.0.linear2.weight_int8" in keys
    test = inputs()
    with torch.no_grad():
        ref, out = model(*test), qmodel(*test)
    assert _cos(ref, out) >= 0.999, (_cos(ref, out), _sqnr(ref, out))


def test_decoder_and_transformer_quantize():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    model = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=24, dropout=0.0,
                           batch_first=True).eval()

    def inputs():
        src, tgt = torch.randn(2, 7, 16, generator=g), torch.randn(2, 5, 16, generator=g)
        mpm = torch.zeros(2, 7, dtype=torch.bool)
        mpm[1, 5:] = True
        return src, tgt, None, nn.Transformer.generate_square_subsequent_mask(5), None, mpm, None, mpm

    example = inputs()
    prepared = prepare_fx(model, QC, example)
    with torch.no_grad():
        assert torch.allclose(prepared(*example), model(*example), atol=1e-5)
    for _ in range(8):
        prepared(*inputs())
    qmodel = convert_fx(prepared)
    dec = getattr(qmodel.decoder.layers, "1")
    for m in (dec.self_attn.linear_Q, dec.multihead_attn.linear_K, dec.multihead_attn.out_proj, dec.linear1):
        assert isinstance(m, nnq.Linear)
    test = inputs()
    with torch.no_grad():
        ref, out = model(*test), qmodel(*test)
    assert _cos(ref, out) >= 0.999, (_cos(ref, out), _sqnr(ref, out))


def test_qconfig_settings_reach_the_twins_linears():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    mapping = Q.get_default_qconfig_mapping().set_module_name("self_attn.out_proj", None)
    prepared = prepare_fx(layer, mapping, (x,))
    prepared(x)
    q = convert_fx(prepared)
    assert isinstance(q.self_attn.linear_V, nnq.Linear) and type(q.self_attn.out_proj) is nn.Linear
    # excluding the attention by type keeps torch's module (float), as the user asked
    mapping = Q.get_default_qconfig_mapping().set_object_type(nn.MultiheadAttention, None)
    prepared = prepare_fx(layer, mapping, (x,))
    assert isinstance(prepared.self_attn, nn.MultiheadAttention)
    prepared(x)
    assert isinstance(convert_fx(prepared).linear1, nnq.Linear)
    # the twin's own Linears can be named (the name check sees the swapped model)
    mapping = Q.get_default_qconfig_mapping().set_module_name("self_attn.linear_K", None)
    prepared = prepare_fx(layer, mapping, (x,))
    prepared(x)
    q = convert_fx(prepared)
    assert type(q.self_attn.linear_K) is nn.Linear and isinstance(q.self_attn.linear_Q, nnq.Linear)
    # a declared non-traceable attention stays torch's module, float, without the "stay float" warning
    cfg = Q.PrepareCustomConfig().set_non_traceable_module_names(["self_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        prepared = prepare_fx(layer, QC, (x,), prepare_custom_config=cfg)
    assert isinstance(prepared.self_attn, nn.MultiheadAttention) and prepared.self_attn.qconfig is None


def test_subclass_is_named_in_a_warning():
    class MyMHA(nn.MultiheadAttention):
        pass

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.att, self.fc = MyMHA(8, 2), nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.att(x, x, x)[0])

    x = torch.randn(3, 2, 8)
    with pytest.warns(UserWarning, match=r"'att' \(MyMHA\) stay float"):
        prepare_fx(M().eval(), QC, (x,))


def test_qat_and_quantize_ptq():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    qat = prepare_qat_fx(layer, Q.get_default_qat_qconfig_mapping(), (x,))
    assert qat.training
    qat(x).sum().backward()
    assert qat.self_attn.linear_Q.weight.grad is not None
    assert isinstance(convert_fx(qat.eval()).self_attn.linear_K, nnq.Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no quantizable op got a qconfig"
        qmodel, _ = Q.quantize_ptq(layer.eval(), [(torch.randn(2, 5, 16),) for _ in range(4)], recipe="default",
                                   progress=False)
    assert isinstance(qmodel.self_attn.linear_Q, nnq.Linear)
    with torch.no_grad():
        assert _cos(layer(x), qmodel(x)) >= 0.999
