"""Variants with one planted bug each, for tests/test_check.py: the conformance kit must
fail each on its property (and pass `_check_good`, the correct one they start from).

Loaded by path (variants.load_module); names start with "_" so "all" leaves them out.
"""

from __future__ import annotations

import torch

import variants
from variants import Contract, Grouping, Variant, register

_Standard = type(variants.build("standard"))  # a correct decoder, for the decoding bugs


def _softmax_weights(q, k, causal, scale=None):
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.softmax(s, dim=-1)  # (B, H, N, N)


@register
class Good(Variant):
    """Exact attention by plain torch ops (the base every planted bug starts from)."""
    name = "_check_good"
    family = "test"
    contract = Contract(exactness="exact", weights=True)
    paper = "https://arxiv.org/abs/1706.03762"

    def attention_weights(self, q, k, causal):
        return _softmax_weights(q, k, causal)

    def attend(self, q, k, v, causal):
        return self.attention_weights(q, k, causal) @ v

    def flops(self, B, H, N, D, causal=False):
        return 4 * B * H * N * N * D // (2 if causal else 1)


@register
class BadSpec(Good):
    """No paper link."""
    name = "_check_spec"
    paper = ""


@register
class BadShapes(Good):
    """Returns float64 whatever it is given."""
    name = "_check_shapes"

    def attend(self, q, k, v, causal):
        return super().attend(q, k, v, causal).double()


class _HalfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 0.5  # the bug: the identity's gradient is g


@register
class BadGradients(Good):
    """Its backward halves the gradient of v."""
    name = "_check_gradients"

    def attend(self, q, k, v, causal):
        return super().attend(q, k, _HalfGrad.apply(v), causal)


@register
class BadBatchHeads(Good):
    """Mixes the heads: every head adds a tenth of head 0's output."""
    name = "_check_batch_heads"

    def attend(self, q, k, v, causal):
        o = super().attend(q, k, v, causal)
        return o + 0.1 * o[:, :1]


@register
class BadCausal(Good):
    """Causal query i also reads key i + 1."""
    name = "_check_causal"

    def attention_weights(self, q, k, causal):
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        if causal:
            n = q.shape[-2]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(2), float("-inf"))
        return torch.softmax(s, dim=-1)


@register
class BadDeterminism(Good):
    """Draws its temperature from the global generator at build time, unseeded."""
    name = "_check_determinism"

    def __init__(self, params=None):
        super().__init__(params)
        self.scale = 1 + float(torch.rand(()))

    def attention_weights(self, q, k, causal):
        return _softmax_weights(q, k, causal, q.shape[-1] ** -0.5 * self.scale)

    contract = Contract(weights=True)


@register
class BadFlops(Good):
    """Counts one matmul of N x D, not N x N x D."""
    name = "_check_flops"

    def flops(self, B, H, N, D, causal=False):
        return 2 * B * H * N * D // (2 if causal else 1)


@register
class BadExactness(Good):
    """Claims exactness with a 1/D scale instead of 1/sqrt(D)."""
    name = "_check_exactness"

    def attention_weights(self, q, k, causal):
        return _softmax_weights(q, k, causal, 1 / q.shape[-1])


@register
class BadWeights(Good):
    """Its map leaves out the 1/sqrt(D) scale its output uses."""
    name = "_check_weights"

    def attention_weights(self, q, k, causal):
        return _softmax_weights(q, k, causal, 1.0)

    def attend(self, q, k, v, causal):
        return _softmax_weights(q, k, causal) @ v


@register
class BadDecoding(_Standard):
    """Its decoding step's output is 0.1% off the causal forward's row."""
    name = "_check_decoding"
    family = "test"

    def decode_step(self, state, q, k, v, **inputs):
        o, state = super().decode_step(state, q, k, v, **inputs)
        return o * 1.001, state


@register
class BadStateSize(_Standard):
    """Declares half the cache it keeps."""
    name = "_check_state_size"
    family = "test"

    def state_size(self, N, D):
        return N * D


@register
class BadGroupings(Good):
    """Declares that it reads grouped keys natively, but repeats them."""
    name = "_check_groupings"
    contract = Contract(exactness="exact", weights=True, grouping=Grouping("kv", "native"))

    def attend(self, q, k, v, causal):
        g = q.shape[1] // k.shape[1]
        return super().attend(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal)

    def flops_at(self, s, causal=False):
        return self.flops(s.B, s.H, s.N, s.D, causal)
