"""Low-rank attention: softmax(q (E k)^T / sqrt(D)) (F v) with k x N projections E, F
(family `low_rank`; Linformer, Wang et al. 2020).

`linformer.py` holds the variant, the segment means (`mean_pool` projections) and the
blocked exact `softmax_attention` it runs on the projected keys; the last two are public,
for Nystromformer's landmarks and Long-Short's summaries. The plain form is the variant's
`weights` (the dense N x N map the projections imply). Imports: `variants.core` only.
"""

from .linformer import (Linformer, LinformerParams, segment_means, segment_sizes,
                        softmax_attention)

__all__ = ["Linformer", "LinformerParams", "segment_means", "segment_sizes",
           "softmax_attention"]
