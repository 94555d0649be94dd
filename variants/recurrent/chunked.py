"""The chunkwise-parallel forms: within a chunk of C tokens attention-like matmuls, across
chunks a carried (D, D) state. Differentiable (autograd keeps one state per chunk:
O(N D + (N / C) D^2) plus per-chunk C x C).

Decays are compounded in log space: b = cumsum(g) within the chunk only, and every
factor taken is exp of a difference that is <= 0 (a later position against an earlier
one), so nothing overflows in float32 or bfloat16 and a small decay is never the quotient of two
underflowed ones. Inputs arrive in the compute dtype (float32 for bfloat16); the caller
casts.

Within a chunk, with b_t the log-decay from the chunk's start through t and S0 the state
before the chunk (row vectors, s = D^-1/2):

- scalar gate (retention, mamba2): o = s [(Q ⊙ e^b) S0 + (Q K^T ⊙ Γ) V],
  Γ_ij = exp(b_i - b_j) (j <= i); S_C = e^{b_C} S0 + (K ⊙ e^{b_C - b})^T V.
- per-channel gate (gla): the same with Γ per channel: Q K^T ⊙ Γ by `scores.py`, one
  path for any decay (quadrants against a point between their keys and queries, the
  diagonal leaves of `sub` tokens explicitly).
- delta rule (deltanet, gated_deltanet), the WY/UT form (Yang et al. 2024, Sec. 3): with
  A = tril(diag(β) (K K^T ⊙ Γ), -1) and T = (I + A)^-1 diag(β) (one triangular solve),
  W = T (K ⊙ e^b) and Ũ = T V; then per chunk U = Ũ - W S0 (the values the erase leaves),
  o = s [(Q ⊙ e^b) S0 + (tril(Q K^T) ⊙ Γ) U], S_C = e^{b_C} S0 + (K ⊙ e^{b_C - b})^T U.
- delta rule after a per-channel decay (kda): the same UT form with the per-channel scores
  of gla in place of Q K^T ⊙ Γ and K K^T ⊙ Γ, the state's rows decayed per channel.
"""

from __future__ import annotations

import torch

from .scores import EXP_FLOOR, channel_scores

