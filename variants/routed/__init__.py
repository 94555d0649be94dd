"""Content-routed sparse attention (family `routed`): each query attends, with exact
softmax, to the keys it selects by content, not to a pattern fixed beforehand.

- `moba`: the top_k key blocks by q . mean key (MoBA, Lu et al. 2025,
  https://arxiv.org/abs/2502.13189);
- `quest`: the top_k pages by the bound q+ . max + q- . min over the page's keys (Quest,
  Tang et al. 2024, https://arxiv.org/abs/2406.10774; a decoding rule, used here for
  every query);
- `topk`: the oracle, each query's top_k highest-scoring keys: a reference ceiling for
  any k-sparse method (O(N^2) selection), not an efficient variant.

Causal: blocks that start at or before the query, its own always among the top_k. The
selection is not differentiated; gradients flow through the selected scores. Each
variant's `select(q, k, causal)` gives the chosen block, page or key indices, and its
plain form is softmax under that selection's mask (its `weights`). `routing.py` holds the
block statistics and the chunked top-k rule, `routed_rows.py` the per-key-block kernel of
moba and quest (forward and a recomputing backward), `topk.py` the oracle with its own.
Imports: `variants.core` only.
"""

from . import moba, quest, topk  # noqa: F401
from .moba import Moba, MobaParams
from .quest import Quest, QuestParams
from .routing import block_bounds, block_means
from .topk import TopK, TopKParams

__all__ = ["Moba", "MobaParams", "Quest", "QuestParams", "TopK", "TopKParams",
           "block_bounds", "block_means"]
