"""Error of a variant's output against exact softmax attention in float64.

rel_err = ||o - o_ref||_F / ||o_ref||_F and max_abs_err = max |o - o_ref| over the rows
compared. o_ref is `variants.exact_reference` (float64, query-chunked, same causal flag)
on the same q, k, v. For N > max_rows the error is taken on a random sample of max_rows
query rows drawn from `seed` (torch.randperm), sorted; the number compared is `err_rows`.

row_cos is the mean, over every compared (batch, head, query) row, of the cosine similarity
between o's row and o_ref's row. rel_err alone misleads when o_ref is near zero: on i.i.d.
inputs attention is near-uniform, each o_ref row is the mean of N random value rows (norm
~ sqrt(D / N)), so a variant that is off by a small absolute amount reads rel_err ~ 1 or
more. The cosine is scale-free per row: it asks whether each output points the right way.
For captured inputs (batch = L layers x B windows, layer-major), `layers` = L also gives
layer_rel_err: rel_err over each layer's slice of the batch.
"""

from __future__ import annotations

import dataclasses

import torch

import variants


@dataclasses.dataclass(frozen=True)
class Error:
    rel_err: float
    max_abs_err: float
    err_rows: int  # query rows compared (N when all)
    row_cos: float  # mean cosine of o's rows to the reference's rows
    layer_rel_err: list[float] | None = None  # per layer (captured inputs), in layer order


def sample_rows(N: int, max_rows: int, seed: int) -> torch.Tensor | None:
    """Sorted indices of max_rows query rows drawn from seed, or None for all N rows."""
    if N <= max_rows:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(N, generator=g)[:max_rows].sort().values


def error(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          *, max_rows: int = 1024, seed: int = 0, layers: int | None = None,
          reference=None, inputs: dict | None = None) -> Error:
    """Error of o (B, H, N, D) against float64 exact attention on q, k, v.

    `layers`: B is that many layers stacked layer-major; rel_err is also given per layer.
    `reference(q, k, v, causal, **inputs)`: the variant's own float64 form instead (a
    recurrence, `err_ref` = recurrence), run over the whole sequence, then sampled.
    """
    N = q.shape[-2]
    rows = sample_rows(N, max_rows, seed)
    if reference is None:
        sinks = (inputs or {}).get("sinks")  # gpt-oss's sinks: softmax with their column
        ref = variants.exact_reference(q.detach(), k.detach(), v.detach(), causal, rows=rows,
                                       sinks=None if sinks is None else sinks.detach())
    else:
        with torch.no_grad():
            ref = reference(q.detach(), k.detach(), v.detach(), causal,
                            **{n: t.detach() for n, t in (inputs or {}).items()})
        ref = ref if rows is None else ref[:, :, rows.to(ref.device)]
    got = (o if rows is None else o[:, :, rows.to(o.device)]).detach().double()  # (B, H, R, D)
    diff = got - ref
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)  # (B, H, R)
    per_layer = None
    if layers:
        d, r = diff.unflatten(0, (layers, -1)), ref.unflatten(0, (layers, -1))
        per_layer = (torch.linalg.vector_norm(d.flatten(1), dim=1)
                     / torch.linalg.vector_norm(r.flatten(1), dim=1)).tolist()
    return Error(rel, float(diff.abs().max()), N if rows is None else len(rows),
                 float(cos.mean()), per_layer)



# Bytes of one chunk of float64 exact probabilities (B, H, c, N) in `mass_captured`.
_MASS_CHUNK_BYTES = 32 * 2**20


