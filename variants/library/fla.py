"""flash-linear-attention's Triton kernels of our gated linear recurrences (`*_fla`).

PyPI `fla-core` (the optional extra `fla-core`), its chunkwise kernels `chunk_retention`,
`chunk_gla`, `chunk_simple_gla` (Mamba2's SSD core: a scalar log-decay per head and token),
`chunk_delta_rule`, `chunk_gated_delta_rule` and `chunk_kda` (Yang et al.,
https://github.com/fla-org/flash-linear-attention). Each is a variant of family
`recurrent` computing what ours computes: the same recurrence, the same s = D^-1/2 (fla's
default scale), the same inputs (our `g` is fla's per-token log-decay, our `beta` its
beta), q and k L2-normalised by us for the delta rule, and its error measured against our
float64 sequential recurrence (`err_ref` = recurrence). fla takes (B, N, H, D): our
(B, H, N, D) tensors are transposed into it and the output back (two copies, inside the
timed call, as a model in our layout would pay them).

Triton kernels: CUDA only; without fla-core (or triton) installed, or on CPU, every case
is refused with the reason. fla's delta rule refuses float32 (bfloat16 or float16 only).
Nothing is imported until a kernel is called.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch

from ..core import Grouping, NoParams, register
from ..recurrent import GLA, DeltaNet, GatedDeltaNet, KimiDeltaAttention, Mamba2, Retention


def _missing() -> list[str]:
    return [m for m in ("fla", "triton") if importlib.util.find_spec(m) is None]


# fla's kernels here take one value head a query-key head: grouped value heads are
# repeated for them (the base class's `repeat`), their time and memory counting it.
REPEAT = Grouping("value", "repeat")


class _Fla:
    """fla's kernel in place of our chunked form; flops, weights and the float64 reference
    are ours (the same recurrence). `kernel(q, k, v, g, beta)` on (B, N, H, ...) tensors.
    Each class declares its family's contract with the grouping `REPEAT`."""
    Params = NoParams
    fp32_ok: ClassVar[bool] = True

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        missing = _missing()
        if missing:
            return [f"{self.name} needs {' and '.join(missing)}: fla-core is not installed "
                    "(pip install 'attnbench[fla-core]')"]
        reasons = []
        if device.type != "cuda":
            reasons.append(f"{self.name} runs fla's Triton kernels on CUDA only, not on "
                           f"{device.type}")
        if dtype == torch.float32 and not self.fp32_ok:
            reasons.append(f"{self.name}: fla's kernel takes bfloat16 or float16, not float32")
        if dtype == torch.float64:
            reasons.append(f"{self.name}: fla's kernels do not take float64")
        return reasons

    def _c(self, N):
        return min(64, N)

    def attend(self, q, k, v, causal, **inputs):
        q, k, v, g, beta = self._terms(q, k, v, inputs)
        t = (lambda x: None if x is None else x.transpose(1, 2).contiguous())  # (B, N, H, ...)
        o, _ = self.kernel(t(q), t(k), t(v), t(g), t(beta))
        return o.transpose(1, 2)  # (B, H, N, D)


@register
class RetentionFla(_Fla, Retention):
    """fla's chunk_retention: RetNet's retention, γ_h = 1 - 2^(-5-h) (fla's own schedule)."""
    name = "retention_fla"
    contract = Retention.contract.but(grouping=REPEAT)

    def kernel(self, q, k, v, g, beta):
        from fla.ops.retention import chunk_retention
        return chunk_retention(q, k, v)


@register
class GLAFla(_Fla, GLA):
    """fla's chunk_gla: gated linear attention with a per-channel log-decay g."""
    name = "gla_fla"
    contract = GLA.contract.but(grouping=REPEAT)

    def flops(self, B, H, N, D, causal=False):
        return GLA().flops(B, H, N, D, causal)

    def kernel(self, q, k, v, g, beta):
        from fla.ops.gla import chunk_gla
        return chunk_gla(q, k, v, g)


@register
class Mamba2Fla(_Fla, Mamba2):
    """fla's chunk_simple_gla: a scalar log-decay per head and token (Mamba2's SSD core)."""
    name = "mamba2_fla"
    contract = Mamba2.contract.but(grouping=REPEAT)

    def kernel(self, q, k, v, g, beta):
        from fla.ops.simple_gla import chunk_simple_gla
        return chunk_simple_gla(q, k, v, g=g)


@register
class DeltaNetFla(_Fla, DeltaNet):
    """fla's chunk_delta_rule: the delta rule by the WY representation."""
    name = "deltanet_fla"
    contract = DeltaNet.contract.but(grouping=REPEAT)
    fp32_ok = False

    def kernel(self, q, k, v, g, beta):
        from fla.ops.delta_rule import chunk_delta_rule
        return chunk_delta_rule(q, k, v, beta)


@register
class GatedDeltaNetFla(_Fla, GatedDeltaNet):
    """fla's chunk_gated_delta_rule: Gated DeltaNet, a scalar log-decay g and beta."""
    name = "gated_deltanet_fla"
    contract = GatedDeltaNet.contract.but(grouping=REPEAT)

    def kernel(self, q, k, v, g, beta):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, g, beta)


@register
class KimiDeltaAttentionFla(_Fla, KimiDeltaAttention):
    """fla's chunk_kda: Kimi Delta Attention, a per-channel log-decay g and beta."""
    name = "kda_fla"
    contract = KimiDeltaAttention.contract.but(grouping=REPEAT)

    def flops(self, B, H, N, D, causal=False):
        return KimiDeltaAttention().flops(B, H, N, D, causal)

    def kernel(self, q, k, v, g, beta):
        from fla.ops.kda import chunk_kda
        return chunk_kda(q, k, v, g, beta)
