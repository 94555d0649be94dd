"""DSA's plain form in float64, from the definition and independent of the kernels: the
dense (B, N, N) indexer scores, the top-k mask by a stable sort of each row read from its
last key back (so that of equal scores the later key ranks first), softmax over it.
Differentiable in q, k, v (autograd through the masked softmax)."""

from __future__ import annotations

import math

import torch


def index_scores(q, k, indexer, index_q=None, index_k=None, index_w=None):
    """The indexer's (B, N, N) float64 scores I(t, s), every pair (future ones too)."""
    if indexer == "lightning":
        a = torch.einsum("bjtd,bsd->bjts", index_q.double(), index_k[:, 0].double()).relu()
        return torch.einsum("bjts,bjt->bts", a, index_w.double())
    H, Hk = q.shape[1], k.shape[1]
    kr = k.double().repeat_interleave(H // Hk, dim=1)
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.relu().sum(dim=1)


def dsa_mask(q, k, top_k, indexer, **inputs):
    """(B, N, N) bool: key s of query t is among its min(top_k, t + 1) best by the
    indexer over s <= t, ties to the later s."""
    B, N = q.shape[0], q.shape[2]
    s = index_scores(q.detach(), k.detach(), indexer, **inputs)
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices
    keys = N - 1 - order  # best first, the later of equal scores first
    take = torch.arange(N)[None, :] < torch.arange(1, N + 1).clamp(max=top_k)[:, None]
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    return mask.scatter_(-1, keys, take.expand(B, N, N))


def dsa_reference(q, k, v, top_k, indexer="heads", **inputs):
    """float64 (B, Hq, N, Dv): softmax(q k^T / sqrt(D)) over `dsa_mask`, q (B, Hq, N, D),
    k (B, Hk, N, D), v (B, Hk, N, Dv), query head h reading key-value head h // (Hq / Hk)."""
    H, Hk = q.shape[1], k.shape[1]
    mask = dsa_mask(q, k, top_k, indexer, **inputs)
    kr, vr = (x.double().repeat_interleave(H // Hk, dim=1) for x in (k, v))
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1) @ vr
