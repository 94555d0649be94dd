"""The family's decoding form: the (D, Dv) state S after the context, then one recurrence
step per token (the recurrence of `reference.py`, in the compute dtype). The terms enter
as the forward's do (`Recurrent._in`): cast to the compute dtype first, then L2-normalised
(the delta rule), so that in bfloat16 a token's output rounds as its forward row does.

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

# Context tokens the decay-only prefill folds into the state at a time, and the delta
# rule's blocks (a triangular solve of this size each).
_BLOCK = 4096
_DELTA_BLOCK = 64


@dataclasses.dataclass
class RecurrentState(DecodeState):
    """S (B, H, D, Dv) in the compute dtype."""
    S: torch.Tensor


class RecurrentDecoding:
    """Mixed into `Recurrent`: prefill, extend and step on its `_terms`."""

    def decode_prefill(self, k, v, max_len, **inputs):
        B, H, N, D = k.shape
        S = k.new_zeros(B, H, D, v.shape[-1], dtype=compute_dtype(k.dtype))
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
        for s in range(0, k.shape[-2], _BLOCK):
            kb, vb, gb = k[:, :, s:s + _BLOCK], v[:, :, s:s + _BLOCK], g[:, :, s:s + _BLOCK]
            G = gb.cumsum(dim=2)  # (B, H, r) or (B, H, r, D)
            total = G[:, :, -1:]  # (B, H, 1) or (B, H, 1, D)
            w = (total - G).exp_()  # decay from each token to the block's end, <= 1
            if gb.dim() == 3:  # a scalar per head and token
                state.S.mul_(total.exp()[..., None])
                state.S.add_((kb * w[..., None]).transpose(-1, -2) @ vb)
            else:  # per channel: row d of S decays by channel d's gate
                state.S.mul_(total.exp().transpose(-1, -2))
                state.S.add_((kb * w).transpose(-1, -2) @ vb)
        return state

    def decode_step(self, state, q, k, v, **inputs):
        dtype = q.dtype
        q, k, v, g, beta = self._in(q, k, v, inputs, state.S.dtype)
        _write(state.S, k[:, :, 0], v[:, :, 0], None if g is None else g[:, :, 0],
               None if beta is None else beta[:, :, 0])
        B, H, D, Dv = state.S.shape
        o = torch.bmm(q.reshape(B * H, 1, D), state.S.view(B * H, D, Dv))
        return o.mul_(D ** -0.5).view(B, H, 1, Dv).to(dtype), state


def _delta_block(S, k, v, beta, g) -> None:
    """r tokens of the delta rule into S (B, H, D, Dv), in place, by the UT form (Yang et
    al. 2024): with G the block's cumulative log-decay (0 without a gate),
    U = (I + tril(diag(β) (K K^T ⊙ Γ), -1))^-1 diag(β) (V - diag(exp G) K S),
    Γ_ts = exp(G_t - G_s), and then S <- exp(G_r) S + (K ⊙ exp(G_r - G))^T U."""
    r = k.shape[-2]
    G = torch.zeros_like(beta) if g is None else g.cumsum(dim=-1)  # (B, H, r)
    lower = torch.ones(r, r, dtype=torch.bool, device=k.device).tril(-1)
    gam = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * gam  # (B, H, r, r), strictly lower
    eye = torch.eye(r, dtype=k.dtype, device=k.device)
    rhs = beta[..., None] * (v - G.exp()[..., None] * (k @ S))  # (B, H, r, Dv)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    total = G[..., -1:]  # (B, H, 1)
    S.mul_(total.exp()[..., None])
    S.add_((k * (total - G).exp()[..., None]).transpose(-1, -2) @ u)


def _write(S, k, v, g, beta) -> None:
    """One token of the recurrence into S (B, H, D, Dv), in place: decay, erase, write.
    k, v (B, H, D); g (B, H) or (B, H, D) or None; beta (B, H) or None. On (B H)-batched
    views, so that each product is one bmm: the erase's v - k S one baddbmm, the write
    S + k^T w another (a step at B = 1 is a few small calls, and their count is its time)."""
    B, H, D, Dv = S.shape
    S3, k3 = S.view(B * H, D, Dv), k.reshape(B * H, 1, D)
    if g is not None:
        a = g.exp()
        S.mul_(a[..., None, None] if a.dim() == 2 else a[..., :, None])
    w = v.reshape(B * H, 1, Dv)
    if beta is not None:  # β (v - k S): what the erase leaves, scaled
        w = torch.baddbmm(w, k3, S3, alpha=-1).mul_(beta.reshape(B * H, 1, 1))
    S3.baddbmm_(k3.transpose(1, 2), w)
