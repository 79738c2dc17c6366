"""Session 37 sweep: static int8 (graph mode) of tiny transformer encoders / decoders built in the test (never
downloaded): padding left out of calibration, SmoothQuant statistics on real tokens, half / bfloat16 models refused
up front."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit as Q
from lowbit.algorithms.smoothquant import _collect
from lowbit.fx import padding

transformers = pytest.importorskip("transformers")

V = 100


def _bert(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def _grids(prepared: torch.nn.Module) -> dict[str, tuple[float, float]]:
    return {n: (float(o.min_val), float(o.max_val)) for n, o in prepared.named_modules()
            if isinstance(o, Q.observer.ObserverBase) and n.rpartition(".")[2].startswith("activation_post_process")}


def _prepare(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.nn.Module:
    mapping = Q.QConfigMapping().set_global(Q.get_calibration_qconfig("minmax", "minmax"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BertModel's parts cannot be traced: prepared one by one
        return Q.prepare_fx(model, mapping, example_inputs=(ids, mask))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("as_kwargs", [True, False])
def test_padded_tokens_do_not_set_activation_grids(side: str, as_kwargs: bool) -> None:
    """A batch padded to 3x its length (right or left, the mask passed by keyword or position) calibrates every
    activation grid as the unpadded batch does (padded tokens' hidden states widened 14 of 27 grids before)."""
    model = _bert()  # (seeds the ids too)
    ids = torch.randint(1, V, (4, 8))
    fill = torch.zeros(4, 24, dtype=torch.long)  # 32 tokens = hidden: the pooled (batch, hidden) input is still not filtered
    pad = torch.cat([ids, fill], 1) if side == "right" else torch.cat([fill, ids], 1)
    mask = (pad != 0).long()
    pos = (mask.cumsum(1) - 1).clamp_min(0)  # left padding keeps the real tokens' positions (as generation does)
    ref = _prepare(model, ids, torch.ones_like(ids))
    ref(input_ids=ids, attention_mask=torch.ones_like(ids))
    p = _prepare(model, pad, mask)
    with torch.no_grad():
        p(input_ids=pad, attention_mask=mask, position_ids=pos) if as_kwargs else p(pad, mask, None, pos)
    g_ref, g_pad = _grids(ref), _grids(p)
    assert len(g_ref) == 27 and g_ref.keys() == g_pad.keys()
    for k in g_ref:
        if side == "left" and k.startswith("pooler"):  # BertPooler reads token 0: a pad token under left padding
            continue
        assert g_pad[k] == pytest.approx(g_ref[k], rel=1e-5, abs=1e-7), k
    assert padding.current() is None  # the mask lives for the call only
    q = Q.convert_fx(p)
    assert padding._push not in q._forward_pre_hooks.values() and padding._pop not in q._forward_hooks.values()
    with torch.no_grad():  # the real tokens' outputs do not depend on the padding
        a = q(input_ids=pad, attention_mask=mask, position_ids=pos).last_hidden_state[mask.bool()]
        b = Q.convert_fx(ref)(input_ids=ids).last_hidden_state.reshape(-1, 32)
        f = model(input_ids=ids).last_hidden_state.reshape(-1, 32)
    cos = torch.nn.functional.cosine_similarity(a.double(), f.double(), dim=1)
    assert float(cos.min()) > 0.999, float(cos.min())
    assert torch.allclose(a, b, atol=1e-3)


def test_padding_observers_without_mask_and_all_padding_batch() -> None:
    """No mask (or an all-1 mask) observes everything as before; an all-padding sequence adds nothing; a padded
    row's NaN cannot reach a grid (rows are dropped, not weighted by 0)."""
    obs = Q.observer.MinMaxObserver()
    padding.hook_observers(torch.nn.ModuleDict({"activation_post_process_0": obs}))
    x = torch.tensor([[[1.0], [50.0]], [[float("nan")], [-60.0]]])  # (2, 2, 1)
    mask = torch.tensor([[True, False], [False, False]])
    padding._stack().append(mask)
    try:
        assert obs(x) is x  # the full tensor flows on
    finally:
        padding._stack().pop()
    assert (float(obs.min_val), float(obs.max_val)) == (1.0, 1.0)
    with pytest.warns(UserWarning, match="NaN"):  # no mask: everything is observed
        obs(x)
    assert (float(obs.min_val), float(obs.max_val)) == (-60.0, 50.0)
    assert padding._as_mask(torch.ones(2, 3)) is None and padding._as_mask(torch.full((2, 3), -1e9)) is None
    flat = torch.arange(4.0).reshape(4, 1)  # tokens flattened into rows
    assert padding.real_rows(flat, mask).flatten().tolist() == [0.0]
    assert padding.real_rows(torch.zeros(2, 2), mask) is None  # (batch, hidden) with hidden == tokens: not filtered


def test_smooth_quant_statistics_skip_padding() -> None:
    """smooth_quant's per-channel max|x| of each Linear's input ignores padded tokens (dict or positional mask):
    before, padding moved a channel's max by 81 % and with it s."""
    model = _bert()
    torch.manual_seed(2)
    ids = torch.randint(1, V, (4, 8))
    pad = torch.cat([ids, torch.zeros(4, 13, dtype=torch.long)], 1)
    mask = (pad != 0).long()
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = _collect(model, [{"input_ids": ids}], names)
        kw, _ = _collect(model, [{"input_ids": pad, "attention_mask": mask}], names)
        pos, _ = _collect(model, [(pad, mask)], names)
    for n in names:
        if n == "pooler.dense":  # reads the first token only
            continue
        torch.testing.assert_close(kw[n], ref[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pos[n], ref[n], rtol=1e-5, atol=1e-6)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_models_are_refused_before_any_work(dtype: torch.dtype) -> None:
    """A half / bfloat16 model prepared for static int8 converted, then failed in its first forward deep inside a
    LayerNorm ("mixed dtype (CPU)": the int8 layers return float32); now refused at prepare_fx, naming the tensor,
    the caller's model untouched even with inplace=True."""
    model = _bert(1).to(dtype)
    ids = torch.randint(0, V, (2, 6))
    with pytest.raises(TypeError, match=r"'embeddings.word_embeddings.weight' is torch\.(bfloat16|float16).*model\.float"):
        Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(ids,), inplace=True)
    assert not any("qconfig" in m.__dict__ for m in model.modules())
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)).to(dtype)
    with pytest.raises(TypeError, match="'0.weight'"):
        Q.prepare_fx(seq, None, example_inputs=(torch.randn(2, 8, dtype=dtype),))
    # the float32 model works and a dynamic recipe is not refused at prepare
    q = Q.prepare_fx(seq.float(), None, example_inputs=(torch.randn(2, 8),))
    assert q is not None
