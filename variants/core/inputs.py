"""Inputs beyond q, k, v: what a variant declares of each (name, shape, range, how a
benchmark draws it) and the checks `Variant.forward` runs on them before any work.

A gated recurrence takes a log-decay `g` ((B, H, N) per head or (B, H, N, D) per channel,
<= 0) and a write strength `beta` ((B, H, N) in (0, 1)). They are per-token tensors, not
parameters: a model computes them from its hidden state, a benchmark draws them from the
case's seed as the papers' layers would at initialisation (`InputSpec.sample`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

# sample(generator, B, H, N, D, **fixed) -> float32 CPU tensor of the declared shape;
# `fixed` the case's parameters when the spec has `fixed` (below).
Sampler = Callable[..., torch.Tensor]
# fixed(generator, H, D) -> {name: tensor}: what a layer fixes once per case rather than per
# token (Mamba2's A_log and dt_bias per head), drawn first from the same generator.
FixedSampler = Callable[[torch.Generator, int, int], dict]


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One declared input: `dims` names its shape from (B, H, N, D); values lie in
    [low, high] (None: unbounded; `open_low`/`open_high` exclude the bound); `drawn` says
    in words how `sample` draws it (the paper's layer at initialisation); `layer` names the
    paper's layer that makes it from a hidden state (a trained model builds that layer:
    harness.train.model). `fixed`, where the layer has them, draws its per-case parameters
    (a decay rate per head), which `sample` then takes: a sequence drawn in pieces
    (a decode benchmark's context) keeps one set for all its pieces (`draw(fixed=...)`)."""
    name: str
    dims: tuple[str, ...]
    low: float | None
    high: float | None
    drawn: str
    sample: Sampler = dataclasses.field(repr=False, compare=False)
    open_low: bool = False
    open_high: bool = False
    doc: str = ""
    layer: str = ""
    fixed: FixedSampler | None = dataclasses.field(default=None, repr=False, compare=False)
    # Sizes of dims the input names itself, beyond the case's B, H, N, D: ((name, size), ...)
    # (dsa's indexer heads and width, a dim of one); its layout keeps B first and N third,
    # as q's, so that a sequence taken in pieces cuts it along dim 2.
    own_dims: tuple = ()

    @property
    def shape_text(self) -> str:
        return "(" + ", ".join(self.dims) + ")"

    @property
    def range_text(self) -> str:
        if self.low is None and self.high is None:
            return "any"
        if self.low is None:
            return f"{'<' if self.open_high else '<='} {self.high:g}"
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        return (f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.open_high else ']'}")

    def describe(self) -> str:
        """`g (B, H, N) <= 0; drawn: ...`, as `list` prints it."""
        return f"{self.name} {self.shape_text} {self.range_text}; drawn: {self.drawn}"

    def shape_for(self, q: torch.Tensor, sizes: dict | None = None) -> tuple[int, ...]:
        """Its shape for a case: `sizes` (B, H, N, D; H the output's head count, D the
        keys' width: `checks.input_sizes`), or q's own (B, H, N, D); `own_dims` give the
        sizes of the dims the input names itself."""
        sizes = {**(sizes or dict(zip(("B", "H", "N", "D"), q.shape))), **dict(self.own_dims)}
        return tuple(sizes[d] for d in self.dims)

    def in_range(self, x: torch.Tensor) -> bool:
        ok = torch.ones((), dtype=torch.bool, device=x.device)
        if self.low is not None:
            ok = ok & (x > self.low).all() if self.open_low else ok & (x >= self.low).all()
        if self.high is not None:
            ok = ok & (x < self.high).all() if self.open_high else ok & (x <= self.high).all()
        return bool(ok)

    def draw_fixed(self, H: int, D: int, *, seed: int) -> dict:
        """The per-case parameters `draw` would take from `seed` ({} without `fixed`)."""
        return {} if self.fixed is None else self.fixed(torch.Generator().manual_seed(seed), H, D)

    def draw(self, B: int, H: int, N: int, D: int, *, seed: int, dtype=torch.float32,
             device="cpu", fixed: dict | None = None) -> torch.Tensor:
        """The benchmark's draw from `seed` (on CPU in float32, then cast), kept inside an
        open range after the cast (bfloat16 rounds sigmoid(5) to 1). The per-case
        parameters come first from the same generator, unless `fixed` gives them (from
        `draw_fixed`: one set for every piece of a sequence drawn in pieces)."""
        gen = torch.Generator().manual_seed(seed)
        if self.fixed is not None and fixed is None:
            fixed = self.fixed(gen, H, D)
        x = self.sample(gen, B, H, N, D, **(fixed or {})).to(dtype)
        if self.open_high and self.high is not None:
            x = x.clamp(max=_below(self.high, dtype))
        if self.open_low and self.low is not None:
            x = x.clamp(min=_above(self.low, dtype))
        return x.to(device).contiguous()


