"""The family's decoding form: the state S after the context, then one recurrence step
per token (the recurrence of `reference.py`, in the compute dtype). The terms enter as
the forward's do (`Recurrent._in`): cast to the compute dtype first, then L2-normalised
(the delta rule), so that in bfloat16 a token's output rounds as its forward row does.

Grouped value heads (Hv = r H, `chunked.py`): the state of query-key head h is (Dk, r Dv),
its r value heads' states side by side in the value width, so that a step's read q S,
its erase k S and its write S + k^T w are each one batched product on (B H, Dk, r Dv);
a decay or beta per value head scales its own Dv-wide column block. It holds Hv Dk Dv
numbers a batch element, as r ungrouped heads would, and no copy of q or k.

A prefill without the delta rule needs no step at all: with G the cumulative log-decay
of a block of r tokens (G_r its total), S <- exp(G_r) S + sum_j exp(G_r - G_j) k_j^T v_j,
per channel where the gate is per channel; each factor is at most 1 (g <= 0), so nothing
overflows. The delta rule's erase depends on the state: its prefill takes blocks of 64
tokens by the UT form (`_delta_block`), a triangular solve a block.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import DecodeState, compute_dtype
from .chunked import pack, split_heads, unpack

# Context tokens the decay-only prefill folds into the state at a time, and the delta
# rule's blocks (a triangular solve of this size each).
_BLOCK = 4096
_DELTA_BLOCK = 64


@dataclasses.dataclass
class RecurrentState(DecodeState):
    """S (B, H, Dk, r Dv) in the compute dtype: a query-key head's r value heads packed."""
    S: torch.Tensor


class RecurrentDecoding:
    """Mixed into `Recurrent`: prefill, extend and step on its `_terms`."""

    def decode_prefill(self, k, v, max_len, **inputs):
        B, H, N, D = k.shape
        S = k.new_zeros(B, H, D, v.shape[1] // H * v.shape[-1], dtype=compute_dtype(k.dtype))
        return self.decode_extend(RecurrentState(S), k, v, **inputs)

    def decode_extend(self, state, k, v, **inputs):
        _, k, v, g, beta = self._in(k, k, v, inputs, state.S.dtype)
        if beta is not None and g is not None and g.dim() == 4:  # a decay per channel
            for t in range(k.shape[-2]):
                _write(state.S, k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
            return state
        if beta is not None:
            for s in range(0, k.shape[-2], _DELTA_BLOCK):
                e = s + _DELTA_BLOCK
                _delta_block(state.S, k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e],
                             None if g is None else g[:, :, s:e])
            return state
        H = k.shape[1]
        for s in range(0, k.shape[-2], _BLOCK):
            kb, vb = k[:, :, s:s + _BLOCK], split_heads(v[:, :, s:s + _BLOCK], H)
            G = split_heads(g[:, :, s:s + _BLOCK], H).cumsum(dim=3)  # (B, H, r, n[, Dk])
            total = G[:, :, :, -1]  # (B, H, r) or (B, H, r, Dk)
            w = (total.unsqueeze(3) - G).exp_()  # decay from each token to the block's end
            _decay(state.S, total.exp())
            if G.dim() == 4:  # a scalar per value head and token: on the values' side
                state.S.add_(kb.transpose(-1, -2) @ pack(vb * w[..., None]))
            else:  # per channel: row d of S decays by channel d's gate
                state.S.add_(pack((kb[:, :, None] * w).transpose(-1, -2) @ vb))
        return state

    def decode_step(self, state, q, k, v, **inputs):
        dtype = q.dtype
        q, k, v, g, beta = self._in(q, k, v, inputs, state.S.dtype)
        _write(state.S, k[:, :, 0], v[:, :, 0], None if g is None else g[:, :, 0],
               None if beta is None else beta[:, :, 0])
        B, H, D, W = state.S.shape  # W = r Dv
        o = torch.bmm(q.reshape(B * H, 1, D), state.S.view(B * H, D, W))  # (B H, 1, r Dv)
        return o.mul_(D ** -0.5).view(B, v.shape[1], 1, v.shape[-1]).to(dtype), state


def _decay(S: torch.Tensor, a: torch.Tensor) -> None:
    """S (B, H, Dk, r Dv) times a decay per value head, in place: a (B, H, r) scales value
    head j's Dv-wide column block; a (B, H, r, Dk) also per row (a decay per key channel)."""
    B, H, D, W = S.shape
    r = a.shape[2]
    blocks = S.view(B, H, D, r, W // r)
    if a.dim() == 3:
        blocks.mul_(a[:, :, None, :, None])
    else:
        blocks.mul_(a.transpose(2, 3)[..., None])


def _delta_block(S, k, v, beta, g) -> None:
    """n tokens of the delta rule into S (B, H, Dk, r Dv), in place, by the UT form (Yang et
    al. 2024), per value head j: with G the block's cumulative log-decay (0 without a
    gate), U_j = (I + tril(diag(β_j) (K K^T ⊙ Γ_j), -1))^-1 diag(β_j) (V_j - diag(exp G_j)
    (K S)_j), Γ_ts = exp(G_t - G_s), and then S_j <- exp(G_n) S_j + (K ⊙ exp(G_n - G))^T U_j.
    K K^T and K S are one product per query-key head (K S over the packed state)."""
    H, n = k.shape[1], k.shape[-2]
    r = v.shape[1] // H
    bt = split_heads(beta, H)  # (B, H, r, n)
    G = torch.zeros_like(bt) if g is None else split_heads(g, H).cumsum(dim=-1)
    lower = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    gam = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = bt[..., :, None] * (k @ k.transpose(-1, -2))[:, :, None] * gam  # (B, H, r, n, n)
    eye = torch.eye(n, dtype=k.dtype, device=k.device)
    kS = unpack(k @ S, r)  # (B, H, r, n, Dv)
    rhs = bt[..., None] * (split_heads(v, H) - G.exp()[..., None] * kS)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    total = G[..., -1]  # (B, H, r)
    _decay(S, total.exp())
    S.add_(k.transpose(-1, -2) @ pack(u * (total[..., None] - G).exp()[..., None]))


def _write(S, k, v, g, beta) -> None:
    """One token of the recurrence into S (B, H, Dk, r Dv), in place: decay, erase, write.
    k (B, H, Dk), v (B, Hv, Dv); g (B, Hv) or (B, Hv, Dk) or None; beta (B, Hv) or None.
    On (B H)-batched views, so that each product is one bmm over the r packed value heads
    (a token's v (B, Hv, Dv) is already packed: value heads h r .. h r + r - 1 are
    adjacent): the erase's v - k S one baddbmm, the write S + k^T w another (a step at
    B = 1 is a few small calls, and their count is its time)."""
    B, H, D, W = S.shape
    r = v.shape[1] // H
    S3, k3 = S.view(B * H, D, W), k.reshape(B * H, 1, D)
    if g is not None:
        a = g.exp()
        _decay(S, a.view(B, H, r, *a.shape[2:]))
    w = v.reshape(B * H, 1, W)
    if beta is not None:  # β_j (v_j - k S_j): what the erase leaves, scaled per value head
        w = torch.baddbmm(w, k3, S3, alpha=-1)
        w.view(B * H, 1, r, W // r).mul_(beta.reshape(B * H, 1, r, 1))
    S3.baddbmm_(k3.transpose(1, 2), w)
