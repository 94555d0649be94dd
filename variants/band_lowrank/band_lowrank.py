"""Band plus low rank: exact attention near the diagonal, a cheap estimate of the rest.

Both variants split the keys of query i into the band i - w <= j <= i + w (sliding_window's,
causal: i - w <= j <= i), scored exactly, and the far field outside it, which they see
through a low-rank stand-in; one softmax denominator covers both.

- `scatterbrain`: Chen, Dao et al. 2021, "Scatterbrain: Unifying Sparse and Low-rank
  Attention Approximation", https://arxiv.org/abs/2110.15343 (Sec. 3.2 and Algorithm 1;
  their code is HazyResearch/fly, `sblocal_attention.py`). exp(q_i.k_j / sqrt(D)) is kept
  exactly in the band and replaced by the Performer estimate phi(q_i).phi(k_j) outside it,
  with `performer`'s FAVOR+ positive orthogonal random features (its feature code and
  seeded draw, reused): o_i = sum_j a_ij v_j / sum_j a_ij. The paper writes the far field
  as the low-rank estimate over all keys minus its band part (S - S_band); here it is
  summed directly over the far keys, which is the same sum in exact arithmetic but a sum
  of nonnegative terms, so it never cancels below zero and needs no floor (the reference
  code clamps that difference at 1e-24). Far keys j <= i - w - 1 are a causal linear
  attention with a lag of w + 1 rows, those j >= i + w + 1 an anticausal one: chunked
  prefix (suffix) sums (`variants.linear.lagged_kernel_sum`), O(N (C m + m D)).
  Stability, in log space as the reference code's `logaddexp` of the two parts: the
  query features carry a per-row log scale and the key features one shift per (batch,
  head) (Performer's stabilisers), the band's scores their row maximum, and both parts
  are taken relative to the larger of the band's maximum and the far field's log mass, so
  no exponent overflows and neither part underflows unless it is ~87 nats below the other.
- `longshort`: the learning-free form of the Long-Short Transformer (Zhu et al. 2021,
  "Long-Short Transformer: Efficient Transformers for Language and Vision",
  https://arxiv.org/abs/2107.02192, Sec. 3). Its long-range keys are a projection of
  the sequence learned from the data (dynamic projection); without learning, the
  projection is segment means: the sequence is cut into `segment` contiguous segments
  (sizes differ by at most one; min(segment, N) of them) and each is summarised by the
  means of its keys and values. Query i attends, under one softmax, to the keys of its
  band and to the summaries of the segments lying wholly outside it (causal: the
  segments that end before i - w, as the paper's autoregressive form sees only segments
  before the window). A summary's score gets + log(its size), so it weighs like the keys
  it stands for (as linformer's mean_pool does). Keys of a segment that straddles the
  band's edge are seen only inside the band. O(N (c + 2w + segment) D).

The band is sliding_window's blocked scheme (`band_span`, `band_views`, `band_drop_mask`):
query chunks of c rows score a contiguous span of L = c + 2w keys (causal c + w), so both
variants are O(N (window + features) D) in time and O(N (window + features)) in memory,
forward and (plain autograd) backward; never N x N. At window >= N - 1 the far field is
empty and both are exact softmax attention.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import Contract, DecodeState, Variant, compute_dtype, param, register, softmax_scale
from ..linear import Performer, PerformerParams, lagged_kernel_flops, lagged_kernel_sum
from ..low_rank import segment_means, segment_sizes
from ..sliding_window import (MaskCache, band_drop_mask, band_mask, band_span, band_views,
                             group_chunks, window_covers)

# Chunk rows of the far field's prefix sums (2 C m + 4 m D FLOPs per row and direction; 64
# balances the two for m = 128, D = 64).
_FAR_CHUNK = 64


def _band_mask_dense(N: int, w: int, causal: bool, device) -> torch.Tensor:
    """Bool (N, N): the band i - w <= j <= i + w (causal: and j <= i)."""
    idx = torch.arange(N, device=device)
    band = band_mask(w)(idx, idx)
    return band & (idx[None, :] <= idx[:, None]) if causal else band


@dataclasses.dataclass
class ScatterbrainState(DecodeState):
    """Scatterbrain's decoding state: a ring of the band's last W = window + 1 keys and
    values (token t in slot t mod W), and the far field's FAVOR+ sums of the keys older
    than the band, S (B, H, m, D) and z (B, H, m), against the key scale `shift`."""
    k: torch.Tensor
    v: torch.Tensor
    n: int
    S: torch.Tensor
    z: torch.Tensor
    shift: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ScatterbrainParams:
    window: int = param(256, doc="band half-width: exact scores for i - window <= j <= i + window",
                        min=0)
    num_features: int = param(256, doc="Performer random features m for the far field", min=1)
    seed: int = param(0, doc="seed of the random features", min=0)


@register
class Scatterbrain(Variant):
    """Scatterbrain: exact scores in a band, Performer features for the rest, one denominator."""
    name = "scatterbrain"
    family = "band_lowrank"
    contract = Contract(decoding=True, extend=True, weights=True)
    Params = ScatterbrainParams
    paper = "https://arxiv.org/abs/2110.15343"

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        # performer's features and seeded draw (orthogonal, drawn at the first D, device,
        # dtype it sees and cached; never redrawn).
        self.features = Performer(PerformerParams(num_features=p.num_features, orthogonal=True,
                                                  seed=p.seed))
        self._masks = MaskCache()

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        # A band over every pair leaves no far field: exact softmax attention.
        return window_covers(self.params.window, seq_len)

    def _far(self, q, k, v, w, causal):
        """The far field's [numerator | denominator] sums (B, H, N, D + 1) with shifted
        features, and the log scale per query row (B, H, N, 1) that multiplies them.

        With p_q, p_k the features' softmax over the m features and lq, lk their log
        scales (performer's `phi_k`: phi(x) = p * exp(l)), phi(q_i).phi(k_j) =
        (p_q,i . p_k,j) exp(lq_i + lk_j); exp(lk_j - g) (g: the largest lk of the batch
        and head, a constant) goes on key j's row of [v | 1].
        """
        D = q.shape[-1]
        phi = self.features.feature_fns(D, q.dtype, q.device)[1]
        pq, lq = phi(q)  # (B, H, N, m), (B, H, N, 1)
        pk, lk = phi(k)
        g = lk.detach().amax(dim=-2, keepdim=True)  # (B, H, 1, 1)
        wk = torch.exp(lk - g)  # (B, H, N, 1), at most 1
        x = torch.cat([v * wk, wk], dim=-1)  # (B, H, N, D + 1)
        far = lagged_kernel_sum(pq, pk, x, w + 1, _FAR_CHUNK)  # keys j <= i - w - 1
        if not causal:  # and keys j >= i + w + 1
            far = far + lagged_kernel_sum(pq, pk, x, w + 1, _FAR_CHUNK, reverse=True)
        return far, lq + g

    @staticmethod
    def _shift(band_max: torch.Tensor, far_den: torch.Tensor, log_scale: torch.Tensor):
        """Per-row shift c = max(band max, far field's log mass), detached; a row without far
        keys (far_den = 0) takes the band's maximum. The far mass is floored at the
        smallest normal number inside the log only, so exp(log_scale - c) <= 1 / tiny."""
        tiny = torch.finfo(far_den.dtype).tiny
        log_far = log_scale.detach() + far_den.detach().clamp_min(tiny).log()
        return torch.where(far_den.detach() > 0, torch.maximum(band_max, log_far), band_max)

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        if N == 0:
            return q.clone()
        dtype, dt = q.dtype, compute_dtype(q.dtype)  # features and sums in float32 at least
        q, k, v = (t.to(dt) for t in (q, k, v))
        w, c, L = band_span(self.params.window, N, causal)
        nc = math.ceil(N / c)
        far, log_scale = self._far(q, k, v, w, causal)  # (B, H, N, D + 1), (B, H, N, 1)
        pad = (0, 0, 0, nc * c - N)
        far = torch.nn.functional.pad(far, pad).view(B, H, nc, c, D + 1)
        log_scale = torch.nn.functional.pad(log_scale, pad).view(B, H, nc, c, 1)
        qc, kw, vw = band_views(q, k, v, w, c, L, causal)
        drop = self._masks.get((N, causal, q.device), lambda: band_drop_mask(
            N, w, c, L, causal).to(q.device))  # (nc, c, L)
        G = group_chunks(B, H, c, L, q.element_size())
        outs = []
        for qg, kg, vg, dg, fg, lg in zip(qc.split(G, 2), kw.split(G, 2), vw.split(G, 2),
                                          drop.split(G, 0), far.split(G, 2),
                                          log_scale.split(G, 2)):
            s = (qg @ kg).masked_fill_(dg, float("-inf"))  # (B, H, G, c, L)
            shift = self._shift(s.detach().amax(dim=-1, keepdim=True), fg[..., D:], lg)
            e = s.sub_(shift).exp_()  # exp(s - shift); in place: matmul saves its inputs
            ef = torch.exp(lg - shift)  # (B, H, G, c, 1): the far field's factor
            num = e @ vg + ef * fg[..., :D]  # (B, H, G, c, D)
            den = e.sum(dim=-1, keepdim=True) + ef * fg[..., D:]
            outs.append(num / den)
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, nc, c, D)
        return o.reshape(B, H, nc * c, D)[:, :, :N].to(dtype)

    def attention_weights(self, q, k, causal):
        """exp(s_ij) in the band, phi(q_i).phi(k_j) outside it, over their row sum; with the
        forward's shifts, so weights @ v is its output to rounding."""
        B, H, N, D = q.shape
        dt = compute_dtype(q.dtype)
        q, k = q.to(dt), k.to(dt)
        w, _, _ = band_span(self.params.window, N, causal)
        band = _band_mask_dense(N, w, causal, q.device)  # (N, N)
        idx = torch.arange(N, device=q.device)
        far_keys = ~band if not causal else (idx[None, :] < idx[:, None] - w)
        phi = self.features.feature_fns(D, dt, q.device)[1]
        pq, lq = phi(q)
        pk, lk = phi(k)
        g = lk.amax(dim=-2, keepdim=True)
        a = (pq @ pk.transpose(-1, -2)) * torch.exp(lk - g).transpose(-1, -2)  # (B, H, N, N)
        a = a.masked_fill(~far_keys, 0.0)
        s = ((q * softmax_scale(D)) @ k.transpose(-1, -2)).masked_fill(~band, float("-inf"))
        shift = self._shift(s.amax(dim=-1, keepdim=True), a.sum(dim=-1, keepdim=True), lq + g)
        weights = torch.exp(s - shift) + torch.exp(lq + g - shift) * a
        return (weights / weights.sum(dim=-1, keepdim=True)).to(q.dtype)

    def state_size(self, N, D):
        # The band's keys and values, and the far field's feature sums (m x D and m).
        m = self.params.num_features
        return 2 * min(self.params.window + 1, N) * D + m * (D + 1)

    # -- decoding: the band's ring and the far field's feature sums -----------------------
    def decode_prefill(self, k, v, max_len):
        B, H, N, D = k.shape
        dt, m = compute_dtype(k.dtype), self.params.num_features
        W = min(self.params.window + 1, max(max_len, 1))  # i - w .. i
        st = ScatterbrainState(k.new_zeros(B, H, W, D, dtype=dt), k.new_zeros(B, H, W, D, dtype=dt),
                               0, k.new_zeros(B, H, m, D, dtype=dt), k.new_zeros(B, H, m, dtype=dt),
                               k.new_full((B, H, 1, 1), float("-inf"), dtype=dt))
        return self.decode_extend(st, k, v)

    def _add_far(self, st, k, v):
        """Keys that left the band join the far field's sums, against the largest key
        scale seen so far (the sums rescaled when it grows; it cancels in the output)."""
        phi = self.features.feature_fns(k.shape[-1], k.dtype, k.device)[1]
        pk, lk = phi(k)  # (B, H, r, m), (B, H, r, 1)
        top = torch.maximum(st.shift, lk.amax(dim=-2, keepdim=True))
        rescale = (st.shift - top).exp_()
        st.S.mul_(rescale)
        st.z.mul_(rescale[..., 0])
        st.shift.copy_(top)
        w = (lk - top).exp_()  # (B, H, r, 1)
        st.S.add_(pk.transpose(-1, -2) @ (v * w))
        st.z.add_((pk * w).sum(dim=-2))

    def decode_extend(self, st, k, v):
        dt = st.S.dtype
        k, v = k.to(dt), v.to(dt)
        W, n, r = st.k.shape[-2], st.n, k.shape[-2]
        end = n + r - W  # tokens before `end` are in the far field once these are in
        if end > max(0, n - W):  # ring tokens that leave the band, in order
            t = torch.arange(max(0, n - W), min(n, end), device=k.device)
            if len(t):
                self._add_far(st, st.k[:, :, t % W], st.v[:, :, t % W])
        if end > n:  # new tokens that go straight to the far field
            self._add_far(st, k[:, :, :end - n], v[:, :, :end - n])
        t = torch.arange(max(n, end), n + r, device=k.device)
        st.k[:, :, t % W] = k[:, :, t - n]
        st.v[:, :, t % W] = v[:, :, t - n]
        st.n = n + r
        return st

    def decode_step(self, st, q, k, v):
        dtype, dt = q.dtype, st.S.dtype
        self.decode_extend(st, k, v)
        q = q.to(dt)
        held = min(st.n, st.k.shape[-2])
        s = (q * softmax_scale(q.shape[-1])) @ st.k[:, :, :held].transpose(-1, -2)  # (B, H, 1, h)
        pq, lq = self.features.feature_fns(q.shape[-1], dt, q.device)[1](q)  # (B, H, 1, m)
        num_far, den_far = pq @ st.S, pq @ st.z.unsqueeze(-1)  # (B, H, 1, D), (B, H, 1, 1)
        log_scale = lq + st.shift
        shift = self._shift(s.amax(dim=-1, keepdim=True), den_far, log_scale)
        e, ef = (s - shift).exp(), (log_scale - shift).exp()
        num = e @ st.v[:, :, :held] + ef * num_far
        den = e.sum(dim=-1, keepdim=True) + ef * den_far
        return (num / den).to(dtype), st

    def flops(self, B, H, N, D, causal=False):
        """Band as sliding_window counts it (4 c L D per chunk); features x w^T for q and k
        (2 x 2 N D m); the far field's chunked sums with D + 1 columns, one direction
        causal, two non-causal."""
        if N == 0:
            return 0
        m = self.params.num_features
        w, c, L = band_span(self.params.window, N, causal)
        band = 4 * math.ceil(N / c) * c * L * D
        features = 2 * 2 * N * D * m
        far = 0 if w + 1 >= N else lagged_kernel_flops(N, m, D + 1, _FAR_CHUNK)
        return B * H * (band + features + far * (1 if causal else 2))


@dataclasses.dataclass(frozen=True)
class LongShortParams:
    window: int = param(256, doc="band half-width: exact scores for i - window <= j <= i + window",
                        min=0)
    segment: int = param(256, doc="segments the sequence is cut into (min(segment, N) of them); "
                         "each summarised by its key and value means", min=1)


@register
class LongShort(Variant):
    """Learning-free Long-Short: one softmax over the band's keys and segment-mean summaries outside it."""
    name = "longshort"
    family = "band_lowrank"
    contract = Contract(weights=True)
    Params = LongShortParams
    paper = "https://arxiv.org/abs/2107.02192"

    def __init__(self, params=None):
        super().__init__(params)
        self._masks = MaskCache()

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        # A band over every pair leaves no far field; one segment per token makes every
        # summary a key of its own (log 1 = 0): exact softmax attention either way.
        return window_covers(self.params.window, seq_len) or self.params.segment >= seq_len

    def _segments(self, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first token, last token) of each of the min(segment, N) segments, CPU longs."""
        sizes = torch.tensor(segment_sizes(N, min(self.params.segment, N)))
        end = sizes.cumsum(0)
        return end - sizes, end - 1

    def _summary_drop(self, N: int, w: int, causal: bool, rows: int) -> torch.Tensor:
        """Bool (rows, r), CPU: True where query row i (rows >= N: padding) may NOT see
        segment g: g is not wholly outside its band (causal: does not end before i - w)."""
        first, last = self._segments(N)
        i = torch.arange(rows)[:, None]
        allowed = last[None, :] < i - w
        if not causal:
            allowed |= first[None, :] > i + w
        return ~allowed

    def _summaries(self, k, v):
        """(key means (B, H, r, D), value means (B, H, r, D), log sizes (r,))."""
        N = k.shape[-2]
        r = min(self.params.segment, N)
        sizes = torch.tensor(segment_sizes(N, r), dtype=torch.float64)
        return segment_means(k, r), segment_means(v, r), sizes.log().to(k.device, k.dtype)

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        if N == 0:
            return q.clone()
        w, c, L = band_span(self.params.window, N, causal)
        nc = math.ceil(N / c)
        qc, kw, vw = band_views(q, k, v, w, c, L, causal)
        drop = self._masks.get(("band", N, causal, q.device), lambda: band_drop_mask(
            N, w, c, L, causal).to(q.device))  # (nc, c, L)
        k_bar, v_bar, log_size = self._summaries(k, v)  # (B, H, r, D), (r,)
        r = k_bar.shape[-2]
        sdrop = self._masks.get(("summary", N, causal, q.device), lambda: self._summary_drop(
            N, w, causal, nc * c).view(nc, c, r).to(q.device))  # (nc, c, r)
        kt = k_bar.transpose(-1, -2)  # (B, H, D, r); q is scaled already
        G = group_chunks(B, H, c, L + r, q.element_size())
        outs = []
        for qg, kg, vg, dg, sg in zip(qc.split(G, 2), kw.split(G, 2), vw.split(G, 2),
                                      drop.split(G, 0), sdrop.split(G, 0)):
            g = qg.shape[2]
            sb = (qg @ kg).masked_fill_(dg, float("-inf"))  # (B, H, g, c, L)
            ss = (qg.reshape(B, H, g * c, D) @ kt).view(B, H, g, c, r)  # (B, H, g, c, r)
            ss = ss.add_(log_size).masked_fill_(sg, float("-inf"))
            top = torch.maximum(sb.detach().amax(dim=-1, keepdim=True),
                                ss.detach().amax(dim=-1, keepdim=True))  # (B, H, g, c, 1)
            eb, es = sb.sub_(top).exp_(), ss.sub_(top).exp_()  # one softmax over both
            den = eb.sum(dim=-1, keepdim=True) + es.sum(dim=-1, keepdim=True)
            num = eb @ vg + (es.view(B, H, g * c, r) @ v_bar).view(B, H, g, c, D)
            outs.append(num / den)
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, nc, c, D)
        return o.reshape(B, H, nc * c, D)[:, :, :N]

    def attention_weights(self, q, k, causal):
        """The softmax over band keys and allowed summaries, a summary's weight spread evenly
        over its segment's keys (the value mean it multiplies)."""
        B, H, N, D = q.shape
        w, _, _ = band_span(self.params.window, N, causal)
        band = _band_mask_dense(N, w, causal, q.device)
        s = ((q * softmax_scale(D)) @ k.transpose(-1, -2)).masked_fill(~band, float("-inf"))
        k_bar, _, log_size = self._summaries(k, k)
        ss = (q * softmax_scale(D)) @ k_bar.transpose(-1, -2) + log_size  # (B, H, N, r)
        ss = ss.masked_fill(self._summary_drop(N, w, causal, N).to(q.device), float("-inf"))
        p = torch.softmax(torch.cat([s, ss], dim=-1), dim=-1)
        first, last = self._segments(N)
        j = torch.arange(N)
        sizes = (last - first + 1).to(torch.float64)
        mean = ((j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])) / sizes[:, None]
        return p[..., :N] + p[..., N:] @ mean.to(q.device, q.dtype)

    def state_size(self, N, D):
        # The band's keys and values, and a key and value summary per segment (a fixed
        # count over the sequence: the summaries depend on its final length).
        return 2 * min(self.params.window + 1, N) * D + 2 * min(self.params.segment, N) * D

    def flops(self, B, H, N, D, causal=False):
        """Band as sliding_window counts it (4 c L D per chunk); scores and values of the r
        summaries for every padded row (4 P r D); segment sums of k and v (2 N D adds)."""
        if N == 0:
            return 0
        w, c, L = band_span(self.params.window, N, causal)
        P = math.ceil(N / c) * c
        r = min(self.params.segment, N)
        return B * H * (4 * P * L * D + 4 * P * r * D + 2 * N * D)
