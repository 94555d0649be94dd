"""The bottom of variants/: the interface, the registry and the float64 exact reference.

`interface.Variant` is the pure q, k, v -> o map every variant subclasses; `contract` the
one declared record of what a variant can do (and the heads and widths it takes) that
everything else reads; `registry` is the
one list of variants (`register`, `build`, `names`, `spec`); `reference` is exact softmax
attention in float64, in query chunks, that every error is measured against; `checks`
(shapes, key masks, the 1/sqrt(D) scale) sits below both; `ops` holds the in-place numerics
the families' kernels share; `decoder` the decoding half of the interface (prefill, step,
their checks, what a step reads and writes); `cache_dtype` the narrow dtypes a decoding
cache may store keys and values in (bfloat16, fp8 with scales); `decoding` the states a decoder keeps (a
key-value cache written in place, a ring buffer; `CacheDecoder`, the extend of a variant
that decodes from one); `modules` the variants from outside the package (a module of one's
own, an entry point), with where each came from. Imports: torch only; nothing from the
families.
"""

from . import cache_dtype
from .cache_dtype import CACHE_DTYPES, cache_dtype_param
from .checks import KeyMask, check_qkv, expand_heads, softmax_scale
from .contract import Contract, ContractError, Grouping, Shape
from .decoding import CacheDecoder, DecodeState, KVCache, RingKV
from .inputs import InputSpec
from .interface import WEIGHTS_MAX_N, NoParams, Variant, param
from .ops import (Workspace, compute_dtype, exp_, softmax_, softmax_logsumexp,
                  softmax_lse_)
from .modules import ModuleError, load_entry_points, load_module, loaded_modules
from .reference import (attend_row, dense_mask, exact_reference, naive_attention,
                        softmax_sinked, softmax_weights)
from .sinks import SINKS, Sinks, per_token, sink_grad, sink_param, sinked
from .registry import (ParamSpec, VariantSpec, build, make_params, names, origin, register,
                       spec, stored_params)

__all__ = ["attend_row", "cache_dtype", "CACHE_DTYPES", "cache_dtype_param", "CacheDecoder", "Contract", "ContractError", "Grouping", "Shape",
           "expand_heads", "softmax_sinked",
           "DecodeState", "InputSpec", "KVCache", "KeyMask", "NoParams", "ParamSpec", "RingKV",
           "Variant", "VariantSpec", "WEIGHTS_MAX_N", "Workspace", "build", "check_qkv",
           "compute_dtype", "dense_mask", "exact_reference", "exp_", "load_entry_points",
           "load_module", "loaded_modules", "make_params", "ModuleError", "naive_attention",
           "SINKS", "Sinks", "per_token", "sink_grad", "sink_param", "sinked",
           "names", "origin", "param", "register", "softmax_", "softmax_logsumexp",
           "softmax_lse_", "softmax_scale", "softmax_weights", "spec",
           "stored_params"]
