"""MoBA: each query attends to the top_k key blocks whose mean key it scores best.

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs",
https://arxiv.org/abs/2502.13189 (Sec. 2.2): blocks of `block_size` keys, gate score
s_j = q . mean(K_j), top_k blocks a query; causal: no block that starts after the query,
its own block always chosen (and counted among the top_k), with the causal mask inside
it. Training-free here: the gate has no parameters, and the selection is not
differentiated (as in the paper: gradients flow through the attention over the selected
keys). A partial last block's mean is over its actual keys.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import param, register
from .blocks import BlockRouted
from .routing import block_means, grouped_scores


@dataclasses.dataclass(frozen=True)
class MobaParams:
    block_size: int = param(64, doc="keys per block", min=1)
    top_k: int = param(3, doc="blocks each query reads (causal: its own among them)", min=1)


@register
class Moba(BlockRouted):
    """Exact softmax over each query's top_k key blocks by q . mean key (MoBA)."""
    name = "moba"
    Params = MobaParams
    paper = "https://arxiv.org/abs/2502.13189"
    block_param = "block_size"
    gate_flops = 2

    def gate(self, k):
        # Once per kv head: (B, Hk, D, nb); each query head scores its kv head's means.
        means = block_means(k, self.params.block_size).transpose(-1, -2)

        def scores(qc: torch.Tensor) -> torch.Tensor:
            return grouped_scores(qc, means)  # (B, Hq, c, nb)
        return scores
