"""What every variant and the reference check first: q, k, v shapes, key masks, the scale."""

from __future__ import annotations

import math
from typing import Callable

import torch

# Key masks are callables (query indices [c], key indices [n]) -> bool [c, n]: True where
# query i may attend key j. They describe a pattern without ever materialising N x N.
KeyMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (B, H, N, D) with one shape, dtype and device."""
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{label} must be (B, H, N, D), got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must share one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")


def softmax_scale(D: int) -> float:
    return 1.0 / math.sqrt(D)
