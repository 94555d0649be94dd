"""The learning-rate factor of a run at each step.

Warmup-stable-decay (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations", https://arxiv.org/abs/2405.18392), when `warmup` is a
whole number of steps: a linear warm-up over those steps, the full rate, then a 1 - sqrt
decay to 0 over the last DECAY_SHARE of the cap. The first 0.8 x cap steps do not depend
on the cap, so a run continued to a larger cap from before its decay is the run that
larger cap would have trained. A run that settles decays too, over a quarter of the steps
it ran (its decay then DECAY_SHARE of the whole), before its test evaluation
(harness.train.trainer.Run).

When `warmup` is a fraction (a float in [0, 1], the protocol before issue 49, which the
matrices of earlier folders hold): a linear warm-up over warmup x cap steps, then cosine
to 0 at the cap.
"""

from __future__ import annotations

import math

DECAY_SHARE = 0.2  # the share of the cap the decay takes (Hägele et al.: 10-20%)


def is_wsd(warmup) -> bool:
    """Whether `warmup` asks for warmup-stable-decay: a step count, not a fraction."""
    return not isinstance(warmup, float)


def warmup_steps(warmup, max_steps: int) -> int:
    """The warm-up's steps: the count itself, or the fraction of the cap."""
    return int(warmup) if is_wsd(warmup) else int(round(warmup * max_steps))


def decay_start(max_steps: int) -> int:
    """The step where the cap's decay begins."""
    return max_steps - int(round(DECAY_SHARE * max_steps))


def settle_decay(step: int, eval_every: int) -> int:
    """Steps of the decay of a run that settled at `step`: a quarter of them (the decay a
    fifth of the whole), rounded up to an evaluation."""
    steps = max(1, -(-step // 4))
    return -(-steps // eval_every) * eval_every


def schedule(step: int, max_steps: int, warmup, decay: tuple[int, int] | None = None
             ) -> float:
    """The factor at `step` (0-based). Warmup-stable-decay for a step-count `warmup`, its
    decay over [start, end) (`decay`, default the cap's last DECAY_SHARE); a fraction:
    linear warm-up, then cosine to 0 at max_steps."""
    warm = warmup_steps(warmup, max_steps)
    if step < warm:
        return (step + 1) / warm
    if not is_wsd(warmup):
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(max_steps - warm, 1)))
    start, end = decay or (decay_start(max_steps), max_steps)
    if step < start:
        return 1.0
    return max(0.0, 1 - math.sqrt(min(1.0, (step - start) / max(end - start, 1))))
