"""The declared inputs of the family and how a benchmark draws them: the papers' layers at
initialisation, applied to a projection output x ~ N(0, 1) per token.

- `g` per channel (GLA, Yang et al. 2024, Sec. 4.4; fla's GatedLinearAttention):
  logsigmoid(x) / 16, the gate's low-rank projection through logsigmoid divided by the
  normaliser 16. Mean about -0.05 per token: a slow forget over ~20 tokens per channel.
- `g` per head (Mamba2, Dao & Gu 2024): -exp(A_log) softplus(x + dt_bias),
  A = exp(A_log) ~ U(1, 16) per head and dt_bias = softplus^-1(dt),
  dt = exp(U(log 1e-3, log 1e-1)) per head (mamba_ssm's Mamba2 defaults `A_init_range`
  and `dt_min`, `dt_max`), all drawn from the seed.
- `g` per head (Gated DeltaNet, Yang, Kautz, Hatamizadeh 2025; fla's GatedDeltaNet layer):
  the same form with A ~ U(0, 16), as that layer draws it.
- `g` per channel (Kimi Delta Attention, fla's KimiDeltaAttention layer):
  -exp(A_log) softplus(x + dt_bias), A = exp(A_log) ~ U(1, 16) per head, dt_bias =
  softplus^-1(dt) with dt ~ logU(1e-3, 1e-1) per channel.
A_log and dt_bias are a layer's weights: drawn once per case (`InputSpec.fixed`), first
from the input's generator, then the per-token x.
- `beta` (DeltaNet, Gated DeltaNet, KDA): sigmoid(x).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core import InputSpec


def _gla_gate(gen: torch.Generator, B: int, H: int, N: int, D: int) -> torch.Tensor:
    return F.logsigmoid(torch.randn(B, H, N, D, generator=gen)) / 16


def mamba2_decay_params(gen: torch.Generator, H: int,
                        A_range: tuple = (1, 16)) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log, dt_bias), each (H,), as Mamba2 initialises them (Gated DeltaNet's layer:
    A_range (0, 16))."""
    A = torch.empty(H).uniform_(*A_range, generator=gen)
    dt = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    return A.log(), dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt


def _mamba2_fixed(gen: torch.Generator, H: int, D: int, A_range: tuple = (1, 16)) -> dict:
    A_log, dt_bias = mamba2_decay_params(gen, H, A_range)
    return {"A_log": A_log, "dt_bias": dt_bias}


GDN_A_RANGE = (0, 16)  # fla's GatedDeltaNet: A = torch.empty(H).uniform_(0, 16)


def _gdn_fixed(gen: torch.Generator, H: int, D: int) -> dict:
    return _mamba2_fixed(gen, H, D, GDN_A_RANGE)


def _mamba2_gate(gen: torch.Generator, B: int, H: int, N: int, D: int, *, A_log: torch.Tensor,
                 dt_bias: torch.Tensor) -> torch.Tensor:
    x = torch.randn(B, H, N, generator=gen)
    return -A_log.exp()[:, None] * F.softplus(x + dt_bias[:, None])


def _kda_fixed(gen: torch.Generator, H: int, D: int) -> dict:
    """A (H,) and dt_bias (H, D)."""
    A = torch.empty(H).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(H, D).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    return {"A": A, "dt_bias": dt + torch.log(-torch.expm1(-dt))}


def _kda_gate(gen: torch.Generator, B: int, H: int, N: int, D: int, *, A: torch.Tensor,
              dt_bias: torch.Tensor) -> torch.Tensor:
    x = torch.randn(B, H, N, D, generator=gen)
    return -A[:, None, None] * F.softplus(x + dt_bias[:, None, :])


def _beta(gen: torch.Generator, B: int, H: int, N: int, D: int) -> torch.Tensor:
    return torch.sigmoid(torch.randn(B, H, N, generator=gen))


GATE_CHANNEL = InputSpec("g", ("B", "H", "N", "D"), None, 0.0,
                         "logsigmoid(x) / 16, x ~ N(0, 1) (GLA's gate)", _gla_gate,
                         doc="log-decay per key channel", layer="gla_gate")
GATE_HEAD = InputSpec("g", ("B", "H", "N"), None, 0.0,
                      "-exp(A_log) softplus(x + dt_bias), x ~ N(0, 1), A ~ U(1, 16), "
                      "dt ~ logU(1e-3, 1e-1) per head (Mamba2's decay)", _mamba2_gate,
                      doc="log-decay per head", layer="mamba2_decay", fixed=_mamba2_fixed)
GATE_GDN = InputSpec("g", ("B", "H", "N"), None, 0.0,
                     "-exp(A_log) softplus(x + dt_bias), x ~ N(0, 1), A ~ U(0, 16), "
                     "dt ~ logU(1e-3, 1e-1) per head (Gated DeltaNet's decay)", _mamba2_gate,
                     doc="log-decay per head", layer="gdn_decay", fixed=_gdn_fixed)
GATE_KDA = InputSpec("g", ("B", "H", "N", "D"), None, 0.0,
                     "-exp(A_log) softplus(x + dt_bias), x ~ N(0, 1), A ~ U(1, 16) per head, "
                     "dt ~ logU(1e-3, 1e-1) per channel (KDA's gate)", _kda_gate,
                     doc="log-decay per key channel", layer="kda_gate", fixed=_kda_fixed)
BETA = InputSpec("beta", ("B", "H", "N"), 0.0, 1.0, "sigmoid(x), x ~ N(0, 1)", _beta,
                 open_low=True, open_high=True, doc="write strength", layer="sigmoid")


def beta_spec(beta_max: float) -> InputSpec:
    """`beta` in (0, beta_max), drawn beta_max sigmoid(x) (DeltaNet's and Gated DeltaNet's
    `beta_max`; 1 is BETA)."""
    if beta_max == 1.0:
        return BETA

    def sample(gen, B, H, N, D):
        return beta_max * _beta(gen, B, H, N, D)
    return InputSpec("beta", ("B", "H", "N"), 0.0, float(beta_max),
                     f"{beta_max:g} sigmoid(x), x ~ N(0, 1)", sample, open_low=True,
                     open_high=True, doc="write strength", layer="sigmoid")
