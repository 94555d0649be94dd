"""Kernelised attention cores of the linear family, (B, H, N, D) -> same: given feature maps
phi, o_i = sum_j a_ij v_j / (sum_j a_ij + eps) with a_ij = phi(q_i).phi(k_j) >= 0.

Used by `linear.py` (elu+1 and FAVOR+ features, each a `FeatureMap` that also gives its
derivatives).

Non-causal: by associativity, S = phi(K)^T V (M x D) and z = phi(K)^T 1 first, O(N M D),
in blocks of keys, then the queries in blocks (`kernel_attention`). A block is
sized so that its (B, H, rows, M) features are ~2 MiB (`block_rows`), so they stay in
cache; whole-sequence features cost a fresh, page-faulted allocation per call. The blocks
write into preallocated buffers, and the backward is written out (`_KernelAttention`):
autograd through the blocks kept every block's intermediates and concatenated them.

Causal: chunked prefix sums (`causal_linear_attention`, shared by both variants): within
a chunk of C positions the masked C x C quadratic form; across chunks the running state
S = sum phi(k) v^T and z = sum phi(k), one (M, D + 1) state per chunk, so memory is
O(N (M + C) + N M D / C) per head, never N x N nor N x M x D. Its backward is written
out too (`_CausalKernelAttention`), with the same complexity. Without autograd the same
scheme streams (`causal_kernel_attention`): blocks of a few chunks make their features
and pass the state on, so memory is the output and one block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    (zt = w^T phi(K), den^T = zt phi(Q)^T): on this CPU a batched matmul with D + 1 = 65
    columns ran ~18% slower than one with 64, and one with a single column (phi(Q) z) ran
    at a few GFLOP/s, where a row vector times a block takes about as long as one pass
    over the block.
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


def causal_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            fmap: FeatureMap, eps: float, chunk: int, rows: int) -> torch.Tensor:
    """Causal kernelised attention over (B, H, N, D) q, k, v (the compute dtype) with
    features from `fmap`, by chunks of `chunk` positions.

    Under autograd: whole-sequence features (`sequence_features`) and
    `causal_linear_attention`, whose backward keeps the chunk scores and states. Without
    it, streamed (`_causal_stream`): blocks of about `rows` positions (a whole number of
    chunks) make their features, run the chunked scheme with the state [S | z] of every
    key before the block, and pass the state on, so the only sequence-sized tensor made
    is the output. Whole-sequence features and chunk states cost ~113 MiB at N = 8192,
    H = 8, D = 64, each page of it faulted in afresh on every call.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        fq, fk = sequence_features(q, k, fmap)
        return causal_linear_attention(fq, fk, v, eps, chunk)
    return _causal_stream(q, k, v, fmap, eps, chunk, rows)


