"""MLA's two forward forms and its absorbed decoding step, over the latent layout of
`mla.py` (q = q_pe (B, H, N, dr), k = k_pe (B, 1, N, dr), v = c_kv (B, 1, N, R); the inputs
q_nope (B, H, N, dn), w_uk (H, dn, R), w_uv (H, dv, R)).

Both forms hand the softmax to torch's scaled_dot_product_attention, whose fused CPU kernel
(FlashAttention's scheme: no N x N tensor, forward or backward) runs only where the values
are as wide as the keys: measured here, q (1, 8, 4096, E) forward+backward causal, E = 192
with values of 128 ran the math path (1.6 GiB above the inputs, the N x N scores kept),
E = Ev = 576 the fused kernel (242 MiB with enable_gqa, the shared head read natively).
So the naive form pads its values (or keys) with zero columns to one width, and the
absorbed form uses the latent-and-rotary key as its own value (FlashMLA's MQA mode: the
value is the key's first R columns) and keeps the first R columns of the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import compute_dtype, softmax_


def up_project(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c (B, 1, N, R) by every head's w (H, d, R): (B, H, N, d) = c w_h^T, one matmul
    (the latent is not repeated per head)."""
    B, _, N, R = c.shape
    H, d, _ = w.shape
    y = c.reshape(B * N, R) @ w.reshape(H * d, R).transpose(0, 1)  # (B N, H d)
    return y.view(B, N, H, d).transpose(1, 2)


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, a) by each head's own w (H, a, b): (B, H, N, b), one batched matmul."""
    B, H, N, a = x.shape
    y = torch.bmm(x.transpose(0, 1).reshape(H, B * N, a), w)  # (H, B N, b)
    return y.view(H, B, N, -1).transpose(0, 1)


def naive_forward(q_pe, k_pe, c, q_nope, w_uk, w_uv, causal: bool, scale: float):
    """Decompress the latent into every head's key [c W_UK_h^T | k_pe] and value
    c W_UV_h^T, then exact attention with the query [q_nope | q_pe]: (B, H, N, dv)."""
    B, H, N, dr = q_pe.shape
    dv = w_uv.shape[1]
    k = torch.cat([up_project(c, w_uk), k_pe.expand(B, H, N, dr)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    v = up_project(c, w_uv)
    E = q.shape[-1]
    if dv < E:  # zero value columns: one width for the fused kernel, cut after
        v = F.pad(v, (0, E - dv))
    elif dv > E:  # zero key columns change no score
        q, k = F.pad(q, (0, dv - E)), F.pad(k, (0, dv - E))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return o[..., :dv]


def absorbed_query(q_pe, q_nope, w_uk):
    """[q_nope W_UK_h | q_pe]: (B, H, N, R + dr), the query in the latent's space."""
    return torch.cat([per_head(q_nope, w_uk), q_pe], dim=-1)


def absorbed_forward(q_pe, k_pe, c, q_nope, w_uk, w_uv, causal: bool, scale: float):
    """W_UK folded into the query, attention over the one latent-and-rotary key
    [c | k_pe] (its first R columns the value), W_UV applied to the head's sum:
    (B, H, N, dv)."""
    H, R = q_pe.shape[1], c.shape[-1]
    kc = torch.cat([c, k_pe], dim=-1)  # (B, 1, N, R + dr): what the cache keeps
    o = F.scaled_dot_product_attention(absorbed_query(q_pe, q_nope, w_uk), kc, kc,
                                       is_causal=causal, scale=scale, enable_gqa=H != 1)
    return per_head(o[..., :R], w_uv.transpose(1, 2))


def absorbed_step(kc: torch.Tensor, q_pe, q_nope, w_uk, w_uv, scale: float):
    """One query row a head against the first n rows of the cache kc (B, n, R + dr):
    q_pe (B, H, 1, dr), q_nope (B, H, 1, dn) -> (B, H, 1, dv), computed in the dtype the
    kernels accumulate in (float32 for bfloat16). Every head's scores are rows of one
    batched matmul against the latent (read once for all heads), the softmax in place,
    the heads' latent sums one more, then each head's W_UV."""
    cd = compute_dtype(q_pe.dtype)
    B, H = q_pe.shape[:2]
    R = w_uk.shape[-1]
    qa = absorbed_query(q_pe.to(cd), q_nope.to(cd), w_uk.to(cd))[:, :, 0]  # (B, H, R + dr)
    kc = kc.to(cd)
    s = torch.bmm(qa.mul_(scale), kc.transpose(1, 2))  # (B, H, n)
    softmax_(s)
    o = torch.bmm(s, kc[..., :R])  # (B, H, R)
    return per_head(o[:, :, None], w_uv.to(cd).transpose(1, 2)).to(q_pe.dtype)


def naive_step(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, scale: float):
    """One query row a head, q (B, H, 1, dn + dr), against per-head keys k (B, H, n, dn +
    dr) and values v (B, H, n, dv): (B, H, 1, dv) in the accumulation dtype."""
    cd = compute_dtype(q.dtype)
    s = (q.to(cd) * scale) @ k.to(cd).transpose(-1, -2)
    softmax_(s)
    return s @ v.to(cd)
