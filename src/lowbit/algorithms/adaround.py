"""AdaRound: learn whether each weight rounds up or down (Nagel et al. 2020, "Up or Down?").

For one layer with weight grid ``(s, z)`` (per output channel) the weight is
``W_hat(V) = s * (clamp(floor(v) + h(V), qmin, qmax) - z)``, ``v = W · fl(1 / s) + z`` in float32 (``convert``'s
unrounded code, ``lowbit.rounding.grid_position``: round to nearest here is the converted model's code), with the
rectified sigmoid
``h(V) = clamp(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``, ``zeta = 1.1``, ``gamma = -0.1``.
``V`` starts where ``h(V)`` equals the fractional part (round-to-nearest's neighbourhood) and minimises::

    || act(op(x_q; W_hat(V))) - y ||^2  +  lam * sum(1 - |2 h(V) - 1| ** beta)

on calibration data: ``x_q`` is the layer's input *in the quantized model* (earlier layers already
rounded, activations fake-quantized), ``y`` the float model's output of this layer, so each layer
also absorbs the error arriving from upstream. ``beta`` anneals from 20 to 2 after a 20 % warm-up
(the regulariser then pushes every ``h`` to 0 or 1); the final codes round ``h(V) >= 0.5`` up, unless
round-to-nearest scores better on the whole calibration objective (short runs can end worse).
Cost: ``iters`` forward/backward passes of the layer on ``batch_size`` samples.

>>> import torch

from ..rounding import grid_position
>>> from torch import nn
>>> _ = torch.manual_seed(0); lin = nn.Linear(16, 8)
>>> x = torch.randn(256, 16); y = lin(x)
>>> w = lin.weight.detach(); s = w.abs().amax(1, keepdim=True) / 8; z = torch.zeros_like(s)   # a coarse 4-bit grid
>>> from lowbit.rounding import round_codes
>>> q_near = round_codes(w, s, z, -8, 7)                 # round to nearest, as convert rounds
>>> def sample():                                         # a random mini-batch of 64 rows
...     i = torch.randint(256, (64,))
...     return (lambda w_: nn.functional.linear(x[i], w_, lin.bias)), y[i]
>>> q = adaround_codes(w, s, z, -8, 7, sample, iters=100)
>>> err = lambda q_: float((nn.functional.linear(x, (q_ - z) * s, lin.bias) - y).pow(2).mean())
>>> err(q) < err(q_near)
True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..rounding import grid_position

__all__ = ["adaround_codes", "rectified_sigmoid"]

ZETA, GAMMA = 1.1, -0.1


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    """``h(V) = clamp(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``."""
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def adaround_codes(weight: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int,
                   sample: Callable[[], tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]],
                   error: Callable[[torch.Tensor], float] | None = None, iters: int = 500, lr: float = 1e-2,
                   lam: float = 0.1, warmup: float = 0.2, beta: tuple[float, float] = (20.0, 2.0),
                   normalize: bool = True) -> torch.Tensor:
    """Learned integer codes ``q`` for ``weight`` on the grid ``(s, z)`` (same shape as ``weight``).

    ``sample()`` draws a mini-batch and returns ``(run, target)``: ``run(w_hat)`` is the layer (with its
    activation) applied to that batch's quantized-model inputs with weight ``w_hat``, ``target`` what it
    should produce (the float layer's output). The reconstruction term sums squared errors over dim 1
    (channels) and averages the rest. ``normalize=True`` divides it by round-to-nearest's value on the
    first mini-batch (not by the first step's, where ``W_hat = W`` and an exact input would make it 0)
    and averages the regulariser over the weights, so ``lam`` weighs the two terms alike for every layer size (the paper's
    ``lam = 0.01`` on a summed regulariser is tuned for 10k+ steps; with a few hundred, it rounds every
    weight before the reconstruction term has moved it). ``normalize=False, lam=0.01`` is the paper's
    objective. ``error(w_hat)`` (optional) scores a weight on all calibration
    data; the learned codes are kept only if they score no worse than round-to-nearest.
    """
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"adaround_codes: iters={iters!r} must be an int >= 0")
    w = weight.detach().to(torch.float32)
    v_pos = grid_position(w, s, z)  # convert's unrounded codes (z included): its rounding is round_codes'
    w_floor = torch.floor(v_pos)
    rest = (v_pos - w_floor).clamp(0.0, 1.0)
    # h(V0) = rest:  sigmoid(V0) = (rest - gamma) / (zeta - gamma)
    p = ((rest - GAMMA) / (ZETA - GAMMA)).clamp(1e-4, 1 - 1e-4)
    v = torch.log(p / (1 - p)).requires_grad_(True)
    opt = torch.optim.Adam([v], lr=lr)
    start = int(warmup * iters)
    scale = None
    for it in range(iters):
        run, target = sample()
        h = rectified_sigmoid(v)
        w_hat = (torch.clamp(w_floor + h, qmin, qmax) - z) * s
        d = (run(w_hat) - target.detach()).pow(2)
        loss = d.sum(1).mean() if d.dim() > 1 else d.mean()
        if normalize:  # reconstruction relative to round-to-nearest's, regulariser averaged over weights
            if scale is None:
                with torch.no_grad():
                    e = (run((torch.clamp(torch.round(v_pos), qmin, qmax) - z) * s) - target).pow(2)
                    scale = float(e.sum(1).mean() if e.dim() > 1 else e.mean()) + 1e-12
            loss = loss / scale
        if it >= start:
            b = beta[0] + (beta[1] - beta[0]) * (it - start) / max(1, iters - start)
            f = 1 - (2 * h - 1).abs().pow(b)
            loss = loss + lam * (f.mean() if normalize else f.sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        up = (rectified_sigmoid(v) >= 0.5).to(torch.float32)
        learned = torch.clamp(w_floor + up, qmin, qmax)
        if error is None:
            return learned
        nearest = torch.clamp(torch.round(v_pos), qmin, qmax)  # = round_codes(w, s, z, qmin, qmax)
        # a short run can end worse than round-to-nearest on the whole objective: keep the better
        return learned if error((learned - z) * s) <= error((nearest - z) * s) else nearest
