"""Sliding-window attention: exact softmax over keys |i - j| <= window, (B, H, N, D) in O(N w D).

Longformer's local attention (Beltagy et al. 2020, https://arxiv.org/abs/2004.05150), without
its global tokens: query i sees key j iff i - window <= j <= i + window (causal: and j <= i).

Blocked scheme: queries are split into chunks of c rows; chunk [s, s + c) scores the
contiguous key span [s - w, s + c + w) (causal: [s - w, s + c)), rows of the zero-padded
keys taken as a view, and the band is masked inside that small (c, L) block, L = c + 2w
(causal c + w). One chunk is one batched matmul over B H for the scores and one for the
values, the (B, H, c, L) scores cache-sized; chunks too small to fill that budget (a
narrow window) go G at a time, one matmul over (B H, G) spans. Time and memory, forward
and backward, are O(N (c + 2w) D): never an N x N matrix.

Backward (`_BandRows`, FlashAttention's recomputation: Dao et al. 2022,
https://arxiv.org/abs/2205.14135, Algorithm 4 without tiling): the forward saves q (scaled,
padded), the padded k and v, the output and one log-sum-exp per query; the backward
recomputes each chunk's probabilities and adds its span's key and value gradients into
the padded gradients. Plain autograd kept every chunk's probabilities and a copy of the
overlapping key and value spans.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .base import (KeyMask, Variant, Workspace, exp_, param, softmax_, softmax_lse_,
                   softmax_scale)
from .registry import register

# Query-chunk rows: half the window, within these bounds. A chunk scores c + 2w keys per
# query against the band's 2w + 1, so smaller chunks waste less work; below ~32 rows the
# matmuls get too small to run fast. At window=256 on the 2-core machine, c = 64, 128 and
# 256 timed within noise of each other (forward and forward+backward, N=8192); 128 wastes
# 1.25x of the band's work where 256 wastes 1.5x.
_MIN_CHUNK, _MAX_CHUNK = 32, 128
# Bytes of one group's score block.
_GROUP_BYTES = 2 * 2**20
# Lengths whose band masks a module keeps (each is N (c + 2w) bytes).
_CACHED_MASKS = 4


@dataclasses.dataclass(frozen=True)
class SlidingWindowParams:
    window: int = param(256, doc="keys on each side a query sees (|i - j| <= window)", min=0)


def in_band(i: torch.Tensor, j: torch.Tensor, window: int) -> torch.Tensor:
    """i - window <= j <= i + window, elementwise over broadcast index tensors."""
    d = j - i
    return (d >= -window) & (d <= window)


def band_mask(window: int) -> KeyMask:
    """The key predicate i - window <= j <= i + window, as a KeyMask ([c], [n] -> [c, n])."""
    def allowed(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return in_band(i[:, None], j[None, :], window)  # (c, n)
    return allowed


def window_covers(window: int, N: int) -> bool:
    """Whether the band |i - j| <= window holds every pair of N positions (exact attention)."""
    return window >= N - 1


def chunk_rows(window: int, N: int) -> int:
    """Query rows per chunk for this window and length."""
    c = min(max(window // 2, _MIN_CHUNK), _MAX_CHUNK)
    return max(1, min(c, N))


def band_span(window: int, N: int, causal: bool) -> tuple[int, int, int]:
    """(window w, chunk rows c, keys scored per chunk L) of the blocked band at length N.

    A band wider than the sequence is the full matrix: w is clamped to N - 1, so spans stay
    <= ~3N.
    """
    w = min(window, max(N - 1, 0))
    c = chunk_rows(w, N)
    return w, c, c + w + (0 if causal else w)


def band_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, c: int, L: int,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocked band's operands: (qc, kw, vw) = q scaled by 1/sqrt(D) in chunks
    (B, H, nc, c, D), each chunk's key span as (B, H, nc, D, L) and value span as
    (B, H, nc, L, D); the spans are `unfold` views of zero-padded keys and values."""
    B, H, N, D = q.shape
    nc = math.ceil(N / c)
    # Keys/values padded so chunk t's span starts at padded index t * c (= token t c - w).
    right = nc * c - N + (0 if causal else w)
    kp = F.pad(k, (0, 0, w, right))  # (B, H, w + nc c [+ w], D)
    vp = F.pad(v, (0, 0, w, right))
    kw = kp.unfold(2, L, c)  # (B, H, nc, D, L): a view, no copy
    vw = vp.unfold(2, L, c).transpose(-1, -2)  # (B, H, nc, L, D)
    # The scale goes on q (N D products) rather than on the scores (N L).  (B, H, nc, c, D)
    qc = F.pad(q * softmax_scale(D), (0, 0, 0, nc * c - N)).view(B, H, nc, c, D)
    return qc, kw, vw


