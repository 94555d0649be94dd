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

The N x k scores are made in cache-sized blocks of heads and query rows, with a
written-out backward that keeps the weights (`softmax_attention`, shared with nystrom).

Non-causal only: each projected key mixes positions from the whole sequence, future included.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import Contract, Variant, Workspace, param, register, softmax_, softmax_scale


def segment_sizes(N: int, m: int) -> list[int]:
    """Sizes of m contiguous segments covering N positions, as equal as possible (larger first)."""
    s, r = divmod(N, m)
    return [s + 1] * r + [s] * (m - r)


def segment_means(x: torch.Tensor, m: int) -> torch.Tensor:
    """Means of m contiguous segments along dim -2: (..., N, D) -> (..., m, D); needs m <= N.

    The first N mod m segments hold one position more than the rest, so every position
    contributes and no segment is empty. Two reshapes instead of an (m, N) averaging matrix.
    Under autograd the backward writes each segment's gradient over its positions in one
    pass (`_SegmentMeans`): autograd through the slices and means made three N-sized
    tensors (zeros, a copy, the spread mean), each a fresh allocation.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _SegmentMeans.apply(x, m)
    return _segment_means(x, m)


def _segment_parts(N: int, m: int):
    """(first position, count, size) of the two runs of equal segments: r of s + 1
    positions, then m - r of s (runs of no segments left out)."""
    s, r = divmod(N, m)
    return [p for p in ((0, r, s + 1), (r * (s + 1), m - r, s)) if p[1]]


def _segment_means(x: torch.Tensor, m: int) -> torch.Tensor:
    parts = [x[..., a:a + n * size, :].unflatten(-2, (n, size)).mean(dim=-2)  # (..., n, D)
             for a, n, size in _segment_parts(x.shape[-2], m)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


class _SegmentMeans(torch.autograd.Function):
    """`segment_means` with its backward written out: a position's gradient is its
    segment's, over the segment's size."""

    @staticmethod
    def forward(ctx, x, m):
        ctx.N, ctx.m = x.shape[-2], m
        return _segment_means(x, m)

    @staticmethod
    def backward(ctx, g):
        N, m = ctx.N, ctx.m
        dx = g.new_empty(*g.shape[:-2], N, g.shape[-1])
        j = 0
        for a, n, size in _segment_parts(N, m):
            gs = g[..., j:j + n, :].unsqueeze(-2)  # (..., n, 1, D)
            out = dx[..., a:a + n * size, :].unflatten(-2, (n, size))  # (..., n, size, D)
            torch.div(gs.expand(out.shape), size, out=out)
            j += n
        return dx, None


# Bytes of one block of scores in `softmax_attention`.
_BLOCK_BYTES = 2 << 20


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      budget: int = _BLOCK_BYTES) -> torch.Tensor:
    """softmax(q k^T + bias) v: q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv), bias (Nk,)
    or None (a constant: no gradient) -> (B, H, Nq, Dv). The scale goes on q or k beforehand.

    For one side much shorter than the other (linformer's k projected keys, nystrom's
    landmarks): the scores are made in blocks of heads and query rows of about `budget`
    bytes (`_blocks`), so each block stays in cache instead of making a whole (B, H, Nq,
    Nk) tensor in memory. Under autograd the backward is written out (`_SoftmaxAttention`),
    keeping the weights as plain autograd would, in the same blocks.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _SoftmaxAttention.apply(q, k, v, bias, budget)
    return _softmax_forward(q, k, v, bias, budget, None)


