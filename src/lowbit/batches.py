"""Calibration inputs as batches: the one convention every data-driven step shares.

``inputs`` is a tensor (one batch) or an iterable of batches; a batch that is a tuple/list is
unpacked as positional arguments, a dict as keywords. ``flatten_outputs`` turns whatever a model
returns (tensor, ``QTensor``, nested tuple/list/dict) into a flat list of float tensors. ``real_rows``
keeps an activation's rows at a padded batch's real tokens (its ``attention_mask``) for statistics.
``check_seed`` is the one seed rule of every step that draws samples (here, below the algorithms and examples).

>>> import torch
>>> from lowbit.batches import iter_batches, run_batch, flatten_outputs
>>> [b.shape[0] for b in iter_batches([torch.zeros(2, 3), torch.zeros(4, 3)], "demo")]
[2, 4]
>>> [t.shape for t in flatten_outputs((torch.ones(2), {"a": torch.zeros(3)}))]
[torch.Size([2]), torch.Size([3])]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .qtensor import QTensor

__all__ = ["iter_batches", "run_batch", "check_module", "output_tensors", "flatten_outputs", "check_finite_batch",
           "eval_mode", "real_rows", "bool_mask", "check_seed", "input_shapes", "batch_failed", "first_failing"]


def iter_batches(inputs: Any, where: str) -> Iterator[Any]:
    """A tensor is one batch; a list/tuple/iterable holds batches. Raises on an empty or odd ``inputs``."""
    if isinstance(inputs, torch.Tensor):
        yield inputs
        return
    if isinstance(inputs, (str, bytes, dict)) or not isinstance(inputs, Iterable):
        raise TypeError(f"{where}: inputs must be a tensor or an iterable of batches, got {type(inputs).__name__}")
    n = 0
    for batch in inputs:
        n += 1
        yield batch
    if n == 0:
        raise ValueError(f"{where}: inputs is empty; give at least one batch")


def check_finite_batch(batch: Any, where: str, label: str, why: str, masks: bool = False) -> None:
    """``ValueError`` for a NaN/Inf in any float tensor of ``batch`` (a tensor, tuple/list or dict), naming
    ``label`` (e.g. ``"calib batch 3"``), the input (position or key, for a batch of several) and ``why``.
    ``masks`` (model inputs): in a batch of several inputs, a tensor whose only non-finite values are ``-inf`` is an
    additive attention mask (``nn.Transformer.generate_square_subsequent_mask``), accepted (observers ignore them).

    >>> mask = torch.triu(torch.full((3, 3), float("-inf")), 1)
    >>> check_finite_batch((torch.ones(2, 3, 4), mask), "demo", "calib batch 0", "", masks=True)
    """
    items = list(batch.items() if isinstance(batch, dict) else enumerate(batch) if isinstance(batch, (tuple, list))
                 else [(None, batch)])
    masks = masks and len(items) > 1
    for key, item in items:
        for t in output_tensors(item):  # an input that is itself a tuple / list / dict of tensors: each of them
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()) and \
                    not (masks and bool((torch.isfinite(t) | (t == float("-inf"))).all())):
                part = "" if key is None else f", input {key}"
                raise ValueError(f"{where}: {label}{part} holds {int((~torch.isfinite(t)).sum())} NaN/Inf values "
                                 f"of {t.numel()}; {why}")


def input_shapes(batch: tuple[Any, ...]) -> list[Any]:
    """The shapes of a batch's tensors (the type name of anything else), for error messages."""
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in batch]


def batch_failed(where: str, label: str, batch: tuple[Any, ...], err: BaseException, hint: str = "") -> ValueError:
    """The error for a calibration batch the model cannot run: ``label`` (``"calib batch 1"``), its input shapes and
    the first line of the model's error that has text.

    >>> batch_failed("demo", "calib batch 1", (torch.zeros(1, 3),), RuntimeError("\\nbad shape")).args[0]
    'demo: calib batch 1 (input shapes [(1, 3)]) failed in the model: RuntimeError: bad shape'
    """
    try:
        text = str(err)
    except Exception:  # (an exception class whose __str__ fails: its name still says what was raised)
        text = ""
    first = next((ln for ln in text.splitlines() if ln.strip()), "(no message)")
    return ValueError(f"{where}: {label} (input shapes {input_shapes(batch)}) failed in the model: "
                      f"{type(err).__name__}: {first}{hint}")


