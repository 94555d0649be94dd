"""The exact reference: softmax(q k^T / sqrt(D)) v in float64, in query chunks.

Everything is measured against this: the tests, and the harness's error columns. It never
holds an N x N matrix: queries are processed `chunk` rows at a time, so the extra memory is
B * H * chunk * N float64 scores (about 64 MiB by default, whatever N is).
"""

from __future__ import annotations

import torch

from .checks import KeyMask, check_qkv, expand_heads, softmax_scale
from .contract import Grouping

_GROUPINGS = (Grouping("kv", "repeat", value_dim=True), Grouping("value", "repeat", value_dim=True))


def grouped_as_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v checked (grouped keys or grouped values, values of any width) and their
    shared heads repeated to one per output head: the references' plain form."""
    try:
        check_qkv(q, k, v, _GROUPINGS[0])
    except ValueError:
        check_qkv(q, k, v, _GROUPINGS[1])
    return expand_heads(q, k, v)

# Budget for one chunk's float64 score block, in bytes.
_CHUNK_BYTES = 64 * 2**20


def exact_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    *, key_mask: KeyMask | None = None, rows: torch.Tensor | None = None,
                    chunk: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention in float64 for (B, H, N, D) q, k, v; returns (B, H, R, Dv) float64.

    Grouped heads: q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hv, N, Dv) with Hk = Hv dividing
    Hq (query head h reads key-value head h // (Hq / Hk)), or Hq = Hk dividing Hv (value
    head j reads query-key head j // (Hv / Hk)); the shared heads are repeated first.

    causal: query i sees keys j <= i. key_mask: an extra pattern (i, j) -> allowed.
    rows: optional query indices (R of them) to compute; all N rows when None.
    sinks: one logit per output head (H,) in every row's denominator, its column dropped
    (gpt-oss's sinks, `sinks.py`): exp(S_h) is added to the row's sum of exp(scores).
    A query row with no allowed key gets a zero output (a sink alone: zero too). Not
    differentiable (the chunk
    arithmetic is in place): for a float64 autograd reference use `naive_attention` on
    float64 inputs.
    """
    q, k, v = grouped_as_plain(q, k, v)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    rows = torch.arange(N, device=q.device) if rows is None else rows.to(q.device)
    if chunk is None:
        chunk = max(1, min(len(rows), _CHUNK_BYTES // (8 * B * H * max(N, 1))))
    k64, v64 = k.double(), v.double()
    keys = torch.arange(N, device=q.device)
    scale = softmax_scale(D)
    out = torch.empty(B, H, len(rows), Dv, dtype=torch.float64, device=q.device)
    sink = None if sinks is None else sinks.detach().double().to(q.device).view(1, H, 1, 1)
    for s in range(0, len(rows), chunk):
        r = rows[s:s + chunk]
        # In place from here on: one (B, H, c, N) block alive per chunk.
        p = (q[:, :, r].double() * scale) @ k64.transpose(-1, -2)  # (B, H, c, N) scores
        allowed = _allowed(r, keys, causal, key_mask)
        if allowed is not None:
            p.masked_fill_(~allowed, float("-inf"))
        top = p.amax(dim=-1, keepdim=True)
        if sink is not None:
            top = torch.maximum(top, sink)
        top.nan_to_num_(neginf=0.0)
        p.sub_(top).exp_()
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + (sink - top).exp()
        out[:, :, s:s + chunk] = (p @ v64) / denom.clamp_min(torch.finfo(torch.float64).tiny)
    return out


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    *, key_mask: KeyMask | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The plain dense form in q's own dtype (the N x N matrix, materialised); with
    `sinks` (H,), each head's sink column in the softmax (autograd reaches them).

    The baseline whose rounding error sets the tolerance for fast paths in the same dtype.
    """
    return softmax_weights(q, k, causal, key_mask=key_mask, sinks=sinks) @ v


def softmax_weights(q: torch.Tensor, k: torch.Tensor, causal: bool = False, *,
                    key_mask: KeyMask | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) over the allowed keys, (B, H, n, N) in q's dtype (n
    queries, the last n of the N keys' positions: a decoding step's row is query N - 1).
    sinks: one logit a head (H,) as one more column of every row, dropped after: the rows
    then sum to below 1 (gpt-oss's sinks).

    A row with no allowed key (possible under a pattern) is all zeros.
    """
    n, N, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = (q * softmax_scale(D)) @ k.transpose(-1, -2)  # (B, H, n, N)
    keys = torch.arange(N, device=q.device)
    allowed = _allowed(keys[N - n:], keys, causal, key_mask)
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    p = softmax_sinked(scores, None if sinks is None else sinks.view(1, -1, 1, 1))
    if key_mask is not None:  # a pattern may leave a row without keys: 0 there
        p = p.nan_to_num(0.0)
    return p


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row a head over a decoder's held keys: q (B, Hq, 1, D), k (B, Hk, n, D),
    v (B, Hk, n, Dv), Hk dividing Hq (query head h reads head h // (Hq / Hk): the r query
    heads of a key-value head as r rows of one product, never repeated); sinks (Hq,) as
    in `softmax_weights`. Returns (B, Hq, 1, Dv) in q's dtype."""
    B, Hq, _, D = q.shape
    Hk = k.shape[1]
    r = Hq // Hk
    s = (q.reshape(B, Hk, r, D) * softmax_scale(D)) @ k.transpose(-1, -2)  # (B, Hk, r, n)
    p = softmax_sinked(s, None if sinks is None else sinks.view(1, Hk, r, 1))
    return (p @ v).reshape(B, Hq, 1, v.shape[-1])


def softmax_sinked(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of `scores`; with `sink` (broadcastable to scores[..., :1]:
    each row's sink logit), the sink as one more column, dropped after (gpt-oss's sinks).
    Differentiable: autograd reaches the sinks."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    col = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


def dense_mask(N: int, causal: bool = False, key_mask: KeyMask | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The bool [N, N] allowed-mask of a pattern, for tests and explicit-mask SDPA."""
    idx = torch.arange(N, device=device)
    allowed = _allowed(idx, idx, causal, key_mask)
    return torch.ones(N, N, dtype=torch.bool, device=device) if allowed is None else allowed


def _allowed(r: torch.Tensor, keys: torch.Tensor, causal: bool,
             key_mask: KeyMask | None) -> torch.Tensor | None:
    allowed = None
    if key_mask is not None:
        allowed = key_mask(r, keys)
    if causal:
        c = keys[None, :] <= r[:, None]
        allowed = c if allowed is None else allowed & c
    return allowed
