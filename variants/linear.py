"""Linear attention phi(q_i).sum_j phi(k_j) v_j^T / phi(q_i).sum_j phi(k_j); (B, H, N, D) -> same.

Two feature maps phi (M features) share one kernelised-attention core:

- `linear`: phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, "Transformers are RNNs",
  https://arxiv.org/abs/2006.16236). Applied to q and k as they are, WITHOUT the softmax
  temperature 1/sqrt(D): the kernel is phi(q).phi(k), not an approximation of
  exp(q.k/sqrt(D)), and the paper's feature map takes raw queries and keys. o_i is
  sum_j a_ij v_j / (sum_j a_ij + eps) with a_ij = phi(q_i).phi(k_j), eps the parameter.
- `performer`: FAVOR+ positive random features (Choromanski et al. 2021, "Rethinking
  Attention with Performers", https://arxiv.org/abs/2009.14794, Lemma 1 and Sec. 2.4).
  With x scaled by D^-1/4 (so that E[phi(q).phi(k)] = exp(q.k / sqrt(D))),
  phi(x)_r = exp(w_r.x - |x|^2/2 - c) / sqrt(m), r = 1..m, w_r ~ N(0, I_D); orthogonal=True
  makes the w_r orthogonal within blocks of D (Sec. 2.4: QR of a Gaussian block, rows
  rescaled by chi_D-distributed norms so each w_r is still marginally N(0, I_D)).
  Stabilisers: every feature is computed as a softmax over the m features of its row
  (one fused, vectorised pass: ~1.5x the rate of a plain exp here), which is the feature
  times a per-row factor. For queries that factor cancels in the normalised ratio. For
  keys it does not: each key row also gets logw = logsumexp_r(w_r.x) - |x|^2/2 - log(m)/2,
  and exp(logw - max logw over the block) is applied to that row's value (D numbers, not
  m features); the sums are rescaled online to the largest shift seen (a common factor,
  it cancels). This plays the role of the paper code's (google-research
  performer/fast_attention) max-subtraction: nothing overflows, and a key row underflows
  only when it is ~87 nats (float32) below the block's largest. The guard against 0/0 is
  an eps of the dtype's smallest normal number in the denominator, not an eps added to
  each feature: after a per-block max shift the median key feature (times sqrt(m)) is ~1e-6 on
  `gaussian` and ~4e-9 on `local` inputs (N=2048, D=64), and adding 1e-6 to every feature
  moved the output by 1.5% and 17% there, towards uniform attention. Causal: the key
  shift is one max over the whole sequence of a (batch, head), a constant, so a future key
  never changes a causal output (beyond rounding).

Non-causal: by associativity, [S | z] = phi(K)^T [V | 1] (M x (D + 1), one matmul) first,
O(N M D), in blocks of keys, then the queries in blocks (`kernel_attention`). A block is
sized so that its (B, H, rows, M) features are ~2 MiB (`block_rows`): the K = D matmul
that makes them runs at ~150 GFLOP/s while its output stays in this CPU's caches and ~80
beyond, and whole-sequence features cost a fresh, page-faulted allocation per call
(performer(256) forward at N=16384, H=8 measured ~400 ms whole, ~270 ms in blocks of
1024 rows, ~200-250 ms with the fused softmax features in 2 MiB blocks; noisy machine,
medians of interleaved runs). Without autograd the blocks write into preallocated
buffers.

Causal: chunked prefix sums (`causal_linear_attention`, shared by both variants): within
a chunk of C positions the masked C x C quadratic form; across chunks the running state
S = sum phi(k) v^T and z = sum phi(k), one (M, D) state per chunk, so memory is
O(N (M + C) + N M D / C) per head, never N x N nor N x M x D. Autograd backprops through
it with the same complexity (the prefix sum over chunks is a small autograd.Function).

Accumulation dtype: float64 inputs compute in float64, everything else (bfloat16, float16,
float32) computes features and sums in float32, and the output is cast back to q's dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .base import Variant, param
from .registry import register

# Chunk length of the causal scheme. Per row the intra-chunk form costs 2 C (M + D) FLOPs
# and the state path 4 M D; C = 2 M D / (M + D) balances them (64 for M = D = 64, ~100 for
# M = 256). Timings at N=16384 on the shared 2-core CPU were too noisy to pick finer.
_CHUNK_LINEAR = 64
_CHUNK_PERFORMER = 128
# Bytes of one (B, H, rows, M) feature block of the non-causal path (see block_rows).
_BLOCK_BYTES = 2 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; low precision and float32 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_rows(B: int, H: int, M: int, budget: int = _BLOCK_BYTES) -> int:
    """Rows per block so that one (B, H, rows, M) float32 feature block is about `budget` bytes.

    A power of two in [64, 1024]. Measured here (2 cores, 1 MiB L2 each): the K = D matmul
    that makes the features runs at ~150 GFLOP/s for up to ~2048 x 256 outputs and ~80
    beyond, where its output no longer stays in cache.
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
    if not graph:
        out = Sz.new_empty(B, H, N, D)
        for i, qb in zip(range(0, N, rows), q.split(rows, dim=2)):
            o = phi_q(qb) @ Sz  # (B, H, r, D + 1)
            torch.div(o[..., :D], o[..., D:].add_(eps), out=out[:, :, i:i + rows])
        return out
    outs = []
    for qb in q.split(rows, dim=2):
        o = phi_q(qb) @ Sz  # (B, H, r, D + 1)
        outs.append(o[..., :D] / (o[..., D:] + eps))  # (B, H, r, D)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


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


