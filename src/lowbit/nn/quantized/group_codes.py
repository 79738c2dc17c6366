"""Group-wise weight codes: round to nearest, the MSE clip search, GPTQ (``WeightOnlyLinear``'s quantizers).

A float weight ``w`` ``(N, K)`` is cut into ``G = K / g`` groups of ``g`` input columns per row; group ``(n, j)`` gets
``(s_nj, z_nj)`` from its clipped range ``[r·min, r·max]`` (``calculate_qparams``'s contract) and codes::

    q[n, k] = clamp(round_half_even(w[n, k] / s[n, j]) + z[n, j], qmin, qmax)    # j = k // g
    ŵ[n, k] = (q[n, k] - z[n, j]) * s[n, j]

``quantize_groups``: ``r = 1`` (``"rtn"``) or the ``r`` in ``CLIP_RATIOS`` minimising the group's (optionally
column-weighted) ``||w - ŵ||²`` (``"mse"``). ``gptq_quantize``: columns in order, each rounding error spread over the
columns not yet quantized through the inverse Hessian ``H = XᵀX`` of calibration inputs (Frantar et al. 2022).
``lowbit.nn.quantized.weight_only`` stores the results (and re-exports these names).

>>> import torch
>>> from lowbit.qscheme import qint4
>>> w = torch.tensor([[0.1, -0.3, 0.7, 0.35], [0.9, 0.5, -1.0, 0.2]])
>>> q, s, z = quantize_groups(w, 2, qint4, symmetric=True)   # g = 2: (2, 2) groups; symmetric: z = 0
>>> tuple(q.shape), tuple(s.shape), z.unique().tolist()
((2, 4), (2, 2), [0])
>>> torch.allclose(s, w.reshape(2, 2, 2).abs().amax(-1) / 7.5)   # qint4 [-8, 7]: s = max|w| / 7.5
True
>>> w_hat = (q.reshape(2, 2, 2) * s[..., None]).reshape(2, 4)
>>> bool(((w_hat - w).abs() <= s.repeat_interleave(2, 1) / 2 + 1e-7).all())   # half a step at most
True
"""

from __future__ import annotations

import math
import warnings

import torch

from ...qparams import calculate_qparams
from ...qscheme import QDtype, per_channel_affine, per_channel_symmetric

__all__ = ["CLIP_RATIOS", "group_qparams", "quantize_groups", "gptq_quantize", "warn_few_rows"]

CLIP_RATIOS = tuple(1.0 - 0.02 * i for i in range(25))  # 1.00, 0.98, ..., 0.52: the mse search grid


