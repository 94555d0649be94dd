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
  moved the output by 1.5% and 17% there, towards uniform attention. Causal: under
  autograd the key shift is one max over the whole sequence of a (batch, head), a
  constant, so a future key never changes a causal output (beyond rounding); without it
  (the streamed path) the largest so far, the carried state rescaled when it grows, so
  only past keys set it.

The kernelised-attention cores (non-causal in blocks, causal by chunked prefix sums) are
in `noncausal.py` and `causal.py`.

Accumulation dtype: float64 inputs compute in float64, everything else (bfloat16, float16,
float32) computes features and sums in float32, and the output is cast back to q's dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import (Contract, DecodeState, Variant, compute_dtype, exp_, param, register,
                    softmax_, softmax_logsumexp, softmax_lse_)
from .causal import causal_kernel_attention, core_flops
from .noncausal import (FeatureMap, block_rows, kernel_attention, kernel_weights,
                          sequence_features)

# Chunk length of the causal scheme. Per row the intra-chunk form costs 2 C (M + D) FLOPs
# and the state path 4 M D; C = 2 M D / (M + D) balances them (64 for M = D = 64, ~100 for
# M = 256). Timings at N=16384 on the shared 2-core CPU were too noisy to pick finer.
_CHUNK_LINEAR = 64
_CHUNK_PERFORMER = 128


class _SoftmaxLogSumExp(torch.autograd.Function):
    """u (..., m) -> (softmax(u), logsumexp(u, keepdim)) by `softmax_logsumexp`, one exp
    pass; only p is saved for backward (d lse / du = p)."""

    @staticmethod
    def forward(ctx, u):
        p, lse = softmax_logsumexp(u)
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


class EluFeatures(FeatureMap):
    """phi(x) = elu(x) + 1, and its derivative from its value: 1 where x > 0 (phi > 1),
    exp(x) = phi elsewhere, so phi' = min(phi, 1). Features are cheap here: recomputed in
    the backward pass rather than kept.

    Computed as exp(min(x, 0)) + max(x, 0), the exp in place as an exp2 (`exp_`): on this
    CPU torch's elu ran at about half the rate of exp(min(x, 0)) + max(x, 0) (one-thread
    microbenchmark, 2^19 elements: 1.1 vs 0.64 ms), and torch.exp at a third of exp2's.
    No autograd through it (the in-place exp's result is changed): the cores call it
    without. The gradient methods write into `out` when given one.
    """

    def query(self, x):
        return exp_(x.clamp(max=0)).add_(x.clamp(min=0))

    def key(self, x):
        return self.query(x), None

    def query_grad(self, x, f, df, out=None):
        return torch.mul(f.clamp(max=1), df, out=out)

    def key_grad(self, x, f, wk, t, out=None):
        return torch.mul(f.clamp(max=1), t, out=out)


class FavorFeatures(FeatureMap):
    """FAVOR+ features from the projection w_t (D, m), the D^-1/4 scale s folded into it
    (see `Performer.feature_fns`); kept for the backward pass (recomputing them would
    repeat the projections, half of the forward's matmuls).

    query(x) = softmax(x w_t); key(x) = (p, logw), p = softmax(u), u = x w_t, logw =
    logsumexp(u) - s^2 |x|^2 / 2 - log(m) / 2. Gradients: a query's softmax takes
    du = f (df - sum(df f)), dx = du w_t^T. A key's feature is phi = exp(u - s^2 |x|^2 / 2
    - ...), so with t = dL/d phi: du = phi t and dx = du w_t^T - s^2 x sum(du).
    """

    save = True

    def __init__(self, w_t: torch.Tensor, scale: float):
        self.w_t = w_t
        self.s2 = scale * scale
        self.half_log_m = 0.5 * math.log(w_t.shape[1])

    def query(self, x):
        # x arrives as a slice of the sequence, strided across heads; matmul runs it as one
        # (B H r, D) x (D, m) product only if it is contiguous (else a batched product with
        # the projection expanded per head, measured ~1.5x slower here).
        u = x.contiguous() @ self.w_t  # (B, H, r, m)
        # Without autograd (the cores) the softmax overwrites u: one (r, m) block, not two.
        return torch.softmax(u, dim=-1) if u.requires_grad else softmax_(u)

    def key(self, x):
        x = x.contiguous()
        u = x @ self.w_t  # (B, H, r, m)
        if u.requires_grad:
            p, lse = _SoftmaxLogSumExp.apply(u)  # (B, H, r, m), (B, H, r, 1)
        else:
            p, lse = u, softmax_lse_(u)
        return p, lse - x.square().sum(dim=-1, keepdim=True) * (self.s2 / 2) - self.half_log_m

    def query_grad(self, x, f, df, out=None):
        du = (df - torch.linalg.vecdot(df, f).unsqueeze(-1)).mul_(f)
        dx = du @ self.w_t.T  # matmul's out= does not take a strided (B, H, r, D) view
        return dx if out is None else out.copy_(dx)

    def key_grad(self, x, f, wk, t, out=None):
        du = t * f if wk is None else (t * f).mul_(wk)  # (B, H, r, m)
        return torch.sub(du @ self.w_t.T, x * (self.s2 * du.sum(dim=-1, keepdim=True)),
                         out=out)


