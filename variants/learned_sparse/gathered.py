"""Exact softmax of each query over the keys its selection lists, a query chunk at a time
(q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv), sel (B, N, kk) -> o (B, Hq, N, Dv)).

The selection is one a (batch, query), shared by every head: a chunk of c queries gathers
its c kk selected rows of the keys and values laid out token-major, (B N, Hk D), one dim-0
`index_select` each, and the Hq / Hk query heads of a key-value head score them together:
(c, Hk) batches of (r, D) x (D, kk), masked where a row lists -1, softmaxed in place, times
the gathered values. Keys and values are read per key-value head, never repeated to the
query heads. Memory: one chunk's gathers (B c kk Hk (D + Dv)) and scores, and the (B, N,
kk) selection; time O(N kk Hq D).

Backward (FlashAttention's recomputation, Dao et al. 2022, Algorithm 4): the forward
keeps q, k, v, the output, a log-sum-exp per query and head, and the selection; each chunk
gathers again and recomputes P = exp(S - lse), then dV = P^T dO, dS = P (dO V^T -
rowsum(dO o)), dQ = dS K, dK = dS^T Q, scattered back into the rows they came from
(`index_add_`). The selection is not differentiated.
"""

from __future__ import annotations

import torch

from ..core import compute_dtype, softmax_, softmax_scale

# Bytes of one chunk's gathered keys and values and scores.
_STEP_BYTES = 32 * 2**20


def _chunks(B, N, kk, Hq, Hk, D, Dv):
    c = max(1, min(N, _STEP_BYTES // (4 * B * kk * (Hk * (D + Dv) + 2 * Hq))))
    return [(s, min(N, s + c)) for s in range(0, N, c)]


def gathered_attention(q, k, v, sel):
    """Each query's softmax over its selected keys; gradients reach q, k, v. sel: a (B, N,
    kk) int tensor, or an object with that `shape` whose `sel[:, s:e]` gives a chunk's
    rows (nsa's blocks and window, expanded to tokens one chunk at a time)."""
    return _Gathered.apply(q, k, v, sel)


def _rows(sel, s, e, N):
    """Rows of the token-major (B N, .) layout that chunk s..e reads, (B, c, kk) long, and
    where its selection lists none (-1), (B, c, 1, 1, kk) bool."""
    idx = sel[:, s:e].long()
    pad = idx < 0
    base = torch.arange(idx.shape[0], device=idx.device)[:, None, None] * N
    return (idx.clamp(min=0) + base), pad[:, :, None, None, :]


def _gather(xf, rows, Hk, W):
    """The rows (B, c, kk) of xf (B N, Hk W) as (B, c, Hk, kk, W)."""
    B, c, kk = rows.shape
    return xf.index_select(0, rows.view(-1)).view(B, c, kk, Hk, W).transpose(2, 3)


def _layout(x, Hk):
    """(B, Hq, N, W) -> (B, N, Hk, r, W), contiguous: the r query heads of a key-value head
    together."""
    B, H, N, W = x.shape
    return x.reshape(B, Hk, H // Hk, N, W).permute(0, 3, 1, 2, 4).contiguous()


def _back(x):
    """(B, N, Hk, r, W) -> (B, Hq, N, W)."""
    B, N, Hk, r, W = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, Hk * r, N, W)


class _Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel):
        B, Hq, N, D = q.shape
        Hk, Dv, kk = k.shape[1], v.shape[-1], sel.shape[-1]
        dtype, cd = q.dtype, compute_dtype(q.dtype)
        qs = _layout(q.to(cd) * softmax_scale(D), Hk)  # (B, N, Hk, r, D)
        kf = k.to(cd).transpose(1, 2).reshape(B * N, Hk * D)
        vf = v.to(cd).transpose(1, 2).reshape(B * N, Hk * Dv)
        out = torch.empty(*qs.shape[:4], Dv, dtype=cd, device=q.device)
        lse = torch.empty(*qs.shape[:4], 1, dtype=cd, device=q.device)
        for s, e in _chunks(B, N, kk, Hq, Hk, D, Dv):
            rows, pad = _rows(sel, s, e, N)
            K, V = _gather(kf, rows, Hk, D), _gather(vf, rows, Hk, Dv)  # (B, c, Hk, kk, .)
            sc = (qs[:, s:e] @ K.transpose(-1, -2)).masked_fill_(pad, float("-inf"))
            mx = sc.amax(dim=-1, keepdim=True)
            softmax_(sc)  # every row lists one key at least: its selection is never empty
            lse[:, s:e] = mx.sub_(sc.amax(dim=-1, keepdim=True).log_())
            out[:, s:e] = sc @ V
        if any(ctx.needs_input_grad[:3]):
            ctx.dtype, ctx.shapes = dtype, (q.shape, k.shape, v.shape)
            kept = (sel,) if isinstance(sel, torch.Tensor) else ()
            ctx.rows_of = None if kept else sel
            ctx.save_for_backward(qs, kf, vf, out, lse, *kept)
        return _back(out).to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qs, kf, vf, out, lse, *kept = ctx.saved_tensors
        sel = kept[0] if kept else ctx.rows_of
        (B, Hq, N, D), (_, Hk, _, _), (_, _, _, Dv) = ctx.shapes
        kk = sel.shape[-1]
        do = _layout(dout.to(qs.dtype), Hk)  # (B, N, Hk, r, Dv)
        delta = torch.linalg.vecdot(do, out).unsqueeze(-1)  # rowsum(dO o)
        dq = torch.empty_like(qs)
        dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
        for s, e in _chunks(B, N, kk, Hq, Hk, D, Dv):
            rows, pad = _rows(sel, s, e, N)
            K, V = _gather(kf, rows, Hk, D), _gather(vf, rows, Hk, Dv)
            p = (qs[:, s:e] @ K.transpose(-1, -2)).masked_fill_(pad, float("-inf"))
            p.sub_(lse[:, s:e]).exp_()  # the forward's P, 0 where none is listed
            dog = do[:, s:e]
            dV = p.transpose(-1, -2) @ dog  # (B, c, Hk, kk, Dv)
            ds = (dog @ V.transpose(-1, -2)).sub_(delta[:, s:e]).mul_(p)
            dq[:, s:e] = (ds @ K) * softmax_scale(D)
            dK = ds.transpose(-1, -2) @ qs[:, s:e]  # (B, c, Hk, kk, D)
            flat = rows.view(-1)
            dkf.index_add_(0, flat, dK.transpose(2, 3).reshape(-1, Hk * D))
            dvf.index_add_(0, flat, dV.transpose(2, 3).reshape(-1, Hk * Dv))
        dtype = ctx.dtype
        dk = dkf.view(B, N, Hk, D).transpose(1, 2).to(dtype)
        dv = dvf.view(B, N, Hk, Dv).transpose(1, 2).to(dtype)
        return _back(dq).to(dtype), dk, dv, None
