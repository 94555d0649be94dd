"""attnbench variants: a package per family, each registering its variants on import.

    import variants
    variants.names()                      # every registered variant
    m = variants.build("sdpa")            # a torch.nn.Module
    o = m(q, k, v, causal=False)          # q, k, v: (B, H, N, D); grouped heads and
                                          # values' width as its contract declares
    variants.spec("sdpa").contract        # what it can do, declared (core/contract.py)

`core/` is the bottom: the interface, the registry and the float64 exact reference. Each
family's folder holds its variants and the kernels only they use, and imports `core` and,
where it builds on another family, that family's public names (its `__init__`), never its
modules. `library/` holds library kernels (flex, SDPA with a mask, xformers biases) of
our families' algorithms.

Adding a variant: one new file in its family's folder (or a new folder for a new family)
and one import line in that folder's `__init__.py` (a new folder: one line below too). Or,
outside this package: a file of one's own that `@register`s it, loaded by
`load_module(path)` (the command line's `--variant-module`), or an installed package's entry
point in the group `attnbench.variants` (`load_entry_points`).
"""

from .core import (WEIGHTS_MAX_N, Contract, ContractError, Grouping, Shape, expand_heads,
                   KeyMask, ModuleError, ParamSpec, Variant, VariantSpec, build, dense_mask,
                   exact_reference, load_entry_points, load_module, loaded_modules, make_params,
                   naive_attention, names, origin, param, per_token, register, softmax_weights,
                   spec, stored_params)

__all__ = ["WEIGHTS_MAX_N", "Contract", "ContractError", "Grouping", "Shape", "expand_heads",
           "KeyMask", "ModuleError", "ParamSpec", "Variant", "VariantSpec", "build",
           "dense_mask", "exact_reference", "load_entry_points", "load_module",
           "loaded_modules", "make_params", "naive_attention", "names", "origin", "param",
           "per_token", "register", "softmax_weights", "spec", "stored_params"]

# The families, in registration order; importing a package registers its variants.
from . import exact  # noqa: E402,F401
from . import sliding_window  # noqa: E402,F401
from . import sparse  # noqa: E402,F401
from . import low_rank  # noqa: E402,F401
from . import nystrom  # noqa: E402,F401
from . import linear  # noqa: E402,F401
from . import band_lowrank  # noqa: E402,F401
from . import routed  # noqa: E402,F401
from . import learned_sparse  # noqa: E402,F401
from . import latent  # noqa: E402,F401
from . import recurrent  # noqa: E402,F401
from . import library  # noqa: E402,F401
from . import floor  # noqa: E402,F401
