"""What `moba` and `quest` share: a query attends, exactly, to the keys of the `top_k` key
blocks its gate scores best (causal: its own block always, counted among them, and
earlier blocks only). The subclasses say what a block's gate score is.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core import Contract, Grouping, Variant, compute_dtype, softmax_scale
from .decoding import BlockDecoding
from .routed_rows import routed_block_attention
from .routing import block_count, selected_keys, selected_rows, top_blocks

# Up to this many tokens the selection is applied as a mask over the dense scores (one
# SDPA call with a boolean mask): at a recall model's lengths the routed kernel's plan
# (the scatter, nonzero and gathers of `routed_rows`) costs more than the whole N x N.
# One thread, B = 32, H = 2, D = 32, causal, forward and backward, moba with 8-token
# blocks, top 3 (tests/benchmarks/test_recurrent_steps.py, "routed forms"): 9.2 ms routed
# against 2.9 dense at N = 64, 35.9 against 10.6 at 128 (sdpa 2.2, 7.2). Above it, the
# routed kernel: O(N top_k b D) time, O(N top_k) memory.
DENSE_MAX = 128


class BlockRouted(BlockDecoding, Variant):
    """Exact softmax over the keys of each query's top_k gated blocks; see the subclasses."""
    family = "routed"
    # Grouped keys run natively: each query head routes on its own against its kv head's
    # block statistics (computed once per kv head), and the kernels read that head's key
    # blocks; values may have their own width.
    contract = Contract(decoding=True, extend=True, weights=True,
                        grouping=Grouping("kv", "native", value_dim=True))
    # The parameter holding the block length (`block_size`, Quest's `page_size`).
    block_param: ClassVar[str] = "block_size"
    # Gate FLOPs per (query, block, channel): 2 for one dot product.
    gate_flops: ClassVar[int] = 2
    budget_param = "top_k"  # blocks (pages) a query reads: its budget, b keys a block

    @property
    def block(self) -> int:
        return getattr(self.params, self.block_param)

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        if device.type == "meta":  # which queries read a block is known only from values
            return [f"{self.name} routes by the values of q and k: its work cannot be laid "
                    "out on the meta device, which holds no values"]
        return []

    def gate(self, k: torch.Tensor):
        """A function of a query chunk (B, H, c, D) -> its blocks' scores (B, H, c, nb)."""
        raise NotImplementedError

    def select(self, q: torch.Tensor, k: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """The blocks each query reads, (B, H, N, kk) long, kk = min(top_k, blocks): best
        gate score first; causal: its own block first and -1 where fewer blocks precede
        it. Not differentiated. Scored in the dtype the attention computes in (float32
        for bfloat16), as the decoder scores them: bfloat16 block statistics and scores
        tie and round apart, and another block set is another output."""
        cd = compute_dtype(q.dtype)
        with torch.no_grad():
            return top_blocks(self.gate(k.detach().to(cd)), q.detach().to(cd),
                              block_count(q.shape[-2], self.block), self.block,
                              self.params.top_k, causal)

    def selection(self, q, k, causal=False):
        """`select`: the block indices forward computes (the selection's cost)."""
        return self.select(q, k, causal)

    def selection_cost(self, B, H, Hk, N, D, causal=False, itemsize=4):
        """Every query scores every block (later ones masked after): gate_flops D a block
        and head (moba's q . mean, Quest's two products); the block statistics read, one
        (moba's mean) or two (Quest's min and max) D-vectors a block and kv head."""
        nb = block_count(N, self.block)
        stats = 1 if self.block_stat == "sum" else 2
        return float(self.gate_flops * H * D * nb), float(stats * Hk * D * itemsize * nb)

    def selected_keys(self, selection, rows, N, causal):
        return selected_rows(selection[:, :, rows.to(selection.device)], rows, self.block, N,
                             causal)

    def attend(self, q, k, v, causal):
        N = q.shape[-2]
        if N == 0:
            return q.clone()
        sel = self.select(q, k, causal)
        if N <= DENSE_MAX:  # the same softmax over the same keys (see DENSE_MAX)
            allowed = selected_keys(sel, self.block, N, causal)  # every row holds a key
            cd = compute_dtype(q.dtype)
            if k.shape[1] == q.shape[1]:
                return F.scaled_dot_product_attention(q.to(cd), k.to(cd), v.to(cd),
                                                      attn_mask=allowed).to(q.dtype)
            return _grouped_dense(q.to(cd), k.to(cd), v.to(cd), allowed).to(q.dtype)
        return routed_block_attention(q, k, v, sel, self.block, causal)

    def attention_weights(self, q, k, causal):
        N = q.shape[-2]
        allowed = selected_keys(self.select(q, k, causal), self.block, N, causal)
        s = (q * softmax_scale(q.shape[-1])) @ k.transpose(-1, -2)  # (B, H, N, N)
        return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        """Every block is read where top_k covers them all (causal: those at or before
        the query, fewer still)."""
        return self.params.top_k >= block_count(seq_len, self.block)

    def _blocks_read(self, N: int, causal: bool) -> int:
        """(query, block) pairs computed: kk per query; causal min(kk, own block + 1)."""
        b, kk = self.block, min(self.params.top_k, block_count(N, self.block))
        if not causal:
            return N * kk
        full, rest = divmod(N, b)  # full blocks of queries, then a partial one
        per = [min(kk, j + 1) for j in range(full + (rest > 0))]
        return sum(p * b for p in per[:full]) + (per[-1] * rest if rest else 0)

    def flops(self, B, H, N, D, causal=False):
        return self._flops(B, H, N, D, D, causal)

    def flops_at(self, s, causal=False):
        """`flops` of its own heads and widths: grouping shares keys, not work."""
        return self._flops(s.B, s.H, s.N, s.D, s.Dv, causal)

    def _flops(self, B, H, N, D, Dv, causal):
        """2 b (Dk + Dv) per (query, block) pair read (q k^T and p v, at block granularity:
        the masked part of a partial or own block counted) plus the gate, gate_flops Dk per
        (query, block); the block statistics are not matmuls. Up to DENSE_MAX tokens,
        2 N^2 (Dk + Dv) (the dense masked form)."""
        if N == 0:
            return 0
        nb = block_count(N, self.block)
        gate = self.gate_flops * N * nb * D
        if N <= DENSE_MAX:  # every score, masked or not (SDPA under a mask skips none)
            return B * H * (2 * N * N * (D + Dv) + gate)
        return B * H * (2 * self._blocks_read(N, causal) * self.block * (D + Dv) + gate)

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        """Mean keys a query attends to: causal, min(top_k - 1, blocks before its own) b plus
        its own block's keys up to it; non-causal min(top_k, nb) b, capped at N (at most
        that when b does not divide N: the partial block may or may not be chosen)."""
        b, kk = self.block, min(self.params.top_k, block_count(N, self.block))
        if not causal:
            return float(min(kk * b, N))
        i = torch.arange(N, dtype=torch.float64)
        own = torch.div(i, b, rounding_mode="floor")
        return float((torch.clamp(own, max=kk - 1) * b + (i - own * b) + 1).mean())

    def state_size(self, N, D):
        return 2 * N * D  # any past block may be chosen: the whole cache is kept

    def state_size_at(self, N, s):
        return s.Hk * N * (s.D + s.Dv)  # one cache per kv head


def _grouped_dense(q, k, v, allowed):
    """The dense form on grouped keys: kv head kv's r = Hq / Hk query heads as r N rows
    against its keys (row x: query head kv r + x // N at position x % N), under the
    selection's mask (B, Hq, N, N); k and v are never repeated."""
    B, Hq, N, D = q.shape
    Hk = k.shape[1]
    s = (q.reshape(B, Hk, Hq // Hk * N, D) * softmax_scale(D)) @ k.transpose(-1, -2)
    s.masked_fill_(~allowed.reshape(B, Hk, -1, N), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).view(B, Hq, N, v.shape[-1])

