"""xformers' local attention biases: sliding-window attention by xformers' fused kernel.

`xformers.ops.memory_efficient_attention` (Rabe & Staats 2021, https://arxiv.org/abs/2112.05682)
with an attention bias from `xformers.ops.fmha.attn_bias` (xformers docs) skips the keys
the bias masks: `LocalAttentionFromBottomRightMask(window_left=w, window_right=w)` is
i - w <= j <= i + w on a square problem, `LowerTriangularFromBottomRightLocalAttentionMask(
w + 1)` is i - w <= j <= i (its window counts the diagonal). Checked against our
band_mask by materialising both on CPU (tests/test_library_kernels.py, where xformers is
installed). CUDA only: xformers has no CPU kernel.

No `block_sparse_xformers`: xformers' block-diagonal biases (BlockDiagonalMask and its
causal/local/padded kin) describe packed independent sequences, one diagonal block each;
none expresses BigBird's global and random blocks, and a dense tensor bias would be the
N x N baseline again (that is `block_sparse_sdpa_mask`).
"""

from __future__ import annotations


from ..core import Variant, register
from ..exact import xformers_reasons
from ..sliding_window import SameBand


def window_bias(window: int, causal: bool):
    """The xformers attn_bias equal to band_mask(window) (AND j <= i when causal)."""
    from xformers.ops.fmha import attn_bias

    if causal:
        return attn_bias.LowerTriangularFromBottomRightLocalAttentionMask(window + 1)
    return attn_bias.LocalAttentionFromBottomRightMask(window_left=window, window_right=window)


@register
class SlidingWindowXFormers(SameBand, Variant):
    """Sliding-window attention by xformers memory_efficient_attention with a local bias (CUDA)."""
    name = "sliding_window_xformers"
    paper = "https://arxiv.org/abs/2112.05682"

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        return xformers_reasons(device, dtype)

    def flops(self, B, H, N, D, causal=False):
        """4 D per (query, key) pair in the band (the kernel's tiles add some, uncounted)."""
        w = min(self.params.window, max(N - 1, 0))
        # Pairs with |i - j| <= w: N (2w + 1) minus the w (w + 1) cut off at the two ends.
        pairs = N * (2 * w + 1) - w * (w + 1)
        if causal:
            pairs = (pairs + N) // 2
        return 4 * B * H * pairs * D

    def attend(self, q, k, v, causal):
        from xformers.ops import memory_efficient_attention

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D): xformers' layout
        o = memory_efficient_attention(q, k, v, attn_bias=window_bias(self.params.window, causal))
        return o.transpose(1, 2)  # (B, H, N, D)
