"""Windows of a split, bits per byte, the n-gram floors and the recall-hit mask, against
plain Python loops over the byte stream and brute force.

Planted bugs these catch: labels equal to the inputs or two bytes ahead, windows that step
seq_len + 1 (a byte never predicted) or drop the padded tail (the stream loop and the
counts); a bits-per-byte that averages per window, or counts padding (the unigram model
scoring exactly unigram_bpb); a bigram scored on the wrong byte pair (the stream loop);
a recall hit that counts its own occurrence, a 7-gram of six or eight bytes, a train
count compared with < instead of <=, a match across two windows (brute force); an
unseeded or misaligned training window (substrings of the split, seeds).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from harness.train import text_metrics as tm
from harness.train.text_windows import IGNORE, eval_windows, train_windows


def _bytes(s: bytes) -> torch.Tensor:
    return torch.tensor(list(s), dtype=torch.long)


def _text(n: int, seed: int, alphabet: bytes = b"ab c") -> bytes:
    rng = random.Random(seed)
    return bytes(rng.choice(alphabet) for _ in range(n))


def _words(n: int, seed: int) -> bytes:
    """n bytes of random words: text whose bigrams say a lot."""
    rng = random.Random(seed)
    out = b""
    while len(out) < n:
        out += rng.choice([b"the ", b"cat ", b"sat ", b"on ", b"mat\n", b"quickly "])
    return out[:n]


@pytest.mark.parametrize("L,N", [(2, 1), (17, 4), (33, 8), (100, 7), (5, 16)])
def test_eval_windows_predict_every_byte_after_the_first_once_from_its_predecessor(L, N):
    data = _bytes(_text(L, L))
    x, y = eval_windows(data, N)
    assert x.shape == y.shape == (math.ceil((L - 1) / N), N)
    pairs = [(a, b) for a, b in zip(x.flatten().tolist(), y.flatten().tolist()) if b != IGNORE]
    stream = data.tolist()
    assert pairs == [(stream[t - 1], stream[t]) for t in range(1, L)]


def test_train_windows_are_substrings_shifted_by_one_and_seeded():
    raw = _text(500, 1, b"abcdefgh")
    data = _bytes(raw)
    x, y = train_windows(data, 32, 16, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (32, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, last in zip(x.tolist(), y[:, -1].tolist()):
        assert bytes(row + [last]) in raw
    again = train_windows(data, 32, 16, torch.Generator().manual_seed(3))
    other = train_windows(data, 32, 16, torch.Generator().manual_seed(4))
    assert torch.equal(again[0], x) and not torch.equal(other[0], x)


def _stream_bits(train: bytes, test: bytes, order: int) -> float:
    """Add-one unigram (order 1) or bigram (order 2) bits per byte over bytes 1.. of test."""
    uni, big, first = Counter(train), Counter(zip(train, train[1:])), Counter(train[:-1])
    bits = 0.0
    for t in range(1, len(test)):
        if order == 1:
            p = (uni[test[t]] + 1) / (len(train) + 256)
        else:
            p = (big[test[t - 1], test[t]] + 1) / (first[test[t - 1]] + 256)
        bits -= math.log2(p)
    return bits / (len(test) - 1)


def test_a_model_predicting_train_unigrams_scores_exactly_unigram_bpb():
    train, test = _bytes(_text(3000, 1, b"aab cdd\n")), _bytes(_text(999, 2, b"abcxyz \n"))
    x, y = eval_windows(test, 64)  # 998 labels: the last window padded
    logp = tm.unigram_logprobs(train)
    nats = tm.byte_nats(lambda inp: logp.expand(*inp.shape, 256), x, y, batch=5)
    got = tm.scores(nats, y)["bits_per_byte"]
    assert got == pytest.approx(tm.unigram_bpb(train, y), rel=1e-12, abs=0)
    assert got == pytest.approx(_stream_bits(bytes(train.tolist()), bytes(test.tolist()), 1),
                                rel=1e-12)


def test_a_bigram_model_scores_bigram_bpb_and_a_target_off_by_one_does_not():
    raw_train, raw_test = _words(4000, 3), _words(777, 4)
    train, test = _bytes(raw_train), _bytes(raw_test)
    x, y = eval_windows(test, 32)
    table = tm.bigram_logprobs(train)
    nats = tm.byte_nats(lambda inp: table[inp], x, y)
    want = _stream_bits(raw_train, raw_test, 2)
    assert tm.scores(nats, y)["bits_per_byte"] == pytest.approx(want, rel=1e-12)
    assert tm.bigram_bpb(train, x, y) == pytest.approx(want, rel=1e-12)
    shifted = torch.roll(y, -1, dims=1)  # targets one byte late: the planted off-by-one
    shifted[y == IGNORE] = IGNORE
    off = tm.scores(tm.byte_nats(lambda inp: table[inp], x, shifted), shifted)["bits_per_byte"]
    assert abs(off - want) > 0.05


def _brute_hits(windows: list[list[int]], train: list[int], max_count: int) -> list[list[bool]]:
    grams = Counter(tuple(train[i:i + 7]) for i in range(len(train) - 6))
    out = []
    for w in windows:  # w: the window's bytes, inputs then the last label (no padding)
        row = [False] * (len(w) - 1)
        for j in range(len(w) - 1):  # label j is byte j + 1 of the window
            if j + 1 < 6:
                continue
            gram = tuple(w[j - 5:j + 2])
            earlier = any(tuple(w[s - 5:s + 2]) == gram for s in range(5, j))
            row[j] = earlier and grams[gram] <= max_count
        out.append(row)
    return out


@pytest.mark.parametrize("max_count", [0, 1, 100])
@pytest.mark.parametrize("N", [12, 40])
def test_recall_hits_match_brute_force(max_count, N):
    raw_train = _text(3000, 5, b"ab") + b"abcabcabcabc"
    raw_test = _text(400, 6, b"ab") + b"xyz" * 14 + _text(200, 7, b"abc")
    train, test = _bytes(raw_train), _bytes(raw_test)
    x, y = eval_windows(test, N)
    hits = tm.recall_hits(x, y, tm.train_gram_counts(train), max_count)
    windows = [raw_test[i * N:i * N + N + 1] for i in range(len(x))]
    brute = _brute_hits([list(w) for w in windows], list(raw_train), max_count)
    for i, row in enumerate(brute):
        assert hits[i, :len(row)].tolist() == row, f"window {i}"
        assert not hits[i, len(row):].any()
    assert hits.any() and not hits.all()


def test_train_counts_and_the_hit_scores_against_plain_sums():
    raw = _text(2000, 8, b"abc")
    codes, counts = tm.train_gram_counts(_bytes(raw))
    want = Counter(raw[i:i + 7] for i in range(len(raw) - 6))
    got = {bytes(int(c) >> (8 * k) & 255 for k in range(6, -1, -1)): int(n)
           for c, n in zip(codes, counts)}
    assert got == dict(want)
    x, y = eval_windows(_bytes(_text(300, 9, b"ab")), 20)
    nats = torch.rand(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    hits = tm.recall_hits(x, y, (codes, counts), 10_000)
    s = tm.scores(nats, y, hits)
    flat = [(float(n), bool(h)) for n, h, l in zip(nats.flatten(), hits.flatten(),
                                                  y.flatten()) if l != IGNORE]
    on = [n for n, h in flat if h]
    off = [n for n, h in flat if not h]
    assert s["hit_share"] == len(on) / len(flat)
    assert s["hit_bpb"] == pytest.approx(sum(on) / math.log(2) / len(on), rel=1e-12)
    assert s["other_bpb"] == pytest.approx(sum(off) / math.log(2) / len(off), rel=1e-12)
