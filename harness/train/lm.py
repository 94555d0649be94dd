"""The `lm` task in the trainer: a configuration's byte windows, its plateau, its test
numbers, and the corpus checks the plan and a resume make.

Training draws `batch` windows of seq_len + 1 bytes at uniform starts of the train split at
every step (text_windows.train_windows, from the run's seeded batch-order generator); the
validation set is `validation_examples` windows of the validation split's tiling
(text_windows.eval_windows), evenly spaced over it, or all of them when it has fewer;
the test set is the test split's whole tiling: every test byte but the first predicted
once. The metric is bits per byte (text_metrics), lower is better; the plateau a run must
leave to count as having learned anything is the train split's add-one unigram scored on
the validation bytes (what a model that reads no context can reach).

At the end of a run (trainer.Run._test) the test split gives, at the kept checkpoint:

    bits_per_byte      summed cross-entropy over every predicted test byte / ln 2 / bytes
    unigram_bpb        the train split's add-one unigram on the same bytes
    bigram_bpb         the train split's add-one bigram, each byte given the one before
    hit_bpb, other_bpb bits per byte on recall hits (text_metrics.recall_hits) and the rest
    hit_share          hits / predicted bytes
    bpb_2n, bpb_4n     bits per byte of the same test split tiled at 2N and 4N (length
                       extrapolation), where every mixer of the model takes that length
                       (its declared reasons); empty elsewhere
"""

from __future__ import annotations

import torch

from harness.errors import UsageError
from harness.train import corpus as corpora
from harness.train import text_metrics, text_windows

METRIC = "bits_per_byte"
TASK = "lm"
EXTRAPOLATE = (2, 4)  # the test split also tiled at these multiples of the trained length

_DATA: dict[tuple, tuple] = {}
_GRAMS: dict[str, tuple] = {}


def corpus_of(config) -> str:
    return config.task_param_dict.get("corpus", "python-docs")


def data(config) -> tuple[torch.Tensor, tuple, tuple]:
    """(train split bytes (L,), validation (inputs, labels), test (inputs, labels)); the
    held-out sets' windows are seq_len bytes (the module's docstring). Cached (one)."""
    corpus = corpus_of(config)
    key = (corpus, config.seq_len, config.validation_examples)
    if key not in _DATA:
        _DATA.clear()
        train = text_windows.split_tensor(corpus, "train")
        vx, vy = text_windows.eval_windows(text_windows.split_tensor(corpus, "validation"),
                                           config.seq_len)
        keep = evenly(len(vx), config.validation_examples)
        test = text_windows.eval_windows(text_windows.split_tensor(corpus, "test"),
                                         config.seq_len)
        _DATA[key] = (train, (vx[keep], vy[keep]), test)
    return _DATA[key]


def evenly(total: int, n: int) -> torch.Tensor:
    """min(n, total) indices of range(total), evenly spaced, first and last included."""
    if n <= 0 or n >= total:
        return torch.arange(total)
    return torch.linspace(0, total - 1, n).round().long().unique()


def plateau(config) -> float:
    """The train split's add-one unigram, in bits per byte, on the validation set's bytes."""
    train, (_, vy), _ = data(config)
    return text_metrics.unigram_bpb(train, vy)


def train_grams(corpus: str) -> tuple[torch.Tensor, torch.Tensor]:
    if corpus not in _GRAMS:
        _GRAMS.clear()
        _GRAMS[corpus] = text_metrics.train_gram_counts(text_windows.split_tensor(corpus, "train"))
    return _GRAMS[corpus]


def extrapolates(model, config, length: int) -> bool:
    """Whether every mixer of the model takes `length` (none of its declared reasons)."""
    for block in model.blocks:
        reasons = block.mixer.unsupported_reasons(
            device=config.device, dtype=torch.float32, causal=config.causal, seq_len=length,
            head_dim=config.head_dim, backward=False)
        if reasons:
            return False
    return True


@torch.no_grad()
def test_scores(model, config, device) -> dict:
    """The module's test numbers of a trained model (put in eval mode for them)."""
    was = model.training
    model.eval()
    try:
        corpus = corpus_of(config)
        train, _, (tx, ty) = data(config)
        right = [0]

        def counted(tokens):  # byte_nats' model, counting the arg-max hits on the way
            logits = model(tokens)
            y = ty[counted.at:counted.at + len(tokens)].to(logits.device)
            counted.at += len(tokens)
            right[0] += int(((logits.argmax(-1) == y) & (y != text_windows.IGNORE)).sum())
            return logits
        counted.at = 0
        nats = text_metrics.byte_nats(counted, tx, ty, device=device)
        hits = text_metrics.recall_hits(tx, ty, train_grams(corpus))
        out = text_metrics.scores(nats, ty, hits)
        out["unigram_bpb"] = text_metrics.unigram_bpb(train, ty)
        out["bigram_bpb"] = text_metrics.bigram_bpb(train, tx, ty)
        out["accuracy"] = right[0] / int((ty != text_windows.IGNORE).sum())
        test = text_windows.split_tensor(corpus, "test")
        for k in EXTRAPOLATE:
            n = k * config.seq_len
            if len(test) < n + 1 or not extrapolates(model, config, n):
                out[f"bpb_{k}n"] = None
                continue
            x, y = text_windows.eval_windows(test, n)
            out[f"bpb_{k}n"] = text_metrics.scores(
                text_metrics.byte_nats(model, x, y, batch=max(1, 64 // k), device=device),
                y)["bits_per_byte"]
        return out
    finally:
        model.train(was)


def corpora_of(configs) -> list[tuple[str, float, float]]:
    """The distinct corpora of a matrix's lm configurations."""
    return sorted({(corpus_of(c), corpora.VALID_FRAC, corpora.TEST_FRAC)
                   for c in configs if c.task == TASK})


def check_plan(configs) -> None:
    """Read every lm corpus of the plan and split it: a `path:` that does not exist or holds
    no text, `hf:` without `datasets` or unreachable, too few documents: UsageError (exit 2,
    one line) before anything runs."""
    for corpus, valid, test in corpora_of(configs):
        corpora.splits(corpus, valid, test)


def describe(configs) -> dict:
    """{corpus: corpus.describe} of the plan's lm corpora: what train_meta.json records."""
    return {corpus: corpora.describe(corpus, valid, test)
            for corpus, valid, test in corpora_of(configs)}


def check_resume(recorded: dict) -> None:
    """UsageError (one line) when a recorded corpus's splits differ from this machine's."""
    for rec in (recorded or {}).values():
        corpora.check_recorded(rec)


def clear_cache() -> None:
    _DATA.clear()
    _GRAMS.clear()
    text_windows.clear_cache()


__all__ = ["METRIC", "TASK", "UsageError", "check_plan", "check_resume", "data", "describe",
           "plateau", "test_scores"]
