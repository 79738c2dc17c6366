"""`lowbit quantize` inputs a session-36 probe found ending in a traceback or a misleading line (each failed before)."""

from __future__ import annotations

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
def cnn3():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "tiny36.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    torch.save(torch.randn(20, 8), "x.pt")
    torch.save(torch.randint(0, 3, (20,)), "y.pt")
    return tmp_path


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["quantize", "--quiet", "--model", "tiny36:mlp", *args])
    err = capsys.readouterr().err
    return rc, err


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowbit: error: ") and "\x1b" not in lines[0], err
    return lines[0]


def test_quantized_tensor_files_are_named(work, capsys):
    # torch.quantize_per_tensor tensors: .float() / .long() raised "Creation of quantized tensor requires quantized
    # dtype" out of main (a traceback, no exit status)
    q = torch.quantize_per_tensor(torch.randn(20, 8), 0.1, 0, torch.qint8)
    torch.save(q, "xq.pt")
    rc, err = run(["--calib", "xq.pt", "--method", "ptq", "--out", "o1"], capsys)
    assert rc == 2 and "--calib xq.pt: holds a torch quantized tensor (dtype torch.qint8)" in one_error(err)
    torch.save(torch.quantize_per_tensor(torch.ones(20), 1.0, 0, torch.qint8), "yq.pt")
    rc, err = run(["--calib", "x.pt", "--method", "qat", "--calib-labels", "yq.pt", "--out", "o2"], capsys)
    assert rc == 2 and "--calib-labels yq.pt: holds a torch quantized tensor" in one_error(err)
    assert not (work / "o1").exists() and not (work / "o2").exists()


def test_labels_out_of_int64_are_named_by_their_value(work, capsys):
    # the range was checked after .long(): 1e30 and 2**63 + 5 were named as label -9223372036854775808 / ...803
    torch.save(torch.full((20,), 1e30), "yf.pt")
    rc, err = run(["--calib", "x.pt", "--eval", "x.pt", "--labels", "yf.pt", "--method", "dynamic", "--out", "o"],
                  capsys)
    assert rc == 2 and one_error(err).endswith("--labels yf.pt: label 1e+30 is outside [0, 3) (the model has 3 outputs)")
    np.save("yu.npy", np.full(20, 2**63 + 5, dtype=np.uint64))
    rc, err = run(["--calib", "x.pt", "--eval", "x.pt", "--labels", "yu.npy", "--method", "dynamic", "--out", "o"],
                  capsys)
    line = one_error(err)
    assert rc == 2 and "label 9223372036854775808 is outside [0, 3)" in line and "-9" not in line
    np.save("yu8.npy", np.array([0, 1, 2] * 6 + [0, 1], dtype=np.uint64))  # in range: still accepted
    rc, err = run(["--calib", "x.pt", "--eval", "x.pt", "--labels", "yu8.npy", "--method", "dynamic", "--out", "o"],
                  capsys)
    assert rc == 0, err


def test_a_file_torch_cannot_read_is_not_called_a_pickled_model(work, capsys):
    # every torch.load failure was "holds a pickled Python object (a whole model?)": a .npy, random bytes, text
    np.save("w.npy", np.zeros(3, np.float32))
    rc, err = run(["--calib", "x.pt", "--weights", "w.npy", "--method", "dynamic", "--out", "o"], capsys)
    line = one_error(err)
    assert rc == 2 and "--weights w.npy: is not a file torch.save wrote" in line and "pickled" not in line
    import tiny36

    torch.save(tiny36.mlp(), "whole.pt")
    rc, err = run(["--calib", "x.pt", "--weights", "whole.pt", "--method", "dynamic", "--out", "o"], capsys)
    assert rc == 2 and "holds a pickled Python object (a whole model?), not a state_dict (it pickles " \
        "torch.nn.modules.container.Sequential)" in one_error(err)
    # as --calib: torch's paragraph about the weights_only default (with terminal bold codes) was the message
    rc, err = run(["--calib", "whole.pt", "--method", "dynamic", "--out", "o"], capsys)
    line = one_error(err)
    assert rc == 2 and "--calib whole.pt: holds a pickled Python object (torch.nn.modules.container.Sequential)" in line
    assert "PyTorch 2.6" not in line and len(line) < 300
    (work / "junk.pt").write_bytes(b"not a torch file at all")
    rc, err = run(["--calib", "junk.pt", "--method", "dynamic", "--out", "o"], capsys)
    assert rc == 2 and "--calib junk.pt: is not a file torch.save wrote (Unsupported operand" in one_error(err)


def test_one_line_drops_terminal_escape_codes():
    from lowbit.cli.common import one_line

    assert one_line(ValueError("\x1b[1mdo this\x1b[0m\nor that")) == "ValueError: do this or that"


def test_big_endian_npy_is_read(work, capsys):
    # a valid big-endian .npy was refused: "given numpy array has byte order different from the native byte order"
    x = np.random.default_rng(0).standard_normal((20, 8)).astype(">f4")
    np.save("xbe.npy", x)
    from lowbit.cli.inputs import load_array

    assert torch.equal(load_array("xbe.npy", "--calib"), torch.from_numpy(x.astype("<f4")))
    rc, err = run(["--calib", "xbe.npy", "--method", "dynamic", "--out", "o"], capsys)
    assert rc == 0, err


def test_image_folder_skips_a_subfolder_named_like_an_image(work, capsys):
    from PIL import Image

    (work / "imgs" / "extra.png").mkdir(parents=True)  # was: "cannot read image extra.png (IsADirectoryError ...)"
    for i in range(3):
        Image.fromarray(np.full((6, 6, 3), 40 * i, np.uint8)).save(work / "imgs" / f"{i}.png")
    from lowbit.cli.inputs import load_array

    assert tuple(load_array("imgs", "--calib").shape) == (3, 3, 6, 6)
