"""MLA: multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1; DeepSeek-V3's
inference/model.py `MLA`, whose forward has both forms below).

Each token's keys and values for all H heads are one latent c_kv of width R =
kv_lora_rank and one rotary key k_pe of width dr = qk_rope_head_dim shared by the heads;
head h's key is [c W_UK_h^T | k_pe] (dn + dr wide, dn = qk_nope_head_dim) and its value
c W_UV_h^T (dv = v_head_dim); its query is [q_nope_h | q_pe_h]; exact causal (or not)
softmax with `scale` (default 1/sqrt(dn + dr)).

As the suite's q, k, v (a pure map: the down-projections, norms and rotary embedding
that make them from a hidden state are the layer's, outside, as every variant's are):
q = q_pe (B, H, N, dr), k = k_pe (B, 1, N, dr), v = c_kv (B, 1, N, R), so the case is
head_dim = dr, kv_heads = 1, value_dim = R, and a decoder's cache is its k and v, R + dr
numbers a token for all heads. The declared inputs: q_nope (B, H, N, dn) a token, and the
layer's up-projections w_uk (H, dn, R) and w_uv (H, dv, R) (DeepSeek-V3's wkv_b, viewed
(H, dn + dv, R) and split), drawn as the paper's layer at initialisation. The output is
(B, H, N, dv).

Two forms (`form`), equal in exact arithmetic:
  naive    decompress the latent into every head's key and value, exact attention over
           them (DeepSeek-V3's attn_impl "naive"; its decoder caches per-head keys and
           values, H (dn + dr + dv) numbers a token);
  absorbed fold W_UK into the query (q_nope_h W_UK_h, R wide) and W_UV into the output:
           attention over the latent itself, one key-value head of R + dr for every
           head, the value the latent (DeepSeek-V3's "absorb", FlashMLA's MQA mode); its
           decoder caches R + dr numbers a token whatever H.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import (Contract, DecodeState, Grouping, InputSpec, Shape, Variant, param,
                    register)
from . import kernels as K
from .reference import LatentDecodeReference, mla_reference

FORMS = ("absorbed", "naive")
# DeepSeek-V2 Sec. 3.1.2 (and V3 Sec. 4.2): every learnable parameter is initialised with
# this standard deviation.
INIT_STD = 0.006


@dataclasses.dataclass(frozen=True)
class MlaParams:
    form: str = param("absorbed", choices=FORMS,
                      doc="absorbed: W_UK in the query, W_UV after the sum, attention over the "
                          "latent; naive: per-head keys and values decompressed from it")
    kv_lora_rank: int = param(512, min=1, doc="the latent's width R (DeepSeek-V3: 512); the "
                                              "case's value_dim")
    qk_rope_head_dim: int = param(64, min=1, doc="the shared rotary key's width (DeepSeek-V3: "
                                                 "64); the case's head_dim")
    qk_nope_head_dim: int = param(128, min=1, doc="each head's key and query width from the "
                                                  "latent (DeepSeek-V3: 128)")
    v_head_dim: int = param(128, min=1, doc="each head's value width, the output's "
                                            "(DeepSeek-V3: 128)")
    scale: float = param(0.0, min=0.0, doc="softmax scale; 0: 1/sqrt(qk_nope_head_dim + "
                                           "qk_rope_head_dim) (DeepSeek-V3's before its "
                                           "long-context mscale^2)")


def _weights_input(name: str, rows_name: str, rows: int, R: int, what: str) -> InputSpec:
    """An up-projection (H, rows, R): a parameter of the layer, one draw a case for every
    piece of a sequence (`fixed`), N(0, INIT_STD^2)."""
    def fixed(gen, H, D):
        return {name: torch.randn(H, rows, R, generator=gen) * INIT_STD}

    def sample(gen, B, H, N, D, **drawn):
        return drawn[name].clone()

    return InputSpec(name, ("H", rows_name, "kv_lora_rank"), None, None,
                     f"N(0, {INIT_STD}^2), one draw a case (DeepSeek-V2's initialisation)",
                     sample, doc=what, fixed=fixed,
                     own_dims=((rows_name, rows), ("kv_lora_rank", R)))


def mla_inputs(dn: int, dv: int, R: int) -> tuple[InputSpec, ...]:
    def q_nope(gen, B, H, N, D):
        return torch.randn(B, H, N, dn, generator=gen)

    return (InputSpec("q_nope", ("B", "H", "N", "qk_nope_head_dim"), None, None,
                      "N(0, 1) a token, as q", q_nope,
                      doc="each head's query part that meets the latent's keys",
                      own_dims=(("qk_nope_head_dim", dn),)),
            _weights_input("w_uk", "qk_nope_head_dim", dn, R,
                           "W_UK: the latent to each head's key (DeepSeek-V3's wkv_b, "
                           "its first qk_nope_head_dim rows a head)"),
            _weights_input("w_uv", "v_head_dim", dv, R,
                           "W_UV: the latent to each head's value (wkv_b's last v_head_dim "
                           "rows a head)"))


@dataclasses.dataclass
class LatentCache(DecodeState):
    """The absorbed decoder's cache: (B, 1, max_len, R + dr), each token's latent then its
    rotary key, the first n written; one for all heads."""
    appends = True
    kc: torch.Tensor
    n: int
    H: int  # the query heads it serves

    def query_heads(self) -> int:
        return self.H

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark  # later tokens are overwritten by the next appends


@dataclasses.dataclass
class HeadsCache(DecodeState):
    """The naive decoder's cache: every head's decompressed keys (B, H, max_len, dn + dr)
    and values (B, H, max_len, dv), the first n written."""
    appends = True
    k: torch.Tensor
    v: torch.Tensor
    n: int

    def mark(self) -> int:
        return self.n

    def rewind(self, mark: int) -> None:
        self.n = mark


@register
class Mla(Variant):
    """Multi-head latent attention: every head's keys and values from one latent and one
    rotary key a token (DeepSeek-V2/V3); naive or absorbed form."""
    name = "mla"
    family = "latent"
    Params = MlaParams
    paper = "https://arxiv.org/abs/2405.04434"
    # The inputs at the default widths (what `list` shows); an instance declares its own.
    contract = Contract(exactness="own", own_reference="own_softmax", decoding=True, extend=True,
                        grouping=Grouping("kv", "native", value_dim=True),
                        inputs=mla_inputs(128, 128, 512))

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        self.contract = self.contract.but(
            inputs=mla_inputs(p.qk_nope_head_dim, p.v_head_dim, p.kv_lora_rank))

    # -- widths ---------------------------------------------------------------------
    @property
    def softmax_scale(self) -> float:
        p = self.params
        return p.scale or 1.0 / math.sqrt(p.qk_nope_head_dim + p.qk_rope_head_dim)

    @property
    def row(self) -> int:
        """Numbers a token keeps in the latent cache: R + dr."""
        return self.params.kv_lora_rank + self.params.qk_rope_head_dim

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        return self.shape_reasons(Shape(1, 1, seq_len, head_dim, kv_heads=1,
                                        value_dim=self.params.kv_lora_rank))

    def shape_reasons(self, s: Shape) -> list[str]:
        """One reason per width the parameters fix that the case does not give: head_dim =
        qk_rope_head_dim (q = q_pe, k = k_pe), kv_heads 1 (one latent for every head),
        value_dim = kv_lora_rank (v = the latent)."""
        p, out = self.params, []
        if s.D != p.qk_rope_head_dim:
            out.append(f"mla: head_dim {s.D} is not qk_rope_head_dim {p.qk_rope_head_dim} "
                       "(q and k are the rotary query and key)")
        if s.Hk != 1 or s.value_heads not in (None, s.H, s.Hk):
            out.append(f"mla: kv_heads {s.Hk} is not 1 (one latent and rotary key for every "
                       "head)")
        if s.Dv != p.kv_lora_rank:
            out.append(f"mla: value_dim {s.Dv} is not kv_lora_rank {p.kv_lora_rank} (v is "
                       "the latent)")
        return out

    def check_call(self, q, k, v, causal=False, *, backward=False, **inputs):
        super().check_call(q, k, v, causal, backward=backward, **inputs)
        self._check_widths(q.shape[1], k, v)

    def _check_widths(self, H, k, v):
        reasons = self.shape_reasons(Shape(k.shape[0], H, k.shape[2], k.shape[-1],
                                           kv_heads=k.shape[1], value_dim=v.shape[-1]))
        if reasons:
            raise ValueError("; ".join(reasons))

    # -- the map ----------------------------------------------------------------------
    def attend(self, q, k, v, causal, q_nope, w_uk, w_uv):
        form = K.naive_forward if self.params.form == "naive" else K.absorbed_forward
        return form(q, k, v, q_nope, w_uk, w_uv, causal, self.softmax_scale)

    def reference(self, q, k, v, causal=True, q_nope=None, w_uk=None, w_uv=None):
        return mla_reference(q, k, v, causal, q_nope, w_uk, w_uv, self.softmax_scale)

    def flops_at(self, s: Shape, causal: bool = False) -> int:
        return self.flops(s.B, s.H, s.N, s.D, causal)

    def flops(self, B, H, N, D, causal=False):
        """As computed (the fused kernel's padded widths included): naive, the two
        up-projections of every token 2 N R (dn + dv) a head, then q k^T and p v at the
        common width E = max(dn + dr, dv); absorbed, the query's 2 N dn R and the output's
        2 N R dv a head, q k^T and p v both R + dr wide. Causal halves the attention."""
        p = self.params
        R, dn, dr, dv = p.kv_lora_rank, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim
        if p.form == "naive":
            proj, width = 2 * N * R * (dn + dv), max(dn + dr, dv)
        else:
            proj, width = 2 * N * R * (dn + dv), R + dr
        att = 4 * N * N * width // (2 if causal else 1)
        return B * H * (proj + att)

    def keys_per_query(self, N, causal=False):
        return float(N if not causal else (N + 1) / 2)

    # -- decoding -------------------------------------------------------------------
    def state_size(self, N, D):
        """Per head as if alone: the absorbed cache, N (R + dr); naive, N (dn + dr + dv)."""
        p = self.params
        if p.form == "naive":
            return N * (p.qk_nope_head_dim + p.qk_rope_head_dim + p.v_head_dim)
        return N * self.row

    def state_size_at(self, N, s):
        """Absorbed: N (R + dr) for all heads; naive: H N (dn + dr + dv)."""
        return self.state_size(N, s.D) * (s.H if self.params.form == "naive" else 1)

    def decode_read_size_at(self, N, s):
        """The cache (`state_size_at`) and the two up-projections the step multiplies by
        (H R (dn + dv): the query's absorption and the output's, or the new token's
        decompression)."""
        p = self.params
        return self.state_size_at(N, s) + s.H * p.kv_lora_rank * (p.qk_nope_head_dim
                                                                  + p.v_head_dim)

    def decode_flops_at(self, N, s):
        """As the step computes: the projections 2 H R (dn + dv); absorbed, scores and
        latent sums 2 H N (2 R + dr); naive, 2 H N (dn + dr + dv)."""
        p = self.params
        R, dn, dr, dv = p.kv_lora_rank, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim
        att = 2 * R + dr if p.form == "absorbed" else dn + dr + dv
        return 2 * s.H * (R * (dn + dv) + N * att)

    def decode_prefill(self, k, v, max_len, **inputs):
        H = inputs["q_nope"].shape[1]
        self._check_widths(H, k, v)
        B = k.shape[0]
        if self.params.form == "naive":
            p = self.params
            state = HeadsCache(k.new_empty(B, H, max_len, p.qk_nope_head_dim + p.qk_rope_head_dim),
                               v.new_empty(B, H, max_len, p.v_head_dim), 0)
        else:
            state = LatentCache(k.new_empty(B, 1, max_len, self.row), 0, H)
        return self.decode_extend(state, k, v, **inputs)

    def decode_extend(self, state, k, v, q_nope=None, w_uk=None, w_uv=None):
        n, r = state.n, k.shape[-2]
        if n + r > state.tensors()[0].shape[-2]:
            raise ValueError(f"the cache is full: max_len = {state.tensors()[0].shape[-2]} "
                             "tokens")
        if isinstance(state, LatentCache):
            R = self.params.kv_lora_rank
            state.kc[:, :, n:n + r, :R], state.kc[:, :, n:n + r, R:] = v, k
        else:  # decompressed as it enters, in the dtype the kernels accumulate in
            cd = torch.float64 if v.dtype == torch.float64 else torch.float32
            H = state.k.shape[1]
            c = v.to(cd)
            state.k[:, :, n:n + r] = torch.cat(
                [K.up_project(c, w_uk.to(cd)), k.to(cd).expand(-1, H, -1, -1)], dim=-1)
            state.v[:, :, n:n + r] = K.up_project(c, w_uv.to(cd))
        state.n = n + r
        return state

    def decode_step(self, state, q, k, v, q_nope=None, w_uk=None, w_uv=None):
        self.decode_extend(state, k, v, q_nope=q_nope, w_uk=w_uk, w_uv=w_uv)
        n = state.n
        if isinstance(state, LatentCache):
            return K.absorbed_step(state.kc[:, 0, :n], q, q_nope, w_uk, w_uv,
                                   self.softmax_scale), state
        o = K.naive_step(state.k[:, :, :n], state.v[:, :, :n],
                         torch.cat([q_nope, q], dim=-1), self.softmax_scale)
        return o.to(q.dtype), state

    def reference_from(self, state, q, k, v, q_nope=None, w_uk=None, w_uv=None):
        """The float64 causal forward of these tokens after the latents `state` holds (None:
        the start): the decompressed reference over the context so far and these tokens,
        their rows kept; the state, every latent and rotary key so far (as given). Its
        work grows with the square of the context: the decode pass uses
        `decode_reference` instead."""
        ks, vs = ([k[:, :1]], [v[:, :1]]) if state is None else (
            [state[0], k[:, :1]], [state[1], v[:, :1]])
        kk, vv = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        P, T = kk.shape[2] - k.shape[2], k.shape[2]
        pad = q.new_zeros(q.shape[0], q.shape[1], P, q.shape[-1])
        pad_n = q_nope.new_zeros(q.shape[0], q.shape[1], P, q_nope.shape[-1])
        full = mla_reference(torch.cat([pad, q], dim=2), kk, vv, True,
                             torch.cat([pad_n, q_nope], dim=2), w_uk, w_uv, self.softmax_scale)
        return full[:, :, P:P + T], (kk, vv)

    def decode_reference(self, q, k, v, q_nope=None, w_uk=None, w_uv=None):
        """The decode pass's float64 reference of the T new tokens (q, q_nope of those
        tokens): an online softmax over the context's pieces and then the tokens
        (`reference.LatentDecodeReference`), T rows of work whatever the context."""
        return LatentDecodeReference(q, q_nope, w_uk, w_uv, self.softmax_scale)
