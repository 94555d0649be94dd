"""attnbench variants: one file per family, each registering itself.

    import variants
    variants.names()                      # every registered variant
    m = variants.build("sdpa")            # a torch.nn.Module
    o = m(q, k, v, causal=False)          # q, k, v: (B, H, N, D)

Adding a variant: one new file in this package and one import line below.
"""

from .base import KeyMask, Variant, param
from .reference import dense_mask, exact_reference, naive_attention, softmax_weights
from .registry import ParamSpec, VariantSpec, build, make_params, names, register, spec

__all__ = ["KeyMask", "ParamSpec", "Variant", "VariantSpec", "build", "dense_mask",
           "exact_reference", "make_params", "naive_attention", "names", "param",
           "register", "softmax_weights", "spec"]

# The variant families; importing a module registers its variants.
from . import exact  # noqa: E402,F401
from . import sliding_window  # noqa: E402,F401
from . import block_sparse  # noqa: E402,F401
from . import linformer  # noqa: E402,F401
from . import nystrom  # noqa: E402,F401
from . import linear  # noqa: E402,F401
from . import band_lowrank  # noqa: E402,F401
from . import flex  # noqa: E402,F401
from . import sdpa_mask  # noqa: E402,F401
from . import xformers_bias  # noqa: E402,F401