def band_drop_mask(N: int, w: int, c: int, L: int, causal: bool) -> torch.Tensor:
    """Bool (nc, c, L), CPU: True where a chunk's span column is masked.

    Query row a of chunk t is token t c + a; span column b is token t c - w + b, so
    j - i = b - a - w. Masked: outside the band (causal: j > i) or a padded key. The
    diagonal (b = a + w) is kept even for padded query rows, so that no row is all
    -inf (which would put NaN in the backward pass).
    """
    nc = math.ceil(N / c)
    rel = torch.arange(L)[None, :] - torch.arange(c)[:, None] - w  # (c, L): j - i
    band = (rel >= -w) & (rel <= (0 if causal else w))
    tok = torch.arange(nc)[:, None] * c - w + torch.arange(L)  # (nc, L): key token
    real = (tok >= 0) & (tok < N)
    return ~(band & (real[:, None, :] | (rel == 0)))


def group_chunks(B: int, H: int, c: int, L: int, element_size: int) -> int:
    """Chunks per group, so that one group's (B, H, G, c, L) score block is cache-sized."""
    return max(1, _GROUP_BYTES // (B * H * c * L * element_size))


class MaskCache:
    """A few (key -> tensor) masks per module, oldest dropped first (each is O(N L) bytes)."""

    def __init__(self, size: int = _CACHED_MASKS):
        self.size, self._masks = size, {}

    def get(self, key: tuple, make) -> torch.Tensor:
        if key not in self._masks:
            if len(self._masks) >= self.size:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = make()
        return self._masks[key]


@register
class SlidingWindow(Variant):
    """Exact softmax attention restricted to a band |i - j| <= window (Longformer's local part)."""
    name = "sliding_window"
    family = "sliding_window"
    Params = SlidingWindowParams
    paper = "https://arxiv.org/abs/2004.05150"

    def __init__(self, params=None):
        super().__init__(params)
        self._masks = MaskCache()

    def key_mask(self, seq_len: int) -> KeyMask:
        return band_mask(self.params.window)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return window_covers(self.params.window, seq_len)

    def state_size(self, N, D):
        return 2 * min(self.params.window + 1, N) * D  # the cache of the window's keys, values

    def flops(self, B, H, N, D, causal=False):
        """FLOPs of the blocked scheme as computed: every chunk scores its whole key span.

        ceil(N / c) chunks x c queries x L keys, q k^T and p v: 4 c L D per chunk and head.
        This counts the work done (band plus the masked corners and padding of each block),
        not only the band's (2w + 1) keys per query; it is about (c + 2w) / (2w + 1) times
        the band count (causal: (c + w) / (w + 1)).
        """
        if N == 0:
            return 0
        _, c, L = band_span(self.params.window, N, causal)
        return 4 * B * H * math.ceil(N / c) * c * L * D

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        if N == 0:
            return q.clone()
        w, c, L = band_span(self.params.window, N, causal)
        # Small chunks (a narrow window) are taken G at a time, one matmul over (B H, G)
        # with the whole (G, c, L) mask; a chunk that fills a group on its own masks only
        # its corner runs.
        G = group_chunks(B, H, c, L, q.element_size())
        if G > 1:
            drop = self._masks.get((N, causal, q.device, "full"), lambda: band_drop_mask(
                N, w, c, L, causal).to(q.device))
        else:
            drop = self._masks.get((N, causal, q.device), lambda: mask_runs(band_drop_mask(
                N, w, c, L, causal), q.device))
        return _BandRows.apply(q, k, v, w, c, L, causal, drop, G)[:, :, :N]


def mask_runs(drop: torch.Tensor, device) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Per chunk, its masked span columns as runs (a, z, mask (c, z - a) on device): only
    the columns with a masked key, so an inner chunk masks its two corners (b < a and
    b > a + 2w), not its whole (c, L) block."""
    runs = []
    for d in drop:  # (c, L)
        cols = d.any(dim=0).tolist()
        chunk, a = [], None
        for j, m in enumerate(cols + [False]):
            if m and a is None:
                a = j
            elif not m and a is not None:
                chunk.append((a, j, d[:, a:j].contiguous().to(device)))
                a = None
        runs.append(chunk)
    return runs


def _spans(x3: torch.Tensor, t0: int, G: int, c: int, L: int) -> torch.Tensor:
    """Chunks t0 .. t0 + G - 1's key spans of x3 (B H, rows, D) as one overlapping view
    (B H, G, L, D): chunk t's span is rows [t c, t c + L)."""
    BH, _, D = x3.shape
    return x3.as_strided((BH, G, L, D), (x3.stride(0), c * D, D, 1),
                         x3.storage_offset() + t0 * c * D)


def _grouped_forward(q3, k3, v3, o3, lse3, c: int, L: int, drop: torch.Tensor, G: int,
                     ws: Workspace) -> None:
    """The forward G chunks at a time: one (B H, G, c, L) score block a group (matmul
    copies the overlapping spans once), masked by the whole (G, c, L) drop mask."""
    BH, P, D = q3.shape
    nc = P // c
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * c, (t0 + g) * c)
        s = torch.matmul(q3[:, rows].view(BH, g, c, D), _spans(k3, t0, g, c, L).transpose(-1, -2),
                         out=ws("s", BH, g, c, L))
        s.masked_fill_(drop[t0:t0 + g], float("-inf"))
        if lse3 is not None:
            lse3[:, rows] = softmax_lse_(s).view(BH, g * c, 1)
        else:
            softmax_(s)
        o3[:, rows] = torch.matmul(s, _spans(v3, t0, g, c, L), out=ws("o", BH, g, c, D)).view(
            BH, g * c, D)


