"""`lowbit quantize` / `quantize-llm` cases a session-24 probe found: data loss, misstated reports, deep errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lowbit import cli

MODULE = """
import torch
from torch import nn
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
def bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
def out1d():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
def cnn3():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
class Emb(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0); self.e = nn.EmbeddingBag(50, 8); self.fc = nn.Linear(8, 3)
    def forward(self, x):
        return self.fc(self.e(x))
def emb():
    return Emb()
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "tiny24.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    torch.save(torch.randn(40, 8), "x.pt")
    torch.save(torch.randint(0, 3, (40,)), "y.pt")
    torch.save(torch.randn(129, 8), "x129.pt")
    torch.save(torch.randint(0, 3, (129,)), "y129.pt")
    return tmp_path


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(["quantize", "--quiet", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_out_never_replaces_a_users_own_files(work, capsys):
    import tiny24

    (work / "ckpt").mkdir()
    torch.save(tiny24.mlp().state_dict(), work / "ckpt" / "model_best.pt")
    rc, _, err = run(["--model", "tiny24:mlp", "--weights", "ckpt/model_best.pt", "--calib", "x.pt", "--method",
                      "dynamic", "--out", "ckpt"], capsys)
    assert rc == 2 and "lies inside --out ckpt" in err  # the --weights file was deleted with the folder
    rc, _, err = run(["--model", "tiny24:mlp", "--calib", "x.pt", "--method", "dynamic", "--out", "ckpt"], capsys)
    assert rc == 2 and "a folder lowbit did not write (it holds 'model_best.pt')" in err
    assert (work / "ckpt" / "model_best.pt").is_file()


def test_qat_batches_and_outputs(work, capsys):
    rc, _, err = run(["--model", "tiny24:bn_mlp", "--calib", "x129.pt", "--calib-labels", "y129.pt", "--method", "qat",
                      "--qat-epochs", "1", "--out", "q"], capsys)
    assert rc == 0, err  # 129 = 128 + a batch of one, which BatchNorm could not train on
    torch.save(torch.randn(1, 8), "x1.pt")
    torch.save(torch.tensor([1]), "y1.pt")
    rc, _, err = run(["--model", "tiny24:bn_mlp", "--calib", "x1.pt", "--calib-labels", "y1.pt", "--method", "qat",
                      "--out", "q1"], capsys)
    assert rc == 2 and "needs at least 2 samples, got 1" in err
    rc, _, err = run(["--model", "tiny24:out1d", "--calib", "x.pt", "--calib-labels", "y.pt", "--method", "qat",
                      "--out", "q2"], capsys)
    assert rc == 2 and "(batch, classes) model outputs, got shape (2,)" in err  # was torch's loss error


def test_latency_states_the_batch_it_timed(work, capsys):
    rc, out, err = run(["--model", "tiny24:mlp", "--calib", "x.pt", "--eval", "x.pt", "--labels", "y.pt", "--method",
                        "dynamic", "--out", "o"], capsys)
    assert rc == 0, err
    assert "latency (ms, batch 40)" in out and "Latency: batch of 40" in (work / "o" / "report.md").read_text()
    assert json.loads((work / "o" / "report.json").read_text())["rows"][0]["latency_batch"] == 40


def test_colour_images_keep_their_channels_and_token_ids_stay_integers(work, capsys):
    from PIL import Image

    (work / "rgb").mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), "RGB").save(work / "rgb" / f"{i}.png")
    rc, _, err = run(["--model", "tiny24:cnn3", "--calib", "rgb", "--method", "ptq", "--out", "o1"], capsys)
    assert rc == 0, err  # were read as grayscale: "expected input[2, 1, 8, 8] to have 3 channels"
    torch.save(torch.randint(0, 50, (40, 6)), "tok.pt")
    rc, _, err = run(["--model", "tiny24:emb", "--calib", "tok.pt", "--method", "dynamic", "--out", "o2"], capsys)
    assert rc == 0, err  # were cast to float: "Expected tensor for argument #1 'indices' to have ... Long"


def test_weights_wrappers_are_unwrapped_and_a_pickled_model_is_named(work, capsys):
    import tiny24

    sd = tiny24.mlp().state_dict()
    torch.save({"state_dict": sd}, "wrapped.pt")
    torch.save({f"module.{k}": v for k, v in sd.items()}, "dp.pt")
    torch.save(tiny24.mlp(), "whole.pt")
    for w in ("wrapped.pt", "dp.pt"):
        rc, _, err = run(["--model", "tiny24:mlp", "--weights", w, "--calib", "x.pt", "--method", "dynamic",
                          "--out", f"o_{w}"], capsys)
        assert rc == 0, err
    rc, _, err = run(["--model", "tiny24:mlp", "--weights", "whole.pt", "--calib", "x.pt", "--method", "dynamic",
                      "--out", "o3"], capsys)
    assert rc == 2 and "holds a pickled Python object (a whole model?), not a state_dict" in err
    assert len(err.strip().splitlines()) == 1 and "\x1b" not in err


def _tiny_llm(path, tokenizer: bool = True) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,")}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def test_quantize_llm_reports_what_it_did(work, capsys):
    _tiny_llm(work / "llm")
    (work / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["--text", "text.txt", "--calib-windows", "1", "--window", "64", "--speed-tokens", "0", "--quiet"]
    rc = cli.main(["quantize-llm", "llm", *common, "--eval-tokens", "100", "--method", "int8", "--out", "l8"])
    assert rc == 0, capsys.readouterr().err
    r = json.loads((work / "l8" / "report.json").read_text())
    assert (r["bits"], r["group_size"], r["eval_tokens"]) == (8, -1, 64)  # said 4 / 128 / 100
    capsys.readouterr()
    rc = cli.main(["quantize-llm", "llm", *common, "--eval-tokens", "64", "--method", "rtn", "--group-size", "7",
                   "--out", "r7"])  # a group size given is honoured or refused (session 36: it fell back to -1)
    assert rc == 2 and "group_size=7 does not divide" in capsys.readouterr().err
    rc = cli.main(["quantize-llm", "llm", *common, "--eval-tokens", "64", "--method", "rtn", "--group-size", "16",
                   "--out", "r16"])
    assert rc == 0 and json.loads((work / "r16" / "report.json").read_text())["group_size"] == [-1, 16]  # (int8 head)
    _tiny_llm(work / "notok", tokenizer=False)
    capsys.readouterr()
    rc = cli.main(["quantize-llm", "notok", *common, "--eval-tokens", "64", "--out", "nt"])
    assert rc == 2 and "holds no tokenizer" in capsys.readouterr().err  # said "install sentencepiece"
    rc = cli.main(["quantize-llm", "llm", "--text", "missing.txt", "--out", "m", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines() == ["lowbit: error: --text missing.txt: No such file or directory"]
