"""Linear attention: phi(q) (phi(k)^T v) / phi(q) phi(k)^T 1 with a feature map phi
(family `linear`): elu(x) + 1 (Katharopoulos et al. 2020) and FAVOR+ random features
(Performer, Choromanski et al. 2021).

`linear.py` holds the feature maps and the variants; `noncausal.py` the blocked kernel
core, `causal.py` the chunked prefix sums (and the lagged sums band_lowrank builds on).
The plain form is `noncausal.kernel_weights`, the N x N kernel matrix normalised (the
variants' `weights`). Imports: `variants.core` only.
"""

from .causal import lagged_kernel_flops, lagged_kernel_sum
from .linear import (EluFeatures, FavorFeatures, Linear, LinearParams, Performer,
                     PerformerParams, random_projection)

__all__ = ["EluFeatures", "FavorFeatures", "Linear", "LinearParams", "Performer",
           "PerformerParams", "lagged_kernel_flops", "lagged_kernel_sum", "random_projection"]
