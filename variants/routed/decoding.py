"""The decoding form of `moba` and `quest`: per step, score the blocks (pages) of the
cache and read only the chosen ones.

The state is the key-value cache and a statistic per block of it, kept as tokens arrive
in the dtype the attention computes in (float32 for bfloat16, as the forward's gate):
MoBA's key sum while a block fills, turned into its mean once, when its last key arrives;
Quest's elementwise key min and max. A new token i joins its own block; its gate scores
the blocks wholly before it (complete, so their statistics are those the causal forward
uses: a step reads them in place, no copy) and it attends, exactly, to its own block's
keys up to i and those of the top kk - 1 earlier blocks, kk = min(top_k, blocks of the
whole sequence): the causal rule of `routing.top_blocks`, one row at a time, in O(nb D +
kk b D) per step, the chosen keys and values cast to the compute dtype as the forward's
kernel casts them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..core import KVCache, compute_dtype, softmax_scale
from .routing import block_count


@dataclasses.dataclass
class BlockStatsCache(KVCache):
    """The cache and per-block statistics (B, Hk, nb, D) in the compute dtype, one per kv
    head: MoBA's means of complete blocks (the sum of the filling one) in `lo`, or Quest's
    min and max in `lo` and `hi`; `b` keys a block, `kk` blocks a step reads. Not state
    (built once, not counted in `nbytes`): `offsets`, the b positions of a block, and
    `rows`, each (batch, kv head)'s first row in the cache's (B Hk L, D) rows,
    (B, Hk, 1, 1)."""
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    kk: int = 1
    b: int = 1

    def mark(self):
        """The length and the statistics of the block it ends in: the only block a later
        token changes that already held a key (the later ones are reset)."""
        j = self.n // self.b
        part = lambda x: None if x is None else x[:, :, j:j + 1].clone()  # noqa: E731
        return self.n, part(self.lo), part(self.hi)

    def rewind(self, mark) -> None:
        n, lo, hi = mark
        j, end = n // self.b, block_count(self.n, self.b)
        for stat, saved, empty in ((self.lo, lo, 0.0 if self.hi is None else float("inf")),
                                   (self.hi, hi, float("-inf"))):
            if stat is not None and j < stat.shape[2]:
                stat[:, :, j + 1:end] = empty
                stat[:, :, j:j + 1] = saved
        self.n = n


class BlockDecoding:
    """Mixed into `BlockRouted`; `block_stat` says what a block keeps: "sum" or "bounds"."""
    block_stat: ClassVar[str] = "sum"

    def decode_read_size(self, N, D):
        """A step reads the statistics of every block and the keys and values of kk."""
        b, nb = self.block, block_count(N, self.block)
        kk = min(self.params.top_k, nb)
        return nb * D * (1 if self.block_stat == "sum" else 2) + 2 * min(kk * b, N) * D

    def decode_read_size_at(self, N, s):
        """Per kv head: the statistics of every block once (its r = Hq / Hk query heads
        score them in one product), and the keys (Dk) and values (Dv) of the blocks its
        query heads chose, each its own kk: at most r kk blocks, at most the N cached."""
        b, nb = self.block, block_count(N, self.block)
        kk, r = min(self.params.top_k, nb), s.H // s.Hk
        stats = nb * s.D * (1 if self.block_stat == "sum" else 2)
        return s.Hk * (stats + min(r * kk * b, N) * (s.D + s.Dv))

    def decode_flops_at(self, N, s):
        """`decode_step` at context N (the new token is token N, in block own = N // b):
        the gate against the own earlier, complete blocks (`gate_flops` D a block), then
        softmax over the b keys of each block read, the own one whole (its later keys are
        masked after they are scored); kk as `decode_read_size` counts it."""
        b = self.block
        own = N // b
        m = min(max(1, min(self.params.top_k, block_count(N, b))) - 1, own)
        gate = s.out_heads * self.gate_flops * s.D * own if m > 0 else 0
        return gate + self.softmax_step_flops((1 + m) * b, s)

    def decode_prefill(self, k, v, max_len):
        B, H, N, D = k.shape
        b, nb, cd = self.block, block_count(max_len, self.block), compute_dtype(k.dtype)
        cache = KVCache.prefill(k[:, :, :0], v[:, :, :0], max_len)
        if self.block_stat == "sum":
            lo, hi = k.new_zeros(B, H, nb, D, dtype=cd), None
        else:
            lo = k.new_full((B, H, nb, D), float("inf"), dtype=cd)
            hi = k.new_full((B, H, nb, D), float("-inf"), dtype=cd)
        state = BlockStatsCache(cache.k, cache.v, 0, lo, hi, min(self.params.top_k, nb), b)
        state.offsets = torch.arange(b, device=k.device)
        state.rows = (torch.arange(B * H, device=k.device) * max_len).view(B, H, 1, 1)
        return self.decode_extend(state, k, v)

    def decode_extend(self, state, k, v):
        b, r, n = self.block, k.shape[-2], state.n
        blocks = torch.arange(n, n + r, device=k.device) // b  # (r,)
        idx = blocks[None, None, :, None].expand_as(k)
        kc = k.to(state.lo.dtype)
        if self.block_stat == "sum":
            state.lo.scatter_add_(2, idx, kc)
            state.lo[:, :, n // b:(n + r) // b] /= b  # the blocks it completed: sums to means
        else:
            state.lo.scatter_reduce_(2, idx, kc, "amin")
            state.hi.scatter_reduce_(2, idx, kc, "amax")
        state.extend(k, v)
        return state

    def decode_step(self, state, q, k, v):
        """q (B, Hq, 1, D); k, v (B, Hk, 1, D | Dv) and a cache of Hk heads: query head h
        scores kv head h // r's blocks (r = Hq / Hk, the r heads as r rows of one
        product) and reads that head's chosen blocks, its own choice."""
        i, b = state.n, self.block
        self.decode_extend(state, k, v)
        own = i // b
        B, Hq, _, D = q.shape
        Hk, Dv = state.k.shape[1], state.v.shape[-1]
        r = Hq // Hk
        qc = q.to(state.lo.dtype).view(B, Hk, r, D)  # in the compute dtype
        chosen = torch.full((B, Hk, r, 1), own, dtype=torch.long, device=q.device)
        m = min(state.kk - 1, own)
        if m > 0:  # the best earlier blocks by the gate, all of them complete
            if self.block_stat == "sum":
                scores = qc @ state.lo[:, :, :own].transpose(-1, -2)  # (B, Hk, r, own)
            else:
                scores = (qc.clamp(min=0) @ state.hi[:, :, :own].transpose(-1, -2)
                          + qc.clamp(max=0) @ state.lo[:, :, :own].transpose(-1, -2))
            chosen = torch.cat([chosen, scores.topk(m, dim=-1).indices], dim=-1)
        keys = (chosen[..., None] * b + state.offsets).flatten(3)  # (B, Hk, r, L)
        later = keys > i  # the own block's keys after i (and past the cache's end)
        # Whole rows of the (B Hk max_len, D) cache by index_select: gather over dim 2, with
        # its index expanded over D, took twice as long and more (interleaved, 4096 blocks).
        at = (keys.clamp(max=i) + state.rows).flatten()
        K = state.k.view(-1, D).index_select(0, at).view(B, Hk, r, -1, D).to(qc.dtype)
        V = state.v.view(-1, Dv).index_select(0, at).view(B, Hk, r, -1, Dv).to(qc.dtype)
        s = (qc[..., None, :] * softmax_scale(D)) @ K.transpose(-1, -2)  # (B, Hk, r, 1, L)
        s = s.masked_fill(later[..., None, :], float("-inf"))
        return (torch.softmax(s, dim=-1) @ V).view(B, Hq, 1, Dv).to(q.dtype), state
