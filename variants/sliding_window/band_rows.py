"""Exact softmax attention of query chunks over their contiguous key spans; the kernel of
`sliding_window.py` (q, k, v (B, H, N, D) -> (B, H, nc c, D)).

Chunk t's c queries score rows [t c, t c + L) of the zero-padded keys, a view, and the
band is masked inside that (c, L) block: one chunk a batched matmul over B H with its
masked corner runs, or, for small chunks, a group of G chunks in one matmul over (B H, G)
overlapping span views with the group's whole mask.

Grouped keys (Hk key-value heads for Hq = r Hk query heads, SDPA's `enable_gqa` meaning)
run natively: q is laid out (B, Hk, chunks, r, c, D), so that the r query heads of a
key-value head are r c rows of each chunk's one matmul against the span they share; the
keys and values are never repeated.

Backward (`_BandRows`, FlashAttention's recomputation: Dao et al. 2022,
https://arxiv.org/abs/2205.14135, Algorithm 4 without tiling): the forward saves q (scaled,
padded), the padded k and v, the output and one log-sum-exp per query; the backward
recomputes each chunk's probabilities and adds its span's key and value gradients into
the padded gradients. Plain autograd kept every chunk's probabilities and a copy of the
overlapping key and value spans.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core import Workspace, exp_, sink_grad, sinked, softmax_, softmax_lse_, softmax_scale


def band_rows_attention(q, k, v, w: int, c: int, L: int, causal: bool, drop, G: int,
                        sinks=None):
    """Window w, chunks of c rows, spans of L keys; `drop` the mask: per chunk its corner
    runs (G = 1, `sliding_window.mask_runs`) or the whole (nc, c, L) mask (G > 1).
    q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv), Hk dividing Hq; returns
    (B, Hq, nc c, Dv). sinks: a logit per query head (Hq,) in every row's denominator
    (`core/sinks.py`): the rows' outputs rescaled from their log-sum-exp, which the
    backward then reads as is."""
    return _BandRows.apply(q, k, v, w, c, L, causal, drop, G, sinks)


def _spans(x3: torch.Tensor, t0: int, G: int, c: int, L: int) -> torch.Tensor:
    """Chunks t0 .. t0 + G - 1's key spans of x3 (B H, rows, D) as one overlapping view
    (B H, G, L, D): chunk t's span is rows [t c, t c + L)."""
    BH, _, D = x3.shape
    return x3.as_strided((BH, G, L, D), (x3.stride(0), c * D, D, 1),
                         x3.storage_offset() + t0 * c * D)


def _to_kernel(x: torch.Tensor, Hk: int, nc: int, c: int) -> torch.Tensor:
    """(B, Hq, nc c, D) -> the kernel's (B, Hk, nc r c, D), rows of chunk t's r query heads
    together; the tensor itself where r = 1."""
    B, Hq, _, D = x.shape
    if Hq == Hk:
        return x
    r = Hq // Hk
    return x.view(B, Hk, r, nc, c, D).transpose(2, 3).reshape(B, Hk, nc * r * c, D)


def _from_kernel(x: torch.Tensor, Hq: int, nc: int, c: int) -> torch.Tensor:
    """The kernel's (B, Hk, nc r c, D) -> (B, Hq, nc c, D); the tensor itself where r = 1."""
    B, Hk, _, D = x.shape
    if Hq == Hk:
        return x
    r = Hq // Hk
    return x.view(B, Hk, nc, r, c, D).transpose(2, 3).reshape(B, Hq, nc * c, D)


def _grouped_forward(q3, k3, v3, o3, lse3, c: int, r: int, L: int, drop: torch.Tensor,
                     G: int, ws: Workspace) -> None:
    """The forward G chunks at a time: one (B Hk, G, r c, L) score block a group (matmul
    copies the overlapping spans once), masked by the whole (G, c, L) drop mask."""
    BH, P, D = q3.shape
    Dv = v3.shape[-1]
    R = r * c  # a chunk's rows: its r query heads' c queries
    nc = P // R
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * R, (t0 + g) * R)
        s = torch.matmul(q3[:, rows].view(BH, g, R, D), _spans(k3, t0, g, c, L).transpose(-1, -2),
                         out=ws("s", BH, g, R, L))
        s.view(BH, g, r, c, L).masked_fill_(drop[t0:t0 + g, None], float("-inf"))
        if lse3 is not None:
            lse3[:, rows] = softmax_lse_(s).view(BH, g * R, 1)
        else:
            softmax_(s)
        o3[:, rows] = torch.matmul(s, _spans(v3, t0, g, c, L), out=ws("o", BH, g, R, Dv)).view(
            BH, g * R, Dv)


