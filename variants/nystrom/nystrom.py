"""Nyströmformer: softmax(q k~^T) A^+ softmax(q~ k^T) v with segment-mean landmarks; (B, H, N, D).

Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating
Self-Attention", https://arxiv.org/abs/2102.03902. With m landmarks q~, k~ (means of m
contiguous segments of q and k):

    F = softmax(q k~^T / sqrt D)   (N x m)      A = softmax(q~ k~^T / sqrt D)   (m x m)
    B = softmax(q~ k^T / sqrt D)   (m x N)      o = F (A^+ (B v))

B v is formed first, so the largest intermediates are N x m: O(N m) time and memory. F (.)
and B v are each a softmax over a short side (m landmarks, m rows), made in cache-sized
blocks with a written-out backward (`linformer.softmax_attention`); the m x m part
(A, its pseudo-inverse) goes through autograd.

A^+ follows the paper's iterative Moore-Penrose approximation (after Razavi et al. 2014):
Z0 = A^T / (||A||_1 ||A||_inf), Z <- Z/4 (13 I - A Z (15 I - A Z (7 I - A Z))). The norms are
taken per matrix (per batch and head), as the paper writes it; a global maximum over the
batch would slow convergence of every other head. It runs in at least float32 (float64 stays
float64): in bf16/fp16 the cubic iteration's rounding swamps the inverse.

Segments are as equal as possible (sizes differ by at most one), so no position is dropped
when m does not divide N. The paper's depthwise-conv residual on v is a model choice, not
part of the attention map, and is left out. Non-causal only.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import Contract, Variant, param, register, softmax_scale
from ..low_rank import segment_means, softmax_attention


def iterative_pinv(A: torch.Tensor, iterations: int) -> torch.Tensor:
    """Approximate Moore-Penrose inverse of a batch of square matrices (..., m, m).

    The paper's cubic iteration; Z0 = A^T / (max column sum * max row sum) per matrix, which
    makes ||I - A Z0|| < 1 so the iteration converges.
    """
    absA = A.abs()
    norm1 = absA.sum(dim=-2).amax(dim=-1)  # (...,) max column sum
    norm_inf = absA.sum(dim=-1).amax(dim=-1)  # (...,) max row sum
    Z = A.transpose(-1, -2) / (norm1 * norm_inf)[..., None, None]
    shape, m = A.shape, A.shape[-1]
    A, Z = A.reshape(-1, m, m), Z.reshape(-1, m, m)  # (batch, m, m)
    eye = torch.eye(m, dtype=A.dtype, device=A.device)
    c7, c15, c13 = (c * eye.expand_as(A) for c in (7, 15, 13))
    for _ in range(iterations):
        AZ = torch.bmm(A, Z)
        # c I - AZ X as one baddbmm each: fewer small ops, the same arithmetic.
        X = torch.baddbmm(c15, AZ, c7 - AZ, alpha=-1)
        X = torch.baddbmm(c13, AZ, X, alpha=-1)
        Z = torch.bmm(Z, X).mul_(0.25)  # bmm saves its inputs, not its output
    return Z.reshape(shape)


@dataclasses.dataclass(frozen=True)
class NystromParams:
    num_landmarks: int = param(64, doc="number of segment-mean landmarks m (must be <= N)",
                               min=1)
    pinv_iterations: int = param(6, doc="iterations of the paper's Moore-Penrose "
                                 "approximation; 0 means the exact torch.linalg.pinv (SVD)",
                                 min=0)


@register
class Nystrom(Variant):
    """Nyströmformer attention: segment-mean landmarks and an iterative pseudo-inverse."""
    name = "nystrom"
    family = "nystrom"
    Params = NystromParams
    paper = "https://arxiv.org/abs/2102.03902"
    contract = Contract(weights=True, causal="non_causal_only", refused_why=(
        "its landmarks average queries and keys across the whole sequence, future ones "
        "included"))

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        m = self.params.num_landmarks
        if m > seq_len:
            return [f"nystrom num_landmarks={m} exceeds the sequence length N={seq_len}"]
        return []

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        # Landmarks are the tokens themselves: F A^+ B = A A^+ A = A with the exact
        # pseudo-inverse; the iterative one only approaches it.
        return self.params.num_landmarks >= seq_len and self.params.pinv_iterations == 0

    def landmarks(self, q: torch.Tensor, k: torch.Tensor):
        """(q~ / sqrt(D), k~ (B, H, m, D), A^+ (B, H, m, m) in the work dtype)."""
        m = self.params.num_landmarks
        # The scale goes on the m x D landmarks, never on an N-sized tensor.
        q_l = segment_means(q, m) * softmax_scale(q.shape[-1])  # (B, H, m, D)
        k_l = segment_means(k, m)  # (B, H, m, D)
        a = torch.softmax(q_l @ k_l.transpose(-1, -2), dim=-1)  # (B, H, m, m)
        # The pseudo-inverse in float32 at least (see the module docstring).
        a = a.to(torch.promote_types(q.dtype, torch.float32))
        if self.params.pinv_iterations == 0:
            a_pinv = torch.linalg.pinv(a)  # (B, H, m, m)
        else:
            a_pinv = iterative_pinv(a, self.params.pinv_iterations)  # (B, H, m, m)
        return q_l, k_l, a_pinv

    def factors(self, q: torch.Tensor, k: torch.Tensor):
        """(F (B, H, N, m), A^+ (B, H, m, m) in the work dtype, B (B, H, m, N)): the attention
        map is F A^+ B."""
        q_l, k_l, a_pinv = self.landmarks(q, k)
        f = torch.softmax(q @ (k_l * softmax_scale(q.shape[-1])).transpose(-1, -2), dim=-1)
        b = torch.softmax(q_l @ k.transpose(-1, -2), dim=-1)  # (B, H, m, N)
        return f, a_pinv, b

    def attend(self, q, k, v, causal):
        q_l, k_l, a_pinv = self.landmarks(q, k)
        # B v = softmax(q~ k^T) v first, so nothing is N x N; then F (A^+ B v) with
        # F = softmax(q k~^T): both in cache-sized blocks (`softmax_attention`).
        bv = softmax_attention(q_l, k, v)  # (B, H, m, D)
        z_bv = (a_pinv @ bv.to(a_pinv.dtype)).to(q.dtype)  # (B, H, m, D)
        return softmax_attention(q, k_l * softmax_scale(q.shape[-1]), z_bv)  # (B, H, N, D)

    def attention_weights(self, q, k, causal):
        f, a_pinv, b = self.factors(q, k)
        return f @ (a_pinv @ b.to(a_pinv.dtype)).to(q.dtype)  # (B, H, N, N)

    def state_size(self, N, D):
        # A new query needs the landmark keys (m x D) and A^+ softmax(q~ K^T) V (m x D).
        return 2 * min(self.params.num_landmarks, N) * D

    def flops(self, B, H, N, D, causal=False):
        m, it = self.params.num_landmarks, self.params.pinv_iterations
        landmarks = 2 * N * D  # segment sums of q and k: one add per element
        scores = 2 * N * m * D + 2 * m * m * D + 2 * m * N * D  # F, A, B
        bv = 2 * m * N * D
        pinv = it * 4 * 2 * m ** 3  # four m x m matmuls per iteration; the SVD (it=0) uncounted
        out = 2 * m * m * D + 2 * N * m * D  # A^+ (B v), then F (.)
        return B * H * (landmarks + scores + bv + pinv + out)
