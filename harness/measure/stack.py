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
`layers_of`; harness.measure.layers builds a pattern's layers as one module (`Stack`),
which the decode pass steps in turn and whose state is the sum of its layers' own.
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


def composition(spec: str, layers: int) -> tuple[int, str]:
    """(attention_layers, mixer) of a model: how many of its layers are exact softmax
    attention (family `exact`), and its other layers' mixers "+"-joined in order of first
    appearance ("" for attention only)."""
    per_layer = layers_of(spec, layers)
    exact = {n for n in per_layer if variants.spec(n).family == "exact"}
    others = dict.fromkeys(n for n in per_layer if n not in exact)
    return sum(n in exact for n in per_layer), "+".join(others)
