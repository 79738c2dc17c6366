"""Fast checks of the real-data helpers: ``lowbit.data`` loaders and ``lowbit.examples`` (bad input, shapes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import lowbit.data as D
from lowbit.examples import SmallCNN, evaluate, predict, train

needs_fmnist = pytest.mark.skipif(not D.fashion_mnist_available(),
                                  reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
needs_gensim = pytest.mark.skipif(importlib.util.find_spec("gensim") is None, reason="gensim not installed")


@needs_fmnist
def test_fashion_mnist_shapes_and_balance():
    x, y = D.load_fashion_mnist("test")
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((10000, 28, 28), torch.uint8, (10000,), torch.int64)
    assert torch.bincount(y).tolist() == [1000] * 10
    xs, ys = D.load_fashion_mnist("train", limit=7)
    assert xs.shape == (7, 28, 28) and ys.tolist() == [9, 0, 0, 3, 0, 2, 7]
    z = D.normalize_images(xs)
    assert z.shape == (7, 1, 28, 28) and z.dtype == torch.float32
    assert torch.allclose(z.min(), torch.tensor(-D.FASHION_MNIST_MEAN / D.FASHION_MNIST_STD))


def test_fashion_mnist_missing_names_the_debian_package(tmp_path):
    assert not D.fashion_mnist_available(tmp_path)
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        D.load_fashion_mnist("test", root=tmp_path)


@pytest.mark.parametrize("kw, err", [
    ({"split": "val"}, ValueError), ({"split": "test", "limit": 0}, ValueError),
    ({"split": "test", "limit": 2.5}, ValueError), ({"split": "test", "limit": True}, ValueError),
])
def test_fashion_mnist_bad_arguments(kw, err):
    with pytest.raises(err, match="split|limit"):
        D.load_fashion_mnist(**kw)


def test_normalize_images_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        D.normalize_images(torch.zeros(2, 28, 28))
    with pytest.raises(ValueError, match=r"\(N, H, W\)"):
        D.normalize_images(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))


@needs_gensim
def test_lee_corpus():
    background, docs, human = D.load_lee_corpus()
    assert (len(background), len(docs), human.shape) == (300, 50, (50, 50))
    assert all(isinstance(d, str) and len(d) > 100 for d in background + docs)
    assert float(human.min()) >= 0.0 and float(human.max()) <= 1.0


@pytest.mark.parametrize("kw, err, match", [
    ({"texts": "one string"}, TypeError, "list of str"), ({"texts": [1]}, TypeError, "list of str"),
    ({"texts": ["a"], "max_length": 1}, ValueError, "max_length=1"),
    ({"texts": ["a"], "batch_size": 0}, ValueError, "batch_size=0"),
])
def test_embed_sentences_bad_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        D.embed_sentences(None, torch.nn.Identity(), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"channels": (16,)}, "channels"), ({"channels": (16, 0)}, "channels"),
    ({"hidden": 0}, "hidden=0"), ({"num_classes": True}, "num_classes=True"),
])
def test_small_cnn_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        SmallCNN(**kw)


def test_small_cnn_fusion_groups_name_real_modules():
    m = SmallCNN()
    names = dict(m.named_modules())
    assert all(n in names for group in m.fusion_groups() for n in group)


def test_train_learns_a_separable_toy_problem():
    torch.manual_seed(0)
    y = torch.arange(64) % 2
    x = torch.randn(64, 1, 28, 28) * 0.1 + (2.0 * y - 1.0).view(-1, 1, 1, 1)
    m = train(SmallCNN(num_classes=2, channels=(4, 4), hidden=8), x, y, epochs=3, lr=1e-2, batch_size=16)
    assert evaluate(m, x, y) == 100.0 and not m.training


@pytest.mark.parametrize("x, y, kw, err, match", [
    (torch.zeros(4, 1, 28, 28, dtype=torch.uint8), torch.zeros(4, dtype=torch.long), {}, TypeError, "float"),
    (torch.zeros(4, 1, 28, 28), torch.zeros(3, dtype=torch.long), {}, ValueError, "length 4"),
    (torch.zeros(4, 1, 28, 28), torch.zeros(4), {}, ValueError, "int64"),
    (torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long), {"epochs": 0}, ValueError, "epochs=0"),
    (torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long), {"batch_size": 0}, ValueError, "batch_size=0"),
    (torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long), {"on_step": 3}, TypeError, "on_step=3"),
])
def test_train_bad_arguments(x, y, kw, err, match):
    with pytest.raises(err, match=match):
        train(SmallCNN(channels=(2, 2), hidden=2), x, y, **kw)


def test_predict_bad_arguments():
    m = SmallCNN(channels=(2, 2), hidden=2).eval()
    with pytest.raises(TypeError, match="float"):
        predict(m, torch.zeros(2, 1, 28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="batch_size=0"):
        predict(m, torch.zeros(2, 1, 28, 28), batch_size=0)


def test_mean_pool_matches_the_masked_mean_and_pools_empty_sentences_to_zero():
    torch.manual_seed(0)
    h, mask = torch.randn(3, 5, 4), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    out = D.mean_pool(h, mask)
    ref = h[0, :2].mean(0)
    assert torch.allclose(out[0], ref / ref.norm())
    assert torch.allclose(out[1], h[1].mean(0) / h[1].mean(0).norm())
    assert torch.equal(out[2], torch.zeros(4))
    assert torch.equal(D.mean_pool(h, mask.bool()), out) and torch.equal(D.mean_pool(h, mask.float()), out)


@pytest.mark.parametrize("h, mask, match", [
    (torch.ones(2, 3, 4), torch.ones(2, 4), r"\(B, T\) = \(2, 3\).*got \(2, 4\)"),
    (torch.ones(2, 3, 4), torch.ones(3), r"got \(3,\)"),
    (torch.ones(2, 3, 4), [[1, 1, 1]] * 2, "got list"),
    (torch.ones(2, 3), torch.ones(2, 3), r"\(B, T, H\).*got \(2, 3\)"),
    (torch.ones(2, 3, 4, dtype=torch.int64), torch.ones(2, 3), "floating.*torch.int64"),
    ("h", torch.ones(2, 3), "got str"),
    (torch.ones(2, 3, 4), torch.tensor([[1, 2, 0], [1, 1, 1]]), r"only 0 and 1, got \[2\]"),
    (torch.ones(2, 3, 4), torch.tensor([[1.0, float("nan"), 0], [1, 1, 1]]), r"only 0 and 1, got \[nan\]"),
])
def test_mean_pool_bad_input_names_the_value(h, mask, match):
    with pytest.raises(ValueError, match=match):
        D.mean_pool(h, mask)


def test_mean_pool_propagates_non_finite_states():
    h = torch.ones(2, 2, 3)
    h[0, 0, 0] = float("nan")
    out = D.mean_pool(h, torch.ones(2, 2))
    assert out[0].isnan().all() and torch.isfinite(out[1]).all()
