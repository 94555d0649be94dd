"""Feature maps and the non-causal kernelised attention core of the linear family, (B, H,
N, D) -> same: o_i = sum_j a_ij v_j / (sum_j a_ij + eps) with a_ij = phi(q_i).phi(k_j) >= 0.

Used by `linear.py` (elu+1 and FAVOR+ features, each a `FeatureMap` that also gives its
derivatives).

Non-causal: by associativity, S = phi(K)^T V (M x D) and z = phi(K)^T 1 first, O(N M D),
in blocks of keys, then the queries in blocks (`kernel_attention`). A block is
sized so that its (B, H, rows, M) features are ~2 MiB (`block_rows`), so they stay in
cache; whole-sequence features cost a fresh, page-faulted allocation per call. The blocks
write into preallocated buffers, and the backward is written out (`_KernelAttention`):
autograd through the blocks kept every block's intermediates and concatenated them.

The causal cores are in `causal.py`.
"""

from __future__ import annotations

import torch

# Bytes of one (B, H, rows, M) feature block of the non-causal path (see block_rows).
_BLOCK_BYTES = 2 << 20


def block_rows(B: int, H: int, M: int, budget: int = _BLOCK_BYTES) -> int:
    """Rows per block so that one (B, H, rows, M) float32 feature block is about `budget` bytes.

    A power of two in [64, 1024]. On this 2-core CPU (1 MiB L2 each) the K = D matmul
    that makes the features ran at ~130-150 GFLOP/s up to ~2048 x 256 outputs and ~80
    at 8192 x 256 (a one-off microbenchmark of torch.mm; blocks of 1-8 MiB timed within
    noise of each other in the whole forward).
    """
    rows = budget // (4 * B * H * M)
    return max(64, min(1024, 1 << max(rows, 1).bit_length() - 1))


class FeatureMap:
    """A feature map phi on (B, H, r, D) blocks, with the derivatives the cores' hand-written
    backward passes need. The cores call it without autograd; `query` and `key` are plain
    differentiable torch code, so other variants may also use them under autograd.

    query(x) -> f (B, H, r, M): the query features, up to a positive factor per row.
    key(x) -> (f, logw): key features f * exp(logw), logw (B, H, r, 1) or None for f alone.
    query_grad(x, f, df, out=None) -> dx: the gradient of x given df = dL/df.
    key_grad(x, f, wk, t, out=None) -> dx: the gradient of x given t = dL/d(f wk) (wk =
    exp(logw - shift), or None). Neither gradient method writes into its arguments; given
    `out` (x's shape, possibly strided), they write dx there and return it.
    `save`: whether the cores keep the features for backward (True where recomputing them
    costs matmuls) or recompute them block by block.
    """

    save = False

    def query(self, x):
        raise NotImplementedError

    def key(self, x):
        raise NotImplementedError

    def query_grad(self, x, f, df, out=None):
        raise NotImplementedError

    def key_grad(self, x, f, wk, t, out=None):
        raise NotImplementedError


