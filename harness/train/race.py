"""The race of learning rates inside one configuration: successive halving's rungs
(Jamieson and Talwalkar 2016, https://arxiv.org/abs/1502.07943; Hyperband's inner loop,
Li et al. 2018) with a cut that cannot be made on noise.

Every rate runs a first budget of steps; then, at each rung, a rate is cut only when it
trails the leader (the best validation score so far: accuracy, or on a bits_per_byte task
the lowest bits per byte, with a margin of 0.02 bits) by more than the margin,
max(0.02, three binomial standard errors of the validation set at the leader's accuracy,
harness.train.outcome.margin), and the leader is above its plateau plus the margin: on
MQAR's plateau every rate reads the same accuracy, and which one rises first is not yet
told. The rates left go on to twice the budget, and so on; the last rate left runs to its
end (early_stop, settled, or max_steps). A run that reaches `early_stop` ends the race. A
run that stops on its own (settled, nonfinite) keeps its place with what it reached. A
cut rate that reads more than the margin above every run that finished is run to its end
as well, so the row's rate is always one whose run finished. A winner at an end of the
grid (below early_stop) adds one rate beyond it, one grid step further, run to its end;
at most one. Runs are continued, not restarted: `advance(lr, until)` trains a rate's run
to step `until` and returns its result so far (harness.train.trainer.Run.result, or a
failure's status).

Worst case (nothing cut: every rate on the plateau, or tied): every rate of the grid and
the one beyond it run to the cap, (rates + 1) x max_steps steps
(harness.train.estimate.planned_steps counts it).
"""

from __future__ import annotations

from typing import Callable

from harness.train import outcome, tasks

ETA = 2  # the budget is multiplied by ETA at each rung


def race(lrs, advance: Callable[[float, int], dict], *, first: int, cap: int,
         early_stop: float, margin: float = outcome.MIN_MARGIN,
         edge: bool = True) -> list[tuple[float, dict]]:
    """[(lr, its last result)] in the order the rates were first run; a rate not in it was
    not run (an earlier one reached early_stop). `margin`: the least margin; `edge`:
    whether a winner at an end of the grid adds the rate beyond it."""
    results: dict[float, dict] = {}
    alive = list(lrs)
    budget = min(first, cap) if len(alive) > 1 else cap
    while alive:
        for lr in alive:
            r = results.get(lr)
            if r is not None and _finished(r):
                continue
            results[lr] = r = advance(lr, budget)
            if r["status"] == "ok" and score(r) >= early_stop:
                return list(results.items())
        alive = [lr for lr in alive if results[lr]["status"] == "ok"]
        going = [lr for lr in alive if not _finished(results[lr])]
        if not going or budget >= cap:
            break
        alive = keep(alive, results, margin)
        budget = cap if len(alive) == 1 else min(budget * ETA, cap)
    # The row is a finished run's (harness.train.rows.combine): a cut rate that reads more
    # than the margin above every finished run is run to its end too, until none does.
    while True:
        ok = {lr: r for lr, r in results.items() if r["status"] == "ok"}
        done = [r for r in ok.values() if _finished(r)]
        cut = [lr for lr, r in ok.items() if not _finished(r)]
        if not cut:
            break
        lr = max(cut, key=lambda lr: score(results[lr]))
        if done:
            top = max(done, key=score)
            if score(results[lr]) <= score(top) + _margin(top, margin):
                break
        results[lr] = r = advance(lr, cap)
        if r["status"] == "ok" and score(r) >= early_stop:
            return list(results.items())
    further = beyond(lrs, results, early_stop) if edge else None
    if further is not None:
        results[further] = advance(further, cap)
    return list(results.items())


def keep(lrs: list[float], results: dict[float, dict],
         margin: float = outcome.MIN_MARGIN) -> list[float]:
    """The rates that go on, in their order: all of them while the leader is within the
    margin of its plateau; else those within the margin of the leader."""
    acc = {lr: score(results[lr]) for lr in lrs}
    lead = results[max(lrs, key=acc.get)]
    plateau = tasks.score(lead.get("metric", "accuracy"), lead.get("plateau", 0.0))
    if score(lead) <= plateau + _margin_at(lead, plateau) or score(lead) <= plateau + margin:
        return list(lrs)
    gap = _margin(lead, margin)
    return [lr for lr in lrs if acc[lr] >= score(lead) - gap]


def beyond(lrs, results: dict[float, dict], early_stop: float) -> float | None:
    """The rate one grid step beyond the winner, when it finished below early_stop at an
    end of a grid of two or more rates (the step: its ratio to its neighbour); else None."""
    grid = sorted(lrs)
    done = [(lr, r) for lr, r in results.items() if r["status"] == "ok" and _finished(r)]
    if len(grid) < 2 or not done:
        return None
    lr, best = max(done, key=lambda p: score(p[1]))
    if score(best) >= early_stop or lr not in (grid[0], grid[-1]):
        return None
    near = grid[1] if lr == grid[0] else grid[-2]
    return float(f"{lr * lr / near:.2g}")


def score(result: dict) -> float:
    """A run's best validation score, higher is better (tasks.score: its accuracy, or the
    negative of its bits per byte); a result from before scores: its accuracy."""
    return result["score"] if "score" in result else result["accuracy"]


def _margin_at(result: dict, at: float) -> float:
    """The margin of the result's metric at the score `at`."""
    metric = result.get("metric", "accuracy")
    return outcome.metric_margin(metric, tasks.score(metric, at), result.get("val_scored"))


def _margin(result: dict, least: float) -> float:
    return max(least, _margin_at(result, score(result)))


def _finished(result: dict) -> bool:
    return result["status"] != "ok" or result.get("stopped") is not None
