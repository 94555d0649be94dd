"""Sliding-window attention: exact softmax over the band i - window <= j <= i + window
(family `sliding_window`; Longformer's local attention, Beltagy et al. 2020).

`sliding_window.py` holds the band geometry (masks, chunk spans) and the variant; its chunk
kernel, one chunk or a group of chunks with a recomputing backward, is `band_rows.py`. The
plain form is softmax under `band_mask` (the variant's `weights`). The band geometry is
public: band_lowrank and the library kernels build on it. `streaming.py` is StreamingLLM
(the first tokens plus a recent window, a constant cache). Imports: `variants.core` only.
"""

from .sliding_window import (MaskCache, SameBand, SlidingWindow, SlidingWindowParams, band_drop_mask,
                             band_keys, band_mask, band_span, band_views, chunk_rows, group_chunks,
                             in_band, mask_runs, window_covers)
from .streaming import Streaming, streaming_mask

__all__ = ["MaskCache", "SameBand", "SlidingWindow", "SlidingWindowParams", "band_drop_mask",
           "band_keys", "band_mask", "band_span", "band_views", "chunk_rows", "group_chunks", "in_band",
           "mask_runs", "window_covers", "Streaming", "streaming_mask"]
