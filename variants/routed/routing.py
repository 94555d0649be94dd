"""Which key blocks each query reads: block statistics, gate scores in query chunks, the
top-k rule with its causal form. No autograd: the selection is not differentiated.

A selection is a long tensor (B, H, N, kk), kk = min(top_k, number of blocks): the chosen
block indices of each query, best gate score first; causal: the query's own block first,
then up to kk - 1 earlier blocks, -1 filling a row with fewer candidates (the first blocks
of the sequence). Gate scores (B, H, c, nb) exist one query chunk at a time, so memory
is O(N kk) for the selection plus one chunk, whatever N.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

# Bytes of one query chunk's (B, H, c, nb) gate scores.
_GATE_BYTES = 8 * 2**20


def block_count(N: int, b: int) -> int:
    return math.ceil(N / b)


def block_means(k: torch.Tensor, b: int) -> torch.Tensor:
    """Mean key of each block of b tokens, (B, H, nb, D); a partial last block's mean is
    over its actual keys (the zero padding is summed, then divided by the true count)."""
    B, H, N, D = k.shape
    nb = block_count(N, b)
    kp = F.pad(k, (0, 0, 0, nb * b - N)).view(B, H, nb, b, D)
    counts = torch.full((nb, 1), float(b), dtype=k.dtype, device=k.device)
    counts[-1] = N - (nb - 1) * b
    return kp.sum(dim=3) / counts


def block_bounds(k: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of each block's keys, (B, H, nb, D) each; a partial last
    block's over its actual keys (padding is +inf for the min, -inf for the max)."""
    B, H, N, D = k.shape
    nb = block_count(N, b)
    pad = nb * b - N
    lo = F.pad(k, (0, 0, 0, pad), value=float("inf")).view(B, H, nb, b, D).amin(dim=3)
    hi = F.pad(k, (0, 0, 0, pad), value=float("-inf")).view(B, H, nb, b, D).amax(dim=3)
    return lo, hi


def grouped_scores(qc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """qc (B, Hq, c, D) against a kv head's block statistics stats (B, Hk, D, nb), Hk
    dividing Hq (query head h reads kv head h // (Hq / Hk)): (B, Hq, c, nb). The r query
    heads of a kv head are r c rows of one product; the statistics are never repeated."""
    B, Hq, c, D = qc.shape
    Hk = stats.shape[1]
    if Hk == Hq:
        return qc @ stats
    return (qc.reshape(B, Hk, Hq // Hk * c, D) @ stats).view(B, Hq, c, stats.shape[-1])


def top_blocks(gate: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, nb: int,
               b: int, top_k: int, causal: bool) -> torch.Tensor:
    """Each query's top_k blocks by gate(q chunk (B, H, c, D)) -> scores (B, H, c, nb).

    Non-causal: the top min(top_k, nb) blocks. Causal: the query's own block always, and
    the best top_k - 1 of the blocks that end before it (a block starting at or before
    the query is either its own or wholly before it); -1 where there are fewer.
    """
    B, H, N, _ = q.shape
    kk = min(top_k, nb)
    sel = torch.empty(B, H, N, kk, dtype=torch.long, device=q.device)
    c = max(1, min(N, _GATE_BYTES // (4 * B * H * nb)))
    cols = torch.arange(nb, device=q.device)
    for s in range(0, N, c):
        e = min(N, s + c)
        with torch.no_grad():
            g = gate(q[:, :, s:e])  # (B, H, c, nb)
        if not causal:
            sel[:, :, s:e] = g.topk(kk, dim=-1).indices
            continue
        own = torch.arange(s, e, device=q.device) // b  # (c,)
        sel[:, :, s:e, 0] = own
        if kk > 1:
            g.masked_fill_(cols >= own[:, None], float("-inf"))  # only earlier blocks
            val, idx = g.topk(kk - 1, dim=-1)
            sel[:, :, s:e, 1:] = idx.masked_fill_(val == float("-inf"), -1)
    return sel


def selected_keys(sel: torch.Tensor, b: int, N: int, causal: bool) -> torch.Tensor:
    """The dense bool (B, H, N, N) mask of a block selection (and j <= i when causal):
    for `weights`, small checks, and the dense form of short sequences (blocks.DENSE_MAX)."""
    B, H, _, kk = sel.shape
    nb = block_count(N, b)
    blocks = torch.zeros(B, H, N, nb + 1, dtype=torch.bool, device=sel.device)
    blocks.scatter_(-1, sel.masked_fill(sel < 0, nb), True)  # -1 lands in the spare column
    allowed = blocks[..., :nb].repeat_interleave(b, dim=-1)[..., :N]
    if causal:
        allowed &= torch.ones(N, N, dtype=torch.bool, device=sel.device).tril()
    return allowed


def selected_rows(sel: torch.Tensor, rows: torch.Tensor, b: int, N: int,
                  causal: bool) -> torch.Tensor:
    """The bool (B, H, R, N) keys of query positions `rows` (R,) under their block
    selection sel (B, H, R, kk) (-1: none), and j <= i when causal: one row's mask at a
    time for the Sparse Frontier's mass, O(R N) whatever the sequence."""
    B, H, R, kk = sel.shape
    nb = block_count(N, b)
    blocks = torch.zeros(B, H, R, nb + 1, dtype=torch.bool, device=sel.device)
    blocks.scatter_(-1, sel.masked_fill(sel < 0, nb), True)
    allowed = blocks[..., :nb].repeat_interleave(b, dim=-1)[..., :N]
    if causal:
        allowed &= torch.arange(N, device=sel.device)[None, :] <= rows.to(sel.device)[:, None]
    return allowed
