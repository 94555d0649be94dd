"""Learned sparse selection (family `learned_sparse`): each query attends, with exact
softmax, to the keys a cheap scorer of its own selects, the scorer's work in the call.

- `dsa`: DeepSeek Sparse Attention (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556,
  Sec. 2.1): the lightning indexer's top_k keys per query, or the `heads` proxy (the
  summed attention logits the indexer is trained toward); causal only.

`indexer.py` holds the indexer's scores in query chunks, the top-k rule (ties toward the
later position) and the declared inputs; `gathered.py` the attention over the selected
keys by query chunk with a recomputing backward; `reference.py` the float64 plain form
the kernels are tested against (dense indexer scores, the top-k mask, softmax over it).
Imports: `variants.core` only.
"""

from . import dsa  # noqa: F401
from .dsa import Dsa, DsaParams
from .reference import dsa_mask, dsa_reference

__all__ = ["Dsa", "DsaParams", "dsa_mask", "dsa_reference"]
