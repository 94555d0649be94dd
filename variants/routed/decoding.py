"""The decoding form of `moba` and `quest`: per step, score the blocks (pages) of the
cache and read only the chosen ones.

The state is the key-value cache and a statistic per block of it, kept as tokens arrive:
MoBA's key sums (a complete block's mean is its sum over b), Quest's elementwise key min
and max. A new token i joins its own block; its gate scores the blocks wholly before it
(complete, so their statistics are those the causal forward uses) and it attends, exactly,
to its own block's keys up to i and those of the top kk - 1 earlier blocks, kk =
min(top_k, blocks of the whole sequence): the causal rule of `routing.top_blocks`, one
row at a time, in O(nb D + kk b D) per step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..core import KVCache, softmax_scale
from .routing import block_count


@dataclasses.dataclass
class BlockStatsCache(KVCache):
    """The cache and per-block statistics (B, H, nb, D): sums (MoBA) or lo and hi (Quest)."""
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    kk: int = 1

    def mark(self):
        return self.n, self.lo.clone(), None if self.hi is None else self.hi.clone()

    def rewind(self, mark) -> None:
        self.n = mark[0]
        self.lo.copy_(mark[1])
        if self.hi is not None:
            self.hi.copy_(mark[2])


class BlockDecoding:
    """Mixed into `BlockRouted`; `block_stat` says what a block keeps: "sum" or "bounds"."""
    block_stat: ClassVar[str] = "sum"

    def decode_read_size(self, N, D):
        """A step reads the statistics of every block and the keys and values of kk."""
        b, nb = self.block, block_count(N, self.block)
        kk = min(self.params.top_k, nb)
        return nb * D * (1 if self.block_stat == "sum" else 2) + 2 * min(kk * b, N) * D

    def decode_prefill(self, k, v, max_len):
        B, H, N, D = k.shape
        nb = block_count(max_len, self.block)
        cache = KVCache.prefill(k[:, :, :0], v[:, :, :0], max_len)
        if self.block_stat == "sum":
            lo, hi = k.new_zeros(B, H, nb, D), None
        else:
            lo = k.new_full((B, H, nb, D), float("inf"))
            hi = k.new_full((B, H, nb, D), float("-inf"))
        state = BlockStatsCache(cache.k, cache.v, 0, lo, hi,
                                min(self.params.top_k, nb))
        return self.decode_extend(state, k, v)

    def decode_extend(self, state, k, v):
        b, r = self.block, k.shape[-2]
        blocks = torch.arange(state.n, state.n + r, device=k.device) // b  # (r,)
        idx = blocks[None, None, :, None].expand_as(k)
        if self.block_stat == "sum":
            state.lo.scatter_add_(2, idx, k)
        else:
            state.lo.scatter_reduce_(2, idx, k, "amin")
            state.hi.scatter_reduce_(2, idx, k, "amax")
        state.extend(k, v)
        return state

    def decode_step(self, state, q, k, v):
        i, b = state.n, self.block
        self.decode_extend(state, k, v)
        own = i // b
        B, H = q.shape[:2]
        chosen = torch.full((B, H, 1), own, dtype=torch.long, device=q.device)
        m = min(state.kk - 1, own)
        if m > 0:  # the best earlier blocks by the gate, all of them complete
            if self.block_stat == "sum":
                scores = q @ (state.lo[:, :, :own] / b).transpose(-1, -2)  # (B, H, 1, own)
            else:
                scores = (q.clamp(min=0) @ state.hi[:, :, :own].transpose(-1, -2)
                          + q.clamp(max=0) @ state.lo[:, :, :own].transpose(-1, -2))
            chosen = torch.cat([chosen, scores[:, :, 0].topk(m, dim=-1).indices], dim=-1)
        keys = (chosen[..., None] * b + torch.arange(b, device=q.device)).flatten(2)  # (B, H, L)
        later = keys > i  # the own block's keys after i (and past the cache's end)
        gather = keys.clamp(max=i)[..., None].expand(-1, -1, -1, q.shape[-1])
        K, V = state.k.gather(2, gather), state.v.gather(2, gather)  # (B, H, L, D)
        s = (q * softmax_scale(q.shape[-1])) @ K.transpose(-1, -2)  # (B, H, 1, L)
        s = s.masked_fill(later[:, :, None, :], float("-inf"))
        return torch.softmax(s, dim=-1) @ V, state
