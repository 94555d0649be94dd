"""The decoding half of the variant interface, mixed into `Variant`: a state built from
the context, then one token at a time (the states themselves: `decoding.py`).

    state = m.prefill(k, v, max_len=N + T)      # checked: the context and its inputs
    o, state = m.step(state, q, k, v)           # checked: the token and its inputs
    m.check_tokens(q, k, v); m.decode_step(...)  # T tokens checked once, then steps alone

The host class gives `name`, `contract`, `unsupported_reasons` and `state_size`
(interface.Variant does). Grouped heads: the context's k (B, Hk, N, Dk) and v (B, Hv, N, Dv)
as the contract's grouping allows; a variant whose grouping is `repeat` gets them repeated
to one per output head (`q_heads`: the queries' head count, for grouped keys) before its
`decode_prefill`, and each token's likewise before `decode_step`.
"""

from __future__ import annotations

import torch

from .checks import check_qkv, expand_heads, input_sizes
from .decoding import DecodeState, check_context, check_token
from .inputs import check_inputs


class Decoder:
    """Decoding: `prefill`, `extend`, `step` check what they are given, then call the
    variant's `decode_prefill`, `decode_extend`, `decode_step`; what a step reads and
    writes; the float64 reference of a sequence taken in pieces."""

    def decode_reasons(self) -> list[str]:
        """Why this variant cannot generate token by token; empty when it can. A benchmark
        records a decode case it refuses as skipped with these reasons."""
        if not self.contract.supports_causal:
            return [f"{self.name} is non-causal only: it has no token-by-token form"]
        if not self.contract.decoding:
            return [f"{self.name} has no decoding form (no prefill and step)"]
        return self.extra_decode_reasons()

    def extra_decode_reasons(self) -> list[str]:
        """Setting-specific reasons it cannot decode (features redrawn every call, ...)."""
        return []

    def prefill(self, k: torch.Tensor, v: torch.Tensor, *, max_len: int,
                q_heads: int | None = None, **inputs):
        """The state after the context's keys (B, Hk, N, Dk) and values (B, Hv, N, Dv),
        preallocated for a sequence of `max_len` tokens; the context's outputs are not
        computed. q_heads: the queries' head count (default: the keys'), which grouped
        keys divide."""
        check_context(k, v, max_len)
        g = self.contract.grouping
        q_heads = q_heads or k.shape[1]
        q_like = k.new_empty((k.shape[0], q_heads, 0, k.shape[-1]), device="meta")
        check_qkv(q_like, k[:, :, :0].to("meta"), v[:, :, :0].to("meta"), g, self.name)
        reasons = self.decode_reasons() + self.unsupported_reasons(
            device=k.device, dtype=k.dtype, causal=True, seq_len=max_len, head_dim=k.shape[-1])
        if reasons:
            raise ValueError("; ".join(reasons))
        sizes = {"B": k.shape[0], "H": max(q_heads, v.shape[1]), "N": k.shape[-2],
                 "D": k.shape[-1]}
        if self.contract.inputs or inputs:  # the context's own gates, (B, H, N) or (B, H, N, D)
            check_inputs(self.name, self.contract.inputs, k, inputs, sizes=sizes)
        if g.how == "repeat":  # one key and value (or key) per output head
            H = sizes["H"]
            k, v = (t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)
                    for t in (k, v))
        state = self.decode_prefill(k, v, max_len, **inputs)
        if isinstance(state, DecodeState):  # what a later piece's per-head inputs are sized by
            state.__dict__["_query_heads"] = q_heads
        return state

    def unchecked_step(self, state: DecodeState, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, **inputs) -> tuple[torch.Tensor, DecodeState]:
        """`step` without its checks, for tokens `check_tokens` checked (a benchmark's timed
        loop): the token's heads repeated where the grouping is `repeat`, then
        `decode_step`."""
        return self.decode_step(state, *self._expand_token(q, k, v), **inputs)

    def _expand_token(self, q, k, v):
        """q, k, v of a token (or T tokens) repeated to one per output head where the
        grouping is `repeat`."""
        if self.contract.grouping.how == "repeat":
            return expand_heads(q, k, v)
        return q, k, v

    def step(self, state: DecodeState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             **inputs) -> tuple[torch.Tensor, DecodeState]:
        """One new token, q, k, v of (B, H, 1, D): its output (B, H, 1, D), equal to that row
        of the causal forward over the whole sequence, and the state (updated in place).
        Checks the token first; `check_tokens` then `decode_step` is the same without a
        check per token."""
        check_token(q, k, v)
        check_qkv(q, k, v, self.contract.grouping, self.name)
        if self.contract.inputs or inputs:
            check_inputs(self.name, self.contract.inputs, q, inputs,
                         sizes=input_sizes(q, k, v))
        return self.decode_step(state, *self._expand_token(q, k, v), **inputs)

    def check_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     **inputs) -> None:
        """The checks `step` makes, on T new tokens at once: q, k, v of one (B, H, T, D)
        shape, dtype and device, the declared inputs of those T tokens; ValueError naming
        what is wrong. A caller that checks its tokens here once may then call
        `decode_step` on each token's slices (a benchmark's timed loop: the step and
        nothing else)."""
        check_qkv(q, k, v, self.contract.grouping, self.name)
        if self.contract.inputs or inputs:
            check_inputs(self.name, self.contract.inputs, q, inputs,
                         sizes=input_sizes(q, k, v))

    def extend(self, state: DecodeState, k: torch.Tensor, v: torch.Tensor,
               **inputs) -> DecodeState:
        """More context, (B, H, n, D) keys and values after those the state holds, without
        outputs: a long context prefilled in pieces (`has_extend` says whether it can)."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != v.shape[0] or \
                k.shape[2] != v.shape[2]:
            raise ValueError(f"extend takes k, v of one (B, n) as (B, H, n, D), got "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        H = max(state.query_heads(), v.shape[1])
        sizes = {"B": k.shape[0], "H": H, "N": k.shape[-2], "D": k.shape[-1]}
        if self.contract.inputs or inputs:
            check_inputs(self.name, self.contract.inputs, k, inputs, sizes=sizes)
        if self.contract.grouping.how == "repeat":
            k, v = (t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)
                    for t in (k, v))
        return self.decode_extend(state, k, v, **inputs)

    def has_extend(self) -> bool:
        """Whether it prefills a context in pieces (declared: `contract.extend`)."""
        return self.contract.extend

    def decode_extend(self, state, k, v, **inputs) -> DecodeState:
        raise NotImplementedError(f"{self.name} prefills its context in one call only")

    def decode_read_size(self, N: int, D: int) -> int | None:
        """Elements a decoding step reads per (batch, head) at context N: the whole state
        (`state_size`) unless the variant reads only part of it (a sparse decoder's
        chosen blocks)."""
        return self.state_size(N, D)

    def decode_read_size_at(self, N: int, s) -> int | None:
        """Elements a decoding step reads per batch element, all heads, at context N, for
        a case of its own heads and widths (`contract.Shape`): the whole state
        (`state_size_at`) unless the variant reads only part of it; a `repeat` grouping
        reads one per output head."""
        if not s.grouped and s.Dv == s.D:
            per_head = self.decode_read_size(N, s.D)
            return None if per_head is None else s.H * per_head
        if self.contract.grouping.how == "repeat" and s.Dv == s.D:
            per_head = self.decode_read_size(N, s.D)
            return None if per_head is None else s.out_heads * per_head
        return self.state_size_at(N, s)

    def state_bytes_at(self, N: int, s, dtype: torch.dtype) -> int | None:
        """Bytes the decoding state of a case of `dtype` keeps per batch element after N
        tokens: `state_size_at` numbers in the case's dtype, unless the variant stores them
        otherwise (a cache in a narrower `cache_dtype`); None where it does not say."""
        numbers = self.state_size_at(N, s)
        return None if numbers is None else numbers * dtype.itemsize

    def decode_flops_at(self, N: int, s) -> int | None:
        """FLOPs of one decoding step at context N, per batch element, all heads, for a
        case of its own heads and widths (`contract.Shape`); None where the variant does
        not say. A step's FLOPs over its moved bytes say whether it is bound by the read
        or by the arithmetic (the report's roofline bound, harness.report.generation).
        Counted as the decoder computes them: every matrix product of (m, k) by (k, n)
        as 2 m k n (as torch.utils.flop_counter counts it, and as the matmul rate is
        measured), an elementwise update of a state matrix as one FLOP an element;
        elementwise work on vectors of D, Dv or n numbers a head (feature maps, gates, a
        softmax's exp and sum) is left out: a D-th or less of the rest."""
        return None

    def softmax_step_flops(self, n: float, s) -> int:
        """One query row of softmax attention over n keys, per batch element: q k^T (2 n
        Dk) and p v (2 n Dv) for each output head (each query head does its own dot
        products even where query heads share a key-value head); the softmax's exp, sum
        and division are O(n) a head against O(n D), and left out."""
        return round(2 * s.out_heads * n * (s.D + s.Dv))

    def state_nbytes(self, state: DecodeState) -> int:
        """Bytes the decoding state holds (its preallocated tensors)."""
        return state.nbytes()

    def decode_prefill(self, k, v, max_len, **inputs) -> DecodeState:
        """Build the state; variants with a decoding form override this and `decode_step`."""
        raise NotImplementedError

    def decode_step(self, state, q, k, v, **inputs):
        raise NotImplementedError

    def decode_reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         **inputs: torch.Tensor):
        """The float64 reference of T generated tokens (q, k, v and inputs of those tokens,
        (B, H, T, D)) that the decode pass feeds the context piece by piece: an object with
        `add(q, k, v, inputs)` for each piece of context and `finish(q, k, v, inputs)` ->
        the (B, H, T, Dv) float64 outputs; None (the default): the pass's own (exact
        softmax, or `reference_from` for a variant measured against its own form). A
        variant whose own reference would cost the square of the context (mla) gives one
        that works on the T rows alone."""
        return None

    def reference_from(self, state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       **inputs: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Where `err_ref` is not `softmax`: the float64 causal output of q, k, v (B, H, n, D)
        continuing from `state` (None: the start of a sequence; else what the last call
        returned), and the state after them: the reference of a sequence taken in pieces
        (a decode benchmark's long context, then its new tokens). Computed by the
        variant's forward, never by its decoding form, so that a wrong step shows."""
        raise NotImplementedError(f"{self.name} has no float64 reference from a state")
