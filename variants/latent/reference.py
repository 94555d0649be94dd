"""MLA's float64 references, from the definition (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1):
each head's key and value decompressed from the latent, then exact softmax.

`mla_reference` is the forward's: k_h = [c W_UK_h^T | k_pe], v_h = c W_UV_h^T, q_h = [q_nope_h
| q_pe_h], exact attention in float64 by `variants.exact_reference` (query chunks, no N x N).
`LatentDecodeReference` is the decode pass's, over a context fed in pieces: an online
softmax for the T new tokens only, so that a 1M-token context costs T rows of work; its
scores are the decompressed ones written by associativity, (q_nope_h W_UK_h) . c + q_pe .
k_pe, since decompressing a long context per head in float64 (H (dn + dv) R per token) is
out of reach; tests/test_mla.py holds that equal to the decompressed form to 1e-12.
"""

from __future__ import annotations

import math

import torch

from ..core import exact_reference


def _latents(k, v, H):
    """k_pe (B, Hk, N, dr), c (B, Hk, N, R) as one latent each: the harness may hand them
    repeated to every head (`expand_heads`); all copies are the same latent."""
    return k[:, :1].double(), v[:, :1].double()


def mla_reference(q, k, v, causal, q_nope, w_uk, w_uv, scale: float) -> torch.Tensor:
    """float64 (B, H, N, dv): exact softmax over the per-head keys and values decompressed
    from the latent (q = q_pe, k = k_pe, v = c_kv)."""
    B, H, N, dr = q.shape
    k_pe, c = _latents(k, v, H)
    w_uk, w_uv = w_uk.double(), w_uv.double()
    k_nope = torch.einsum("bnr,hdr->bhnd", c[:, 0], w_uk)
    keys = torch.cat([k_nope, k_pe.expand(B, H, N, dr)], dim=-1)
    values = torch.einsum("bnr,hdr->bhnd", c[:, 0], w_uv)
    queries = torch.cat([q_nope.double(), q.double()], dim=-1)
    E = queries.shape[-1]
    # exact_reference scales by 1 / sqrt(E): fold the variant's own scale into the queries.
    return exact_reference(queries * (scale * math.sqrt(E)), keys, values, causal)


class LatentDecodeReference:
    """Float64 exact causal attention of T new tokens over a context fed chunk by chunk (the
    decode pass's `add`, then `finish`), in the latent: only the T query rows and one chunk
    are alive."""

    def __init__(self, q, q_nope, w_uk, w_uv, scale: float):
        self.w_uv = w_uv.detach().double()
        qa = torch.einsum("bhtd,hdr->bhtr", q_nope.detach().double(), w_uk.detach().double())
        self.qa = torch.cat([qa, q.detach().double()], dim=-1) * scale  # (B, H, T, R + dr)
        B, H, T, _ = q.shape
        self.R = w_uk.shape[-1]
        self.top = self.qa.new_full((B, H, T, 1), float("-inf"))
        self.den = self.qa.new_zeros(B, H, T, 1)
        self.num = self.qa.new_zeros(B, H, T, self.R)

    def add(self, q, k, v, inputs, allowed=None):
        """A piece of the context: k = k_pe (B, Hk, r, dr), v = c (B, Hk, r, R)."""
        if k.shape[-2] == 0:
            return
        k_pe, c = _latents(k, v, q.shape[1])
        kc = torch.cat([c, k_pe], dim=-1)[:, 0]  # (B, r, R + dr)
        s = self.qa @ kc[:, None].transpose(-1, -2)  # (B, H, T, r)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        top = torch.maximum(self.top, s.amax(dim=-1, keepdim=True))
        p = (s - top).exp()
        rescale = (self.top - top).exp()
        self.den = self.den * rescale + p.sum(dim=-1, keepdim=True)
        self.num = self.num * rescale + p @ c[:, :1]
        self.top = top

    def finish(self, q, k, v, inputs) -> torch.Tensor:
        """The new tokens' own keys, causally; the (B, H, T, dv) reference."""
        T = k.shape[-2]
        t = torch.arange(T, device=k.device)
        self.add(q, k, v, inputs, allowed=t[None, :] <= t[:, None])
        return torch.einsum("bhtr,hdr->bhtd", self.num / self.den, self.w_uv)
