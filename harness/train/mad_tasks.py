"""MAD's synthetic tasks, scaled to a CPU: selective copying, noisy recall, fuzzy recall.

Poli, Thomas et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures"
(https://arxiv.org/abs/2403.17844), Sec. 3 and App. B, and its generators in mad-lab
(https://github.com/athms/mad-lab, mad/data/instances.py), whose semantics these follow;
the code is our own, and where it departs from mad-lab's the docstring says so.

Each generator: (num_examples, seq_len, vocab_size, *, seed, its parameters) ->
(inputs, labels), LongTensors (num_examples, seq_len), labels -100 but at the scored
positions, the same tensors for the same arguments (a torch.Generator seeded with `seed`).
Token 0 is the filler (blank, padding) of every task, as in MQAR. Registered in
harness.train.tasks, which adds each task's checks, chance level and `answer_at`.
"""

from __future__ import annotations

import torch

IGNORE = -100  # the label of a position that is not scored (torch's cross_entropy default)


def _subsets(g: torch.Generator, shape: tuple[int, ...], k: int, n: int) -> torch.Tensor:
    """shape + (k,) integers from [0, n), distinct along the last axis, in random order: a
    uniform k-permutation of range(n) (the k largest of n uniform numbers, ranked)."""
    return torch.rand(*shape, n, generator=g).topk(k, dim=-1).indices


