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

Computation in steps (`BlockSparse._plan`): each query block row i gathers exactly its
layout row's key and value blocks (K_i of them; causal: those with j <= i, so the blocks
the causal mask empties are never computed; a global row: all of them, as a view, not a
copy); rows of equal K_i are taken together, a few at a time, so that one batched matmul
computes a step's scores (B, H, R, b, K_i b), cache-sized, then softmax and the value
matmul. Time and memory are proportional to the layout's nonzero blocks, forward and
backward; never an N x N matrix.

The steps run in `block_rows.py`, forward and a recomputing backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..core import (Contract, CacheDecoder, Grouping, KVCache, KeyMask, Variant, attend_row,
                    param, register)
from .block_rows import block_rows_attention

# Plans a module keeps (per length, causal, device and B H); a causal plan holds ~N * 8
# blocks of mask bytes.
_CACHED_PLANS = 4
# Bytes of one plan step's (B, H, R, b, K b) scores: cache-sized, and large enough that
# one batched matmul amortises a step's dozen dispatches.
_STEP_BYTES = 2 * 2**20
# At most this many rows a step: by then the dozen dispatches of a step are amortised.
_STEP_ROWS = 16


@dataclasses.dataclass(frozen=True)
class BlockSparseParams:
    block_size: int = param(64, doc="tokens per block", min=1)
    window_blocks: int = param(1, doc="blocks on each side of the diagonal block", min=0)
    global_blocks: int = param(2, doc="leading blocks that attend and are attended by all",
                               min=0)
    random_blocks: int = param(3, doc="seeded random key blocks per non-global block row",
                               min=0)
    seed: int = param(0, doc="seed of the random blocks", min=0)


@functools.lru_cache(maxsize=16)
def bigbird_layout(nb: int, window_blocks: int, global_blocks: int, random_blocks: int,
                   seed: int) -> torch.Tensor:
    """The non-causal bool [nb, nb] BigBird block layout (CPU); read-only: it is cached,
    since modules of one setting (a plan's cases, the library kernels' SameLayout) share it."""
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