def sequence_features(q: torch.Tensor, k: torch.Tensor, fmap: FeatureMap):
    """Whole-sequence features (phi(q), phi(k)), each (B, H, N, M): phi(q) up to a factor per
    row, phi(k) up to one factor per (batch, head) (the key weights exp(logw) taken relative
    to their largest); both factors cancel. Under autograd the backward is `fmap`'s
    (`_SequenceFeatures`), keeping the inputs and the two feature tensors."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _SequenceFeatures.apply(q, k, fmap)
    return _sequence_features(q, k, fmap)


def _sequence_features(q, k, fmap):
    # Block by block (`block_rows`), each written once into the whole tensor: the feature
    # maps' several elementwise passes stay in cache.
    B, H, N, _ = q.shape
    fq = fk = logw = None
    for i, qb, kb in _row_blocks(q, k):
        fqb = fmap.query(qb)
        fkb, lwb = fmap.key(kb)
        if fq is None:
            M = fqb.shape[-1]
            fq, fk = fqb.new_empty(B, H, N, M), fkb.new_empty(B, H, N, M)
            logw = None if lwb is None else fkb.new_empty(B, H, N, 1)
        r = slice(i, i + qb.shape[2])
        fq[:, :, r], fk[:, :, r] = fqb, fkb
        if lwb is not None:
            logw[:, :, r] = lwb
    if logw is not None:
        fk.mul_(torch.exp(logw - logw.amax(dim=-2, keepdim=True)))
    return fq, fk


def _row_blocks(q, k):
    """(start, q block, k block): blocks sized as for 4 D features (FAVOR+'s default m)."""
    B, H, N, D = q.shape
    rows = block_rows(B, H, 4 * D)
    return zip(range(0, N, rows), q.split(rows, dim=2), k.split(rows, dim=2))


class _SequenceFeatures(torch.autograd.Function):
    """`sequence_features` with the feature map's own derivatives (the key shift is a
    constant, as the stabilisers are everywhere here)."""

    @staticmethod
    def forward(ctx, q, k, fmap):
        fq, fk = _sequence_features(q, k, fmap)
        ctx.fmap = fmap
        ctx.save_for_backward(q, k, fq, fk)
        return fq, fk

    @staticmethod
    def backward(ctx, dfq, dfk):
        q, k, fq, fk = ctx.saved_tensors
        dq = None if dfq is None else ctx.fmap.query_grad(q, fq, dfq)
        dk = None if dfk is None else ctx.fmap.key_grad(k, fk, None, dfk)
        return dq, dk, None


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: FeatureMap,
                     eps: float, rows: int) -> torch.Tensor:
    """Non-causal kernelised attention over (B, H, N, D) q, k, v (the compute dtype), in
    blocks of `rows`, with features from `fmap` (`FeatureMap`).

    Each key block's row weights are taken relative to that block's largest (a common
    factor, it cancels), and the sums S and z are kept relative to the largest seen so far,
    so no exponent overflows. Under autograd the backward is written out (`_KernelAttention`):
    the same blocks again, O(N M D), keeping only S, z, the output and its normaliser
    (and the features where `fmap.save`), never anything N x N.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _KernelAttention.apply(q, k, v, fmap, eps, rows)
    return _kernel_forward(q, k, v, fmap, eps, rows, None)[0]


def _kernel_forward(q, k, v, fmap, eps, rows, saved):
    """The forward of `kernel_attention`: (o, den, S, zt, top), den = the normaliser + eps
    (B, H, N, 1), S = sum_j phi(k_j) w_j v_j^T (B, H, M, D) and zt = sum_j w_j phi(k_j)^T
    (B, H, 1, M), both relative to exp(top) (B, H, 1, 1), or top None (no key weights:
    w = 1). `saved`: a list that receives the feature blocks (queries', then keys', then
    the keys' logw when there are any), or None.

    S and z are kept apart, and z and the normalisers are row vectors times a block
    (zt = w^T phi(K), den^T = zt phi(Q)^T): on this CPU, for one 1024-row block at B H = 8,
    phi(K)^T [V | 1] (65 columns) took 597 us against 468 for phi(K)^T V, and phi(Q) z as
    a one-column matmul 328 us against 50 for z^T phi(Q)^T (medians, `python -m pytest
    tests/benchmarks/test_kernels.py --benchmark-only -k block`).
    """
    B, H, N, D = q.shape
    S = zt = top = ones = None
    fks, logws = [], []
    for kb, vb in zip(k.split(rows, dim=2), v.split(rows, dim=2)):
        fk, logw = fmap.key(kb)  # (B, H, r, M), (B, H, r, 1) or None
        fkt = fk.transpose(-1, -2)
        if logw is None:
            if ones is None or ones.shape[-1] != kb.shape[2]:
                ones = fk.new_ones(B, H, 1, kb.shape[2])
            S_b = fkt @ vb  # (B, H, M, D)
            zt_b = ones @ fk  # (B, H, 1, M)
        else:
            shift = logw.amax(dim=-2, keepdim=True)  # (B, H, 1, 1)
            wk = torch.exp(logw - shift)  # (B, H, r, 1), at most 1
            # The key row weights go on the values (r x D), not on the features (r x M).
            S_b = fkt @ (vb * wk)
            zt_b = wk.transpose(-1, -2) @ fk
            new = shift if top is None else torch.maximum(top, shift)
            f = torch.exp(shift - new)
            S_b.mul_(f)
            zt_b.mul_(f)
            if top is not None:
                f = torch.exp(top - new)
                S.mul_(f)
                zt.mul_(f)
            top = new
        S = S_b if S is None else S.add_(S_b)
        zt = zt_b if zt is None else zt.add_(zt_b)
        if saved is not None:
            fks.append(fk)
            if logw is not None:
                logws.append(logw)
    out = S.new_empty(B, H, N, D)
    den = S.new_empty(B, H, 1, N)  # one row per (batch, head): z^T phi(Q)^T + eps
    for i, qb in zip(range(0, N, rows), q.split(rows, dim=2)):
        fq = fmap.query(qb)  # (B, H, r, M)
        d = den[..., i:i + rows]
        torch.add(zt @ fq.transpose(-1, -2), eps, out=d)
        torch.div(fq @ S, d.transpose(-1, -2), out=out[:, :, i:i + rows])
        if saved is not None:
            saved.append(fq)
    if saved is not None:
        saved += fks + logws
    return out, den.transpose(-1, -2), S, zt, top


class _KernelAttention(torch.autograd.Function):
    """`kernel_attention` with its backward written out, block by block.

    With num_i = phi(q_i) S, den_i = phi(q_i).z + eps and o_i = num_i / den_i, the
    gradient g_i of o_i gives gn_i = g_i / den_i and gd_i = -(g_i . o_i) / den_i; then
    d phi(q_i) = S gn_i + gd_i z, dS = sum_i phi(q_i) gn_i^T, dz = sum_i gd_i phi(q_i),
    and for key j with weight w_j: d(phi(k_j) w_j) = dS v_j + dz, dv_j = w_j dS^T phi(k_j).
    Four matmuls of the forward's size (twice the forward's two), plus the feature maps'.
    """

    @staticmethod
    def forward(ctx, q, k, v, fmap, eps, rows):
        saved = [] if fmap.save else None
        out, den, S, zt, top = _kernel_forward(q, k, v, fmap, eps, rows, saved)
        ctx.fmap, ctx.rows = fmap, rows
        ctx.has_top = top is not None
        extra = [top] if top is not None else []
        ctx.save_for_backward(q, k, v, out, den, S, zt, *extra, *(saved or []))
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, den, S, zt, *rest = ctx.saved_tensors
        top = rest.pop(0) if ctx.has_top else None
        fmap, rows = ctx.fmap, ctx.rows
        B, H, N, D = q.shape
        nb = -(-N // rows)
        fqs, fks, logws = ((rest[:nb], rest[nb:2 * nb], rest[2 * nb:]) if rest
                           else ([None] * nb, [None] * nb, []))
        # Where D + 1 is the inner dimension, S and z go together: d phi(q) = [gn | gd]
        # [S | z]^T and d(phi(k) w) = [v | 1] [dS | dz]^T are one matmul each, which costs
        # less than a matmul and a rank-one pass over the (r, M) block (M = 256 for FAVOR+).
        Szt = torch.cat([S, zt.transpose(-1, -2)], dim=-1).transpose(-1, -2)  # (B, H, D + 1, M)
        dq = torch.empty_like(q)
        dS = torch.zeros_like(S)  # (B, H, M, D)
        dzt = torch.zeros_like(zt)  # (B, H, 1, M)
        dU = None
        for b, i in enumerate(range(0, N, rows)):
            blk = slice(i, i + rows)
            qb = q[:, :, blk]
            fq = fmap.query(qb) if fqs[b] is None else fqs[b]
            r = qb.shape[2]
            if dU is None or dU.shape[2] != r:
                dU = g.new_empty(B, H, r, D + 1)  # [gn | gd], reused across blocks
            gn, gd = dU[..., :D], dU[..., D:]
            torch.div(g[:, :, blk], den[:, :, blk], out=gn)  # (B, H, r, D)
            torch.linalg.vecdot(gn, out[:, :, blk], out=dU[..., D])
            gd.neg_()  # (B, H, r, 1)
            dS.add_(fq.transpose(-1, -2) @ gn)
            dzt.add_(gd.transpose(-1, -2) @ fq)
            fmap.query_grad(qb, fq, dU @ Szt, out=dq[:, :, blk])
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dSzt = torch.cat([dS, dzt.transpose(-1, -2)], dim=-1).transpose(-1, -2)  # (B, H, D + 1, M)
        vw = None
        for b, j in enumerate(range(0, N, rows)):
            blk = slice(j, j + rows)
            kb, vb = k[:, :, blk], v[:, :, blk]
            if fks[b] is None:
                fk, logw = fmap.key(kb)
            else:
                fk, logw = fks[b], (logws[b] if logws else None)
            r = kb.shape[2]
            if vw is None or vw.shape[2] != r:
                vw = g.new_empty(B, H, r, D + 1)  # [v | 1], reused across blocks
                vw[..., D:] = 1
            vw[..., :D] = vb
            t = vw @ dSzt  # (B, H, r, M): dL/d(phi(k_j) w_j)
            dvb = torch.matmul(fk, dS, out=dv[:, :, blk])  # (B, H, r, D)
            wk = None
            if top is not None:
                wk = torch.exp(logw - top)  # (B, H, r, 1)
                dvb.mul_(wk)
            fmap.key_grad(kb, fk, wk, t, out=dk[:, :, blk])
        return dq, dk, dv, None, None, None


def kernel_weights(fq: torch.Tensor, fk: torch.Tensor, eps: float, causal: bool) -> torch.Tensor:
    """The weights a_ij / (sum_j a_ij + eps), a_ij = fq_i . fk_j (causal: j <= i), (B, H, N, N):
    what `kernel_attention` and `causal_linear_attention` multiply v by, made dense."""
    a = fq @ fk.transpose(-1, -2)  # (B, H, N, N)
    if causal:
        a = a.tril_()
    return a / (a.sum(dim=-1, keepdim=True) + eps)
