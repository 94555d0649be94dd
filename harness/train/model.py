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
      o = variant(q, k, v, causal)                         # the variant under test
      h = h + W_o out(o, norm(h))                          # each head normed (and gated)
      h = h + mlp(norm(h))                                 # when the preset says so
    logits = norm(h) @ embedding.weight^T                  # tied head, (B, N, vocab)

The projections, the convolution and the MLP belong to the model, not to the variant,
which stays a pure q, k, v -> o map built from the registry by name and parameters. So do
the layers that make a variant's declared inputs beyond q, k, v (a recurrence's gates) from
the same normed hidden state, as the papers' layers do (input_layers.py's `InputLayer`):
beta = sigmoid(W x) (DeltaNet, Gated DeltaNet); GLA's low-rank gate g = logsigmoid(W2 W1 x) / 16 (rank 16);
Mamba2's decay g = -exp(A_log) dt with dt = softplus(W x + dt_bias), A = exp(A_log) ~
U(1, 16) and dt ~ logU(1e-3, 1e-1) per head at initialisation, and its write scaled by the
same dt (v dt, as SSD writes dt_t B_t^T x_t); Gated DeltaNet's gate of the same form with
A ~ U(0, 16), as fla's layer draws it; Kimi Delta Attention's g per channel =
-exp(A_log) softplus(W2 W1 x + dt_bias), W1 of rank d / H, A_log per head and dt_bias per
channel as in fla's KimiDeltaAttention layer; DSA's lightning indexer (its queries, key
and weights from x.detach(), trained by its own KL loss toward the main attention, which
the block makes beside its output: `RecallModel.aux_loss`). `InputLayer` says where each
differs from its paper's layer. After the mixer, the layer its paper has there
(`OutputLayer`: a norm of each head's output, and an output gate from the same x where the
paper has one); none after softmax attention, whose papers' block has none.
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
from harness.measure import stack
from harness.train.input_layers import InputLayer
from harness.train.output_layer import OUTPUT_LAYERS, OutputLayer

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
    def __init__(self, d_model: int, heads: int, mixer: nn.Module, causal: bool, mlp: bool,
                 output_layer: str = "paper"):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.conv = ShortConv(d_model)
        self.norm_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.mixer = mixer
        self._checked = set()  # the call signatures `_mix` has checked
        self.aux = None  # the last forward's auxiliary loss in training (dsa's indexer KL)
        self.inputs = nn.ModuleDict({s.name: InputLayer(s, d_model, heads)
                                     for s in mixer.contract.inputs})
        # The variant's declared output layer (none for softmax: the papers' transformer
        # block has no norm after attention), unless the matrix asks for today's bare block.
        kind = mixer.contract.output_layer if output_layer == "paper" else ""
        self.output = OutputLayer(kind, d_model, heads) if kind else None
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = None
        if mlp:
            self.norm_mlp = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model))

    def _mix(self, q, k, v, extra: dict) -> torch.Tensor:
        """The mixer's `check_call` once per call signature (shapes, dtype, device,
        whether autograd records), then `unchecked`: the gates come from this block's own
        layers, whose ranges hold by construction, so a per-step range check would only
        cost reductions over every gate and, on CUDA, a host sync per input. A user's call
        of the variant itself is checked every time."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        key = (tuple(q.shape), q.dtype, q.device, grad,
               tuple((n, tuple(t.shape), t.dtype) for n, t in extra.items()))
        if key not in self._checked:
            self.mixer.check_call(q, k, v, self.causal, backward=grad, **extra)
            self._checked.add(key)
        if self.training and torch.is_grad_enabled():  # dsa's indexer KL, else None
            o, self.aux = self.mixer.unchecked_with_loss(q, k, v, self.causal, **extra)
            return o
        return self.mixer.unchecked(q, k, v, self.causal, **extra)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, N, d)
        B, N, d = h.shape
        self.aux = None
        h = h + self.conv(h)  # no norm before it: measured here, a norm delayed learning
        x = self.norm_attn(h)
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).contiguous().unbind(0)  # each (B, H, N, d / H), contiguous:
        # one copy of all three, where strided views cost a copy before each of a
        # recurrence's products, forward and backward (tools/step_ratios.py: the
        # recurrences' steps faster; sdpa's the same within the machine's noise)
        extra = {}
        for name, layer in self.inputs.items():  # gates, if any
            extra[name], scale = layer(x)
            if scale is not None:  # Mamba2's write dt_t B_t^T x_t: v scaled by dt
                v = v * scale
        o = self._mix(q, k, v, extra)  # (B, H, N, d / H)
        o = o.transpose(1, 2).reshape(B, N, d) if self.output is None else self.output(o, x)
        h = h + self.out_proj(o)
        if self.mlp is not None:
            h = h + self.mlp(self.norm_mlp(h))
        return h


class RecallModel(nn.Module):
    """Embedding, `layers` blocks around a registered variant, a tied head; (B, N) -> logits."""

    def __init__(self, variant: str, params: dict, *, vocab_size: int, d_model: int,
                 layers: int, heads: int, causal: bool, mlp: bool, output_layer: str = "paper"):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
        if output_layer not in OUTPUT_LAYERS:
            raise ValueError(f"output_layer must be one of {', '.join(OUTPUT_LAYERS)}, "
                             f"got {output_layer!r}")
        self.embedding = nn.Embedding(vocab_size, d_model)
        # One variant module per layer: its own seeded state (features, projections) each.
        # A layer pattern ("gated_deltanet*3+sdpa") names each layer's mixer; its params map
        # a mixer's name to that mixer's parameters.
        per_layer = stack.layers_of(variant, layers)
        mixer_params = params if stack.is_pattern(variant) else {variant: params}
        self.blocks = nn.ModuleList(
            Block(d_model, heads, variants.build(name, **mixer_params.get(name, {})), causal, mlp,
                  output_layer)
            for name in per_layer)
        self.norm_out = nn.LayerNorm(d_model)
        self._init(layers)

    def _init(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if "mixer." in name:
                continue  # a variant's own buffers/parameters (none are learned by default)
            if name.endswith(("A_log", "dt_bias")):
                continue  # the decay layers' parameters keep their own initialisation
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

    def aux_loss(self) -> torch.Tensor | None:
        """The auxiliary losses the blocks made in the last forward in training (dsa's
        indexer KL: `Block._mix`), summed, and cleared; None when none did. The trainer adds
        it to the cross-entropy (weight 1); held-out evaluation makes none."""
        parts = [b.aux for b in self.blocks if b.aux is not None]
        for b in self.blocks:
            b.aux = None
        return sum(parts) if parts else None

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW's groups: every parameter decayed but those marked `_no_weight_decay` (the
        decay layers' A_log and dt_bias: fla's and mamba_ssm's convention), in the order
        of `parameters()`."""
        params = list(self.parameters())
        keep = [p for p in params if getattr(p, "_no_weight_decay", False)]
        return [{"params": [p for p in params if not getattr(p, "_no_weight_decay", False)],
                 "weight_decay": weight_decay},
                {"params": keep, "weight_decay": 0.0}]

    def n_params(self) -> int:
        """Trainable parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
