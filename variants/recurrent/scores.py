"""The per-channel decayed scores of GLA and KDA within a chunk, by one path for any decay:

    P_tj = Σ_d x_td k_jd exp(b_td - b_jd)   for j <= t, else 0,

x (..., C, D) the queries (or the keys themselves, for the delta rule's K K^T), k the keys,
b = cumsum(g) the log-decay from the chunk's start (non-increasing along C: every g <= 0).
A per-channel decay is no rank-one mask, so P is one matmul only against a common
reference point p, (x_t e^{b_t - b_p}) . (k_j e^{b_p - b_j}); both factors are <= 1, and
so nothing can overflow whatever the decay, exactly when j <= p <= t. That holds for a
whole off-diagonal quadrant of a block at once: queries in its second half, keys in its
first, p the last key of the first half. So the lower triangle is cut dyadically (GLA's
secondary-level chunking, Yang et al. 2024, Sec. 4, taken to every level, each block
against a point inside it as fla's chunk_gla and chunk_kda do within a chunk): the
chunk's lower-left quadrant is one matmul, then each diagonal half's, and so on down to
diagonal leaves of `leaf` tokens, whose (leaf, leaf, D) decays are taken explicitly
(exponents clamped into [EXP_FLOOR, 0], the upper part zeroed after exp; leaf 1: only
x_t . k_t).

The ops called, and so the time, depend only on the shapes, never on the decays' values
(an earlier form switched to a slower path where a channel decayed by more than 60 nats
within a chunk: its time depended on the gates drawn). Cost: about C N D multiply-adds
in the quadrants' matmuls (half of one masked C x C matmul), leaf N D in the leaves and
about 6 N D elementwise a level, log2(C / leaf) levels.
"""

from __future__ import annotations

import torch

# exp's floor for a log-decay: exp takes a slow path for a result below the smallest normal
# number (x < -87.3 in float32). On 2^18 floats, one thread, two runs (`-k exp_of_a_decay`
# in tests/benchmarks/test_kernels.py): 0.24-0.30 ns an element down to -86, 56-64 ns at
# -87.5 to -100, 22-25 ns at -130 to -200, 6-7 ns at -inf. exp(-80) is 1.8e-35, beside a
# chunk's diagonal terms of order one.
EXP_FLOOR = -80.0


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def channel_scores(x: torch.Tensor, k: torch.Tensor, b: torch.Tensor,
                   leaf: int) -> torch.Tensor:
    """P (..., C, C) as above, diagonal included; b (..., C, D) the cumulative log-decay.
    x, k and b broadcast against each other: x may carry one extra leading dimension
    (queries and keys stacked, (2, ..., C, D)), and x and k may be a query-key head's
    (a dimension of 1) against the decays of its r value heads in b (grouped value
    heads: the scores are per value head, q and k are never copied for them).
    Differentiable (`_Scores`)."""
    C, D = k.shape[-2:]
    P = _pow2(C)
    if P > C:  # zeros after the chunk: no contribution; b repeats its last row, so that
        # every factor stays exp of a difference <= 0 (a zero b there would not)
        pad = P - C
        x = torch.cat([x, x.new_zeros(*x.shape[:-2], pad, D)], dim=-2)
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, D)], dim=-2)
        b = torch.cat([b, b[..., -1:, :].expand(*b.shape[:-2], pad, D)], dim=-2)
    keep = (b.numel() <= KEEP_MAX and torch.is_grad_enabled()
            and any(t.requires_grad for t in (x, k, b)))
    out = _Scores.apply(x, k, b, min(_pow2(max(1, leaf)), P), keep)
    return out[..., :C, :C] if P > C else out


