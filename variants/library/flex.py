"""FlexAttention implementations of sliding-window and BigBird block-sparse attention.

`torch.nn.attention.flex_attention` (Dong et al. 2024, "Flex Attention: A Programming
Model for Generating Optimized Attention Kernels", https://arxiv.org/abs/2412.05496;
PyTorch docs, torch.nn.attention.flex_attention) computes exact softmax attention under a
`mask_mod(b, h, q_idx, kv_idx) -> bool` and a `BlockMask`, the block-level sparsity it
skips by: per query block, the key blocks that are partly allowed (the kernel applies
mask_mod there) and those wholly allowed (no mask_mod). It runs fused only under
torch.compile; uncompiled, it materialises the N x N scores, so these variants always
call the compiled function, and compile in `prepare` (before timing; `compile_ms`).

The patterns are ours, not re-derived. Sliding window: the mask_mod is `in_band`, the
elementwise predicate `band_mask` (the variant's key_mask) is built from. Block sparse:
the BlockMask's blocks are `block_sparse`'s `layout(N)` at its block size, so inside a
touched block every pair is in the pattern and the mask_mod only adds causality. Both
BlockMasks are built at block granularity (an [nb, nb] table, never N x N: the
library's `create_block_mask` evaluates mask_mod on all N^2 pairs), then
`BlockMask.from_kv_blocks`.

Compiled with dynamic shapes: in one process, the first case of a (dtype, pattern,
pass, heads, head dim) compiles for seconds and later lengths reuse that kernel (a
length under two blocks, or batch 1, gets its own: dynamo specialises sizes 0 and 1);
the window and the causal flag are tensors, so another window or causal reuses it too.
`prepare` compiles by running the case's pass once (`prepare_calls = 1`), so the
harness's `compile_ms` is prepare's time less one steady-state call: the compile, for
the first case of a kernel in a worker process, and building the BlockMask once the
kernel exists. Measured (CPU, H = 4, D = 64, `attnbench run --preset cpu
--variants sliding_window_flex --seq-lens 4096,8192 --pass forward --inputs gaussian
--causal false`): 8,464 ms at N = 4096 (the compile), 20 ms at N = 8192; without the
subtraction the N = 8192 figure read 54 ms beside a time_ms of 63 ms, about one call.
Inductor's on-disk cache, shared by processes, shortens compiles it has seen before. Inductor's CPU kernels need a C++ compiler, and
on CPU flex_attention has no backward pass: both are declared reasons.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil

import torch

from ..core import Contract, Variant, register
from ..sliding_window import SameBand, in_band
from ..sparse import SameLayout

PAPER = "https://arxiv.org/abs/2412.05496"
# Block size of the sliding-window BlockMask: flex_attention's default tile.
_WINDOW_BLOCK = 128
# (length, causal, device) block masks a module keeps.
_CACHED_MASKS = 4
# Graphs one compiled flex_attention may hold (dtype x pattern x pass x shapes).
# Past the limit dynamo would run flex_attention eagerly (N x N); failing is better.
_RECOMPILE_LIMIT = 64


def cpu_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU kernels (its config, or $CXX), if found."""
    from torch._inductor import config  # imported here: inductor is heavy

    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    names += [c for c in config.cpp.cxx if c]
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


@functools.cache
def _compiled_flex():
    """torch.compile(flex_attention), made once per process on first use (not at import)."""
    from torch.nn.attention.flex_attention import flex_attention

    # Dynamic shapes from the first call (with an int window, dynamic=True failed to
    # lower on CPU with torch 2.13: "'Mul' object has no attribute 'get_name'"; the
    # window is a tensor for that reason too).
    return torch.compile(flex_attention, dynamic=True)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [nq, nk] -> (int32 [1, 1, nq] counts, int32 [1, 1, nq, nk] column indices, set
    columns first), the kv_num_blocks / kv_indices form of BlockMask.from_kv_blocks."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    cols = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None].contiguous(), cols.to(torch.int32)[None, None].contiguous()


