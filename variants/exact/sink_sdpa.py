"""SDPA with a sink logit per head (gpt-oss's sinks, `variants/core/sinks.py`), on the CPU.

torch's fused CPU kernel (`aten._scaled_dot_product_flash_attention_for_cpu`) returns each
row's log-sum-exp beside the output; the sink rescales both (o' = o exp(lse - lse'),
lse' = logaddexp(lse, S_h)), and the kernel's own backward, handed o' and lse', recomputes
the sinked probabilities exp(s - lse') and so gives the sinked gradients of q, k and v
(FlashAttention's backward, Dao et al. 2022, https://arxiv.org/abs/2205.14135, Algorithm
4: D_i = dO_i . O_i). The sink's gradient is one reduction more (`sink_grad`). Time and
memory stay the fused kernel's: O(N) extra, never an N x N matrix.
"""

from __future__ import annotations

import torch

from ..core import sink_grad, sinked, softmax_scale

_aten = torch.ops.aten


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
              causal: bool) -> torch.Tensor:
    """softmax with the sink's column, dropped, for q, k, v (B, H, N, D) of one head count
    (grouped keys are repeated by the caller: the fused CPU kernel takes equal heads)."""
    return _SinkSDPA.apply(q, k, v, sinks, causal)


class _SinkSDPA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal):
        scale = softmax_scale(q.shape[-1])
        o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)  # lse (B, H, N), float32 at least
        o2, lse2 = sinked(o, lse.unsqueeze(-1), sinks)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, sinks, o2, lse2)
        return o2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, sinks, o2, lse2 = ctx.saved_tensors
        do = do.contiguous()
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o2, lse2.squeeze(-1), 0.0, ctx.causal, scale=ctx.scale)
        delta = (do.to(lse2.dtype) * o2.to(lse2.dtype)).sum(dim=-1, keepdim=True)
        dsinks = sink_grad(sinks, lse2, delta) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None
