"""Quest: each query attends to the top_k pages with the highest upper bound on its score.

Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
https://arxiv.org/abs/2406.10774 (Sec. 3): pages of `page_size` keys keep the elementwise
min m and max M of their keys; a query's bound for a page is sum_d max(q_d m_d, q_d M_d)
= q+ . M + q- . m (q+ and q- its positive and negative parts), no smaller than its score
against any key of the page; it reads the top_k pages. Quest was built for decoding (one
query against the cache); using its rule for every query of a forward pass is this
suite's extension, with MoBA's causal form: pages starting at or before the query, its
own page always among the top_k. A partial last page's min and max are over its actual
keys.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import param, register
from .blocks import BlockRouted
from .routing import block_bounds, grouped_scores


@dataclasses.dataclass(frozen=True)
class QuestParams:
    page_size: int = param(16, doc="keys per page", min=1)
    top_k: int = param(12, doc="pages each query reads (causal: its own among them)", min=1)


@register
class Quest(BlockRouted):
    """Exact softmax over each query's top_k pages by the key min/max bound (Quest)."""
    name = "quest"
    Params = QuestParams
    paper = "https://arxiv.org/abs/2406.10774"
    block_param = "page_size"
    gate_flops = 4  # two products: q+ . max and q- . min
    block_stat = "bounds"  # a decoder keeps each page's key min and max

    def gate(self, k):
        lo, hi = block_bounds(k, self.params.page_size)
        lo, hi = lo.transpose(-1, -2), hi.transpose(-1, -2)  # (B, Hk, D, np): once per kv head

        def bound(qc: torch.Tensor) -> torch.Tensor:
            return grouped_scores(qc.clamp(min=0), hi) + grouped_scores(qc.clamp(max=0), lo)
        return bound
