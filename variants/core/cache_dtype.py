"""Cache dtypes: keys and values stored narrower than the attention computes in.

A served decoder keeps its key-value cache in bfloat16 or fp8 and reads it back to the
compute dtype inside the step (FlashMLA's fp8 KV cache, deepseek-ai/FlashMLA; vLLM's
`kv_cache_dtype`). The parameter `cache_dtype` names what is stored:

    float32         the default: keys and values kept in the case's own dtype, as
                    before the parameter (a float64 case stays float64)
    bfloat16        rounded to bfloat16 (2 bytes a number)
    float8_e4m3fn   OCP fp8 E4M3 (1 byte a number; largest finite 448) with a per-block
                    float32 scale: a block is one token's row of one head (its D key
                    numbers, or its Dv value numbers), scaled so that its largest
                    magnitude maps to 448 (FlashMLA's fp8 cache keeps one scale per 128
                    numbers of a token; a head of D <= 128 is one such block)

`round_trip(x, name)` is what the stored cache holds, read back to x's dtype: the forward
of a variant with a narrow cache attends to it, so that the decoder's rows equal its
causal forward's. `quantise` and `dequantise_` are the two halves the decoder uses.
"""

from __future__ import annotations

import functools

import torch

from .interface import param

CACHE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
# E4M3's largest finite value (OCP 8-bit floating point specification, 2023).
FP8_MAX = 448.0


def cache_dtype_param():
    """The `cache_dtype` parameter: declared after results were stored (`later`), so that a
    setting at the default keeps its id."""
    return param("float32", choices=CACHE_DTYPES, later=True,
                 doc="the dtype the decoding cache stores keys and values in: float32 (the "
                     "case's own dtype), bfloat16, or float8_e4m3fn with a float32 scale per "
                     "token row and head; read back to the compute dtype a chunk at a time")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a cache dtype name; ValueError where this torch has none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cache_dtype {name!r}: torch {torch.__version__} has no such dtype")
    return dtype


def narrows(name: str, dtype: torch.dtype) -> bool:
    """Whether a cache of `name` stores a case of `dtype` narrower than the case: float32
    never does (the case's own dtype); bfloat16 not for a bfloat16 case."""
    return name != "float32" and torch_dtype(name) != dtype


def scaled(name: str) -> bool:
    """Whether the stored form keeps a scale per block (fp8)."""
    return name.startswith("float8")


@functools.lru_cache(maxsize=None)
def missing_on(name: str, device: str) -> str:
    """Why `device` cannot store and read back a cache of `name` ("" when it can): one
    tiny round trip, once per process."""
    try:
        x = torch.ones(2, 4, device=device)
        back = dequantise_(x.clone(), *quantise(x, name))
        if not torch.equal(back, x):
            return f"cache_dtype {name}: a round trip on {device} does not give the values back"
    except Exception as e:  # noqa: BLE001 -- any failure of the probe is the reason
        first = (str(e).strip().splitlines() or [""])[0]
        return (f"cache_dtype {name} is not available on {device} with torch "
                f"{torch.__version__}: {type(e).__name__}: {first}")
    return ""


def quantise(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored, scale): x (..., D) in the stored dtype, and for fp8 the float32 scale of
    each row (...,), x ~ stored * scale; scale None otherwise."""
    dtype = torch_dtype(name)
    if not scaled(name):
        return x.to(dtype), None
    amax = x.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale.to(x.dtype)[..., None]).to(dtype), scale


def dequantise_(out: torch.Tensor, stored: torch.Tensor,
                scale: torch.Tensor | None) -> torch.Tensor:
    """stored (..., D) read back into `out` (its dtype, the same shape) and multiplied by
    its rows' scales where it has them; returns out."""
    out.copy_(stored)
    if scale is not None:
        out.mul_(scale.to(out.dtype)[..., None])
    return out


def round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as a cache of `name` holds it, read back to x's dtype (x itself where the cache
    does not narrow it)."""
    if not narrows(name, x.dtype):
        return x
    stored, scale = quantise(x, name)
    return dequantise_(torch.empty_like(x), stored, scale)