def mass_captured(module, selection, q: torch.Tensor, k: torch.Tensor, causal: bool, *,
                  max_rows: int = 1024, seed: int = 0) -> float:
    """The share of exact attention's mass on the keys a sparse variant selects (the Sparse
    Frontier's first axis, Nawrot et al. 2025, arXiv:2504.17768): the mean over every
    (batch, head, query) row of sum_{j in S_i} P_ij, P the float64 softmax of q k^T /
    sqrt(D) (causal: j <= i) and S_i the keys `module.selected_keys(selection, ...)` says
    row i attends to. 1 where every key with weight is selected. On the same seeded sample
    of query rows as `error`, in chunks of rows: O(c N) memory, never N x N. Grouped keys:
    query head h reads key-value head h // (Hq / Hk)."""
    B, H, N, D = q.shape
    rows = sample_rows(N, max_rows, seed)
    rows = torch.arange(N) if rows is None else rows
    q64 = q.detach().double() * D ** -0.5
    k64 = k.detach().double()
    if k64.shape[1] != H:
        k64 = k64.repeat_interleave(H // k64.shape[1], dim=1)
    c = max(1, _MASS_CHUNK_BYTES // (8 * B * H * max(N, 1)))
    total, count = 0.0, 0
    j = torch.arange(N, device=q.device)
    for s in range(0, len(rows), c):
        r = rows[s:s + c].to(q.device)
        sc = q64[:, :, r] @ k64.transpose(-1, -2)  # (B, H, c, N)
        if causal:
            sc.masked_fill_(j[None, :] > r[:, None], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        with torch.no_grad():
            m = module.selected_keys(selection, r, N, causal).to(p.device)
        if m.shape[1] not in (1, H):  # one selection a key-value head (nsa): its query heads'
            m = m.repeat_interleave(H // m.shape[1], dim=1)
        got = (p * m).sum(dim=-1)  # (B, H, c): broadcast over a shared batch or head
        total += float(got.sum())
        count += got.numel()
    return total / count


class DecodeReference:
    """Float64 exact causal attention for T generated tokens, fed the context chunk by
    chunk as it is drawn (an online softmax): only T query rows and one chunk are alive,
    whatever the context's length. Token t (queries q[:, :, t]) sees every context key and
    the new keys k[:, :, :t + 1]."""

    def __init__(self, q: torch.Tensor):
        self.q64 = q.detach().double() * q.shape[-1] ** -0.5  # (B, H, T, D)
        B, H, T, D = q.shape
        self.top = self.q64.new_full((B, H, T, 1), float("-inf"))
        self.den = self.q64.new_zeros(B, H, T, 1)
        self.num = None  # (B, H, T, Dv), from the first values

    def add(self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None):
        """Keys and values (B, Hk, r, D) every new token sees (`allowed` (T, r): which)."""
        if k.shape[-2] == 0:
            return
        H = self.q64.shape[1]  # grouped keys: query head h reads key-value head h // (H / Hk)
        k, v = (t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)
                for t in (k, v))
        if self.num is None:
            self.num = self.q64.new_zeros(*self.q64.shape[:3], v.shape[-1])
        s = self.q64 @ k.detach().double().transpose(-1, -2)  # (B, H, T, r) scores
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        top = torch.maximum(self.top, s.amax(dim=-1, keepdim=True))
        scale = (self.top - top).exp()
        p = (s - top).exp()
        self.den = self.den * scale + p.sum(dim=-1, keepdim=True)
        self.num = self.num * scale + p @ v.detach().double()
        self.top = top

    def finish(self, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Add the T new tokens' own keys and values, causally; the (B, H, T, D) reference.
        sinks: a logit a head (H,) in every row's denominator (gpt-oss's sinks)."""
        T = k.shape[-2]
        t = torch.arange(T, device=k.device)
        self.add(k, v, allowed=t[None, :] <= t[:, None])
        if sinks is None:
            return self.num / self.den
        sink = sinks.detach().double().to(self.den.device).view(1, -1, 1, 1)
        return self.num / (self.den + (sink - self.top).exp())


def decode_error(o: torch.Tensor, ref: torch.Tensor) -> Error:
    """Error of T generated tokens' outputs o (B, H, T, D) against their reference."""
    got = o.detach().double()
    diff = got - ref
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return Error(rel, float(diff.abs().max()), o.shape[-2], float(cos.mean()))
