"""Library kernels of our families' algorithms, each named for its library: FlexAttention
(`flex.py`, `*_flex`), SDPA with an explicit mask (`sdpa_mask.py`, `*_sdpa_mask`) and
xformers' attention biases (`xformers_bias.py`, `*_xformers`).

Each is a variant of the family whose algorithm it runs (its `family` column) and is tested
for exactness against the same float64 reference as our own. Imports: `variants.core` and
the public pattern definitions of `sliding_window` and `sparse`, so that a library kernel
computes exactly the pattern ours does.
"""

from . import flex, sdpa_mask, xformers_bias

__all__ = ["flex", "sdpa_mask", "xformers_bias"]
