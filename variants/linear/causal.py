"""Causal kernelised attention of the linear family, by chunked prefix sums; (B, H, N, D).

o_i = sum_{j<=i} a_ij v_j / (sum_{j<=i} a_ij + eps), a_ij = phi(q_i).phi(k_j) >= 0, with
the feature maps of `noncausal.py`. Within a chunk of C positions the masked C x C
quadratic form; across chunks the running state S = sum phi(k) v^T and z = sum phi(k),
one (M, D + 1) state per chunk, so memory is O(N (M + C) + N M D / C) per head, never
N x N nor N x M x D (`causal_linear_attention`, its backward written out in
`_CausalKernelAttention`). Without autograd the same scheme streams
(`causal_kernel_attention`): blocks of a few chunks make their features and pass the
state on, so memory is the output and one block.

Also the unnormalised causal and lagged kernel sums that band_lowrank's far field uses
(`causal_kernel_sum`, `lagged_kernel_sum`), and the FLOP counts of all of these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .noncausal import FeatureMap, sequence_features


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
        fq, fk, vb = _pad_chunks(fq, fk, vb, C)
        o, _, st, _, kv = _causal_forward(fq, fk, vb, eps, C, states=n > 1, state=state)
        out[:, :, i:i + r] = o[:, :, :r]
        if st is not None:
            state = st[:, :, -1:] + kv[:, :, -1:]  # (B, H, 1, M, D + 1): every key so far
        del fq, fk, o, st, kv  # before the next block makes its own: peak memory
    return out


def causal_linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float,
                            chunk: int) -> torch.Tensor:
    """Causal kernelised attention by chunked prefix sums; fq, fk (B, H, N, M), v (B, H, N, D).

    o_i = sum_{j<=i} a_ij v_j / (sum_{j<=i} a_ij + eps), a_ij = fq_i . fk_j, with a_ij >= 0.
    Under autograd the backward is written out (`_CausalKernelAttention`).
    """
    N = fq.shape[2]
    C = min(chunk, N)
    fq, fk, v = _pad_chunks(fq, fk, v, C)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (fq, fk, v)):
        o = _CausalKernelAttention.apply(fq, fk, v, eps, C)
    else:
        o = _causal_forward(fq, fk, v, eps, C)[0]
    return o[:, :, :N]  # (B, H, N, D)


def _pad_chunks(fq, fk, v, C):
    """fq, fk, v padded along the sequence to a whole number of chunks of C rows.

    Zero keys and values add nothing to any sum. Padded query rows are dropped; they are
    ones, not zeros, so their normaliser is not 0 + eps, which with eps = 0 would send NaN
    gradients into the real keys of the last chunk."""
    pad = -fq.shape[2] % C
    if not pad:
        return fq, fk, v
    fk, v = F.pad(fk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    return F.pad(fq, (0, 0, 0, pad), value=1.0), fk, v


def _causal_forward(fq, fk, v, eps, C, states=None, state=None):
    """The forward of `causal_linear_attention` on a whole number of chunks of C rows:
    (o (B, H, P, D), A, st, den, kv), with A the masked chunk scores (B, H, n, C, C), st
    the states [S | z] entering each chunk (B, H, n, M, D + 1), kv each chunk's own, and den
    the normaliser + eps (B, H, n, C, 1). `states`: whether to carry states across chunks
    (default: when there is more than one; else st and kv are None); `state`: the state
    of keys before the first chunk (B, H, 1, M, D + 1), or None for none."""
    B, H, P, M = fq.shape
    D = v.shape[-1]
    n = P // C
    if states is None:
        states = n > 1
    fq = fq.reshape(B, H, n, C, M)  # (B, H, n, C, M)
    fk = fk.reshape(B, H, n, C, M)
    v = v.reshape(B, H, n, C, D)  # (B, H, n, C, D)
    # Within a chunk: the masked quadratic form, C x C per chunk.
    a = (fq @ fk.transpose(-1, -2)).tril_()  # (B, H, n, C, C)
    num = a @ v  # (B, H, n, C, D)
    den = a.sum(dim=-1, keepdim=True)  # (B, H, n, C, 1)
    st = kv = None
    if states:
        # State entering chunk c: [S | z] summed over the chunks before it (chunk 0 enters
        # with `state`, or zero). The last chunk's own state is computed though the whole
        # sequence does not use it: slicing it off would make strided operands that matmul
        # copies first.
        kv = fk.new_empty(B, H, n, M, D + 1)  # (B, H, n, M, D + 1)
        kv[..., :D] = fk.transpose(-1, -2) @ v
        torch.sum(fk, dim=-2, out=kv[..., D])
        st = _exclusive_scan(kv)
        if state is not None:
            st.add_(state)
        u = fq @ st  # (B, H, n, C, D + 1)
        num.add_(u[..., :D])
        den.add_(u[..., D:])
    den.add_(eps)
    o = num.div_(den)
    return o.reshape(B, H, P, D), a, st, den, kv


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
        o, a, st, den, _ = _causal_forward(fq, fk, v, eps, C)
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
        gU[..., D:].neg_()  # gd (B, H, n, C, 1)
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
            del gU, gU3, gn3, gn
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