@dataclasses.dataclass
class KernelState(DecodeState):
    """The running sums of causal kernel attention after n tokens, in the compute dtype:
    S = sum_j phi(k_j)^T w_j v_j (B, H, M, D) and z = sum_j w_j phi(k_j) (B, H, M), where
    w_j = exp(logw_j - shift) carries a key's own factor (FAVOR+; 1 for elu+1) against the
    largest seen so far, `shift` (B, H, 1, 1); the sums are rescaled when it grows."""
    S: torch.Tensor
    z: torch.Tensor
    shift: torch.Tensor


# Context rows a prefill turns into features at a time: (B, H, rows, M) blocks, not the
# whole (B, H, N, M) context at once.
_PREFILL_ROWS = 4096


class _KernelDecoding:
    """Token-by-token causal kernel attention for a feature map: prefill sums the
    context's features into a `KernelState`; a step adds its key and reads its query."""

    def decode_fmap(self, D: int, dtype: torch.dtype, device) -> tuple[FeatureMap, float]:
        raise NotImplementedError

    def _add_keys(self, state: KernelState, fmap: FeatureMap, k, v) -> None:
        fk, logw = fmap.key(k)  # (B, H, r, M), (B, H, r, 1) or None
        if logw is not None:
            top = torch.maximum(state.shift, logw.amax(dim=-2, keepdim=True))  # (B, H, 1, 1)
            rescale = (state.shift - top).exp_()  # 0 while nothing was added (-inf shift)
            state.S.mul_(rescale)
            state.z.mul_(rescale[..., 0])
            state.shift.copy_(top)
            v = v * (logw - top).exp_()  # each key's factor applied to its value row
            fk_sum = torch.einsum("bhrm,bhr->bhm", fk, (logw - top).exp_()[..., 0])
        else:
            fk_sum = fk.sum(dim=-2)
        state.S.add_(fk.transpose(-1, -2) @ v)  # (B, H, M, D)
        state.z.add_(fk_sum)

    def decode_flops_at(self, N, s):
        """`decode_step` per head, its sums S (M, D) and z (M): the key's write
        phi(k)^T v (2 M D) added into S (M D), the read phi(q) S (2 M D) and its
        normaliser phi(q) z (2 M), and what the feature map adds (`_step_feature_flops`)."""
        D = s.D
        M = self.state_size(1, D) // (D + 1)
        return s.out_heads * (5 * M * D + 2 * M + self._step_feature_flops(D, M))

    def _step_feature_flops(self, D: int, M: int) -> int:
        return 0  # elu + 1: elementwise on D numbers

    def decode_prefill(self, k, v, max_len):
        B, H, N, D = k.shape
        dt = compute_dtype(k.dtype)
        M = self.state_size(1, D) // (D + 1)
        state = KernelState(k.new_zeros(B, H, M, D, dtype=dt), k.new_zeros(B, H, M, dtype=dt),
                            k.new_full((B, H, 1, 1), float("-inf"), dtype=dt))
        return self.decode_extend(state, k, v)

    def decode_extend(self, state, k, v):
        fmap, _ = self.decode_fmap(k.shape[-1], k.dtype, k.device)
        dt = state.S.dtype
        for s in range(0, k.shape[-2], _PREFILL_ROWS):
            self._add_keys(state, fmap, k[:, :, s:s + _PREFILL_ROWS].to(dt),
                           v[:, :, s:s + _PREFILL_ROWS].to(dt))
        return state

    def decode_step(self, state, q, k, v):
        dt = state.S.dtype
        fmap, eps = self.decode_fmap(q.shape[-1], q.dtype, q.device)
        self._add_keys(state, fmap, k.to(dt), v.to(dt))
        fq = fmap.query(q.to(dt))  # (B, H, 1, M)
        num = fq @ state.S  # (B, H, 1, D)
        den = fq @ state.z.unsqueeze(-1)  # (B, H, 1, 1)
        return num.div_(den.add_(eps)).to(q.dtype), state


@dataclasses.dataclass(frozen=True)
class LinearParams:
    eps: float = param(1e-6, doc="added to the normaliser phi(q).sum_j phi(k_j)", min=0.0)


