"""Exact softmax attention: the plain form, torch's fused SDPA, and xformers' kernel.

softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, https://arxiv.org/abs/1706.03762).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys

import torch
import torch.nn.functional as F

from ..core import (CacheDecoder, Contract, Grouping, Sinks, Variant, cache_dtype,
                    cache_dtype_param, naive_attention, register, sink_param, softmax_sinked,
                    softmax_scale)
from .cache import ExactCache
from .sink_sdpa import sink_sdpa


@dataclasses.dataclass(frozen=True)
class SinkParams:
    sink: bool = sink_param()
    cache_dtype: str = cache_dtype_param()

    def __post_init__(self):
        cache_dtype.torch_dtype(self.cache_dtype)  # ValueError where this torch lacks it


class _Exact(CacheDecoder, Variant):
    family = "exact"
    # Query head h reads key-value head h // (Hq / Hk) of the one cache: SDPA's enable_gqa.
    contract = Contract(exactness="exact", decoding=True, extend=True,
                        grouping=Grouping("kv", "native", value_dim=True))
    paper = "https://arxiv.org/abs/1706.03762"

    def flops(self, B, H, N, D, causal=False):
        # q k^T and p v: 2 * 2 N^2 D per head; causal counts half (FlashAttention's rule).
        full = 4 * B * H * N * N * D
        return full // 2 if causal else full

    def flops_at(self, s, causal=False):
        # Each query head: q k^T over Dk, p v over Dv; grouping shares keys, not work.
        full = 2 * s.B * s.H * s.N * s.N * (s.D + s.Dv)
        return full // 2 if causal else full

    def _stored(self) -> str:
        """The cache dtype name (`cache_dtype`; float32, the case's own, where the variant
        has no such parameter)."""
        return getattr(self.params, "cache_dtype", "float32")

    def _scales(self) -> int:
        """Numbers a token keeps beside its key and value in each head: fp8's two scales."""
        return 2 if cache_dtype.scaled(self._stored()) else 0

    def state_size(self, N, D):
        return (2 * D + self._scales()) * N  # the key-value cache (and fp8's scales)

    def state_size_at(self, N, s):
        if self.contract.grouping.how == "repeat":
            return super().state_size_at(N, s)
        return s.Hk * N * (s.D + s.Dv + self._scales())  # one cache per key-value head

    def state_bytes_at(self, N, s, dtype):
        stored = self._stored()
        if not cache_dtype.narrows(stored, dtype):
            return super().state_bytes_at(N, s, dtype)
        numbers = self.state_size_at(N, s)
        scales = s.Hk * N * self._scales() if self.contract.grouping.how != "repeat" else \
            s.out_heads * N * self._scales()
        return (numbers - scales) * cache_dtype.torch_dtype(stored).itemsize + 4 * scales

    def exact_at(self, seq_len, causal=False):
        # A narrow cache attends to rounded keys and values: its error is measured.
        return self._stored() == "float32"

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        reasons = self.setting_errors(device)
        if backward and cache_dtype.narrows(self._stored(), dtype):
            reasons.append(f"{self.name} with cache_dtype = {self._stored()} is an inference "
                           "setting (keys and values rounded as a decoding cache keeps them): "
                           "no backward")
        return reasons

    def setting_errors(self, device):
        device = torch.device(device).type
        if self._stored() == "float32" or (device == "cuda" and not torch.cuda.is_available()):
            return []  # nothing stored narrower, or no device here to probe
        missing = cache_dtype.missing_on(self._stored(), device)
        return [missing] if missing else []

    def _as_cached(self, k, v):
        """k, v as the decoding cache holds them (`cache_dtype`), in their own dtype: the
        forward attends to what the decoder reads, so their rows agree."""
        stored = self._stored()
        return cache_dtype.round_trip(k, stored), cache_dtype.round_trip(v, stored)

    def decode_flops_at(self, N, s):
        # One query row over the context's N cached keys (state_size's; the step's own key
        # is one more, a 1/N share left out as the read bound leaves it).
        return self.softmax_step_flops(N, s)

    def decode_prefill(self, k, v, max_len, sinks=None):
        # preallocated, written in place per token; in `cache_dtype` where it narrows k's
        return ExactCache.prefill(k, v, max_len, self._stored())

    def decode_step(self, state, q, k, v, sinks=None):
        """One exact decoder for every exact variant (`cache.py`): a query row has nothing
        for a fused kernel to fuse, and its time is the read of the cache. sinks: a sink
        logit per query head (sink = true), in the row's denominator."""
        state.extend(k, v)
        return state.attend(q, sinks), state


