"""BigBird block-sparse attention: exact softmax over a block layout, (B, H, N, D) in O(N).

Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences",
https://arxiv.org/abs/2007.14062 (Sec. 2, in its blocked form, BigBird-ITC: existing
tokens made global, no extra tokens). With nb = ceil(N / block_size) blocks, block row i
attends block column j iff

    |i - j| <= window_blocks           (sliding window of blocks)
    or j < global_blocks or i < global_blocks   (global blocks, both directions)
    or j is one of `random_blocks` random columns of row i,

the random columns drawn, for each non-global row, among the columns not already in its
window or global part, from `seed` (a torch.Generator; deterministic in seed and N) when
the module first sees a length, then cached. Causal: that layout AND j <= i, at token
level (blocks above the diagonal contribute nothing; the diagonal block is masked inside).

N not a multiple of block_size: q, k, v are zero-padded to nb * block_size; padded keys
are masked out of every softmax (no key is dropped) and padded query rows are discarded.

Computation: the global query rows (global_blocks * block_size queries) attend all N keys
densely: O(N). Every other query block r concatenates exactly its layout row's key blocks
(K_r of them; causal: those with j <= r) and computes scores (B, H, b, K_r b), softmax and
the value matmul, one block row at a time so each step stays cache-sized. Time and memory,
forward and (plain autograd) backward, are proportional to the layout's nonzero blocks;
never an N x N matrix.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .base import KeyMask, Variant, param, softmax_scale
from .registry import register

# (length, causal, device) plans a module keeps; a causal plan holds ~N * 8 blocks of
# mask bytes.
_CACHED_PLANS = 4


@dataclasses.dataclass(frozen=True)
class BlockSparseParams:
    block_size: int = param(64, doc="tokens per block", min=1)
    window_blocks: int = param(1, doc="blocks on each side of the diagonal block", min=0)
    global_blocks: int = param(2, doc="leading blocks that attend and are attended by all",
                               min=0)
    random_blocks: int = param(3, doc="seeded random key blocks per non-global block row",
                               min=0)
    seed: int = param(0, doc="seed of the random blocks", min=0)


def bigbird_layout(nb: int, window_blocks: int, global_blocks: int, random_blocks: int,
                   seed: int) -> torch.Tensor:
    """The non-causal bool [nb, nb] BigBird block layout (CPU)."""
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    fixed = ((i - j).abs() <= window_blocks) | (j < global_blocks) | (i < global_blocks)
    gen = torch.Generator().manual_seed(seed)
    # Random columns: the r largest of uniform draws over the columns not yet attended;
    # ineligible columns get -1 so they lose to every draw in [0, 1).
    draws = torch.rand(nb, nb, generator=gen).masked_fill(fixed, -1.0)
    top = draws.topk(min(random_blocks, nb), dim=1)  # (nb, r)
    rand = torch.zeros(nb, nb, dtype=torch.bool)
    rand.scatter_(1, top.indices, top.values >= 0)
    return fixed | rand


@register
class BlockSparse(Variant):
    """Exact softmax attention restricted to a BigBird block layout (window + global + random)."""
    name = "block_sparse"
    family = "sparse"
    Params = BlockSparseParams
    paper = "https://arxiv.org/abs/2007.14062"

    def __init__(self, params=None):
        super().__init__(params)
        self._layouts: dict[int, torch.Tensor] = {}
        self._plans: dict[tuple, list[tuple]] = {}

    def layout(self, N: int) -> torch.Tensor:
        """The non-causal bool [ceil(N / block_size), ceil(N / block_size)] block mask."""
        return self._layout(N).clone()

    def _layout(self, N: int) -> torch.Tensor:
        # Drawn once per length and cached, so the timed call never draws.
        if N not in self._layouts:
            p = self.params
            self._layouts[N] = bigbird_layout(math.ceil(N / p.block_size), p.window_blocks,
                                              p.global_blocks, p.random_blocks, p.seed)
        return self._layouts[N]

    def key_mask(self, seq_len: int) -> KeyMask:
        lay = self._layout(seq_len)
        b = self.params.block_size

        def allowed(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            blocks = lay.to(i.device)
            return blocks[(i // b)[:, None], (j // b)[None, :]]  # (c, n)
        return allowed

    def flops(self, B, H, N, D, causal=False):
        """4 b^2 D per nonzero block of the layout (causal: blocks with j <= i) and head.

        Counted at block granularity, as computed: padded keys and the masked upper half
        of diagonal blocks are included.
        """
        if N == 0:
            return 0
        lay = self._layout(N)
        nnz = int(lay.tril().sum() if causal else lay.sum())
        b = self.params.block_size
        return 4 * B * H * nnz * b * b * D

    def _plan(self, N: int, causal: bool, device: torch.device) -> list[tuple]:
        """Per non-global query block: (its key-block columns, drop mask or None).

        The drop mask covers the row's concatenated keys (1 or b, K_r b): padded keys
        (token >= N) and, causal, keys after the query in the diagonal block.
        """
        key = (N, causal, device)
        if key not in self._plans:
            b = self.params.block_size
            lay = self._layout(N)
            nb = lay.shape[0]
            g = min(self.params.global_blocks, nb)
            plan = []
            for i in range(g, nb):
                row = lay[i, :i + 1] if causal else lay[i]
                cols = row.nonzero().flatten().tolist()
                tok = (torch.tensor(cols)[:, None] * b + torch.arange(b)).flatten()  # (K_r b,)
                drop = tok[None, :] >= N  # (1, K_r b)
                if causal:
                    drop = drop | (tok[None, :] > (i * b + torch.arange(b))[:, None])  # (b, K_r b)
                plan.append((cols, drop.to(device) if bool(drop.any()) else None))
            if len(self._plans) >= _CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return self._plans[key]

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        if N == 0:
            return q.clone()
        b = self.params.block_size
        nb = math.ceil(N / b)
        g = min(self.params.global_blocks, nb)
        q = q * softmax_scale(D)  # on q (N D products), not on the scores
        parts = []

        ng = min(g * b, N)
        if ng > 0:
            # Global query rows see every key (causal: keys j <= i < ng): dense, O(N).
            nk = ng if causal else N
            s = q[:, :, :ng] @ k[:, :, :nk].transpose(-1, -2)  # (B, H, ng, nk)
            if causal:
                ar = torch.arange(ng, device=q.device)
                s = s.masked_fill(ar[None, :] > ar[:, None], float("-inf"))
            parts.append(torch.softmax(s, dim=-1) @ v[:, :, :nk])  # (B, H, ng, D)

        if nb > g:
            pad = nb * b - N
            # Block views; `unbind`'s backward is one stack, so reusing a block in many
            # rows costs one small gradient accumulation each, never a full-size zero.
            qb = F.pad(q, (0, 0, 0, pad)).view(B, H, nb, b, D).unbind(2)  # nb x (B, H, b, D)
            kb = F.pad(k, (0, 0, 0, pad)).view(B, H, nb, b, D).unbind(2)
            vb = F.pad(v, (0, 0, 0, pad)).view(B, H, nb, b, D).unbind(2)
            for i, (cols, drop) in enumerate(self._plan(N, causal, q.device), start=g):
                kr = torch.cat([kb[j] for j in cols], dim=2)  # (B, H, K_r b, D)
                vr = torch.cat([vb[j] for j in cols], dim=2)
                s = qb[i] @ kr.transpose(-1, -2)  # (B, H, b, K_r b)
                if drop is not None:
                    s = s.masked_fill_(drop, float("-inf"))  # matmul saves its inputs, not s
                parts.append(torch.softmax(s, dim=-1) @ vr)  # (B, H, b, D)
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # (B, H, >= N, D)
        return out[:, :, :N]
