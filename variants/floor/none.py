"""`none`: the mixer whose output is zero.

In the trained model (harness.train.model) a block is its short convolution, the mixer and
its MLP; with `none` the mixer adds nothing, so the model is the convolution and the MLP
alone: the floor every mixer is set against on text (issue 50: a mixer that does not beat
it by a clear margin has learned nothing from the context beyond the convolution's three
bytes). It keeps no state and reads no key. Not a benchmark variant (there is nothing to
time or to compare with softmax): `"all"` leaves it out (`floor`); named, it builds.
"""

from __future__ import annotations

import torch

from ..core import Contract, Variant, register


@register
class NoMixer(Variant):
    """o = 0: the block without its mixer (the trained comparisons' floor)."""
    name = "none"
    family = "none"
    # compared with its own reference (zero); a floor: left out of "all" (registry.names)
    contract = Contract(exactness="own", floor=True)

    def attend(self, q, k, v, causal):
        return torch.zeros_like(v)

    def reference(self, q, k, v, causal=True, **inputs):
        return torch.zeros_like(v, dtype=torch.float64)

    def state_size(self, N, D):
        return 0

    def flops(self, B, H, N, D, causal=False):
        return 0
