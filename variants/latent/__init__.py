"""Latent attention (family `latent`): every head's keys and values decompressed from one
latent a token, so that a decoder caches the latent, not the heads.

- `mla`: multi-head latent attention (DeepSeek-V2, https://arxiv.org/abs/2405.04434,
  Sec. 2.1; DeepSeek-V3): a latent of kv_lora_rank and a shared rotary key of
  qk_rope_head_dim a token; `form = "naive"` decompresses per-head keys and values,
  `"absorbed"` folds the up-projections into the query and the output and attends over
  the latent (its decoder keeps kv_lora_rank + qk_rope_head_dim numbers a token for all
  heads).

`kernels.py` holds both forward forms (on torch's fused SDPA) and the absorbed decoding
step; `reference.py` the float64 forms from the definition (per-head keys and values
decompressed, exact softmax) the kernels are measured against. Imports: `variants.core`
only.
"""

from . import mla  # noqa: F401
from .mla import Mla, MlaParams, mla_inputs
from .reference import LatentDecodeReference, mla_reference

__all__ = ["LatentDecodeReference", "Mla", "MlaParams", "mla_inputs", "mla_reference"]
