"""Defects session 37 found in the LLM path (``quantize_llm``, ``quantize_w8a8``, ``lowbit quantize-llm``): left-padded
batches calibrated learned absolute positions at their padded places, OPT's flattened MLP rows refused any padding
mask, a quantized tied model could not be saved by ``save_pretrained`` / safetensors, damaged or unsupported GGUF
files were named by gguf's reshape errors, and a second ``quantize_llm`` said "no lm_head". Each test failed before
its fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowbit as Q
from llm_nets import block_input_stats
from lowbit import cli
from lowbit.cli.common import CLIError
from lowbit.cli.gguf_file import check_gguf
from lowbit.llm import blocks as B

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


_stats = block_input_stats  # (tests/llm_nets.py)


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


# ---- 3. GGUF files: a one-line error naming the file, the tensor and its type ----
def _gguf(path, q_type: str = "F32") -> None:
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("general.note", "x" * 40)
    w.add_array("general.tags", ["a", "bc"])
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((32, 64)) * 0.1).astype(np.float32)
    w.add_tensor("token_embd.weight", a)
    if q_type == "I8":
        w.add_tensor("blk.0.attn_q.weight", (a * 100).astype(np.int8), raw_dtype=T.I8)
    else:
        d = gguf.quants.quantize(a, T[q_type])
        w.add_tensor("blk.0.attn_q.weight", d, raw_shape=d.shape, raw_dtype=T[q_type])
    w.add_tensor("output_norm.weight", a[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("q_type", ["F32", "Q8_0", "Q4_1", "BF16"])
def test_a_sound_gguf_file_passes_and_one_byte_less_is_named(tmp_path, q_type):
    _gguf(tmp_path / "m.gguf", q_type)
    check_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1])
    with pytest.raises(CLIError, match=r"cut.gguf is truncated: tensor 'output_norm.weight' \(F32, 256 bytes from "
                                       rf"byte \d+\) ends at byte {len(data)}, past the file's end"):
        check_gguf(tmp_path / "cut.gguf")


def _cli_error(tmp_path, capsys, name: str) -> str:
    (tmp_path / "t.txt").write_text("a b c " * 50)
    rc = cli.main(["quantize-llm", str(tmp_path / name), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"),
                   "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    return err


def test_gguf_faults_are_one_line_naming_the_tensor_and_type(tmp_path, capsys):
    _gguf(tmp_path / "ok.gguf")
    data = bytearray((tmp_path / "ok.gguf").read_bytes())
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    assert "MODEL magic.gguf is not a GGUF file: it starts with b'GGML', not the magic b'GGUF'" in _cli_error(
        tmp_path, capsys, "magic.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:60])
    assert "MODEL head.gguf is truncated: its 60 bytes end inside the header (metadata entry" in _cli_error(
        tmp_path, capsys, "head.gguf")
    (tmp_path / "data.gguf").write_bytes(data[:-300])  # was: "cannot reshape array of size ... into shape (32,64)"
    assert "MODEL data.gguf is truncated: tensor 'blk.0.attn_q.weight' (F32, 8192 bytes" in _cli_error(
        tmp_path, capsys, "data.gguf")
    _gguf(tmp_path / "i8.gguf", "I8")  # was: "Dequantization for I8 is not yet implemented"
    err = _cli_error(tmp_path, capsys, "i8.gguf")
    assert "tensor 'blk.0.attn_q.weight' has GGML type I8, which the installed gguf package cannot dequantize" in err
    assert "Q4_1" in err  # the types it reads are listed
    i = bytes(data).index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight") + 4 + 2 * 8  # name, n_dims, dims
    data[i:i + 4] = (99).to_bytes(4, "little")  # was: "np.uint32(99) is not a valid GGMLQuantizationType"
    (tmp_path / "type.gguf").write_bytes(bytes(data))
    assert "tensor 'blk.0.attn_q.weight' has GGML type id 99, which the installed gguf package does not know" in (
        _cli_error(tmp_path, capsys, "type.gguf"))


# ---- 4. quantize_llm / quantize_w8a8 given their own output ----
def test_quantizing_a_quantized_model_again_says_so():
    calib = [torch.randint(0, 64, (1, 16))]
    qm = Q.quantize_llm(_llama(), calib, bits=4, group_size=16, progress=False)
    with pytest.raises(ValueError, match="output projection of LlamaForCausalLM is a 8-bit WeightOnlyLinear: the "
                                         "model is quantized already"):  # was: "no nn.Linear output projection"
        Q.quantize_llm(qm, calib, bits=4, group_size=16, progress=False)
    for fn, kw in ((Q.quantize_llm, {"head": None, "group_size": 16, "progress": False}), (Q.quantize_w8a8, {})):
        with pytest.raises(ValueError, match="decoder blocks of LlamaForCausalLM are quantized already .*"
                                             "WeightOnlyLinear"):  # was: "hold no nn.Linear to quantize"
            fn(qm, calib, **kw)
