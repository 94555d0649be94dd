"""What a train.csv row says: the descriptive columns of a configuration (its state, the
reach of a fixed key pattern, the reasons it cannot train here), and the outcome of its
runs at one seed (`combine`: the best rate, the flags that tell a fair sweep from an
unfinished one)."""

from __future__ import annotations

import json

import torch

from harness.measure import layers, stack
from harness.measure.rows import NO_CUDA
from harness.train import lm, outcome, schedule, tasks, trainer
from harness.train.race import score
from harness.train.matrix import TrainConfig
from harness.train.model import CONV_KERNEL

CONV_REACH = CONV_KERNEL - 1  # the short convolution reads this many positions back

STATE_DTYPE = torch.float32  # the trained model's dtype: state_bytes = state_size x 4
# When no rate ran ok, the row takes the most telling failure: an error is a bug to read,
# a non-finite loss an outcome of training.
_SEVERITY = ("error", "oom", "timeout", "nonfinite")
_BEST_FIELDS = ("steps", "time_to_best_s", "steps_to_0_9", "step_ms",
                "final_loss", "n_params", "rising", "settled", "steps_run")


def lr_at_edge(lrs, best_lr: float, accuracy: float, early_stop: float) -> bool:
    """Whether the winning rate may not be the best one: it is the smallest or the largest
    of the rates swept (`lrs`, every rate configured, run or not), so a rate outside the
    range might do better. False when the winning run reached early_stop: nothing could
    rank it higher, so a row that stopped at the first rate it tried is never at the edge,
    whichever rate that was. A sweep of one rate is at the edge unless it reached
    early_stop."""
    if accuracy >= early_stop:
        return False
    return best_lr in (min(lrs), max(lrs))


def state_elements(config: TrainConfig, module) -> int | None:
    """The model's state per example: heads x the sum over its layers of each layer's
    mixer's `state_size(N, D)` at the head dimension D = d_model / heads (Based's "state
    size": what a decoder keeps for every layer's heads; layers x that of one mixer, or a
    layer pattern's layers each their own). The same number on non-causal rows, where it is
    what one query reads (Linformer 2 k D, Nystrom 2 m D: the compressed keys and values).
    None where a mixer does not say."""
    state = module.state_size(config.seq_len, config.head_dim)  # a stack's: its layers' sum
    return None if state is None else \
        layers.repeats(module, config.layers) * config.heads * state


def config_row(config: TrainConfig, module) -> dict:
    """The descriptive columns of a configuration (everything but the training's outcome)."""
    state = state_elements(config, module)
    plateau, chance, at = plateau_of(config, module)
    attention_layers, mixer = stack.composition(config.variant, config.layers)
    return {"config_id": config.config_id, "task": config.task,
            "task_params": config.task_params, "variant": config.variant,
            "family": module.family, "params": config.params, "seq_len": config.seq_len,
            "num_kv_pairs": config.task_param_dict.get("num_kv_pairs"),
            "vocab_size": config.vocab_size, "causal": config.causal,
            "d_model": config.d_model, "layers": config.layers,
            "attention_layers": attention_layers, "mixer": mixer, "heads": config.heads,
            "mlp": config.mlp, "batch": config.batch, "max_steps": config.max_steps,
            "device": config.device, "seed": config.seed, "threads": config.threads,
            "state_size": state,
            "state_bytes": None if state is None else state * STATE_DTYPE.itemsize,
            "lrs": json.dumps(list(config.lrs)),
            "chance": chance, "reach": at, "plateau": plateau,
            "metric": tasks.metric_of(config.task)}


_PLATEAUS: dict[str, tuple] = {}


def plateau_of(config: TrainConfig, module=None) -> tuple[float, float, float | None]:
    """(plateau, chance, reach) of a configuration (harness.train.outcome.plateau), cached;
    `module` its built variant, built here when not given."""
    if config.config_id not in _PLATEAUS and config.task == lm.TASK:
        _PLATEAUS.clear()  # bits per byte: the train unigram's on the validation bytes
        task = tasks.get(config.task)
        _PLATEAUS[config.config_id] = (lm.plateau(config), task.chance(
            config.seq_len, config.vocab_size, **config.task_param_dict), None)
    if config.config_id not in _PLATEAUS:
        task = tasks.get(config.task)
        p = {**task.params, **config.task_param_dict}
        chance = task.chance(config.seq_len, config.vocab_size, **p)
        at = reach(config, layers.build(config) if module is None else module)
        _PLATEAUS.clear()  # one configuration at a time: the worker's, the runner's
        _PLATEAUS[config.config_id] = (
            outcome.plateau(task.plateau(config.seq_len, config.vocab_size, **p), chance, at),
            chance, at)
    return _PLATEAUS[config.config_id]


