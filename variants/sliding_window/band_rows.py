"""Exact softmax attention of query chunks over their contiguous key spans; the kernel of
`sliding_window.py` (q, k, v (B, H, N, D) -> (B, H, nc c, D)).

Chunk t's c queries score rows [t c, t c + L) of the zero-padded keys, a view, and the
band is masked inside that (c, L) block: one chunk a batched matmul over B H with its
masked corner runs, or, for small chunks, a group of G chunks in one matmul over (B H, G)
overlapping span views with the group's whole mask.

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

from ..core import Workspace, exp_, softmax_, softmax_lse_, softmax_scale


def band_rows_attention(q, k, v, w: int, c: int, L: int, causal: bool, drop, G: int):
    """Window w, chunks of c rows, spans of L keys; `drop` the mask: per chunk its corner
    runs (G = 1, `sliding_window.mask_runs`) or the whole (nc, c, L) mask (G > 1)."""
    return _BandRows.apply(q, k, v, w, c, L, causal, drop, G)


def _spans(x3: torch.Tensor, t0: int, G: int, c: int, L: int) -> torch.Tensor:
    """Chunks t0 .. t0 + G - 1's key spans of x3 (B H, rows, D) as one overlapping view
    (B H, G, L, D): chunk t's span is rows [t c, t c + L)."""
    BH, _, D = x3.shape
    return x3.as_strided((BH, G, L, D), (x3.stride(0), c * D, D, 1),
                         x3.storage_offset() + t0 * c * D)


def _grouped_forward(q3, k3, v3, o3, lse3, c: int, L: int, drop: torch.Tensor, G: int,
                     ws: Workspace) -> None:
    """The forward G chunks at a time: one (B H, G, c, L) score block a group (matmul
    copies the overlapping spans once), masked by the whole (G, c, L) drop mask."""
    BH, P, D = q3.shape
    nc = P // c
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * c, (t0 + g) * c)
        s = torch.matmul(q3[:, rows].view(BH, g, c, D), _spans(k3, t0, g, c, L).transpose(-1, -2),
                         out=ws("s", BH, g, c, L))
        s.masked_fill_(drop[t0:t0 + g], float("-inf"))
        if lse3 is not None:
            lse3[:, rows] = softmax_lse_(s).view(BH, g * c, 1)
        else:
            softmax_(s)
        o3[:, rows] = torch.matmul(s, _spans(v3, t0, g, c, L), out=ws("o", BH, g, c, D)).view(
            BH, g * c, D)


def _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c: int, L: int,
                      drop: torch.Tensor, G: int, ws: Workspace) -> None:
    """The backward G chunks at a time, as `_grouped_forward`; each chunk's key and value
    gradients are added into its span one chunk after another (the spans overlap)."""
    BH, P, D = q3.shape
    nc = P // c
    for t0 in range(0, nc, G):
        g = min(G, nc - t0)
        rows = slice(t0 * c, (t0 + g) * c)
        qt, do = q3[:, rows].view(BH, g, c, D), do3[:, rows].view(BH, g, c, D)
        ks, vs = _spans(k3, t0, g, c, L), _spans(v3, t0, g, c, L)
        s = torch.matmul(qt, ks.transpose(-1, -2), out=ws("s", BH, g, c, L))
        s.masked_fill_(drop[t0:t0 + g], float("-inf"))
        p = exp_(s.sub_(lse3[:, rows].view(BH, g, c, 1)))  # the forward's probabilities
        dvs = torch.matmul(p.transpose(-1, -2), do, out=ws("dv", BH, g, L, D))
        ds = torch.matmul(do, vs.transpose(-1, -2), out=ws("ds", BH, g, c, L))
        ds.sub_(delta3[:, rows].view(BH, g, c, 1)).mul_(p)
        dq3[:, rows] = torch.matmul(ds, ks, out=ws("dq", BH, g, c, D)).view(BH, g * c, D)
        dks = torch.matmul(ds.transpose(-1, -2), qt, out=ws("dk", BH, g, L, D))
        for j in range(g):
            span = slice((t0 + j) * c, (t0 + j) * c + L)
            dk3[:, span] += dks[:, j]
            dv3[:, span] += dvs[:, j]


