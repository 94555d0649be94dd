"""Library kernels of our families' algorithms, each named for its library: FlexAttention
(`flex.py`, `*_flex`), SDPA with an explicit mask (`sdpa_mask.py`, `*_sdpa_mask`),
xformers' attention biases (`xformers_bias.py`, `*_xformers`) and flash-linear-attention's
Triton kernels of the gated recurrences (`fla.py`, `*_fla`).

Each is a variant of the family whose algorithm it runs (its `family` column) and is tested
for exactness against the same float64 reference as our own. Imports: `variants.core` and
the public pattern definitions of `sliding_window` and `sparse`, so that a library kernel
computes exactly the pattern ours does, and the public variants of `recurrent`, whose
recurrence, inputs and float64 reference the fla kernels share.
"""

from . import fla, flex, sdpa_mask, xformers_bias

__all__ = ["fla", "flex", "sdpa_mask", "xformers_bias"]
