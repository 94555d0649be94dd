"""Exact softmax attention of query blocks over gathered key blocks, in plan steps; the
kernel of `block_sparse.py` (q (B, Hq, N, D), k (B, Hk, N, D), v (B, Hk, N, Dv) ->
(B, Hq, nb b, Dv)).

Grouped keys (Hk dividing Hq, SDPA's `enable_gqa` meaning: query head h reads kv head
h // r, r = Hq / Hk) run natively: the layout is every head's, so q is laid out
(B, Hk, nb, r b, D), a query block row holding its r heads' b queries, and each of its
r b rows scores the kv head's key blocks in the same matmul; k and v are never repeated.

A plan (`BlockSparse._plan`) is a list of steps (rows, cols, K, drop): R query blocks of
K key blocks each. A step gathers its rows' key and value blocks as rows of a (B H nb,
b D) view (one dim-0 index op; a view for a row of all blocks), computes its scores
(B H R, b, K b) with one batched matmul into a workspace every step reuses, masks the
columns `drop` names, and softmaxes in place.

Backward (`_BlockRows`, FlashAttention's recomputation: Dao et al. 2022,
https://arxiv.org/abs/2205.14135, Algorithm 4 without tiling): the forward saves only q,
k, v, the output and one log-sum-exp per query; the backward recomputes each row's
scores, P = exp(S - lse), and forms dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
dQ = dS K, dK = dS^T Q, adding into the key blocks' gradients. Plain autograd would keep
every row's gathered keys, values and probabilities: the forward+backward peak at
N = 8192, H = 8, D = 64 read 504 MiB that way and 176 MiB this way (`attnbench
run --preset scaling`, results/scaling-h8-v3 against the same preset at commit 6b3ab61).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core import Workspace, exp_, softmax_, softmax_lse_, softmax_scale


def block_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                         plan: list[tuple]) -> torch.Tensor:
    """Each plan step's query blocks attend its key blocks; (B, H, nb b, D), the rows past
    N padding. Under autograd the backward recomputes the probabilities (`_BlockRows`)."""
    return _BlockRows.apply(q, k, v, block_size, plan)


def _mask(s: torch.Tensor, drop) -> None:
    """-inf into the scores s (B, Hk, R, r, b, K b) where a plan step's drop (R or 1, b,
    K b - a) says: the same for a block row's r query heads."""
    if drop is not None:
        a, m = drop
        s[..., a:].masked_fill_(m.unsqueeze(-3), float("-inf"))


def _take(x: torch.Tensor, sel) -> torch.Tensor:
    """x[:, :, sel] for a slice (a view) or a long tensor (a copy)."""
    return x[:, :, sel] if isinstance(sel, slice) else x.index_select(2, sel)


def _count(sel) -> int:
    """How many blocks a plan step's rows (a slice or a long tensor) hold."""
    return sel.stop - sel.start if isinstance(sel, slice) else len(sel)


