"""The layer between a recall model's mixer and its output projection, as the mixer's paper
and fla's layer have it: each head's output normalised, and gated where the paper's layer
gates it (`OutputLayer`). Which one a mixer gets, its variant declares (`output_layer`);
the matrix's `output_layer = "none"` builds none (the block as it was before these layers).
Read against fla's layers (fla-org/flash-linear-attention at bc3b101, fla/layers/*.py) and
mamba_ssm's Mamba2; docs/training.md tabulates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The matrix's `output_layer`: the layer the variant declares after its mixer, or none.
OUTPUT_LAYERS = ("paper", "none")
NORM_EPS = 1e-5  # fla's and mamba_ssm's norm_eps


class OutputLayer(nn.Module):
    """The paper's layer between the mixer and the output projection, by the name its variant
    declares (`output_layer`): each head's output o (B, H, N, d / H) normalised per head and,
    where the paper's layer has one, gated by a gate made from the block's normed hidden
    state x (B, N, d), the input of fla's and mamba_ssm's layers (and of InputLayer):

    - "rms": RMSNorm per head with a weight. DeltaNet: fla's DeltaNet (use_gate=False, its
      default). linear and performer: fla's LinearAttention (output_norm="rmsnorm", its
      default); the elu+1 and FAVOR+ papers have no norm (docs/training.md says why it is
      kept).
    - "rms_swish": RMSNorm per head, times swish(W x), W without a bias (fla's
      FusedRMSNormGated after its g_proj): GLA (fla's GatedLinearAttention, GLA Sec. 4.4's
      output gate) and Gated DeltaNet (fla's GatedDeltaNet, use_gate=True, its default).
    - "group_swish": GroupNorm with a group per head (each head's output standardised, a
      weight and bias per channel), times swish(W x): RetNet's MSR(X) = (swish(X W_G) *
      GroupNorm_h(Y)) W_O (Sun et al. 2023, Sec. 2.2). fla's MultiScaleRetention has an
      RMSNorm there instead.
    - "swish_rms": RMSNorm per head of o * swish(W x), the gate before the norm: Mamba2's
      RMSNormGated(norm_before_gate=False) on y and z (mamba_ssm's and fla's Mamba2), z = W x.
      mamba_ssm normalises in groups of d_inner / ngroups, the groups of B and C; here k
      and q are per head, so a group is a head.
    - "rms_sigmoid": RMSNorm per head, times sigmoid(W2 W1 x + b), W1 of rank d / H: KDA
      (fla's KimiDeltaAttention g_proj and its o_norm with activation "sigmoid").

    forward(o, x) -> (B, N, d), the heads merged for the output projection."""

    KINDS = ("rms", "rms_swish", "group_swish", "swish_rms", "rms_sigmoid")

    def __init__(self, kind: str, d_model: int, heads: int):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"the recall model has no output layer {kind!r} "
                             f"(it has {', '.join(self.KINDS)})")
        self.kind, dh = kind, d_model // heads
        self.norm = (nn.GroupNorm(heads, d_model, eps=NORM_EPS) if kind == "group_swish"
                     else nn.RMSNorm(dh, eps=NORM_EPS))
        self.gate = None
        if kind == "rms_sigmoid":
            self.gate = nn.Sequential(nn.Linear(d_model, dh, bias=False), nn.Linear(dh, d_model))
        elif kind != "rms":
            self.gate = nn.Linear(d_model, d_model, bias=False)

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, H, N, dh = o.shape
        o = o.transpose(1, 2)  # (B, N, H, d / H)
        g = None if self.gate is None else self.gate(x).view(B, N, H, dh)
        if self.kind == "swish_rms":
            return self.norm(o * F.silu(g)).reshape(B, N, H * dh)
        if self.kind == "group_swish":  # GroupNorm takes channels second: (B N, d)
            y = self.norm(o.reshape(B * N, H * dh)).view(B, N, H, dh)
        else:
            y = self.norm(o)
        if g is not None:
            y = y * (torch.sigmoid(g) if self.kind == "rms_sigmoid" else F.silu(g))
        return y.reshape(B, N, H * dh)