def first_failing(where: str, what: str, model: nn.Module, batches: list[Any]) -> ValueError | None:
    """``batch_failed`` for the first of ``batches`` the float ``model`` cannot run (eval, no_grad; the modes are
    restored), else ``None``: run only after a step on those batches failed, to say whether the data did it.

    >>> first_failing("demo", "calib", nn.Linear(2, 1), [torch.zeros(1, 2), torch.zeros(1, 3)]).args[0][:45]
    'demo: calib batch 1 (input shapes [(1, 3)]) f'
    """
    with eval_mode(model), torch.no_grad():
        for i, b in enumerate(batches):
            try:
                run_batch(model, b)
            except Exception as e:  # (any error of the user's model on this batch)
                parts = tuple(b.values()) if isinstance(b, dict) else tuple(b) if isinstance(b, (tuple, list)) else (b,)
                return batch_failed(where, f"{what} batch {i}", parts, e)
    return None


def run_batch(model: nn.Module, batch: Any) -> Any:
    """``model(batch)``; a tuple/list batch is unpacked as positional arguments, a dict as keywords."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (BatchNorm reads its running statistics and does not update them, dropout off) for
    the block; afterwards every module gets its own earlier mode back, even when the block raised (a training model
    with frozen BatchNorm layers stays so: ``model.train(was_training)`` would unfreeze them). A module made inside
    the block takes the root's earlier mode.

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train(); _ = m[1].eval()
    >>> with eval_mode(m):
    ...     m[0].training
    False
    >>> m.training, m[1].training
    (True, False)
    """
    modes = {id(m): (m, m.training) for m in model.modules()}
    root = model.training
    model.eval()
    try:
        yield model
    finally:
        for m in model.modules():
            m.training = modes[id(m)][1] if id(m) in modes else root


def check_module(model: Any, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} must be an nn.Module, got {type(model).__name__}")
    return model


def output_tensors(out: Any) -> list[Any]:
    """Every tensor (or ``QTensor``) in a nested tuple/list/dict output, in order, as it is (gradients kept).

    >>> [tuple(t.shape) for t in output_tensors([torch.ones(2), (torch.zeros(1), {"k": torch.ones(3)}), "x"])]
    [(2,), (1,), (3,)]
    """
    if isinstance(out, (QTensor, torch.Tensor)):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in output_tensors(o)]
    return []


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """Every tensor in ``out`` as float, in order (QTensors dequantized; clones, so later in-place ops can't alter them)."""
    return [t.dequantize() if isinstance(t, QTensor) else t.detach().float().clone() for t in output_tensors(out)]


