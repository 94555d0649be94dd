"""Bits per byte of a byte-level language model, its n-gram floors, and Zoology's recall split.

    bits_per_byte = (sum over every predicted byte of its cross-entropy in nats) / ln 2 / bytes

`unigram_bpb` and `bigram_bpb` are the same number for add-one smoothed byte counts fitted
on the train split, scored on the same predicted bytes: p(b) = (c(b) + 1) / (L + 256) and
p(b | a) = (c(a b) + 1) / (c(a .) + 256), c(a .) counting the bigrams that start with a.

A recall hit (Arora et al. 2023, "Zoology", Sec. 3, at byte level): a predicted byte whose
7-gram (the six bytes before it and itself) occurred earlier in the same evaluation window
and at most MAX_TRAIN_COUNT times in the train split: a byte the context gives and the
train statistics do not. Its first six labels are never hits (their 7-gram starts before
the window). Found by sorting each window's 7-gram codes (one int64 per 7-gram), not by
comparing positions pairwise; train's counts by one `torch.unique` over its codes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

IGNORE = -100
VOCAB = 256
GRAM = 7  # bytes in a recall 7-gram: six before the predicted byte, and itself
MAX_TRAIN_COUNT = 100
LN2 = math.log(2)


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """Summed cross-entropy in nats over n_bytes predicted bytes, in bits per byte."""
    return nats / LN2 / n_bytes


@torch.no_grad()
def byte_nats(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
              labels: torch.Tensor, batch: int = 64, device: str | torch.device = "cpu"
              ) -> torch.Tensor:
    """(W, N) float64 on the CPU: each predicted byte's cross-entropy in nats under `model`
    (inputs (B, N) on `device` -> logits (B, N, 256), e.g. trainer's RecallModel in eval
    mode); 0 where the label is -100."""
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for s in range(0, len(inputs), batch):
        logits = model(inputs[s:s + batch].to(device))
        y = labels[s:s + batch].to(device)
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none")
        out[s:s + batch] = (nll.view(y.shape).double() * (y != IGNORE)).cpu()
    return out


def scores(nats: torch.Tensor, labels: torch.Tensor, hits: torch.Tensor | None = None) -> dict:
    """{bits_per_byte} over every predicted byte; with a hit mask also `hit_bpb` and
    `other_bpb` (bits per byte on hits and on the rest; None when there are none) and
    `hit_share` (hits / predicted bytes)."""
    scored = labels != IGNORE
    out = {"bits_per_byte": bits_per_byte(float(nats[scored].sum()), int(scored.sum()))}
    if hits is not None:
        for name, mask in (("hit_bpb", hits & scored), ("other_bpb", scored & ~hits)):
            n = int(mask.sum())
            out[name] = bits_per_byte(float(nats[mask].sum()), n) if n else None
        out["hit_share"] = int((hits & scored).sum()) / int(scored.sum())
    return out


# -- the n-gram floors -----------------------------------------------------------------------
def unigram_logprobs(train: torch.Tensor) -> torch.Tensor:
    """(256,) float64: log p(b) of the add-one smoothed byte counts of `train` ((L,) bytes)."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1
    return (counts / counts.sum()).log()


def bigram_logprobs(train: torch.Tensor) -> torch.Tensor:
    """(256, 256) float64: [a, b] = log p(b | a), add-one smoothed over train's bigrams."""
    pairs = torch.bincount(train[:-1] * VOCAB + train[1:], minlength=VOCAB * VOCAB)
    counts = pairs.view(VOCAB, VOCAB).double() + 1
    return (counts / counts.sum(dim=1, keepdim=True)).log()


def unigram_bpb(train: torch.Tensor, labels: torch.Tensor) -> float:
    """Bits per byte of the train split's add-one unigram on the scored labels."""
    scored = labels != IGNORE
    return bits_per_byte(-float(unigram_logprobs(train)[labels[scored]].sum()),
                         int(scored.sum()))


def bigram_bpb(train: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Bits per byte of the train split's add-one bigram, each label given its input (the
    byte before it)."""
    scored = labels != IGNORE
    logp = bigram_logprobs(train)[inputs[scored], labels[scored]]
    return bits_per_byte(-float(logp.sum()), int(scored.sum()))


# -- recall hits -----------------------------------------------------------------------------
def gram_codes(data: torch.Tensor) -> torch.Tensor:
    """(L - 6,) int64: the 7-gram starting at each position, its bytes as one base-256 number."""
    n = len(data) - GRAM + 1
    code = torch.zeros(max(n, 0), dtype=torch.long)
    for k in range(GRAM):
        code = code * VOCAB + data[k:k + n]
    return code


def train_gram_counts(train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ascending, counts): every distinct 7-gram of the train split and how often it
    occurs (overlapping occurrences counted)."""
    return torch.unique(gram_codes(train), return_counts=True)


def recall_hits(inputs: torch.Tensor, labels: torch.Tensor,
                train_counts: tuple[torch.Tensor, torch.Tensor],
                max_train_count: int = MAX_TRAIN_COUNT) -> torch.Tensor:
    """(W, N) bool: the labels that are recall hits (the module's docstring)."""
    W, N = labels.shape
    code = torch.zeros(W, N, dtype=torch.long)
    for k in range(GRAM - 1):  # label j's 7-gram: inputs j-5 .. j, then label j
        code[:, GRAM - 2:] = code[:, GRAM - 2:] * VOCAB + inputs[:, k:N - GRAM + 2 + k]
    code = code * VOCAB + labels.clamp(min=0)
    valid = labels != IGNORE
    valid[:, :GRAM - 2] = False
    # Positions without a 7-gram get distinct negative codes: they match nothing.
    code = torch.where(valid, code, -1 - torch.arange(N).expand(W, N))
    ordered, where = torch.sort(code, dim=1, stable=True)  # equal codes: earliest first
    again = torch.zeros(W, N, dtype=torch.bool)
    again[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    earlier = torch.zeros(W, N, dtype=torch.bool).scatter_(1, where, again)
    known, counts = train_counts
    at = torch.searchsorted(known, code).clamp(max=max(len(known) - 1, 0))
    in_train = torch.where(known[at] == code, counts[at], 0) if len(known) else \
        torch.zeros_like(code)
    return earlier & valid & (in_train <= max_train_count)