@register
class Linear(_KernelDecoding, Variant):
    """elu(x)+1 feature-map linear attention, O(N D^2); causal by chunked prefix sums."""
    name = "linear"
    family = "linear"
    # fla's LinearAttention's output layer (docs/training.md).
    contract = Contract(decoding=True, extend=True, weights=True, output_layer="rms")
    Params = LinearParams
    paper = "https://arxiv.org/abs/2006.16236"

    def feature_maps(self, q, k):
        """phi(q), phi(k), each (B, H, N, D), elu(x) + 1 in the compute dtype."""
        dt = compute_dtype(q.dtype)
        return sequence_features(q.to(dt), k.to(dt), EluFeatures())

    def attend(self, q, k, v, causal):
        eps = self.params.eps
        B, H, _, D = q.shape
        dt, dtype = compute_dtype(q.dtype), q.dtype
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if causal:
            o = causal_kernel_attention(q, k, v, EluFeatures(), eps, _CHUNK_LINEAR,
                                        rows=block_rows(B, H, D))
        else:
            o = kernel_attention(q, k, v, EluFeatures(), eps, rows=block_rows(B, H, D))
        return o.to(dtype)

    def attention_weights(self, q, k, causal):
        fq, fk = self.feature_maps(q, k)  # (B, H, N, D)
        return kernel_weights(fq, fk, self.params.eps, causal).to(q.dtype)

    def decode_fmap(self, D, dtype, device):
        return EluFeatures(), self.params.eps

    def flops(self, B, H, N, D, causal=False):
        return B * H * core_flops(N, D, D, causal, _CHUNK_LINEAR)

    def state_size(self, N, D):
        return D * D + D  # sum_j phi(k_j) v_j^T (D x D) and sum_j phi(k_j) (D)


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
class Performer(_KernelDecoding, Variant):
    """FAVOR+ positive (orthogonal) random features for the softmax kernel; causal by chunked prefix sums."""
    name = "performer"
    family = "linear"
    # fla's LinearAttention's output layer (docs/training.md).
    contract = Contract(decoding=True, extend=True, weights=True, output_layer="rms")
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
        fmap = self.feature_map(D, dtype, device)
        dt = compute_dtype(dtype)
        return (lambda x: fmap.query(x.to(dt))), (lambda x: fmap.key(x.to(dt)))

    def feature_map(self, D: int, dtype: torch.dtype, device: torch.device) -> FavorFeatures:
        """The `FavorFeatures` of one forward call, in the compute dtype of `dtype`."""
        dt = compute_dtype(dtype)
        scale = D ** -0.25
        # (D, m), drawn once per call at most; the D^-1/4 is folded into it: x.w = (k s).w = k.(s w).
        return FavorFeatures((self._projection(D, device, dt) * scale).T, scale)

    def feature_maps(self, q, k):
        """phi(q), phi(k) (B, H, N, m) in the compute dtype: phi(q) up to a factor per row,
        phi(k) up to one factor per (batch, head) (both cancel)."""
        dt = compute_dtype(q.dtype)
        return sequence_features(q.to(dt), k.to(dt), self.feature_map(q.shape[-1], q.dtype,
                                                                      q.device))

    def attend(self, q, k, v, causal):
        eps = torch.finfo(compute_dtype(q.dtype)).tiny
        B, H, _, D = q.shape
        dt, dtype = compute_dtype(q.dtype), q.dtype
        fmap = self.feature_map(D, dtype, q.device)
        rows = block_rows(B, H, self.params.num_features)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if causal:
            o = causal_kernel_attention(q, k, v, fmap, eps, _CHUNK_PERFORMER, rows=rows)
        else:
            o = kernel_attention(q, k, v, fmap, eps, rows=rows)
        return o.to(dtype)

    def decode_fmap(self, D, dtype, device):
        return self.feature_map(D, dtype, device), torch.finfo(compute_dtype(dtype)).tiny

    def _step_feature_flops(self, D, M):
        # The query's and the key's projections x w^T (2 D M each), the rescale of S
        # when the key scale grows (M D, made every step).
        return 4 * D * M + M * D

    def extra_decode_reasons(self):
        if self.params.redraw:
            return ["performer(redraw=True) draws new features on every call: no state "
                    "carries from one token to the next"]
        return []

    def extra_weights_reasons(self):
        if self.params.redraw:
            return ["performer(redraw=True) draws new features on every call, so no one map "
                    "gives its next output"]
        return []

    def attention_weights(self, q, k, causal):
        fq, fk = self.feature_maps(q, k)  # (B, H, N, m)
        return kernel_weights(fq, fk, torch.finfo(fq.dtype).tiny, causal).to(q.dtype)

    def state_size(self, N, D):
        m = self.params.num_features
        return m * D + m  # sum_j phi(k_j) v_j^T (m x D) and sum_j phi(k_j) (m)

    def flops(self, B, H, N, D, causal=False):
        m = self.params.num_features
        projection = 2 * 2 * N * D * m  # x @ w^T for q and for k
        return B * H * (projection + core_flops(N, m, D, causal, _CHUNK_PERFORMER))