def block_mask(touched: torch.Tensor, full: torch.Tensor, block: int, N: int,
               allows, causal: bool, device: torch.device):
    """A BlockMask from block tables: `touched` [nb, nb] blocks holding any allowed pair,
    `full` those where every pair is allowed (mask_mod is skipped there); mask_mod is
    allows(q_idx, kv_idx) (the pattern's elementwise predicate; AND kv <= q when causal),
    evaluated by the kernel on the partial blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    partial = touched & ~full

    # A tensor flag, not a Python bool: causal and non-causal cases share one kernel.
    causal_t = torch.tensor(causal, device=device)

    def mask_mod(b, h, q_idx, kv_idx):  # scalar index tensors
        # allows None: the block tables are the whole pattern.
        keep = kv_idx >= 0 if allows is None else allows(q_idx, kv_idx)
        return keep & ((kv_idx <= q_idx) | ~causal_t)

    num, idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    bm = BlockMask.from_kv_blocks(num.to(device), idx.to(device), full_num.to(device),
                                  full_idx.to(device), BLOCK_SIZE=block, mask_mod=mask_mod,
                                  seq_lengths=(N, N))
    # Block counts vary with N like q, k, v do: one dynamic-shape kernel for every length,
    # instead of a length-specialised one then a recompile (dynamo guards the sizes of
    # tensors held in an object unless told they are dynamic).
    for t in bm.as_tuple()[2:]:
        if isinstance(t, torch.Tensor):
            for dim in range(2, t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
    return bm


def kernel_options(block: int, device: torch.device) -> dict | None:
    """Triton tile sizes that divide the BlockMask's block, on CUDA; None (the library's
    defaults) elsewhere or where the block is a multiple of 128.

    flex_attention's CUDA kernels tile the sequence in 128 (forward) and 64 or 128
    (backward) rows by default and refuse a BlockMask whose blocks those tiles do not
    divide ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N", seen on an
    H200 with block_sparse's 64-token blocks); smaller tiles that divide the block keep the
    layout as it is.
    """
    if device.type != "cuda" or block % 128 == 0:
        return None
    fwd, bwd = math.gcd(block, 64), math.gcd(block, 32)
    return {"BLOCK_M": fwd, "BLOCK_N": fwd, "BLOCK_M1": bwd, "BLOCK_N1": bwd,
            "BLOCK_M2": bwd, "BLOCK_N2": bwd}


class _Flex(Variant):
    paper = PAPER
    # Compiles in prepare, by running the case's pass once.
    contract = Contract(exactness="pattern", compiled=True, prepare_calls=1)

    def __init__(self, params=None):
        super().__init__(params)
        self._masks: dict[tuple, object] = {}

    def extra_reasons(self, device, dtype, causal, seq_len, head_dim, backward):
        if device.type == "meta":
            return ["flex_attention runs only compiled (torch.compile), and compiled "
                    "kernels do not run on the meta device"]
        reasons = []
        if device.type == "cpu":
            if backward:
                reasons.append("flex_attention has no backward pass on CPU "
                               "(its compiled CPU kernel is forward only)")
            if cpu_compiler() is None:
                reasons.append("flex_attention on CPU needs a C++ compiler for inductor's "
                               "kernels (g++ or $CXX); none found on PATH")
        elif device.type == "cuda" and importlib.util.find_spec("triton") is None:
            reasons.append("flex_attention on CUDA needs Triton (inductor's GPU kernels); "
                           "it is not installed")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"flex_attention variants take float32, bfloat16 or float16, "
                           f"not {dtype}")
        return reasons

    # -- the pattern at block granularity (subclasses) ------------------------------
    def _block(self) -> int:
        raise NotImplementedError

    def _blocks(self, N: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(touched, full) bool [nb, nb] block tables of the pattern at length N."""
        raise NotImplementedError

    def tables(self, N: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(touched, full) bool [nb, nb]: blocks with an allowed pair, blocks of allowed
        pairs only (the last block row and column are never full when N is ragged: their
        padding is masked)."""
        touched, full = self._blocks(N, causal)
        if N % self._block():
            full = full.clone()
            full[-1, :] = False
            full[:, -1] = False
        return touched, full

    def _block_mask(self, N: int, causal: bool, device: torch.device):
        key = (N, causal, device)
        if key not in self._masks:
            touched, full = self.tables(N, causal)
            if len(self._masks) >= _CACHED_MASKS:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = block_mask(touched, full, self._block(), N,
                                          self._allows(N, device), causal, device)
        return self._masks[key]

    def _allows(self, N: int, device: torch.device):
        """The pattern's elementwise predicate (q_idx, kv_idx) -> bool the kernel evaluates
        inside partial blocks (the one key_mask is built from), or None where the block
        tables are exactly the pattern."""
        raise NotImplementedError

    def flops(self, B, H, N, D, causal=False):
        """4 b^2 D per block the kernel visits (partial or full) and head: its work as done."""
        if N == 0:
            return 0
        touched, _ = self._blocks(N, causal)
        return 4 * B * H * int(touched.sum()) * self._block() ** 2 * D

    def prepare(self, q, k, v, causal, backward=False):
        """Build the BlockMask for q's length and compile flex_attention for this case."""
        if q.shape[-2] == 0:
            return False
        if backward:
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            self.attend(q, k, v, causal).sum().backward()
        else:
            with torch.no_grad():
                self.attend(q, k, v, causal)
        return True

    def attend(self, q, k, v, causal):
        N = q.shape[-2]
        if N == 0:
            return q.clone()
        bm = self._block_mask(N, causal, q.device)
        for t in (q, k, v):  # batch and length: one kernel for all (dynamo keeps H, D static)
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                        fail_on_recompile_limit_hit=True):
            return _compiled_flex()(q, k, v, block_mask=bm,
                                    kernel_options=kernel_options(self._block(), q.device))


