"""The exact decoder: one new query row over a key-value cache, softmax(q K^T / sqrt(D)) V,
for every exact variant (`standard`, `sdpa`, `xformers`).

A step at a long context is a read of the cache and nothing else: 2 n D numbers a head
for 4 n D FLOPs, so its time is the time to stream the cache once. It is three passes,
each laid out for that:

    s = q K^T / sqrt(D)      # K (B, H, L, D) as it arrives: n dots of D contiguous numbers
    p = softmax(s)           # in place, in a buffer preallocated to L (no page faults)
    o = p V / sum p          # V kept transposed, (B, H, D, L): D long dots over n,
                             #   one gemv a head at the longest contexts

Each layout was chosen against the others by interleaved A/B timings in one process (B =
1, H = 8, D = 64, float32, 512K and 1M tokens, one and two threads), each pass's time
against a sum over the same bytes beside it; `tests/benchmarks/test_decode.py` times the
same alternatives on demand. q K^T over K as it arrives was no slower than over K stored
transposed; p V over V stored transposed (long dot products) was faster than over V as
it arrives; a softmax into a fresh tensor of n numbers a head had its pages faulted in
on every call (the worker runs with glibc's mmap threshold at 64 KiB), which a kept
buffer does not; SDPA's CPU kernel tiles the keys for a block of queries, and with one
query row its small matrix products and exp pass cost more than the read.

Exact in any dtype: float32 and float64 run the three passes in their own dtype (the
scores in the cache's dtype, as SDPA's math path); a lower precision keeps V as it
arrives and runs SDPA over the cache, whose kernel keeps the scores in float32 (a
transposed V would be copied by it every step).

A cache stored narrower than the queries (`cache_dtype` bfloat16 or float8_e4m3fn,
`variants.core.cache_dtype`) keeps K and V as they arrive in that dtype (fp8 with a float32
scale per token row and head) and reads them back a chunk of tokens at a time: each
chunk's keys (then values) are converted into a buffer of `_CHUNK` numbers in the compute
dtype (float32; float64 for a float64 case), scaled, and multiplied there, so no
full-size copy of the cache in the compute dtype is ever made. The same two passes as
above: q K^T chunk by chunk into the scores buffer, the softmax in place, then p V
accumulated chunk by chunk.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core import DecodeState, cache_dtype, sinked, softmax_, softmax_scale

# Dtypes whose scores the three passes keep in the cache's own dtype.
_OWN_DTYPE = (torch.float32, torch.float64)
# Values (n D a head) from which the output is renormalised (16K tokens at D = 64): a
# short row's sum does not drift.
_RENORM_FROM = 1 << 20
# ... and from which V^T p runs as one torch.mv a head rather than one bmm (256K tokens at
# D = 64): at 1M tokens the loop of gemvs took less time than the batched product (a
# matrix product with one column), but each call is a parallel region, and where another
# process holds a core each region waits for it (at 16K-64K tokens on a busy machine the
# loop's calls cost more than they saved).
_MV_FROM = 1 << 24
# Numbers of one chunk of a narrow cache read back to the compute dtype (4 MiB in float32),
# across the batch and heads: big enough that a step at 1M tokens is a few hundred calls,
# small enough to stay in the CPU's caches between its conversion and its product.
_CHUNK = 1 << 20


@dataclasses.dataclass
class ExactCache(DecodeState):
    """Keys (B, H, L, D) and values, L = max_len, the first `n` tokens written; the values
    transposed, (B, H, D, L), where the three passes run (float32, float64), as they
    arrive otherwise. A scores buffer of B H L numbers goes with it (not state: it holds
    nothing between steps, and is not counted in `nbytes`).

    `stored`: the cache dtype name (`cache_dtype`) where it narrows the keys' dtype; then K
    and V are kept as they arrive in that dtype, and, for fp8, `k_scale` and `v_scale`
    (B, H, L) float32, one a token row and head (counted in `nbytes`: they are state)."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    n: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    stored: str = ""

    def __post_init__(self):
        B, H, L, _ = self.k.shape
        self.transposed = self.k.dtype in _OWN_DTYPE and not self.stored
        # B H L numbers, grown to B Hq L on the first step of grouped queries.
        self.scores = self.k.new_empty(B * H * L if self.transposed else 0)
        self.chunk = None  # a narrow cache's read-back buffer, made on the first step

    @classmethod
    def prefill(cls, k: torch.Tensor, v: torch.Tensor, max_len: int,
                stored: str = "float32") -> "ExactCache":
        B, H, N, D = k.shape
        Dv = v.shape[-1]
        if cache_dtype.narrows(stored, k.dtype):
            dtype = cache_dtype.torch_dtype(stored)
            scales = ((k.new_empty(B, H, max_len, dtype=torch.float32),
                       k.new_empty(B, H, max_len, dtype=torch.float32))
                      if cache_dtype.scaled(stored) else (None, None))
            state = cls(k.new_empty(B, H, max_len, D, dtype=dtype),
                        v.new_empty(B, H, max_len, Dv, dtype=dtype), 0, *scales, stored)
            state.extend(k, v)
            return state
        shape = (B, H, Dv, max_len) if k.dtype in _OWN_DTYPE else (B, H, max_len, Dv)
        state = cls(k.new_empty(B, H, max_len, D), v.new_empty(shape), 0)
        state.extend(k, v)
        return state

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (B, H, r, D) keys and values after those held, in place."""
        r, n = k.shape[-2], self.n
        if n + r > self.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {self.k.shape[-2]} tokens")
        if self.stored:
            for x, out, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
                q, s = cache_dtype.quantise(x, self.stored)
                out[:, :, n:n + r] = q
                if scale is not None:
                    scale[:, :, n:n + r] = s
            self.n += r
            return
        self.k[:, :, n:n + r] = k
        if self.transposed:
            self.v[:, :, :, n:n + r] = v.transpose(-1, -2)
        else:
            self.v[:, :, n:n + r] = v
        self.n += r

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.n]  # (B, H, n, D), a view

    def values(self) -> torch.Tensor:
        """(B, H, n, D), a view (strided where the values are kept transposed)."""
        if self.transposed:
            return self.v[:, :, :, :self.n].transpose(-1, -2)
        return self.v[:, :, :self.n]

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens are overwritten by the next writes

    def attend(self, q: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The row of one query q (B, Hq, 1, D) over the n cached tokens of the Hk heads it
        holds (query head h reads head h // (Hq / Hk): grouped keys, never repeated):
        (B, Hq, 1, Dv). sinks: a logit per query head (Hq,) in the row's denominator
        (gpt-oss's sinks), applied to the output from the row's log-sum-exp."""
        if self.stored:
            return self._attend_stored(q, sinks)
        if not self.transposed:
            B, Hq, _, D = q.shape
            H = self.k.shape[1]
            if sinks is None:
                # The g query heads of a cached head as g rows of one head (every row
                # reads every cached token): the cache is never repeated.
                o = F.scaled_dot_product_attention(q.reshape(B, H, Hq // H, D), self.keys(),
                                                   self.values())
                return o.reshape(B, Hq, 1, -1)
            # The same rows; the fused CPU kernel returns their log-sum-exp for the sink.
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.reshape(B, H, Hq // H, D), self.keys(), self.values(), 0.0, False,
                scale=softmax_scale(D))
            o = o.reshape(B, Hq, 1, -1)
            return sinked(o, lse.reshape(B, Hq, 1, 1), sinks)[0]
        B, Hq, _, D = q.shape
        H, Dv, n = self.k.shape[1], self.v.shape[-2], self.n
        g = Hq // H  # query rows a cached head serves
        if self.scores.numel() < B * Hq * self.k.shape[-2]:
            self.scores = q.new_empty(B * Hq * self.k.shape[-2])
        K = self.k[:, :, :n].reshape(B * H, n, D)  # a view: B and H merge
        Vt = self.v[:, :, :, :n].reshape(B * H, Dv, n)
        s = self.scores[:B * Hq * n].view(B * H, g, n)  # contiguous, written in place
        torch.baddbmm(s, q.reshape(B * H, g, D), K.transpose(1, 2), beta=0,
                      alpha=softmax_scale(D), out=s)  # q K^T / sqrt(D), one call
        top = s.amax(dim=-1) if sinks is not None else None  # (B H, g)
        softmax_(s)  # aten's fused kernel: one parallel region, its sum in SIMD lanes
        o = self._weighted(q, s, Vt)  # (B, Hq, 1, Dv)
        if sinks is None:
            return o
        # The row's log-sum-exp from its largest score and weight: max(s) - log(max(p)).
        lse = top.sub_(s.amax(dim=-1).log_()).view(B, Hq, 1, 1)
        return sinked(o, lse, sinks)[0]

    def _weighted(self, q: torch.Tensor, s: torch.Tensor, Vt: torch.Tensor) -> torch.Tensor:
        """p V for the weights s (B H, g, n) over the values Vt (B H, Dv, n): (B, Hq, 1, Dv)."""
        B, Hq = q.shape[:2]
        BH, g, n = s.shape
        Dv = Vt.shape[1]
        if n * Dv < _RENORM_FROM:  # a short row: few calls matter more than the lanes' drift
            o = torch.bmm(Vt, s.transpose(1, 2))  # (B H, Dv, g)
            return o.transpose(1, 2).reshape(B, Hq, 1, Dv)
        # The lanes' sums drift over a long sharp row (at 256K keys, 3-4x SDPA's error
        # against float64); torch.sum's cascade sum of the weights gives the row's sum
        # again, and the output is divided by it (one more read of the weights).
        den = s.sum(dim=-1)  # (B H, g), 1 to rounding
        if n * Dv < _MV_FROM or g > 1:
            o = torch.bmm(Vt, s.transpose(1, 2)).transpose(1, 2)  # (B H, g, Dv)
        else:
            o = q.new_empty(BH, 1, Dv)
            for i in range(BH):  # one matrix-vector product a head: BLAS's gemv
                torch.mv(Vt[i], s[i, 0], out=o[i, 0])
        return o.div_(den[..., None]).reshape(B, Hq, 1, Dv)

    def _attend_stored(self, q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """`attend` over a narrow cache: the keys, then the values, read back a chunk of
        tokens at a time into one buffer in the compute dtype (the queries' dtype; float32
        for a narrower one), never the whole cache at once."""
        B, Hq, _, D = q.shape
        H, L, n, Dv = self.k.shape[1], self.k.shape[-2], self.n, self.v.shape[-1]
        g, BH = Hq // H, B * H
        work = q.dtype if q.dtype in _OWN_DTYPE else torch.float32
        c = max(64, _CHUNK // (BH * max(D, Dv)))  # tokens a chunk
        if self.chunk is None or self.chunk.dtype != work:
            self.chunk = q.new_empty(BH * c * max(D, Dv), dtype=work)
        if self.scores.numel() < B * Hq * L or self.scores.dtype != work:
            self.scores = q.new_empty(B * Hq * L, dtype=work)
        s = self.scores[:B * Hq * n].view(BH, g, n)
        qg = q.to(work).reshape(BH, g, D)
        K, V = self.k.view(BH, L, D), self.v.view(BH, L, Dv)
        ks = None if self.k_scale is None else self.k_scale.view(BH, L)
        vs = None if self.v_scale is None else self.v_scale.view(BH, L)
        for a in range(0, n, c):
            b = min(a + c, n)
            Kc = cache_dtype.dequantise_(self.chunk[:BH * (b - a) * D].view(BH, b - a, D),
                                         K[:, a:b], None if ks is None else ks[:, a:b])
            s[:, :, a:b] = torch.bmm(qg, Kc.transpose(1, 2)).mul_(softmax_scale(D))
        top = s.amax(dim=-1) if sinks is not None else None  # (B H, g)
        softmax_(s)
        o = qg.new_zeros(BH, g, Dv)
        for a in range(0, n, c):
            b = min(a + c, n)
            Vc = cache_dtype.dequantise_(self.chunk[:BH * (b - a) * Dv].view(BH, b - a, Dv),
                                         V[:, a:b], None if vs is None else vs[:, a:b])
            o.baddbmm_(s[:, :, a:b], Vc)
        if n * Dv >= _RENORM_FROM:  # as `_weighted`: the lanes' sums drift over a long row
            o.div_(s.sum(dim=-1)[..., None])
        o = o.reshape(B, Hq, 1, Dv)
        if sinks is not None:
            lse = top.sub_(s.amax(dim=-1).log_()).view(B, Hq, 1, 1)
            o = sinked(o, lse, sinks)[0]
        return o.to(q.dtype)