def _blocks(BH: int, Nq: int, Nk: int, itemsize: int, budget: int) -> tuple[int, int]:
    """(heads, rows) per block: up to 1024 query rows that the budget holds, then as many
    heads as it holds (at least one of each)."""
    rows = max(1, min(Nq, 1024, budget // (itemsize * Nk)))
    return max(1, min(BH, budget // (itemsize * rows * Nk))), rows


def _softmax_forward(q, k, v, bias, budget, saved):
    """The forward of `softmax_attention`; `saved`: a list that receives the weight blocks,
    or None."""
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    BH = B * H
    q3, k3, v3 = q.reshape(BH, Nq, D), k.reshape(BH, Nk, D), v.reshape(BH, Nk, Dv)
    hb, rows = _blocks(BH, Nq, Nk, q.element_size(), budget)
    out = q.new_empty(BH, Nq, Dv)
    # Without autograd one score buffer serves every block (a fresh block each time costs
    # the allocator's page faults, see `Workspace`); under it each block's weights are kept.
    ws = Workspace(q) if saved is None else None
    for h in range(0, BH, hb):
        kt, vh = k3[h:h + hb].transpose(-1, -2), v3[h:h + hb]  # (hb, D, Nk), (hb, Nk, Dv)
        for i in range(0, Nq, rows):
            qb = q3[h:h + hb, i:i + rows]
            s = torch.bmm(qb, kt, out=None if ws is None else ws("s", *qb.shape[:2], Nk))
            if bias is not None:
                s += bias
            p = softmax_(s)
            torch.bmm(p, vh, out=out[h:h + hb, i:i + rows])  # (hb, r, Dv)
            if saved is not None:
                saved.append(p)
    return out.view(B, H, Nq, Dv)


class _SoftmaxAttention(torch.autograd.Function):
    """`softmax_attention` with its backward written out, block by block: with the weights
    p of a block and g the output's gradient, dv += p^T g, ds = p (g v^T - rowsum(g o)),
    dq = ds k, dk += ds^T q; four matmuls of the forward's size (twice its two)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, budget):
        saved = []
        out = _softmax_forward(q, k, v, bias, budget, saved)
        ctx.budget = budget
        ctx.save_for_backward(q, k, v, out, *saved)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, *ps = ctx.saved_tensors
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[-1]
        BH = B * H
        q3, k3, v3 = q.reshape(BH, Nq, D), k.reshape(BH, Nk, D), v.reshape(BH, Nk, Dv)
        g3, o3 = g.reshape(BH, Nq, Dv), out.view(BH, Nq, Dv)
        hb, rows = _blocks(BH, Nq, Nk, q.element_size(), ctx.budget)
        dq = torch.empty_like(q3)
        # The first block of rows of each head writes dk and dv (beta = 0), later ones add:
        # no zero-filled (BH, Nk, D) tensors (nystrom's B v has one block of rows a head).
        dk = torch.empty_like(k3)
        dv = torch.empty_like(v3)
        blocks = iter(ps)
        ws = Workspace(g3)
        for h in range(0, BH, hb):
            hs = slice(h, h + hb)
            for i in range(0, Nq, rows):
                rs = slice(i, i + rows)
                beta = 0 if i == 0 else 1
                p, gb = next(blocks), g3[hs, rs]
                dv[hs].baddbmm_(p.transpose(-1, -2), gb, beta=beta)
                ds = torch.bmm(gb, v3[hs].transpose(-1, -2), out=ws("ds", *p.shape))
                ds.sub_(torch.linalg.vecdot(gb, o3[hs, rs]).unsqueeze(-1)).mul_(p)
                torch.bmm(ds, k3[hs], out=dq[hs, rs])
                dk[hs].baddbmm_(ds.transpose(-1, -2), q3[hs, rs], beta=beta)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None, None


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
    contract = Contract(weights=True, causal="non_causal_only", refused_why=(
        "every projected key and value mixes positions across the whole sequence, future "
        "ones included"))

    def __init__(self, params=None):
        super().__init__(params)
        # (N, device, dtype) -> (E, F) for gaussian, or the (k,) score offsets for mean_pool.
        self._cache: dict[tuple, object] = {}


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
        return softmax_attention(q, kp * scale, vp, offsets)  # (B, H, N, D)

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

    def state_size(self, N, D):
        k = min(self.params.k, N)
        return 2 * k * D  # E K and F V (k x D each)

    def flops(self, B, H, N, D, causal=False):
        kk = self.params.k
        if self.params.projection == "gaussian":
            # E k and F v are both computed (share_kv reuses E's values, not the product).
            proj = 2 * 2 * kk * N * D
        else:
            # Segment sums: one add per element of k and of v (no matmul).
            proj = 2 * N * D
        return B * H * (proj + 2 * N * kk * D + 2 * N * kk * D)
