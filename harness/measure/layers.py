"""What the harness builds for a case: its layers, one built module a layer.

A plain variant is one layer, the module `variants.build` returns. A layer pattern
("gated_deltanet*3+sdpa", harness.measure.stack) is a `Stack`: its mixers built one a layer,
each with its own parameters (the case's params JSON maps each mixer to its full
parameters), seen by the runner, the worker, the plan and the rows through the same
descriptive half of the variant interface a plain variant offers (family, state_size, the
reasons it cannot run, ...), summed or joined over its layers. Every caller builds a
case's module with `build(case)`, so a pattern never reaches `variants.build` as a name;
the decode pass steps `of(module)`, the layers, in turn.

A pattern is a model's layers: it is measured per generated token in the decode pass and
trained by `attnbench train`; its forward passes are not cases of their own
(FORWARD_REASON), and its decode row has no single reference (NO_REFERENCE).
"""

from __future__ import annotations

import dataclasses
import json

import variants
from harness.measure import stack

FORWARD_REASON = ("a layer pattern is a model's layers: measured per token in the decode "
                  "pass and trained by `train`; its forward pass is not a case")
NO_REFERENCE = ("a layer pattern's decode row has no single reference: its layers' tokens "
                "are drawn apart, and each mixer's own decoding is tested against its own")


@dataclasses.dataclass(frozen=True)
class StackContract:
    """What the harness reads of a stack's declared contract: its layers' joined."""
    supports_causal: bool
    compiled: bool
    inputs: tuple
    err_ref: None = None  # no single reference: the error columns stay empty (NO_REFERENCE)
    exact: bool = False
    prepare_calls: int = 0


class Stack:
    """A layer pattern as one case's module: `layers` (built, in layer order) and what the
    rows, the skips, the guard and the plan read of a module, over all of them."""

    family = stack.FAMILY

    def __init__(self, spec: str, params: dict[str, dict]):
        self.name = spec
        self.layers = tuple(variants.build(n, **params.get(n, {})) for n in stack.parse(spec))
        self.contract = StackContract(
            supports_causal=all(m.contract.supports_causal for m in self.layers),
            compiled=any(m.contract.compiled for m in self.layers),
            inputs=tuple({s.name: s for m in self.layers for s in m.contract.inputs}.values()))

    def to(self, device) -> "Stack":
        for m in self.layers:
            m.to(device)
        return self

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return False

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False) -> int:
        return sum(m.flops(B, H, N, D, causal) for m in self.layers)

    def flops_at(self, s, causal: bool = False) -> int:
        return sum(m.flops_at(s, causal) for m in self.layers)

    def state_size_at(self, N: int, s) -> int | None:
        sizes = [m.state_size_at(N, s) for m in self.layers]
        return None if None in sizes else sum(sizes)

    def state_bytes_at(self, N: int, s, dtype) -> int | None:
        sizes = [m.state_bytes_at(N, s, dtype) for m in self.layers]
        return None if None in sizes else sum(sizes)

    def state_size(self, N: int, D: int) -> int | None:
        """The sum of the layers' own state_size(N, D); None when one does not say."""
        sizes = [m.state_size(N, D) for m in self.layers]
        return None if None in sizes else sum(sizes)

    def decode_flops_at(self, N: int, s) -> int | None:
        """A token's step through every layer: the sum of the layers' (None when one does
        not say)."""
        flops = [m.decode_flops_at(N, s) for m in self.layers]
        return None if None in flops else sum(flops)

    def keys_per_query(self, N: int, causal: bool = False) -> None:
        return None  # no one budget: each layer attends its own way

    def unsupported_reasons(self, **case) -> list[str]:
        return _joined(m.unsupported_reasons(**case) for m in self.layers)

    def decode_reasons(self) -> list[str]:
        return _joined(m.decode_reasons() for m in self.layers)

    def setting_errors(self, device) -> list[str]:
        return _joined(m.setting_errors(device) for m in self.layers)

    def key_mask(self, N: int):
        return None  # several mixers: no one fixed pattern of keys

    def memory_bytes(self, *case) -> None:
        return None  # each layer's own: the guard goes by the measured points


def _joined(lists) -> list[str]:
    return list(dict.fromkeys(r for reasons in lists for r in reasons))


def build_mixer(spec: str, params: dict):
    """The module that stands for a mixer: the registered variant of a plain name built with
    `params`, or the `Stack` of a layer pattern (`params`: mixer name -> its parameters)."""
    return Stack(spec, params) if stack.is_pattern(spec) else variants.build(spec, **params)


def build(case):
    """The module of a case (a benchmark case or a training configuration: its `variant`
    and its params JSON)."""
    return build_mixer(case.variant, json.loads(case.params))


def repeats(module, layers: int) -> int:
    """How many times a model of `layers` layers repeats the module's layers (a plain
    variant: once a layer)."""
    return layers // len(of(module))


def of(module) -> tuple:
    """The layers a case's module steps through: a stack's, or the variant alone."""
    return module.layers if isinstance(module, Stack) else (module,)
