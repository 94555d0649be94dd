"""The race of learning rates inside one configuration: successive halving (Jamieson and
Talwalkar 2016, https://arxiv.org/abs/1502.07943; Hyperband's inner loop, Li et al. 2018),
so that a configuration costs about one long run, not one per rate.

Every rate runs a first budget of steps; the better half (by held-out accuracy so far,
best over the run's evaluations) goes on to twice the budget, and so on; the last rate
left runs to its end (early_stop, settled, or max_steps). Rates tied at the cut (within
`margin`, the settling rule's, of the last one kept) are ranked by their held-out loss
(their training loss where a result has none): on MQAR's plateau every rate sits at the
same held-out accuracy while the loss already tells the run about to rise, and a coin
flip (or the order of the sweep) would not. A run that reaches `early_stop` ends the
race (as the sweep stopped at the first rate that did). A run that stops on its own
(settled, nonfinite) keeps its place with what it reached. A cut rate that reads more
than `margin` above every run that finished (the winner settled low, the cut one was
ahead at its tie) is run to its end as well, so the row's rate is always one whose run
finished. Runs are continued, not restarted: `advance(lr, until)` trains a rate's run to
step `until` and returns its result so far (harness.train.trainer.Run.result, or a
failure's status).
"""

from __future__ import annotations

import math
from typing import Callable

ETA = 2  # keep 1 / ETA of the rates at each rung, and multiply the budget by ETA


def race(lrs, advance: Callable[[float, int], dict], *, first: int, cap: int,
         early_stop: float, margin: float) -> list[tuple[float, dict]]:
    """[(lr, its last result)] in the order the rates were first run; a rate not in it was
    not run (an earlier one reached early_stop)."""
    results: dict[float, dict] = {}
    alive = list(lrs)
    budget = min(first, cap) if len(alive) > 1 else cap
    while alive:
        for lr in alive:
            r = results.get(lr)
            if r is not None and _finished(r):
                continue
            results[lr] = r = advance(lr, budget)
            if r["status"] == "ok" and r["accuracy"] >= early_stop:
                return list(results.items())
        alive = [lr for lr in alive if results[lr]["status"] == "ok"]
        going = [lr for lr in alive if not _finished(results[lr])]
        if not going or budget >= cap:
            break
        alive = keep(alive, results, margin)
        budget = cap if len(alive) == 1 else min(budget * ETA, cap)
    # The row is a finished run's (harness.train.rows.combine). A rate cut at a tie (kept
    # by held-out loss) can read more than the winner settled at: one cut that reads more
    # than `margin` above every finished run is run to its end too, until none does.
    while True:
        ok = {lr: r for lr, r in results.items() if r["status"] == "ok"}
        done = [r["accuracy"] for r in ok.values() if _finished(r)]
        cut = [lr for lr, r in ok.items() if not _finished(r)]
        if not cut:
            break
        lr = max(cut, key=lambda lr: results[lr]["accuracy"])
        if done and results[lr]["accuracy"] <= max(done) + margin:
            break
        results[lr] = advance(lr, cap)
    return list(results.items())


def keep(lrs: list[float], results: dict[float, dict], margin: float) -> list[float]:
    """The ceil(n / ETA) rates that go on, in their original order: those more than
    `margin` above the accuracy of the last place kept, then, of the rates within
    `margin` of it, those with the lowest held-out loss (the last of `held_out_loss`;
    `final_loss`, the training loss, where there is none)."""
    acc = {lr: results[lr]["accuracy"] for lr in lrs}
    n = math.ceil(len(lrs) / ETA)
    line = sorted(acc.values(), reverse=True)[n - 1]
    sure = [lr for lr in lrs if acc[lr] > line + margin]
    tied = sorted((lr for lr in lrs if lr not in sure and acc[lr] >= line - margin),
                  key=lambda lr: (_loss(results[lr]), -acc[lr]))
    kept = set(sure) | set(tied[:n - len(sure)])
    return [lr for lr in lrs if lr in kept]


def _loss(result: dict) -> float:
    held = result.get("held_out_loss")
    loss = held[-1][1] if held else result.get("final_loss")
    return math.inf if loss is None or not math.isfinite(loss) else loss


def _finished(result: dict) -> bool:
    return result["status"] != "ok" or result.get("stopped") is not None
