"""The contract a variant signs: one declared, frozen, typed record of what it can do.

Every variant class declares `contract = Contract(...)` (a subclass of a family's base
declares `contract = Base.contract.but(...)`); the registry checks the declaration against
the class at registration (`check_declaration`: a key pattern needs a `key_mask`, decoding
needs a prefill and a step, ...) and refuses one the class cannot honour with one line.
Everything else (the registry's `spec`, the harness, the conformance kit, `attnbench
list`) reads this record and nothing else: no capability is inferred from which methods a
class overrides, and no class-level flag is read outside variants/core.

Heads and widths. q is (B, Hq, N, Dq), k (B, Hk, N, Dk), v (B, Hv, N, Dv), Dq = Dk:

  * softmax grouping (`Grouping.heads == "kv"`): Hk = Hv dividing Hq; query head h reads
    key-value head h // (Hq / Hk) (SDPA's `enable_gqa`); the output is (B, Hq, N, Dv).
  * value grouping (`"value"`, the recurrences): Hq = Hk dividing Hv; value head j reads
    query-key head j // (Hv / Hk) (flash-linear-attention's `num_v_heads`), its gates are
    per value head; the output is (B, Hv, N, Dv).

`Grouping.how` says how a variant runs a grouping: `native` (its kernel reads the shared
heads, never repeating them), `repeat` (the base class repeats the shared heads to one per
output head before `attend`: its time, memory and bytes count the repeat) or `refuse`
(with `why`). `value_dim`: it runs Dv != Dk.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .inputs import InputSpec

Exactness = Literal["exact", "pattern", "approximate", "own"]
CausalModes = Literal["both", "causal_only", "non_causal_only"]
GroupedHeads = Literal["kv", "value"]
GroupingHow = Literal["native", "repeat", "refuse"]

EXACTNESS = ("exact", "pattern", "approximate", "own")
# What an `own` variant's float64 form is: a recurrence's sequential form, or the exact
# softmax of its own definition over keys and values it builds itself (mla's latent ones).
OWN_REFERENCES = ("recurrence", "own_softmax")
CAUSAL_MODES = ("both", "causal_only", "non_causal_only")
GROUPED_HEADS = ("kv", "value")
GROUPING_HOW = ("native", "repeat", "refuse")


class ContractError(TypeError):
    """A declaration the class cannot honour, or a malformed one: refused at registration."""


def _choice(field: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ContractError(f"{field} must be one of {', '.join(allowed)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Grouping:
    """Which head and width groupings a variant runs.

    heads: the head count that may differ from q's: `kv` (softmax: Hk = Hv dividing Hq) or
    `value` (recurrences: Hq = Hk dividing Hv). how: `native`, `repeat` or `refuse`; why:
    the reason, required where it refuses. value_dim: it runs values of their own width
    (Dv != Dk); the output is Dv wide. group_selects: the query heads of a key-value group
    share one choice of keys (NSA's block selection, summed over the group): a grouped
    call is then its call on the heads repeated only where a group's query heads are
    equal, which is how the conformance kit compares the two."""
    heads: GroupedHeads = "kv"
    how: GroupingHow = "repeat"
    why: str = ""
    value_dim: bool = False
    group_selects: bool = False

    def __post_init__(self):
        _choice("grouping.heads", self.heads, GROUPED_HEADS)
        _choice("grouping.how", self.how, GROUPING_HOW)
        if self.how == "refuse" and not self.why:
            raise ContractError("grouping.how = 'refuse' needs its reason in grouping.why")

    def describe(self) -> str:
        """`kv native`, `value repeat`, `kv refuses (why)`; `+ Dv` where value_dim."""
        text = f"{self.heads} {self.how}" if self.how != "refuse" else \
            f"{self.heads} refuses ({self.why})"
        return (text + (", Dv != Dk" if self.value_dim else "")
                + (", one selection a group" if self.group_selects else ""))


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a variant can do, declared once.

    exactness: `exact` (softmax over every key), `pattern` (exact softmax restricted to the
        key pattern its `key_mask` returns), `approximate` (measured against exact softmax)
        or `own` (approximates no softmax: measured against its own float64 form, the
        `reference` method).
    causal: `both`, `causal_only` or `non_causal_only`; refused_why: why the other mode is
        refused (required unless `both`).
    backward: it has a backward pass. decoding: it has a token-by-token form
        (`decode_prefill` and `decode_step`); extend: it prefills a context in pieces
        (`decode_extend`). weights: it has its own `attention_weights` (the weights it
        implies); exact and pattern variants say theirs without one (softmax over the
        keys they attend: `says_weights`).
    inputs: the inputs beyond q, k, v (`InputSpec`); their `H` is the output's head count.
    compiled: runs a torch.compile'd kernel (compiles in `prepare`); prepare_calls: calls
        of the measured pass `prepare` makes (subtracted from `compile_ms`).
    reference_ceiling: a bound for the others (the top-k oracle), never offered as an answer.
    grouping: the head and width groupings it runs (`Grouping`).
    per_head_schedule: head h has its own fixed constant (RetNet's decay): heads are not
        interchangeable (the kit's batch-and-heads property permutes none).
    output_layer: the paper's norm and gate after the mixer (harness.train.output_layer),
        "" for none.
    floor: a floor of the trained comparisons (`none`), no benchmark variant: `"all"` and
        the registry's listing leave it out; named, it builds.
    """
    exactness: Exactness = "approximate"
    causal: CausalModes = "both"
    refused_why: str = ""
    backward: bool = True
    decoding: bool = False
    extend: bool = False
    weights: bool = False
    inputs: tuple[InputSpec, ...] = ()
    compiled: bool = False
    prepare_calls: int = 0
    reference_ceiling: bool = False
    grouping: Grouping = Grouping()
    per_head_schedule: bool = False
    output_layer: str = ""
    floor: bool = False
    own_reference: str = "recurrence"

    def __post_init__(self):
        _choice("exactness", self.exactness, EXACTNESS)
        _choice("causal", self.causal, CAUSAL_MODES)
        _choice("own_reference", self.own_reference, OWN_REFERENCES)
        if self.causal != "both" and not self.refused_why:
            raise ContractError(f"causal = {self.causal!r} needs the reason the other mode is "
                                "refused in refused_why")
        if not isinstance(self.inputs, tuple) or not all(isinstance(i, InputSpec)
                                                          for i in self.inputs):
            raise ContractError("inputs must be a tuple of InputSpec")
        if not isinstance(self.grouping, Grouping):
            raise ContractError("grouping must be a Grouping")
        if self.extend and not self.decoding:
            raise ContractError("extend = True needs decoding = True")
        if self.causal == "non_causal_only" and self.decoding:
            raise ContractError("a non-causal-only variant cannot declare decoding")
        if not isinstance(self.prepare_calls, int) or self.prepare_calls < 0:
            raise ContractError("prepare_calls must be an int >= 0")

    def but(self, **changes) -> "Contract":
        """This contract with some fields changed (a subclass's declaration)."""
        return dataclasses.replace(self, **changes)

    # -- read-outs --------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        return self.exactness == "exact"

    @property
    def pattern_exact(self) -> bool:
        return self.exactness == "pattern"

    @property
    def says_weights(self) -> bool:
        """Whether it says what attention weights it implies (`Variant.weights`)."""
        return self.weights or self.exactness in ("exact", "pattern")

    @property
    def err_ref(self) -> str:
        """What its error is measured against: `softmax` (exact attention over its q, k, v),
        or its own float64 form: `recurrence`, or `own_softmax` (exact softmax of its own
        definition, as mla's latent keys and values)."""
        return self.own_reference if self.exactness == "own" else "softmax"

    @property
    def supports_causal(self) -> bool:
        return self.causal != "non_causal_only"

    @property
    def causal_only(self) -> bool:
        return self.causal == "causal_only"

    def describe(self) -> dict[str, str]:
        """One line per field, as `attnbench list --spec` prints it."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "inputs":
                value = "; ".join(i.describe() for i in value) or "-"
            elif f.name == "grouping":
                value = value.describe()
            elif f.name == "own_reference" and self.exactness != "own":
                value = "-"  # read only by `own` variants: no default shown as if declared
            out[f.name] = str(value)
        out["err_ref"] = self.err_ref  # what its error is measured against (derived)
        return out


@dataclasses.dataclass(frozen=True)
class Shape:
    """A case's heads and widths: B, H query heads, N, D (= Dk = Dq), and where they differ
    kv_heads (Hk = Hv for grouped keys), value_heads (Hv for grouped values) and value_dim
    (Dv); None: H, H, D."""
    B: int
    H: int
    N: int
    D: int
    kv_heads: int | None = None
    value_heads: int | None = None
    value_dim: int | None = None

    @property
    def Hk(self) -> int:
        return self.kv_heads or self.H

    @property
    def Hv(self) -> int:
        return self.value_heads or self.kv_heads or self.H

    @property
    def Dv(self) -> int:
        return self.value_dim or self.D

    @property
    def out_heads(self) -> int:
        """The output's heads: Hq for grouped keys, Hv for grouped values."""
        return max(self.H, self.Hv)

    @property
    def grouped(self) -> bool:
        return self.Hk != self.H or self.Hv != self.H

    def shapes(self) -> tuple[tuple, tuple, tuple]:
        """(q, k, v) shapes."""
        return ((self.B, self.H, self.N, self.D), (self.B, self.Hk, self.N, self.D),
                (self.B, self.Hv, self.N, self.Dv))

    def check(self, grouping: Grouping, name: str = "") -> list[str]:
        """Why a variant of this grouping cannot take this shape; empty when it can."""
        who = f"{name}: " if name else ""
        out = []
        for label, x in (("kv_heads", self.kv_heads), ("value_heads", self.value_heads),
                         ("value_dim", self.value_dim)):
            if x is not None and (not isinstance(x, int) or x < 1):
                out.append(f"{who}{label} must be a positive int, got {x!r}")
        if out:
            return out
        if self.Dv != self.D and not grouping.value_dim:
            out.append(f"{who}does not declare values of their own width (value_dim "
                       f"{self.Dv} != head_dim {self.D})")
        if self.kv_heads not in (None, self.H) and grouping.heads != "kv":
            out.append(f"{who}groups value heads, not key-value heads (kv_heads {self.kv_heads})")
        elif self.value_heads not in (None, self.H) and grouping.heads != "value":
            out.append(f"{who}groups key-value heads, not value heads "
                       f"(value_heads {self.value_heads})")
        elif self.grouped and grouping.how == "refuse":
            out.append(f"{who}refuses grouped heads: {grouping.why}")
        elif grouping.heads == "kv" and self.H % self.Hk:
            out.append(f"{who}kv_heads {self.Hk} must divide heads {self.H}")
        elif grouping.heads == "value" and self.Hv % self.H:
            out.append(f"{who}heads {self.H} must divide value_heads {self.Hv}")
        return out
