"""Learned sparse selection (family `learned_sparse`): each query attends, with exact
softmax, to the keys a cheap scorer of its own selects, the scorer's work in the call.

- `dsa`: DeepSeek Sparse Attention (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556,
  Sec. 2.1): the lightning indexer's top_k keys per query, or the `heads` proxy (the
  summed attention logits the indexer is trained toward); causal only.
- `nsa`: Native Sparse Attention (https://arxiv.org/abs/2502.11089, Sec. 3): compressed
  blocks (mean-pooled), the top_n selection blocks by the compressed attention summed over
  a key-value group, and a sliding window, mixed by the gates gate_cmp, gate_slc,
  gate_win; causal only.

`indexer.py` holds the indexer's scores in query chunks, the top-k rule (ties toward the
later position) and the declared inputs; `gathered.py` the attention over the selected
keys by query chunk with a recomputing backward; `reference.py` the float64 plain form
the kernels are tested against (dense indexer scores, the top-k mask, softmax over it;
nsa's three branches from dense masks). `blocks.py` holds nsa's compressed branch and its
block selection in query chunks.
Imports: `variants.core` only.
"""

from . import dsa, nsa  # noqa: F401
from .dsa import Dsa, DsaParams
from .nsa import Nsa, NsaParams
from .reference import dsa_mask, dsa_reference, nsa_branches, nsa_reference

__all__ = ["Dsa", "DsaParams", "Nsa", "NsaParams", "dsa_mask", "dsa_reference",
           "nsa_branches", "nsa_reference"]
