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

The chunks run in `band_rows.py`, forward and a recomputing backward.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..core import (Contract, CacheDecoder, Grouping, KeyMask, RingKV, Sinks, Variant,
                    attend_row, param, register, sink_param, softmax_scale)
from .band_rows import band_rows_attention

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
class BandParams:
    window: int = param(256, doc="keys on each side a query sees (|i - j| <= window)", min=0)


@dataclasses.dataclass(frozen=True)
class SlidingWindowParams(BandParams):
    """The band's window, and gpt-oss's sinks (its windowed layer is
    `sliding_window(window=127, sink=true)`: keys i - 127 .. i)."""
    sink: bool = sink_param()


def in_band(i: torch.Tensor, j: torch.Tensor, window: int) -> torch.Tensor:
    """i - window <= j <= i + window, elementwise over broadcast index tensors."""
    d = j - i
    return (d >= -window) & (d <= window)


def band_mask(window: int) -> KeyMask:
    """The key predicate i - window <= j <= i + window, as a KeyMask ([c], [n] -> [c, n])."""
    def allowed(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return in_band(i[:, None], j[None, :], window)  # (c, n)
    return allowed


def band_keys(window: int, N: int, causal: bool) -> float:
    """Mean keys a query sees in the band at length N (fewer near the ends)."""
    i = torch.arange(N, dtype=torch.float64)
    lo = (i - window).clamp(min=0)
    hi = i if causal else (i + window).clamp(max=N - 1)
    return float((hi - lo + 1).mean()) if N else 0.0


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


class SameBand:
    """Mixin of another library's implementation of the band: sliding_window's parameters,
    its key pattern, exactness, state and budget. List it before the implementation's
    base class."""
    family = "sliding_window"
    Params = BandParams
    contract = Contract(exactness="pattern")

    def key_mask(self, seq_len: int) -> KeyMask:
        return band_mask(self.params.window)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return window_covers(self.params.window, seq_len)

    def state_size(self, N, D):
        return 2 * min(self.params.window + 1, N) * D  # the window's keys and values

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        return band_keys(self.params.window, N, causal)


@register
class SlidingWindow(Sinks, CacheDecoder, Variant):
    """Exact softmax attention restricted to a band |i - j| <= window (Longformer's local part)."""
    name = "sliding_window"
    family = "sliding_window"
    Params = SlidingWindowParams
    # Grouped keys run natively: the band kernel takes a key-value head's query heads as
    # rows of one matmul (band_rows.py), the decoder's ring holds one key and value per
    # key-value head and `attend_row` reads it the same way.
    contract = Contract(exactness="pattern", decoding=True, extend=True,
                        grouping=Grouping("kv", "native", value_dim=True))
    paper = "https://arxiv.org/abs/2004.05150"

    def __init__(self, params=None):
        super().__init__(params)
        self._masks = MaskCache()

    def key_mask(self, seq_len: int) -> KeyMask:
        return band_mask(self.params.window)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return window_covers(self.params.window, seq_len)

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        return band_keys(self.params.window, N, causal)

    def state_size(self, N, D):
        return 2 * min(self.params.window + 1, N) * D  # the cache of the window's keys, values

    def state_size_at(self, N, s):
        return s.Hk * min(self.params.window + 1, N) * (s.D + s.Dv)  # a ring per kv head

    def decode_flops_at(self, N, s):
        return self.softmax_step_flops(min(self.params.window + 1, N), s)  # the ring's keys

    def decode_prefill(self, k, v, max_len, sinks=None):
        # Query i sees i - window .. i: a ring of the last window + 1 keys and values.
        return RingKV.prefill(k, v, min(self.params.window + 1, max(max_len, 1)))

    def decode_step(self, state, q, k, v, sinks=None):
        state.append(k, v)
        o = attend_row(q, state.keys(), state.values(), sinks=sinks)
        return o, state  # (B, Hq, 1, D)

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

    def attend(self, q, k, v, causal, sinks=None):
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
        return band_rows_attention(q, k, v, w, c, L, causal, drop, G, sinks)[:, :, :N]


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
