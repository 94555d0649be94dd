"""The small model trained on a recall task, with a registered variant as its sequence mixer.

The recipe of the recall studies this follows (Zoology, Arora et al. 2023,
https://arxiv.org/abs/2312.04927; Based, Arora et al. 2024, https://arxiv.org/abs/2402.18668):
a short causal convolution beside attention lets one attention layer solve associative
recall (the convolution writes the key into the value's position; attention then matches
the query against it), where attention alone needs two layers and many more steps.

    tokens (B, N)
    h = embedding(tokens)                                  # (B, N, d)
    per layer:
      h = h + conv(h)                                      # causal depthwise, kernel 3
      q, k, v = split(W_qkv norm(h))                       # each (B, H, N, d / H)
      h = h + W_o merge(variant(q, k, v, causal))          # the variant under test
      h = h + mlp(norm(h))                                 # when the preset says so
    logits = norm(h) @ embedding.weight^T                  # tied head, (B, N, vocab)

The projections, the convolution and the MLP belong to the model, not to the variant,
which stays a pure q, k, v -> o map built from the registry by name and parameters.
Parameters are initialised as Zoology's model does (normal, std 0.02; output projections
scaled by 1 / sqrt(2 layers)) except the q, k, v projection: std d_model^-1/2, so that the
first scores are O(1) and attention is not uniform from the start. Measured here (sdpa,
MQAR N = 128, 16 pairs, d = 64, lr 3e-3): with std 0.02 held-out accuracy stayed at 0.06
for 400 steps; with d^-1/2 it reached 0.99 in 100-125 steps over three seeds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import variants

CONV_KERNEL = 3


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over the sequence: y_i = sum_{t<K} w_t * x_{i-t}."""

    def __init__(self, d_model: int, kernel: int = CONV_KERNEL):
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model, padding=kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, N, d)
        y = self.conv(x.transpose(1, 2))  # (B, d, N + K - 1): padded both sides
        return y[..., :x.shape[1]].transpose(1, 2)  # the first N: output i sees i-K+1..i


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, mixer: nn.Module, causal: bool, mlp: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.conv = ShortConv(d_model)
        self.norm_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.mixer = mixer
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = None
        if mlp:
            self.norm_mlp = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, N, d)
        B, N, d = h.shape
        h = h + self.conv(h)  # no norm before it: measured here, a norm delayed learning
        q, k, v = self.qkv(self.norm_attn(h)).split(d, dim=-1)  # each (B, N, d)
        q, k, v = (t.view(B, N, self.heads, d // self.heads).transpose(1, 2)
                   for t in (q, k, v))  # each (B, H, N, d / H)
        o = self.mixer(q, k, v, causal=self.causal)  # (B, H, N, d / H)
        h = h + self.out_proj(o.transpose(1, 2).reshape(B, N, d))
        if self.mlp is not None:
            h = h + self.mlp(self.norm_mlp(h))
        return h


class RecallModel(nn.Module):
    """Embedding, `layers` blocks around a registered variant, a tied head; (B, N) -> logits."""

    def __init__(self, variant: str, params: dict, *, vocab_size: int, d_model: int,
                 layers: int, heads: int, causal: bool, mlp: bool):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
        self.embedding = nn.Embedding(vocab_size, d_model)
        # One variant module per layer: its own seeded state (features, projections) each.
        self.blocks = nn.ModuleList(Block(d_model, heads, variants.build(variant, **params),
                                          causal, mlp) for _ in range(layers))
        self.norm_out = nn.LayerNorm(d_model)
        self._init(layers)

    def _init(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if "mixer." in name:
                continue  # a variant's own buffers/parameters (none are learned by default)
            if name.endswith("weight") and p.dim() >= 2 and "conv" not in name:
                std = 0.02 / math.sqrt(2 * layers) if ("out_proj" in name or "mlp.2" in name) \
                    else p.shape[1] ** -0.5 if "qkv" in name else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, N, vocab); with a bool mask `where` (B, N), only at those positions,
        (M, vocab): a recall task scores a few positions, and the head is the large matmul."""
        h = self.embedding(tokens)  # (B, N, d)
        for block in self.blocks:
            h = block(h)
        if where is not None:
            h = h[where]  # (M, d)
        return F.linear(self.norm_out(h), self.embedding.weight)  # tied head

    def n_params(self) -> int:
        """Trainable parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
