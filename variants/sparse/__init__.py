"""Block-sparse attention: exact softmax over a BigBird block layout (family `sparse`;
Zaheer et al. 2020): local window blocks, global blocks and seeded random blocks.

`block_sparse.py` holds the layout, the step plan and the variant; its step kernel
(gathers, scatters, the recomputing backward) is `block_rows.py`. The plain form is
softmax under the layout's key mask (the variant's `weights`). `SameLayout` is public so
that library kernels compute the very same layout. Imports: `variants.core` only.
"""

from .block_sparse import BlockSparse, BlockSparseParams, SameLayout, bigbird_layout, in_layout

__all__ = ["BlockSparse", "BlockSparseParams", "SameLayout", "bigbird_layout", "in_layout"]
