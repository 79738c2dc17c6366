"""Scale refinement after GPTQ: with the codes fixed, re-fit each group's scale to the layer-output error.

GPTQ chooses the integer codes ``q`` with the group qparams ``(s, z)`` fixed beforehand. Given ``q``
and ``z``, the dequantized weight is linear in the scales, ``ŵ[n, J_j] = s_nj · c[n, J_j]`` with
``c = q - z`` (``J_j``: the columns of group ``j``), so the output error on the calibration inputs

    f(s) = Σ_n (w_n - ŵ_n) H (w_n - ŵ_n)ᵀ,      H = XᵀX

is a quadratic in ``s``. ``refine_scales`` minimises it by exact coordinate descent over the groups
(every row at once): with ``E = W - Ŵ`` and ``R = E H``,

    δ_n = (c_nJ · R_nJ) / (c_nJ H_JJ c_nJᵀ),     s_nj += δ_n,     E_J -= δ c_J,     R -= (δ c_J) H_J:

each step lowers ``f`` (or keeps it: a step that would make a scale ≤ 0 is skipped), and ``sweeps``
passes over the groups cost ``O(sweeps · N K²)``, about one calibration matmul. Codes and zero points
do not change, so the file size and the kernels are the same.

>>> import torch
>>> from lowbit.nn.quantized.weight_only import gptq_quantize
>>> from lowbit.qscheme import quint4
>>> X = torch.randn(512, 32) * torch.linspace(0.2, 3, 32); w = torch.randn(8, 32); H = X.T @ X
>>> q, s, z = gptq_quantize(w, H, 16, quint4, False)
>>> s2, f = refine_scales(w, H, q, s, z, 16)
>>> bool(f[-1] <= f[0]) and s2.shape == s.shape
True
"""

from __future__ import annotations

import torch

__all__ = ["refine_scales", "output_error"]


def output_error(w: torch.Tensor, H: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int) -> float:
    """``Σ_n (w_n - ŵ_n) H (w_n - ŵ_n)ᵀ`` (float64) of codes ``q`` ``(N, K)`` on group qparams ``s, z`` ``(N, K/g)``."""
    N, K = w.shape
    dq = ((q.double().reshape(N, -1, g) - z.double()[..., None]) * s.double()[..., None]).reshape(N, K)
    e = w.double() - dq
    return float(((e @ H.double()) * e).sum())


@torch.no_grad()
def refine_scales(w: torch.Tensor, H: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int,
                  sweeps: int = 4) -> tuple[torch.Tensor, list[float]]:
    """Scales ``(N, G)`` minimising the output error for fixed codes; also ``f`` before and after each sweep."""
    N, K = w.shape
    if q.shape != (N, K) or s.shape != (N, K // g) or z.shape != s.shape or H.shape != (K, K):
        raise ValueError(f"refine_scales: codes {tuple(q.shape)}, scales {tuple(s.shape)}, zero points "
                         f"{tuple(z.shape)} and H {tuple(H.shape)} do not fit a weight {tuple(w.shape)} in groups of {g}")
    Hd = H.double()
    c = (q.double().reshape(N, -1, g) - z.double()[..., None])  # (N, G, g)
    s = s.double().clone()
    E = w.double() - (c * s[..., None]).reshape(N, K)
    R = E @ Hd
    f = [float((R * E).sum())]
    for _ in range(sweeps):
        for j in range(K // g):
            J = slice(j * g, (j + 1) * g)
            cj = c[:, j]  # (N, g)
            den = ((cj @ Hd[J, J]) * cj).sum(1)
            d = torch.where(den > 0, (cj * R[:, J]).sum(1) / den.clamp_min(1e-300), torch.zeros_like(den))
            d = torch.where(s[:, j] + d > 0, d, torch.zeros_like(d))  # keep every scale positive
            s[:, j] += d
            step = d[:, None] * cj  # (N, g): the change of ŵ on this group
            E[:, J] -= step
            R -= step @ Hd[J, :]
        f.append(float((R * E).sum()))
    return s.float(), f
