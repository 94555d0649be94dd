"""NSA's compressed branch and its block selection, a query chunk at a time (Native Sparse
Attention, Yuan et al. 2025, arXiv:2502.11089, Sec. 3.3.1-3.3.2).

Geometry (0-based positions; `block` l, `stride` d, `select_block` l', d | l, d | l'):

  * compressed block i covers tokens i d .. i d + l - 1, its key and value the mean of
    theirs (mean pooling: fla's training-free phi; the paper's phi is a learned MLP with an
    intra-block position encoding); query t sees block i when it ends at or before t,
    i d + l - 1 <= t, so `compressed_count(t + 1)` blocks (the paper's Eq. 7,
    0 <= i <= floor((t - l) / d) in its 1-based positions);
  * selection block j covers tokens j l' .. j l' + l' - 1; its importance for query t is
    the compressed attention probabilities of t summed over the query heads of its
    key-value group (Eq. 10), each compressed block weighted by how many stride-long
    pieces it shares with selection block j (Eq. 9: sum over m < l'/d, n < l/d of
    p_cmp[j l'/d + m - n]);
  * query t chooses among the blocks that start at or before it (j <= t // l'); the
    initial block and the two local blocks (its own, t // l', and the one before) are
    always chosen (Sec. 4.1: "1 initial block and 2 local blocks"); the rest by importance,
    `top_n` in all, ties toward the later block (as dsa breaks them); where top_n < 3 the
    latest of the forced blocks are kept.

The compressed attention's scores exist one query chunk at a time, (B, Hq, c, nc), and
its selection is made in the same pass from the same probabilities: nothing of N x N/d
is kept but the (B, Hk, N, top_n) block indices. Backward (FlashAttention's
recomputation): the forward keeps q, the compressed keys and values, the output and one
log-sum-exp per query and head; the selection is not differentiated (nor in the paper).
"""

from __future__ import annotations

import torch

from ..core import compute_dtype, softmax_scale
from . import indexer as ix

# Bytes of one query chunk's compressed scores and block importances.
_CHUNK_BYTES = 16 * 2**20


def compressed_count(n: int, block: int, stride: int) -> int:
    """Compressed blocks wholly within n tokens: floor((n - l) / d) + 1, 0 below l."""
    return 0 if n < block else (n - block) // stride + 1


