"""Exact softmax of each query over the key blocks it selected, laid out per key block;
the kernel of `moba` and `quest` (q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv), a
selection (B, Hq, N, kk) -> o (B, Hq, N, Dv)).

Grouped keys (Hk dividing Hq, SDPA's `enable_gqa` meaning) run natively: a slice is one
(batch, kv head), its r = Hq / Hk query heads' queries its r N query rows (row x is query
head x // N's query at position x % N, a view of q), so that the queries of all r heads
that chose a key block share that block's chunks; keys and values are never repeated.

Gathering each query's kk blocks of b keys would hold N kk b D numbers. Instead the work
goes per key block: for one tile of T queries (part of one (batch, head) slice, or at
short lengths several whole slices, whose blocks are then numbered slice by slice), the
queries that selected block j are listed (a scatter into a (slices, nb, Q) bool table
and its `nonzero`, which comes out in block order: no sort) and cut into chunks of C rows,
the last one padded with a zero query. A step takes a few dozen chunks: it gathers their
query rows and key blocks, scores them with one batched matmul (n, C, b), masks only the
chunks that need it (the partial last block's padding; causal, the blocks at or after the
tile's first query, where a query's own block is), softmaxes in place and keeps per
(query, block) row its log-sum-exp l and output o. The tile then merges each query's kk
rows as online softmax does (Milakov & Gimelshein 2018): L = log sum e^l (a scatter-max
first), o = sum o e^(l - L), with two index_adds. Memory is O(T kk D) a tile plus the
O(N kk) selection; time O(N kk b D).

Backward (FlashAttention's recomputation, Dao et al. 2022, Algorithm 4): the forward keeps
q, k, v, the output and one log-sum-exp per query; the backward plans the tiles again
and recomputes each chunk's P = exp(S - lse), then dV = P^T dO, dS = P (dO V^T - rowsum(dO
o)), dQ = dS K, dK = dS^T Q, added into the blocks and rows they belong to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core import Workspace, compute_dtype, exp_, softmax_lse_, softmax_scale

# Query rows per chunk: one (C, D) x (D, b) matmul. 128 rows ran at 1.5-2x the rate of
# 64 for b = 64 and 128 on this CPU (a batch of 16 MiB of scores, two threads).
_CHUNK = 128
# (query, block) pairs per tile: the tile's per-pair buffers are this many rows of D.
_TILE_PAIRS = 2**16
# Bytes of one step's (n, C, b) scores.
_STEP_BYTES = 4 * 2**20


def routed_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sel: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """Each query's exact softmax over the keys of its selected blocks (B, Hq, N, kk; -1:
    none), with j <= i inside its own block when causal; (B, Hq, N, Dv) in q's dtype;
    query head h reads kv head h // (Hq / Hk).
    Gradients flow to q, k, v through the selected scores, not through the selection."""
    return _RoutedRows.apply(q, k, v, sel, block_size, causal)


def _tile_rows(N: int, kk: int, nb: int) -> int:
    """Queries per tile: _TILE_PAIRS pairs, and at least two chunks' worth of queries per
    block on average, so that the padding of each block's last chunk stays a small part.
    More than N: a tile takes several whole (batch, head) slices."""
    return max(1, _TILE_PAIRS // kk, 2 * _CHUNK * nb // kk)


def _chunk_rows(T: int, kk: int, nb: int) -> int:
    """Rows per chunk: _CHUNK, or fewer where a slice's blocks average fewer queries in a
    tile (a short sequence of small blocks), so that padding does not outweigh the work:
    the power of two at or above the mean, at least 8."""
    mean = max(1, T * kk // nb)
    return min(_CHUNK, max(8, 1 << (mean - 1).bit_length()))


def _plan(sel_t: torch.Tensor, nb: int, C: int) -> tuple:
    """A tile's chunks of C rows from the selection sel_t (S, Q, kk) of its S slices' Q
    queries each: (rows, grp).

    rows (n C,): each chunk slot's query, an index into the tile's S Q queries (S Q, a
    zero row, pads a chunk); grp (n,): each chunk's block, s nb + block for slice s of the
    tile, ascending.
    """
    S, Q, kk = sel_t.shape
    hit = torch.zeros(S, nb + 1, Q, dtype=torch.bool, device=sel_t.device)
    st = sel_t.transpose(1, 2)  # (S, kk, Q)
    hit.scatter_(1, st.masked_fill(st < 0, nb), True)  # -1 lands in the spare row
    s_of, blk_of, i = hit[:, :nb].nonzero(as_tuple=True)  # by slice, block, then query
    grp_of = s_of * nb + blk_of
    cnt = torch.bincount(grp_of, minlength=S * nb)
    nch = (cnt + C - 1) // C
    first = nch.cumsum(0) - nch  # each block's first chunk
    total = int(nch.sum())
    pos = torch.arange(len(i), device=i.device) - (cnt.cumsum(0) - cnt)[grp_of]
    rows = torch.full((total * C,), S * Q, dtype=torch.long, device=i.device)
    rows[first[grp_of] * C + pos] = s_of * Q + i
    grp = torch.repeat_interleave(torch.arange(S * nb, device=i.device), nch)
    return rows, grp


def _mask(sc: torch.Tensor, blk: torch.Tensor, rows: torch.Tensor, Q: int, q0: int,
          pad_row: int, b: int, N: int, causal: bool) -> None:
    """-inf into the scores sc (n, C, b) of chunks of blocks blk (n,) (in their slice)
    with query slots rows (n, C) (tile indices, pad_row for padding): padded keys (token
    >= N) and, causal, keys after the query."""
    ktok = blk[:, None, None] * b + torch.arange(b, device=sc.device)  # (n, 1, b)
    drop = ktok >= N
    if causal:  # a slice's row x is the query at position x % N (r heads' rows, grouped)
        qtok = ((q0 + rows % Q) % N).masked_fill_(rows == pad_row, N + b)  # padding: no drop
        drop = drop | (ktok > qtok[..., None])
    sc.masked_fill_(drop, float("-inf"))


def _mask_step(sc, need, blk, rows, Q, q0, pad_row, b, N, causal) -> None:
    """Mask the chunks of a step that need it (a suffix of each slice's chunks)."""
    at = need.nonzero().squeeze(1)
    if len(at):
        sub = sc.index_select(0, at)
        _mask(sub, blk.index_select(0, at), rows.view(len(blk), -1).index_select(0, at), Q,
              q0, pad_row, b, N, causal)
        sc.index_copy_(0, at, sub)


class _Layout:
    """The shapes of one call: slices (one (batch, kv head) each, its r N query rows),
    blocks, tiles, and the tiles' plans."""

    def __init__(self, q: torch.Tensor, Hk: int, sel: torch.Tensor, b: int, causal: bool):
        B, Hq, N, D = q.shape
        self.BH, self.N, self.D, self.b, self.causal = B * Hk, N, D, b, causal
        self.M = Hq // Hk * N  # query rows a slice
        self.nb = math.ceil(N / b)
        self.kk = sel.shape[-1]
        self.sel = sel.reshape(self.BH, self.M, self.kk)
        T = _tile_rows(N, self.kk, self.nb)
        self.Q = min(T, self.M)  # query rows of one slice in a tile
        self.S = max(1, T // self.M)  # slices a tile
        self.C = _chunk_rows(self.Q, self.kk, self.nb)
        self.steps = max(1, _STEP_BYTES // (self.C * b * 4))  # chunks a step

    def tiles(self):
        """(g0, n, q0, Q, rows, grp, blk, need) for each tile: its queries are rows g0 ..
        g0 + n of the (B Hk M) flattened ones, Q of each of its slices from row q0 on;
        grp its chunks' global key blocks (slice nb + block), blk their blocks within the
        slice, need the chunks to mask (the partial last block; causal, blocks at or
        after the tile's earliest query position: a query's own block)."""
        N, M, nb, b = self.N, self.M, self.nb, self.b
        partial = nb * b > N
        for sa in range(0, self.BH, self.S):
            sb = min(self.BH, sa + self.S)
            for q0 in range(0, M, self.Q):
                Q = min(self.Q, M - q0)
                rows, grp = _plan(self.sel[sa:sb, q0:q0 + Q], nb, self.C)
                blk = grp % nb
                need = torch.zeros_like(blk, dtype=torch.bool)
                if partial:
                    need |= blk == nb - 1
                if self.causal:  # rows from q0: positions from q0 % N, or from 0 on a wrap
                    first = q0 % N if q0 % N + Q <= N else 0
                    need |= blk >= first // b
                yield sa * M + q0, (sb - sa) * Q, q0, Q, rows, grp + sa * nb, blk, need

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hk, N, E) -> zero-padded key blocks (B Hk nb, b E), contiguous."""
        pad = self.nb * self.b - self.N
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.reshape(self.BH * self.nb, self.b * x.shape[-1])


def _with_zero_row(ws: Workspace, name: str, x: torch.Tensor) -> torch.Tensor:
    """x (T, E) followed by a zero row, in workspace buffer `name`: (T + 1, E)."""
    out = ws(name, x.shape[0] + 1, x.shape[1])
    out[:-1] = x
    out[-1] = 0
    return out


class _RoutedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel, b, causal):
        dtype = q.dtype
        cd = compute_dtype(dtype)  # bfloat16 runs in float32: the merge needs its range
        lay = _Layout(q, k.shape[1], sel, b, causal)
        BH, M, N, D, C, Dv = lay.BH, lay.M, lay.N, lay.D, lay.C, v.shape[-1]
        qs = (q.to(cd) * softmax_scale(D)).contiguous().view(BH, M, D)  # a model gives strided q
        kb, vb = lay.blocks(k.to(cd)), lay.blocks(v.to(cd))
        out = torch.empty(BH, M, Dv, dtype=cd, device=q.device)
        keep = any(ctx.needs_input_grad[:3])
        lse = torch.empty(BH, M, 1, dtype=cd, device=q.device) if keep else None
        ws = Workspace(qs)
        qf, of = qs.view(BH * M, D), out.view(BH * M, Dv)
        lf = lse.view(BH * M, 1) if keep else None
        for g0, Tn, q0, Q, rows, grp, blk, need in lay.tiles():
            n_all = len(grp)
            qt = _with_zero_row(ws, "qt", qf[g0:g0 + Tn])
            o_sl, m_sl = ws("o", n_all * C, Dv), ws("m", n_all * C, 1)
            for c0 in range(0, n_all, lay.steps):
                c1 = min(n_all, c0 + lay.steps)
                n, r = c1 - c0, rows[c0 * C:c1 * C]
                qg = torch.index_select(qt, 0, r, out=ws("qg", n * C, D)).view(n, C, D)
                kg = torch.index_select(kb, 0, grp[c0:c1], out=ws("kg", n, b * D))
                vg = torch.index_select(vb, 0, grp[c0:c1], out=ws("vg", n, b * Dv))
                sc = torch.bmm(qg, kg.view(n, b, D).transpose(1, 2), out=ws("s", n, C, b))
                _mask_step(sc, need[c0:c1], blk[c0:c1], r, Q, q0, Tn, b, N, causal)
                m_sl[c0 * C:c1 * C] = softmax_lse_(sc).view(n * C, 1)  # sc is now P
                torch.bmm(sc, vg.view(n, b, Dv), out=o_sl[c0 * C:c1 * C].view(n, C, Dv))
            # Merge each query's rows (slot x belongs to query rows[x]; Tn pads): its
            # log-sum-exp over all of them, then the rows weighted by e^(lse_row - lse).
            top = torch.full((Tn + 1, 1), float("-inf"), dtype=cd, device=q.device)
            top.scatter_reduce_(0, rows[:, None], m_sl, "amax")
            w = exp_(m_sl.sub_(top.index_select(0, rows)))  # over m_sl
            den = torch.zeros(Tn + 1, 1, dtype=cd, device=q.device).index_add_(0, rows, w)
            num = torch.zeros(Tn + 1, Dv, dtype=cd, device=q.device).index_add_(0, rows,
                                                                               o_sl.mul_(w))
            torch.div(num[:Tn], den[:Tn], out=of[g0:g0 + Tn])
            if keep:
                torch.add(top[:Tn], den[:Tn].log_(), out=lf[g0:g0 + Tn])
        if keep:
            ctx.b, ctx.causal, ctx.dtype = b, causal, dtype
            ctx.shapes = q.shape, k.shape, v.shape
            ctx.save_for_backward(qs, kb, vb, out, lse, sel)
        return out.view(*q.shape[:3], Dv).to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qs, kb, vb, out, lse, sel = ctx.saved_tensors
        b, causal = ctx.b, ctx.causal
        qshape, kshape, vshape = ctx.shapes
        lay = _Layout(qs.view(qshape), kshape[1], sel, b, causal)
        BH, M, N, D, C, nb, Dv = lay.BH, lay.M, lay.N, lay.D, lay.C, lay.nb, vshape[-1]
        cd = qs.dtype
        dout = dout.to(cd).reshape(BH, M, Dv)
        delta = torch.linalg.vecdot(dout, out).unsqueeze(-1)  # (B Hk, M, 1): rowsum(dO o)
        dq = torch.empty_like(qs)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
        ws = Workspace(qs)
        qf, dof, lf, df = (t.view(BH * M, -1) for t in (qs, dout, lse, delta))
        dqf = dq.view(BH * M, D)
        for g0, Tn, q0, Q, rows, grp, blk, need in lay.tiles():
            n_all = len(grp)
            qt = _with_zero_row(ws, "qt", qf[g0:g0 + Tn])
            dot = _with_zero_row(ws, "dot", dof[g0:g0 + Tn])
            lt = _with_zero_row(ws, "lt", lf[g0:g0 + Tn])
            dt = _with_zero_row(ws, "dt", df[g0:g0 + Tn])
            dqt = ws("dqt", Tn + 1, D).zero_()
            for c0 in range(0, n_all, lay.steps):
                c1 = min(n_all, c0 + lay.steps)
                n, r, bl = c1 - c0, rows[c0 * C:c1 * C], grp[c0:c1]
                qg = torch.index_select(qt, 0, r, out=ws("qg", n * C, D)).view(n, C, D)
                dog = torch.index_select(dot, 0, r, out=ws("dog", n * C, Dv)).view(n, C, Dv)
                kg = torch.index_select(kb, 0, bl, out=ws("kg", n, b * D)).view(n, b, D)
                vg = torch.index_select(vb, 0, bl, out=ws("vg", n, b * Dv)).view(n, b, Dv)
                p = torch.bmm(qg, kg.transpose(1, 2), out=ws("s", n, C, b))
                _mask_step(p, need[c0:c1], blk[c0:c1], r, Q, q0, Tn, b, N, causal)
                exp_(p.sub_(lt.index_select(0, r).view(n, C, 1)))  # the forward's P
                dvg = torch.bmm(p.transpose(1, 2), dog, out=ws("dvg", n, b, Dv))
                dvb.index_add_(0, bl, dvg.view(n, b * Dv))
                ds = torch.bmm(dog, vg.transpose(1, 2), out=ws("ds", n, C, b))
                ds.sub_(dt.index_select(0, r).view(n, C, 1)).mul_(p)
                dqg = torch.bmm(ds, kg, out=ws("dqg", n, C, D))
                dqt.index_add_(0, r, dqg.view(n * C, D))
                dkg = torch.bmm(ds.transpose(1, 2), qg, out=ws("dkg", n, b, D))
                dkb.index_add_(0, bl, dkg.view(n, b * D))
            # dQ = dS K / sqrt(D): the forward scaled q, so the scale comes back here.
            torch.mul(dqt[:Tn], softmax_scale(D), out=dqf[g0:g0 + Tn])
        dtype = ctx.dtype
        dk = dkb.view(BH, nb * b, D)[:, :N].reshape(kshape).to(dtype)
        dv = dvb.view(BH, nb * b, Dv)[:, :N].reshape(vshape).to(dtype)
        return dq.view(qshape).to(dtype), dk, dv, None, None, None