def _causal_stream(q, k, v, fmap, eps, chunk, rows):
    """`causal_kernel_attention` without autograd, block by block.

    The key weights exp(logw) (FAVOR+) are taken relative to the largest logw seen so far,
    and the carried state is rescaled when a block raises it: a common factor of every
    term of a row's numerator and normaliser, so it cancels (the whole-sequence path uses
    the sequence's largest; the outputs agree to rounding). The same matmuls as
    `chunked_flops` counts: every chunk's scores and products, and, when there is more
    than one chunk, every chunk's state and its read-out.
    """
    B, H, N, D = q.shape
    C = min(chunk, N)
    n = -(-N // C)
    rows = max(C, rows // C * C)
    out = q.new_empty(B, H, N, D)
    state = top = None  # [S | z] of the keys before the block (B, H, 1, M, D + 1), / exp(top)
    for i in range(0, N, rows):
        qb, kb, vb = q[:, :, i:i + rows], k[:, :, i:i + rows], v[:, :, i:i + rows]
        r = qb.shape[2]
        fq = fmap.query(qb)  # (B, H, r, M)
        fk, logw = fmap.key(kb)
        if logw is not None:
            shift = logw.amax(dim=-2, keepdim=True)  # (B, H, 1, 1)
            if top is not None:
                shift = torch.maximum(shift, top)
                state.mul_(torch.exp(top - shift).unsqueeze(-1))
            top = shift
            fk = fk.mul_(torch.exp(logw - shift))
        pad = -r % C
        if pad:  # as in causal_linear_attention: zero keys and values, padded queries dropped
            fk, vb = F.pad(fk, (0, 0, 0, pad)), F.pad(vb, (0, 0, 0, pad))
            fq = F.pad(fq, (0, 0, 0, pad), value=1.0)
        nb, M = (r + pad) // C, fq.shape[-1]
        fq = fq.reshape(B, H, nb, C, M)
        fk = fk.reshape(B, H, nb, C, M)
        vb = vb.reshape(B, H, nb, C, D)
        a = (fq @ fk.transpose(-1, -2)).tril_()  # (B, H, nb, C, C)
        num = a @ vb  # (B, H, nb, C, D)
        den = a.sum(dim=-1, keepdim=True)  # (B, H, nb, C, 1)
        if n > 1:
            kv = fk.new_empty(B, H, nb, M, D + 1)
            kv[..., :D] = fk.transpose(-1, -2) @ vb
            torch.sum(fk, dim=-2, out=kv[..., D])
            st = _exclusive_scan(kv)  # within the block
            total = st[:, :, -1:] + kv[:, :, -1:]  # (B, H, 1, M, D + 1): the block's keys
            if state is not None:
                st.add_(state)
                total.add_(state)
            state = total
            u = fq @ st  # (B, H, nb, C, D + 1)
            num.add_(u[..., :D])
            den.add_(u[..., D:])
        o = num.div_(den.add_(eps)).view(B, H, nb * C, D)
        out[:, :, i:i + r] = o[:, :, :r]
    return out


def causal_linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float,
                            chunk: int) -> torch.Tensor:
    """Causal kernelised attention by chunked prefix sums; fq, fk (B, H, N, M), v (B, H, N, D).

    o_i = sum_{j<=i} a_ij v_j / (sum_{j<=i} a_ij + eps), a_ij = fq_i . fk_j, with a_ij >= 0.
    Under autograd the backward is written out (`_CausalKernelAttention`).
    """
    B, H, N, M = fq.shape
    C = min(chunk, N)
    n = -(-N // C)
    pad = n * C - N
    if pad:
        # Zero keys and values add nothing to any sum. Padded query rows are dropped; they
        # are ones, not zeros, so their normaliser is not 0 + eps, which with eps = 0 would
        # send NaN gradients into the real keys of the last chunk.
        fk, v = F.pad(fk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        fq = F.pad(fq, (0, 0, 0, pad), value=1.0)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (fq, fk, v)):
        o = _CausalKernelAttention.apply(fq, fk, v, eps, C)
    else:
        o = _causal_forward(fq, fk, v, eps, C)[0]
    return o[:, :, :N] if pad else o  # (B, H, N, D)


def _causal_forward(fq, fk, v, eps, C):
    """The forward of `causal_linear_attention` on a whole number of chunks of C rows:
    (o (B, H, P, D), A, st, den), with A the masked chunk scores (B, H, n, C, C), st the
    states [S | z] entering each chunk (B, H, n, M, D + 1; None for one chunk) and den the
    normaliser + eps (B, H, n, C, 1)."""
    B, H, P, M = fq.shape
    D = v.shape[-1]
    n = P // C
    fq = fq.reshape(B, H, n, C, M)  # (B, H, n, C, M)
    fk = fk.reshape(B, H, n, C, M)
    v = v.reshape(B, H, n, C, D)  # (B, H, n, C, D)
    # Within a chunk: the masked quadratic form, C x C per chunk.
    a = (fq @ fk.transpose(-1, -2)).tril_()  # (B, H, n, C, C)
    num = a @ v  # (B, H, n, C, D)
    den = a.sum(dim=-1, keepdim=True)  # (B, H, n, C, 1)
    st = None
    if n > 1:
        # State entering chunk c: [S | z] summed over the chunks before it (chunk 0 enters
        # with zero). The last chunk's own state is computed though unused: slicing it off
        # would make strided operands that matmul copies first.
        kv = fk.new_empty(B, H, n, M, D + 1)  # (B, H, n, M, D + 1)
        kv[..., :D] = fk.transpose(-1, -2) @ v
        torch.sum(fk, dim=-2, out=kv[..., D])
        st = _exclusive_scan(kv)
        u = fq @ st  # (B, H, n, C, D + 1)
        num.add_(u[..., :D])
        den.add_(u[..., D:])
    den.add_(eps)
    o = num.div_(den)
    return o.reshape(B, H, P, D), a, st, den


class _CausalKernelAttention(torch.autograd.Function):
    """`causal_linear_attention` with its backward written out.

    Per chunk, with gn = g / den and gd = -(g . o) / den per row: the masked scores take
    dA = tril(gn v^T + gd 1^T), so d fq = dA fk + [gn | gd] st^T, d fk = dA^T fq +
    [v | 1] dst'^T and d v = A^T gn + fk dst'[:, :D], where dst = fq^T [gn | gd] is the
    gradient of each chunk's entering state and dst' its exclusive suffix sum (a state
    reaches every later chunk). Twice the forward's matmuls; A and the states are kept
    from the forward (N C + N M D / C per head), nothing N x N.
    """

    @staticmethod
    def forward(ctx, fq, fk, v, eps, C):
        o, a, st, den = _causal_forward(fq, fk, v, eps, C)
        ctx.C = C
        ctx.save_for_backward(fq, fk, v, o, a, den, *([st] if st is not None else []))
        return o

    @staticmethod
    def backward(ctx, g):
        fq, fk, v, o, a, den, *st = ctx.saved_tensors
        B, H, P, M = fq.shape
        D = v.shape[-1]
        C = ctx.C
        n = P // C
        fq = fq.reshape(B, H, n, C, M)
        fk = fk.reshape(B, H, n, C, M)
        v = v.reshape(B, H, n, C, D)
        gU = g.new_empty(B, H, n, C, D + 1)  # [gn | gd]
        gn = gU[..., :D]
        torch.div(g.reshape(B, H, n, C, D), den, out=gn)
        torch.linalg.vecdot(gn, o.reshape(B, H, n, C, D), out=gU[..., D])
        gd = gU[..., D:].neg_()  # (B, H, n, C, 1)
        # 3-d views (batch = B H n chunks) so that the products accumulate in place
        # (baddbmm_), without a temporary each; freed as soon as used: peak memory.
        fq3, fk3, v3 = fq.reshape(-1, C, M), fk.reshape(-1, C, M), v.reshape(-1, C, D)
        gU3 = gU.view(-1, C, D + 1)
        gn3 = gU3[..., :D]
        dA = torch.bmm(gn3, v3.transpose(-1, -2)).add_(gU3[..., D:]).tril_()  # (B H n, C, C)
        dfq = torch.bmm(dA, fk3)  # (B H n, C, M)
        dfk = torch.bmm(dA.transpose(-1, -2), fq3)
        del dA
        dv = torch.bmm(a.view(-1, C, C).transpose(-1, -2), gn3)  # (B H n, C, D)
        if st:
            st3 = st[0].view(-1, M, D + 1)
            dfq.baddbmm_(gU3, st3.transpose(-1, -2))
            dst = torch.bmm(fq3.transpose(-1, -2), gU3).view(B, H, n, M, D + 1)
            del gU, gU3, gn3, gn, gd
            dst = _exclusive_scan(dst, reverse=True).view(-1, M, D + 1)  # (B H n, M, D + 1)
            dfk.baddbmm_(v3, dst[..., :D].transpose(-1, -2))
            dfk.view(B, H, n, C, M).add_(dst.view(B, H, n, M, D + 1)[..., D].unsqueeze(-2))
            dv.baddbmm_(fk3, dst[..., :D])
        return (dfq.reshape(B, H, P, M), dfk.reshape(B, H, P, M), dv.reshape(B, H, P, D),
                None, None)


def _exclusive_scan(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """(B, H, n, ...) -> same, out[:, :, c] = sum of x[:, :, :c] (reverse: of x[:, :, c + 1:]),
    without autograd. One pass: a loop of n contiguous adds (torch.cumsum along a middle
    dimension runs strided, ~6x slower than one elementwise pass on this CPU)."""
    out = torch.empty_like(x)
    n = x.shape[2]
    order = range(n - 1, 0, -1) if reverse else range(n - 1)
    edge = n - 1 if reverse else 0
    out[:, :, edge].zero_()
    for c in order:
        nxt = c - 1 if reverse else c + 1
        torch.add(out[:, :, c], x[:, :, c], out=out[:, :, nxt])
    return out


def causal_kernel_sum(fq: torch.Tensor, fk: torch.Tensor, x: torch.Tensor, chunk: int,
                      reverse: bool = False) -> torch.Tensor:
    """sum_{j <= i} (fq_i . fk_j) x_j for every i (reverse: sum_{j >= i}), by chunked prefix
    (suffix) sums; fq, fk (B, H, N, M), x (B, H, N, E) -> (B, H, N, E), unnormalised.

    The scheme of `causal_linear_attention` with the value and normaliser columns in one
    x: within a chunk of C rows the masked C x C form, across chunks an (M, E) state per
    chunk summed over the chunks before (after) it. O(N (C M + C E + M E)) time, O(N (M +
    C) + N M E / C) memory per head, forward and backward.
    """
    B, H, N, M = fq.shape
    E = x.shape[-1]
    C = min(chunk, N)
    n = -(-N // C)
    pad = n * C - N
    if pad:  # zero features add nothing; padded rows are dropped
        fq, fk, x = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, x))
    fq = fq.reshape(B, H, n, C, M)  # (B, H, n, C, M)
    fk = fk.reshape(B, H, n, C, M)
    x = x.reshape(B, H, n, C, E)  # (B, H, n, C, E)
    a = fq @ fk.transpose(-1, -2)  # (B, H, n, C, C)
    # In place: matmul saves its operands, not its output.
    out = (a.triu_() if reverse else a.tril_()) @ x  # (B, H, n, C, E)
    if n > 1:
        scan = _ExclusiveSuffixSum if reverse else _ExclusivePrefixSum
        S = scan.apply(fk.transpose(-1, -2) @ x)  # (B, H, n, M, E)
        out = out.add_(fq @ S)
    return out.reshape(B, H, n * C, E)[:, :, :N]


def lagged_kernel_sum(fq: torch.Tensor, fk: torch.Tensor, x: torch.Tensor, lag: int,
                      chunk: int, reverse: bool = False) -> torch.Tensor:
    """sum_{j <= i - lag} (fq_i . fk_j) x_j (reverse: sum_{j >= i + lag}); shapes as
    `causal_kernel_sum`. The keys and x are shifted by `lag` rows (zeros enter), so the
    chunked scheme runs unchanged; lag >= N gives zeros."""
    B, H, N, _ = fq.shape
    if lag >= N:
        return x.new_zeros(B, H, N, x.shape[-1])
    shift = (0, 0, -lag, lag) if reverse else (0, 0, lag, -lag)  # pad one end, crop the other
    return causal_kernel_sum(fq, F.pad(fk, shift), F.pad(x, shift), chunk, reverse)


def lagged_kernel_flops(N: int, M: int, E: int, chunk: int) -> int:
    """Forward matmul FLOPs per head of `causal_kernel_sum` (and of the lagged form): with
    C = min(chunk, N), P = ceil(N / C) C padded rows, 2 P C M (scores) + 2 P C E (their
    product with x), and when there is more than one chunk 2 P M E (chunk states) +
    2 P M E (their read-out)."""
    C = min(chunk, N)
    n = -(-N // C)
    P = n * C
    return 2 * P * C * (M + E) + (4 * P * M * E if n > 1 else 0)


class _ExclusivePrefixSum(torch.autograd.Function):
    """(B, H, n, ...) -> same: out[:, :, c] = sum of x[:, :, :c]; out[:, :, 0] = 0, by
    `_exclusive_scan`; the backward is the reverse scan (x[c] reaches out[c + 1:])."""

    @staticmethod
    def forward(ctx, x):
        return _exclusive_scan(x)

    @staticmethod
    def backward(ctx, g):
        return _exclusive_scan(g.contiguous(), reverse=True)


def chunked_flops(N: int, M: int, D: int, chunk: int) -> int:
    """Forward matmul FLOPs per head of `causal_linear_attention` as implemented.

    With C = min(chunk, N), n = ceil(N / C) chunks and P = n C padded rows: intra-chunk
    scores 2 P C M and their product with v 2 P C D; when n > 1, chunk states 2 P M D (the
    last chunk's is computed, unused) and the state read-out 2 P M D (numerator) + 2 P M
    (denominator; chunk 0 reads a zero state). Row sums and prefix sums are not matmuls.
    Per row that is 2 C (M + D) + 4 M D + 2 M against 4 M D + 2 M non-causal: the causal
    form costs MORE matmul FLOPs than the non-causal one (the C x C block is computed whole
    and masked), unlike exact attention, where causal counts half.
    """
    C = min(chunk, N)
    n = -(-N // C)
    P = n * C
    f = 2 * P * C * M + 2 * P * C * D
    if n > 1:
        f += 4 * P * M * D + 2 * P * M
    return f


def core_flops(N: int, M: int, D: int, causal: bool, chunk: int) -> int:
    """Per-head forward FLOPs of the core. Non-causal: S = phi(K)^T [V w] and z^T = w^T
    phi(K), then phi(Q) S and z^T phi(Q)^T: 4 N M (D + 1) (w: key row weights, ones for
    linear)."""
    if causal:
        return chunked_flops(N, M, D, chunk)
    return 4 * N * M * (D + 1)


class _ExclusiveSuffixSum(torch.autograd.Function):
    """(B, H, n, ...) -> same: out[:, :, c] = sum of x[:, :, c + 1:]; out[:, :, n - 1] = 0;
    the backward is the forward scan (x[c] reaches out[:c])."""

    @staticmethod
    def forward(ctx, x):
        return _exclusive_scan(x, reverse=True)

    @staticmethod
    def backward(ctx, g):
        return _exclusive_scan(g.contiguous())