def _flat(sel: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Block indices `sel` (n,) of every (B H) slice as rows of a (B H nb, b D) view:
    base (B H, 1) holds each slice's first row. A dim-0 index_select on that 2-d view is a
    row copy, ~2.6x faster than index_select on dim 2 of the 5-d blocks (146 vs 381 us for
    64 blocks at B H = 8, b = D = 64, two threads)."""
    return (base + sel).view(-1)


def _rows(xp: torch.Tensor, sel, base: torch.Tensor, ws: Workspace, name: str) -> torch.Tensor:
    """(B, H, nb, b, D) blocks -> the step's R row blocks as (B H R, b, D): a view for one
    row, else a copy into workspace buffer `name`."""
    B, H, nb, b, D = xp.shape
    R = _count(sel)
    if R == 1:
        i = sel.start if isinstance(sel, slice) else int(sel[0])
        return xp[:, :, i].view(B * H, b, D)
    buf = ws(name, B, H, R, b, D)
    if isinstance(sel, slice):
        buf.copy_(xp[:, :, sel])
    else:
        torch.index_select(xp.view(-1, b * D), 0, _flat(sel, base), out=buf.view(-1, b * D))
    return buf.view(B * H * R, b, D)


def _keys(xp: torch.Tensor, cols, R: int, K: int, base: torch.Tensor, ws: Workspace,
          name: str) -> torch.Tensor:
    """(B, H, nb, b, D) blocks -> each of R rows' K blocks concatenated, (B H R, K b, D):
    a view for the leading blocks 0..K-1 (cols a slice, R = 1), else a copy into
    workspace buffer `name`."""
    B, H, nb, b, D = xp.shape
    if isinstance(cols, slice):
        return xp.view(B * H, nb * b, D)[:, :K * b]
    buf = ws(name, B * H * R * K, b * D)
    torch.index_select(xp.view(-1, b * D), 0, _flat(cols, base), out=buf)
    return buf.view(B * H * R, K * b, D)


def _reserve(ws: Workspace, plan: list[tuple], BH: int, rb: int, b: int, D: int,
             names) -> None:
    """Allocate each workspace buffer once, at the plan's largest step: `names` maps
    each buffer to its shape kind, "row" (R rb D), "keys" (R K b D, gathered steps only)
    or "scores" (R rb K b); rb query rows a block row, D the wider of Dk and Dv."""
    R = max(_count(rows) for rows, _, _, _ in plan)
    RK = max(_count(rows) * K for rows, _, K, _ in plan)
    gathered = [_count(rows) * K for rows, cols, K, _ in plan if not isinstance(cols, slice)]
    size = {"row": R * rb * D, "keys": max(gathered, default=0) * b * D,
            "scores": RK * rb * b}
    for name, kind in names.items():
        if size[kind]:
            ws(name, BH * size[kind])


class _BlockRows(torch.autograd.Function):
    """Exact softmax attention of each query block over its plan's key blocks.

    q, k, v: (B, H, N, D); returns (B, H, nb b, D), the rows past N padding. Each plan
    step is one batched matmul over its rows' gathered key blocks, (B H R, b, K b),
    written into a workspace that every step reuses.
    """

    @staticmethod
    def forward(ctx, q, k, v, b, plan):
        B, Hq, N, D = q.shape
        H, Dv = k.shape[1], v.shape[-1]  # H: the kv heads, each a slice of the kernel
        r = Hq // H
        rb = r * b  # a block row's query rows: its r query heads' b queries
        nb = math.ceil(N / b)
        pad = nb * b - N
        # Block views (B, Hk, nb, r b, D) of q, (B, Hk, nb, b, D | Dv) of k, v; zero-padded
        # keys are masked by the plan. The scale goes on q (N D products), not the scores.
        qp = q.new_zeros(B, Hq, nb * b, D) if pad else q.new_empty(B, Hq, N, D)
        torch.mul(q, softmax_scale(D), out=qp[:, :, :N])
        qp = _to_rows(qp, H, nb, b)
        kp, vp = ((F.pad(t, (0, 0, 0, pad)) if pad else t).contiguous()
                  .view(B, H, nb, b, t.shape[-1]) for t in (k, v))
        out = q.new_empty(B, H, nb, rb, Dv)
        keep = any(ctx.needs_input_grad[:3])  # else nothing is saved: no log-sum-exp needed
        if keep:
            # float32 at least: a bfloat16 lse would shift every recomputed probability.
            lse = q.new_empty(B, H, nb, rb, 1,
                              dtype=torch.promote_types(q.dtype, torch.float32))
        ws = Workspace(q)
        _reserve(ws, plan, B * H, rb, b, max(D, Dv), {"s": "scores", "k": "keys", "v": "keys",
                                                      "q": "row", "o": "row"})
        base = torch.arange(0, B * H * nb, nb, device=q.device)[:, None]  # (B H, 1)
        for rows, cols, K, drop in plan:
            R = _count(rows)
            s = torch.bmm(_rows(qp, rows, base, ws, "q"),
                          _keys(kp, cols, R, K, base, ws, "k").transpose(1, 2),
                          out=ws("s", B * H * R, rb, K * b))
            _mask(s.view(B, H, R, r, b, K * b), drop)
            if keep:
                _put(lse, rows, softmax_lse_(s).view(B, H, R, rb, 1), base)
            else:
                softmax_(s)
            o = torch.bmm(s, _keys(vp, cols, R, K, base, ws, "v"),
                          out=ws("o", B * H * R, rb, Dv))
            _put(out, rows, o.view(B, H, R, rb, Dv), base)
        if keep:
            ctx.plan, ctx.N, ctx.b = plan, N, b
            ctx.save_for_backward(qp, kp, vp, out, lse)
        return _from_rows(out, Hq, b).reshape(B, Hq, nb * b, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qp, kp, vp, out, lse = ctx.saved_tensors
        B, H, nb, rb, D = qp.shape
        b, Dv = ctx.b, vp.shape[-1]
        r, BH = rb // b, B * H
        dout = _to_rows(dout, H, nb, b)  # (B, Hk, nb, r b, Dv)
        delta = torch.linalg.vecdot(dout, out).unsqueeze(-1)  # (B, H, nb, b, 1): rowsum(dO * O)
        dq = torch.empty_like(qp)
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
        ws = Workspace(qp)
        _reserve(ws, ctx.plan, BH, rb, b, max(D, Dv), {"s": "scores", "dp": "scores", "dk": "keys",
                                          "dv": "keys", "k": "keys", "v": "keys",
                                          "q": "row", "do": "row", "o": "row"})
        base = torch.arange(0, BH * nb, nb, device=qp.device)[:, None]  # (B H, 1)
        for rows, cols, K, drop in ctx.plan:
            R = _count(rows)
            qr, do = _rows(qp, rows, base, ws, "q"), _rows(dout, rows, base, ws, "do")
            kr = _keys(kp, cols, R, K, base, ws, "k")  # (B H R, K b, D)
            vr = _keys(vp, cols, R, K, base, ws, "v")
            s = torch.bmm(qr, kr.transpose(1, 2), out=ws("s", BH * R, rb, K * b))
            _mask(s.view(B, H, R, r, b, K * b), drop)
            p = exp_(s.sub_(_take(lse, rows).reshape(BH * R, rb, 1)))  # the forward's
            dvr = torch.bmm(p.transpose(1, 2), do, out=ws("dv", BH * R, K * b, Dv))
            ds = torch.bmm(do, vr.transpose(1, 2), out=ws("dp", BH * R, rb, K * b))
            ds.sub_(_take(delta, rows).reshape(BH * R, rb, 1)).mul_(p)
            # dQ = dS K / sqrt(D): the forward scaled q, so the scale comes back here, as
            # the matmul's alpha rather than a pass over dq.
            o = ws("o", BH * R, rb, D)
            dqr = torch.baddbmm(o, ds, kr, beta=0, alpha=softmax_scale(D), out=o)
            _put(dq, rows, dqr.view(B, H, R, rb, D), base)
            dkr = torch.bmm(ds.transpose(1, 2), qr, out=ws("dk", BH * R, K * b, D))
            if isinstance(cols, slice):
                dk.view(BH, nb * b, D)[:, :K * b] += dkr
                dv.view(BH, nb * b, Dv)[:, :K * b] += dvr
            else:
                at = _flat(cols, base)
                dk.view(-1, b * D).index_add_(0, at, dkr.view(-1, b * D))
                dv.view(-1, b * Dv).index_add_(0, at, dvr.view(-1, b * Dv))
        N = ctx.N
        dq = _from_rows(dq, H * r, b).reshape(B, H * r, nb * b, D)[:, :, :N]
        dk, dv = (t.view(B, H, nb * b, t.shape[-1])[:, :, :N] for t in (dk, dv))
        return dq, dk, dv, None, None


def _to_rows(x: torch.Tensor, Hk: int, nb: int, b: int) -> torch.Tensor:
    """(B, Hq, nb b, E) -> (B, Hk, nb, r b, E), r = Hq / Hk: block row i of kv head kv
    holds query heads kv r .. kv r + r - 1's queries of block i, head after head (a copy
    of the queries' side only; a view where r = 1)."""
    B, Hq, _, E = x.shape
    r = Hq // Hk
    if r == 1:
        return x.contiguous().view(B, Hk, nb, b, E)
    return x.reshape(B, Hk, r, nb, b, E).transpose(2, 3).reshape(B, Hk, nb, r * b, E)


def _from_rows(x: torch.Tensor, Hq: int, b: int) -> torch.Tensor:
    """The kernel's (B, Hk, nb, r b, E) -> (B, Hq, nb, b, E); the tensor itself at r = 1."""
    B, Hk, nb, rb, E = x.shape
    if Hq == Hk:
        return x
    return x.view(B, Hk, nb, Hq // Hk, b, E).transpose(2, 3).reshape(B, Hq, nb, b, E)


def _put(x: torch.Tensor, sel, value: torch.Tensor, base: torch.Tensor) -> None:
    """x[:, :, sel] = value, for a slice or a long tensor; x (B, H, nb, b, E) contiguous."""
    if isinstance(sel, slice):
        x[:, :, sel] = value
    else:
        E = x.shape[3] * x.shape[4]
        # index_copy_ does not cast: a bfloat16 block's lse goes into a float32 buffer.
        x.view(-1, E).index_copy_(0, _flat(sel, base), value.reshape(-1, E).to(x.dtype))
