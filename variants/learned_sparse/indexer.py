"""DSA's selection: the indexer's scores in query chunks and the top-k rule.

DeepSeek-V3.2 (arXiv:2512.02556, Sec. 2.1), the lightning indexer: with index_heads heads
of width index_dim, one indexer key a token shared by them,

    I(t, s) = sum_j index_w(t, j) ReLU(index_q(t, j) . index_k(s)),   s <= t,

and query t attends to the top_k keys by I(t, .) (every key when t < top_k). The `heads`
proxy scores with sum_h ReLU(q_h . k_h / sqrt(D)) over the attention's own query heads
(each reading its key-value head): the summed attention logits the paper's KL trains the
indexer toward, training-free. One selection a (batch, query), shared by every head.

Ties go to the later position: the kk-th largest score is the threshold, every score
above it is taken and, of those equal to it, the last ones (a reversed running count).
Scores exist one query chunk at a time, (B, c, n), summed over the indexer's heads Hx from
per-head scores made a key chunk at a time in one buffer, so memory is one chunk plus the
(B, N, kk) selection. No autograd: the selection is not
differentiated (in the paper the indexer learns from its own KL loss).
"""

from __future__ import annotations

import math

import torch

from ..core import InputSpec, compute_dtype, softmax_scale

# Bytes of one query chunk's per-head indexer scores (B, c, Hx, n).
_CHUNK_BYTES = 16 * 2**20


