"""NSA: Native Sparse Attention (Yuan et al. 2025, arXiv:2502.11089, Sec. 3): three
branches over each query's earlier tokens, mixed by per-query, per-head gates,

    o_t = gate_cmp(t) Attn(q_t, compressed K, V) + gate_slc(t) Attn(q_t, selected blocks)
          + gate_win(t) Attn(q_t, the last `window` tokens)                       (Eq. 5)

  * compressed: blocks of `block` tokens at `stride`, each pooled to one key and value by
    its mean (fla's training-free form, fla/ops/nsa/naive.py; the paper learns an MLP with
    an intra-block position encoding); a block is seen once it ends at or before the query;
  * selected: `top_n` blocks of `select_block` tokens by importance, the compressed
    attention's probabilities summed over the query heads of a key-value group (one
    selection a group, as the paper's GQA kernel shares it; Eq. 9-11), the initial block
    and the two local blocks always among them, ties toward the later block; exact softmax
    over their tokens up to the query;
  * window: exact softmax over tokens t - window + 1 .. t.

Each branch is its own softmax (the gates mix outputs, not scores). `blocks.py` holds the
compressed branch and the selection, made from its probabilities in the same query-chunk
pass; the selected blocks and the window run on dsa's gather kernel (`gathered.py`),
their token indices expanded one chunk at a time. The decoder keeps the key-value cache
(a block anywhere may be chosen) and the compressed keys and values of every complete
block; a step reads those, its chosen blocks and its window.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import (Contract, DecodeState, Grouping, InputSpec, Variant, compute_dtype, param,
                    register, softmax_scale)
from . import blocks as bk
from .gathered import gathered_attention
from .reference import nsa_weights

GATES = ("gate_cmp", "gate_slc", "gate_win")


@dataclasses.dataclass(frozen=True)
class NsaParams:
    block: int = param(32, doc="compression block length l (the paper: 32)", min=1)
    stride: int = param(16, doc="compression stride d, dividing block and select_block "
                                "(the paper: 16)", min=1)
    select_block: int = param(64, doc="selection block length l' (the paper: 64)", min=1)
    top_n: int = param(16, doc="blocks each key-value group's query reads, the initial and "
                               "two local blocks among them (the paper: 16)", min=1)
    window: int = param(512, doc="sliding window w: keys t - w + 1 .. t (the paper: 512)",
                        min=1)

    def __post_init__(self):
        if self.block % self.stride:
            raise ValueError(f"stride {self.stride} must divide block {self.block} "
                             "(NSA's compressed blocks, arXiv:2502.11089 Eq. 9)")
        if self.select_block % self.stride:
            raise ValueError(f"stride {self.stride} must divide select_block "
                             f"{self.select_block} (NSA's block importance, Eq. 9)")


def _gate(gen, B, H, N, D):
    return torch.sigmoid(torch.randn(B, H, N, generator=gen))


GATE_INPUTS = tuple(
    InputSpec(name, ("B", "H", "N"), 0.0, 1.0,
              "sigmoid(N(0, 1)) (the gate MLP's sigmoid at initialisation)", _gate,
              doc=f"the {what} branch's gate, one a query head and token",
              layer="sigmoid")  # trained: sigmoid(W x + b) per head (NSA Sec. 3.1's gate)
    for name, what in zip(GATES, ("compressed", "selected", "sliding-window")))


@dataclasses.dataclass
class NsaCache(DecodeState):
    """Keys (B, Hk, max_len, D) and values (B, Hk, max_len, Dv), the first n written; the
    compressed keys and values (B, Hk, nc(max_len), .), the first nc(n) written; the
    query heads, which the gates of a context taken in pieces follow."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    n: int
    q_heads: int

    def query_heads(self) -> int:
        return self.q_heads

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens and blocks are overwritten by the next appends


