"""Error of a variant's output against exact softmax attention in float64.

rel_err = ||o - o_ref||_F / ||o_ref||_F and max_abs_err = max |o - o_ref| over the rows
compared. o_ref is `variants.exact_reference` (float64, query-chunked, same causal flag)
on the same q, k, v. For N > max_rows the error is taken on a random sample of max_rows
query rows drawn from `seed` (torch.randperm), sorted; the number compared is `err_rows`.
"""

from __future__ import annotations

import dataclasses

import torch

import variants


@dataclasses.dataclass(frozen=True)
class Error:
    rel_err: float
    max_abs_err: float
    err_rows: int  # query rows compared (N when all)


def sample_rows(N: int, max_rows: int, seed: int) -> torch.Tensor | None:
    """Sorted indices of max_rows query rows drawn from seed, or None for all N rows."""
    if N <= max_rows:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(N, generator=g)[:max_rows].sort().values


def error(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          *, max_rows: int = 1024, seed: int = 0) -> Error:
    """Error of o (B, H, N, D) against float64 exact attention on q, k, v."""
    N = q.shape[-2]
    rows = sample_rows(N, max_rows, seed)
    ref = variants.exact_reference(q.detach(), k.detach(), v.detach(), causal, rows=rows)
    got = (o if rows is None else o[:, :, rows.to(o.device)]).detach().double()  # (B, H, R, D)
    diff = got - ref
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
    return Error(rel, float(diff.abs().max()), N if rows is None else len(rows))
