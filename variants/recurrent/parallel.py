"""The one-chunk (parallel) forms: the whole sequence as a single chunk from a zero state,
for a sequence that fits in one chunk (a recall model's N = 64). The same sums as
`chunked.py`'s with one chunk, minus what only a carried state needs (the chunk states,
their scan, W = T K, the per-chunk loop): at such lengths a chunked call's cost is its
small operations, not its arithmetic, so these take as few as the form allows. Inputs in
the compute dtype; q, k L2-normalised for the delta rule (the caller's). q, k (B, H, N,
Dk), v and the gates per value head (B, Hv, N, ...), Hv = r H (value head h r + j reads
query-key head h; `chunked.py` says how they are grouped). Each -> o (B, Hv, N, Dv).

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

from .chunked import decayed, lower_mask, pack, split_heads, unit_lower_solve, unpack
from .scores import channel_scores


def _out(o: torch.Tensor, D: int) -> torch.Tensor:
    """(B, H, r, N, Dv) -> (B, Hv, N, Dv), scaled by s = D^-1/2."""
    return o.flatten(1, 2) * D ** -0.5


def whole_scalar_gate(q, k, v, g):
    """Retention / Mamba2: q, k (B, H, N, Dk), v (B, Hv, N, Dv), g (B, Hv, N) log-decays
    per value head; Q K^T once per query-key head, decayed by each value head's Γ_j."""
    H = q.shape[1]
    att, = decayed(split_heads(g, H).cumsum(-1), lower_mask(q.shape[-2], q),
                   (q @ k.transpose(-1, -2))[:, :, None])  # (B, H, r, N, N)
    return _out(att @ split_heads(v, H), q.shape[-1])


def whole_channel_gate(q, k, v, g, leaf: int):
    """GLA: g (B, Hv, N, Dk) log-decays per value head and key channel: the scores per
    value head, q and k broadcast against its decays."""
    H = q.shape[1]
    att = channel_scores(q[:, :, None], k[:, :, None], split_heads(g, H).cumsum(-2), leaf)
    return _out(att @ split_heads(v, H), q.shape[-1])


def _delta_out(qk, a, v, beta, D):
    """s qk (I + tril(a, -1))^-1 diag(β) V; a = diag(β) (K K^T ⊙ Γ) (B, H, r, N, N) (its
    diagonal and upper part are never read: the solve's), v (B, H, r, N, Dv), beta
    (B, H, r, N); qk decayed and zero above the diagonal, per value head (B, H, r, N, N)
    or, without a decay, a query-key head's (B, H, N, N): then one product over the
    packed values."""
    u = unit_lower_solve(a, beta[..., None] * v)
    if qk.dim() == u.dim():
        return _out(qk @ u, D)
    return _out(unpack(qk @ pack(u), u.shape[2]), D)


def whole_delta(q, k, v, beta, g):
    """DeltaNet (g None) / Gated DeltaNet (g (B, Hv, N)); beta (B, Hv, N). Q K^T and K K^T
    once per query-key head; diag(β_j) and Γ_j per value head."""
    H, N, D = q.shape[1], q.shape[-2], q.shape[-1]
    lower = lower_mask(N, q)
    kt = k.transpose(-1, -2)
    qk, kk = q @ kt, k @ kt  # (B, H, N, N)
    bt, vs = split_heads(beta, H), split_heads(v, H)  # (B, H, r, N), (B, H, r, N, Dv)
    if g is None:
        return _delta_out(qk * lower, bt[..., None] * kk[:, :, None], vs, bt, D)
    att, a = decayed(split_heads(g, H).cumsum(-1), lower, qk[:, :, None], kk[:, :, None])
    return _delta_out(att, bt[..., None] * a, vs, bt, D)  # att zero above the diagonal


def whole_delta_channel(q, k, v, beta, g, leaf: int):
    """Kimi Delta Attention: g (B, Hv, N, Dk) per channel, beta (B, Hv, N). The per-channel
    scores are zero above the diagonal already; the keys' rows are scaled by β before
    them (the scores are linear in x), so A = diag(β) (K K^T ⊙ Γ) needs no N^2 product.
    q and β k stacked into one call where they share a shape (one value head a query-key
    head); else two, q not copied per value head."""
    H = q.shape[1]
    bt, b = split_heads(beta, H), split_heads(g, H).cumsum(-2)  # (B, H, r, N), (.., N, Dk)
    q, k = q[:, :, None], k[:, :, None]
    bk = bt[..., None] * k
    if bt.shape[2] == 1:
        qk, a = channel_scores(torch.stack([q, bk]), k, b, leaf)
    else:
        qk, a = channel_scores(q, k, b, leaf), channel_scores(bk, k, b, leaf)
    return _delta_out(qk, a, split_heads(v, H), bt, q.shape[-1])