def _pad(x: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
    """x zero-padded along `dim` to length n: padded tokens come after every real one, so
    they change no real output (a zero log-decay, zero keys and values)."""
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """(B, H, N, ...) with N a multiple of C -> (B, H, N / C, C, ...)."""
    return x.view(x.shape[0], x.shape[1], x.shape[2] // C, C, *x.shape[3:])


def lower_mask(C: int, like: torch.Tensor) -> torch.Tensor:
    """j <= i as a (C, C) 0/1 matrix in like's dtype: a product with it ran 8-20x faster
    here than tril or masked_fill on a recall model's (32, 2, 64, 64), backward too."""
    return torch.ones(C, C, dtype=like.dtype, device=like.device).tril()


class _Decayed(torch.autograd.Function):
    """m ⊙ Γ for each m given, with Γ_ij = exp(b_i - b_j) where lower[i, j] (a 0/1 mask),
    else 0; b (..., C) non-increasing (g <= 0). The exponent is clamped into [EXP_FLOOR, 0]
    before exp, in place: above the diagonal (b_i - b_j >= 0) nothing overflows before
    the mask, and no entry takes exp's slow path below float32's normal range, where an
    additive -inf mask put half the matrix (Q K^T ⊙ Γ forward at (32, 2, 64, 64), one
    thread: 0.98-1.34 ms that way against 0.32-0.36; `-k decay_matrix` in
    tests/benchmarks/test_kernels.py). Backward from the saved Γ and products: dm = d ⊙ Γ, and
    with dx = Σ d ⊙ (m ⊙ Γ), db_i = Σ_j dx_ij - Σ_j dx_ji: four C x C operations for the
    delta rule's two products where autograd took seven (an entry at the floor gets
    exp(EXP_FLOOR) for exp's derivative, which is below 1.8e-35 there)."""

    @staticmethod
    def forward(ctx, b, lower, *mats):
        e = (b[..., :, None] - b[..., None, :]).clamp_(EXP_FLOOR, 0).exp_().mul_(lower)
        outs = tuple(m * e for m in mats)
        ctx.save_for_backward(e, *outs)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *douts):
        e, *outs = ctx.saved_tensors
        dmats = [d * e if need else None for d, need in zip(douts, ctx.needs_input_grad[2:])]
        db = None
        if ctx.needs_input_grad[0]:
            dx = douts[0] * outs[0]
            for d, o in zip(douts[1:], outs[1:]):
                dx.addcmul_(d, o)
            db = dx.sum(-1) - dx.sum(-2)
        return (db, None, *dmats)


def decayed(b: torch.Tensor, lower: torch.Tensor, *mats: torch.Tensor) -> tuple:
    """(m ⊙ Γ for m in mats), Γ the decay between every pair of a chunk's positions:
    exp(b_i - b_j) where lower[i, j] (a 0/1 mask in b's dtype), else 0; b (..., C), each
    m (..., C, C). See `_Decayed`."""
    return _Decayed.apply(b, lower, *mats)


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + A)^-1 R for A strictly lower triangular (its diagonal and upper part are
    not read, so a caller need not mask them). Backward: dR = (I + A)^-T dX, one solve,
    and dA = -dR X^T on the strictly lower part, 0 on what was not read.

    The backward's solve is taken as the right-hand solve dR^T (I + A) = dX^T, on `a` as
    it is stored: the same numbers as a left solve by the transposed view of `a`, which
    took 2.6-2.9x as long here (one thread, (32, 2, 64, 64) with 32 right-hand sides and
    (32, 2, 2, 64, 64) with 64: 0.96 against 0.36 ms, 3.80 against 1.31;
    tests/benchmarks/test_recurrent_steps.py, "solve backward")."""

    @staticmethod
    def forward(ctx, a, r):
        x = torch.linalg.solve_triangular(a, r, upper=False, unitriangular=True)
        ctx.save_for_backward(a, x)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dx):
        a, x = ctx.saved_tensors
        dr = torch.linalg.solve_triangular(a, dx.transpose(-1, -2), upper=False, left=False,
                                           unitriangular=True).transpose(-1, -2)
        return (dr @ x.transpose(-1, -2)).neg_().tril_(-1), dr


unit_lower_solve = _UnitLowerSolve.apply


def chunk_length(N: int, C: int, multiple: int = 1) -> int:
    """The chunk a length-N call uses: C, or N rounded up to `multiple` when shorter."""
    return min(C, -(-N // multiple) * multiple)


# The streamed form's block: about this many elements in its largest per-block tensor
# (B H rows max(C, D)); 2 MiB in float32, so a block's temporaries are reused from the heap
# and stay in cache instead of being sequence-sized fresh mappings (see `stream`).
BLOCK_ELEMENTS = 1 << 19


def block_rows(B: int, H: int, C: int, D: int) -> int:
    """Tokens per block of `stream`: a whole number of chunks of C, at least one."""
    return max(C, BLOCK_ELEMENTS // (B * H * max(C, D)) // C * C)


def stream(step, q, k, v, inputs: dict, rows: int, dtype) -> torch.Tensor:
    """The chunkwise form run block by block of `rows` tokens (a multiple of the chunk),
    the state carried from block to block: step(q, k, v, inputs, S) -> (o, S after the
    block), on the block's slices (each input's sequence axis is dim 2). The same sums
    as one call over the whole sequence, to rounding.

    Every temporary of a kernel (the chunk scores, the chunk states, the normalised or cast
    q and k) is then block-sized, not sequence-sized: one call over N = 16384, H = 8,
    D = 64 makes tensors of 32 MiB and more, above glibc's mmap ceiling, each a fresh
    mapping faulted in page by page on every call, which made the time grow faster than N.
    Without autograd the only sequence-sized tensor is the output (in `dtype`); under
    autograd the blocks' graphs chain through the carried state, and the backward keeps
    what one whole-sequence call keeps."""
    N = q.shape[2]
    if N <= rows:
        return step(q, k, v, inputs, None)[0].to(dtype)
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, *inputs.values()))
    out = None if grad else q.new_empty(q.shape, dtype=dtype)
    outs, S = [], None
    # split, not [:, :, i:i + rows]: each slice's backward would write a zero tensor of the
    # whole input's size; split's is one concatenation.
    names = list(inputs)
    parts = [t.split(rows, dim=2) for t in (q, k, v, *inputs.values())]
    for i, (qb, kb, vb, *ib) in enumerate(zip(*parts)):
        o, S = step(qb, kb, vb, dict(zip(names, ib)), S)
        if grad:
            outs.append(o)
        else:
            out[:, :, i * rows:i * rows + o.shape[2]] = o
        del o  # before the next block makes its own
    return torch.cat(outs, dim=2).to(dtype) if grad else out


def _scan(decay: torch.Tensor, U: torch.Tensor, S: torch.Tensor | None):
    """States before each chunk: S_0 = S (zeros for None), S_{c+1} = decay_c ⊙ S_c + U_c.
    decay (B, H, n, 1 or D, 1), U (B, H, n, D, D) -> ((B, H, n, D, D), the state after
    the last chunk (B, H, D, D))."""
    S = torch.zeros_like(U[:, :, 0]) if S is None else S
    states = []
    # unbind, not U[:, :, c]: each indexing's backward would write a zero tensor of U's
    # size, (N / C)^2 D^2 in all; unbind's is one stack.
    for d, u in zip(decay.unbind(2), U.unbind(2)):
        states.append(S)
        S = d * S + u
    return torch.stack(states, dim=2), S


def chunk_scalar_gate(q, k, v, g, C: int, S=None):
    """Retention / Mamba2 (SSD): g (B, H, N) log-decays per head; S the state before the
    first token (B, H, D, D), None for zeros. -> (o (B, H, N, D), the state after the
    last token)."""
    B, H, N, D = q.shape
    C = chunk_length(N, C)
    n = -(-N // C) * C
    qc, kc, vc = (_chunks(_pad(t, n), C) for t in (q, k, v))  # (B, H, n/C, C, D)
    b = _chunks(_pad(g, n), C).cumsum(-1)  # (B, H, n/C, C)
    s = D ** -0.5
    att, = decayed(b, lower_mask(C, q), qc @ kc.transpose(-1, -2))  # (B, H, n/C, C, C)
    last = b[..., -1:]  # (B, H, n/C, 1)
    U = (kc * (last - b).exp()[..., None]).transpose(-1, -2) @ vc  # (B, H, n/C, D, D)
    S0, S = _scan(last.exp()[..., None], U, S)  # states before each chunk, after the last
    o = att @ vc + (qc * b.exp()[..., None]) @ S0
    return (s * o).reshape(B, H, n, D)[:, :, :N], S


def chunk_channel_gate(q, k, v, g, C: int, sub: int, S=None):
    """GLA: g (B, H, N, D) log-decays per key channel; S as chunk_scalar_gate's. -> (o
    (B, H, N, D), the state after the last token)."""
    B, H, N, D = q.shape
    C = chunk_length(N, C)
    n = -(-N // C) * C
    qc, kc, vc = (_chunks(_pad(t, n), C) for t in (q, k, v))  # (B, H, nc, C, D)
    b = _chunks(_pad(g, n), C).cumsum(-2)  # (B, H, nc, C, D)
    s = D ** -0.5
    last = b[..., -1:, :]  # (B, H, nc, 1, D): each chunk's total log-decay, <= 0
    att = channel_scores(qc, kc, b, sub)  # (B, H, nc, C, C)
    U = (kc * (last - b).exp()).transpose(-1, -2) @ vc  # (B, H, nc, D, D)
    S0, S = _scan(last.exp().transpose(-1, -2), U, S)
    o = att @ vc + (qc * b.exp()) @ S0
    return (s * o).reshape(B, H, n, D)[:, :, :N], S


def chunk_delta(q, k, v, beta, g, C: int, S=None):
    """DeltaNet (g None) / Gated DeltaNet (g (B, H, N)): beta (B, H, N); q, k already
    L2-normalised; S as chunk_scalar_gate's. -> (o (B, H, N, D), the state after the last
    token)."""
    B, H, N, D = q.shape
    C = chunk_length(N, C)
    n = -(-N // C) * C
    qc, kc, vc = (_chunks(_pad(t, n), C) for t in (q, k, v))  # (B, H, nc, C, D)
    bc = _chunks(_pad(beta, n), C)  # (B, H, nc, C)
    s = D ** -0.5
    lower = lower_mask(C, q)
    # diag(β) K K^T as (β ⊙ K) K^T (β scales C D numbers, not C^2); the solve reads only
    # its strict lower part
    kk = (bc[..., None] * kc) @ kc.transpose(-1, -2)
    qk = qc @ kc.transpose(-1, -2)
    if g is None:
        b = None
        a, att = kk, qk * lower  # tril(Q K^T)
    else:
        b = _chunks(_pad(g, n), C).cumsum(-1)  # (B, H, nc, C)
        a, att = decayed(b, lower, kk, qk)  # and tril(Q K^T) ⊙ Γ
    ke = kc if b is None else kc * b.exp()[..., None]
    rhs = bc[..., None] * torch.cat([vc, ke], dim=-1)  # diag(β) [V | K ⊙ e^b]
    x = unit_lower_solve(a, rhs)  # (I + A)^-1 rhs
    # Ũ = T V, W = T (K ⊙ e^b); contiguous: the per-chunk matmuls on strided halves ran
    # ten times slower here.
    u_t, w = x[..., :D].contiguous(), x[..., D:].contiguous()
    if b is None:
        qe, kd, decay = qc, kc, None
    else:
        last = b[..., -1:]
        qe, kd, decay = qc * b.exp()[..., None], kc * (last - b).exp()[..., None], last.exp()
    S = q.new_zeros(B, H, D, D) if S is None else S
    out = []
    decays = [None] * (n // C) if decay is None else decay[..., None].unbind(2)
    # unbind, not [:, :, c] (see _scan): one stack in the backward, not N / C zero tensors.
    for u_c, w_c, q_c, a_c, k_c, d_c in zip(u_t.unbind(2), w.unbind(2), qe.unbind(2),
                                             att.unbind(2), kd.unbind(2), decays):
        u = u_c - w_c @ S  # (B, H, C, D): the values the erase leaves
        out.append(q_c @ S + a_c @ u)
        S = S if d_c is None else d_c * S
        S = S + k_c.transpose(-1, -2) @ u
    return (s * torch.stack(out, dim=2)).reshape(B, H, n, D)[:, :, :N], S


def chunk_delta_channel(q, k, v, beta, g, C: int, sub: int, S=None):
    """Kimi Delta Attention: the delta rule after a per-channel decay, g (B, H, N, D), beta
    (B, H, N); q, k already L2-normalised. The UT form with GLA's per-channel scores:
    A = tril(diag(β) [Σ_d k_td k_jd e^{b_td - b_jd}], -1), W = T (K ⊙ e^b), Ũ = T V, and
    per chunk U = Ũ - W S0, o = s [(Q ⊙ e^b) S0 + P U], S_C = Diag(e^{b_C}) S0 +
    (K ⊙ e^{b_C - b})^T U, P_tj = Σ_d q_td k_jd e^{b_td - b_jd} (j <= t); S as
    chunk_scalar_gate's. -> (o (B, H, N, D), the state after the last token)."""
    B, H, N, D = q.shape
    C = chunk_length(N, C)
    n = -(-N // C) * C
    qc, kc, vc = (_chunks(_pad(t, n), C) for t in (q, k, v))  # (B, H, nc, C, D)
    bc = _chunks(_pad(beta, n), C)  # (B, H, nc, C)
    b = _chunks(_pad(g, n), C).cumsum(-2)  # (B, H, nc, C, D)
    s = D ** -0.5
    last = b[..., -1:, :]  # (B, H, nc, 1, D)
    # P, and diag(β) (K K^T decayed) from the keys' rows scaled by β (the scores are linear
    # in x); the solve reads only its strict lower part, so no mask
    p_att, a = channel_scores(torch.stack([qc, bc[..., None] * kc]), kc, b, sub)
    eb = b.exp()  # e^b, taken once for W's right-hand side and Q ⊙ e^b
    rhs = bc[..., None] * torch.cat([vc, kc * eb], dim=-1)  # diag(β) [V | K ⊙ e^b]
    x = unit_lower_solve(a, rhs)
    u_t, w = x[..., :D].contiguous(), x[..., D:].contiguous()
    att = p_att
    qe, kd = qc * eb, kc * (last - b).exp()
    decay = last.exp().transpose(-1, -2)  # (B, H, nc, D, 1): the state's rows
    S = q.new_zeros(B, H, D, D) if S is None else S
    out = []
    for u_c, w_c, q_c, a_c, k_c, d_c in zip(u_t.unbind(2), w.unbind(2), qe.unbind(2),
                                             att.unbind(2), kd.unbind(2), decay.unbind(2)):
        u = u_c - w_c @ S
        out.append(q_c @ S + a_c @ u)
        S = d_c * S + k_c.transpose(-1, -2) @ u
    return (s * torch.stack(out, dim=2)).reshape(B, H, n, D)[:, :, :N], S
