"""Exact softmax of each query over the key blocks it selected, laid out per key block;
the kernel of `moba` and `quest` (q, k, v (B, H, N, D), a selection (B, H, N, kk) -> o).

Gathering each query's kk blocks of b keys would hold N kk b D numbers. Instead the work
goes per key block: for one (batch, head) slice and one tile of T queries, the queries
that selected block j are listed (a scatter into a (nb, T) bool table and its `nonzero`,
which comes out sorted by block: no sort) and cut into chunks of C rows, the last one
padded with a zero query. A step takes a few dozen chunks: it gathers their query rows
and key blocks, scores them with one batched matmul (n, C, b), masks only the chunks
that need it (the partial last block's padding; causal, the blocks the tile's own
queries sit in: they come last, blocks being in order), and keeps per (query, block)
row its max m, sum l and unnormalised output o. The tile then merges each query's kk
rows as online softmax does (Milakov & Gimelshein 2018): M = max m, L = sum l e^(m - M),
o = sum o e^(m - M) / L, with a scatter-max and two index_adds. Memory is O(T kk D) a
tile plus the O(N kk) selection; time O(N kk b D).

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
    """Each query's exact softmax over the keys of its selected blocks (B, H, N, kk; -1:
    none), with j <= i inside its own block when causal; (B, H, N, D) in q's dtype.
    Gradients flow to q, k, v through the selected scores, not through the selection."""
    return _RoutedRows.apply(q, k, v, sel, block_size, causal)


def _tile_rows(N: int, kk: int, nb: int) -> int:
    """Queries per tile: _TILE_PAIRS pairs, and at least two chunks' worth of queries per
    block on average, so that the padding of each block's last chunk stays a small part."""
    return max(1, min(N, max(_TILE_PAIRS // kk, 2 * _CHUNK * nb // kk)))


def _chunk_rows(T: int, kk: int, nb: int) -> int:
    """Rows per chunk: _CHUNK, or fewer where a tile's blocks average fewer queries (a
    short sequence of small blocks), so that padding does not outweigh the work: the
    power of two at or above the mean, at least 8."""
    mean = max(1, T * kk // nb)
    return min(_CHUNK, max(8, 1 << (mean - 1).bit_length()))


def _plan(sel_t: torch.Tensor, nb: int, first_masked: int, C: int) -> tuple:
    """A tile's chunks of C rows from its queries' selection sel_t (T, kk): (rows, blk, a).

    rows (n C,): each chunk slot's query (local index; T, a zero row, pads a chunk);
    blk (n,): each chunk's key block, ascending; a: the first chunk whose block is
    >= first_masked (those need a mask).
    """
    T, kk = sel_t.shape
    hit = torch.zeros(nb + 1, T, dtype=torch.bool, device=sel_t.device)
    st = sel_t.t()
    hit.scatter_(0, st.masked_fill(st < 0, nb), True)  # -1 lands in the spare row
    blk_of, i = hit[:nb].nonzero(as_tuple=True)  # by block, then query
    cnt = torch.bincount(blk_of, minlength=nb)
    nch = (cnt + C - 1) // C
    first = nch.cumsum(0) - nch  # each block's first chunk
    total = int(nch.sum())
    pos = torch.arange(len(i), device=i.device) - (cnt.cumsum(0) - cnt)[blk_of]
    rows = torch.full((total * C,), T, dtype=torch.long, device=i.device)
    rows[first[blk_of] * C + pos] = i
    blk = torch.repeat_interleave(torch.arange(nb, device=i.device), nch)
    a = int(first[first_masked]) if first_masked < nb else total
    return rows, blk, a


def _mask(sc: torch.Tensor, blk: torch.Tensor, rows: torch.Tensor, s0: int, b: int, N: int,
          causal: bool) -> None:
    """-inf into the scores sc (n, C, b) of chunks blk (n,) with query slots rows (n C,):
    padded keys (token >= N) and, causal, keys after the query."""
    ktok = blk[:, None, None] * b + torch.arange(b, device=sc.device)  # (n, 1, b)
    drop = ktok >= N
    if causal:
        drop = drop | (ktok > (rows + s0).view(-1, sc.shape[1], 1))
    sc.masked_fill_(drop, float("-inf"))


class _Layout:
    """The shapes of one call: slices, blocks, tiles, and the tiles' plans."""

    def __init__(self, q: torch.Tensor, sel: torch.Tensor, b: int, causal: bool):
        B, H, N, D = q.shape
        self.BH, self.N, self.D, self.b, self.causal = B * H, N, D, b, causal
        self.nb = math.ceil(N / b)
        self.kk = sel.shape[-1]
        self.sel = sel.reshape(self.BH, N, self.kk)
        self.T = _tile_rows(N, self.kk, self.nb)
        self.C = _chunk_rows(self.T, self.kk, self.nb)
        self.steps = max(1, _STEP_BYTES // (self.C * b * 4))  # chunks a step

    def tiles(self):
        """(bh, s0, Tn, rows, blk, a) for each slice and tile of queries [s0, s0 + Tn)."""
        partial = self.nb * self.b > self.N
        for bh in range(self.BH):
            for s0 in range(0, self.N, self.T):
                Tn = min(self.T, self.N - s0)
                first = min(self.nb - 1 if partial else self.nb,
                            s0 // self.b if self.causal else self.nb)
                yield (bh, s0, Tn) + _plan(self.sel[bh, s0:s0 + Tn], self.nb, first, self.C)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) -> zero-padded key blocks (B H, nb, b D), contiguous."""
        pad = self.nb * self.b - self.N
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.reshape(self.BH, self.nb, self.b * self.D)


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
        lay = _Layout(q, sel, b, causal)
        BH, N, D, C = lay.BH, lay.N, lay.D, lay.C
        qs = (q.to(cd) * softmax_scale(D)).reshape(BH, N, D)
        kb, vb = lay.blocks(k.to(cd)), lay.blocks(v.to(cd))
        out = torch.empty(BH, N, D, dtype=cd, device=q.device)
        keep = any(ctx.needs_input_grad[:3])
        lse = torch.empty(BH, N, 1, dtype=cd, device=q.device) if keep else None
        ws = Workspace(qs)
        for bh, s0, Tn, rows, blk, a in lay.tiles():
            n_all = len(blk)
            qt = _with_zero_row(ws, "qt", qs[bh, s0:s0 + Tn])
            o_sl, m_sl = ws("o", n_all * C, D), ws("m", n_all * C, 1)
            for c0 in range(0, n_all, lay.steps):
                c1 = min(n_all, c0 + lay.steps)
                n, r = c1 - c0, rows[c0 * C:c1 * C]
                qg = torch.index_select(qt, 0, r, out=ws("qg", n * C, D)).view(n, C, D)
                kg = torch.index_select(kb[bh], 0, blk[c0:c1], out=ws("kg", n, b * D))
                vg = torch.index_select(vb[bh], 0, blk[c0:c1], out=ws("vg", n, b * D))
                sc = torch.bmm(qg, kg.view(n, b, D).transpose(1, 2), out=ws("s", n, C, b))
                if c1 > a:
                    m0 = max(a, c0)
                    _mask(sc[m0 - c0:], blk[m0:c1], rows[m0 * C:c1 * C], s0, b, N, causal)
                m_sl[c0 * C:c1 * C] = softmax_lse_(sc).view(n * C, 1)  # sc is now P
                torch.bmm(sc, vg.view(n, b, D), out=o_sl[c0 * C:c1 * C].view(n, C, D))
            # Merge each query's rows (slot x belongs to query rows[x]; T pads): its
            # log-sum-exp over all of them, then the rows weighted by e^(lse_row - lse).
            top = torch.full((Tn + 1, 1), float("-inf"), dtype=cd, device=q.device)
            top.scatter_reduce_(0, rows[:, None], m_sl, "amax")
            w = exp_(m_sl.sub_(top.index_select(0, rows)))  # over m_sl
            den = torch.zeros(Tn + 1, 1, dtype=cd, device=q.device).index_add_(0, rows, w)
            num = torch.zeros(Tn + 1, D, dtype=cd, device=q.device).index_add_(0, rows,
                                                                               o_sl.mul_(w))
            torch.div(num[:Tn], den[:Tn], out=out[bh, s0:s0 + Tn])
            if keep:
                torch.add(top[:Tn], den[:Tn].log_(), out=lse[bh, s0:s0 + Tn])
        if keep:
            ctx.b, ctx.causal, ctx.shape, ctx.dtype = b, causal, q.shape, dtype
            ctx.save_for_backward(qs, kb, vb, out, lse, sel)
        return out.view(q.shape).to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qs, kb, vb, out, lse, sel = ctx.saved_tensors
        b, causal = ctx.b, ctx.causal
        lay = _Layout(qs.view(ctx.shape), sel, b, causal)
        BH, N, D, C, nb = lay.BH, lay.N, lay.D, lay.C, lay.nb
        cd = qs.dtype
        dout = dout.to(cd).reshape(BH, N, D)
        delta = torch.linalg.vecdot(dout, out).unsqueeze(-1)  # (B H, N, 1): rowsum(dO o)
        dq = torch.empty_like(qs)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
        ws = Workspace(qs)
        for bh, s0, Tn, rows, blk, a in lay.tiles():
            n_all = len(blk)
            qt = _with_zero_row(ws, "qt", qs[bh, s0:s0 + Tn])
            dot = _with_zero_row(ws, "dot", dout[bh, s0:s0 + Tn])
            lt = _with_zero_row(ws, "lt", lse[bh, s0:s0 + Tn])
            dt = _with_zero_row(ws, "dt", delta[bh, s0:s0 + Tn])
            dqt = ws("dqt", Tn + 1, D).zero_()
            for c0 in range(0, n_all, lay.steps):
                c1 = min(n_all, c0 + lay.steps)
                n, r, bl = c1 - c0, rows[c0 * C:c1 * C], blk[c0:c1]
                qg = torch.index_select(qt, 0, r, out=ws("qg", n * C, D)).view(n, C, D)
                dog = torch.index_select(dot, 0, r, out=ws("dog", n * C, D)).view(n, C, D)
                kg = torch.index_select(kb[bh], 0, bl, out=ws("kg", n, b * D)).view(n, b, D)
                vg = torch.index_select(vb[bh], 0, bl, out=ws("vg", n, b * D)).view(n, b, D)
                p = torch.bmm(qg, kg.transpose(1, 2), out=ws("s", n, C, b))
                if c1 > a:
                    m0 = max(a, c0)
                    _mask(p[m0 - c0:], blk[m0:c1], rows[m0 * C:c1 * C], s0, b, N, causal)
                exp_(p.sub_(lt.index_select(0, r).view(n, C, 1)))  # the forward's P
                dvg = torch.bmm(p.transpose(1, 2), dog, out=ws("dvg", n, b, D))
                dvb[bh].index_add_(0, bl, dvg.view(n, b * D))
                ds = torch.bmm(dog, vg.transpose(1, 2), out=ws("ds", n, C, b))
                ds.sub_(dt.index_select(0, r).view(n, C, 1)).mul_(p)
                dqg = torch.bmm(ds, kg, out=ws("dqg", n, C, D))
                dqt.index_add_(0, r, dqg.view(n * C, D))
                dkg = torch.bmm(ds.transpose(1, 2), qg, out=ws("dkg", n, b, D))
                dkb[bh].index_add_(0, bl, dkg.view(n, b * D))
            # dQ = dS K / sqrt(D): the forward scaled q, so the scale comes back here.
            torch.mul(dqt[:Tn], softmax_scale(D), out=dq[bh, s0:s0 + Tn])
        shape, dtype = ctx.shape, ctx.dtype
        dk = dkb.view(BH, nb * b, D)[:, :N].reshape(shape).to(dtype)
        dv = dvb.view(BH, nb * b, D)[:, :N].reshape(shape).to(dtype)
        return dq.view(shape).to(dtype), dk, dv, None, None, None