def _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c: int, L: int,
                      drop: torch.Tensor, G: int, ws: Workspace) -> None:
    """The backward G chunks at a time, as `_grouped_forward`; each chunk's key and value
    gradients are added into its span one chunk after another (the spans overlap)."""
    BH, P, D = q3.shape
    nc = P // c
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * c, (t0 + g) * c)
        qt, do = q3[:, rows].view(BH, g, c, D), do3[:, rows].view(BH, g, c, D)
        ks, vs = _spans(k3, t0, g, c, L), _spans(v3, t0, g, c, L)
        s = torch.matmul(qt, ks.transpose(-1, -2), out=ws("s", BH, g, c, L))
        s.masked_fill_(drop[t0:t0 + g], float("-inf"))
        p = exp_(s.sub_(lse3[:, rows].view(BH, g, c, 1)))  # the forward's probabilities
        dvs = torch.matmul(p.transpose(-1, -2), do, out=ws("dv", BH, g, L, D))
        ds = torch.matmul(do, vs.transpose(-1, -2), out=ws("ds", BH, g, c, L))
        ds.sub_(delta3[:, rows].view(BH, g, c, 1)).mul_(p)
        dq3[:, rows] = torch.matmul(ds, ks, out=ws("dq", BH, g, c, D)).view(BH, g * c, D)
        dks = torch.matmul(ds.transpose(-1, -2), qt, out=ws("dk", BH, g, L, D))
        for j in range(g):
            span = slice((t0 + j) * c, (t0 + j) * c + L)
            dk3[:, span] += dks[:, j]
            dv3[:, span] += dvs[:, j]