@register
class Nsa(Variant):
    """Native Sparse Attention: gated compressed, top_n selected-block and window branches.

    Causal only (a decoder-model mechanism). The gates are declared inputs (B, Hq, N) in
    [0, 1], drawn as sigmoid(N(0, 1)) for timing. The block selection is shared by the
    query heads of a key-value group, so a grouped call is not its call on the heads
    repeated (each head its own group): the contract says so (`Grouping.group_selects`),
    and the conformance kit compares the two with a group's query heads equal.
    """
    name = "nsa"
    family = "learned_sparse"
    Params = NsaParams
    paper = "https://arxiv.org/abs/2502.11089"
    contract = Contract(
        causal="causal_only", refused_why="nsa's compressed blocks and selection read each "
        "token's earlier keys (the paper's decoder-only form): non-causal attention is "
        "refused", decoding=True, extend=True, weights=True, inputs=GATE_INPUTS,
        grouping=Grouping("kv", "native", value_dim=True, group_selects=True))

    # -- the forward ----------------------------------------------------------------
    def branches(self, q, k, v):
        """(o_cmp, o_slc, o_win), each (B, Hq, N, Dv), and the chosen blocks (B, Hk, N,
        min(top_n, ns)) int32."""
        p = self.params
        B, Hq, N, D = q.shape
        Hk, Dv = k.shape[1], v.shape[-1]
        kc, vc = bk.pool(k, p.block, p.stride), bk.pool(v, p.block, p.stride)
        o_cmp, sel = bk.compressed_attention(q, kc, vc, p.block, p.stride, p.select_block,
                                             p.top_n)
        rows = bk.BlockRows(sel.view(B * Hk, N, -1), p.select_block)
        o_slc = gathered_attention(q.reshape(B * Hk, Hq // Hk, N, D), k.reshape(B * Hk, 1, N, D),
                                   v.reshape(B * Hk, 1, N, Dv), rows).reshape(B, Hq, N, Dv)
        o_win = gathered_attention(q, k, v, bk.WindowRows(B, N, p.window, q.device))
        return o_cmp, o_slc, o_win, sel

    def attend(self, q, k, v, causal, gate_cmp, gate_slc, gate_win):
        if q.shape[-2] == 0:
            return q.new_empty(*q.shape[:3], v.shape[-1])
        o_cmp, o_slc, o_win, _ = self.branches(q, k, v)
        return (gate_cmp[..., None] * o_cmp + gate_slc[..., None] * o_slc
                + gate_win[..., None] * o_win)

    def select(self, q, k) -> torch.Tensor:
        """The blocks each (batch, key-value head, query) reads, (B, Hk, N, min(top_n,
        ns)) int32, latest first, -1 where fewer precede it; not differentiated."""
        p = self.params
        with torch.no_grad():
            kc = bk.pool(k, p.block, p.stride)
            return bk.compressed_attention(q, kc, kc[..., :1], p.block, p.stride,
                                           p.select_block, p.top_n)[1]

    # -- the Sparse Frontier (harness.measure.worker, `selection`) ---------------------
    # top_n sets the budget; the frontier preset scales block, stride, select_block and
    # window with N (the issue's window + top_n l' + N / d = the budget).
    budget_param = "top_n"

    def selection(self, q, k, causal=True, **inputs):
        """`select`: the compressed scores and the block choice, as forward computes them
        (NSA's selection cost; the compressed branch's values are not read)."""
        return self.select(q, k)

    def selection_cost(self, B, H, Hk, N, D, causal=True, itemsize=4):
        """The compressed scores of each query chunk against the blocks its last query
        sees, 2 D a compressed key and query head (as `flops` counts them; the forward's
        compressed branch shares them), and 2 more for `select`'s pass over a one-wide
        value (the probabilities' product, discarded); one compressed key read a block and
        kv head. The importances' sums are not matmuls and are not counted."""
        if N == 0:
            return 0.0, 0.0
        p = self.params
        ns = bk.select_count(N, p.select_block)
        nc = bk.compressed_count(N, p.block, p.stride)
        keys = sum((e - s) * bk.compressed_count(e, p.block, p.stride)
                   for s, e in bk.chunks(B, H, N, nc, ns)) / N
        return 2 * H * (D + 1) * keys, Hk * D * itemsize * keys

    def selected_keys(self, selection, rows, N, causal):
        """(B, Hk, R, N): the keys NSA's two exact-softmax branches read for query rows
        `rows`, its chosen blocks' tokens up to the query and its window. The compressed
        branch reads pooled keys, none of them a key: its share is outside the mass."""
        p = self.params
        rows = rows.to(selection.device)
        sel = selection[:, :, rows].long()  # (B, Hk, R, nb), -1 for none
        ns = bk.select_count(N, p.select_block)
        chosen = torch.zeros(*sel.shape[:3], ns + 1, dtype=torch.bool, device=sel.device)
        chosen.scatter_(-1, sel.masked_fill(sel < 0, ns), True)
        j = torch.arange(N, device=sel.device)
        m = chosen[..., j // p.select_block]  # (B, Hk, R, N): a chosen block's tokens
        m |= (j[None, :] > rows[:, None] - p.window)
        return m & (j[None, :] <= rows[:, None])

    def attention_weights(self, q, k, causal, gate_cmp, gate_slc, gate_win):
        p = self.params
        w = nsa_weights(q, k, gate_cmp, gate_slc, gate_win, p.block, p.stride,
                        p.select_block, p.top_n, p.window)
        return w.to(q.dtype)

    def flops(self, B, H, N, D, causal=False):
        """As computed: the compressed scores of each query chunk against the blocks its
        last query sees, 4 H D a pair; every query's min(top_n, ns) l' selected slots
        and min(window, N) window slots, filled or not, 4 H D a slot."""
        if N == 0:
            return 0
        p = self.params
        ns = bk.select_count(N, p.select_block)
        nc = bk.compressed_count(N, p.block, p.stride)
        pairs = sum((e - s) * bk.compressed_count(e, p.block, p.stride)
                    for s, e in bk.chunks(B, H, N, nc, ns))
        slots = min(p.top_n, ns) * p.select_block + min(p.window, N)
        return B * 4 * H * D * (pairs + N * slots)

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        """Tokens a query's three branches read, by their count (a token in a chosen
        block and the window counts twice, as a compressed key counts once): the mean
        over queries of the compressed keys it sees, its chosen blocks' tokens up to it,
        and min(window, t + 1)."""
        if N == 0:
            return 0.0
        return float(self._reads(torch.arange(1, N + 1, dtype=torch.float64)).mean())

    def _reads(self, n):
        """Tokens (compressed, selected, window) the query at position n - 1 reads (n an
        int, or a tensor of them)."""
        p = self.params
        if isinstance(n, int):
            return int(self._reads(torch.tensor([n], dtype=torch.float64))[0])
        nb = torch.ceil(n / p.select_block)
        selected = nb.clamp(max=p.top_n) * p.select_block - (nb * p.select_block - n)
        cmp = torch.where(n >= p.block, torch.floor((n - p.block) / p.stride) + 1, 0)
        return cmp + selected + n.clamp(max=p.window)

    # -- decoding -----------------------------------------------------------------
    def state_size(self, N, D):
        """Per head as if alone: the cache, 2 N D, and the compressed keys and values."""
        return 2 * D * (N + bk.compressed_count(N, self.params.block, self.params.stride))

    def state_size_at(self, N, s):
        return s.Hk * (N + bk.compressed_count(N, self.params.block, self.params.stride)) \
            * (s.D + s.Dv)

    def decode_read_size(self, N, D):
        return 2 * D * self._reads(N)

    def decode_read_size_at(self, N, s):
        """A step whose query is the N-th token (the cache then holds N, the paper's s):
        per key-value head, the keys and values of the compressed blocks it sees,
        floor((N - block) / stride) + 1, of its group's chosen blocks up to the query,
        min(top_n, ceil(N / l')) l' less the current block's unwritten tail, and of its
        window, min(window, N): the paper's (s - l) / d + n l' + w (Sec. 5.2, Table 4)
        where N is a multiple of l' past n l' and w, its compressed count plus one (the
        block i = 0 of Eq. 7)."""
        return s.Hk * self._reads(N) * (s.D + s.Dv)

    def decode_flops_at(self, N, s):
        return self.softmax_step_flops(self._reads(N), s)

    def decode_prefill(self, k, v, max_len, **inputs):
        p = self.params
        B, Hk, _, D = k.shape
        nc = bk.compressed_count(max_len, p.block, p.stride)
        state = NsaCache(k.new_empty(B, Hk, max_len, D), v.new_empty(B, Hk, max_len, v.shape[-1]),
                         k.new_empty(B, Hk, nc, D), v.new_empty(B, Hk, nc, v.shape[-1]), 0,
                         inputs["gate_cmp"].shape[1] if inputs else Hk)
        return self.decode_extend(state, k, v)

    def decode_extend(self, state, k, v, **inputs):
        p = self.params
        n, m = state.n, k.shape[-2]
        if n + m > state.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {state.k.shape[-2]} tokens")
        state.k[:, :, n:n + m], state.v[:, :, n:n + m] = k, v
        state.n = n + m
        c0, c1 = (bk.compressed_count(x, p.block, p.stride) for x in (n, n + m))
        if c1 > c0:  # the blocks these tokens complete, pooled as the forward pools them
            lo, hi = c0 * p.stride, (c1 - 1) * p.stride + p.block
            state.kc[:, :, c0:c1] = bk.pool(state.k[:, :, lo:hi], p.block, p.stride)
            state.vc[:, :, c0:c1] = bk.pool(state.v[:, :, lo:hi], p.block, p.stride)
        return state

    def read_plan(self, state, q):
        """What a step at the state's last token reads, per (batch, key-value head): the
        compressed blocks it sees (a count, nc: all complete ones), the chosen blocks'
        token indices (B, Hk, nb l'), -1 for none, and the window's first and last
        token; and the compressed branch's probabilities (B, Hk, r, nc)."""
        p = self.params
        n, cd = state.n, compute_dtype(q.dtype)
        B, Hq, _, D = q.shape
        Hk = state.k.shape[1]
        nc = bk.compressed_count(n, p.block, p.stride)
        qs = (q.to(cd) * softmax_scale(D)).reshape(B, Hk, Hq // Hk, 1, D)
        t = torch.tensor([n - 1], device=q.device)
        if nc:
            prob = bk.probs(bk._scores(qs, state.kc.to(cd), t, nc, p.block, p.stride))[0]
            P = prob.sum(dim=2)  # (B, Hk, 1, nc)
        else:
            prob, P = None, qs.new_zeros(B, Hk, 1, 0)
        imp = bk.importance(P, bk.select_count(n, p.select_block), p.block, p.stride,
                            p.select_block)
        chosen = bk.choose(imp, t, p.select_block, p.top_n)[:, :, 0]  # (B, Hk, nb)
        tok = chosen[..., None] * p.select_block + torch.arange(p.select_block, device=q.device)
        tok = tok.masked_fill_((chosen[..., None] < 0) | (tok >= n), -1).flatten(2)
        return nc, tok, (max(0, n - p.window), n - 1), prob

    def decode_step(self, state, q, k, v, gate_cmp, gate_slc, gate_win):
        self.decode_extend(state, k, v)
        cd = compute_dtype(q.dtype)
        B, Hq, _, D = q.shape
        Hk, L = state.k.shape[1], state.k.shape[2]
        r = Hq // Hk
        nc, tok, (w0, w1), prob = self.read_plan(state, q)
        qs = q.to(cd).reshape(B, Hk, r, D) * softmax_scale(D)
        Dv = state.v.shape[-1]
        o_cmp = (prob[:, :, :, 0] @ state.vc[:, :, :nc].to(cd) if nc
                 else qs.new_zeros(B, Hk, r, Dv))
        rows = (tok.clamp(min=0) + (torch.arange(B * Hk, device=q.device) * L).view(B, Hk, 1))
        K, V = (x.reshape(-1, x.shape[-1]).index_select(0, rows.flatten()).view(
            B, Hk, -1, x.shape[-1]).to(cd) for x in (state.k, state.v))
        s = (qs @ K.transpose(-1, -2)).masked_fill_((tok < 0)[:, :, None, :], float("-inf"))
        o_slc = torch.softmax(s, dim=-1) @ V
        Kw, Vw = state.k[:, :, w0:w1 + 1].to(cd), state.v[:, :, w0:w1 + 1].to(cd)
        o_win = torch.softmax(qs @ Kw.transpose(-1, -2), dim=-1) @ Vw
        g = [x.to(cd).reshape(B, Hk, r, 1) for x in (gate_cmp, gate_slc, gate_win)]
        o = g[0] * o_cmp + g[1] * o_slc + g[2] * o_win
        return o.reshape(B, Hq, 1, Dv).to(q.dtype), state