def select_count(n: int, select_block: int) -> int:
    """Selection blocks that start within n tokens."""
    return -(-n // select_block)


def pool(x: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """(B, H, N, W) -> (B, H, nc, W): each compressed block's mean (differentiable)."""
    if x.shape[2] < block:
        return x[:, :, :0]
    return x.unfold(2, block, stride).mean(dim=-1)


def probs(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of masked scores sc (..., n) in place, and its log-sum-exp (..., 1); a row
    with no visible block (all -inf, or n = 0) gets probabilities 0 and lse = +inf (its
    output 0: the branch has nothing to say yet; +inf makes the backward's P 0)."""
    mx = sc.amax(dim=-1, keepdim=True) if sc.shape[-1] else sc.new_full((*sc.shape[:-1], 1),
                                                                          float("-inf"))
    some = mx > float("-inf")
    mx = torch.where(some, mx, torch.zeros_like(mx))
    p = sc.sub_(mx).exp_()
    z = p.sum(dim=-1, keepdim=True)
    p.div_(torch.where(some, z, torch.ones_like(z)))
    return p, torch.where(some, mx + z.log(), torch.full_like(z, float("inf")))


def importance(P: torch.Tensor, ns: int, block: int, stride: int,
               select_block: int) -> torch.Tensor:
    """Selection-block importances (..., ns) from compressed-block probabilities P (...,
    ne) (Eq. 9): p_slc[j] = sum_{m < l'/d, n < l/d} P[j l'/d + m - n], P 0 outside
    0..ne-1."""
    R, L = select_block // stride, block // stride
    ne = P.shape[-1]
    Pp = torch.nn.functional.pad(P, (L - 1, ns * R - ne))
    out = P.new_zeros(*P.shape[:-1], ns)
    for u in range(R + L - 1):
        count = min(u, R - 1) - max(u - L + 1, 0) + 1  # pairs (m, n) with m - n = u - L + 1
        out.add_(Pp[..., u:u + (ns - 1) * R + 1:R], alpha=count)
    return out


def choose(imp: torch.Tensor, t: torch.Tensor, select_block: int, top_n: int) -> torch.Tensor:
    """The blocks queries at positions t (c,) read, from importances imp (..., c, ns):
    (..., c, min(top_n, ns)) long, latest first, -1 where fewer blocks precede the query.
    Causal (j <= t // l'); the initial and the two local blocks forced."""
    j = torch.arange(imp.shape[-1], device=imp.device)
    cur = (t // select_block)[:, None]
    imp = imp.masked_fill(j > cur, float("-inf"))
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    return ix.top_later(imp.masked_fill(forced, float("inf")), top_n)


def chunks(B: int, Hq: int, N: int, nc: int, ns: int) -> list[tuple[int, int]]:
    """Query chunks whose compressed scores and importances fit _CHUNK_BYTES (float32
    counted, whatever the dtype, so that `flops` can follow the cut)."""
    c = max(1, min(N, _CHUNK_BYTES // (4 * B * Hq * (max(nc, 1) + max(ns, 1)))))
    return [(s, min(N, s + c)) for s in range(0, N, c)]


def compressed_attention(q, kc, vc, block, stride, select_block, top_n):
    """The compressed branch's output (B, Hq, N, Dv) and each (batch, key-value head,
    query)'s blocks (B, Hk, N, min(top_n, ns)) int32, -1 padded; gradients reach q, kc, vc."""
    return _Compressed.apply(q, kc, vc, (block, stride, select_block, top_n))


def _scores(qs, kcc, t, ne, block, stride):
    """Scores of scaled queries qs (B, Hk, r, c, D) at positions t against the first ne
    compressed keys, the blocks a query does not see yet at -inf."""
    sc = qs @ kcc[:, :, None, :ne].transpose(-1, -2)  # (B, Hk, r, c, ne)
    seen = torch.where(t + 1 >= block, (t + 1 - block) // stride + 1, 0)
    return sc.masked_fill_(torch.arange(ne, device=qs.device) >= seen[:, None], float("-inf"))


class _Compressed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kc, vc, geom):
        block, stride, select_block, top_n = geom
        B, Hq, N, D = q.shape
        Hk, nc, Dv = kc.shape[1], kc.shape[2], vc.shape[-1]
        r, ns = Hq // Hk, select_count(N, select_block)
        dtype, cd = q.dtype, compute_dtype(q.dtype)
        qs = (q.to(cd) * softmax_scale(D)).reshape(B, Hk, r, N, D)
        kcc, vcc = kc.to(cd), vc.to(cd)
        out = qs.new_zeros(B, Hk, r, N, Dv)
        lse = qs.new_full((B, Hk, r, N, 1), float("inf"))
        sel = torch.full((B, Hk, N, min(top_n, ns)), -1, dtype=torch.int32, device=q.device)
        with torch.no_grad():
            for s, e in chunks(B, Hq, N, nc, ns):
                t = torch.arange(s, e, device=q.device)
                ne = compressed_count(e, block, stride)
                if ne:
                    p, lse[:, :, :, s:e] = probs(_scores(qs[:, :, :, s:e], kcc, t, ne,
                                                         block, stride))
                    out[:, :, :, s:e] = p @ vcc[:, :, None, :ne]
                    P = p.sum(dim=2)  # (B, Hk, c, ne): summed over the group's heads
                else:
                    P = qs.new_zeros(B, Hk, e - s, 0)
                imp = importance(P, select_count(e, select_block), block, stride,
                                 select_block)
                top = choose(imp, t, select_block, top_n)
                sel[:, :, s:e, :top.shape[-1]] = top.to(torch.int32)
        ctx.mark_non_differentiable(sel)
        if any(ctx.needs_input_grad[:3]):
            ctx.geom, ctx.dtype = geom, (q.dtype, kc.dtype, vc.dtype)
            ctx.save_for_backward(qs, kcc, vcc, out, lse)
        return out.view(B, Hq, N, Dv).to(dtype), sel

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dsel):
        qs, kcc, vcc, out, lse = ctx.saved_tensors
        block, stride, select_block, _ = ctx.geom
        B, Hk, r, N, D = qs.shape
        nc = kcc.shape[2]
        do = dout.to(qs.dtype).reshape(out.shape)
        delta = torch.linalg.vecdot(do, out).unsqueeze(-1)  # rowsum(dO o)
        dq = torch.zeros_like(qs)
        dkc, dvc = torch.zeros_like(kcc), torch.zeros_like(vcc)
        for s, e in chunks(B, Hk * r, N, nc, select_count(N, select_block)):
            ne = compressed_count(e, block, stride)
            if not ne:
                continue
            t = torch.arange(s, e, device=qs.device)
            qc, dog = qs[:, :, :, s:e], do[:, :, :, s:e]
            p = _scores(qc, kcc, t, ne, block, stride).sub_(lse[:, :, :, s:e]).exp_()
            dvc[:, :, :ne] += (p.transpose(-1, -2) @ dog).sum(dim=2)
            ds = (dog @ vcc[:, :, None, :ne].transpose(-1, -2)).sub_(delta[:, :, :, s:e]).mul_(p)
            dq[:, :, :, s:e] = ds @ kcc[:, :, None, :ne]
            dkc[:, :, :ne] += (ds.transpose(-1, -2) @ qc).sum(dim=2)
        dq = (dq * softmax_scale(D)).view(B, Hk * r, N, D).to(ctx.dtype[0])
        return dq, dkc.to(ctx.dtype[1]), dvc.to(ctx.dtype[2]), None


class BlockRows:
    """A (B', N, nb l') view of the tokens of each query's chosen blocks (B', N, nb),
    expanded one chunk at a time for `gathered_attention`: -1 for a block not chosen and
    for the tokens after the query (its own block's later part)."""

    def __init__(self, blocks: torch.Tensor, select_block: int):
        self.blocks, self.size = blocks, select_block
        self.shape = (*blocks.shape[:2], blocks.shape[2] * select_block)

    def __getitem__(self, index):
        rows = index[1]
        b = self.blocks[:, rows].long()  # (B', c, nb)
        t = torch.arange(self.blocks.shape[1], device=b.device)[rows]
        tok = b[..., None] * self.size + torch.arange(self.size, device=b.device)
        bad = (b[..., None] < 0) | (tok > t[None, :, None, None])
        return tok.masked_fill_(bad, -1).flatten(2)


class WindowRows:
    """(B, N, min(w, N)): query t's window t - w + 1 .. t, latest first, -1 before 0."""

    def __init__(self, B: int, N: int, window: int, device):
        self.shape, self.device = (B, N, min(window, N)), device

    def __getitem__(self, index):
        rows = index[1]
        B, N, w = self.shape
        t = torch.arange(N, device=self.device)[rows]
        tok = t[:, None] - torch.arange(w, device=self.device)
        return tok.masked_fill_(tok < 0, -1).expand(B, -1, -1)
