"""StreamingLLM: the first few tokens ("attention sinks") plus a window of the most recent
ones, exact softmax on that key pattern, a constant cache (Xiao et al. 2023,
https://arxiv.org/abs/2309.17453).

Query i sees key j <= i when j < sink_tokens or j > i - window: the first `sink_tokens`
keys and the last `window` (itself included). Causal only: it is a decoding scheme.

Forward in query chunks of c rows: chunk [a, a + c) scores the sink keys not already in
its span, then the contiguous span [a - window + 1, a + c), masked to the pattern inside
that small block; plain autograd keeps each chunk's (c, sink_tokens + c + window) block.
Time and memory, forward and backward, O(N (sink_tokens + c + window) D): never N x N.

Positions: the official code re-rotates each cached key by its place in the cache (RoPE
positions within the cache, not in the text); the maps here have no positional encoding,
so that rotation has nothing to act on and the pattern alone is measured
(docs/variants.md).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import (CacheDecoder, Contract, DecodeState, KeyMask, Variant, naive_attention,
                    param, register, softmax_scale)

_CAUSAL_ONLY = ("streaming is a decoding scheme: its pattern (the first tokens and the "
                "recent window) is defined for causal attention only")


@dataclasses.dataclass(frozen=True)
class StreamingParams:
    window: int = param(1020, min=1, doc="recent keys a query sees, itself included "
                                          "(j > i - window)")
    sink_tokens: int = param(4, min=0, doc="the first keys every query sees (j < sink_tokens)")


def streaming_mask(window: int, sink_tokens: int) -> KeyMask:
    """j < sink_tokens or j > i - window ([c], [n] -> [c, n]); causal adds j <= i."""
    def allowed(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (j[None, :] < sink_tokens) | (j[None, :] > i[:, None] - window)
    return allowed


def streaming_keys(window: int, sink_tokens: int, N: int) -> float:
    """Mean keys a causal query sees at length N."""
    i = torch.arange(N, dtype=torch.float64)
    recent = torch.clamp(i + 1, max=window)
    sink = torch.clamp(i + 1 - window, min=0).clamp(max=sink_tokens)
    return float((recent + sink).mean()) if N else 0.0


@dataclasses.dataclass
class SinkRing(DecodeState):
    """The first `sink_tokens` keys and values (B, H, s, D) and a ring of the last W,
    token t in slot t mod W; `n` tokens seen. Constant size whatever the context."""
    appends = True
    sk: torch.Tensor
    sv: torch.Tensor
    rk: torch.Tensor
    rv: torch.Tensor
    n: int

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, s: int, W: int) -> "SinkRing":
        B, H, _, D = k.shape
        Dv = v.shape[-1]
        return cls(k.new_zeros(B, H, s, D), v.new_zeros(B, H, s, Dv),
                   k.new_zeros(B, H, W, D), v.new_zeros(B, H, W, Dv), 0)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take (B, H, r, D) more tokens: those among the first s into the sink slots, the
        last W of them into the ring."""
        r, a = k.shape[-2], self.n
        s, W = self.sk.shape[-2], self.rk.shape[-2]
        take = max(0, min(s, a + r) - a)
        if take:
            self.sk[:, :, a:a + take] = k[:, :, :take]
            self.sv[:, :, a:a + take] = v[:, :, :take]
        t = torch.arange(max(0, r - W), r, device=k.device)
        self.rk[:, :, (a + t) % W] = k[:, :, t]
        self.rv[:, :, (a + t) % W] = v[:, :, t]
        self.n += r

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the next query sees: the sink tokens not in the ring's
        window, then the ring's held slots (order does not matter to softmax)."""
        W = self.rk.shape[-2]
        held = min(self.n, W)
        s = min(self.sk.shape[-2], max(0, self.n - W))
        if s == 0:
            return self.rk[:, :, :held], self.rv[:, :, :held]
        return (torch.cat([self.sk[:, :, :s], self.rk[:, :, :held]], dim=2),
                torch.cat([self.sv[:, :, :s], self.rv[:, :, :held]], dim=2))


def _chunk(window: int) -> int:
    return min(max(window // 2, 32), 128)


@register
class Streaming(CacheDecoder, Variant):
    """StreamingLLM: exact softmax over the first sink_tokens keys and the last window."""
    name = "streaming"
    family = "sliding_window"
    Params = StreamingParams
    contract = Contract(exactness="pattern", causal="causal_only", refused_why=_CAUSAL_ONLY,
                        decoding=True, extend=True)
    paper = "https://arxiv.org/abs/2309.17453"

    def key_mask(self, seq_len: int) -> KeyMask:
        return streaming_mask(self.params.window, self.params.sink_tokens)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return self.params.window + self.params.sink_tokens >= seq_len

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        return streaming_keys(self.params.window, self.params.sink_tokens, N)

    def state_size(self, N, D):
        return 2 * min(N, self.params.window + self.params.sink_tokens) * D

    def flops(self, B, H, N, D, causal=True):
        """As computed: each chunk of c queries scores the sink keys before its span and
        its span of up to c + window - 1 keys; q k^T and p v, 4 D a pair."""
        w, s, c = self.params.window, self.params.sink_tokens, _chunk(self.params.window)
        total = 0
        for a in range(0, N, c):
            z = min(a + c, N)
            lo = max(0, a - w + 1)
            total += (z - a) * (min(s, lo) + z - lo)
        return 4 * B * H * total * D

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        w, s = self.params.window, self.params.sink_tokens
        c = _chunk(w)
        scale = softmax_scale(D)
        outs = []
        for a in range(0, N, c):
            z = min(a + c, N)
            lo = max(0, a - w + 1)  # the first recent key any query of the chunk sees
            hs = min(s, lo)  # sink keys before the span
            keys, vals = k[:, :, lo:z], v[:, :, lo:z]
            pos = torch.arange(lo, z, device=q.device)
            if hs:
                keys = torch.cat([k[:, :, :hs], keys], dim=2)
                vals = torch.cat([v[:, :, :hs], vals], dim=2)
                pos = torch.cat([torch.arange(hs, device=q.device), pos])
            i = torch.arange(a, z, device=q.device)[:, None]
            allowed = (pos[None, :] <= i) & ((pos[None, :] < s) | (pos[None, :] > i - w))
            scores = (q[:, :, a:z] * scale) @ keys.transpose(-1, -2)  # (B, H, c, hs + span)
            scores = scores.masked_fill(~allowed, float("-inf"))
            outs.append(torch.softmax(scores, dim=-1) @ vals)
        return torch.cat(outs, dim=2) if outs else q.clone()

    def decode_flops_at(self, N, s):
        # The sink tokens and the window's keys (state_size's count at context N).
        return self.softmax_step_flops(min(N, self.params.window + self.params.sink_tokens), s)

    def decode_prefill(self, k, v, max_len):
        # A sequence no longer than the window never leaves the ring: no sink slots then;
        # else the first sink_tokens, and no more than the tokens past the window.
        W, s = self.params.window, self.params.sink_tokens
        state = SinkRing.empty(k, v, min(s, max(0, max_len - W)), min(W, max(max_len, 1)))
        state.extend(k, v)
        return state

    def decode_step(self, state, q, k, v):
        state.extend(k, v)
        keys, vals = state.keys_values()
        return naive_attention(q, keys, vals), state
