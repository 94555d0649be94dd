"""A throwaway variant whose memory is known by construction, for the memory worker's tests
(tests/test_measure_planted.py): what it keeps between calls and what one call adds are
its parameters, so the worker's `state_mib` and `peak_mem_mib` have a hand-computed answer.

Loaded by path through ATTNBENCH_EXTRA_MODULES in the worker processes only; the name
starts with "_" so "all" leaves it out.
"""

from __future__ import annotations

import dataclasses

import torch

from variants import Variant, param, register

MIB_FLOATS = 2**18  # float32 elements in one MiB


@dataclasses.dataclass(frozen=True)
class KnownParams:
    state_mib: int = param(0, doc="MiB allocated on the first call and kept", min=0)
    temp_mib: int = param(16, doc="MiB one call allocates, written, and frees", min=0)
    how: str = param("one", doc="the call's temporary: one tensor, ten sequential ones "
                     "of temp_mib each, or temp_mib held live in 0.5 MiB pieces",
                     choices=("one", "sequential", "pieces"))


@register
class KnownMemory(Variant):
    """Keeps `state_mib` from its first call on; each call's peak is `temp_mib`; returns v."""
    name = "_known_memory"
    family = "test"
    Params = KnownParams

    def flops(self, B, H, N, D, causal=False):
        return 0

    def attend(self, q, k, v, causal):
        p = self.params
        if p.state_mib and not hasattr(self, "_kept"):  # a layout or features, say
            self._kept = torch.ones(p.state_mib * MIB_FLOATS)
        if p.how == "one":
            t = torch.ones(p.temp_mib * MIB_FLOATS)
            del t
        elif p.how == "sequential":
            for _ in range(10):
                t = torch.ones(p.temp_mib * MIB_FLOATS)
                del t
        else:
            pieces = [torch.ones(MIB_FLOATS // 2) for _ in range(2 * p.temp_mib)]
            del pieces
        return v.clone()