def _blocks(t: torch.Tensor, m: int, cols: int | None = None) -> torch.Tensor:
    """The diagonal (m, m) blocks of t (..., P, P) as a view (..., P/m, m, m); with cols,
    the (m, cols) row blocks of t (..., P, cols) as (..., P/m, m, cols)."""
    P = t.shape[-2]
    if cols is not None:
        return t.view(*t.shape[:-2], P // m, m, cols)
    v = t.view(*t.shape[:-2], P // m, m, P // m, m)
    return v.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _levels(P: int, L: int):
    """(m, h) of each level: blocks of m tokens, halves of h, from the leaves up."""
    m = L
    while m < P:
        m *= 2
        yield m, m // 2


def _factors(b: torch.Tensor, m: int, h: int):
    """exp(b_t - b_p) for the later half's queries and exp(b_p - b_j) for the earlier
    half's keys of each block of m, p the earlier half's last key: (..., P/m, h, D) each,
    every factor <= 1."""
    bs = _blocks(b, m, b.shape[-1])
    r = bs[..., h - 1:h, :]
    return (bs[..., h:, :] - r).exp_(), (r - bs[..., :h, :]).exp_()  # in place: no autograd


def _leaf_decays(b: torch.Tensor, L: int) -> torch.Tensor:
    """exp(b_t - b_j) within each leaf of L tokens, 0 for j > t: (..., P/L, L, L, D). In
    place (no autograd here); the clamp keeps exp off its slow paths (see EXP_FLOOR)."""
    bl = _blocks(b, L, b.shape[-1])[..., :, None, :]  # (..., P/L, L, 1, D)
    upper = torch.ones(L, L, dtype=torch.bool, device=b.device).triu(1)[..., None]
    return (bl - bl.transpose(-2, -3)).clamp_(EXP_FLOOR, 0).exp_().masked_fill_(upper, 0)


# Elements of b up to which the forward keeps every level's factors for the backward
# (4 MiB of b in float32; a recall model's (32, 2, 64, 32) is 1/8 of it).
KEEP_MAX = 1 << 20

# Quadrants of at most this many rows are multiplied elementwise: a batched matmul of a few
# rows runs far below its rate (at h = 2, 2x slower than the broadcast product here).
SMALL = 2


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a b^T over the last two dims, a and b (..., h, D)."""
    if a.shape[-2] == 1:
        return (a * b).sum(-1, keepdim=True)
    if a.shape[-2] <= SMALL:
        return (a[..., :, None, :] * b[..., None, :, :]).sum(-1)
    return a @ b.transpose(-1, -2)


def _times(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """s @ b, s (..., h, h), b (..., h, D) (see _outer)."""
    if s.shape[-1] == 1:
        return s * b
    if s.shape[-1] <= SMALL:
        return (s[..., :, :, None] * b[..., None, :, :]).sum(-2)
    return s @ b


class _Scores(torch.autograd.Function):
    """P from x, k, b (padded to a power of two P), leaves of L; the backward by the same
    blocks: dx_t = Σ_j dP_tj (k_j ⊙ e^{b_t - b_j}), dk_j = Σ_t dP_tj (x_t ⊙ e^{b_t - b_j}),
    and db = x ⊙ dx - k ⊙ dk (each e^{b_t - b_j} moves with b_t and against b_j)."""

    @staticmethod
    def forward(ctx, x, k, b, L, keep):
        ctx.save_for_backward(x, k, b)
        ctx.L = L
        # keep (a recall model's chunk under autograd): each level's factors and scaled
        # rows are kept for the backward, which then takes half its ops; otherwise it
        # recomputes them (2 log2(P / L) copies of x's size held would be too many at long
        # N, and a forward without autograd needs none).
        ctx.kept = [] if keep else None
        P, D = k.shape[-2:]
        out = x.new_zeros(torch.broadcast_shapes(x.shape[:-2], k.shape[:-2], b.shape[:-2])
                          + (P, P))
        if L == 1:
            out.diagonal(dim1=-2, dim2=-1).copy_((x * k).sum(-1))
        else:
            _blocks(out, L).copy_((_blocks(x, L, D)[..., :, None, :] * _leaf_decays(b, L)
                                   * _blocks(k, L, D)[..., None, :, :]).sum(-1))
        for m, h in _levels(P, L):
            eq, ek = _factors(b, m, h)
            qr = _blocks(x, m, D)[..., h:, :] * eq  # the later queries
            kr = _blocks(k, m, D)[..., :h, :] * ek  # the earlier keys
            if keep:
                ctx.kept.append((eq, ek, qr, kr))
            if qr.dim() > kr.dim() and h > SMALL:  # stacked: a product per x, not one
                # against k broadcast (a batched matmul copies the expanded k^T first)
                for o, r in zip(out.unbind(0), qr.unbind(0)):
                    _blocks(o, m)[..., h:, :h] = r @ kr.transpose(-1, -2)
            else:
                _blocks(out, m)[..., h:, :h] = _outer(qr, kr)  # (..., P/m, h, h)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dP):
        x, k, b = ctx.saved_tensors
        L, (P, D) = ctx.L, k.shape[-2:]
        dP = dP.contiguous()
        shape = torch.broadcast_shapes(x.shape[:-2], k.shape[:-2], b.shape[:-2]) + (P, D)
        dx, dk = x.new_zeros(shape), x.new_zeros(shape)
        if L == 1:
            d = dP.diagonal(dim1=-2, dim2=-1)[..., None]  # (..., P, 1)
            dx.add_(d * k)
            dk.add_(d * x)
        else:
            dl = _blocks(dP, L)[..., None]  # (..., P/L, L, L, 1)
            e = _leaf_decays(b, L) * dl
            _blocks(dx, L, D).add_((e * _blocks(k, L, D)[..., None, :, :]).sum(-2))
            _blocks(dk, L, D).add_((e * _blocks(x, L, D)[..., :, None, :]).sum(-3))
        kept = iter(ctx.kept) if ctx.kept is not None else None
        for m, h in _levels(P, L):
            if kept is not None:
                eq, ek, qr, kr = next(kept)
            else:
                eq, ek = _factors(b, m, h)
                qr = _blocks(x, m, D)[..., h:, :] * eq
                kr = _blocks(k, m, D)[..., :h, :] * ek
            dq = _blocks(dP, m)[..., h:, :h]  # (..., P/m, h, h)
            _blocks(dx, m, D)[..., h:, :].add_(_times(dq, kr) * eq)
            _blocks(dk, m, D)[..., :h, :].add_(_times(dq.transpose(-1, -2), qr) * ek)
        db = x * dx - k * dk
        # summed back over what each broadcast: the stacked x's leading dimension (for k
        # and b), the r value heads (for a query-key head's x and k)
        dx, dk, db = (t.sum_to_size(like.shape) if t.shape != like.shape else t
                      for t, like in ((dx, x), (dk, k), (db, b)))
        return dx, dk, db, None, None
