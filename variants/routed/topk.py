"""The oracle: each query attends, exactly, to its top_k highest-scoring keys.

The ceiling for any method that reads k keys a query: top-k keeps the most probability
mass a k-sparse row can keep (which almost always, though not provably, gives the
closest output). A reference, not an efficient variant: selecting needs every score,
O(N^2 D) work. It runs in query chunks of c rows against all keys (causal: the keys up
to the chunk's last query): scores (B, H, c, N'), their top_k, softmax over those, and
the output as the scattered weights times V. Memory is one chunk plus O(N) per slice:
the backward recomputes each chunk's scores and selection (the same matmul, the same
topk) instead of keeping N top_k indices, and forms dV, dS, dQ, dK as the chunk's dense
products, zero off the selection.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import Contract, Variant, compute_dtype, param, register, softmax_scale

# Bytes of one query chunk's (B, H, c, N) scores.
_CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class TopKParams:
    top_k: int = param(192, doc="keys each query attends to", min=1)


def _chunks(B: int, H: int, N: int):
    c = max(1, min(N, _CHUNK_BYTES // (4 * B * H * max(N, 1))))
    return [(s, min(N, s + c)) for s in range(0, N, c)]


def _chunk_weights(qs, k, s, e, top_k, causal):
    """Scores of queries s..e against keys 0..n' (all, causal: up to e), the top_k of
    each row: (scores (B, H, c, n'), values, indices), future keys at -inf."""
    n = e if causal else k.shape[-2]
    sc = qs[:, :, s:e] @ k[:, :, :n].transpose(-1, -2)  # (B, H, c, n)
    if causal:
        i = torch.arange(s, e, device=sc.device)[:, None]
        sc.masked_fill_(torch.arange(n, device=sc.device) > i, float("-inf"))
    val, idx = sc.topk(min(top_k, n), dim=-1)
    return sc, val, idx


def _operands(q, k):
    """q scaled by 1/sqrt(D) and k, in the dtype the scores are computed in: the
    selection is made on these, in `select` as in the forward and backward."""
    cd = compute_dtype(q.dtype)
    return q.to(cd) * softmax_scale(q.shape[-1]), k.to(cd)


def top_keys(q, k, top_k, causal):
    """Each query's top_k keys, (B, H, N, min(top_k, N)) long, best first; -1 where the
    causal mask leaves fewer keys."""
    B, H, N, D = q.shape
    kk = min(top_k, N)
    qs, k = _operands(q, k)
    out = torch.full((B, H, N, kk), -1, dtype=torch.long, device=q.device)
    for s, e in _chunks(B, H, N):
        _, val, idx = _chunk_weights(qs, k, s, e, top_k, causal)
        out[:, :, s:e, :idx.shape[-1]] = idx.masked_fill_(val == float("-inf"), -1)
    return out


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, top_k, causal):
        B, H, N, D = q.shape
        dtype, cd = q.dtype, compute_dtype(q.dtype)
        (qs, k), v = _operands(q, k), v.to(cd)
        out = torch.empty(B, H, N, D, dtype=cd, device=q.device)
        lse = torch.empty(B, H, N, 1, dtype=cd, device=q.device)
        for s, e in _chunks(B, H, N):
            sc, val, idx = _chunk_weights(qs, k, s, e, top_k, causal)
            lse[:, :, s:e] = torch.logsumexp(val, dim=-1, keepdim=True)
            p = sc.zero_().scatter_(-1, idx, torch.softmax(val, dim=-1))  # (B, H, c, n)
            torch.matmul(p, v[:, :, :p.shape[-1]], out=out[:, :, s:e])
        if any(ctx.needs_input_grad[:3]):
            ctx.top_k, ctx.causal, ctx.dtype = top_k, causal, dtype
            ctx.save_for_backward(qs, k, v, out, lse)
        return out.to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qs, k, v, out, lse = ctx.saved_tensors
        B, H, N, D = qs.shape
        dout = dout.to(qs.dtype)
        delta = torch.linalg.vecdot(dout, out).unsqueeze(-1)  # rowsum(dO o)
        dq, dk, dv = torch.empty_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        for s, e in _chunks(B, H, N):
            sc, val, idx = _chunk_weights(qs, k, s, e, ctx.top_k, ctx.causal)
            n = sc.shape[-1]
            p = sc.zero_().scatter_(-1, idx, (val - lse[:, :, s:e]).exp())  # the forward's
            do = dout[:, :, s:e]
            dv[:, :, :n] += p.transpose(-1, -2) @ do
            ds = (do @ v[:, :, :n].transpose(-1, -2)).sub_(delta[:, :, s:e]).mul_(p)
            dq[:, :, s:e] = (ds @ k[:, :, :n]) * softmax_scale(D)
            dk[:, :, :n] += ds.transpose(-1, -2) @ qs[:, :, s:e]
        dtype = ctx.dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None


@register
class TopK(Variant):
    """The oracle ceiling: exact softmax over each query's top_k highest-scoring keys."""
    name = "topk"
    family = "routed"
    Params = TopKParams
    paper = "https://arxiv.org/abs/2504.17768"
    # A bound for the others, not an efficient method: the report never offers it.
    contract = Contract(reference_ceiling=True, weights=True)
    budget_param = "top_k"

    def select(self, q: torch.Tensor, k: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """The keys each query reads, (B, H, N, min(top_k, N)) long, best first; -1 where
        fewer keys precede it (causal). Not differentiated."""
        with torch.no_grad():
            return top_keys(q.detach(), k.detach(), self.params.top_k, causal)

    def selection(self, q, k, causal=False):
        """`select`: each query's top_k keys by its exact scores (O(N^2): the oracle's
        cost, which its forward pays inside its own chunks)."""
        return self.select(q, k, causal)

    def selection_cost(self, B, H, Hk, N, D, causal=False, itemsize=4):
        """Every query's scores against the keys its chunk reads (all, causal: up to the
        chunk's last query): 2 D a key and head; those keys read, D a key and kv head."""
        if N == 0:
            return 0.0, 0.0
        keys = sum((e - s) * (e if causal else N) for s, e in _chunks(B, H, N)) / N
        return 2 * H * D * keys, Hk * D * itemsize * keys

    def selected_keys(self, selection, rows, N, causal):
        sel = selection[:, :, rows.to(selection.device)]
        m = torch.zeros(*sel.shape[:3], N + 1, dtype=torch.bool, device=sel.device)
        return m.scatter_(-1, sel.masked_fill(sel < 0, N), True)[..., :N]

    def attend(self, q, k, v, causal):
        if q.shape[-2] == 0:
            return q.clone()
        return _TopK.apply(q, k, v, self.params.top_k, causal)

    def attention_weights(self, q, k, causal):
        N = q.shape[-2]
        sel = self.select(q, k, causal)
        allowed = torch.zeros(*sel.shape[:3], N + 1, dtype=torch.bool, device=q.device)
        allowed.scatter_(-1, sel.masked_fill(sel < 0, N), True)
        s = (q * softmax_scale(q.shape[-1])) @ k.transpose(-1, -2)
        return torch.softmax(s.masked_fill(~allowed[..., :N], float("-inf")), dim=-1)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return self.params.top_k >= seq_len

    def flops(self, B, H, N, D, causal=False):
        """As computed: every chunk scores all its keys (causal: those up to the chunk's
        last query) for the selection, and multiplies its dense weights by V: 4 c n' D a
        chunk; the top-k selection itself is not a matmul."""
        if N == 0:
            return 0
        return 4 * B * H * D * sum((e - s) * (e if causal else N) for s, e in _chunks(B, H, N))

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        """min(top_k, N); causal: the mean over queries of min(top_k, i + 1)."""
        if not causal:
            return float(min(self.params.top_k, N))
        i = torch.arange(1, N + 1, dtype=torch.float64)
        return float(i.clamp(max=self.params.top_k).mean())

    def state_size(self, N, D):
        return 2 * N * D
