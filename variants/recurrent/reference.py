"""The plain forms the chunked kernels are tested against: the sequential recurrence, one
token at a time, and the dense (B, H, N, N) weights the recurrence implies.

Row vectors: q_t, k_t are (1, D), the state S_t is (D, D), s = D^-1/2. One recurrence
covers the family:

    S_t = (I - β_t k_t^T k_t) Diag(exp g_t) S_{t-1} + β_t k_t^T v_t,    o_t = s q_t S_t

g_t a scalar per head ((B, H, N): Diag(exp g_t) = exp(g_t) I) or per channel
((B, H, N, D)); no `g`: no decay; no `beta`: β = 1 and no erasing (the plain write
S_t = Diag(exp g_t) S_{t-1} + k_t^T v_t). With a scalar gate the decay commutes with the
erase, so this is Gated DeltaNet's exp(g_t) (I - β_t k_t^T k_t) S_{t-1} too.
"""

from __future__ import annotations

import torch


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
               beta: torch.Tensor | None = None) -> torch.Tensor:
    """o (B, Hv, N, Dv) by the recurrence above, one token at a time (differentiable); q, k
    (B, H, N, D), v and the gates (B, Hv, ...): grouped value heads, Hv a multiple of H,
    value head j reading query-key head j // (Hv / H) (q and k repeated here: the plain
    form)."""
    if v.shape[1] != q.shape[1]:
        q, k = (t.repeat_interleave(v.shape[1] // q.shape[1], dim=1) for t in (q, k))
    B, H, N, D = q.shape
    s = D ** -0.5
    S = q.new_zeros(B, H, D, v.shape[-1])  # (B, H, D, Dv)
    out = []
    for t in range(N):
        if g is not None:
            a = g[:, :, t].exp()  # (B, H) or (B, H, D)
            S = S * (a[..., None, None] if a.dim() == 2 else a[..., :, None])
        kt, vt = k[:, :, t], v[:, :, t]  # (B, H, D)
        if beta is None:
            write = vt
        else:  # erase what k_t reads from the decayed state, then write β_t v_t
            write = beta[:, :, t, None] * (vt - (kt[..., None, :] @ S).squeeze(-2))
        S = S + kt[..., :, None] * write[..., None, :]
        out.append(s * (q[:, :, t, None, :] @ S).squeeze(-2))
    return torch.stack(out, dim=2)


def _decay_matrix(g: torch.Tensor | None, N: int, like: torch.Tensor) -> torch.Tensor:
    """Γ (B, H, N, N) or (1, 1, N, N): exp(G_i - G_j) for j <= i, else 0; G = cumsum(g)."""
    lower = torch.ones(N, N, dtype=torch.bool, device=like.device).tril()
    if g is None:
        return lower.to(like.dtype)[None, None]
    G = g.cumsum(-1)
    return (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()


def dense_weights(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor | None = None,
                  beta: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, N, N) W with W @ v = recurrence(q, k, v, g, beta).

    Scalar gate, no beta: s (Q K^T ⊙ Γ). Per-channel gate: W_ij = s Σ_d q_id k_jd
    exp(G_id - G_jd). Delta rule: the UT form over one chunk of length N,
    s (tril(Q K^T) ⊙ Γ) (I + tril(diag(β) (K K^T ⊙ Γ), -1))^-1 diag(β), with the
    per-channel products in place of Q K^T ⊙ Γ and K K^T ⊙ Γ for a per-channel gate (KDA).
    """
    B, H, N, D = q.shape
    s = D ** -0.5
    if g is not None and g.dim() == 4:  # per channel: one (N, N) decay matrix per channel
        lower = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        G = g.cumsum(-2)
        qk, kk = q.new_zeros(B, H, N, N), q.new_zeros(B, H, N, N)
        for d in range(D):
            gam = (G[..., :, None, d] - G[..., None, :, d]).masked_fill(~lower, float("-inf"))
            gam = gam.exp()
            qk = qk + q[..., :, None, d] * k[..., None, :, d] * gam
            if beta is not None:
                kk = kk + k[..., :, None, d] * k[..., None, :, d] * gam
        qk = s * qk
        if beta is None:
            return qk
        a = (beta[..., :, None] * kk).tril(-1)
    else:
        gam = _decay_matrix(g, N, q)
        qk = s * (q @ k.transpose(-1, -2)) * gam  # (B, H, N, N), lower triangular
        if beta is None:
            return qk
        a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * gam).tril(-1)
    eye = torch.eye(N, dtype=q.dtype, device=q.device)
    # W = qk (I + A)^-1 diag(β): solve X (I + A) = qk, a right (upper-form) solve.
    t = torch.linalg.solve_triangular(eye + a, qk, upper=False, left=False)
    return t * beta[..., None, :]
