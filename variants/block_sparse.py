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

Computation, one query block row at a time (each step stays cache-sized): block row i
gathers exactly its layout row's key and value blocks (K_i of them; causal: those with
j <= i; a global row: all of them, as a view, not a copy) and computes scores
(B, H, b, K_i b), softmax and the value matmul. Time and memory are proportional to the
layout's nonzero blocks, forward and backward; never an N x N matrix.

Backward (`_BlockRows`, FlashAttention's recomputation: Dao et al. 2022,
https://arxiv.org/abs/2205.14135, Algorithm 4 without tiling): the forward saves only q,
k, v, the output and one log-sum-exp per query; the backward recomputes each row's
scores, P = exp(S - lse), and forms dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
dQ = dS K, dK = dS^T Q, adding into the key blocks' gradients. Plain autograd would keep
every row's gathered keys, values and probabilities: the forward+backward peak at
N = 8192, H = 8, D = 64 read 504 MiB that way and 176 MiB this way (`python run_bench.py
run --preset scaling`, results/scaling-h8-v3 against the same preset at commit 6b3ab61).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from .base import KeyMask, Variant, param, softmax_logsumexp, softmax_scale
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

    def state_size(self, N, D):
        return 2 * N * D  # random and global blocks reach any past key: the whole cache

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
        """Per query block i: (cols, span, drop). cols: its key-block columns (a long tensor
        on `device`); span: (0, c) when cols is 0..c-1 (a view serves), else None; drop: a
        bool mask over the row's concatenated keys (1 or b, K_i b) of padded keys
        (token >= N) and, causal, keys after the query, or None.
        """
        key = (N, causal, device)
        if key not in self._plans:
            b = self.params.block_size
            lay = self._layout(N)
            plan = []
            for i in range(lay.shape[0]):
                row = lay[i, :i + 1] if causal else lay[i]
                cols = row.nonzero().flatten()
                span = (0, len(cols)) if bool((cols == torch.arange(len(cols))).all()) else None
                tok = (cols[:, None] * b + torch.arange(b)).flatten()  # (K_i b,)
                drop = tok[None, :] >= N  # (1, K_i b)
                if causal:
                    drop = drop | (tok[None, :] > (i * b + torch.arange(b))[:, None])  # (b, K_i b)
                plan.append((cols.to(device), span, drop.to(device) if bool(drop.any()) else None))
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
        pad = nb * b - N
        q = q * softmax_scale(D)  # on q (N D products), not on the scores
        # Block views (B, H, nb, b, D); zero-padded keys are masked by the plan.
        qp, kp, vp = (F.pad(t, (0, 0, 0, pad)).view(B, H, nb, b, D) for t in (q, k, v))
        out = _BlockRows.apply(qp, kp, vp, self._plan(N, causal, q.device))
        return out[:, :, :N]  # (B, H, N, D)


class SameLayout:
    """Mixin of another library's implementation of BigBird block sparsity: block_sparse's
    parameters, and the layout of a BlockSparse built from them (drawn and cached once)
    as its key_mask. List it before the implementation's base class."""
    family = "sparse"
    Params = BlockSparseParams

    def __init__(self, params=None):
        super().__init__(params)
        self._pattern = BlockSparse(self.params)

    def key_mask(self, seq_len: int) -> KeyMask:
        return self._pattern.key_mask(seq_len)

    def exact_at(self, seq_len: int, causal: bool = False) -> bool:
        return self._pattern.exact_at(seq_len, causal)


def _gather(xp: torch.Tensor, cols: torch.Tensor, span) -> torch.Tensor:
    """(B, H, nb, b, D) blocks -> the row's key blocks concatenated, (B, H, K b, D)."""
    B, H, _, b, D = xp.shape
    part = xp[:, :, span[0]:span[1]] if span is not None else xp.index_select(2, cols)
    return part.reshape(B, H, -1, D)


class _BlockRows(torch.autograd.Function):
    """Exact softmax attention of each query block over its plan's key blocks.

    q, k, v: (B, H, nb, b, D) padded block views, q already scaled; returns (B, H, nb b, D).
    """

    @staticmethod
    def forward(ctx, qp, kp, vp, plan):
        B, H, nb, b, D = qp.shape
        out = qp.new_empty(B, H, nb, b, D)
        keep = any(ctx.needs_input_grad)  # else nothing is saved: no log-sum-exp needed
        if keep:
            # float32 at least: a bfloat16 lse would shift every recomputed probability.
            lse = qp.new_empty(B, H, nb, b, 1, dtype=torch.promote_types(qp.dtype, torch.float32))
        for i, (cols, span, drop) in enumerate(plan):
            s = qp[:, :, i] @ _gather(kp, cols, span).transpose(-1, -2)  # (B, H, b, K b)
            if drop is not None:
                s.masked_fill_(drop, float("-inf"))
            if keep:
                p, lse[:, :, i] = softmax_logsumexp(s)
            else:
                p = torch.softmax(s, dim=-1)
            out[:, :, i] = p @ _gather(vp, cols, span)
        if keep:
            ctx.plan = plan
            ctx.save_for_backward(qp, kp, vp, out, lse)
        return out.view(B, H, nb * b, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qp, kp, vp, out, lse = ctx.saved_tensors
        B, H, nb, b, D = qp.shape
        dout = dout.reshape(B, H, nb, b, D)
        delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, H, nb, b, 1): rowsum(dO * O)
        dq = torch.empty_like(qp)
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
        for i, (cols, span, drop) in enumerate(ctx.plan):
            qi, do = qp[:, :, i], dout[:, :, i]  # (B, H, b, D)
            kr, vr = _gather(kp, cols, span), _gather(vp, cols, span)  # (B, H, K b, D)
            s = qi @ kr.transpose(-1, -2)  # (B, H, b, K b)
            if drop is not None:
                s.masked_fill_(drop, float("-inf"))
            p = s.sub_(lse[:, :, i]).exp_()  # the forward's probabilities
            dvr = p.transpose(-1, -2) @ do  # (B, H, K b, D)
            ds = (do @ vr.transpose(-1, -2)).sub_(delta[:, :, i]).mul_(p)
            torch.matmul(ds, kr, out=dq[:, :, i])
            dkr = ds.transpose(-1, -2) @ qi  # (B, H, K b, D)
            if span is not None:
                dk[:, :, span[0]:span[1]] += dkr.view(B, H, -1, b, D)
                dv[:, :, span[0]:span[1]] += dvr.view(B, H, -1, b, D)
            else:
                dk.index_add_(2, cols, dkr.view(B, H, -1, b, D))
                dv.index_add_(2, cols, dvr.view(B, H, -1, b, D))
        return dq, dk, dv, None
