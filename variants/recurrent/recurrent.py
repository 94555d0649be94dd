"""The gated linear recurrences: retention, gla, mamba2, deltanet, gated_deltanet, kda.

Each is `S_t = (gate, erase) S_{t-1} + write`, o_t = D^-1/2 q_t S_t (`reference.py` has the
sequential form and the dense weights, `chunked.py` the chunkwise kernels). Causal only.
Accumulation dtype: float64 stays, everything else computes in float32 and casts back.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..core import Contract, Grouping, Variant, compute_dtype, param, register
from .chunked import (block_rows, chunk_channel_gate, chunk_delta, chunk_delta_channel,
                      chunk_length, chunk_scalar_gate, stream)
from .decoding import RecurrentDecoding
from .gates import BETA, GATE_CHANNEL, GATE_GDN, GATE_HEAD, GATE_KDA, beta_spec
from .parallel import (whole_channel_gate, whole_delta, whole_delta_channel,
                       whole_scalar_gate)
from .reference import dense_weights, recurrence

CAUSAL_ONLY = "a recurrence: causal only"


@dataclasses.dataclass(frozen=True)
class ChunkParams:
    chunk: int = param(64, min=1, doc="tokens per chunk of the chunkwise-parallel form")


@dataclasses.dataclass(frozen=True)
class GLAParams:
    chunk: int = param(64, min=1, doc="tokens per chunk of the chunkwise-parallel form")
    sub_chunk: int = param(1, min=1, doc="tokens per diagonal leaf of the per-channel scores "
                           "whose (c, c, D) decays are taken explicitly, rounded up to a power "
                           "of two (1: only q_t . k_t; the rest are matmuls, scores.py)")


@dataclasses.dataclass(frozen=True)
class DeltaParams:
    chunk: int = param(64, min=1, doc="tokens per chunk of the chunkwise-parallel form")
    beta_max: float = param(1.0, min=1.0, max=2.0, doc="the write strength's upper bound: "
                            "beta = beta_max sigmoid(x), in (0, beta_max); above 1 the "
                            "transition I - beta k k^T has a negative eigenvalue, which "
                            "state tracking (parity) needs (Grazzi et al. 2024, "
                            "arXiv:2411.12537: 2)", later=True)


class BetaMax:
    """DeltaNet's and Gated DeltaNet's declared `beta` follows the parameter beta_max: its
    range (0, beta_max), drawn beta_max sigmoid(x) (the trained model's layer scales its
    sigmoid by the range's top, harness.train.model)."""

    def __init__(self, params=None):
        super().__init__(params)
        beta_max = getattr(self.params, "beta_max", 1.0)  # a subclass of other Params
        if beta_max != 1.0:  # this instance's contract: its declared inputs follow it
            self.contract = self.contract.but(inputs=tuple(
                beta_spec(beta_max) if s.name == "beta" else s for s in self.contract.inputs))


class Recurrent(RecurrentDecoding, Variant):
    """Shared by the family: the causal-only refusal, the dtype handling, the state size
    and the float64 sequential reference. Subclasses give `_terms` (q, k, v, g, beta as
    the recurrence takes them), `_chunked` and `_whole` (the one-chunk form, for a
    sequence that fits in one chunk)."""
    family = "recurrent"
    # Measured against its own float64 form; grouped value heads (fla's num_v_heads):
    # value head j reads query-key head j // (Hv / Hk), its gates per value head, run
    # natively: q and k are never repeated; a query-key head's state is (Dk, r Dv), its r
    # value heads side by side (chunked.py, decoding.py); values of their own width too.
    # output_layer: the paper's layer between the mixer and the output projection (a
    # per-head norm, an output gate), which a trained model builds around it:
    # harness.train.output_layer.
    contract = Contract(exactness="own", causal="causal_only", refused_why=CAUSAL_ONLY,
                        decoding=True, extend=True, weights=True,
                        grouping=Grouping("value", "native", value_dim=True))
    delta = False  # L2-normalises q and k (the delta rule's papers do)

    def _terms(self, q, k, v, inputs) -> tuple:
        """(q, k, v, g, beta) as the recurrence takes them, in q's dtype."""
        g, beta = inputs.get("g"), inputs.get("beta")
        if self.delta:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return q, k, v, g, beta

    def _in(self, q, k, v, inputs, ct) -> tuple:
        """The terms in the compute dtype ct, cast before the L2 normalisation."""
        return self._terms(q.to(ct), k.to(ct), v.to(ct),
                           {n: t.to(ct) for n, t in inputs.items()})

    def attend(self, q, k, v, causal, **inputs):
        """Up to `chunk` tokens the one-chunk form (`parallel.py`); longer, block by block
        (`chunked.stream`): the cast, the L2 normalisation and the chunk kernels on blocks
        of a few thousand tokens, the state carried between them. Neither form looks at
        the values to choose what it computes."""
        B, _, N, D = q.shape
        ct = compute_dtype(q.dtype)
        if N <= self.params.chunk:
            return self._whole(*self._in(q, k, v, inputs, ct)).to(q.dtype)
        rows = block_rows(B, v.shape[1], self._c(N), max(D, v.shape[-1]))
        return stream(lambda qb, kb, vb, ib, S: self._chunked(*self._in(qb, kb, vb, ib, ct), S),
                      q, k, v, inputs, rows, q.dtype)

    def attention_weights(self, q, k, causal, **inputs):
        dtype = q.dtype
        q, k, _, g, beta = self._in(q, k, k, inputs, compute_dtype(dtype))
        return dense_weights(q, k, g, beta).to(dtype)

    def reference(self, q, k, v, causal=True, **inputs) -> torch.Tensor:
        """The float64 sequential recurrence (`reference.recurrence`): what this variant's
        error is measured against (`err_ref` = recurrence)."""
        return recurrence(*self._in(q, k, v, inputs, torch.float64))

    def reference_from(self, state, q, k, v, **inputs):
        """The causal forward in float64 from the state S (B, H, Dk, r Dv) after the tokens
        before (None: zeros): (o, S after these). The chunkwise kernels, block by block as
        `attend` runs them, not the decoding form: a decode benchmark's reference."""
        self.check_call(q, k, v, True, **inputs)
        q, k, v, inputs = q.double(), k.double(), v.double(), {
            n: t.double() for n, t in inputs.items()}
        B, _, N, D = q.shape
        rows = block_rows(B, v.shape[1], self._c(N), max(D, v.shape[-1]))
        out = []
        for s in range(0, N, rows):
            o, state = self._chunked(*self._in(
                q[:, :, s:s + rows], k[:, :, s:s + rows], v[:, :, s:s + rows],
                {n: t[:, :, s:s + rows] for n, t in inputs.items()}, torch.float64), state)
            out.append(o)
        return torch.cat(out, dim=2), state

    def state_size(self, N, D):
        return D * D

    def state_size_at(self, N, s):
        """A (Dk, Dv) state per value head, whatever the grouping: Hv Dk Dv numbers a batch
        element (a query-key head's (Dk, r Dv) holds its r value heads'); q and k are
        not kept."""
        return s.Hv * s.D * s.Dv

    def flops(self, B, H, N, D, causal=False):
        return self._count(B, H, H, N, D, D)

    def flops_at(self, s, causal=False):
        """Natively grouped: the products a query-key head's r value heads share (Q K^T,
        K K^T where no per-value-head decay enters them) once per query-key head, the
        rest per value head, over Dv where they are the values'; repeated (fla's
        kernels), every product per value head."""
        Hqk = s.H if self.contract.grouping.how == "native" else s.Hv
        return self._count(s.B, Hqk, s.Hv, s.N, s.D, s.Dv)

    def _count(self, B, H, Hv, N, D, Dv):
        shared, per = self._split_flops(N, self._c(N), D, Dv)
        return B * (H * shared + Hv * per)

    def _split_flops(self, N, C, D, Dv) -> tuple[int, int]:
        """Forward FLOPs of one (batch, query-key head) and of one (batch, value head)."""
        raise NotImplementedError

    def decode_flops_at(self, N, s):
        """`decoding.decode_step` per value head, its state S (D, Dv): the write k^T w
        (a (D, 1) by (1, Dv) product added into S, 2 D Dv), the read q S (2 D Dv), the
        decay's scaling of S (D Dv) where a step decays, the delta rule's k S (2 D Dv)
        for its erase; whatever the context."""
        per = 4 + (1 if self.step_decays else 0) + (2 if self.delta else 0)
        return s.out_heads * per * s.D * s.Dv

    @property
    def step_decays(self) -> bool:
        """Whether a step scales its state by a decay: a declared gate g."""
        return any(i.name == "g" for i in self.contract.inputs)

    def _chunked(self, q, k, v, g, beta, S=None):
        raise NotImplementedError

    def _whole(self, q, k, v, g, beta):
        raise NotImplementedError

    def _c(self, N):
        return chunk_length(N, self.params.chunk)


def _linear_flops(N, C, D, Dv):
    """(per query-key head, per value head): Q K^T in each chunk (2 N C D); its product
    with V (2 N C Dv), the chunk states K^T V and the inter-chunk Q S (4 N D Dv; none in
    the one-chunk form)."""
    return 2 * N * C * D, 2 * N * C * Dv + (4 * N * D * Dv if N > C else 0)


@register
class Retention(Recurrent):
    """RetNet's retention: S_t = γ_h S_{t-1} + k_t^T v_t, γ_h = 1 - 2^(-5-h); o_t = s q_t S_t."""
    name = "retention"
    Params = ChunkParams
    paper = "https://arxiv.org/abs/2307.08621"
    # Head h decays by its own γ_h: heads are not interchangeable.
    contract = Recurrent.contract.but(output_layer="group_swish", per_head_schedule=True)
    step_decays = True  # by its fixed γ_h, no declared gate

    def _terms(self, q, k, v, inputs):
        return q, k, v, retention_log_decay(v), None  # γ per value head

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_scalar_gate(q, k, v, g, self.params.chunk, S)

    def _whole(self, q, k, v, g, beta):
        return whole_scalar_gate(q, k, v, g)

    def _split_flops(self, N, C, D, Dv):
        return _linear_flops(N, C, D, Dv)


def retention_log_decay(v: torch.Tensor) -> torch.Tensor:
    """log γ_h for each value head h = 0..Hv-1, expanded to (B, Hv, N) (a view: read only);
    v (B, Hv, N, Dv). Grouped value heads decay each by its own γ, as the same heads
    ungrouped (q and k repeated) do."""
    B, H, N, _ = v.shape
    return _head_log_decay(H, v.dtype, v.device)[None, :, None].expand(B, H, N)


@functools.lru_cache(maxsize=None)
def _head_log_decay(H: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(H,) log γ_h, built once per (H, dtype, device): a decode step reads it, never
    rebuilds it (four small ops and a host-to-device copy a token otherwise)."""
    with torch.inference_mode(False):  # kept: usable by later calls with autograd too
        h = torch.arange(H, dtype=torch.float64)
        return torch.log1p(-torch.pow(2.0, -5.0 - h)).to(dtype).to(device)


@register
class GLA(Recurrent):
    """Gated linear attention: S_t = Diag(exp g_t) S_{t-1} + k_t^T v_t; g (B, H, N, D) <= 0."""
    name = "gla"
    Params = GLAParams
    paper = "https://arxiv.org/abs/2312.06635"
    contract = Recurrent.contract.but(output_layer="rms_swish", inputs=(GATE_CHANNEL,))

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_channel_gate(q, k, v, g, self.params.chunk, self.params.sub_chunk, S)

    def _whole(self, q, k, v, g, beta):
        return whole_channel_gate(q, k, v, g, self.params.sub_chunk)

    def _split_flops(self, N, C, D, Dv):
        # The per-channel scores' lower triangle (N C D: quadrant matmuls and leaves), per
        # value head (its decays enter them), then P V and the states as the scalar gate.
        return 0, N * C * D + _linear_flops(N, C, D, Dv)[1]


@register
class Mamba2(Recurrent):
    """Mamba2's SSD core: S_t = exp(g_t) S_{t-1} + k_t^T v_t with g (B, H, N) <= 0."""
    name = "mamba2"
    Params = ChunkParams
    paper = "https://arxiv.org/abs/2405.21060"
    contract = Recurrent.contract.but(output_layer="swish_rms", inputs=(GATE_HEAD,))

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_scalar_gate(q, k, v, g, self.params.chunk, S)

    def _whole(self, q, k, v, g, beta):
        return whole_scalar_gate(q, k, v, g)

    def _split_flops(self, N, C, D, Dv):
        return _linear_flops(N, C, D, Dv)


def _delta_flops(N, C, D, Dv):
    """(per query-key head, per value head): K K^T and Q K^T in each chunk (4 N C D); att U
    (2 N C Dv), the triangular solve for [Ũ | W] = T [V | K] (N C (Dv + D)), W S, Q S,
    K^T U (6 N D Dv). The one-chunk form solves for Ũ only and keeps no state (3 N C Dv
    a value head)."""
    if N > C:
        return 4 * N * C * D, 2 * N * C * Dv + N * C * (Dv + D) + 6 * N * D * Dv
    return 4 * N * C * D, 3 * N * C * Dv


@register
class DeltaNet(BetaMax, Recurrent):
    """DeltaNet: S_t = (I - β_t k_t^T k_t) S_{t-1} + β_t k_t^T v_t, q and k L2-normalised;
    β in (0, beta_max)."""
    name = "deltanet"
    Params = DeltaParams
    paper = "https://arxiv.org/abs/2406.06484"
    contract = Recurrent.contract.but(output_layer="rms", inputs=(BETA,))
    delta = True

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_delta(q, k, v, beta, None, self.params.chunk, S)

    def _whole(self, q, k, v, g, beta):
        return whole_delta(q, k, v, beta, None)

    def _split_flops(self, N, C, D, Dv):
        return _delta_flops(N, C, D, Dv)


@register
class GatedDeltaNet(BetaMax, Recurrent):
    """Gated DeltaNet: S_t = exp(g_t) (I - β_t k_t^T k_t) S_{t-1} + β_t k_t^T v_t; β in
    (0, beta_max)."""
    name = "gated_deltanet"
    Params = DeltaParams
    paper = "https://arxiv.org/abs/2412.06464"
    contract = Recurrent.contract.but(output_layer="rms_swish", inputs=(GATE_GDN, BETA))
    delta = True

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_delta(q, k, v, beta, g, self.params.chunk, S)

    def _whole(self, q, k, v, g, beta):
        return whole_delta(q, k, v, beta, g)

    def _split_flops(self, N, C, D, Dv):
        return _delta_flops(N, C, D, Dv)


@register
class KimiDeltaAttention(Recurrent):
    """Kimi Delta Attention: S_t = (I - β_t k_t^T k_t) Diag(exp g_t) S_{t-1} + β_t k_t^T v_t."""
    name = "kda"
    Params = GLAParams
    paper = "https://arxiv.org/abs/2510.26692"
    contract = Recurrent.contract.but(output_layer="rms_sigmoid", inputs=(GATE_KDA, BETA))
    delta = True

    def _chunked(self, q, k, v, g, beta, S=None):
        return chunk_delta_channel(q, k, v, beta, g, self.params.chunk, self.params.sub_chunk,
                                   S)

    def _whole(self, q, k, v, g, beta):
        return whole_delta_channel(q, k, v, beta, g, self.params.sub_chunk)

    def _split_flops(self, N, C, D, Dv):
        # its per-channel decays enter K K^T and Q K^T too: every product per value head
        return 0, sum(_delta_flops(N, C, D, Dv))
