"""Attention sinks: one learned logit per query head in the softmax's denominator.

gpt-oss (openai/gpt-oss, gpt_oss/torch/model.py, its attention layer's `sinks`): every
layer has a logit S_h per head that joins each query's scores as one more column, and that
column is dropped after the softmax:

    p_ij = exp(s_ij) / (exp(S_h) + sum_j' exp(s_ij'))        o_i = sum_j p_ij v_j

so a query may put weight on "nothing" and its output shrinks towards zero. A kernel that
gives the plain output o and each row's log-sum-exp lse = log sum_j exp(s_ij) gets the
sinked output from them: o' = o exp(lse - lse'), lse' = logaddexp(lse, S_h); and the
FlashAttention-style backward (probabilities recomputed as exp(s - lse), D_i = dO_i . O_i)
gives the sinked gradients when handed o' and lse' (the sink's column is a key whose value
is zero). The sink's own gradient is dS_h = -sum_{b,i} exp(S_h - lse'_i) (dO_i . o'_i).

A sink of -inf is the variant without one, exactly (o' = o).

`sink = true` on `standard`, `sdpa` and `sliding_window` declares the input `sinks`
(`SINKS`): (H,), one logit a query head, drawn N(0, 1) per head, the same for every piece
of a sequence drawn in pieces (it is the layer's parameter, not a per-token input).
"""

from __future__ import annotations

import torch

from .inputs import InputSpec
from .interface import param


def _fixed(gen: torch.Generator, H: int, D: int) -> dict:
    return {"sinks": torch.randn(H, generator=gen)}


def _sample(gen: torch.Generator, B: int, H: int, N: int, D: int, *, sinks) -> torch.Tensor:
    return sinks.clone()


SINKS = InputSpec(
    "sinks", ("H",), None, None,
    "N(0, 1) per query head, one set per case (gpt-oss's per-head sink logit, a learned "
    "parameter of the layer)", _sample,
    doc="one logit per query head in each row's softmax denominator, its column dropped "
        "after (gpt-oss)", fixed=_fixed)


def sink_param():
    """The `sink` parameter: declared after results were stored (`later`), so that a
    setting without it keeps its id."""
    return param(False, doc="a learned sink logit per query head in the softmax's "
                            "denominator, its column dropped (gpt-oss); declares the input "
                            "`sinks` (H,)", later=True)


def per_token(spec: InputSpec) -> bool:
    """Whether an input has one value a token (its dims name N): cut with the tokens of a
    sequence taken in pieces; one that does not (a sink a head) is whole in every piece."""
    return "N" in spec.dims


class Sinks:
    """Mixed into a variant with a `sink` parameter, before its base class: an instance with
    sink = true declares the input `sinks` (its instance's contract), and says so in its
    checks."""

    def __init__(self, params=None):
        super().__init__(params)
        if getattr(self.params, "sink", False):
            self.contract = self.contract.but(inputs=self.contract.inputs + (SINKS,))


def sinked(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, view=(1, -1, 1, 1)):
    """(o', lse'): an output o (B, H, n, Dv) and its rows' log-sum-exp lse (B, H, n, 1)
    with each head's sink logit (H,) in the denominator; `view`: the shape that lays the
    sinks along lse's head dim (a kernel's own layout). lse' in lse's dtype; o' in o's."""
    s = sinks.to(lse.dtype).view(view)
    lse2 = torch.logaddexp(lse, s)
    return o * (lse - lse2).exp().to(o.dtype), lse2


def sink_grad(sinks: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor,
              view=(1, -1, 1, 1)) -> torch.Tensor:
    """dS (H,): -sum over batch and rows of exp(S_h - lse'_i) delta_i, delta_i = dO_i . o'_i,
    both (B, H, n, 1) (or the layout `view` lays the sinks along, as in `sinked`)."""
    s = sinks.to(lse2.dtype).view(view)
    w = (s - lse2).exp()
    return -(w * delta.to(lse2.dtype)).sum_to_size(s.shape).reshape(sinks.shape).to(sinks.dtype)
