"""What every variant and the reference check first: q, k, v shapes, key masks, the scale."""

from __future__ import annotations

import math
from typing import Callable

import torch

# Key masks are callables (query indices [c], key indices [n]) -> bool [c, n]: True where
# query i may attend key j. They describe a pattern without ever materialising N x N.
KeyMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouping=None,
              name: str = "") -> None:
    """Raise ValueError unless q, k, v are 4-D tensors of one dtype and device that the
    grouping allows (`contract.Grouping`); without one: of one (B, H, N, D) shape.

    q (B, Hq, N, Dq), k (B, Hk, N, Dk), v (B, Hv, N, Dv): one B and N, Dq = Dk; Dv = Dk
    unless the grouping declares `value_dim`; heads `kv`: Hk = Hv dividing Hq; `value`:
    Hq = Hk dividing Hv; a grouping that refuses takes equal heads only (its reason)."""
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{label} must be (B, H, N, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if grouping is None or q.shape == k.shape == v.shape:
        if not (q.shape == k.shape == v.shape):
            raise ValueError(f"q, k, v must share one shape, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        return
    who = f"{name}: " if name else ""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    (B, Hq, N, Dq), (Bk, Hk, Nk, Dk), (Bv, Hv, Nv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and N == Nk == Nv):
        raise ValueError(f"{who}q, k, v must share B and N, got {shapes}")
    if Dq != Dk:
        raise ValueError(f"{who}q and k must share a width (Dq = Dk), got {shapes}")
    if Dv != Dk and not grouping.value_dim:
        raise ValueError(f"{who}values of their own width (Dv != Dk) are not declared "
                         f"(contract.grouping.value_dim), got {shapes}")
    if Hq == Hk == Hv:
        return
    if grouping.how == "refuse":
        raise ValueError(f"{who}q, k, v must share a head count ({grouping.why}), got {shapes}")
    if grouping.heads == "kv":
        if Hk != Hv or Hq % Hk:
            raise ValueError(f"{who}grouped keys take Hk = Hv dividing Hq, got {shapes}")
    elif Hq != Hk or Hv % Hk:
        raise ValueError(f"{who}grouped values take Hq = Hk dividing Hv, got {shapes}")


def out_heads(q: torch.Tensor, v: torch.Tensor) -> int:
    """The output's head count: Hq for grouped keys, Hv for grouped values (the larger)."""
    return max(q.shape[1], v.shape[1])


def input_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouping=None) -> dict:
    """The sizes a declared input's dims name: B, N, D = Dk, and H the output's head count
    (a recurrence's gates are per value head)."""
    return {"B": q.shape[0], "H": out_heads(q, v), "N": q.shape[-2], "D": k.shape[-1]}


def expand_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouping=None):
    """q, k, v with the shared heads repeated to one per output head (query head h reads
    key-value head h // (Hq / Hk); value head j reads query-key head j // (Hv / Hk)):
    the `repeat` grouping, and the references' plain form. Views where nothing repeats."""
    H = out_heads(q, v)
    return tuple(t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)
                 for t in (q, k, v))


def softmax_scale(D: int) -> float:
    return 1.0 / math.sqrt(D)
