"""The trained section's "Training curves below 0.9" (harness.report.curves), from a
synthetic sweep and train_curves.jsonl whose runs are known by construction.

gla's best cell (heads 2) stays below 0.9 over its two seeds, its other size lower still;
sdpa reaches 1.0. Planted bugs these catch: a cell above 0.9 drawn, a variant's worse size
drawn instead of its best, another rate's run drawn instead of the winning one, a seed
left out, the held-out loss panel drawing the accuracy, the part shown without curves.
"""

from __future__ import annotations

import json

from harness.files.curves import TRAIN_CURVES
from harness.report import curves
from harness.report.build import write_report
from harness.report.trained import read_train
import report_synth

TASK = json.dumps({"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False},
                  sort_keys=True)


def _row(variant, heads, seed, acc, lr=0.0032):
    return {"config_id": f"{variant}-{heads}-{seed}", "task": "mqar", "task_params": TASK,
            "variant": variant, "family": "x", "params": "{}", "seq_len": 64,
            "num_kv_pairs": 8, "vocab_size": 64, "causal": True, "d_model": 64, "layers": 2,
            "heads": heads, "mlp": False, "batch": 32, "max_steps": 1000, "device": "cpu",
            "status": "ok", "reason": "", "accuracy": acc, "best_lr": lr,
            "lr_accuracy": "{}", "steps": 900, "time_to_best_s": 1.0, "steps_to_0_9": None,
            "step_ms": 10.0, "train_s": 5.0, "final_loss": 2.0, "n_params": 1000,
            "state_size": 100 * heads, "chance": 1 / 32, "seed": seed, "threads": 1,
            "settled": False, "steps_run": 1000}


def _run(lr, top, loss0, steps=1000):
    hist = [[s, round(0.03 + (top - 0.03) * s / steps, 4)] for s in range(50, steps + 1, 50)]
    loss = [[s, round(loss0 - s / 2000, 4)] for s in range(50, steps + 1, 50)]
    return {"lr": lr, "status": "ok", "steps_run": steps, "stopped": "cap", "history": hist,
            "held_out_loss": loss}


ROWS = [_row("gla", 2, 0, 0.5), _row("gla", 2, 1, 0.6, lr=0.001), _row("gla", 4, 0, 0.2),
        _row("gla", 4, 1, 0.2), _row("sdpa", 2, 0, 1.0), _row("sdpa", 2, 1, 1.0)]
# gla-2-0 raced: its winning 3.2e-3 run (to 0.5) and a cut 1e-2 run (to 0.1)
RUNS = {"gla-2-0": [_run(0.01, 0.1, 3.5, 250), _run(0.0032, 0.5, 3.0)],
        "gla-2-1": [_run(0.001, 0.6, 2.9)], "gla-4-0": [_run(0.0032, 0.2, 3.2)],
        "gla-4-1": [_run(0.0032, 0.2, 3.2)], "sdpa-2-0": [_run(0.0032, 1.0, 1.0, 300)],
        "sdpa-2-1": [_run(0.0032, 1.0, 1.0, 300)]}


def _folder(tmp_path, with_curves=True):
    folder = report_synth.write_train(tmp_path / "t", ROWS)
    if with_curves:
        with open(folder / TRAIN_CURVES, "w") as f:
            for cid, runs in RUNS.items():
                f.write(json.dumps({"config_id": cid, "runs": runs}) + "\n")
    return folder


def test_the_best_cell_below_0_9_is_drawn_with_each_seeds_winning_run(tmp_path):
    folder = _folder(tmp_path)
    tr = read_train(folder / "train.csv")
    runs = curves.winning_runs(tr, curves.below(tr), curves.read_curves(folder / TRAIN_CURVES))
    assert sorted(zip(runs["variant"], runs["size"], runs["seed"], runs["lr"])) == \
        [("gla", "H=2", 0, 0.0032), ("gla", "H=2", 1, 0.001)]
    fig = curves.curves_figure(runs, "mqar N=64")
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid()}
    assert set(lines) == {"gla H=2:0:acc", "gla H=2:0:loss", "gla H=2:1:acc",
                          "gla H=2:1:loss"}
    won = RUNS["gla-2-0"][1]
    assert list(lines["gla H=2:0:acc"].get_ydata()) == [a for _, a in won["history"]]
    assert list(lines["gla H=2:0:loss"].get_ydata()) == [v for _, v in won["held_out_loss"]]
    assert list(lines["gla H=2:1:acc"].get_xdata())[-1] == 1000


def test_the_report_shows_the_part_only_with_curves(tmp_path):
    folder = _folder(tmp_path)
    write_report(folder)
    md = (folder / "report.md").read_text()
    part = md.split("### Training curves below 0.9", 1)[1].split("\n## ", 1)[0]
    assert "gla H=2" in part and "sdpa" not in part and "cut by the race" not in part
    assert "1000: 0.500 / 2.50" in part  # the winning run's last evaluation and loss
    assert (folder / "plots" / "trained_curves_mqar_N_64_P_8_V_64_causal.png").exists()
    bare = _folder(tmp_path / "bare", with_curves=False)
    write_report(bare)
    assert "Training curves below 0.9" not in (bare / "report.md").read_text()