def chunks(B: int, heads: int, N: int) -> list[tuple[int, int]]:
    """Query chunks (s, e) whose per-head scores against N keys fit _CHUNK_BYTES (float32
    counted: the same cut whatever the dtype, so `flops` can follow it)."""
    c = max(1, min(N, _CHUNK_BYTES // (4 * B * max(heads, 1) * max(N, 1))))
    return [(s, min(N, s + c)) for s in range(0, N, c)]


# Per-head scores are made a key chunk at a time into one buffer of about this many bytes
# (at least _MIN_KEYS keys a chunk), rectified and summed over the heads there: the product
# of a few query rows by many keys then runs as cache-sized matmuls, where one product
# against every key writes, rectifies and rereads all of its per-head scores (a decoding
# step of 64 indexer heads against 1M keys: 256 MiB; results/dsa-decode-1m).
_KEY_CHUNK_BYTES = 2**20
_MIN_KEYS = 512


def key_chunks(rows: int, n: int) -> list[tuple[int, int]]:
    """Key ranges (s, e) whose scores for `rows` query rows (all heads) fit the buffer."""
    m = max(_MIN_KEYS, _KEY_CHUNK_BYTES // (4 * max(rows, 1)))
    return [(s, min(n, s + m)) for s in range(0, n, m)]


@torch.no_grad()  # a selection is not differentiated (DSA's KL trains the indexer: dsa.py)
def lightning_scores(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor) -> torch.Tensor:
    """I for queries iq (B, Hi, c, di) with weights iw (B, Hi, c) against keys ik (B, 1, n,
    di): (B, c, n); per batch element and key chunk, the products of every head's query
    with the keys into one buffer, rectified there, and their weighted sum over heads."""
    B, Hi, c, di = iq.shape
    n = ik.shape[-2]
    qr = iq.transpose(1, 2).reshape(B, c * Hi, di)
    w = iw.transpose(1, 2).reshape(B, c, 1, Hi)
    out = iq.new_empty(B, c, n)
    spans = key_chunks(c * Hi, n)
    buf = iq.new_empty(c * Hi, spans[0][1] - spans[0][0] if spans else 0)
    for b in range(B):
        for s, e in spans:
            a = buf[:, :e - s]
            torch.mm(qr[b], ik[b, 0, s:e].t(), out=a)
            a.relu_()
            out[b, :, s:e] = (w[b] @ a.view(c, Hi, e - s)).squeeze(1)
    return out


@torch.no_grad()
def heads_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """sum_h ReLU(q_h . k_g(h) / sqrt(D)) for queries q (B, Hq, c, D) against keys k (B,
    Hk, n, D), query head h reading key-value head h // (Hq / Hk): (B, c, n), a key chunk
    at a time as `lightning_scores`."""
    B, Hq, c, D = q.shape
    Hk, n = k.shape[1], k.shape[-2]
    qs = (q.reshape(B, Hk, (Hq // Hk) * c, D) * softmax_scale(D)).reshape(B * Hk, -1, D)
    out = q.new_empty(B, c, n)
    spans = key_chunks(B * Hq * c, n)
    buf = q.new_empty(B * Hk, qs.shape[1], spans[0][1] - spans[0][0] if spans else 0)
    for s, e in spans:
        a = buf[:, :, :e - s]
        torch.bmm(qs, k[:, :, s:e].reshape(B * Hk, e - s, D).transpose(1, 2), out=a)
        out[:, :, s:e] = a.relu_().view(B, Hq, c, e - s).sum(dim=1)
    return out


def top_later(s: torch.Tensor, kk: int) -> torch.Tensor:
    """The kk best of each row of scores s (..., n) (-inf: not a candidate), ties toward the
    later position: (..., kk) long positions, latest first, -1 where a row has fewer
    candidates. On CPU, where no row has a tie at its kk-th score (real-valued scores almost
    never do), top-k's own positions are the answer; else, and on other devices (the test
    would read the device's answer back to the host), `_top_later_ties`."""
    n = s.shape[-1]
    kk = min(kk, n)
    vals, idx = s.topk(kk, dim=-1, sorted=False)
    thr = vals.amin(dim=-1, keepdim=True)
    if s.device.type == "cpu" and bool((thr > float("-inf")).all()) and \
            bool(((s >= thr).sum(dim=-1) == kk).all()):
        return idx.sort(dim=-1, descending=True).values
    return _top_later_ties(s, kk, thr)


def _top_later_ties(s: torch.Tensor, kk: int, thr: torch.Tensor) -> torch.Tensor:
    """`top_later` where a row ties at its threshold thr, or has fewer than kk candidates:
    every score above thr is taken and, of those equal to it, the last ones (a reversed
    running count)."""
    n = s.shape[-1]
    above = s > thr
    tie = (s == thr) & (thr > float("-inf"))
    need = kk - above.sum(dim=-1, keepdim=True)
    later = tie.flip(-1).cumsum(-1).flip(-1)  # ties at or after each position
    take = above | (tie & (later <= need))
    pos = torch.arange(n, device=s.device).expand_as(s).masked_fill(~take, -1)
    return pos.topk(kk, dim=-1).values


def select(q, k, top_k: int, indexer: str, index_q=None, index_k=None,
           index_w=None) -> torch.Tensor:
    """Each query's keys, (B, N, kk) int32, kk = min(top_k, N), causal (s <= t), -1
    filling a row with fewer keys; scored in the dtype the attention computes in."""
    B, Hq, N, _ = q.shape
    kk = min(top_k, N)
    cd = compute_dtype(q.dtype)
    sel = torch.full((B, N, kk), -1, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        if indexer == "lightning":
            iq, ik, iw = index_q.to(cd), index_k.to(cd), index_w.to(cd)
            heads = iq.shape[1]
        else:
            qc, kc = q.detach().to(cd), k.detach().to(cd)
            heads = Hq
        for s, e in chunks(B, heads, N):
            if indexer == "lightning":
                sc = lightning_scores(iq[:, :, s:e], ik[:, :, :e], iw[:, :, s:e])
            else:
                sc = heads_scores(qc[:, :, s:e], kc[:, :, :e])
            t = torch.arange(s, e, device=q.device)[:, None]
            sc.masked_fill_(torch.arange(e, device=q.device) > t, float("-inf"))
            top = top_later(sc, kk)  # min(kk, e) wide: a chunk ending before kk keys
            sel[:, s:e, :top.shape[-1]] = top.to(torch.int32)
    return sel


# -- the declared inputs of the lightning indexer ------------------------------------

def _q(hi: int, di: int):
    def sample(gen, B, H, N, D):
        return torch.randn(B, hi, N, di, generator=gen)
    return sample


def _k(di: int):
    def sample(gen, B, H, N, D):
        return torch.nn.functional.layer_norm(torch.randn(B, 1, N, di, generator=gen), (di,))
    return sample


def _w(hi: int, di: int):
    def sample(gen, B, H, N, D):
        return torch.randn(B, hi, N, generator=gen) / math.sqrt(hi * di)
    return sample


def index_inputs(hi: int, di: int) -> tuple[InputSpec, ...]:
    """index_q (B, index_heads, N, index_dim), index_k (B, 1, N, index_dim), index_w (B,
    index_heads, N), drawn as DeepSeek-V3.2's indexer at initialisation (its inference
    code, `Indexer`): q a projection of the normed query latent (its Hadamard rotation is
    orthogonal), N(0, 1); k = LayerNorm(W x), LayerNorm of N(0, 1); the weights W_w x
    times index_heads^-1/2 index_dim^-1/2 (the code folds both scales into them). I is
    positively homogeneous in each of the three, so these scales move no selection."""
    own = (("index_heads", hi), ("index_dim", di), ("1", 1))
    return (
        InputSpec("index_q", ("B", "index_heads", "N", "index_dim"), None, None,
                  "N(0, 1) (a projection of the normed query latent)", _q(hi, di),
                  doc="the indexer's queries, one a head and token", own_dims=own,
                  layer="indexer_q"),  # trained: W_q x (harness.train.model.InputLayer)
        InputSpec("index_k", ("B", "1", "N", "index_dim"), None, None,
                  "LayerNorm(x), x ~ N(0, 1) (the indexer's key norm)", _k(di),
                  doc="the indexer's key, one a token shared by its heads", own_dims=own,
                  layer="indexer_k"),  # trained: LayerNorm(W_k x)
        InputSpec("index_w", ("B", "index_heads", "N"), None, None,
                  "N(0, 1) / sqrt(index_heads index_dim) (weights_proj with the code's "
                  "scales)", _w(hi, di), doc="each indexer head's weight a token",
                  own_dims=own, layer="indexer_w"),  # trained: W_w x hi^-1/2 di^-1/2
    )
