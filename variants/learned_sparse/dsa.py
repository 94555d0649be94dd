"""DSA: DeepSeek Sparse Attention, each query's exact softmax over the top_k keys an
indexer scores best (DeepSeek-V3.2, arXiv:2512.02556, Sec. 2.1).

The selection (`indexer.py`): the lightning indexer I(t, s) = sum_j index_w(t, j)
ReLU(index_q(t, j) . index_k(s)) from the declared inputs, or the `heads` proxy
sum_h ReLU(q_h . k_h / sqrt(D)); causal; the top_k keys (every key when t < top_k), ties
toward the later position; one selection a (batch, query) shared by every head. The
attention (`gathered.py`): softmax over the selected keys, gathered by query chunk, a
recomputing backward. Both are in the call: the indexer's work is the selection's real
cost. The decoder keeps the whole key-value cache (any past key may be chosen) and, for
the lightning indexer, each token's indexer key; a step scores every indexer key and
reads the top_k tokens' keys and values. A trained model's lightning indexer learns from
`indexer_kl` (the paper's KL toward the main attention), computed beside the attention by
`unchecked_with_loss` from the same selection.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import (Contract, DecodeState, Grouping, Variant, compute_dtype, param, register,
                    softmax_scale)
from . import indexer as ix
from .gathered import gathered_attention

INDEXERS = ("heads", "lightning")


def indexer_kl(q, k, sel, index_q, index_k, index_w) -> torch.Tensor:
    """DSA's indexer loss in its sparse training stage (arXiv:2512.02556, Sec. 2.1.1): the
    mean over batch and queries t of KL(p_t || softmax(I(t, S_t))), S_t the keys t selected
    (sel (B, N, kk), -1: none), p_t the main attention's distribution over S_t (each query
    head's softmax over S_t, as the sparse attention computes it) summed over the query
    heads and L1-normalised. p is computed without autograd: gradient reaches only the
    indexer's inputs. Only the selected keys are gathered, (B, N, kk) rows: O(N kk) memory
    and time, never N x N. A scalar in the attention's compute dtype."""
    B, Hq, N, D = q.shape
    Hk, kk, di = k.shape[1], sel.shape[-1], index_k.shape[-1]
    cd = compute_dtype(q.dtype)
    idx = sel.long()
    pad = idx < 0  # (B, N, kk)
    rows = (idx.clamp(min=0) + torch.arange(B, device=q.device)[:, None, None] * N).view(-1)
    with torch.no_grad():  # the target: detached
        kf = k.detach().to(cd).transpose(1, 2).reshape(B * N, Hk * D)
        K = kf.index_select(0, rows).view(B, N, kk, Hk, D).permute(0, 1, 3, 4, 2)
        qs = q.detach().to(cd).reshape(B, Hk, Hq // Hk, N, D).permute(0, 3, 1, 2, 4)
        s = (qs * softmax_scale(D)) @ K  # (B, N, Hk, r, kk): head h reads its kv head
        p = torch.softmax(s.masked_fill_(pad[:, :, None, None], float("-inf")), dim=-1)
        p = p.sum(dim=(2, 3))
        p = p / p.sum(dim=-1, keepdim=True)  # (B, N, kk), 0 where none is listed
    ik = index_k.to(cd)[:, 0].reshape(B * N, di).index_select(0, rows).view(B, N, kk, di)
    a = torch.relu(index_q.to(cd).transpose(1, 2) @ ik.transpose(-1, -2))  # (B, N, Hi, kk)
    score = (index_w.to(cd).transpose(1, 2).unsqueeze(2) @ a).squeeze(2)  # I, (B, N, kk)
    logq = torch.log_softmax(score.masked_fill(pad, float("-inf")), dim=-1)
    kl = torch.xlogy(p, p) - p * logq.masked_fill(pad, 0.0)
    return kl.sum(dim=-1).mean()


@dataclasses.dataclass(frozen=True)
class DsaParams:
    top_k: int = param(2048, doc="keys each query attends to (DeepSeek-V3.2: 2048)", min=1)
    indexer: str = param("heads", choices=INDEXERS,
                         doc="heads: sum_h ReLU(q_h . k_h / sqrt(D)), a training-free proxy; "
                             "lightning: DSA's indexer on the inputs index_q, index_k, index_w")
    index_heads: int = param(64, doc="lightning indexer heads (DeepSeek-V3.2: 64)", min=1)
    index_dim: int = param(128, doc="lightning indexer width (DeepSeek-V3.2: 128)", min=1)


@dataclasses.dataclass
class DsaCache(DecodeState):
    """Keys (B, Hk, max_len, D) and values (B, Hk, max_len, Dv), the first n written; the
    lightning indexer's keys (B, 1, max_len, index_dim), or None."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    ik: torch.Tensor | None
    n: int

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens are overwritten by the next appends


@register
class Dsa(Variant):
    """Exact softmax over each query's top_k keys by DSA's indexer (DeepSeek-V3.2); causal.

    The default indexer is `heads`: sum over the query heads of ReLU(q_h . k_h / sqrt(D)),
    the summed attention logits the paper's KL loss trains the lightning indexer toward
    (Sec. 2.1.1): a training-free proxy of a trained indexer, so that on real q, k, v the
    error against exact attention says what a DSA-like shared top_k loses. The lightning
    indexer with its inputs drawn at initialisation selects nothing the attention would
    choose (its error measures only the budget), but its cost is DSA's: time it with
    indexer = "lightning". One selection a (batch, query) shared by all heads, whatever
    the key-value grouping: DSA's MQA form (one key-value head: its group is every head);
    a selection per key-value group would make a grouped call differ from the same call on
    the heads repeated, which the suite's grouping contract forbids.
    """
    name = "dsa"
    family = "learned_sparse"
    Params = DsaParams
    paper = "https://arxiv.org/abs/2512.02556"
    budget_param = "top_k"
    contract = Contract(
        causal="causal_only", refused_why="dsa selects among each token's earlier keys "
        "(DeepSeek-V3.2's decoder-only form): non-causal attention is refused",
        decoding=True, extend=True, weights=True,
        grouping=Grouping("kv", "native", value_dim=True))

    def __init__(self, params=None):
        super().__init__(params)
        if self.params.indexer == "lightning":  # its instance declares the index inputs
            self.contract = self.contract.but(
                inputs=ix.index_inputs(self.params.index_heads, self.params.index_dim))

    @property
    def lightning(self) -> bool:
        return self.params.indexer == "lightning"

    def select(self, q, k, **inputs) -> torch.Tensor:
        """The keys each query reads, (B, N, min(top_k, N)) int32, -1 where fewer precede
        it; not differentiated."""
        return ix.select(q, k, self.params.top_k, self.params.indexer, **inputs)

    def selection(self, q, k, causal=True, **inputs):
        """`select`: the indexer's scores and top_k, as forward computes them (DSA's real
        selection cost)."""
        return self.select(q, k, **inputs)

    def selection_cost(self, B, H, Hk, N, D, causal=True, itemsize=4):
        """The indexer's scores against the keys up to its chunk's last query, as `flops`
        counts them: the lightning indexer 2 index_heads (index_dim + 1) a key (its
        products and the weighted sum) reading one index_dim key a token; the `heads`
        proxy 2 H D a key, reading every kv head's key."""
        if N == 0:
            return 0.0, 0.0
        heads = self.params.index_heads if self.lightning else H
        keys = sum((e - s) * e for s, e in ix.chunks(B, heads, N)) / N
        if self.lightning:
            di = self.params.index_dim
            return 2 * heads * (di + 1) * keys, di * itemsize * keys
        return 2 * H * D * keys, Hk * D * itemsize * keys

    def selected_keys(self, selection, rows, N, causal):
        """(B, 1, R, N): one selection shared by every head."""
        sel = selection[:, rows.to(selection.device)].long()
        m = torch.zeros(*sel.shape[:2], N + 1, dtype=torch.bool, device=sel.device)
        return m.scatter_(-1, sel.masked_fill(sel < 0, N), True)[:, None, :, :N]

    def attend(self, q, k, v, causal, **inputs):
        if q.shape[-2] == 0:
            return q.new_empty(*q.shape[:3], v.shape[-1])
        return gathered_attention(q, k, v, self.select(q, k, **inputs))

    def unchecked_with_loss(self, q, k, v, causal=True, **inputs):
        """(o, the indexer's loss): `unchecked`, and with the lightning indexer its
        `indexer_kl` on the same selection (None with the `heads` proxy, which learns
        nothing). A trained model adds the loss to its objective (harness.train.model)."""
        if q.shape[-2] == 0 or not self.lightning:
            return self.unchecked(q, k, v, causal, **inputs), None
        sel = self.select(q, k, **inputs)
        return gathered_attention(q, k, v, sel), indexer_kl(q, k, sel, **inputs)

    def attention_weights(self, q, k, causal, **inputs):
        N = q.shape[-2]
        sel = self.select(q, k, **inputs).long()
        allowed = torch.zeros(q.shape[0], N, N + 1, dtype=torch.bool, device=q.device)
        allowed.scatter_(-1, sel.masked_fill(sel < 0, N), True)
        s = (q * softmax_scale(q.shape[-1])) @ k.transpose(-1, -2)
        return torch.softmax(s.masked_fill(~allowed[:, None, :, :N], float("-inf")), dim=-1)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return self.params.top_k >= seq_len

    def flops(self, B, H, N, D, causal=False):
        """As computed: the indexer scores each chunk against the keys up to its last
        query (2 Hi di per pair and 2 Hi for the weighted sum; heads: 2 H D), and every
        query computes kk = min(top_k, N) slots, filled or not: 4 H D kk."""
        if N == 0:
            return 0
        heads = self.params.index_heads if self.lightning else H
        pairs = sum((e - s) * e for s, e in ix.chunks(B, heads, N))
        per = 2 * heads * (self.params.index_dim + 1) if self.lightning else 2 * H * D
        return B * (pairs * per + 4 * H * D * N * min(self.params.top_k, N))

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        """The mean over queries of min(top_k, t + 1)."""
        i = torch.arange(1, N + 1, dtype=torch.float64)
        return float(i.clamp(max=self.params.top_k).mean()) if N else 0.0

    # -- decoding -----------------------------------------------------------------
    def state_size(self, N, D):
        """Per head as if alone (DSA's one key-value head): the cache, 2 N D, and the
        lightning indexer's keys, N index_dim."""
        return 2 * N * D + (N * self.params.index_dim if self.lightning else 0)

    def state_size_at(self, N, s):
        return s.Hk * N * (s.D + s.Dv) + (N * self.params.index_dim if self.lightning else 0)

    def decode_read_size(self, N, D):
        """Per head as if alone: every indexer key (the lightning indexer's, or the keys
        themselves) and the keys and values of min(top_k, N) tokens."""
        kk = min(self.params.top_k, N)
        return N * (self.params.index_dim if self.lightning else D) + 2 * kk * D

    def decode_read_size_at(self, N, s):
        """All heads: the indexer keys once (the lightning indexer's, shared), or every
        key-value head's keys; the selected tokens' keys and values per key-value head."""
        kk = min(self.params.top_k, N)
        index = N * self.params.index_dim if self.lightning else s.Hk * N * s.D
        return index + s.Hk * kk * (s.D + s.Dv)

    def decode_flops_at(self, N, s):
        """As the step computes at context N: the indexer against every key (lightning:
        2 index_heads (index_dim + 1) a key, its products and the weighted sum; heads:
        2 H D a key), then softmax attention over min(top_k, N) keys."""
        per = (2 * self.params.index_heads * (self.params.index_dim + 1) if self.lightning
               else 2 * s.H * s.D)
        return per * N + self.softmax_step_flops(min(self.params.top_k, N), s)

    def decode_prefill(self, k, v, max_len, **inputs):
        B, Hk, _, D = k.shape
        ik = (k.new_empty(B, 1, max_len, self.params.index_dim) if self.lightning else None)
        state = DsaCache(k.new_empty(B, Hk, max_len, D),
                         v.new_empty(B, Hk, max_len, v.shape[-1]), ik, 0)
        return self.decode_extend(state, k, v, **inputs)

    def decode_extend(self, state, k, v, **inputs):
        n, r = state.n, k.shape[-2]
        if n + r > state.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {state.k.shape[-2]} tokens")
        state.k[:, :, n:n + r], state.v[:, :, n:n + r] = k, v
        if state.ik is not None:
            state.ik[:, :, n:n + r] = inputs["index_k"]
        state.n = n + r
        return state

    def decode_step(self, state, q, k, v, **inputs):
        self.decode_extend(state, k, v, **inputs)
        n, cd = state.n, compute_dtype(q.dtype)
        B, Hq, _, D = q.shape
        Hk = state.k.shape[1]
        if self.lightning:  # every indexer key
            sc = ix.lightning_scores(inputs["index_q"].to(cd), state.ik[:, :, :n].to(cd),
                                     inputs["index_w"].to(cd))
        else:  # every key of every head
            sc = ix.heads_scores(q.to(cd), state.k[:, :, :n].to(cd))
        idx = ix.top_later(sc, self.params.top_k)  # (B, 1, kk)
        pad = idx < 0
        rows = (idx.clamp(min=0) + torch.arange(B, device=q.device)[:, None, None] * Hk
                * state.k.shape[2])  # row of head 0 in the (B Hk L, .) cache
        rows = rows[:, :, None, :] + torch.arange(Hk, device=q.device)[:, None] \
            * state.k.shape[2]  # (B, 1, Hk, kk)
        K, V = (x.view(-1, x.shape[-1]).index_select(0, rows.flatten()).view(
            B, Hk, -1, x.shape[-1]).to(cd) for x in (state.k, state.v))  # (B, Hk, kk, .)
        s = (q.to(cd).reshape(B, Hk, Hq // Hk, D) * softmax_scale(D)) @ K.transpose(-1, -2)
        s = s.masked_fill(pad[:, :, None, :].expand(B, 1, 1, -1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ V  # (B, Hk, r, Dv)
        return o.reshape(B, Hq, 1, -1).to(q.dtype), state
