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


# -- NSA (arXiv:2502.11089 Sec. 3), from the definition ---------------------------------

def _masked_softmax(s, allowed):
    """softmax over the allowed entries; 0 for a row with none."""
    s = s.masked_fill(~allowed, float("-inf"))
    some = allowed.any(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(~some, 0.0), dim=-1) * some


def nsa_compressed(x, block, stride):
    """(B, H, N, W) -> float64 (B, H, nc, W): block i the mean of tokens i d .. i d + l - 1,
    for every block wholly within N."""
    N = x.shape[2]
    starts = range(0, N - block + 1, stride) if N >= block else range(0)
    out = [x[:, :, s:s + block].double().mean(dim=2) for s in starts]
    return torch.stack(out, dim=2) if out else x[:, :, :0].double()


def nsa_compressed_probs(q, k, block, stride):
    """float64 (B, Hq, N, nc): query t's softmax over the compressed keys of the blocks
    ending at or before it (i d + l - 1 <= t), 0 where none has."""
    B, H, N, D = q.shape
    kc = nsa_compressed(k, block, stride).repeat_interleave(H // k.shape[1], dim=1)
    s = q.double() @ kc.transpose(-1, -2) / math.sqrt(D)
    ends = torch.arange(kc.shape[2]) * stride + block - 1
    return _masked_softmax(s, ends[None, :] <= torch.arange(N)[:, None])


def nsa_block_mask(q, k, block, stride, select_block, top_n):
    """(B, Hk, N, ns) bool: the selection blocks query t of each key-value group reads.
    Importance: the compressed probabilities summed over the group's query heads, each
    compressed block weighted by its overlap with the selection block in stride-long
    pieces; candidates the blocks starting at or before t; block 0, t // l' and
    t // l' - 1 forced; the min(top_n, t // l' + 1) best by a stable sort of each row read
    from its last block back (the later block first of equal ones)."""
    B, H, N, _ = q.shape
    Hk = k.shape[1]
    p = nsa_compressed_probs(q.detach(), k.detach(), block, stride)
    P = p.view(B, Hk, H // Hk, N, -1).sum(dim=2)
    nc, ns = P.shape[-1], -(-N // select_block)
    W = torch.zeros(nc, ns, dtype=torch.float64)
    for i in range(nc):
        for j in range(ns):
            lo, hi = max(i * stride, j * select_block), min(i * stride + block,
                                                            (j + 1) * select_block)
            W[i, j] = max(0, hi - lo) / stride
    imp = P @ W
    j = torch.arange(ns)
    cur = (torch.arange(N) // select_block)[:, None]
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    imp = torch.where(forced, float("inf"), imp.masked_fill(j > cur, float("-inf")))
    order = torch.sort(imp.flip(-1), dim=-1, descending=True, stable=True).indices
    blocks = ns - 1 - order
    take = j[None, :] < (cur + 1).clamp(max=top_n)
    mask = torch.zeros(B, Hk, N, ns, dtype=torch.bool)
    return mask.scatter_(-1, blocks, take.expand(B, Hk, N, ns))


def _branch_masks(q, k, block, stride, select_block, top_n, window):
    """(selected tokens (B, Hq, N, N), window (N, N)) bool, causal."""
    N, H, Hk = q.shape[2], q.shape[1], k.shape[1]
    t, s = torch.arange(N)[:, None], torch.arange(N)[None, :]
    blocks = nsa_block_mask(q, k, block, stride, select_block, top_n)
    sel = blocks[..., torch.arange(N) // select_block] & (s <= t)
    return sel.repeat_interleave(H // Hk, dim=1), (s <= t) & (s > t - window)


def nsa_branches(q, k, v, block, stride, select_block, top_n, window):
    """float64 (o_cmp, o_slc, o_win), each (B, Hq, N, Dv); differentiable in q, k, v."""
    H, Hk, D = q.shape[1], k.shape[1], q.shape[-1]
    vc = nsa_compressed(v, block, stride).repeat_interleave(H // Hk, dim=1)
    o_cmp = nsa_compressed_probs(q, k, block, stride) @ vc
    sel, win = _branch_masks(q, k, block, stride, select_block, top_n, window)
    kr, vr = (x.double().repeat_interleave(H // Hk, dim=1) for x in (k, v))
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(D)
    return o_cmp, _masked_softmax(s, sel) @ vr, _masked_softmax(s, win) @ vr


def nsa_reference(q, k, v, gate_cmp, gate_slc, gate_win, block, stride, select_block,
                  top_n, window):
    """float64 (B, Hq, N, Dv): the gated sum of the three branches (Eq. 5)."""
    o = nsa_branches(q, k, v, block, stride, select_block, top_n, window)
    return sum(g.double()[..., None] * x for g, x in zip((gate_cmp, gate_slc, gate_win), o))


def nsa_weights(q, k, gate_cmp, gate_slc, gate_win, block, stride, select_block, top_n,
                window):
    """float64 (B, Hq, N, N) with weights @ v = nsa_reference: a compressed key's weight
    spread evenly over its block's tokens, plus the two softmax maps, gated."""
    H, Hk, N, D = q.shape[1], k.shape[1], q.shape[2], q.shape[-1]
    p = nsa_compressed_probs(q, k, block, stride)
    spread = torch.zeros(p.shape[-1], N, dtype=torch.float64)
    for i in range(p.shape[-1]):
        spread[i, i * stride:i * stride + block] = 1.0 / block
    sel, win = _branch_masks(q, k, block, stride, select_block, top_n, window)
    s = q.double() @ k.double().repeat_interleave(H // Hk, dim=1).transpose(-1, -2) / math.sqrt(D)
    g = [x.double()[..., None] for x in (gate_cmp, gate_slc, gate_win)]
    return g[0] * (p @ spread) + g[1] * _masked_softmax(s, sel) + g[2] * _masked_softmax(s, win)
