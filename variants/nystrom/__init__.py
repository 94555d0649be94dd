"""Nystrom attention: segment-mean landmarks and an iterative Moore-Penrose pseudo-inverse
(family `nystrom`; Nystromformer, Xiong et al. 2021).

`nystrom.py` holds the variant and `iterative_pinv`; the plain form is its `weights` (the
three-factor product, dense). Imports: `variants.core` and the public segment means and
blocked softmax of `variants.low_rank`.
"""

from .nystrom import Nystrom, NystromParams, iterative_pinv

__all__ = ["Nystrom", "NystromParams", "iterative_pinv"]