def reach(config: TrainConfig, module) -> float | None:
    """For a one-layer model whose variant attends over a fixed key pattern (its `key_mask`:
    windows, block layouts), the share of held-out queries whose answer it can read: the
    pattern seen from the query holds a position where the short convolution has put the
    answer together with its key, the answer's own position or the next one (kernel 3:
    position j carries tokens j-2..j, and the key sits just before its answer). The other
    queries it can only guess. None for other variants (no pattern, or more layers, which
    can relay)."""
    mask = module.key_mask(config.seq_len) if config.layers == 1 and \
        config.task != lm.TASK else None
    if mask is None:
        return None
    task = tasks.get(config.task)
    *_, (inputs, labels) = trainer.datasets(config)  # the test set, the reported one
    at = task.answer_at(inputs, labels, **config.task_param_dict)
    rows, cols = (at >= 0).nonzero(as_tuple=True)
    if len(rows) == 0:
        return None
    N = config.seq_len
    seen = mask(torch.arange(N), torch.arange(N))  # (N, N): query i sees key j
    if config.causal:
        seen = seen & torch.ones(N, N, dtype=torch.bool).tril()
    answer = at[rows, cols]
    carried = torch.zeros(len(rows), dtype=torch.bool)
    for shift in range(CONV_REACH):  # positions answer .. answer + K - 2 hold key and answer
        j = (answer + shift).clamp(max=N - 1)
        carried |= seen[cols, j] & (answer + shift < N)
    return float(carried.float().mean())


def skip_reasons(config: TrainConfig, module) -> list[str]:
    """Reasons, declared before running, that the variant cannot be trained here."""
    reasons = [NO_CUDA] if config.device == "cuda" and not torch.cuda.is_available() else []
    return reasons + module.unsupported_reasons(
        device=config.device, dtype=torch.float32, causal=config.causal,
        seq_len=config.seq_len, head_dim=config.head_dim, backward=True)


def combine(config: TrainConfig, runs: list[tuple[float, dict, float]]) -> dict:
    """One row's outcome from a cell's runs at this seed [(lr, last result, wall seconds
    of all its segments), ...] in the order first run: the run of the best validation
    accuracy of those that finished (of equals, the run that went furthest, then the
    first; a run the race cut only where none finished), its test accuracy as `accuracy`
    (its best validation accuracy where it has none: a cut run), that as
    `val_accuracy`."""
    ok = [(lr, r) for lr, r, _ in runs if r["status"] == "ok"]
    notes = [f"lr={lr:g}: {r['status']}: {r['reason']}" for lr, r, _ in runs
             if r["status"] != "ok"]
    ran = {lr for lr, _, _ in runs}
    untried = [f"{lr:g}" for lr in config.lrs if lr not in ran]
    target = trainer.target_score(config)
    metric = tasks.metric_of(config.task)
    if untried and ok and max(score(r) for _, r in ok) >= target:
        first = next(lr for lr, r in ok if score(r) >= target)
        notes.append(f"lr={', '.join(untried)} not run: lr={first:g} reached "
                     f"early_stop={config.early_stop:g}")
    elif untried and config.first_seed:
        notes.append(f"lr={', '.join(untried)} not run")
    cut = [f"{lr:g} at step {r['steps_run']}" for lr, r in ok
           if _cut(r) and r is not max(ok, key=_rank)[1]]
    if cut:
        notes.append(f"raced: lr={', '.join(cut)} cut")
    out = {"train_s": sum(w for _, _, w in runs), "curves": curves(runs),
           "lr_accuracy": json.dumps({f"{lr:g}": round(_value(r), 5) if r["status"] == "ok"
                                      else r["status"] for lr, r, _ in runs})}
    if not ok:
        statuses = [r["status"] for _, r, _ in runs]
        status = min(statuses, key=lambda s: _SEVERITY.index(s) if s in _SEVERITY else -1)
        return {**out, "status": status, "reason": "; ".join(notes),
                "outcome": "diverged" if status == "nonfinite" else None}
    lr, best = max(ok, key=_rank)
    tested = best.get("test_accuracy")
    row = {**out, "status": "ok", "reason": "; ".join(notes), "best_lr": lr,
           **{k: best.get(k) for k in _BEST_FIELDS},
           "accuracy": best["accuracy"] if tested is None else tested,
           "val_accuracy": best["accuracy"],
           "lr_at_edge": lr_at_edge([*config.lrs, *(x for x in ran if x not in config.lrs)],
                                    lr, score(best), target),
           "outcome": run_outcome(config, best), "metric": metric}
    if metric == lm.METRIC:  # the test split's numbers (harness.train.lm.test_scores)
        text = best.get("test_text") or {}
        row.update({k: text.get(k) for k in TEXT_FIELDS})
        row["val_bits_per_byte"] = _value(best)
        if text.get("accuracy") is not None:
            row["accuracy"] = text["accuracy"]
        if text.get("bits_per_byte") is None:  # a cut run: its validation number
            row["bits_per_byte"] = row["val_bits_per_byte"]
    return row


