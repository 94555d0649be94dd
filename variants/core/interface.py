"""The variant interface: a pure q, k, v -> o attention map on (B, H, N, D) tensors
(grouped heads and values of their own width where its contract declares them:
`contract.py`, the one record of what it can do).

A variant is a frozen parameter dataclass and a `Variant` subclass registered with
`@register` (`registry.py`), in its family's folder. The base class checks shapes and
declared capabilities before any work, so that a case a variant cannot do is refused with
its reason instead of quietly computing something else; `check_call` then `unchecked` is
the same call with its checks made once (what a benchmark times). Its decoding form,
token by token, is the `Decoder` half (`decoder.py`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .checks import KeyMask, check_qkv, expand_heads, input_sizes
from .contract import Contract, Shape
from .decoder import Decoder
from .inputs import InputSpec, check_inputs, draw_inputs
from .reference import softmax_weights

# Longest sequence `Variant.weights` returns a map for: the map is (B, H, N, N), 64 MiB per
# head in float32 at this length.
WEIGHTS_MAX_N = 4096


@dataclasses.dataclass(frozen=True)
class NoParams:
    """A variant without parameters."""


def param(default, *, doc: str = "", choices: tuple | None = None, min: float | None = None,
          max: float | None = None, later: bool = False):
    """A dataclass field for a variant parameter, with the constraints the registry checks.
    `later`: a parameter added after results were stored, left out of a setting's stored
    form at its default (`registry.stored_params`), so that those results keep their ids."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "later": later}
    return dataclasses.field(default=default, metadata=meta)


