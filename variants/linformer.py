"""Linformer: softmax(q (E k)^T / sqrt(D)) (F v) with E, F in R^{k x N}; (B, H, N, D) -> same.

Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity",
https://arxiv.org/abs/2006.04768. Keys and values are projected along the sequence axis to
k rows, so the score matrix is N x k: O(N k) time and memory, never N x N.

Two untrained projections (a variant is a pure q, k, v -> o map, so nothing is learned):

- "gaussian": the paper's random construction (Theorem 2: E = delta R, F = e^-delta R with
  R_ij ~ N(0, 1/k); delta = 1 here). The 1/k variance is the Johnson-Lindenstrauss scaling:
  for a column x in R^N of k or v, E||R x||^2 = ||x||^2. Drawn on CPU from `seed` when the
  module first sees a length N and cached per (N, device, dtype), so the draw is
  deterministic across devices and never happens inside a timed call.
- "mean_pool": row r of E = F averages the r-th of k contiguous segments (sizes differ by
  at most one). A pooled key stands for its whole segment, so its score gets + log(size):
  exp(q.k_bar + log n_r) = n_r exp(q.k_bar), the mass of n_r equal keys. With k = N every
  segment is one token and this is exactly softmax attention. Computed by segment means
  (reshapes), without a dense k x N matrix.

Non-causal only: each projected key mixes positions from the whole sequence, future included.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import Variant, param, softmax_scale
from .registry import register


def segment_sizes(N: int, m: int) -> list[int]:
    """Sizes of m contiguous segments covering N positions, as equal as possible (larger first)."""
    s, r = divmod(N, m)
    return [s + 1] * r + [s] * (m - r)


def segment_means(x: torch.Tensor, m: int) -> torch.Tensor:
    """Means of m contiguous segments along dim -2: (..., N, D) -> (..., m, D); needs m <= N.

    The first N mod m segments hold one position more than the rest, so every position
    contributes and no segment is empty. Two reshapes instead of an (m, N) averaging matrix.
    """
    N = x.shape[-2]
    s, r = divmod(N, m)
    cut = r * (s + 1)
    parts = []
    if r:
        parts.append(x[..., :cut, :].unflatten(-2, (r, s + 1)).mean(dim=-2))  # (..., r, D)
    if m - r:
        parts.append(x[..., cut:, :].unflatten(-2, (m - r, s)).mean(dim=-2))  # (..., m-r, D)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


# Query rows per block of the score computation.
_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class LinformerParams:
    k: int = param(256, doc="projected length: rows of E and F (must be <= N)", min=1)
    projection: str = param("gaussian", doc="'gaussian': seeded N(0, 1/k) entries (the paper's "
                            "untrained construction); 'mean_pool': segment means with a "
                            "log(segment size) score offset", choices=("gaussian", "mean_pool"))
    seed: int = param(0, doc="seed of the gaussian projections (unused by mean_pool)", min=0)
    share_kv: bool = param(False, doc="use E for both keys and values (F = E)")


@register
class Linformer(Variant):
    """Linformer low-rank attention: keys and values projected along the sequence to k rows."""
    name = "linformer"
    family = "low_rank"
    Params = LinformerParams
    paper = "https://arxiv.org/abs/2006.04768"
    supports_causal = False

    def __init__(self, params=None):
        super().__init__(params)
        # (N, device, dtype) -> (E, F) for gaussian, or the (k,) score offsets for mean_pool.
        self._cache: dict[tuple, object] = {}

    def non_causal_why(self) -> str:
        return ("every projected key and value mixes positions across the whole sequence, "
                "future ones included")

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        k = self.params.k
        if k > seq_len:
            return [f"linformer k={k} exceeds the sequence length N={seq_len} "
                    f"(projects to more rows than there are keys)"]
        return []

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        # One segment per token: every key is its own pooled key (the module docstring).
        # Gaussian projections mix keys at any k.
        return self.params.projection == "mean_pool" and self.params.k >= seq_len

    # -- cached per length state -----------------------------------------------------
    def projections(self, N: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The gaussian (E, F), each (k, N), drawn from `seed` on first use of this key."""
        key = ("proj", N, torch.device(device), dtype)
        if key not in self._cache:
            p = self.params
            g = torch.Generator().manual_seed(p.seed)
            # E is drawn first, so it does not depend on share_kv.
            E = (torch.randn(p.k, N, generator=g) / math.sqrt(p.k)).to(device=device, dtype=dtype)
            F = E if p.share_kv else (torch.randn(p.k, N, generator=g)
                                      / math.sqrt(p.k)).to(device=device, dtype=dtype)
            self._cache[key] = (E, F)
        return self._cache[key]

    def pool_offsets(self, N: int, device, dtype) -> torch.Tensor:
        """log(segment size) per pooled key, (k,)."""
        key = ("offsets", N, torch.device(device), dtype)
        if key not in self._cache:
            sizes = torch.tensor(segment_sizes(N, self.params.k), dtype=torch.float64)
            self._cache[key] = sizes.log().to(device=device, dtype=dtype)
        return self._cache[key]

    # -- the map --------------------------------------------------------------------
    def attend(self, q, k, v, causal):
        N, D = q.shape[-2], q.shape[-1]
        scale = softmax_scale(D)
        offsets = None
        if self.params.projection == "gaussian":
            E, F = self.projections(N, q.device, q.dtype)
            kp = E @ k  # (B, H, k, D)
            vp = F @ v  # (B, H, k, D)
        else:
            kp = segment_means(k, self.params.k)  # (B, H, k, D)
            vp = segment_means(v, self.params.k)  # (B, H, k, D)
            offsets = self.pool_offsets(N, q.device, q.dtype)  # (k,)
        # Scaling the k x D keys rather than the N x k scores: fewer elements.
        kt = (kp * scale).transpose(-1, -2)  # (B, H, D, k)
        # Queries in blocks of _ROWS: each (B, H, rows, k) score block stays in cache and
        # below glibc's 32 MiB mmap threshold (whole, at N=16384, H=8, k=256 it is 128 MiB,
        # a fresh page-faulted mapping per call: measured ~290 ms whole, ~230 ms blocked).
        outs = []
        for qb in q.split(_ROWS, dim=2):
            scores = qb @ kt  # (B, H, rows, k)
            if offsets is not None:
                # In place: the matmul's backward needs its inputs, not this output.
                scores += offsets
            outs.append(torch.softmax(scores, dim=-1) @ vp)  # (B, H, rows, D)
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, N, D)

    def attention_weights(self, q, k, causal):
        """softmax(q (E k)^T / sqrt(D)) F, (B, H, N, N): the scores over the k projected keys
        mapped back through the value projection (mean_pool: each pooled key's weight spread
        evenly over its segment)."""
        N, D = q.shape[-2], q.shape[-1]
        if self.params.projection == "gaussian":
            E, F = self.projections(N, q.device, q.dtype)
            scores = q @ ((E @ k) * softmax_scale(D)).transpose(-1, -2)  # (B, H, N, k)
            return torch.softmax(scores, dim=-1) @ F  # (B, H, N, N)
        kp = segment_means(k, self.params.k)  # (B, H, k, D)
        scores = q @ (kp * softmax_scale(D)).transpose(-1, -2) + self.pool_offsets(
            N, q.device, q.dtype)  # (B, H, N, k)
        sizes = torch.tensor(segment_sizes(N, self.params.k), dtype=torch.float64)
        seg = torch.repeat_interleave(torch.arange(len(sizes)), sizes.long())  # (N,) segment of j
        mean = (seg[None, :] == torch.arange(len(sizes))[:, None]) / sizes[:, None]  # (k, N)
        return torch.softmax(scores, dim=-1) @ mean.to(q.device, q.dtype)

    def flops(self, B, H, N, D, causal=False):
        kk = self.params.k
        if self.params.projection == "gaussian":
            # E k and F v are both computed (share_kv reuses E's values, not the product).
            proj = 2 * 2 * kk * N * D
        else:
            # Segment sums: one add per element of k and of v (no matmul).
            proj = 2 * N * D
        return B * H * (proj + 2 * N * kk * D + 2 * N * kk * D)