# An lm row's columns from the test split (harness.train.lm.test_scores).
TEXT_FIELDS = ("bits_per_byte", "unigram_bpb", "bigram_bpb", "hit_bpb", "other_bpb",
               "hit_share", "bpb_2n", "bpb_4n")


def _value(result: dict) -> float:
    """A run's best validation number in its metric's units (accuracy, bits per byte)."""
    return result["value"] if result.get("value") is not None else result["accuracy"]


def run_outcome(config: TrainConfig, result: dict) -> str | None:
    """The outcome (harness.train.outcome) of a finished run's result."""
    plateau, chance, at = plateau_of(config)
    metric = tasks.metric_of(config.task)
    if metric != "accuracy":  # compared as scores (higher is better), the margin in bits
        if result["status"] != "ok":
            return outcome.outcome(status=result["status"], accuracy=None, early_stop=0,
                                   plateau_=0, chance=0, reach=None, scored=None,
                                   held_out_loss=[], vocab_size=config.vocab_size,
                                   warmup_steps=0)
        if outcome.diverged(result.get("held_out_loss") or [], config.vocab_size,
                            schedule.warmup_steps(config.warmup, config.max_steps)):
            return "diverged"
        best = score(result)
        if best >= trainer.target_score(config):
            return "learned"
        floor = tasks.score(metric, result.get("plateau", plateau))
        # No target to reach (early_stop 0): a run beyond its plateau has learned.
        return "not_learned" if best <= floor + outcome.BPB_MARGIN else "learned"
    level = result.get("plateau", plateau)
    got = outcome.outcome(
        status=result["status"], accuracy=result.get("accuracy"),
        early_stop=config.early_stop, plateau_=level, chance=chance,
        reach=at, scored=result.get("val_scored"),
        held_out_loss=result.get("held_out_loss") or [], vocab_size=config.vocab_size,
        warmup_steps=schedule.warmup_steps(config.warmup, config.max_steps))
    # The best validation accuracy is the largest of many evaluations, biased up by the
    # choice: near the plateau its noise alone clears the margin (parity at 0.5: 0.54 on
    # validation, 0.51 on the test split). A run whose test accuracy, one evaluation of
    # the chosen checkpoint, is on the plateau has not learned.
    tested = result.get("test_accuracy")
    if got in ("partial", "at_reach") and tested is not None and \
            outcome.on_plateau(tested, level, result.get("val_scored")):
        return "not_learned"
    return got


def curves(runs: list[tuple[float, dict, float]]) -> list[dict]:
    """Each rate's run as it went: its held-out accuracy and loss at every evaluation
    (`history`, `held_out_loss`: [[step, value], ...]), how far it ran and why it stopped
    (None: cut by the race). What train_curves.jsonl keeps of a row."""
    return [{"lr": lr, "status": r["status"], "steps_run": r.get("steps_run"),
             "stopped": r.get("stopped"), "history": r.get("history", []),
             "held_out_loss": r.get("held_out_loss", [])} for lr, r, _ in runs]


def _rank(pair: tuple[float, dict]) -> tuple:
    """A finished run before one the race cut (the race ran to its end any cut run that
    read more than its margin above the finished ones: what is left is within it, and a
    cut run's number is not a settled one), then the best accuracy, then the run that went
    furthest; max() keeps the first of full ties."""
    r = pair[1]
    return not _cut(r), score(r), r.get("steps_run") or 0


def _cut(result: dict) -> bool:
    """A run the race paused and did not go on with (`stopped` None; a result without the
    key is a finished one)."""
    return "stopped" in result and result["stopped"] is None
