"""Defects session 37 found in the LLM path (``quantize_llm``, ``quantize_w8a8``, ``lowbit quantize-llm``): left-padded
batches calibrated learned absolute positions at their padded places, OPT's flattened MLP rows refused any padding
mask, a quantized tied model could not be saved by ``save_pretrained`` / safetensors, damaged or unsupported GGUF
files were named by gguf's reshape errors, and a second ``quantize_llm`` said "no lm_head". Each test failed before
its fix.
"""

from __future__ import annotations

import pytest
import torch

import lowbit as Q
from lowbit.llm import blocks as B
from lowbit.llm.blocks import capture_block_inputs, decoder_layers, linear_groups, token_mask
from lowbit.llm.sequential import _input_stats

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


def _llama(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                                      "tie_word_embeddings": True, **kw})
    return transformers.LlamaForCausalLM(cfg).eval()


def _bigcode():  # learned absolute positions (wpe) and nn.Linear blocks
    torch.manual_seed(0)
    cfg = transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        bos_token_id=0, eos_token_id=0)
    return transformers.GPTBigCodeForCausalLM(cfg).eval()


def _opt():  # its MLP reads the tokens flattened to (batch * tokens, hidden)
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=64, word_embed_proj_dim=32)
    return transformers.OPTForCausalLM(cfg).eval()


def _seqs(seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (1, 20), generator=g), torch.randint(3, 64, (1, 13), generator=g)]


def _pad(seqs: list[torch.Tensor], width: int, left: bool) -> dict[str, torch.Tensor]:
    ids = torch.full((len(seqs), width), 1)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        cols = slice(width - s.shape[1], width) if left else slice(0, s.shape[1])
        ids[i, cols], mask[i, cols] = s[0], 1
    return {"input_ids": ids, "attention_mask": mask}


def _stats(m, calib):
    layers = decoder_layers(m)
    calib = B.check_llm_calib(m, calib, "t")
    inps = capture_block_inputs(m, layers, calib)
    names = [g[0] for g in linear_groups(layers[0], *inps[0])]
    return _input_stats(layers[0], names, None, inps, [token_mask(b) for b in calib], 1, None, True)


# ---- 1. padded calibration batches: the positions generate() gives, OPT's flattened rows ----
@pytest.mark.parametrize("make, left", [(_bigcode, True), (_opt, False), (_opt, True), (_llama, True)])
def test_a_padded_batch_calibrates_like_its_unpadded_sequences(make, left):
    """Oracle: each sequence alone (no padding: positions 0..T-1 either way). Before: GPT-BigCode's left-padded real
    tokens took their padded positions' wpe vectors (H off by 40-76 %); OPT refused any mask (its MLP rows are
    flattened). Rotary Llama was already right: attention sees position differences only."""
    m = make()
    plain = _stats(m, _seqs())
    padded = _stats(m, [_pad(_seqs(), 26, left)])
    for name, (H, s) in plain.items():
        Hp, sp = padded[name]
        assert torch.allclose(Hp, H, rtol=1e-4, atol=1e-4 * float(H.abs().max())), name
        assert torch.allclose(sp, s, rtol=1e-4, atol=1e-5), name


def test_generation_positions_are_transformers_own():
    m = _bigcode()
    batch = _pad(_seqs(), 26, left=True)
    want = m._prepare_position_ids_for_generation(batch["input_ids"], dict(batch))
    assert torch.equal(B.generation_positions(m, batch)["position_ids"], want)
    given = {**batch, "position_ids": torch.arange(26).expand(2, 26)}
    assert B.generation_positions(m, given) is given  # the caller's positions are kept
    ones = {"input_ids": batch["input_ids"], "attention_mask": torch.ones(2, 26, dtype=torch.int64)}
    assert "position_ids" not in B.generation_positions(m, ones)


def test_w8a8_on_a_left_padded_batch_matches_the_unpadded_one():
    m = _bigcode()
    ev = _seqs(9)[0]
    ref = Q.quantize_w8a8(m, _seqs())(ev).logits
    got = Q.quantize_w8a8(m, [_pad(_seqs(), 26, left=True)])(ev).logits
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


# ---- 2. a quantized tied model saved and loaded ----
@pytest.mark.parametrize("head", ["int8", "int4"])
def test_a_quantized_tied_model_round_trips_through_save_pretrained(tmp_path, head):
    safetensors = pytest.importorskip("safetensors.torch")
    calib, ev = [torch.randint(0, 64, (1, 16)) for _ in range(2)], torch.randint(0, 64, (1, 16))
    qm = Q.quantize_llm(_llama(), calib, bits=4, group_size=16, head=head, progress=False)
    ref = qm(ev).logits
    qm.save_pretrained(tmp_path)  # was: RuntimeError "The weights trying to be saved contained shared tensors"
    sd = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith("model.embed_tokens.") for k in sd)  # the codes once, under lm_head
    fresh = Q.quantize_llm(_llama(seed=1), calib, bits=4, group_size=16, head=head, method="rtn", awq=False,
                           progress=False)  # the same structure, other codes
    fresh.load_state_dict(sd)  # strict
    assert fresh.model.embed_tokens.head is fresh.lm_head
    assert torch.equal(fresh(ev).logits, ref)
    safetensors.save_file(qm.state_dict(), str(tmp_path / "plain.safetensors"))  # was: "tensors share memory"


def test_a_checkpoint_with_the_head_under_the_embedding_too_still_loads():
    """State dicts written before (the head's codes also under ``model.embed_tokens.head.``) load strictly."""
    calib, ev = [torch.randint(0, 64, (1, 16))], torch.randint(0, 64, (1, 16))
    qm = Q.quantize_llm(_llama(), calib, bits=4, group_size=16, progress=False)
    sd = qm.state_dict()
    old = {**sd, **{f"model.embed_tokens.head.{k[len('lm_head.'):]}": v for k, v in sd.items()
                    if k.startswith("lm_head.")}}
    fresh = Q.quantize_llm(_llama(seed=1), calib, bits=4, group_size=16, method="rtn", awq=False, progress=False)
    fresh.load_state_dict(old)
    assert torch.equal(fresh(ev).logits, qm(ev).logits)
    emb = fresh.model.embed_tokens.to(torch.bfloat16)  # the embedding alone moves the head it reads
    assert emb.head.scales.dtype == torch.bfloat16 and emb(ev).dtype == torch.bfloat16