@register
class Standard(Sinks, _Exact):
    """Exact attention with the full N x N score matrix materialised (the plain form)."""
    name = "standard"
    Params = SinkParams

    def memory_bytes(self, B, H, N, D, dtype, backward=False):
        # scores and probabilities, N x N each; backward keeps them and adds their grads.
        nxn = B * H * N * N * torch.finfo(dtype).bits // 8
        return (4 if backward else 2) * nxn

    def attend(self, q, k, v, causal, sinks=None):
        k, v = self._as_cached(k, v)
        B, Hq, N, D = q.shape
        Hk = k.shape[1]
        if Hk == Hq:
            return naive_attention(q, k, v, causal, sinks=sinks)
        # Grouped keys: the g = Hq / Hk query heads of key-value head kv as one (g N)-row
        # block against its keys (row r is the query at position r % N), never repeated.
        qg = q.reshape(B, Hk, Hq // Hk * N, D)
        s = (qg * softmax_scale(D)) @ k.transpose(-1, -2)  # (B, Hk, g N, N)
        if causal:
            pos = torch.arange(qg.shape[-2], device=q.device) % N
            s.masked_fill_(torch.arange(N, device=q.device) > pos[:, None], float("-inf"))
        # Row r of key-value head kv is query head kv g + r // N's: its sink.
        sink = None if sinks is None else \
            sinks.view(1, Hk, Hq // Hk, 1).repeat_interleave(N, dim=2)
        return (softmax_sinked(s, sink) @ v).reshape(B, Hq, N, v.shape[-1])


@register
class SDPA(Sinks, _Exact):
    """Exact attention by torch.nn.functional.scaled_dot_product_attention (fused kernels)."""
    name = "sdpa"
    paper = "https://arxiv.org/abs/2205.14135"
    Params = SinkParams
    # Values of their own width: its CPU kernels take Dv != Dk only on the math path,
    # which repeats grouped keys and values (the kit's groupings property caught it).
    contract = _Exact.contract.but(grouping=Grouping("kv", "native"))

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        reasons = super().extra_reasons(device, dtype, causal, seq_len, head_dim, backward)
        if self.params.sink and device.type != "cpu":
            reasons.append(f"sdpa with sink = true runs torch's fused CPU kernel, which "
                           f"returns each row's log-sum-exp; none is wired for {device.type} "
                           "here")
        return reasons

    def attend(self, q, k, v, causal, sinks=None):
        k, v = self._as_cached(k, v)
        if sinks is not None:  # the fused CPU kernel takes equal heads: grouped keys repeated
            if k.shape[1] != q.shape[1]:
                g = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return sink_sdpa(q, k, v, sinks, causal)
        # enable_gqa: query head h reads key-value head h // (Hq / Hk), never repeated.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])


def xformers_reasons(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why xformers.ops.memory_efficient_attention cannot run here (empty when it can)."""
    if importlib.util.find_spec("xformers") is None:
        return ["xformers is not installed (optional extra: pip install -e '.[xformers]'; "
                "it runs on CUDA only)"]
    if device.type != "cuda":
        return [f"xformers.ops.memory_efficient_attention runs on CUDA only, not on "
                f"{device.type}"]
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return [f"xformers memory_efficient_attention does not take {dtype}"]
    if not torch.cuda.is_available():  # planning a GPU run here: nothing to probe
        return [f"no CUDA device here to run xformers on (torch {torch.__version__}, "
                f"CUDA available: no)"]
    missing = kernel_missing(str(device), dtype)
    return [missing] if missing else []


@functools.lru_cache(maxsize=None)
def kernel_missing(device: str, dtype: torch.dtype) -> str:
    """Why xformers has no kernel for `device` and `dtype` ("" when it has one): one tiny
    call, once per process, made only where a CUDA device exists. A wheel built for another
    torch installs and imports but has no CUDA operators ("No operator found for
    `memory_efficient_attention_forward`"), or fails to import at all; every case would
    otherwise be an error row or a traceback at planning, so any failure of the probe is
    a skip reason naming it."""
    try:
        import xformers
        from xformers.ops import memory_efficient_attention

        x = torch.zeros(1, 8, 1, 8, device=device, dtype=dtype)  # (B, N, H, D)
        memory_efficient_attention(x, x, x)
    except Exception as e:  # noqa: BLE001 -- the probe's whole job: any failure is the reason
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        version = getattr(sys.modules.get("xformers"), "__version__", "?")
        return (f"xformers {version} failed its probe call on {device} {dtype} with torch "
                f"{torch.__version__} (a wheel built for another torch?): "
                f"{type(e).__name__}: {first}")
    return ""


@register
class XFormers(_Exact):
    """Exact attention by xformers.ops.memory_efficient_attention (CUDA only)."""
    name = "xformers"
    paper = "https://arxiv.org/abs/2112.05682"
    contract = _Exact.contract.but(grouping=Grouping("kv", "repeat"))

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        return xformers_reasons(device, dtype)

    def attend(self, q, k, v, causal):
        from xformers.ops import LowerTriangularMask, memory_efficient_attention

        # xformers wants (B, N, H, D).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D)
        bias = LowerTriangularMask() if causal else None
        o = memory_efficient_attention(q, k, v, attn_bias=bias)
        return o.transpose(1, 2)  # (B, H, N, D)
