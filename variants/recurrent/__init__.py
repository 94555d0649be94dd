"""Gated linear recurrences (family `recurrent`): a (D, D) state written once per token,
with a forget gate (a decay) and/or the delta rule (erase, then write); o_t = D^-1/2 q_t S_t.

- `retention`: RetNet (Sun et al. 2023, arXiv:2307.08621), a fixed decay per head.
- `gla`: gated linear attention (Yang et al. 2024, arXiv:2312.06635), a decay per channel.
- `mamba2`: Mamba2's SSD core (Dao & Gu 2024, arXiv:2405.21060), a decay per head and token.
- `deltanet`: the delta rule (Schlag et al. 2021; Yang et al. 2024, arXiv:2406.06484).
- `gated_deltanet`: Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, arXiv:2412.06464).
- `kda`: Kimi Delta Attention (Kimi Linear, arXiv:2510.26692), the delta rule after a decay
  per channel.

`reference.py` is the plain form: the sequential recurrence (the float64 reference these
variants' error is measured against: they approximate no softmax) and the dense weights;
`chunked.py` the chunkwise-parallel kernels (the WY/UT form for the delta rule);
`parallel.py` the one-chunk forms for a sequence that fits in one chunk; `scores.py` the
per-channel decayed scores of gla and kda, one path for any decay; `gates.py` the declared
inputs `g` and `beta` and the papers' initialisation the benchmark draws them from;
`recurrent.py` the variants. Imports: `variants.core` only.
"""

from .recurrent import (GLA, DeltaNet, GatedDeltaNet, KimiDeltaAttention, Mamba2, Recurrent,
                        Retention)
from .reference import dense_weights, recurrence

__all__ = ["DeltaNet", "GLA", "GatedDeltaNet", "KimiDeltaAttention", "Mamba2", "Recurrent",
           "Retention", "dense_weights", "recurrence"]