def group_qparams(w: torch.Tensor, qdtype: QDtype, symmetric: bool, ratio: float | torch.Tensor = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` of shape ``(N, G)`` for grouped weights ``w`` ``(N, G, g)``, range clipped by ``ratio``."""
    lo, hi = w.amin(-1) * ratio, w.amax(-1) * ratio
    return calculate_qparams(lo, hi, per_channel_symmetric if symmetric else per_channel_affine, qdtype,
                             validate=False)


def _fake(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qdtype: QDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values of ``w`` ``(N, G, g)`` on per-group ``s, z`` ``(N, G)`` (the numerics contract)."""
    zf = z.to(w.dtype)[..., None]
    q = torch.round(w * torch.reciprocal(s)[..., None] + zf).clamp_(qdtype.quant_min, qdtype.quant_max)
    return q, (q - zf) * s[..., None]


def quantize_groups(w: torch.Tensor, g: int, qdtype: QDtype, symmetric: bool, method: str = "rtn",
                    col_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``(N, K)`` int64, scales ``(N, G)``, zero points ``(N, G)`` of a float ``(N, K)`` weight (rtn or mse).

    ``col_weight`` ``(K,)`` (mse only) weighs each column's squared error, e.g. by ``diag(XᵀX)``: the
    clip then minimises ``Σ_k h_k (w_k - ŵ_k)²``, the layer-output error of uncorrelated inputs. ``g = -1`` is one
    group per row (per channel), as ``fit_group_size`` returns where no group size ≥ 8 divides ``K``.
    """
    g = w.shape[1] if g == -1 else g
    wg = w.detach().to(torch.float32).reshape(w.shape[0], -1, g)  # (N, G, g)
    cw = 1.0 if col_weight is None else col_weight.detach().to(torch.float32).reshape(1, -1, g)
    s, z = group_qparams(wg, qdtype, symmetric)
    if method == "mse":
        best = ((_fake(wg, s, z, qdtype)[1] - wg) ** 2 * cw).sum(-1)  # (N, G)
        for r in CLIP_RATIOS[1:]:
            s_r, z_r = group_qparams(wg, qdtype, symmetric, r)
            err = ((_fake(wg, s_r, z_r, qdtype)[1] - wg) ** 2 * cw).sum(-1)
            better = err < best
            best, s, z = torch.where(better, err, best), torch.where(better, s_r, s), torch.where(better, z_r, z)
    q, _ = _fake(wg, s, z, qdtype)
    return q.reshape(w.shape).to(torch.int64), s, z


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, g: int, qdtype: QDtype, symmetric: bool,
                  damp: float = 0.01, block: int = 128, group_method: str = "mse", act_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ codes ``(N, K)``, scales and zero points ``(N, G)`` minimising ``||X wᵀ - X ŵᵀ||²`` for ``H = XᵀX`` ``(K, K)``.

    A group's qparams are chosen when its first column is reached, from the weights as updated so
    far, by ``group_method`` (``"mse"``: clipping search, the default; ``"rtn"``: min/max; ``"hmse"``: the
    clipping search with each column's error weighted by ``diag(H)``, i.e. activation-aware). On
    SmolLM2-135M int4 g128 (2048 tokens) min/max groups gave ppl 49.0, the mse search 40.4 (RTN 43.4).
    ``act_order``: quantize columns by decreasing ``diag(H)`` (the most active inputs first), with
    every group's qparams fixed beforehand by ``group_method`` on the original weights ("static
    groups"); there it gave 37.1.

    >>> from lowbit.qscheme import qint4
    >>> w, X = torch.randn(8, 32), torch.randn(256, 32)
    >>> q, s, z = gptq_quantize(w, X.T @ X, 16, qint4, True)
    >>> q.shape, s.shape, int(q.min()) >= -8
    (torch.Size([8, 32]), torch.Size([8, 2]), True)
    """
    if group_method not in ("rtn", "mse", "hmse"):
        raise ValueError(f"gptq_quantize: group_method={group_method!r} must be 'rtn', 'mse' or 'hmse'")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < math.inf:
        raise ValueError(f"gptq_quantize: damp={damp!r} must be a finite number >= 0 (a fraction of mean diag(XᵀX))")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"gptq_quantize: w must be a 2-D (out_features, in_features) tensor, got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    W = w.detach().to(torch.float32).clone()  # (N, K)
    N, K = W.shape
    g = K if g == -1 and not isinstance(g, bool) else g  # -1: per channel, as quantize_groups
    if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or K % g:
        raise ValueError(f"gptq_quantize: g={g!r} must be a positive int dividing in_features={K} (or -1: per channel)")
    H = hessian.detach().to(torch.float64).clone()  # float64 keeps the Cholesky stable at K=1536
    if H.shape != (K, K):
        raise ValueError(f"gptq_quantize: hessian of shape {tuple(H.shape)} does not match in_features={K}")
    if not bool(torch.isfinite(W).all()):
        raise ValueError(f"gptq_quantize: the weight holds {int((~torch.isfinite(W)).sum())} NaN/Inf values")
    if not bool(torch.isfinite(H).all()):
        raise ValueError("gptq_quantize: the hessian XᵀX holds NaN/Inf: the calibration inputs reaching this layer "
                         "(or their squares) are not finite")
    diag = torch.diag(H).clone()
    if bool((diag < 0).any()):
        raise ValueError(f"gptq_quantize: the hessian has negative diagonal entries (min {float(diag.min()):.3g}); "
                         "XᵀX of real inputs is positive semi-definite")
    if N == 0:
        return torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K // g), torch.zeros(0, K // g, dtype=torch.int64)
    # inputs that never fired in calibration (a ReLU's dead channel on few samples): XᵀX says nothing about their
    # weights, which are kept and rounded to nearest (they were zeroed, as GPTQ's reference code does: a 2-layer ReLU
    # MLP calibrated on 1 row then gave 55x the output error of RTN on other inputs); their diagonal gets the mean of the
    # live ones so the damping stays relative to the data
    dead = diag == 0
    H[dead, dead] = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    G = K // g
    S, Z = torch.zeros(N, G), torch.zeros(N, G, dtype=torch.int64)
    perm = torch.arange(K)
    gm, cw = ("mse", torch.diag(H).float()) if group_method == "hmse" else (group_method, None)
    if act_order:
        _, S, Z = quantize_groups(W, g, qdtype, symmetric, gm, cw)  # static groups
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        cols = perm // g  # (K,): the group of each permuted column
        Sc, Ic, Zc = S[:, cols], torch.reciprocal(S)[:, cols], Z.float()[:, cols]  # (N, K) per-column qparams
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, dtype=H.dtype)
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) == 0:
        Hinv, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if int(info) != 0:
        raise ValueError(f"gptq_quantize: the damped hessian (damp={damp!r}) is not positive definite (Cholesky failed "
                         f"at column {int(info) - 1}): XᵀX must be symmetric positive semi-definite; raise damp for a "
                         "singular one (few calibration rows, constant or repeated columns)")
    Hinv = Hinv.float()  # (K, K) upper
    Q = torch.zeros(N, K, dtype=torch.int64)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if act_order:  # this column's own (static) group
                s, inv_s, zf = Sc[:, col], Ic[:, col], Zc[:, col]
            elif col % g == 0:  # new group: qparams from the weights as updated so far
                grp = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :g]
                _, s, z = quantize_groups(grp, g, qdtype, symmetric, gm, None if cw is None else cw[col:col + g])
                S[:, col // g], Z[:, col // g] = s[:, 0], z[:, 0]
                s, inv_s, zf = s[:, 0], torch.reciprocal(s[:, 0]), z[:, 0].float()  # (N,): as in _fake
            w = W1[:, i]
            q = torch.round(w * inv_s + zf).clamp_(qdtype.quant_min, qdtype.quant_max)
            Q[:, col] = q.to(torch.int64)
            err = (w - (q - zf) * s) / Hinv1[i, i]  # the rounding error, scaled by H⁻¹'s pivot
            W1[:, i:].sub_(torch.outer(err, Hinv1[i, i:]))
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return Q, S, Z


def warn_few_rows(where: str, few: dict[str, tuple[int, int]], instead: str, stacklevel: int = 2) -> None:
    """Warn (``UserWarning``, once for all layers) that GPTQ saw fewer calibration rows than input features at the
    layers of ``few`` (``name -> (rows, in_features)``; nothing when empty): ``H = XᵀX`` then has rank ``rows < K``,
    and GPTQ fits those rows and spreads the error where they have no component. ``quantize_weight_only`` and
    ``quantize_llm`` share it; ``instead`` names the calibration-free method(s) to suggest; ``stacklevel`` as the
    caller's own ``warnings.warn`` would take it.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn_few_rows("demo", {"fc": (16, 32)}, "method='rtn'")
    >>> str(w[0].message)[:73]
    'demo: GPTQ saw fewer calibration rows than input features at 1 layer(s) ('
    """
    if not few:
        return
    shown = dict(list(few.items())[:4])
    warnings.warn(f"{where}: GPTQ saw fewer calibration rows than input features at {len(few)} layer(s) ((rows, "
                  f"in_features): {shown}{' ...' if len(few) > 4 else ''}); it over-fits those rows (on a 2-layer MLP, "
                  f"16 rows for 32 features gave ~2.4x RTN's output error): calibrate with more tokens, or use "
                  f"{instead}", stacklevel=stacklevel + 1)
