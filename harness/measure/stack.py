"""Layer patterns: a stack of mixers named by one string, as the hybrid models ship them.

    "gated_deltanet*3+sdpa"   three gated_deltanet layers, then one sdpa layer
    "mamba2+sliding_window"   alternating, one of each
    "sdpa*4"                  four sdpa layers (the same model as "sdpa" at layers = 4)

A pattern is one or more terms joined by "+", a term a registered variant's name with an
optional "*count" (a positive integer). The pattern repeats to fill a model's `layers`,
which must be a multiple of its length (Qwen3-Next and Kimi Linear: 3:1 of a linear mixer
and full attention; MiniMax-01 and Jamba: 7:1; Samba: Mamba with sliding-window
attention). A plain name is a model of one mixer, not a pattern.

Everything here reads only the registry: the trained model builds one mixer per layer from
`layers_of`, the decode pass steps each layer in turn, and a stack's state is the sum of
its layers' own (`state_size`).
"""

from __future__ import annotations

import variants

FAMILY = "hybrid"  # the `family` column of every pattern


def is_pattern(spec: str) -> bool:
    """True for a layer pattern ("a*3+b", "a*4"), False for a plain variant name."""
    return "+" in spec or "*" in spec


def parse(spec: str) -> tuple[str, ...]:
    """The pattern's mixers in layer order, one entry a layer; ValueError naming the fault."""
    out = []
    for term in spec.split("+"):
        name, star, count = term.strip().partition("*")
        name = name.strip()
        if not name:
            raise ValueError(f"layer pattern {spec!r}: an empty term (write e.g. 'gla*3+sdpa')")
        if name not in variants.names(private=True):
            raise ValueError(f"layer pattern {spec!r}: unknown variant {name!r}; known: "
                             + ", ".join(variants.names()))
        n = 1
        if star:
            try:
                n = int(count)
            except ValueError:
                n = 0
            if n < 1 or str(n) != count.strip():
                raise ValueError(f"layer pattern {spec!r}: the count after '*' in {term!r} "
                                 "must be a positive integer")
        out += [name] * n
    return tuple(out)


def mixers(spec: str) -> tuple[str, ...]:
    """The distinct mixers of a pattern (or the plain name), in order of first appearance."""
    return tuple(dict.fromkeys(parse(spec) if is_pattern(spec) else (spec,)))


def layers_of(spec: str, layers: int) -> tuple[str, ...]:
    """The mixer of each of `layers` layers: a plain name in every layer, a pattern repeated.

    ValueError when `layers` is not a multiple of the pattern's length."""
    if not is_pattern(spec):
        return (spec,) * layers
    unit = parse(spec)
    if layers < 1 or layers % len(unit):
        raise ValueError(f"layer pattern {spec!r} has {len(unit)} layers, which does not "
                         f"divide layers = {layers}: use a multiple of {len(unit)}")
    return unit * (layers // len(unit))


def attention_share(spec: str, layers: int, full: frozenset[str]) -> float:
    """The fraction of a model's layers whose mixer is in `full` (e.g. the exact family)."""
    per_layer = layers_of(spec, layers)
    return sum(name in full for name in per_layer) / len(per_layer)


def params_of(spec: str, params: dict) -> dict[str, dict]:
    """Mixer name -> its parameters: a pattern's params already map them; a plain name's
    params are that variant's."""
    return params if is_pattern(spec) else {spec: params}


class Stack:
    """A layer pattern where the harness describes a model by its mixer: the family
    (`hybrid`), the reasons it cannot run (any layer's, named by its mixer), its FLOPs per
    layer, no fixed key pattern. One module per distinct mixer, built with its parameters
    (`params`: mixer name -> parameters)."""

    family = FAMILY

    def __init__(self, spec: str, params: dict[str, dict]):
        self.name, self.unit = spec, parse(spec)
        self.modules = {n: variants.build(n, **params.get(n, {})) for n in mixers(spec)}

    def layer_modules(self, layers: int) -> list:
        return [self.modules[n] for n in layers_of(self.name, layers)]

    def unsupported_reasons(self, **case) -> list[str]:
        return [f"{n}: {r}" for n, m in self.modules.items() for r in m.unsupported_reasons(**case)]

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False) -> float:
        """Forward FLOPs of one layer, averaged over the pattern: `layers` times this is the
        model's (layers is a multiple of the pattern's length)."""
        return sum(self.modules[n].flops(B, H, N, D, causal) for n in self.unit) / len(self.unit)

    def key_mask(self, N: int):
        return None  # several mixers: no one fixed pattern of keys


def build(spec: str, params: dict):
    """The module that stands for a model's mixer: the variant of a plain name, else a Stack."""
    return Stack(spec, params) if is_pattern(spec) else variants.build(spec, **params)


def model_state(module, layers: int, N: int, D: int) -> int | None:
    """Elements a model of `layers` layers keeps per (batch, head) at context N: the sum over
    its layers of each mixer's own `state_size(N, D)` (`module` from `build`). None when any
    layer's mixer declares no state size."""
    per_layer = module.layer_modules(layers) if isinstance(module, Stack) else [module] * layers
    sizes = [m.state_size(N, D) for m in per_layer]
    return None if None in sizes else sum(sizes)


def state_size(spec: str, layers: int, params: dict[str, dict], N: int, D: int) -> int | None:
    """`model_state` of a pattern or plain name whose mixers take `params` (name -> params)."""
    return model_state(build(spec, params if is_pattern(spec) else params.get(spec, {})),
                       layers, N, D)


def composition(spec: str, layers: int) -> tuple[int, str]:
    """(attention_layers, mixer) of a model: how many of its layers are exact softmax
    attention (family `exact`), and its other layers' mixers "+"-joined in order of first
    appearance ("" for attention only)."""
    per_layer = layers_of(spec, layers)
    exact = {n for n in per_layer if variants.spec(n).family == "exact"}
    others = dict.fromkeys(n for n in per_layer if n not in exact)
    return sum(n in exact for n in per_layer), "+".join(others)