def in_layout(layout: torch.Tensor, block_size: int, i: torch.Tensor,
              j: torch.Tensor) -> torch.Tensor:
    """Whether query i may attend key j under a block layout, elementwise over broadcast
    index tensors: layout[i // block_size, j // block_size]."""
    return layout[i // block_size, j // block_size]


@register
class BlockSparse(CacheDecoder, Variant):
    """Exact softmax attention restricted to a BigBird block layout (window + global + random)."""
    name = "block_sparse"
    family = "sparse"
    # Grouped keys run natively: the layout is every head's, so a kv head's r query heads
    # are the r b rows of each of its query blocks (block_rows.py), and the decoder keeps
    # one cache per kv head, read by `attend_row`; values may have their own width.
    contract = Contract(exactness="pattern", decoding=True, extend=True,
                        grouping=Grouping("kv", "native", value_dim=True))
    Params = BlockSparseParams
    paper = "https://arxiv.org/abs/2007.14062"
    budget_param = "random_blocks"  # the window and global blocks kept, the random ones set

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
            return in_layout(lay.to(i.device), b, i[:, None], j[None, :])  # (c, n)
        return allowed

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        """True when the layout holds every block (causal: every block on or below the
        diagonal): at N = 512 a block size of 128 is 4 x 4 blocks, all of them in it."""
        p = self.params
        nb = math.ceil(seq_len / p.block_size)
        most = nb * (2 * p.window_blocks + 1 + 2 * p.global_blocks + p.random_blocks)
        if most < (nb * (nb + 1) // 2 if causal else nb * nb):  # too few blocks to cover
            return False
        lay = self._layout(seq_len)
        return bool(lay.tril().eq(torch.ones_like(lay).tril()).all() if causal else lay.all())

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        """Mean keys a query sees: the keys of its row's blocks (a partial last block's
        actual keys); causal, those at or before it."""
        if N == 0:
            return 0.0
        lay, b = self._layout(N).double(), self.params.block_size
        nb = lay.shape[0]
        size = torch.full((nb,), float(b), dtype=torch.float64)
        size[-1] = N - (nb - 1) * b  # keys (and queries) in each block
        if not causal:
            return float((lay @ size * size).sum() / N)
        # a query at offset a of its block sees the earlier blocks and a + 1 keys of its own
        before = (lay.tril(-1) @ size * size).sum()
        own = (lay.diagonal() * size * (size + 1) / 2).sum()
        return float((before + own) / N)

    def state_size(self, N, D):
        return 2 * N * D  # random and global blocks reach any past key: the whole cache

    def state_size_at(self, N, s):
        return s.Hk * N * (s.D + s.Dv)  # one cache per kv head

    def decode_read_size(self, N, D):
        """A step reads the keys and values of its row block's layout: the mean over row
        blocks of their key blocks, b tokens each."""
        return int(2 * self._keys_read(N) * D)

    def decode_read_size_at(self, N, s):
        """Per kv head, once for its r query heads (one layout for all): the keys (Dk) and
        values (Dv) of the row block's layout."""
        return s.Hk * int(self._keys_read(N) * (s.D + s.Dv))

    def _keys_read(self, N) -> float:
        per_row = float(self._layout(N).sum(dim=1, dtype=torch.float64).mean())
        return min(per_row * self.params.block_size, N)

    def decode_flops_at(self, N, s):
        """Softmax over the keys `decode_read_size` counts: a row block's layout blocks,
        the mean over row blocks."""
        per_row = float(self._layout(N).sum(dim=1, dtype=torch.float64).mean())
        return self.softmax_step_flops(min(per_row * self.params.block_size, N), s)

    def decode_prefill(self, k, v, max_len):
        # The layout is the one of the whole sequence's length (its random blocks are
        # drawn for it); the new row attends to its row block's key blocks, j <= i.
        state = KVCache.prefill(k, v, max_len)
        # Not state: the layout (the module's, for this length) and each row block's keys.
        state.layout, state.keys_of = self._layout(max_len).to(k.device), {}
        return state

    def decode_step(self, state, q, k, v):
        i = state.n
        state.append(k, v)
        b = self.params.block_size
        r = i // b
        if r not in state.keys_of:  # the keys of the row block's layout, in order
            blocks = state.layout[r].nonzero().flatten()  # (nnz,)
            idx = (blocks[:, None] * b + torch.arange(b, device=k.device)).flatten()
            state.keys_of[r] = idx[idx < state.k.shape[-2]]
        idx = state.keys_of[r]
        idx = idx[: int(torch.searchsorted(idx, i, right=True))]  # j <= i
        # q (B, Hq, 1, D) over the cache's Hk heads: query head h reads kv head h // r.
        return attend_row(q, state.k[:, :, idx], state.v[:, :, idx]), state

    def flops(self, B, H, N, D, causal=False):
        """4 b^2 D per nonzero block of the layout (causal: blocks with j <= i) and query
        head (`flops_at`: 2 b^2 (Dk + Dv) where values have their own width).

        Counted at block granularity, as computed: padded keys and the masked upper half
        of diagonal blocks are included.
        """
        if N == 0:
            return 0
        lay = self._layout(N)
        nnz = int(lay.tril().sum() if causal else lay.sum())
        b = self.params.block_size
        return 4 * B * H * nnz * b * b * D

    def _plan(self, N: int, causal: bool, device: torch.device, BH: int,
              element_size: int) -> list[tuple]:
        """The layout's query block rows in steps, each one batched matmul over R rows of
        equal width (K key blocks): a list of (rows, cols, K, drop).

        rows: the step's R query blocks, a slice when consecutive, else a long tensor; cols:
        their key-block columns, a long tensor (R K,) row after row, or a slice (0, K) for a
        row of all of them (a global row; causal: a row of every block up to it), which
        serves as a view, not a copy; drop: None or (a, mask), the bool mask over the
        step's score columns a.. (b, K b - a) or (R, b, K b - a), of padded keys (token
        >= N) and, causal, keys after the query: a row's columns ascend, so both are in
        its last block, and only that tail is masked. Rows are taken in order of width,
        R <= _STEP_ROWS of them at a time so that a step's (B, H, R, b, K b) scores stay
        near _STEP_BYTES; the causal mask empties every block above the diagonal, and
        those are never in a row's columns.
        """
        b = self.params.block_size
        R_bytes = BH * b * b * element_size  # one row's scores per key block
        key = (N, causal, device, R_bytes)
        if key not in self._plans:
            lay = self._layout(N)
            nb = lay.shape[0]
            rows = [(lay[i, :i + 1] if causal else lay[i]).nonzero().flatten() for i in range(nb)]
            full = [bool((c == torch.arange(len(c))).all()) for c in rows]
            order = sorted(range(nb), key=lambda i: (full[i], len(rows[i]), i))
            plan, at = [], 0
            while at < nb:
                i0 = order[at]
                K = len(rows[i0])
                R = 1 if full[i0] else min(_STEP_ROWS, max(1, _STEP_BYTES // (R_bytes * K)))
                step = [i0]
                while (len(step) < R and at + len(step) < nb
                       and not full[order[at + len(step)]]
                       and len(rows[order[at + len(step)]]) == K):
                    step.append(order[at + len(step)])
                at += len(step)
                plan.append(_step(step, rows, K, full[i0], b, N, causal, device))
            if len(self._plans) >= _CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return self._plans[key]

    def attend(self, q, k, v, causal):
        B, H, N, D = q.shape
        if N == 0:
            return q.clone()
        plan = self._plan(N, causal, q.device, B * H, q.element_size())
        return block_rows_attention(q, k, v, self.params.block_size, plan)[:, :, :N]


def _step(step: list[int], rows: list[torch.Tensor], K: int, full: bool, b: int, N: int,
          causal: bool, device: torch.device) -> tuple:
    """One plan step (rows, cols, K, drop) of query blocks `step`, each of K key blocks."""
    R = len(step)
    consecutive = step == list(range(step[0], step[0] + R))
    sel = slice(step[0], step[0] + R) if consecutive else torch.tensor(step, device=device)
    cols = torch.cat([rows[i] for i in step])  # (R K,)
    tok = (cols.view(R, K, 1) * b + torch.arange(b)).view(R, 1, K * b)  # key tokens
    drop = (tok >= N).expand(R, b, K * b)
    if causal:
        qtok = (torch.tensor(step)[:, None] * b + torch.arange(b)).view(R, b, 1)
        drop = drop | (tok > qtok)
    if not bool(drop.any()):
        return sel, slice(0, K) if full else cols.to(device), K, None
    a = int(drop.any(dim=1).any(dim=0).nonzero()[0])  # the first column with a masked key
    drop = drop[:, :, a:]
    if bool((drop == drop[:1]).all()):
        drop = drop[:1]  # the same for every row of the step
    drop = (a, drop.contiguous().to(device))
    return sel, slice(0, K) if full else cols.to(device), K, drop


class SameLayout:
    """Mixin of another library's implementation of BigBird block sparsity: block_sparse's
    parameters, and the layout of a BlockSparse built from them (drawn and cached once)
    as its key_mask. List it before the implementation's base class."""
    family = "sparse"
    Params = BlockSparseParams
    contract = Contract(exactness="pattern")

    def __init__(self, params=None):
        super().__init__(params)
        self._pattern = BlockSparse(self.params)

    def key_mask(self, seq_len: int) -> KeyMask:
        return self._pattern.key_mask(seq_len)

    def state_size(self, N, D):
        return self._pattern.state_size(N, D)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return self._pattern.exact_at(seq_len, causal)

    def keys_per_query(self, N: int, causal: bool = False) -> float:
        return self._pattern.keys_per_query(N, causal)