def _first_equal(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(n, P): for each slot, the first valid slot with the same id (itself if none earlier);
    -1 where the slot itself is not valid."""
    P = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, None, :]  # (n, P, P): slot j like i
    same &= torch.ones(P, P, dtype=torch.bool).tril()  # ... and j <= i
    first = same.float().argmax(dim=2)  # the first True (valid slots match themselves)
    return torch.where(valid, first, torch.full_like(first, -1))


# -- selective copying ----------------------------------------------------------------------
def selective_copying_problems(seq_len: int, vocab_size: int, num_tokens: int) -> list[str]:
    out = []
    if num_tokens < 1:
        return [f"selective_copying: num_tokens must be >= 1, got {num_tokens}"]
    if seq_len < 2 * num_tokens + 2:
        out.append(f"selective_copying: {num_tokens} tokens do not fit in seq_len={seq_len} "
                   f"(the tokens, at least one blank among them, the separator and "
                   f"{num_tokens} outputs: seq_len >= {2 * num_tokens + 2})")
    if vocab_size < 4:
        out.append(f"selective_copying: vocab_size={vocab_size} is too small (blank 0, the "
                   f"separator vocab_size - 1 and at least two tokens to copy: vocab_size >= 4)")
    return out


def selective_copying(num_examples: int, seq_len: int, vocab_size: int, num_tokens: int, *,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective copying (MAD; mad-lab's `generate_selective_copying_instance`).

    - T = num_tokens tokens, drawn uniformly with replacement from [1, vocab_size - 1), sit
      in order at T positions drawn uniformly among the first L = seq_len - T - 1; the other
      positions of that stretch hold the blank 0.
    - Position L holds the separator, vocab_size - 1; positions L + 1 .. seq_len - 1 are
      blanks, the outputs: `labels` there is the j-th token (j = 0 .. T - 1), -100 elsewhere.
      So the answer is never in the input after its scored position (a non-causal form).
    mad-lab inserts the blanks at random insertion points (np.insert) and counts the blank
    and separator at the top of the vocabulary; the layout is otherwise the same.
    """
    problems = selective_copying_problems(seq_len, vocab_size, num_tokens)
    if problems:
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    n, T, L = num_examples, num_tokens, seq_len - num_tokens - 1
    where = _subsets(g, (n,), T, L).sort(dim=1).values  # (n, T): ascending data positions
    tokens = torch.randint(1, vocab_size - 1, (n, T), generator=g)
    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    inputs.scatter_(1, where, tokens)
    inputs[:, L] = vocab_size - 1
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    labels[:, L + 1:] = tokens
    return inputs, labels


def selective_copying_answer_at(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(n, N): at output j, the position of the j-th non-blank before the separator."""
    out = torch.full_like(inputs, -1)
    scored = labels != IGNORE
    for e in range(len(inputs)):
        outputs = scored[e].nonzero().flatten()
        data = (inputs[e, :int(outputs[0]) - 1] != 0).nonzero().flatten()
        out[e, outputs] = data
    return out


def selective_copying_chance(seq_len: int, vocab_size: int, num_tokens: int, **_) -> float:
    """A uniform guess among the vocab_size - 2 tokens that can be copied."""
    return 1.0 / (vocab_size - 2)


def selective_copying_guess(seq_len: int, vocab_size: int, num_tokens: int, **_) -> float:
    """Each output guessed among the num_tokens tokens shown, order unknown: 1 / tokens."""
    return 1.0 / num_tokens


# -- noisy recall ------------------------------------------------------------------------
def _recall_vocab(vocab_size: int, noise_vocab_size: int) -> tuple[int, int, int]:
    """(first key, first value, first noise token): 0 filler, keys, values, noise."""
    nonnoise = vocab_size - noise_vocab_size - 1
    return 1, 1 + nonnoise // 2, vocab_size - noise_vocab_size


def noisy_recall_problems(seq_len: int, vocab_size: int, noise_vocab_size: int,
                          frac_noise: float) -> list[str]:
    out = []
    if not (isinstance(frac_noise, (int, float)) and 0 <= frac_noise < 1):
        out.append(f"noisy_recall: frac_noise must be in [0, 1), got {frac_noise!r}")
    if noise_vocab_size < 0 or (noise_vocab_size == 0 and frac_noise > 0):
        out.append(f"noisy_recall: noise_vocab_size must be >= 1 when frac_noise > 0, got "
                   f"{noise_vocab_size}")
    if seq_len < 4:
        out.append(f"noisy_recall: seq_len={seq_len} is too short for a pair and its query "
                   f"(seq_len >= 4)")
    if vocab_size - noise_vocab_size - 1 < 2:
        out.append(f"noisy_recall: vocab_size={vocab_size} leaves no key and value beside the "
                   f"filler 0 and {noise_vocab_size} noise tokens: vocab_size >= "
                   f"{noise_vocab_size + 3}")
    return out


def noisy_recall(num_examples: int, seq_len: int, vocab_size: int, noise_vocab_size: int,
                 frac_noise: float, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """In-context recall with noise (MAD's noisy in-context recall, multi-query; mad-lab's
    `generate_noisy_in_context_recall_instance` with multi_query=True).

    - Vocabulary: 0 filler; keys [1, k); values [k, vocab_size - noise_vocab_size), k =
      1 + (vocab_size - noise_vocab_size - 1) // 2; noise [vocab_size - noise_vocab_size,
      vocab_size).
    - Each example has its own map key -> value, each value uniform over the values (two
      keys may share one). The sequence is seq_len // 2 two-token slots (a leading filler
      when seq_len is odd). A slot is noise with probability frac_noise: two tokens drawn
      uniformly from the noise vocabulary. Otherwise it is a pair `key value`, the key
      uniform over the keys. One slot among the first ones is always a pair; the last is
      always a pair whose key, uniform among the distinct keys shown before, repeats.
    - `labels` is -100 but at the key of a pair whose key appeared in an earlier pair: there
      it is the key's value, the token that follows (the model predicts the value while
      reading its key, as MAD's shifted targets). Noise is never scored nor an answer.
    The value follows its key at every occurrence, the scored ones too: the answer is in
    the input right after its scored position, so there is no non-causal form.
    mad-lab counts keys from 0 (no filler) and may leave the guaranteed pair out when it
    draws the last slot; otherwise the same.
    """
    problems = noisy_recall_problems(seq_len, vocab_size, noise_vocab_size, frac_noise)
    if problems:
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    n, P, off = num_examples, seq_len // 2, seq_len % 2
    k0, v0, z0 = _recall_vocab(vocab_size, noise_vocab_size)
    n_keys, n_values = v0 - k0, z0 - v0
    value_of = torch.randint(v0, z0, (n, n_keys), generator=g)  # (n, keys): the example's map
    keys = torch.randint(0, n_keys, (n, P), generator=g)  # (n, P) key index per slot
    is_pair = torch.rand(n, P, generator=g) >= frac_noise
    keep = torch.randint(0, P - 1, (n,), generator=g)
    is_pair[torch.arange(n), keep] = True
    # The last slot: a key drawn uniformly among the distinct keys of the earlier pairs.
    shown = torch.zeros(n, n_keys + 1, dtype=torch.bool)  # the last column: noise slots
    shown.scatter_(1, torch.where(is_pair[:, :-1], keys[:, :-1], n_keys), True)
    pick = torch.rand(n, n_keys, generator=g).masked_fill(~shown[:, :-1], -1).argmax(dim=1)
    keys[:, -1], is_pair[:, -1] = pick, True
    noise = torch.randint(z0, vocab_size, (n, P, 2), generator=g) if noise_vocab_size else None
    pair = torch.stack([keys + k0, value_of.gather(1, keys)], dim=2)  # (n, P, 2)
    slots = pair if noise is None else torch.where(is_pair[..., None], pair, noise)
    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    inputs[:, off:] = slots.reshape(n, 2 * P)
    repeat = _first_equal(keys, is_pair) < torch.arange(P)  # a pair whose key came earlier
    repeat &= is_pair
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    lab = labels[:, off:off + 2 * P].view(n, P, 2)
    lab[..., 0] = torch.where(repeat, pair[..., 1], torch.full_like(keys, IGNORE))
    return inputs, labels


def recall_answer_at(inputs: torch.Tensor, labels: torch.Tensor, key_len: int = 1) -> torch.Tensor:
    """(n, N): at a scored position i, the position of the same answer token after the most
    recent earlier occurrence of the key span that ends at i - s (s = how far i is into the
    value span); -1 elsewhere. The nearest earlier copy: the one a window reaches first."""
    out = torch.full_like(inputs, -1)
    scored = labels != IGNORE
    for e in range(len(inputs)):
        row = inputs[e].tolist()
        for i in scored[e].nonzero().flatten().tolist():
            s = 0  # back to the key span's last token: scored positions run on from it
            while i - s - 1 >= 0 and scored[e, i - s - 1]:
                s += 1
            end = i - s
            key = row[end - key_len + 1:end + 1]
            for j in range(end - 1, key_len - 2, -1):
                if row[j - key_len + 1:j + 1] == key:
                    out[e, i] = j + 1 + s
                    break
    return out


def noisy_recall_chance(seq_len: int, vocab_size: int, noise_vocab_size: int,
                        frac_noise: float, **_) -> float:
    """A uniform guess among the values (each key's value is uniform over them)."""
    _, v0, z0 = _recall_vocab(vocab_size, noise_vocab_size)
    return 1.0 / (z0 - v0)


def noisy_recall_guess(seq_len: int, vocab_size: int, noise_vocab_size: int,
                       frac_noise: float, **_) -> float:
    """A guess among the values of the keys shown: 1 / the expected number of distinct
    keys among the (1 - frac_noise) seq_len // 2 pairs, K (1 - (1 - 1/K)^pairs) of K keys
    (the mean of 1 / distinct read at its mean: a slight underestimate)."""
    k0, v0, _ = _recall_vocab(vocab_size, noise_vocab_size)
    keys, pairs = v0 - k0, (1 - frac_noise) * (seq_len // 2)
    return 1.0 / max(1.0, keys * (1 - (1 - 1 / keys) ** pairs))


# -- fuzzy recall ------------------------------------------------------------------------
def fuzzy_recall_problems(seq_len: int, vocab_size: int, key_len: int,
                          value_len: int) -> list[str]:
    out = []
    if key_len < 1 or value_len < 1:
        return [f"fuzzy_recall: key_len and value_len must be >= 1, got {key_len}, {value_len}"]
    h = (vocab_size - 1) // 2
    if h < key_len or vocab_size - 1 - h < value_len:
        out.append(f"fuzzy_recall: vocab_size={vocab_size} is too small for keys of {key_len} "
                   f"distinct tokens from [1, {1 + h}) and values of {value_len} from "
                   f"[{1 + h}, {vocab_size}): vocab_size >= {2 * max(key_len, value_len) + 1}")
    if seq_len < 2 * (key_len + value_len):
        out.append(f"fuzzy_recall: seq_len={seq_len} does not hold a pair and its repeat "
                   f"(seq_len >= 2 x (key_len + value_len) = {2 * (key_len + value_len)})")
    return out


def fuzzy_recall(num_examples: int, seq_len: int, vocab_size: int, key_len: int,
                 value_len: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuzzy in-context recall, keys and values of several tokens (MAD; mad-lab's
    `generate_fuzzy_in_context_recall_instance` with multi_query=True).

    - Vocabulary: 0 filler; key tokens [1, 1 + h), value tokens [1 + h, vocab_size),
      h = (vocab_size - 1) // 2. A key is key_len distinct key tokens, a value value_len
      distinct value tokens, each uniform over such sequences.
    - The sequence is P = seq_len // (key_len + value_len) pairs `key value`, after a
      leading filler of seq_len - P (key_len + value_len) zeros. Each pair's key is uniform;
      a key seen before in the example keeps its value, a new one draws its value. The
      last pair repeats the pair of a slot drawn uniformly among the others (MAD's probe).
    - `labels`: -100 but in the pairs whose key appeared in an earlier pair, from the key's
      last token to the value's second-to-last, each position labelled with the next token:
      the model reads the key span and writes the value span (MAD's shifted targets).
    A value span is in the input right after its scored positions: no non-causal form.
    mad-lab draws spans of random lengths up to key_len and value_len while training (its
    test set keys are key_len long), places its probe pair at a random point and keeps one
    map per key length; this fixes both lengths, as in its test set.
    """
    problems = fuzzy_recall_problems(seq_len, vocab_size, key_len, value_len)
    if problems:
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    n, K, W = num_examples, key_len, value_len
    span = K + W
    P, h = seq_len // span, (vocab_size - 1) // 2
    keys = _subsets(g, (n, P), K, h)  # (n, P, K) key-token indices
    values = _subsets(g, (n, P), W, vocab_size - 1 - h)  # (n, P, W)
    probe = torch.randint(0, P - 1, (n,), generator=g)
    keys[:, -1] = keys[torch.arange(n), probe]
    ids = (keys * torch.tensor([h ** j for j in range(K)])).sum(-1)  # (n, P): a key's number
    first = _first_equal(ids, torch.ones(n, P, dtype=torch.bool))  # (n, P)
    values = values.gather(1, first[..., None].expand(-1, -1, W))  # a key keeps its value
    repeat = first < torch.arange(P)
    pairs = torch.cat([keys + 1, values + 1 + h], dim=2)  # (n, P, K + W)
    off = seq_len - P * span
    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    inputs[:, off:] = pairs.reshape(n, P * span)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    lab = labels[:, off:].view(n, P, span)
    nxt = pairs[..., K:]  # the token after positions K-1 .. K+W-2 of the pair
    lab[..., K - 1:span - 1] = torch.where(repeat[..., None], nxt, torch.full_like(nxt, IGNORE))
    return inputs, labels


def fuzzy_recall_chance(seq_len: int, vocab_size: int, key_len: int, value_len: int,
                        **_) -> float:
    """A guess that reads the value span so far but no earlier pair: its j-th token is
    uniform over the m - j value tokens not yet in it (m of them), mean over the span."""
    m = vocab_size - 1 - (vocab_size - 1) // 2
    return sum(1.0 / (m - j) for j in range(value_len)) / value_len


def fuzzy_recall_guess(seq_len: int, vocab_size: int, key_len: int, value_len: int,
                       **_) -> float:
    """A guess of which earlier pair is repeated, among the P - 1 before the last, P =
    seq_len // (key_len + value_len): its value span's tokens are then all right."""
    return 1.0 / max(1, seq_len // (key_len + value_len) - 1)
