"""The one-chunk (parallel) forms: the whole sequence as a single chunk from a zero state,
for a sequence that fits in one chunk (a recall model's N = 64). The same sums as
`chunked.py`'s with one chunk, minus what only a carried state needs (the chunk states,
their scan, W = T K, the per-chunk loop): at such lengths a chunked call's cost is its
small operations, not its arithmetic, so these take as few as the form allows. Inputs in
the compute dtype; q, k L2-normalised for the delta rule (the caller's). Each -> o
(B, H, N, D).

With b = cumsum(g) over the sequence, s = D^-1/2 and Γ_ij = exp(b_i - b_j) for j <= i
(the decay as a mask, every exponent <= 0):

- scalar gate (retention, mamba2; SSD's quadratic form, Dao & Gu 2024, Sec. 3):
  o = s (Q K^T ⊙ Γ) V.
- per-channel gate (gla): o = s P V, P_ij = Σ_d q_id k_jd exp(b_id - b_jd) (`scores.py`).
- delta rule (deltanet, gated_deltanet; the UT transform over the whole sequence, Yang et
  al. 2024, Sec. 3): o = s (Q K^T ⊙ Γ) (I + A)^-1 diag(β) V,
  A = tril(diag(β) (K K^T ⊙ Γ), -1).
- kda: the same with the per-channel scores in place of both Q K^T ⊙ Γ and K K^T ⊙ Γ.
"""

from __future__ import annotations

import torch

from .chunked import decayed, lower_mask, unit_lower_solve
from .scores import channel_scores

def whole_scalar_gate(q, k, v, g):
    """Retention / Mamba2: g (B, H, N) log-decays per head."""
    att, = decayed(g.cumsum(-1), lower_mask(q.shape[-2], q), q @ k.transpose(-1, -2))
    return (att @ v) * q.shape[-1] ** -0.5


def whole_channel_gate(q, k, v, g, leaf: int):
    """GLA: g (B, H, N, D) log-decays per key channel."""
    return (channel_scores(q, k, g.cumsum(-2), leaf) @ v) * q.shape[-1] ** -0.5


def _delta_out(qk, a, v, beta):
    """s qk (I + tril(a, -1))^-1 diag(β) V; qk (B, H, N, N) decayed and zero above the
    diagonal, a = diag(β) (K K^T ⊙ Γ) (its diagonal and upper part are never read: the
    solve's)."""
    u = unit_lower_solve(a, beta[..., None] * v)
    return (qk @ u) * v.shape[-1] ** -0.5


def whole_delta(q, k, v, beta, g):
    """DeltaNet (g None) / Gated DeltaNet (g (B, H, N)); beta (B, H, N). diag(β) K K^T is
    taken as (β ⊙ K) K^T: β scales N D numbers, not N^2."""
    lower = lower_mask(q.shape[-2], q)
    kt = k.transpose(-1, -2)
    # two products: a cat of q and k and its split's backward cost more
    qk, a = q @ kt, (beta[..., None] * k) @ kt
    if g is None:
        return _delta_out(qk * lower, a, v, beta)
    return _delta_out(*decayed(g.cumsum(-1), lower, qk, a), v, beta)  # zero above the diagonal


def whole_delta_channel(q, k, v, beta, g, leaf: int):
    """Kimi Delta Attention: g (B, H, N, D) per channel, beta (B, H, N). The per-channel
    scores are zero above the diagonal already; the keys' rows are scaled by β before
    them (the scores are linear in x), so A = diag(β) (K K^T ⊙ Γ) needs no N^2 product."""
    qk, a = channel_scores(torch.stack([q, beta[..., None] * k]), k, g.cumsum(-2), leaf)
    return _delta_out(qk, a, v, beta)