def _below(x: float, dtype: torch.dtype) -> float:
    """The largest number of `dtype` below x."""
    inf = torch.tensor(-math.inf, dtype=dtype)
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), inf))


def _above(x: float, dtype: torch.dtype) -> float:
    """The smallest number of `dtype` above x."""
    inf = torch.tensor(math.inf, dtype=dtype)
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), inf))


def check_inputs(variant: str, specs: tuple[InputSpec, ...], q: torch.Tensor,
                 inputs: dict, sizes: dict | None = None) -> None:
    """Raise ValueError naming the input unless `inputs` holds exactly the declared ones,
    each a tensor of its shape, on q's device, of q's dtype, within its range; `sizes`
    gives the case's B, H, N, D where q's shape does not (grouped value heads)."""
    declared = {s.name: s for s in specs}
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        allowed = ", ".join(declared) if declared else "none"
        raise ValueError(f"{variant}: unknown input(s) {', '.join(map(repr, unknown))}; "
                         f"declared: {allowed}")
    missing = [n for n in declared if n not in inputs]
    if missing:
        raise ValueError(f"{variant}: missing input(s) "
                         + "; ".join(declared[n].describe() for n in missing))
    for name, s in declared.items():
        x = inputs[name]
        where = f"{variant}: input {name!r}"
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{where} must be a tensor {s.shape_text}, got {type(x).__name__}")
        want = s.shape_for(q, sizes)
        if tuple(x.shape) != want:
            raise ValueError(f"{where} must be {s.shape_text} = {want}, got {tuple(x.shape)}")
        if x.device != q.device or x.dtype != q.dtype:
            raise ValueError(f"{where} must be on q's device and of q's dtype ({q.device}, "
                             f"{q.dtype}), got {x.device}, {x.dtype}")
        if x.device.type != "meta" and not s.in_range(x):  # meta tensors hold no values
            raise ValueError(f"{where} must lie in {s.range_text} (and be finite where "
                             f"bounded), got values in [{float(x.min()):g}, {float(x.max()):g}]")


def draw_inputs(specs: tuple[InputSpec, ...], B: int, H: int, N: int, D: int, *, seed: int,
                dtype=torch.float32, device="cpu",
                fixed_seed: int | None = None) -> dict[str, torch.Tensor]:
    """Every declared input drawn for a (B, H, N, D) case; input i from seed + 7919 (i + 1),
    so that it is independent of q, k, v drawn from `seed`. fixed_seed: the per-case
    parameters (`InputSpec.fixed`) drawn instead from fixed_seed + 7919 (i + 1), as a case of
    seed fixed_seed draws them, whatever `seed` the tokens come from (a sequence drawn in
    pieces, each piece from its own seed, keeps its case's decay rates throughout)."""
    out = {}
    for i, s in enumerate(specs):
        fixed = None if fixed_seed is None else s.draw_fixed(H, D, seed=fixed_seed + 7919 * (i + 1))
        out[s.name] = s.draw(B, H, N, D, seed=seed + 7919 * (i + 1), dtype=dtype, device=device,
                             fixed=fixed)
    return out
