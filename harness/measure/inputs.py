"""Named, seeded input distributions for q, k, v of shape (B, H, N, D).

- `gaussian`: q, k, v ~ N(0, 1). Scores q.k/sqrt(D) ~ N(0, 1): near-uniform attention,
  which flatters low-rank and kernel methods.
- `sharp`: as gaussian with q scaled by 4: scores ~ N(0, 16), low-entropy attention where
  each query picks out a few keys anywhere in the sequence.
- `local`: q and k share a smooth positional component (sinusoids with wavelengths of 8 to
  1024 tokens) plus noise, so each query attends mostly to keys near itself. The score of
  the shared component is 20 at distance 0; far keys see its residue of ~32 cosines at
  unrelated phases, so the scale is set high enough that their total weight stays small at
  long N (measured, D = 64: weight within 64 tokens 0.9999 at N = 4096, 0.9996 at 16384,
  0.9990 at 32768; at a scale of 12 it was 0.976, 0.884, 0.797).

- `retrieval`: content-sparse, non-local attention, as a retrieval head's. D // 4 code
  directions (the first channels); each query carries one code (alpha e_c), and each code
  sits on RETRIEVAL_KEYS keys at random positions (anywhere in the sequence), so a query
  strongly matches those few keys, at random distances, and no others. The rest of q and k
  is N(0, 1/4) noise in the other channels (none in the code channels), small enough that
  a block holding a planted key stands out in its mean key (q . mean: alpha^2 / b against
  noise of ~0.1 at b = 64) and in its page bound (Quest's min and max).

`attention_entropy` measures the mean entropy (nats) of the exact attention rows, for docs
and reports; `python -m harness.measure.inputs` prints it for each distribution.
"""

from __future__ import annotations

import math

import torch

DISTRIBUTIONS = ("gaussian", "sharp", "local", "retrieval")
LOCAL_SCALE = 20.0  # score of the shared positional component at distance 0
RETRIEVAL_ALPHA = 9.0  # code strength: a planted match scores alpha^2 / sqrt(D) (10.1 at D = 64)
RETRIEVAL_KEYS = 4  # keys each code is planted on


def make_inputs(dist: str, B: int, H: int, N: int, D: int, *, dtype=torch.float32,
                device="cpu", seed: int = 0, kv_heads: int | None = None,
                value_heads: int | None = None, value_dim: int | None = None):
    """q, k, v for distribution `dist`, drawn on CPU in float32 from `seed`, then cast.

    Heads and widths of their own: kv_heads keeps the first kv_heads of the keys and
    values (grouped keys); value_heads or value_dim draws the values again, (B, value_heads
    or kv_heads or H, N, value_dim or D), from the same generator after the rest. At the
    default the draw is the one it always was."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown input distribution {dist!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, N, D, generator=g).unbind(0)  # each (B, H, N, D)
    if dist == "sharp":
        q = q * 4.0
    elif dist == "local":
        pos = _positional(N, D)  # (N, D), rows of unit norm
        # scores ~ LOCAL_SCALE * cos-similarity of positions: a peak a few tokens wide.
        q = 0.5 * q + math.sqrt(LOCAL_SCALE * math.sqrt(D)) * pos
        k = 0.5 * k + math.sqrt(LOCAL_SCALE * math.sqrt(D)) * pos
    elif dist == "retrieval":
        q, k = _retrieval(q, k, g)
    if kv_heads not in (None, H):
        k, v = k[:, :kv_heads], v[:, :kv_heads]
    if value_heads not in (None, H) or value_dim not in (None, D):
        v = torch.randn(B, value_heads or v.shape[1], N, value_dim or D, generator=g)
    return tuple(t.to(dtype=dtype, device=device).contiguous() for t in (q, k, v))


def _retrieval(q: torch.Tensor, k: torch.Tensor, g: torch.Generator):
    """q, k of `retrieval` from N(0, 1) draws: noise / 2 outside the code channels, each
    query one code, each code on RETRIEVAL_KEYS random keys (per batch and head)."""
    B, H, N, D = q.shape
    C = max(1, D // 4)
    q, k = q * 0.5, k * 0.5
    q[..., :C] = 0
    k[..., :C] = 0
    code = torch.randint(C, (B, H, N), generator=g)
    q[..., :C] = RETRIEVAL_ALPHA * torch.nn.functional.one_hot(code, C).to(q.dtype)
    pos = torch.randint(N, (B, H, C * RETRIEVAL_KEYS), generator=g)  # where each code sits
    b, h = torch.meshgrid(torch.arange(B), torch.arange(H), indexing="ij")
    which = torch.arange(C).repeat_interleave(RETRIEVAL_KEYS).expand(B, H, -1)
    k.index_put_((b[..., None].expand_as(pos), h[..., None].expand_as(pos), pos, which),
                 torch.tensor(RETRIEVAL_ALPHA), accumulate=True)
    return q, k


def _positional(N: int, D: int) -> torch.Tensor:
    """Unit-norm sinusoidal features (N, D) with wavelengths from 8 to 1024 tokens."""
    half = D // 2
    wavelengths = torch.logspace(math.log10(8), math.log10(1024), half)
    angles = torch.arange(N, dtype=torch.float32)[:, None] * (2 * math.pi / wavelengths)
    pos = torch.zeros(N, D)
    pos[:, 0:2 * half:2] = torch.cos(angles)
    pos[:, 1:2 * half:2] = torch.sin(angles)
    return pos / pos.norm(dim=-1, keepdim=True)


def attention_entropy(q: torch.Tensor, k: torch.Tensor, rows: int = 256, seed: int = 0) -> float:
    """Mean entropy in nats of exact softmax attention rows (a sample of `rows` queries)."""
    N, D = q.shape[-2], q.shape[-1]
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(N, generator=g)[:rows]
    s = (q[..., idx, :].double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    logp = torch.log_softmax(s, dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def near_weight(q: torch.Tensor, k: torch.Tensor, width: int = 64, rows: int = 256,
                seed: int = 0) -> float:
    """Mean attention weight on keys within `width` tokens of the query (sampled rows)."""
    N, D = q.shape[-2], q.shape[-1]
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:rows]
    p = torch.softmax((q[..., idx, :].double() @ k.double().transpose(-1, -2)) / math.sqrt(D), -1)
    near = (idx[:, None] - torch.arange(N)[None, :]).abs() <= width  # (rows, N)
    return float((p * near).sum(-1).mean())


def main() -> None:
    print(f"{'input':10s} {'N':>6s} {'entropy_nats':>12s} {'uniform_nats':>12s} {'weight_within_64':>16s}")
    for dist in DISTRIBUTIONS:
        for N in (1024, 4096, 16384):
            q, k, _ = make_inputs(dist, 1, 4, N, 64)
            print(f"{dist:10s} {N:6d} {attention_entropy(q, k):12.2f} {math.log(N):12.2f} "
                  f"{near_weight(q, k):16.4f}")


if __name__ == "__main__":
    main()