class _BandRows(torch.autograd.Function):
    """Exact softmax attention of each c-row query chunk over its contiguous key span.

    q, k, v: (B, H, N, D); returns (B, H, nc c, D), the rows past N padding. Chunk t's
    keys and values are rows [t c, t c + L) of the zero-padded k and v: a view (one
    batched matmul per chunk over B H, no copy of the overlapping spans). The backward
    recomputes each chunk's probabilities from one log-sum-exp per query (FlashAttention's
    recomputation, Dao et al. 2022, https://arxiv.org/abs/2205.14135, Algorithm 4 without
    tiling) and adds each span's key and value gradients into the padded gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, c, L, causal, drop, G):
        B, H, N, D = q.shape
        nc = math.ceil(N / c)
        # Keys/values padded so chunk t's span starts at padded row t c (= token t c - w).
        right = nc * c - N + (0 if causal else w)
        # Contiguous (F.pad with nothing to pad may return its input, strided): the chunks
        # are slices of (B H, rows, D) views, and the gradients' layouts follow these.
        kp = F.pad(k, (0, 0, w, right)).contiguous()  # (B, H, (nc - 1) c + L, D)
        vp = F.pad(v, (0, 0, w, right)).contiguous()
        # The scale goes on q (N D products) rather than on the scores (N L).
        qc = q.new_zeros(B, H, nc * c, D) if nc * c > N else q.new_empty(B, H, N, D)
        torch.mul(q, softmax_scale(D), out=qc[:, :, :N])
        out = q.new_empty(B, H, nc * c, D)
        keep = any(ctx.needs_input_grad[:3])  # else nothing is saved: no log-sum-exp needed
        if keep:
            # float32 at least: a bfloat16 lse would shift every recomputed probability.
            lse = q.new_empty(B, H, nc * c, 1, dtype=torch.promote_types(q.dtype, torch.float32))
        # (B H, rows, D) views: chunk t's queries, key span and output rows are slices of
        # them, so each chunk is one bmm over B H with no copy; the scores go into one
        # workspace buffer that every chunk reuses.
        BH = B * H
        q3, k3, v3, o3 = (t.view(BH, -1, D) for t in (qc, kp, vp, out))
        lse3 = lse.view(BH, -1, 1) if keep else None
        if G > 1:
            _grouped_forward(q3, k3, v3, o3, lse3, c, L, drop, G, Workspace(q))
        else:
            s = Workspace(q)("s", BH, c, L)
            for t in range(nc):
                rows, span = slice(t * c, (t + 1) * c), slice(t * c, t * c + L)
                torch.bmm(q3[:, rows], k3[:, span].transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s[..., a:z].masked_fill_(m, float("-inf"))
                if keep:
                    lse3[:, rows] = softmax_lse_(s)
                else:
                    softmax_(s)
                torch.bmm(s, v3[:, span], out=o3[:, rows])
        if keep:
            ctx.band = (w, c, L, N, drop, G)
            ctx.save_for_backward(qc, kp, vp, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qc, kp, vp, out, lse = ctx.saved_tensors
        w, c, L, N, drop, G = ctx.band
        D = qc.shape[-1]
        nc = math.ceil(N / c)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, H, nc c, 1): rowsum(dO * O)
        dq = torch.empty_like(qc)
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
        BH = qc.shape[0] * qc.shape[1]
        q3, k3, v3, do3, dq3, dk3, dv3 = (t.view(BH, -1, D) for t in (qc, kp, vp, dout, dq,
                                                                      dk, dv))
        lse3, delta3 = lse.view(BH, -1, 1), delta.view(BH, -1, 1)
        ws = Workspace(qc)
        if G > 1:
            _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c, L, drop, G, ws)
        else:
            s, ds = ws("s", BH, c, L), ws("ds", BH, c, L)
            for t in range(nc):
                rows, span = slice(t * c, (t + 1) * c), slice(t * c, t * c + L)
                qt, do = q3[:, rows], do3[:, rows]  # (B H, c, D)
                ks, vs = k3[:, span], v3[:, span]  # (B H, L, D)
                torch.bmm(qt, ks.transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s[..., a:z].masked_fill_(m, float("-inf"))
                p = exp_(s.sub_(lse3[:, rows]))  # the forward's probabilities
                dv3[:, span].baddbmm_(p.transpose(1, 2), do)
                torch.bmm(do, vs.transpose(1, 2), out=ds).sub_(delta3[:, rows]).mul_(p)
                torch.bmm(ds, ks, out=dq3[:, rows])
                dk3[:, span].baddbmm_(ds.transpose(1, 2), qt)
        dq = dq[:, :, :N].mul_(softmax_scale(D))
        return dq, dk[:, :, w:w + N], dv[:, :, w:w + N], None, None, None, None, None, None
