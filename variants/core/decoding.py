"""The decoding form of a causal variant: a state built from the context, then one token
at a time.

    state = m.prefill(k, v, max_len=N + T)      # k, v: (B, H, N, D), the context
    o, state = m.step(state, q, k, v)           # q, k, v: (B, H, 1, D), one new token
    m.state_nbytes(state)                       # bytes the state holds

Generated token by token, the outputs equal the rows of the causal forward over the whole
sequence (to rounding). A state is a `DecodeState`; `mark()` and `rewind(mark)` put it
back to the context it had, so that a benchmark times every repeat from the same context
without copying a cache (at 1M tokens a copy per step would be the whole cost).

This module holds the states several families share: a key-value cache preallocated to
the length the sequence will reach and written in place (`KVCache`), and a ring buffer
of the last W keys and values (`RingKV`).
"""

from __future__ import annotations

import dataclasses

import torch


def check_context(k: torch.Tensor, v: torch.Tensor, max_len: int) -> None:
    """Raise ValueError unless k, v are one (B, H, N, D) shape with N <= max_len."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
        raise ValueError(f"prefill takes k (B, Hk, N, Dk) and v (B, Hv, N, Dv) of one B and N, "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != v.dtype or k.device != v.device:
        raise ValueError("prefill takes k, v of one dtype and device")
    if not isinstance(max_len, int) or max_len < k.shape[-2]:
        raise ValueError(f"prefill: max_len must be an int >= the context's {k.shape[-2]} "
                         f"tokens, got {max_len!r}")


def check_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are one (B, H, 1, D) token of one dtype and device."""
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4 or t.shape[-2] != 1:
            raise ValueError(f"step takes one token, {label} of shape (B, H, 1, D), got "
                             f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("step: q, k, v must share a dtype and a device")


class DecodeState:
    """What a decoder keeps between tokens. Subclasses are dataclasses; their tensor fields
    are what `nbytes` counts. `appends`: a step writes only the new token into it (a cache
    of keys and values), not the whole state again (a recurrence's S <- f(S))."""

    appends = False

    def heads(self) -> int:
        """The head count it keeps (its first tensor's dim 1: (B, H, ...))."""
        return self.tensors()[0].shape[1]

    def query_heads(self) -> int:
        """The query heads its decoder serves, which size a piece of context's per-head
        inputs (`Decoder.extend`): the heads it keeps, unless it keeps fewer (mla's one
        latent for every head says its own). `Decoder.prefill` records the queries' count
        on the state it returns, so a grouped cache (fewer key heads) answers with it."""
        return self.__dict__.get("_query_heads") or self.heads()

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def mark(self):
        """What `rewind` needs to return to the present context: by default a copy of
        every field (states of a fixed, small size); a cache overrides it."""
        return {f.name: (lambda x: x.clone() if isinstance(x, torch.Tensor) else x)(
            getattr(self, f.name)) for f in dataclasses.fields(self)}

    def rewind(self, mark) -> None:
        for name, saved in mark.items():
            x = getattr(self, name)
            if isinstance(x, torch.Tensor):
                x.copy_(saved)
            else:
                setattr(self, name, saved)


@dataclasses.dataclass
class KVCache(DecodeState):
    """Keys and values (B, H, max_len, D), the first `n` of them written."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    n: int

    @classmethod
    def prefill(cls, k: torch.Tensor, v: torch.Tensor, max_len: int) -> "KVCache":
        B, H, N, D = k.shape
        ck = k.new_empty(B, H, max_len, D)  # (B, H, max_len, D)
        cv = v.new_empty(B, H, max_len, v.shape[-1])  # values of their own width
        ck[:, :, :N] = k
        cv[:, :, :N] = v
        return cls(ck, cv, N)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token's (B, H, 1, D) key and value in place."""
        if self.n >= self.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {self.k.shape[-2]} tokens")
        self.k[:, :, self.n] = k[:, :, 0]
        self.v[:, :, self.n] = v[:, :, 0]
        self.n += 1

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (B, H, r, D) keys and values after those held, in place."""
        r = k.shape[-2]
        if self.n + r > self.k.shape[-2]:
            raise ValueError(f"the cache is full: max_len = {self.k.shape[-2]} tokens")
        self.k[:, :, self.n:self.n + r] = k
        self.v[:, :, self.n:self.n + r] = v
        self.n += r

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.n]  # (B, H, n, D), a view

    def values(self) -> torch.Tensor:
        return self.v[:, :, :self.n]

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens are overwritten by the next appends


@dataclasses.dataclass
class RingKV(DecodeState):
    """The last W keys and values, (B, H, W, D) and (B, H, W, Dv), token t in slot t mod W;
    `n` tokens seen so far (min(n, W) slots hold one)."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    n: int

    @classmethod
    def prefill(cls, k: torch.Tensor, v: torch.Tensor, W: int) -> "RingKV":
        B, H, N, D = k.shape
        rk, rv = k.new_zeros(B, H, W, D), v.new_zeros(B, H, W, v.shape[-1])
        t = torch.arange(max(0, N - W), N, device=k.device)
        rk[:, :, t % W] = k[:, :, t]
        rv[:, :, t % W] = v[:, :, t]
        return cls(rk, rv, N)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        slot = self.n % self.k.shape[-2]
        self.k[:, :, slot] = k[:, :, 0]
        self.v[:, :, slot] = v[:, :, 0]
        self.n += 1

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take (B, H, r, D) more tokens; only the last W of them can stay."""
        W, r = self.k.shape[-2], k.shape[-2]
        t = torch.arange(max(0, r - W), r, device=k.device)
        self.k[:, :, (self.n + t) % W] = k[:, :, t]
        self.v[:, :, (self.n + t) % W] = v[:, :, t]
        self.n += r

    def held(self) -> int:
        return min(self.n, self.k.shape[-2])

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.held()]  # slots in ring order: softmax does not care

    def values(self) -> torch.Tensor:
        return self.v[:, :, :self.held()]


class CacheDecoder:
    """Mixed into a Variant whose decoding state is a cache of keys and values (KVCache,
    RingKV): more context is written into the cache as it is, no outputs made. Inputs that
    shape only outputs (sinks) are checked by `Decoder.extend` and not needed here."""

    def decode_extend(self, state, k, v, **output_inputs):
        state.extend(k, v)
        return state
