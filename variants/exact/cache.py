"""The exact decoder: one new query row over a key-value cache, softmax(q K^T / sqrt(D)) V,
for every exact variant (`standard`, `sdpa`, `xformers`).

A step at a long context is a read of the cache and nothing else: 2 n D numbers a head
for 4 n D FLOPs, so its time is the time to stream the cache once. It is three passes,
each laid out for that:

    s = q K^T / sqrt(D)      # K (B, H, L, D) as it arrives: n dots of D contiguous numbers
    p = softmax(s)           # in place, in a buffer preallocated to L (no page faults)
    o = p V = (V^T p^T)^T    # V kept transposed, (B, H, D, L): D long dots over n

What each layout was chosen against (B = 1, H = 8, D = 64, float32, N = 512K, one
thread, medians of 7 interleaved calls in one process, a shared and busy machine; rates
are bytes of the cache read over time, against a sum over the same tensor beside them,
22-25 GB/s): q K^T by one bmm over K as it is 11-18 GB/s, over K stored transposed
13-16; p V over V as it is 11-12 GB/s, over V stored transposed (long dots) 15-18;
torch.softmax into a fresh 32 MiB tensor 28 ms at N = 1M (its pages faulted in every
call: the worker runs with glibc's mmap threshold at 64 KiB), in place in a kept buffer
3 ms; SDPA over the cache 8.6-9.5 GB/s (its CPU kernel tiles the keys for a block of
queries; with one query row its small GEMMs and exp pass cost more than the read).

Exact in any dtype: float32 and float64 run the three passes in their own dtype (the
scores in the cache's dtype, as SDPA's math path); a lower precision runs SDPA over the
cache's views, whose kernel keeps the scores in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core import DecodeState, softmax_, softmax_scale

# Dtypes whose scores the three passes keep in the cache's own dtype.
_OWN_DTYPE = (torch.float32, torch.float64)


@dataclasses.dataclass
class ExactCache(DecodeState):
    """Keys (B, H, L, D) and values transposed (B, H, D, L), L = max_len, the first `n`
    tokens written. A scores buffer of B H L numbers goes with it (not state: it holds
    nothing between steps, and is not counted in `nbytes`)."""
    k: torch.Tensor
    vt: torch.Tensor
    n: int

    def __post_init__(self):
        B, H, L, _ = self.k.shape
        self.scores = self.k.new_empty(B * H * L)

    @classmethod
    def prefill(cls, k: torch.Tensor, v: torch.Tensor, max_len: int) -> "ExactCache":
        B, H, N, D = k.shape
        state = cls(k.new_empty(B, H, max_len, D), v.new_empty(B, H, D, max_len), 0)
        state.extend(k, v)
        return state

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (B, H, r, D) keys and values after those held, in place."""
        r = k.shape[-2]
        if self.n + r > self.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {self.k.shape[-2]} tokens")
        self.k[:, :, self.n:self.n + r] = k
        self.vt[:, :, :, self.n:self.n + r] = v.transpose(-1, -2)
        self.n += r

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.n]  # (B, H, n, D), a view

    def values(self) -> torch.Tensor:
        return self.vt[:, :, :, :self.n].transpose(-1, -2)  # (B, H, n, D), a strided view

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens are overwritten by the next writes

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """The row of one query q (B, H, 1, D) over the n cached tokens: (B, H, 1, D)."""
        if q.dtype not in _OWN_DTYPE:
            return F.scaled_dot_product_attention(q, self.keys(), self.values())
        B, H, _, D = q.shape
        n = self.n
        K = self.k[:, :, :n].reshape(B * H, n, D)  # a view: B and H merge
        Vt = self.vt[:, :, :, :n].reshape(B * H, D, n)
        s = self.scores[:B * H * n].view(B * H, 1, n)  # contiguous, written in place
        torch.bmm(q.reshape(B * H, 1, D) * softmax_scale(D), K.transpose(1, 2), out=s)
        softmax_(s)
        o = torch.bmm(Vt, s.transpose(1, 2))  # (B H, D, 1)
        return o.view(B, H, 1, D)