class _SoftmaxLogSumExp(torch.autograd.Function):
    """u (..., m) -> (softmax(u), logsumexp(u, keepdim)), in one fused pass over u.

    p_i = exp(u_i - lse) for every i, so lse = max(u) - log(max(p)): at the largest u_i,
    p_i >= 1/m, far from underflow. Two max reductions instead of a second exp pass
    (torch.logsumexp), and only p is saved for backward: d lse / du = p.
    """

    @staticmethod
    def forward(ctx, u):
        p = torch.softmax(u, dim=-1)
        lse = u.amax(dim=-1, keepdim=True).sub_(p.amax(dim=-1, keepdim=True).log_())
        ctx.save_for_backward(p)
        return p, lse

    @staticmethod
    def backward(ctx, gp, glse):
        (p,) = ctx.saved_tensors
        # softmax: p * (gp - sum(gp * p)); logsumexp: glse * p.
        g = torch.zeros_like(p) if gp is None else gp
        s = (g * p).sum(dim=-1, keepdim=True)
        if glse is not None:
            s = s - glse
        return p * (g - s)


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


def _flops(N: int, M: int, D: int, causal: bool, chunk: int) -> int:
    """Per-head forward FLOPs of the core. Non-causal: [S | z] = phi(K)^T [V | w] and
    phi(Q) [S | z], two matmuls with D + 1 columns (w: key row weights, ones for linear)."""
    if causal:
        return chunked_flops(N, M, D, chunk)
    return 4 * N * M * (D + 1)


@dataclasses.dataclass(frozen=True)
class LinearParams:
    eps: float = param(1e-6, doc="added to the normaliser phi(q).sum_j phi(k_j)", min=0.0)


@register
class Linear(Variant):
    """elu(x)+1 feature-map linear attention, O(N D^2); causal by chunked prefix sums."""
    name = "linear"
    family = "linear"
    Params = LinearParams
    paper = "https://arxiv.org/abs/2006.16236"

    @staticmethod
    def phi(x: torch.Tensor) -> torch.Tensor:
        """elu(x) + 1 in the compute dtype; (B, H, N, D) -> same."""
        # add_ in place: elu saves its input, not its output, for backward.
        return F.elu(x.to(_compute_dtype(x.dtype))).add_(1)

    def feature_maps(self, q, k):
        """phi(q), phi(k), each (B, H, N, D)."""
        return self.phi(q), self.phi(k)

    def attend(self, q, k, v, causal):
        eps = self.params.eps
        if causal:
            fq, fk = self.feature_maps(q, k)
            o = causal_linear_attention(fq, fk, v.to(fq.dtype), eps, _CHUNK_LINEAR)
        else:
            B, H, _, D = q.shape
            o = kernel_attention(q, k, v, self.phi, lambda kb: (self.phi(kb), None), eps,
                                 rows=block_rows(B, H, D))
        return o.to(q.dtype)

    def flops(self, B, H, N, D, causal=False):
        return B * H * _flops(N, D, D, causal, _CHUNK_LINEAR)


@dataclasses.dataclass(frozen=True)
class PerformerParams:
    num_features: int = param(256, doc="random features m", min=1)
    orthogonal: bool = param(True, doc="orthogonal blocks of D features (else iid Gaussian)")
    seed: int = param(0, doc="seed of the random features", min=0)
    redraw: bool = param(False, doc="draw new features on every forward (by design)")