@register
class SlidingWindowFlex(SameBand, _Flex):
    """Sliding-window attention |i - j| <= window by compiled FlexAttention (BlockMask)."""
    name = "sliding_window_flex"
    contract = _Flex.contract

    def _allows(self, N, device):
        # A tensor, not an int: dynamo would specialise the kernel on the int's value.
        w = torch.tensor(self.params.window, device=device)
        return lambda i, j: in_band(i, j, w)

    def _block(self) -> int:
        return _WINDOW_BLOCK

    def _blocks(self, N, causal):
        # Query block a, key block c: j - i over the pair spans (c - a) b +- (b - 1).
        b, w = _WINDOW_BLOCK, self.params.window
        nb = math.ceil(N / b)
        off = (torch.arange(nb)[None, :] - torch.arange(nb)[:, None]) * b  # (nb, nb)
        lo, hi = off - (b - 1), off + (b - 1)
        right = 0 if causal else w
        return (hi >= -w) & (lo <= right), (lo >= -w) & (hi <= right)


@register
class BlockSparseFlex(SameLayout, _Flex):
    """BigBird block-sparse attention (block_sparse's layout) by compiled FlexAttention."""
    name = "block_sparse_flex"
    contract = _Flex.contract

    def _allows(self, N, device):
        # BlockMask blocks are the layout's blocks (same block size), so inside a touched
        # block every pair is in the layout: only causality and padding remain, and flex
        # masks keys past N itself. (A mask_mod that looks the layout up, in_layout, hit
        # an inductor C++ compile error on CPU with torch 2.13.)
        return None

    def _block(self) -> int:
        return self.params.block_size

    def _blocks(self, N, causal):
        lay = self._pattern.layout(N)  # (nb, nb)
        if not causal:
            return lay, lay
        below = torch.ones_like(lay).tril()
        return lay & below, lay & below.tril(-1)
