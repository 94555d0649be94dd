"""Numerical building blocks the families' kernels share: in-place exp and softmax, the
log-sum-exp, the accumulation dtype, and a per-call buffer workspace. No autograd here."""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernel sums accumulate in: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_logsumexp(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(s), logsumexp(s, keepdim)) over the last dim, with one exp pass (no autograd).

    p_j = exp(s_j - lse) for every j, so lse = max(s) - log(max(p)): at the largest s_j,
    p_j >= 1 / n, far from underflow. Two max reductions instead of torch.logsumexp's
    second exp pass. Rows need one finite entry.
    """
    p = torch.softmax(s, dim=-1)
    return p, s.amax(dim=-1, keepdim=True).sub_(p.amax(dim=-1, keepdim=True).log_())


_LOG2E = 1.4426950408889634  # 1 / ln 2


def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) written over x (no autograd), as exp2(x log2 e); returns x.

    On this AMD EPYC torch.exp ran at under a third of the rate of exp2: 2^19 float32
    elements on two threads took 311 us in torch.exp, 85 us in exp2 and 144 us in this
    function with the copy that restores its input (medians, `python -m pytest
    tests/benchmarks/test_kernels.py --benchmark-only -k exp`). Its time did not move
    under any ATEN_CPU_CAPABILITY, so it is not aten's vectorised path; this build hands
    exp to MKL's vector math library. Rounding log2 e and x log2 e adds a relative
    error of at most |x| eps to the result (eps = 2^-23 in float32): 1e-6 at x = -8,
    where exp(x) is 3e-4, so a few units in the last place wherever a probability is
    not negligible against 1.
    """
    return x.mul_(_LOG2E).exp2_()


def softmax_(s: torch.Tensor) -> torch.Tensor:
    """softmax(s) over the last dim, written over s (no autograd); returns s.

    On the CPU, aten's softmax reads each row's max and sum before writing that row, so
    its output may alias its input (tests/test_sparse_variants.py holds it to
    torch.softmax). Elsewhere that is not verified here: softmax into a new tensor, then
    copied over s.
    """
    if s.device.type == "cpu":
        return torch.ops.aten._softmax.out(s, -1, False, out=s)
    return s.copy_(torch.softmax(s, dim=-1))


def softmax_lse_(s: torch.Tensor) -> torch.Tensor:
    """softmax(s) over the last dim, written over s as `softmax_`; returns logsumexp(s)
    (keepdim) as `softmax_logsumexp` computes it: max(s) - log(max(p))."""
    mx = s.amax(dim=-1, keepdim=True)
    softmax_(s)
    return mx.sub_(s.amax(dim=-1, keepdim=True).log_())


class Workspace:
    """Flat buffers that every step of one call reuses, handed out as views to write with
    out= (gathers, scores, products), so that a call allocates each buffer once rather
    than once a step.

    A fresh multi-MiB tensor a step costs the allocator: glibc returns large freed blocks
    to the system, and the next step's block is faulted in page by page again. Causal
    block_sparse forward at N = 16384, H = 4, two threads, read 85 ms with fresh tensors
    a step and 59 ms with glibc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ and
    MALLOC_TRIM_THRESHOLD_ raised), the time compiled flex attention takes.
    """

    def __init__(self, like: torch.Tensor, dtype: torch.dtype | None = None):
        self._like, self._dtype = like, dtype or like.dtype
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        """A (shape) view of buffer `name`, grown (reallocated) when too small: ask for
        the largest shape first to allocate once."""
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self._bufs[name] = self._like.new_empty(n, dtype=self._dtype)
        return buf[:n].view(shape)
