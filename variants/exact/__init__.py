"""Exact softmax attention: softmax(q k^T / sqrt(D)) v over every key (family `exact`).

`standard` materialises the N x N matrix (the plain form, `core.naive_attention`); `sdpa`
is torch's fused kernel (FlashAttention, Dao et al. 2022); `xformers` is xformers'
memory-efficient kernel (Rabe & Staats 2021), CUDA only. All three decode by one exact
decoder (`cache.py`: a key-value cache laid out for one query row's read). Imports:
`variants.core` only.
"""

from .exact import SDPA, Standard, XFormers, kernel_missing, xformers_reasons

__all__ = ["SDPA", "Standard", "XFormers", "kernel_missing", "xformers_reasons"]