class _BandRows(torch.autograd.Function):
    """Exact softmax attention of each c-row query chunk over its contiguous key span.

    q, k, v: (B, H, N, D); returns (B, H, nc c, D), the rows past N padding. Chunk t's
    keys and values are rows [t c, t c + L) of the zero-padded k and v: a view (one
    batched matmul per chunk over B H, no copy of the overlapping spans). The backward
    recomputes each chunk's probabilities from one log-sum-exp per query (FlashAttention's
    recomputation, Dao et al. 2022, https://arxiv.org/abs/2205.14135, Algorithm 4 without
    tiling) and adds each span's key and value gradients into the padded gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, c, L, causal, drop, G):
        B, H, N, D = q.shape
        nc = math.ceil(N / c)
        # Keys/values padded so chunk t's span starts at padded row t c (= token t c - w).
        right = nc * c - N + (0 if causal else w)
        # Contiguous (F.pad with nothing to pad may return its input, strided): the chunks
        # are slices of (B H, rows, D) views, and the gradients' layouts follow these.
        kp = F.pad(k, (0, 0, w, right)).contiguous()  # (B, H, (nc - 1) c + L, D)
        vp = F.pad(v, (0, 0, w, right)).contiguous()
        # The scale goes on q (N D products) rather than on the scores (N L).
        qc = q.new_zeros(B, H, nc * c, D) if nc * c > N else q.new_empty(B, H, N, D)
        torch.mul(q, softmax_scale(D), out=qc[:, :, :N])
        out = q.new_empty(B, H, nc * c, D)
        keep = any(ctx.needs_input_grad[:3])  # else nothing is saved: no log-sum-exp needed
        if keep:
            # float32 at least: a bfloat16 lse would shift every recomputed probability.
            lse = q.new_empty(B, H, nc * c, 1, dtype=torch.promote_types(q.dtype, torch.float32))
        # (B H, rows, D) views: chunk t's queries, key span and output rows are slices of
        # them, so each chunk is one bmm over B H with no copy; the scores go into one
        # workspace buffer that every chunk reuses.
        BH = B * H
        q3, k3, v3, o3 = (t.view(BH, -1, D) for t in (qc, kp, vp, out))
        lse3 = lse.view(BH, -1, 1) if keep else None
        if G > 1:
            _grouped_forward(q3, k3, v3, o3, lse3, c, L, drop, G, Workspace(q))
        else:
            s = Workspace(q)("s", BH, c, L)
            for t in range(nc):
                rows, span = slice(t * c, (t + 1) * c), slice(t * c, t * c + L)
                torch.bmm(q3[:, rows], k3[:, span].transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s[..., a:z].masked_fill_(m, float("-inf"))
                if keep:
                    lse3[:, rows] = softmax_lse_(s)
                else:
                    softmax_(s)
                torch.bmm(s, v3[:, span], out=o3[:, rows])
        if keep:
            ctx.band = (w, c, L, N, drop, G)
            ctx.save_for_backward(qc, kp, vp, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qc, kp, vp, out, lse = ctx.saved_tensors
        w, c, L, N, drop, G = ctx.band
        D = qc.shape[-1]
        nc = math.ceil(N / c)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, H, nc c, 1): rowsum(dO * O)
        dq = torch.empty_like(qc)
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
        BH = qc.shape[0] * qc.shape[1]
        q3, k3, v3, do3, dq3, dk3, dv3 = (t.view(BH, -1, D) for t in (qc, kp, vp, dout, dq,
                                                                      dk, dv))
        lse3, delta3 = lse.view(BH, -1, 1), delta.view(BH, -1, 1)
        ws = Workspace(qc)
        if G > 1:
            _grouped_backward(q3, k3, v3, do3, lse3, delta3, dq3, dk3, dv3, c, L, drop, G, ws)
        else:
            s, ds = ws("s", BH, c, L), ws("ds", BH, c, L)
            for t in range(nc):
                rows, span = slice(t * c, (t + 1) * c), slice(t * c, t * c + L)
                qt, do = q3[:, rows], do3[:, rows]  # (B H, c, D)
                ks, vs = k3[:, span], v3[:, span]  # (B H, L, D)
                torch.bmm(qt, ks.transpose(1, 2), out=s)
                for a, z, m in drop[t]:
                    s[..., a:z].masked_fill_(m, float("-inf"))
                p = exp_(s.sub_(lse3[:, rows]))  # the forward's probabilities
                dv3[:, span].baddbmm_(p.transpose(1, 2), do)
                torch.bmm(do, vs.transpose(1, 2), out=ds).sub_(delta3[:, rows]).mul_(p)
                torch.bmm(ds, ks, out=dq3[:, rows])
                dk3[:, span].baddbmm_(ds.transpose(1, 2), qt)
        dq = dq[:, :, :N].mul_(softmax_scale(D))
        return dq, dk[:, :, w:w + N], dv[:, :, w:w + N], None, None, None, None, None, None