def _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c: int, r: int, L: int,
                      drop: torch.Tensor, G: int, ws: Workspace) -> None:
    """The backward G chunks at a time, as `_grouped_forward`; each chunk's key and value
    gradients are added into its span one chunk after another (the spans overlap)."""
    BH, P, D = q3.shape
    Dv = v3.shape[-1]
    R = r * c
    nc = P // R
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * R, (t0 + g) * R)
        qt, do = q3[:, rows].view(BH, g, R, D), do3[:, rows].view(BH, g, R, Dv)
        ks, vs = _spans(k3, t0, g, c, L), _spans(v3, t0, g, c, L)
        s = torch.matmul(qt, ks.transpose(-1, -2), out=ws("s", BH, g, R, L))
        s.view(BH, g, r, c, L).masked_fill_(drop[t0:t0 + g, None], float("-inf"))
        p = exp_(s.sub_(lse3[:, rows].view(BH, g, R, 1)))  # the forward's probabilities
        dvs = torch.matmul(p.transpose(-1, -2), do, out=ws("dv", BH, g, L, Dv))
        ds = torch.matmul(do, vs.transpose(-1, -2), out=ws("ds", BH, g, R, L))
        ds.sub_(delta3[:, rows].view(BH, g, R, 1)).mul_(p)
        dq3[:, rows] = torch.matmul(ds, ks, out=ws("dq", BH, g, R, D)).view(BH, g * R, D)
        dks = torch.matmul(ds.transpose(-1, -2), qt, out=ws("dk", BH, g, L, D))
        for j in range(g):
            span = slice((t0 + j) * c, (t0 + j) * c + L)
            dk3[:, span] += dks[:, j]
            dv3[:, span] += dvs[:, j]


