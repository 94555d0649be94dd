"""What a trained run's numbers say: the plateau its accuracy sits on before it has learned
to recall, the margin an accuracy must clear to differ from it, and the run's `outcome`.

Recall is learned in a jump (the induction-head phase change, Olsson et al. 2022,
https://arxiv.org/abs/2209.11895): held-out accuracy first sits on a plateau, the format
learned and the answer guessed among the context's candidates (MQAR: one of its `pairs`
values, 1 / pairs), then rises within a few hundred steps. A run on that plateau has not
learned anything the task measures, however flat its curve: the settling rule
(harness.train.trainer.settled) never stops it, and its outcome is `not_learned`.

    learned      reached the preset's target (`early_stop`)
    partial      above the plateau by more than the margin, below the target: settled
                 there, or stopped at its budget
    at_reach     a variant that cannot read every answer (`reach` < 1: a window shorter
                 than the key-to-query distance) at its own ceiling, reach + (1 - reach)
                 chance, within the margin
    not_learned  best validation accuracy within the margin of the plateau when its
                 budget ended: "not learned within S steps", a censored result
    diverged     training or validation loss non-finite, or validation loss above
                 ln(vocab) + 1 (worse than a uniform guess) after the warm-up
"""

from __future__ import annotations

import math

OUTCOMES = ("learned", "partial", "at_reach", "not_learned", "diverged")
MIN_MARGIN = 0.02  # the margin's floor: two points of accuracy, whatever the set's size


def margin(p: float, scored: int | None) -> float:
    """max(0.02, three binomial standard errors of an accuracy near p measured on `scored`
    positions): a difference smaller than it is not read as one."""
    if not scored:
        return MIN_MARGIN
    p = min(max(p, 0.0), 1.0)
    return max(MIN_MARGIN, 3 * math.sqrt(p * (1 - p) / scored))


BPB_MARGIN = 0.02  # bits per byte: the least difference read as one on a bits_per_byte task


def metric_margin(metric: str, p: float | None, scored: int | None) -> float:
    """The margin on a task's metric: accuracy's `margin`; on bits per byte, BPB_MARGIN (a
    validation set of 100,000 bytes measures its mean to well under 0.01 bits)."""
    if metric == "accuracy":
        return margin(0.0 if p is None else p, scored) if p is not None else MIN_MARGIN
    return BPB_MARGIN


def plateau(task_plateau: float, chance: float, reach: float | None) -> float:
    """A configuration's plateau: the task's, or for a variant that reads only a share
    `reach` of the answers, reach x the task's + (1 - reach) x chance (the other queries
    see no candidate to guess among)."""
    if reach is None or reach >= 1:
        return task_plateau
    return reach * task_plateau + (1 - reach) * chance


def ceiling(chance: float, reach: float | None) -> float:
    """The most a variant of `reach` can score: every answer it reads, a guess elsewhere."""
    return 1.0 if reach is None else reach + (1 - reach) * chance


def on_plateau(accuracy: float, plateau_: float, scored: int | None) -> bool:
    """Whether an accuracy is within the margin of the plateau (or below it)."""
    return accuracy <= plateau_ + margin(plateau_, scored)


def diverged(held_out_loss: list, vocab_size: int, warmup_steps: int) -> bool:
    """Whether a validation loss after the warm-up is non-finite or above ln(vocab) + 1."""
    bound = math.log(vocab_size) + 1
    return any(v is not None and (not math.isfinite(v) or v > bound)
               for s, v in held_out_loss if s > warmup_steps)


def outcome(*, status: str, accuracy: float | None, early_stop: float, plateau_: float,
            chance: float, reach: float | None, scored: int | None,
            held_out_loss: list, vocab_size: int, warmup_steps: int) -> str | None:
    """The outcome of a row's run (`accuracy`: its best validation accuracy); None for a
    row that did not train (skipped, error, oom, timeout)."""
    if status == "nonfinite":
        return "diverged"
    if status != "ok" or accuracy is None:
        return None
    if diverged(held_out_loss, vocab_size, warmup_steps):
        return "diverged"
    if accuracy >= early_stop:
        return "learned"
    if on_plateau(accuracy, plateau_, scored):
        return "not_learned"
    top = ceiling(chance, reach)
    if reach is not None and reach < 1 and accuracy >= top - margin(top, scored):
        return "at_reach"
    return "partial"