def bool_mask(mask: Any) -> torch.Tensor:
    """``mask`` as a bool tensor: a bool one as it is, a 0/1 one of another dtype (a tokenizer's ``attention_mask`` is
    int64) compared with 0; any other value is a ``ValueError`` (indexing with an integer mask gathers rows by number).

    >>> bool_mask(torch.tensor([[1, 0]])).tolist()
    [[True, False]]
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"real_rows: mask must be a (batch, tokens) tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:4].tolist() if not mask.is_complex() else "complex"
        raise ValueError(f"real_rows: mask of dtype {mask.dtype} holds {bad}: a real-token mask is bool or 0/1")
    return mask != 0


def real_rows(x: Any, mask: torch.Tensor | None, token_rows: bool = False) -> torch.Tensor | None:
    """The rows ``(n, C)`` of ``x`` at a padded batch's real tokens, or ``None`` where they cannot be told.

    ``mask`` ``(batch, tokens)`` bool, True at real tokens (a batch's ``attention_mask``, also as 0/1 of another
    dtype: ``bool_mask``; ``None``: no padding to leave out). ``x`` that carries the batch's tokens, as ``(batch,
    tokens, C)`` or flattened to ``(batch * tokens, C)``, gives its rows at real tokens, in order, as ``(n, C)``.
    Padding is dropped by indexing, not by a 0 weight (a NaN in a padded row would survive ``0 * NaN``). ``None``:
    no mask, ``x`` not a tensor, or any other shape (a pooled ``(batch, hidden)``, attention scores ``(batch, heads,
    tokens, tokens)``, even where ``hidden`` or ``heads`` equals ``tokens``): its padding cannot be told from its
    shape. With one token per sequence a 2-D ``x`` of ``batch`` rows reads both ways: ``None`` unless
    ``token_rows=True`` says ``x`` holds token rows.

    Graph-mode observers and SmoothQuant's statistics (``lowbit.fx.padding``) leave an ``x`` that gives ``None``
    unfiltered; a causal LM's block statistics (``lowbit.llm.blocks.linear_rows``, ``token_rows=True``) refuse it.

    >>> mask = torch.tensor([[True, True, False], [True, False, False]])
    >>> x = torch.arange(12.0).reshape(2, 3, 2)                               # (batch, tokens, C)
    >>> real_rows(x, mask).tolist()
    [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]
    >>> torch.equal(real_rows(x.reshape(6, 2), mask), real_rows(x, mask))    # tokens flattened: the same rows
    True
    >>> real_rows(torch.zeros(2, 3), mask) is None                            # (batch, hidden), hidden == tokens
    True
    >>> one = torch.tensor([[True], [False]])                                 # one token each: (2, C) reads both ways
    >>> real_rows(torch.ones(2, 4), one) is None, tuple(real_rows(torch.ones(2, 4), one, token_rows=True).shape)
    (True, (1, 4))
    """
    if mask is None or not isinstance(x, torch.Tensor):
        return None
    mask = bool_mask(mask)
    lead = tuple(x.shape[:-1])
    if lead == tuple(mask.shape):  # (batch, tokens, C)
        return x[mask.to(x.device)]
    if lead == (mask.numel(),) and (token_rows or mask.shape[0] != mask.numel()):  # (batch * tokens, C)
        return x[mask.to(x.device).reshape(-1)]
    return None


def check_seed(where: str, seed: Any) -> int:
    """The one seed rule (``quantize_ptq``, ``reconstruct``, ``tune_biases``, ``distill``, ``examples.train``,
    ``models.photo_crops``): an integer, Python's, NumPy's (any ``numbers.Integral``) or a 0-d integer tensor, not a
    bool, in ``[-2**63, 2**64)`` (``torch.Generator``'s range, else "Overflow when unpacking long long" deep inside;
    a negative seed is in it); returned as a Python ``int``, else a ``TypeError`` / ``ValueError`` naming the value.

    >>> import numpy as np, torch
    >>> check_seed("demo", np.int64(3)), check_seed("demo", torch.tensor(3))
    (3, 3)
    >>> check_seed("demo", True)
    Traceback (most recent call last):
    TypeError: demo: seed=True must be an int (Python, NumPy or a 0-d integer tensor), not a bool or a float
    """
    tensor_int = (isinstance(seed, torch.Tensor) and seed.dim() == 0 and seed.dtype != torch.bool
                  and not seed.is_floating_point() and not seed.is_complex())
    if isinstance(seed, bool) or not (isinstance(seed, numbers.Integral) or tensor_int):
        raise TypeError(f"{where}: seed={seed!r} must be an int (Python, NumPy or a 0-d integer tensor), not a bool or "
                        "a float")
    v = int(seed)
    if not -2 ** 63 <= v < 2 ** 64:  # torch.Generator's range
        raise ValueError(f"{where}: seed={seed!r} must be in [-2**63, 2**64)")
    return v