class _BandRows(torch.autograd.Function):
    """Exact softmax attention of each c-row query chunk over its contiguous key span.

    q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv); returns (B, Hq, nc c, Dv), the rows
    past N padding. Chunk t's keys and values are rows [t c, t c + L) of the zero-padded k
    and v: a view (one batched matmul per chunk over B Hk, its r = Hq / Hk query heads'
    rows together, no copy of the overlapping spans). The backward recomputes each chunk's
    probabilities from one log-sum-exp per query (FlashAttention's recomputation, Dao et
    al. 2022, https://arxiv.org/abs/2205.14135, Algorithm 4 without tiling) and adds each
    span's key and value gradients into the padded gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, c, L, causal, drop, G, sinks):
        B, Hq, N, D = q.shape
        Hk, Dv = k.shape[1], v.shape[-1]
        r = Hq // Hk
        nc = math.ceil(N / c)
        # Keys/values padded so chunk t's span starts at padded row t c (= token t c - w).
        right = nc * c - N + (0 if causal else w)
        # Contiguous (F.pad with nothing to pad may return its input, strided): the chunks
        # are slices of (B H, rows, D) views, and the gradients' layouts follow these.
        kp = F.pad(k, (0, 0, w, right)).contiguous()  # (B, Hk, (nc - 1) c + L, D)
        vp = F.pad(v, (0, 0, w, right)).contiguous()
        # The scale goes on q (N D products) rather than on the scores (N L), laid out
        # (B, Hk, nc r c, D) (`_to_kernel`).
        if r == 1:
            qc = q.new_zeros(B, Hq, nc * c, D) if nc * c > N else q.new_empty(B, Hq, N, D)
            torch.mul(q, softmax_scale(D), out=qc[:, :, :N])
        else:
            qc = _to_kernel(F.pad(q * softmax_scale(D), (0, 0, 0, nc * c - N)), Hk, nc, c)
        out = q.new_empty(B, Hk, nc * r * c, Dv)
        keep = any(ctx.needs_input_grad[:3]) or (sinks is not None and ctx.needs_input_grad[9])
        if keep or sinks is not None:  # else no log-sum-exp is needed
            # float32 at least: a bfloat16 lse would shift every recomputed probability.
            lse = q.new_empty(B, Hk, nc * r * c, 1,
                              dtype=torch.promote_types(q.dtype, torch.float32))
        # (B Hk, rows, D) views: chunk t's queries, key span and output rows are slices of
        # them, so each chunk is one bmm over B Hk with no copy; the scores go into one
        # workspace buffer that every chunk reuses.
        BH, R = B * Hk, r * c
        q3, k3 = qc.view(BH, -1, D), kp.view(BH, -1, D)
        v3, o3 = vp.view(BH, -1, Dv), out.view(BH, -1, Dv)
        lse3 = lse.view(BH, -1, 1) if keep or sinks is not None else None
        if G > 1:
            _grouped_forward(q3, k3, v3, o3, lse3, c, r, L, drop, G, Workspace(q))
        else:
            s = Workspace(q)("s", BH, R, L)
            s4 = s.view(BH, r, c, L)
            for t in range(nc):
                rows, span = slice(t * R, (t + 1) * R), slice(t * c, t * c + L)
                torch.bmm(q3[:, rows], k3[:, span].transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s4[..., a:z].masked_fill_(m, float("-inf"))
                if lse3 is not None:
                    lse3[:, rows] = softmax_lse_(s)
                else:
                    softmax_(s)
                torch.bmm(s, v3[:, span], out=o3[:, rows])
        if sinks is not None:  # the sink's column in each row's denominator
            out, lse = sinked(out.view(B, Hk, nc, r, c, Dv), lse.view(B, Hk, nc, r, c, 1),
                              sinks, view=(1, Hk, 1, r, 1, 1))
            out, lse = out.view(B, Hk, nc * R, Dv), lse.view(B, Hk, nc * R, 1)
        if keep:
            ctx.band = (w, c, L, N, drop, G, Hq)
            ctx.save_for_backward(qc, kp, vp, out, lse, sinks)
        return _from_kernel(out, Hq, nc, c)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qc, kp, vp, out, lse, sinks = ctx.saved_tensors
        w, c, L, N, drop, G, Hq = ctx.band
        B, Hk, _, D = qc.shape
        Dv = vp.shape[-1]
        r, nc = Hq // Hk, math.ceil(N / c)
        R = r * c
        dout = _to_kernel(dout.contiguous(), Hk, nc, c).contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, Hk, nc r c, 1): rowsum(dO * O)
        dq = torch.empty_like(qc)
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
        BH = B * Hk
        q3, k3, dq3, dk3 = (t.view(BH, -1, D) for t in (qc, kp, dq, dk))
        v3, do3, dv3 = (t.view(BH, -1, Dv) for t in (vp, dout, dv))
        lse3, delta3 = lse.view(BH, -1, 1), delta.view(BH, -1, 1)
        ws = Workspace(qc)
        if G > 1:
            _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c, r, L, drop, G,
                              ws)
        else:
            s, ds = ws("s", BH, R, L), ws("ds", BH, R, L)
            s4 = s.view(BH, r, c, L)
            for t in range(nc):
                rows, span = slice(t * R, (t + 1) * R), slice(t * c, t * c + L)
                qt, do = q3[:, rows], do3[:, rows]  # (B Hk, r c, D)
                ks, vs = k3[:, span], v3[:, span]  # (B Hk, L, D)
                torch.bmm(qt, ks.transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s4[..., a:z].masked_fill_(m, float("-inf"))
                p = exp_(s.sub_(lse3[:, rows]))  # the forward's probabilities
                dv3[:, span].baddbmm_(p.transpose(1, 2), do)
                torch.bmm(do, vs.transpose(1, 2), out=ds).sub_(delta3[:, rows]).mul_(p)
                torch.bmm(ds, ks, out=dq3[:, rows])
                dk3[:, span].baddbmm_(ds.transpose(1, 2), qt)
        dq = _from_kernel(dq, Hq, nc, c)[:, :, :N].mul_(softmax_scale(D))
        dsinks = None
        if ctx.needs_input_grad[9]:
            dsinks = sink_grad(sinks, lse.view(B, Hk, nc, r, c, 1),
                               delta.view(B, Hk, nc, r, c, 1), view=(1, Hk, 1, r, 1, 1))
        return (dq, dk[:, :, w:w + N], dv[:, :, w:w + N], None, None, None, None, None, None,
                dsinks)
