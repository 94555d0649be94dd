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

Grouped value heads (Hv = r H; value head h r + j reads query-key head h: fla's
`num_v_heads`, Qwen3-Next's 32 value heads over 16 query-key heads) run natively: q and k
stay (B, H, N, Dk) and are never repeated; v, the gates and beta are per value head, seen
as (B, H, r, ...) views. The state of query-key head h is (Dk, r Dv): its r value heads'
(Dk, Dv) states side by side in the value width (`pack`), so that Q S and K^T U are one
product per query-key head over all r value heads, and Q K^T, K K^T are taken once per
query-key head. A decay per value head cannot be factored out of that shared state: it
scales each Dv-wide column block by its own head's factor (`col_decay`), and where it
enters a chunk's scores (Γ_j, a per-channel decay, β_j) those are per value head, the
shared Q K^T broadcast against them. With r = 1 every packing is a view.
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


def _vchunks(x: torch.Tensor, H: int, C: int) -> torch.Tensor:
    """A per-value-head tensor (B, Hv, N, ...), N a multiple of C, as (B, H, r, N / C, C,
    ...), r = Hv / H: value head h r + j at (h, j). A view."""
    B, Hv, N = x.shape[:3]
    return x.view(B, H, Hv // H, N // C, C, *x.shape[3:])


def split_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """(B, Hv, ...) as (B, H, r, ...), r = Hv / H, a view: the r value heads of each
    query-key head."""
    return x.view(x.shape[0], H, x.shape[1] // H, *x.shape[2:])


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, H, r, ..., m, Dv) -> (B, H, ..., m, r Dv): each query-key head's r value heads
    side by side in the value width (the packed state's layout). A view where r = 1."""
    return x.movedim(2, -2).flatten(-2)


def unpack(x: torch.Tensor, r: int) -> torch.Tensor:
    """(B, H, ..., m, r Dv) -> (B, H, r, ..., m, Dv), a view: `pack` undone."""
    return x.unflatten(-1, (r, x.shape[-1] // r)).movedim(-2, 2)


def col_decay(d: torch.Tensor, Dv: int) -> torch.Tensor:
    """A decay per value head, d (B, H, r, ..., m) (m = 1: one per head; m = Dk: one per
    state row), as the packed state's factor (B, H, ..., m, r Dv): each Dv-wide column
    block by its own head's decay; (B, H, ..., m, 1) where r = 1."""
    r, d = d.shape[2], d.movedim(2, -1)  # (B, H, ..., m, r)
    return d if r == 1 else d[..., None].expand(*d.shape, Dv).flatten(-2)


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
        # a query-key head's m against its r value heads' Γ: gradients summed back
        ctx.shapes, ctx.b_shape = [m.shape for m in mats], b.shape
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *douts):
        e, *outs = ctx.saved_tensors
        dmats = [(d * e).sum_to_size(shape) if need else None
                 for d, need, shape in zip(douts, ctx.needs_input_grad[2:], ctx.shapes)]
        db = None
        if ctx.needs_input_grad[0]:
            dx = douts[0] * outs[0]
            for d, o in zip(douts[1:], outs[1:]):
                dx.addcmul_(d, o)
            db = (dx.sum(-1) - dx.sum(-2)).sum_to_size(ctx.b_shape)
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
    # (B, Hv, N, Dv): the output has the value heads and width
    out = None if grad else q.new_empty(v.shape[:3] + v.shape[-1:], dtype=dtype)
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
    decay (B, H, n, 1 or Dk, 1 or r Dv) (`col_decay`), U (B, H, n, Dk, r Dv) -> ((B, H, n,
    Dk, r Dv), the state after the last chunk (B, H, Dk, r Dv))."""
    S = torch.zeros_like(U[:, :, 0]) if S is None else S
    states = []
    # unbind, not U[:, :, c]: each indexing's backward would write a zero tensor of U's
    # size, (N / C)^2 D^2 in all; unbind's is one stack.
    for d, u in zip(decay.unbind(2), U.unbind(2)):
        states.append(S)
        S = d * S + u
    return torch.stack(states, dim=2), S


def _shapes(q, v, C):
    """(B, H, N, D, r, Dv, C, n): the chunk a call uses and the padded length n."""
    B, H, N, D = q.shape
    C = chunk_length(N, C)
    return B, H, N, D, v.shape[1] // H, v.shape[-1], C, -(-N // C) * C


def chunk_scalar_gate(q, k, v, g, C: int, S=None):
    """Retention / Mamba2 (SSD): q, k (B, H, N, Dk), v (B, Hv, N, Dv), g (B, Hv, N)
    log-decays per value head; S the state before the first token (B, H, Dk, r Dv), None
    for zeros. -> (o (B, Hv, N, Dv), the state after the last token).

    Q K^T once per query-key head, decayed by each value head's Γ_j; the state's write
    K^T (w ⊙ V) with the decay w_tj = e^{b_Cj - b_tj} on the values' side, and the read
    (Q ⊙ e^{b_j}) S0_j = diag(e^{b_j}) (Q S0)_j: each one product over the packed values."""
    B, H, N, D, r, Dv, C, n = _shapes(q, v, C)
    qc, kc = (_chunks(_pad(t, n), C) for t in (q, k))  # (B, H, nc, C, Dk)
    vc = _vchunks(_pad(v, n), H, C)  # (B, H, r, nc, C, Dv)
    b = _vchunks(_pad(g, n), H, C).cumsum(-1)  # (B, H, r, nc, C)
    s = D ** -0.5
    att, = decayed(b, lower_mask(C, q), (qc @ kc.transpose(-1, -2))[:, :, None])
    last = b[..., -1:]  # (B, H, r, nc, 1)
    U = kc.transpose(-1, -2) @ pack(vc * (last - b).exp()[..., None])  # (B, H, nc, Dk, r Dv)
    S0, S = _scan(col_decay(last.exp(), Dv), U, S)  # states before each chunk, after the last
    o = att @ vc + unpack(qc @ S0, r) * b.exp()[..., None]  # (B, H, r, nc, C, Dv)
    return (s * o).reshape(B, H * r, n, Dv)[:, :, :N], S


def chunk_channel_gate(q, k, v, g, C: int, sub: int, S=None):
    """GLA: g (B, Hv, N, Dk) log-decays per value head and key channel; q, k, v, S as
    chunk_scalar_gate's. -> (o (B, Hv, N, Dv), the state after the last token). A decay
    per key channel enters the scores and the state's rows, so those are per value head
    (q and k broadcast against each head's decays, never copied)."""
    B, H, N, D, r, Dv, C, n = _shapes(q, v, C)
    qc, kc = (_chunks(_pad(t, n), C)[:, :, None] for t in (q, k))  # (B, H, 1, nc, C, Dk)
    vc = _vchunks(_pad(v, n), H, C)  # (B, H, r, nc, C, Dv)
    b = _vchunks(_pad(g, n), H, C).cumsum(-2)  # (B, H, r, nc, C, Dk)
    s = D ** -0.5
    last = b[..., -1:, :]  # (B, H, r, nc, 1, Dk): each chunk's total log-decay, <= 0
    att = channel_scores(qc, kc, b, sub)  # (B, H, r, nc, C, C)
    U = pack((kc * (last - b).exp()).transpose(-1, -2) @ vc)  # (B, H, nc, Dk, r Dv)
    S0, S = _scan(col_decay(last.exp().squeeze(-2), Dv), U, S)
    o = att @ vc + (qc * b.exp()) @ unpack(S0, r)
    return (s * o).reshape(B, H * r, n, Dv)[:, :, :N], S


def chunk_delta(q, k, v, beta, g, C: int, S=None):
    """DeltaNet (g None) / Gated DeltaNet (g (B, Hv, N)): beta (B, Hv, N); q, k already
    L2-normalised; q, k, v, S as chunk_scalar_gate's. -> (o (B, Hv, N, Dv), the state
    after the last token).

    Q K^T and K K^T once per query-key head; A_j = diag(β_j) (K K^T ⊙ Γ_j) and so the
    solve, Ũ_j and W_j are per value head (each erases with its own β_j). Per chunk the
    read Q S0 and the write K^T U are one product each over the packed values, W_j S0_j
    one per value head; without a gate the scores tril(Q K^T) are shared too."""
    B, H, N, D, r, Dv, C, n = _shapes(q, v, C)
    qc, kc = (_chunks(_pad(t, n), C) for t in (q, k))  # (B, H, nc, C, Dk)
    vc = _vchunks(_pad(v, n), H, C)  # (B, H, r, nc, C, Dv)
    bc = _vchunks(_pad(beta, n), H, C)  # (B, H, r, nc, C)
    s = D ** -0.5
    lower = lower_mask(C, q)
    kk = kc @ kc.transpose(-1, -2)
    qk = qc @ kc.transpose(-1, -2)
    if g is None:
        b = None
        a, att = kk[:, :, None], qk * lower  # tril(Q K^T), shared by the r value heads
    else:
        b = _vchunks(_pad(g, n), H, C).cumsum(-1)  # (B, H, r, nc, C)
        a, att = decayed(b, lower, kk[:, :, None], qk[:, :, None])  # tril(Q K^T) ⊙ Γ_j
    a = bc[..., None] * a  # diag(β_j) (K K^T ⊙ Γ_j); the solve reads its strict lower part
    ke = kc[:, :, None] if b is None else kc[:, :, None] * b.exp()[..., None]
    rhs = bc[..., None] * torch.cat([vc, ke.expand(*vc.shape[:-1], D)], dim=-1)
    x = unit_lower_solve(a, rhs)  # (I + A)^-1 diag(β) [V | K ⊙ e^b]
    # Ũ = T V, W = T (K ⊙ e^b); contiguous: the per-chunk matmuls on strided halves ran
    # ten times slower here.
    u_t, w = x[..., :Dv].contiguous(), x[..., Dv:].contiguous()  # (B, H, r, nc, C, .)
    S = q.new_zeros(B, H, D, r * Dv) if S is None else S
    out = []
    if b is None:
        # unbind, not [:, :, c] (see _scan): one stack in the backward, not N / C zero
        # tensors.
        for u_c, w_c, q_c, a_c, k_c in zip(u_t.unbind(3), w.unbind(3), qc.unbind(2),
                                           att.unbind(2), kc.unbind(2)):
            u = pack(u_c - w_c @ unpack(S, r))  # (B, H, C, r Dv): what the erase leaves
            out.append(unpack(q_c @ S + a_c @ u, r))
            S = S + k_c.transpose(-1, -2) @ u
    else:
        last = b[..., -1:]
        eb, wk = b.exp()[..., None], (last - b).exp()[..., None]  # (B, H, r, nc, C, 1)
        decay = col_decay(last.exp(), Dv)  # (B, H, nc, 1, r Dv)
        for u_c, w_c, q_c, a_c, k_c, e_c, x_c, d_c in zip(
                u_t.unbind(3), w.unbind(3), qc.unbind(2), att.unbind(3), kc.unbind(2),
                eb.unbind(3), wk.unbind(3), decay.unbind(2)):
            u = u_c - w_c @ unpack(S, r)  # (B, H, r, C, Dv)
            out.append(unpack(q_c @ S, r) * e_c + a_c @ u)
            S = d_c * S + k_c.transpose(-1, -2) @ pack(x_c * u)
    return (s * torch.stack(out, dim=3)).reshape(B, H * r, n, Dv)[:, :, :N], S


def chunk_delta_channel(q, k, v, beta, g, C: int, sub: int, S=None):
    """Kimi Delta Attention: the delta rule after a per-channel decay, g (B, Hv, N, Dk),
    beta (B, Hv, N); q, k already L2-normalised. The UT form with GLA's per-channel scores:
    A = tril(diag(β) [Σ_d k_td k_jd e^{b_td - b_jd}], -1), W = T (K ⊙ e^b), Ũ = T V, and
    per chunk U = Ũ - W S0, o = s [(Q ⊙ e^b) S0 + P U], S_C = Diag(e^{b_C}) S0 +
    (K ⊙ e^{b_C - b})^T U, P_tj = Σ_d q_td k_jd e^{b_td - b_jd} (j <= t); q, k, v, S as
    chunk_scalar_gate's, every decayed term per value head. -> (o (B, Hv, N, Dv), the
    state after the last token)."""
    B, H, N, D, r, Dv, C, n = _shapes(q, v, C)
    qc, kc = (_chunks(_pad(t, n), C)[:, :, None] for t in (q, k))  # (B, H, 1, nc, C, Dk)
    vc = _vchunks(_pad(v, n), H, C)  # (B, H, r, nc, C, Dv)
    bc = _vchunks(_pad(beta, n), H, C)  # (B, H, r, nc, C)
    b = _vchunks(_pad(g, n), H, C).cumsum(-2)  # (B, H, r, nc, C, Dk)
    s = D ** -0.5
    last = b[..., -1:, :]  # (B, H, r, nc, 1, Dk)
    # P, and diag(β) (K K^T decayed) from the keys' rows scaled by β (the scores are linear
    # in x); the solve reads only its strict lower part, so no mask. One call with q and
    # β k stacked where they share a shape (r = 1); else q is not copied per value head.
    bk = bc[..., None] * kc
    if r == 1:
        p_att, a = channel_scores(torch.stack([qc, bk]), kc, b, sub)
    else:
        p_att, a = channel_scores(qc, kc, b, sub), channel_scores(bk, kc, b, sub)
    eb = b.exp()  # e^b, taken once for W's right-hand side and Q ⊙ e^b
    rhs = bc[..., None] * torch.cat([vc, kc * eb], dim=-1)  # diag(β) [V | K ⊙ e^b]
    x = unit_lower_solve(a, rhs)
    u_t, w = x[..., :Dv].contiguous(), x[..., Dv:].contiguous()
    qe, kd = qc * eb, kc * (last - b).exp()  # (B, H, r, nc, C, Dk)
    decay = col_decay(last.exp().squeeze(-2), Dv)  # (B, H, nc, Dk, r Dv): the state's rows
    S = q.new_zeros(B, H, D, r * Dv) if S is None else S
    out = []
    for u_c, w_c, q_c, a_c, k_c, d_c in zip(u_t.unbind(3), w.unbind(3), qe.unbind(3),
                                             p_att.unbind(3), kd.unbind(3), decay.unbind(2)):
        Sj = unpack(S, r)  # (B, H, r, Dk, Dv)
        u = u_c - w_c @ Sj
        out.append(q_c @ Sj + a_c @ u)
        S = d_c * S + pack(k_c.transpose(-1, -2) @ u)
    return (s * torch.stack(out, dim=3)).reshape(B, H * r, n, Dv)[:, :, :N], S
