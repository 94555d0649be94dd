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
  The stabiliser c (as in the google-research performer/fast_attention code) is the max
  exponent of that query row for q, and one max over all keys and features of a
  (batch, head) for k:
  a per-query-row and a per-head constant, both cancel exactly in the normalised ratio, so
  they are detached from autograd. The guard against 0/0 is an eps of the dtype's smallest
  normal number in the denominator, not an eps added to each feature: after the key shift
  the median key feature (times sqrt(m)) is ~1e-6 on `gaussian` and ~4e-9 on `local`
  inputs (N=2048, D=64), and adding 1e-6 to every feature moved the output by 1.5% and 17%
  there, towards uniform attention. Also because the constants cancel, the
  global key max never lets a future key change a causal output (beyond rounding); it
  could only underflow keys ~87 nats (float32) below the largest one, to zero.

Non-causal: by associativity, S = phi(K)^T V (M x D) and z = phi(K)^T 1 first, O(N M D),
in blocks of `_ROWS` keys, then the queries in blocks of `_ROWS` (`kernel_attention`):
the (rows, M) feature blocks stay in cache and below glibc's 32 MiB mmap threshold,
where whole-sequence features cost a fresh, page-faulted allocation per call (measured
here, performer(256) forward at N=16384, H=8: ~270 ms blocked against ~400 ms whole).
Causal: chunked prefix sums (`causal_linear_attention`, shared by both variants): within a
chunk of C positions the masked C x C quadratic form; across chunks the running state
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
# Rows per block of the non-causal path.
_ROWS = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; low precision and float32 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q, phi_k,
                     eps: float, rows: int = _ROWS) -> torch.Tensor:
    """Non-causal kernelised attention over (B, H, N, D) q, k, v, in blocks of `rows`.

    phi_q(q block) -> features (B, H, r, M); phi_k(k block) -> (f, shift): the block's
    features are f * exp(shift), shift (B, H, 1, 1) or None. The sums S and z are kept
    relative to the largest shift seen so far (a common factor, it cancels in the ratio),
    so each block's exponent can be stabilised by its own maximum.
    """
    S = z = top = None
    for kb, vb in zip(k.split(rows, dim=2), v.split(rows, dim=2)):
        fk, shift = phi_k(kb)  # (B, H, r, M)
        S_b = fk.transpose(-1, -2) @ vb.to(fk.dtype)  # (B, H, M, D)
        z_b = fk.sum(dim=-2).unsqueeze(-1)  # (B, H, M, 1)
        if shift is not None:
            new = shift if top is None else torch.maximum(top, shift)
            S_b, z_b = S_b * torch.exp(shift - new), z_b * torch.exp(shift - new)
            if top is not None:
                S, z = S * torch.exp(top - new), z * torch.exp(top - new)
            top = new
        S, z = (S_b, z_b) if S is None else (S + S_b, z + z_b)
    outs = []
    for qb in q.split(rows, dim=2):
        fq = phi_q(qb)  # (B, H, r, M)
        outs.append((fq @ S) / ((fq @ z) + eps))  # (B, H, r, D)
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
    """Per-head forward FLOPs of the core: S = phi(K)^T V, phi(Q) S, phi(Q) z (non-causal)."""
    if causal:
        return chunked_flops(N, M, D, chunk)
    return 4 * N * M * D + 2 * N * M


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
            o = kernel_attention(q, k, v, self.phi, lambda kb: (self.phi(kb), None), eps)
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
        """(phi_q, phi_k) for one forward call: (B, H, r, D) blocks -> (B, H, r, m) features.

        phi_k returns (features, shift): the block's features times exp(shift); the shift is
        that block's stabiliser, which cancels in the normalised output.
        """
        dt = _compute_dtype(dtype)
        w_t = self._projection(D, device, dt).T  # (D, m), drawn once per call at most
        scale = D ** -0.25
        half_log_m = 0.5 * math.log(w_t.shape[1])  # the 1 / sqrt(m), folded into the shift

        def phi_q(x):
            u = (x.to(dt) * scale) @ w_t  # (B, H, r, m)
            # w.x - |x|^2/2 - max_r(w_r.x - |x|^2/2) = w.x - max_r w_r.x: |x|^2/2 drops
            # out. A per-row factor: its gradient, like the stabiliser's, cancels.
            c = u.detach().amax(dim=-1, keepdim=True)  # (B, H, r, 1)
            # In place: the matmul output is not saved for backward; exp_ saves its result.
            return u.sub_(c + half_log_m).exp_()

        def phi_k(x):
            x = x.to(dt) * scale
            u = x @ w_t  # (B, H, r, m)
            u = u.sub_(x.square().sum(dim=-1, keepdim=True) / 2)  # w.x - |x|^2/2
            c = u.detach().amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1): one per block
            return u.sub_(c + half_log_m).exp_(), c

        return phi_q, phi_k

    def feature_maps(self, q, k):
        """phi(q), phi(k) (B, H, N, m) in the compute dtype, stabilisers included."""
        phi_q, phi_k = self.feature_fns(q.shape[-1], q.dtype, q.device)
        return phi_q(q), phi_k(k)[0]

    def attend(self, q, k, v, causal):
        phi_q, phi_k = self.feature_fns(q.shape[-1], q.dtype, q.device)
        eps = torch.finfo(_compute_dtype(q.dtype)).tiny
        if causal:
            fq, (fk, _) = phi_q(q), phi_k(k)
            o = causal_linear_attention(fq, fk, v.to(fq.dtype), eps, _CHUNK_PERFORMER)
        else:
            o = kernel_attention(q, k, v, phi_q, phi_k, eps)
        return o.to(q.dtype)

    def flops(self, B, H, N, D, causal=False):
        m = self.params.num_features
        projection = 2 * 2 * N * D * m  # x @ w^T for q and for k
        return B * H * (projection + _flops(N, m, D, causal, _CHUNK_PERFORMER))