def random_projection(m: int, D: int, orthogonal: bool, generator: torch.Generator) -> torch.Tensor:
    """(m, D) float64 CPU rows w_r, each marginally N(0, I_D); orthogonal within blocks of D."""
    if not orthogonal:
        return torch.randn(m, D, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(-(-m // D)):
        g = torch.randn(D, D, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)  # columns orthonormal
        # Householder QR fixes signs (R's diagonal), which biases the directions; flipping
        # columns by sign(diag R) makes Q Haar-distributed (Mezzadri 2007), so every row
        # is a uniform direction.
        q = q * torch.sign(torch.diagonal(r))[None, :]
        blocks.append(q.T)
    w = torch.cat(blocks)[:m]  # (m, D), unit rows
    # Norms of independent Gaussian vectors (chi_D): a uniform direction times a chi_D
    # length is exactly N(0, I_D), so each row keeps the iid marginal.
    norms = torch.randn(m, D, generator=generator, dtype=torch.float64).norm(dim=-1)
    return w * norms[:, None]


@register
class Performer(Variant):
    """FAVOR+ positive (orthogonal) random features for the softmax kernel; causal by chunked prefix sums."""
    name = "performer"
    family = "linear"
    Params = PerformerParams
    paper = "https://arxiv.org/abs/2009.14794"

    def __init__(self, params=None):
        super().__init__(params)
        self.register_buffer("projection", None, persistent=False)
        self._projection_key = None
        self._calls = 0

    def _projection(self, D: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        p = self.params
        if p.redraw:
            # A fresh draw each call by design, reproducible from (seed, call number).
            self._calls += 1
            g = torch.Generator().manual_seed(p.seed * 1_000_003 + self._calls)
            return random_projection(p.num_features, D, p.orthogonal, g).to(device, dtype)
        key = (D, device, dtype)
        if self._projection_key != key:  # first sight of this (D, device, dtype): draw, cache
            g = torch.Generator().manual_seed(p.seed)
            self.projection = random_projection(p.num_features, D, p.orthogonal, g).to(device, dtype)
            self._projection_key = key
        return self.projection

    def feature_fns(self, D: int, dtype: torch.dtype, device: torch.device):
        """(phi_q, phi_k) for one forward call, on (B, H, r, D) blocks; with u = w.x, x = q or
        k scaled by D^-1/4, the FAVOR+ features are exp(u - |x|^2/2) / sqrt(m).

        phi_q -> (B, H, r, m): softmax over the features of u, which is those features times
        a per-query-row factor (it cancels in the normalised ratio), in one fused pass.
        phi_k -> (p, logw): p = softmax(u) and logw = logsumexp(u) - |x|^2/2 - log(m)/2 per
        key row, so p * exp(logw) are the features exactly; the caller applies exp(logw)
        after a shift, to the values (r x D) rather than to the features (r x m).
        """
        dt = _compute_dtype(dtype)
        scale = D ** -0.25
        # (D, m), drawn once per call at most; the D^-1/4 is folded into it: x.w = (k s).w = k.(s w).
        w_t = (self._projection(D, device, dt) * scale).T
        half_log_m = 0.5 * math.log(w_t.shape[1])

        # x arrives as a slice of the sequence, strided across heads; matmul runs it as one
        # (B H r, D) x (D, m) product only if it is contiguous (else a batched product with
        # the projection expanded per head, measured ~1.5x slower here).

        def phi_q(x):
            return torch.softmax(x.to(dt).contiguous() @ w_t, dim=-1)  # (B, H, r, m)

        def phi_k(x):
            x = x.to(dt).contiguous()
            p, lse = _SoftmaxLogSumExp.apply(x @ w_t)  # (B, H, r, m), (B, H, r, 1)
            return p, lse - x.square().sum(dim=-1, keepdim=True) * (scale * scale / 2) - half_log_m

        return phi_q, phi_k

    def feature_maps(self, q, k):
        """phi(q), phi(k) (B, H, N, m) in the compute dtype: phi(q) up to a factor per row,
        phi(k) up to one factor per (batch, head) (both cancel)."""
        phi_q, phi_k = self.feature_fns(q.shape[-1], q.dtype, q.device)
        p, logw = phi_k(k)
        return phi_q(q), p * torch.exp(logw - logw.detach().amax(dim=-2, keepdim=True))

    def attend(self, q, k, v, causal):
        eps = torch.finfo(_compute_dtype(q.dtype)).tiny
        if causal:
            fq, fk = self.feature_maps(q, k)
            o = causal_linear_attention(fq, fk, v.to(fq.dtype), eps, _CHUNK_PERFORMER)
        else:
            B, H, _, D = q.shape
            phi_q, phi_k = self.feature_fns(D, q.dtype, q.device)
            o = kernel_attention(q, k, v, phi_q, phi_k, eps,
                                 rows=block_rows(B, H, self.params.num_features))
        return o.to(q.dtype)

    def flops(self, B, H, N, D, causal=False):
        m = self.params.num_features
        projection = 2 * 2 * N * D * m  # x @ w^T for q and for k
        return B * H * (projection + _flops(N, m, D, causal, _CHUNK_PERFORMER))