class Variant(Decoder, torch.nn.Module):
    """Base class: `forward(q, k, v, causal=False)` on (B, H, N, D) returns o of q's shape."""

    # Filled in by each subclass; the registry reads them.
    name: ClassVar[str]
    family: ClassVar[str]
    Params: ClassVar[type] = NoParams
    paper: ClassVar[str] = ""
    # What it can do, declared once (`contract.py`): exactness, causal modes, backward,
    # decoding, inputs beyond q, k, v, compiled, reference ceiling, head groupings, ...
    # The registry checks it against the class; everything else reads only this record.
    contract: ClassVar[Contract] = Contract()

    def __init__(self, params=None):
        super().__init__()
        self.params = params if params is not None else self.Params()

    # -- capabilities -----------------------------------------------------------------
    def unsupported_reasons(self, *, device: torch.device | str, dtype: torch.dtype,
                            causal: bool, seq_len: int, head_dim: int,
                            backward: bool = False) -> list[str]:
        """Why this variant cannot run a case; empty when it can. Called before running."""
        reasons = []
        c = self.contract
        if not causal and c.causal == "causal_only":
            reasons.append(c.refused_why)
        if causal and c.causal == "non_causal_only":
            reasons.append(f"{self.name} is non-causal only ({c.refused_why})")
        if backward and not c.backward:
            reasons.append(f"{self.name} has no backward pass")
        if not dtype.is_floating_point:
            reasons.append(f"{self.name} needs a floating-point dtype, got {dtype}")
        reasons += self.extra_reasons(torch.device(device), dtype, causal, seq_len, head_dim,
                                      backward)
        return reasons

    def extra_reasons(self, device: torch.device, dtype: torch.dtype, causal: bool,
                      seq_len: int, head_dim: int, backward: bool) -> list[str]:
        """Variant-specific reasons (device, dtype, length); override where needed."""
        return []

    def shape_reasons(self, s: Shape) -> list[str]:
        """Why this setting cannot take a case of these heads and widths beyond what its
        grouping says (`Shape.check`): widths its own parameters fix (mla's latent and
        rotary key); empty when it can. A case that gives kv_heads, value_heads or
        value_dim the setting cannot take is bad input (the matrix refuses it, exit 2); a
        case that gives none (an `all` matrix's multi-head case) is a skipped row with
        the reason."""
        return []

    def setting_errors(self, device: torch.device | str) -> list[str]:
        """What this setting cannot be on `device` at all (a cache dtype the device or
        torch lacks): bad input, which a run refuses before anything is measured (exit 2),
        not a case to record as skipped; empty when there is nothing. Override where
        needed."""
        return []

    # -- the map --------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool = False, **inputs: torch.Tensor) -> torch.Tensor:
        backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                or v.requires_grad)
        self.check_call(q, k, v, causal, backward=backward, **inputs)
        return self.unchecked(q, k, v, causal, **inputs)

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool = False, *, backward: bool = False,
                   **inputs: torch.Tensor) -> None:
        """Every check `forward` makes before any work (shapes, the declared capabilities,
        the declared inputs' shapes and ranges): ValueError with the reasons."""
        check_qkv(q, k, v, self.contract.grouping, self.name)
        reasons = self.unsupported_reasons(device=q.device, dtype=q.dtype, causal=causal,
                                           seq_len=q.shape[-2], head_dim=q.shape[-1],
                                           backward=backward)
        if reasons:
            raise ValueError("; ".join(reasons))
        if self.contract.inputs or inputs:
            check_inputs(self.name, self.contract.inputs, q, inputs,
                         sizes=input_sizes(q, k, v, self.contract.grouping))

    def unchecked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool = False, **inputs: torch.Tensor) -> torch.Tensor:
        """`forward` without its checks: the method alone, for a caller that ran
        `check_call` on these very tensors once (a benchmark's timed region, which holds
        the call and nothing else: a range check of the gates costs reductions and, on
        CUDA, a host sync per input)."""
        if self.contract.grouping.how == "repeat":  # one k, v (or q, k) per output head
            q, k, v = expand_heads(q, k, v, self.contract.grouping)
        if self.contract.inputs or inputs:
            return self.attend(q, k, v, causal, **inputs)
        return self.attend(q, k, v, causal)

    def unchecked_with_loss(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = False, **inputs: torch.Tensor):
        """(`unchecked`'s output, an auxiliary loss the variant trains its own parts by, or
        None): what a trained model's block calls in training and adds to its objective
        (harness.train.model). None here; dsa's lightning indexer returns its KL."""
        return self.unchecked(q, k, v, causal, **inputs), None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                backward: bool = False) -> bool:
        """One-time work for this case before anything is timed; True when there was some.

        Library kernels compile here (torch.compile) and build their masks for q's length
        and device; the harness times this call, less `prepare_calls` steady-state calls,
        into `compile_ms`, never into `time_ms`. `backward`: the case also runs the
        backward pass (compile that too). The default does nothing and returns False (the
        harness then leaves `compile_ms` empty).
        """
        return False

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        """Whether this setting computes exact softmax attention at this length.

        True for exact variants; an approximate one says True where its setting covers
        every (query, key) pair (a window >= N - 1, a layout of every block, one landmark
        or segment per token), so that the report never offers it as an approximation.
        The default: the class's `exact`.
        """
        return self.contract.exact

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  **inputs: torch.Tensor) -> torch.Tensor:
        """The float64 output this variant's error is measured against where `err_ref` is
        not `softmax` (its own plain form); the softmax reference lives in `reference.py`."""
        raise NotImplementedError(f"{self.name} is measured against exact softmax attention")

    # -- the attention weights it implies ------------------------------------------
    def weights(self, q: torch.Tensor, k: torch.Tensor, causal: bool = False,
                **inputs: torch.Tensor) -> torch.Tensor:
        """The attention weights this variant implies, (B, H, N, N): forward(q, k, v, causal)
        equals weights(q, k, causal) @ v to rounding, for every v.

        For looking at small cases (the report's attention maps) and for checking a variant
        against its own output; refused with ValueError and the reasons of
        `weights_reasons` (above WEIGHTS_MAX_N, a case forward refuses, a variant that does
        not say what weights it implies).
        """
        check_qkv(q, k, k)
        reasons = self.weights_reasons(device=q.device, dtype=q.dtype, causal=causal,
                                       seq_len=q.shape[-2], head_dim=q.shape[-1])
        if reasons:
            raise ValueError("; ".join(reasons))
        if self.contract.inputs or inputs:
            check_inputs(self.name, self.contract.inputs, q, inputs)
            return self.attention_weights(q, k, causal, **inputs)
        return self.attention_weights(q, k, causal)

    def draw_inputs(self, B: int, H: int, N: int, D: int, *, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device="cpu",
                    fixed_seed: int | None = None) -> dict[str, torch.Tensor]:
        """The declared inputs beyond q, k, v as a benchmark draws them from `seed` (the
        papers' layers at initialisation); {} for a variant that declares none.
        fixed_seed: the layers' per-case parameters (a decay rate per head) from that
        seed instead (`inputs.draw_inputs`), for a sequence drawn in pieces."""
        return draw_inputs(self.contract.inputs, B, H, N, D, seed=seed, dtype=dtype, device=device,
                           fixed_seed=fixed_seed)

    def weights_reasons(self, *, device: torch.device | str, dtype: torch.dtype, causal: bool,
                        seq_len: int, head_dim: int) -> list[str]:
        """Why `weights` cannot give this case's map; empty when it can."""
        reasons = self.unsupported_reasons(device=device, dtype=dtype, causal=causal,
                                           seq_len=seq_len, head_dim=head_dim)
        if seq_len > WEIGHTS_MAX_N:
            reasons.append(f"{self.name}.weights returns an N x N map per head: refused above "
                           f"N = {WEIGHTS_MAX_N}, got N = {seq_len}")
        if not self.contract.says_weights:
            reasons.append(f"{self.name} does not say what attention weights it implies "
                           "(no attention_weights method)")
        return reasons + self.extra_weights_reasons()

    def extra_weights_reasons(self) -> list[str]:
        """Variant-specific reasons `weights` cannot give a map; override where needed."""
        return []

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, causal: bool,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, N, N) weights, called by `weights` after its checks. This default serves
        exact and pattern-exact variants: softmax over the keys the pattern allows (with
        `sink = true`, each head's sink logit in the denominator: rows summing to below 1)."""
        return softmax_weights(q, k, causal, key_mask=self.key_mask(q.shape[-2]), sinks=sinks)

    # -- the keys it selects (the Sparse Frontier) ---------------------------------
    # The integer parameter that sets how many keys a query attends to (top_k, a BigBird
    # layout's random_blocks): `budget_params` sets it for a budget; None: none to set.
    budget_param: ClassVar[str | None] = None

    def budget_params(self, keys: float, N: int, causal: bool) -> dict | None:
        """{budget_param: value}: the value whose `keys_per_query(N, causal)` is closest to
        `keys` (bisection: the count grows with it), the other parameters as they are;
        None for a variant without a budget parameter. How the Sparse Frontier's budgets
        (a fraction of the keys) become settings (harness.measure.matrix, `budgets`)."""
        name = self.budget_param
        if name is None:
            return None
        field = {f.name: f for f in dataclasses.fields(self.params)}[name]
        lo = int(field.metadata.get("min") or 0)

        def count(x: int) -> float:
            return type(self)(dataclasses.replace(self.params, **{name: x})).keys_per_query(
                N, causal)
        hi = max(lo, N)
        a, b = lo, hi
        while a < b:  # the least value reaching `keys` (hi if none does)
            m = (a + b) // 2
            if count(m) >= keys:
                b = m
            else:
                a = m + 1
        best = a if a == lo or abs(count(a) - keys) <= abs(count(a - 1) - keys) else a - 1
        return {name: best}

    def selection(self, q: torch.Tensor, k: torch.Tensor, causal: bool = False,
                  **inputs: torch.Tensor):
        """What this variant computes to choose the keys each query attends to, in its own
        form (block, page or key indices; a fixed pattern's key mask), computed as its
        forward computes it: the harness times this call alone as the selection's cost
        (`select_ms`) and reads it with `selected_keys`. None where the variant attends to
        no subset of the keys with exact softmax (dense, low-rank, kernel, recurrent). The
        default: the pattern of `key_mask`, fixed beforehand (nothing is computed a call)."""
        return self.key_mask(q.shape[-2])

    def selection_cost(self, B: int, H: int, Hk: int, N: int, D: int, causal: bool = False,
                       itemsize: int = 4) -> tuple[float, float] | None:
        """(FLOPs, bytes) the selection costs a query, all heads, the mean over N queries:
        the scores it computes to choose (2 a multiply-add; the top-k's comparisons not
        counted) and the bytes of what those scores read (block means or bounds,
        compressed keys, indexer keys, the keys), `itemsize` bytes a number, as `selection`
        computes them (a chunk of queries scores what its last query sees; B sets the
        chunks). None where nothing is computed to choose: dense, kernel and recurrent
        variants, and a fixed pattern (this default). The Sparse Frontier's `select_flops`
        and `select_bytes` (Nawrot et al. 2025's selection cost, arXiv:2504.17768)."""
        return None

    def selected_keys(self, selection, rows: torch.Tensor, N: int,
                      causal: bool) -> torch.Tensor:
        """bool (B or 1, H or 1, len(rows), N): the keys query positions `rows` (long)
        attend to, from `selection` (this variant's own); causal: none after the query.
        Broadcast over batch or heads where the selection is shared. The default reads
        the key mask that `selection`'s default returns."""
        j = torch.arange(N, device=rows.device)
        m = selection(rows, j)  # (R, N)
        if causal:
            m = m & (j[None, :] <= rows[:, None])
        return m[None, None]

    # -- description ------------------------------------------------------------------
    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False) -> int:
        """Analytic forward FLOPs (2 per multiply-add, matmuls only)."""
        raise NotImplementedError

    def flops_at(self, s: Shape, causal: bool = False) -> int:
        """Forward FLOPs of a case of its own heads and widths (`Shape`). The default:
        `flops` at the output's heads (grouped heads share keys or values, not work: each
        output head still reads its N keys), scaled by (Dk + Dv) / 2 Dk where the values
        have their own width (attention's two matmuls, one over each width). A variant
        whose work is otherwise says its own."""
        f = self.flops(s.B, s.out_heads, s.N, s.D, causal)
        return f if s.Dv == s.D else round(f * (s.D + s.Dv) / (2 * s.D))

    def state_size_at(self, N: int, s: Shape) -> int | None:
        """Numbers a causal decoder keeps per batch element, all heads, for a case of its
        own heads and widths after N tokens. The default: a `repeat` grouping keeps one
        state per output head (the repeat counted); a variant that decodes grouped heads
        natively, or values of their own width, says its own."""
        per_head = self.state_size(N, s.D)
        if per_head is None:
            return None
        if s.Dv != s.D or (s.grouped and self.contract.grouping.how == "native"):
            raise NotImplementedError(f"{self.name} decodes grouped heads or widths natively "
                                      "but has no state_size_at")
        return s.out_heads * per_head

    def state_size(self, N: int, D: int) -> int | None:
        """Numbers a causal decoder keeps per (batch, head) to produce the output after N
        tokens: its key-value cache or its recurrent state (the "state size" the recall
        studies plot accuracy against; Based, Arora et al. 2024). None where the variant
        does not say (it cannot decode causally, or nobody wrote it down)."""
        return None

    def keys_per_query(self, N: int, causal: bool = False) -> float | None:
        """Mean number of keys a query attends to at this length (the budget that makes
        sparse patterns comparable): N for exact attention, (N + 1) / 2 causal; a window,
        a block layout, top-k blocks or keys say theirs. None where attention is not over
        a subset of the keys (low-rank, kernel and recurrent variants)."""
        if self.contract.exact:
            return float(N if not causal else (N + 1) / 2)
        return None

    def memory_bytes(self, B: int, H: int, N: int, D: int, dtype: torch.dtype,
                     backward: bool = False) -> int | None:
        """Predicted peak extra bytes of one call, where the variant can say; else None.

        The harness's memory guard uses it to skip a case that cannot fit instead of
        swapping. Only quadratic-memory paths need to say.
        """
        return None

    def key_mask(self, seq_len: int) -> KeyMask | None:
        """The non-causal key pattern for sparse variants that are exact on it, else None.

        A variant returning a mask claims: its output equals exact softmax attention
        restricted to this mask (AND j <= i when causal), to float rounding.
        """
        return None

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.params).items())
