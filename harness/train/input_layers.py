"""The layers of the recall model that make a mixer's declared inputs beyond q, k, v (its
gates, DSA's indexer inputs) from the block's normed hidden state, as each paper's layer
makes them (`InputLayer`; harness.train.model builds one per declared input)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

GLA_GATE_RANK = 16  # GLA's gate: a low-rank projection (Yang et al. 2024, Sec. 4.4)
GLA_GATE_NORMALISER = 16  # ... through logsigmoid, divided by this
# dt = softplus(dt_bias) at initialisation, log-uniform in this range (mamba_ssm's Mamba2
# dt_min, dt_max; fla's GatedDeltaNet and KimiDeltaAttention layers use the same).
DT_RANGE = (1e-3, 1e-1)
# A = exp(A_log) at initialisation, uniform in: mamba_ssm's Mamba2 `A_init_range` (and
# fla's KimiDeltaAttention), fla's GatedDeltaNet.
A_RANGE = {"mamba2_decay": (1, 16), "kda_gate": (1, 16), "gdn_decay": (0, 16)}
INDEXER_LAYERS = ("indexer_q", "indexer_k", "indexer_w")  # dsa's lightning indexer


class InputLayer(nn.Module):
    """One declared input of the mixer (a `variants.InputSpec`), made from the normed hidden
    state x (B, N, d) by the layer its `layer` names, as the paper's layer makes it:

    - "sigmoid", beta = sigmoid(W x) (DeltaNet, Gated DeltaNet, KDA; fla's b_proj). Differs:
      W has a bias (zero at initialisation), and beta is kept inside (0, 1) in float32.
    - "gla_gate", g = logsigmoid(W2 W1 x + b) / 16, W1 of rank 16 (fla's
      GatedLinearAttention gk_proj, GLA Sec. 4.4).
    - "mamba2_decay", Mamba2's SSD (Dao & Gu 2024; mamba_ssm's Mamba2): dt =
      softplus(W x + dt_bias) per head, the decay g = -exp(A_log) dt, and the write scaled
      by the same dt: the mixer gets v dt (ssd_minimal_discrete(X * dt, A * dt, B, C), with
      C = q, B = k, X = v). A ~ U(1, 16), dt ~ logU(1e-3, 1e-1) at initialisation. Differs:
      no D skip (y + D x), the model's short convolution before the projections instead
      of Mamba2's kernel-4 convolution of x, B, C and its SiLU.
    - "gdn_decay", Gated DeltaNet's gate (fla's GatedDeltaNet a_proj): g = -exp(A_log)
      softplus(W x + dt_bias) per head, A ~ U(0, 16), dt ~ logU(1e-3, 1e-1). Differs: fla
      floors dt at 1e-4 (below dt_min: never binds).
    - "kda_gate", Kimi Delta Attention's gate (fla's KimiDeltaAttention f_proj): g per
      channel = -exp(A_log) softplus(W2 W1 x + dt_bias), W1 of rank d / H, A_log per head
      (A ~ U(1, 16)), dt_bias per channel (dt ~ logU(1e-3, 1e-1)).
    - "indexer_q", "indexer_k", "indexer_w", DSA's lightning indexer (DeepSeek-V3.2, arXiv:
      2512.02556, Sec. 2.1; its inference code's `Indexer`): index_q = W_q x (index_heads
      heads of index_dim), index_k = LayerNorm(W_k x) (one key a token, shared by the
      indexer's heads), index_w = W_w x index_heads^-1/2 index_dim^-1/2. Each reads
      x.detach(), as the paper detaches the indexer's input from the main graph: it learns
      only from its KL loss toward the main attention (dsa's `indexer_kl`, `Block`).
      Differs: W_q reads x, where DeepSeek's reads MLA's normed query latent (this model
      has none); no rotary part in q and k (this model's only position signal is its
      convolution), no Hadamard rotation or FP8 (inference-time); W_q, W_k, W_w without
      bias, as DeepSeek's, initialised as the model's other projections (std 0.02); trained
      from the start in the sparse stage, without the paper's dense warm-up.

    forward(x) -> (the input in its declared shape, the factor (B, H, N, 1) the layer
    scales the mixer's v by, or None)."""

    def __init__(self, spec, d_model: int, heads: int):
        super().__init__()
        self.kind, self.heads = spec.layer, heads
        # the declared range's top: a sigmoid input in (0, high) (DeltaNet's beta_max)
        self.high = 1.0 if spec.high is None else float(spec.high)
        if self.kind in INDEXER_LAYERS:  # (B, hi, N, di), (B, 1, N, di) or (B, hi, N)
            own = dict(spec.own_dims)
            self.hi, self.di = own["index_heads"], own["index_dim"]
            width = {"indexer_q": self.hi * self.di, "indexer_k": self.di,
                     "indexer_w": self.hi}[self.kind]
            self.proj = nn.Linear(d_model, width, bias=False)
            if self.kind == "indexer_k":
                self.norm = nn.LayerNorm(self.di)
        elif self.kind == "sigmoid":  # (B, H, N) in (0, high)
            self.proj = nn.Linear(d_model, heads)
        elif self.kind == "gla_gate":  # (B, H, N, d / H) <= 0
            self.proj = nn.Sequential(nn.Linear(d_model, GLA_GATE_RANK, bias=False),
                                      nn.Linear(GLA_GATE_RANK, d_model))
        elif self.kind in A_RANGE:  # (B, H, N) or (B, H, N, d / H) <= 0
            per_channel = self.kind == "kda_gate"
            self.proj = (nn.Sequential(nn.Linear(d_model, d_model // heads, bias=False),
                                       nn.Linear(d_model // heads, d_model, bias=False))
                         if per_channel else nn.Linear(d_model, heads, bias=False))
            A = torch.empty(heads).uniform_(*A_RANGE[self.kind])
            lo, hi = DT_RANGE
            dt = torch.exp(torch.empty(d_model if per_channel else heads).uniform_(
                math.log(lo), math.log(hi)))
            self.A_log = nn.Parameter(A.log())
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            # A decay's parameters, out of AdamW's weight decay (RecallModel.param_groups).
            self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        else:
            raise ValueError(f"the recall model has no layer for input {spec.name!r} "
                             f"(layer {spec.layer!r})")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, N, d = x.shape
        if self.kind in INDEXER_LAYERS:
            return self._indexer(x.detach()), None
        y = self.proj(x)  # (B, N, H) or (B, N, d)
        scale = None
        if self.kind == "sigmoid":
            # Kept strictly inside (0, 1) in float32 (sigmoid(17) rounds to 1).
            y = torch.sigmoid(y) * (1 - 2e-6) + 1e-6
            if self.high != 1.0:
                y = y * self.high
        elif self.kind == "gla_gate":
            y = F.logsigmoid(y).div(GLA_GATE_NORMALISER).view(B, N, self.heads, d // self.heads)
        elif self.kind == "kda_gate":
            y = F.softplus(y + self.dt_bias).view(B, N, self.heads, d // self.heads)
            y = -self.A_log.exp()[:, None] * y
        else:
            dt = F.softplus(y + self.dt_bias)  # (B, N, H)
            y = -self.A_log.exp() * dt
            if self.kind == "mamba2_decay":
                scale = dt.transpose(1, 2)[..., None]  # (B, H, N, 1): the write's dt
        return y.transpose(1, 2).contiguous(), scale  # (B, H, N) or (B, H, N, d / H)

    def _indexer(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        y = self.proj(x)
        if self.kind == "indexer_q":
            return y.view(B, N, self.hi, self.di).transpose(1, 2).contiguous()
        if self.kind == "indexer_k":
            return self.norm(y)[:, None]
        return (y * (self.hi * self.di) ** -0.5).transpose(1, 2).contiguous()
