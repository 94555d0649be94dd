"""Kernelised attention cores of the linear family, (B, H, N, D) -> same: given feature maps
phi, o_i = sum_j a_ij v_j / (sum_j a_ij + eps) with a_ij = phi(q_i).phi(k_j) >= 0.

Used by `linear.py` (elu+1 and FAVOR+ features).

Non-causal: by associativity, [S | z] = phi(K)^T [V | 1] (M x (D + 1), one matmul) first,
O(N M D), in blocks of keys, then the queries in blocks (`kernel_attention`). A block is
sized so that its (B, H, rows, M) features are ~2 MiB (`block_rows`), so they stay in
cache; whole-sequence features cost a fresh, page-faulted allocation per call. Without
autograd the blocks write into preallocated buffers instead of concatenating (measured
once here, paired and interleaved at N = 16384, H = 8: 15% faster for performer, 29% for
linear). Per-variant times: `python run_bench.py run --preset scaling`.

Causal: chunked prefix sums (`causal_linear_attention`, shared by both variants): within
a chunk of C positions the masked C x C quadratic form; across chunks the running state
S = sum phi(k) v^T and z = sum phi(k), one (M, D) state per chunk, so memory is
O(N (M + C) + N M D / C) per head, never N x N nor N x M x D. Autograd backprops through
it with the same complexity (the prefix sum over chunks is a small autograd.Function).
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


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q, phi_k,
                     eps: float, rows: int) -> torch.Tensor:
    """Non-causal kernelised attention over (B, H, N, D) q, k, v, in blocks of `rows`.

    phi_q(q block) -> (B, H, r, M) features, up to a positive factor per query row (it
    cancels in the ratio). phi_k(k block) -> (f, logw): the block's features are
    f * exp(logw), logw (B, H, r, 1) per key row, or None for f alone. Each block's row
    weights are taken relative to that block's largest (a common factor, it cancels), and
    the sums S and z are kept relative to the largest seen so far, so no exponent overflows.
    """
    B, H, N, D = q.shape
    # Without autograd (inference, the timed forward) the blocks write into preallocated
    # buffers; with it, the same arithmetic by differentiable ops (cat), tested equal.
    graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    Sz = top = None  # [S | z]: (B, H, M, D + 1)
    for kb, vb in zip(k.split(rows, dim=2), v.split(rows, dim=2)):
        fk, logw = phi_k(kb)  # (B, H, r, M), (B, H, r, 1) or None
        if logw is None:
            wk = torch.ones_like(fk[..., :1])
        else:
            shift = logw.detach().amax(dim=-2, keepdim=True)  # (B, H, 1, 1)
            wk = torch.exp(logw - shift)  # (B, H, r, 1), at most 1
        # S and z in one matmul; the key row weights go on the values (r x D), not on the
        # features (r x M).
        if graph:
            vw = torch.cat([vb.to(fk.dtype) * wk, wk], dim=-1)
        else:
            vw = fk.new_empty(*vb.shape[:-1], D + 1)
            torch.mul(vb, wk, out=vw[..., :D])
            vw[..., D:] = wk
        Sz_b = fk.transpose(-1, -2) @ vw  # (B, H, M, D + 1)
        if logw is not None:
            new = shift if top is None else torch.maximum(top, shift)
            Sz_b = Sz_b * torch.exp(shift - new)
            if top is not None:
                Sz = Sz * torch.exp(top - new)
            top = new
        Sz = Sz_b if Sz is None else Sz + Sz_b
    out = None if graph else Sz.new_empty(B, H, N, D)
    outs = []
    for i, qb in zip(range(0, N, rows), q.split(rows, dim=2)):
        o = phi_q(qb) @ Sz  # (B, H, r, D + 1)
        if graph:
            outs.append(o[..., :D] / (o[..., D:] + eps))  # (B, H, r, D)
        else:
            torch.div(o[..., :D], o[..., D:].add_(eps), out=out[:, :, i:i + rows])
    if not graph:
        return out
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def kernel_weights(fq: torch.Tensor, fk: torch.Tensor, eps: float, causal: bool) -> torch.Tensor:
    """The weights a_ij / (sum_j a_ij + eps), a_ij = fq_i . fk_j (causal: j <= i), (B, H, N, N):
    what `kernel_attention` and `causal_linear_attention` multiply v by, made dense."""
    a = fq @ fk.transpose(-1, -2)  # (B, H, N, N)
    if causal:
        a = a.tril_()
    return a / (a.sum(dim=-1, keepdim=True) + eps)


def causal_linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, eps: float,
                            chunk: int) -> torch.Tensor:
    """Causal kernelised attention by chunked prefix sums; fq, fk (B, H, N, M), v (B, H, N, D).

    o_i = sum_{j<=i} a_ij v_j / (sum_{j<=i} a_ij + eps), a_ij = fq_i . fk_j, with a_ij >= 0.
    """
    B, H, N, M = fq.shape
    D = v.shape[-1]
    C = min(chunk, N)
    n = -(-N // C)
    pad = n * C - N
    if pad:
        # Zero keys and values add nothing to any sum. Padded query rows are dropped; they
        # are ones, not zeros, so their normaliser is not 0 + eps, which with eps = 0 would
        # send NaN gradients into the real keys of the last chunk.
        fk, v = F.pad(fk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        fq = F.pad(fq, (0, 0, 0, pad), value=1.0)
    fq = fq.reshape(B, H, n, C, M)  # (B, H, n, C, M)
    fk = fk.reshape(B, H, n, C, M)
    v = v.reshape(B, H, n, C, D)  # (B, H, n, C, D)

    # Within a chunk: the masked quadratic form, C x C per chunk.
    # In place here and below: matmul saves its operands, not its output.
    a = (fq @ fk.transpose(-1, -2)).tril_()  # (B, H, n, C, C)
    num = a @ v  # (B, H, n, C, D)
    den = a.sum(dim=-1, keepdim=True)  # (B, H, n, C, 1)
    if n > 1:
        # State entering chunk c: sum over the chunks before it (chunk 0 enters with zero).
        # The last chunk's own state is computed though unused: slicing it off would make
        # strided operands that matmul copies first.
        kv = fk.transpose(-1, -2) @ v  # (B, H, n, M, D)
        S = _ExclusivePrefixSum.apply(kv)  # (B, H, n, M, D)
        z = _ExclusivePrefixSum.apply(fk.sum(dim=-2))  # (B, H, n, M)
        num = num.add_(fq @ S)
        den = den.add_(fq @ z.unsqueeze(-1))
    o = num / (den + eps)
    return o.reshape(B, H, n * C, D)[:, :, :N]  # (B, H, N, D)


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
    """(B, H, n, ...) -> same: out[:, :, c] = sum of x[:, :, :c]; out[:, :, 0] = 0.

    torch.cumsum along a middle dimension runs strided, ~6x slower than one elementwise
    pass over the tensor on this CPU; a loop of n contiguous adds is one pass, forward and
    backward (the backward is the reverse scan), and allocates no padded copy.
    """

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        out[:, :, 0].zero_()
        for c in range(x.shape[2] - 1):
            torch.add(out[:, :, c], x[:, :, c], out=out[:, :, c + 1])
        return out

    @staticmethod
    def backward(ctx, g):
        # x[c] reaches out[c+1:], so gx[c] = sum of g[c+1:], a reverse scan.
        g = g.contiguous()
        gx = torch.empty_like(g)
        n = g.shape[2]
        gx[:, :, n - 1].zero_()
        for c in range(n - 2, -1, -1):
            torch.add(gx[:, :, c + 1], g[:, :, c + 1], out=gx[:, :, c])
        return gx


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
    """Per-head forward FLOPs of the core. Non-causal: [S | z] = phi(K)^T [V | w] and
    phi(Q) [S | z], two matmuls with D + 1 columns (w: key row weights, ones for linear)."""
    if causal:
        return chunked_flops(N, M, D, chunk)
    return 4 * N * M * (D + 1)


class _ExclusiveSuffixSum(torch.autograd.Function):
    """(B, H, n, ...) -> same: out[:, :, c] = sum of x[:, :, c + 1:]; out[:, :, n - 1] = 0.

    `_ExclusivePrefixSum` run from the other end (the same one-pass loop; backward the
    forward scan)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        n = x.shape[2]
        out[:, :, n - 1].zero_()
        for c in range(n - 2, -1, -1):
            torch.add(out[:, :, c + 1], x[:, :, c + 1], out=out[:, :, c])
        return out

    @staticmethod
    def backward(ctx, g):
        # x[c] reaches out[:c], so gx[c] = sum of g[:c], a forward scan.
        g = g.contiguous()
        gx = torch.empty_like(g)
        gx[:, :, 0].zero_()
        for c in range(g.shape[2] - 1):
            torch.add(gx[:, :, c], g[:, :, c], out=gx[:, :, c + 1])
        return gx
