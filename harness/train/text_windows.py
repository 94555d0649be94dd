"""Windows of a corpus split's bytes for the `lm` task: random ones to train on, and the
evaluation set in which every predicted byte is counted once.

A window is seq_len + 1 consecutive bytes w: inputs w[:-1], labels w[1:] (label j is the
byte after input j; vocabulary 256, token = byte). Training windows start anywhere (a
seeded torch.Generator) and may span a document boundary, marked by the EOD byte as the
model reads it. Evaluation windows tile the split: window i holds bytes i seq_len ..
i seq_len + seq_len, so consecutive windows share one byte, the last label of one being
the first input of the next. Every byte but the split's first is a label exactly once; the
first byte of each window is context only (the first label of a window sees one byte).
The last window is padded: inputs EOD, labels -100 (not scored) past the split's end.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from harness.errors import UsageError
from harness.train import corpus as corpora

IGNORE = -100  # the label of a position that is not scored (tasks.IGNORE)
VOCAB = 256

_TENSORS: dict[tuple, torch.Tensor] = {}


def clear_cache() -> None:
    """Forget the corpora read and their tensors (corpus.clear_cache too)."""
    corpora.clear_cache()
    _TENSORS.clear()


def split_tensor(corpus: str, split: str, valid_frac: float = corpora.VALID_FRAC,
                 test_frac: float = corpora.TEST_FRAC) -> torch.Tensor:
    """A split's bytes as a (L,) LongTensor; cached."""
    key = (corpus, split, valid_frac, test_frac)
    if key not in _TENSORS:
        data = corpora.splits(corpus, valid_frac, test_frac)[split]
        _TENSORS[key] = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return _TENSORS[key]


def train_windows(data: torch.Tensor, batch: int, seq_len: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), each (batch, seq_len): windows starting uniformly in the split."""
    if len(data) < seq_len + 1:
        raise UsageError(f"lm: a split of {len(data)} bytes holds no window of seq_len + 1 = "
                         f"{seq_len + 1} bytes")
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=generator)
    w = data[starts[:, None] + torch.arange(seq_len + 1)]  # (batch, seq_len + 1)
    return w[:, :-1], w[:, 1:]


def eval_windows(data: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), each (ceil((L - 1) / seq_len), seq_len): the split tiled as the
    module's docstring says; labels != -100 are bytes 1 .. L - 1 of the split, once each."""
    n = math.ceil((len(data) - 1) / seq_len)
    padded = torch.full((n * seq_len + 1,), corpora.EOD, dtype=torch.long)
    padded[:len(data)] = data
    inputs = padded[:-1].view(n, seq_len)
    labels = padded[1:].clone()
    labels[len(data) - 1:] = IGNORE
    return inputs.clone(), labels.view(n, seq_len)


# -- the `lm` task as tasks.Task's fields want it ---------------------------------------------
def lm_problems(seq_len: int, vocab_size: int, corpus: str = "python-docs") -> list[str]:
    """What is wrong with an lm setting, checked without reading the corpus."""
    out = []
    if vocab_size != VOCAB:
        out.append(f"lm: vocab_size must be {VOCAB} (bytes), got {vocab_size}")
    if seq_len < 1:
        out.append(f"lm: seq_len must be >= 1, got {seq_len}")
    if corpus.startswith("path:"):
        if not Path(corpus[len("path:"):]).expanduser().exists():
            out.append(f"lm: corpus {corpus!r}: {corpus[len('path:'):]!r} does not exist")
    elif corpus.startswith("hf:"):
        if not corpus[len("hf:"):].partition(":")[0]:
            out.append(f"lm: corpus {corpus!r} names no dataset (hf:NAME[:CONFIG])")
        elif importlib.util.find_spec("datasets") is None:
            out.append(f"lm: corpus {corpus!r} needs the optional package `datasets` "
                       "(pip install datasets)")
    elif corpus not in ("python-docs", "python-source"):
        out.append(f"lm: unknown corpus {corpus!r}; corpora: python-docs, python-source, "
                   "path:FILE_OR_FOLDER, hf:NAME[:CONFIG]")
    return out


def lm_windows(num_examples: int, seq_len: int, vocab_size: int, corpus: str = "python-docs",
               *, seed: int = 0, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """num_examples random windows of a split (default train), drawn with `seed`."""
    problems = lm_problems(seq_len, vocab_size, corpus)
    if problems:  # the matrix has reported them as a UsageError before, as for every task
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    return train_windows(split_tensor(corpus, split), num_examples, seq_len, g)


def lm_chance(seq_len: int, vocab_size: int, **_) -> float:
    """Accuracy of a uniform guess over the 256 bytes (the bits-per-byte floors are
    text_metrics' unigram_bpb and bigram_bpb, and the mixer `none`)."""
    return 1.0 / VOCAB


def no_answer_position(inputs: torch.Tensor, labels: torch.Tensor, **_) -> torch.Tensor:
    """-1 everywhere: no single earlier position holds a label's answer."""
    return torch.full_like(inputs, -1)


def lm_spec() -> dict:
    """The `lm` task as tasks.Task's keyword arguments (with `metric`; state_tasks.register_into
    passes the fields Task declares). Its held-out sets are not `generate`'s: eval_windows of
    the validation and test splits."""
    return dict(
        name="lm", summary="byte-level next-byte prediction on a text corpus",
        paper="https://arxiv.org/abs/2312.04927", params={"corpus": "python-docs"},
        generate=lambda n, seq_len, vocab_size, *, seed=0, **p: lm_windows(
            n, seq_len, vocab_size, seed=seed, **p),
        problems=lm_problems, chance=lm_chance, plateau=lm_chance,
        answer_at=no_answer_position,
        non_causal_ok=False,  # each label is the next input
        metric="bits_per_byte")
